//! Reads and writes that a vring thread hands to a file bdev's file itself, with the
//! guest's memory as the buffers, as qemu-storage-daemon does: no copy, and no thread but
//! the vring's own. Each vring thread of a session has an io_uring whose eventfd is one of
//! that thread's epoll events; on it the thread reaps completions and puts their requests
//! on the used ring. A request that does not fit (another type, guest buffers not aligned
//! as O_DIRECT asks, a full ring) takes the bdev path instead.
//!
//! Invariant: a request's guest buffers, its iovec array and the mapping of guest memory
//! stay in its slot from the moment its entry is pushed until its completion is reaped;
//! dropping a ring waits for every request in it.
#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use basalt_bdev::Bdev;
use io_uring::{IoUring, opcode, types};
use vm_memory::{Bytes, GuestAddress, GuestMemoryBackend, GuestMemoryMmap};

use crate::backend::{Completer, STOP_WAIT_MAX};
use crate::request::{Request, STATUS_IOERR, STATUS_OK, TYPE_IN, TYPE_OUT};

/// Requests in one ring at most.
const ENTRIES: u32 = 1024;
/// Buffers per readv or writev at most (Linux's `UIO_MAXIOV`).
const UIO_MAXIOV: usize = 1024;
/// Tries at handing entries to the kernel before leaving them for the next call.
const SUBMIT_TRIES: usize = 3;

/// One vring thread's io_uring on the bdev's file.
pub(crate) struct DirectRing {
    /// The bdev, which keeps the file open while requests are in the ring.
    bdev: Arc<dyn Bdev>,
    fd: RawFd,
    /// Every buffer's address and length must be a multiple of this (O_DIRECT).
    alignment: usize,
    state: Mutex<State>,
    /// Signalled by the kernel when completions are posted.
    completions: OwnedFd,
}

struct State {
    ring: IoUring,
    /// Requests in the ring, by the slot in their entry's user data.
    slots: Vec<Option<Pending>>,
    free: Vec<usize>,
}

/// A request in the ring.
struct Pending {
    completer: Completer,
    head: u16,
    status: GuestAddress,
    write: bool,
    /// Where the data goes in the file, and how much of it is left.
    offset: u64,
    left: u64,
    len: u64,
    /// The guest buffers still to move (advanced past what a short transfer moved).
    iovecs: Vec<libc::iovec>,
    /// The guest memory the buffers point into, mapped while the kernel uses them.
    memory: Arc<GuestMemoryMmap<()>>,
    started: Instant,
}

// SAFETY: the iovecs point into the mapping that `memory` keeps alive; nothing else about
// them is tied to a thread.
unsafe impl Send for Pending {}

impl Pending {
    fn entry(&self, fd: RawFd, slot: usize) -> io_uring::squeue::Entry {
        let (fd, iovecs, count) = (types::Fd(fd), self.iovecs.as_ptr(), self.iovecs.len());
        let count = u32::try_from(count).expect("at most UIO_MAXIOV buffers");
        let entry = if self.write {
            opcode::Writev::new(fd, iovecs, count)
                .offset(self.offset)
                .build()
        } else {
            opcode::Readv::new(fd, iovecs, count)
                .offset(self.offset)
                .build()
        };
        entry.user_data(slot as u64)
    }

    /// Skips the first `moved` bytes (fewer than are left) of the transfer.
    fn advance(&mut self, moved: u64) {
        self.offset += moved;
        self.left -= moved;
        skip(&mut self.iovecs, moved as usize);
    }
}

/// Drops the first `bytes` of the buffers `iovecs` describe (fewer than they hold).
fn skip(iovecs: &mut Vec<libc::iovec>, mut bytes: usize) {
    let whole = iovecs
        .iter()
        .take_while(|iovec| {
            let gone = iovec.iov_len <= bytes;
            if gone {
                bytes -= iovec.iov_len;
            }
            gone
        })
        .count();
    iovecs.drain(..whole);
    if bytes > 0 {
        let first = &mut iovecs[0];
        // SAFETY: `bytes` is less than this buffer's length, so the pointer stays in it.
        first.iov_base = unsafe { first.iov_base.cast::<u8>().add(bytes) }.cast();
        first.iov_len -= bytes;
    }
}

impl DirectRing {
    /// A ring on `bdev`'s file, or `None` when it has none to lend.
    pub(crate) fn new(bdev: Arc<dyn Bdev>) -> io::Result<Option<Self>> {
        let Some((fd, alignment)) = bdev.in_place().map(|in_place| {
            (
                in_place.file.as_raw_fd(),
                in_place.alignment.max(1) as usize,
            )
        }) else {
            return Ok(None);
        };
        let ring = IoUring::new(ENTRIES)?;
        let completions = basalt_io::file_engine::eventfd()?;
        ring.submitter().register_eventfd(completions.as_raw_fd())?;
        Ok(Some(Self {
            bdev,
            fd,
            alignment,
            state: Mutex::new(State {
                ring,
                slots: Vec::new(),
                free: Vec::new(),
            }),
            completions,
        }))
    }

    /// The descriptor that becomes readable when requests complete, to watch
    /// edge-triggered (it is never read).
    pub(crate) fn completions_fd(&self) -> RawFd {
        self.completions.as_raw_fd()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts a read or write of guest memory in the ring (submitted by [`DirectRing::submit`]).
    /// Gives the completer back when the request is not one for this path; then nothing
    /// was done and it goes the bdev's way.
    pub(crate) fn start(
        &self,
        completer: Completer,
        head: u16,
        request: &Request,
        memory: Arc<GuestMemoryMmap<()>>,
    ) -> Result<(), Completer> {
        let write = match request.kind {
            TYPE_IN => false,
            TYPE_OUT => true,
            _ => return Err(completer),
        };
        let runs = if write {
            &request.readable
        } else {
            &request.writable
        };
        let len: u64 = runs.iter().map(|run| u64::from(run.len)).sum();
        let info = self.bdev.info();
        let in_range = request
            .sector
            .checked_mul(crate::request::SECTOR_SIZE)
            .and_then(|offset| info.data_extent(offset, len).ok());
        let Some(extent) = in_range.filter(|_| len <= basalt_bdev::IO_BYTES_MAX) else {
            // The bdev path answers with the error.
            return Err(completer);
        };
        let alignment = self.alignment;
        let mut iovecs = Vec::with_capacity(runs.len());
        for run in runs {
            for slice in GuestMemoryBackend::get_slices(&*memory, run.address, run.len as usize) {
                let Ok(slice) = slice else {
                    return Err(completer);
                };
                let base = slice.ptr_guard_mut().as_ptr();
                if !(base as usize).is_multiple_of(alignment)
                    || !slice.len().is_multiple_of(alignment)
                {
                    return Err(completer);
                }
                iovecs.push(libc::iovec {
                    iov_base: base.cast(),
                    iov_len: slice.len(),
                });
            }
        }
        // readv and writev take at most UIO_MAXIOV buffers; the bdev path takes any number.
        if iovecs.len() > UIO_MAXIOV {
            return Err(completer);
        }
        let mut state = self.lock();
        let slot = match state.free.pop() {
            Some(slot) => slot,
            None if state.slots.len() < ENTRIES as usize => {
                state.slots.push(None);
                state.slots.len() - 1
            }
            None => return Err(completer),
        };
        let pending = Pending {
            completer,
            head,
            status: request.status,
            write,
            offset: extent.offset_bytes(),
            left: len,
            len,
            iovecs,
            memory,
            started: Instant::now(),
        };
        let entry = pending.entry(self.fd, slot);
        state.slots[slot] = Some(pending);
        // The submission queue holds at most one entry per slot in use (a slot is freed only
        // once its entry was submitted and completed), and a slot was free: there is room.
        // SAFETY: the entry's buffers and iovec array live in the slot until it completes.
        if unsafe { state.ring.submission().push(&entry) }.is_err() {
            let pending = state.slots[slot].take().expect("just put");
            state.free.push(slot);
            return Err(pending.completer);
        }
        Ok(())
    }

    /// Hands the entries put in the ring since the last call to the kernel.
    pub(crate) fn submit(&self) {
        let mut state = self.lock();
        for _ in 0..SUBMIT_TRIES {
            if state.ring.submission().is_empty() {
                return;
            }
            if let Err(error) = state.ring.submit() {
                // Left in the queue: tried again now, and by the next call.
                tracing::warn!(%error, "io_uring submit failed");
            }
        }
    }

    /// Ends the requests whose transfers completed: status byte, used ring, the guest
    /// signalled once per vring. A short transfer goes on with the rest.
    pub(crate) fn reap(&self) {
        // The eventfd is watched edge-triggered: it is never read, each completion posted
        // is a new edge, and one posted while this runs brings the thread back here.
        let mut ended = Vec::new();
        {
            let mut state = self.lock();
            let results: Vec<(usize, i32)> = state
                .ring
                .completion()
                .map(|cqe| (cqe.user_data() as usize, cqe.result()))
                .collect();
            for (slot, result) in results {
                let Some(mut pending) = state.slots.get_mut(slot).and_then(Option::take) else {
                    continue;
                };
                let moved = u64::try_from(result).unwrap_or(0);
                if result > 0 && moved < pending.left {
                    pending.advance(moved);
                    let entry = pending.entry(self.fd, slot);
                    state.slots[slot] = Some(pending);
                    // SAFETY: as in `start`; there is room, this request's entry left it.
                    if unsafe { state.ring.submission().push(&entry) }.is_ok() {
                        continue;
                    }
                    pending = state.slots[slot].take().expect("just put");
                    ended.push((pending, false));
                } else {
                    ended.push((pending, result > 0));
                }
                state.free.push(slot);
            }
        }
        self.submit();
        let mut vrings: Vec<Completer> = Vec::new();
        let mut released = Vec::with_capacity(ended.len());
        for (pending, ok) in ended {
            self.bdev
                .count_in_place(pending.write, pending.len, pending.started.elapsed(), ok);
            let status = if ok { STATUS_OK } else { STATUS_IOERR };
            let used_len = match pending.memory.write_obj(status, pending.status) {
                Ok(()) if ok && !pending.write => pending.len as u32 + 1,
                Ok(()) => 1,
                Err(_) => 0,
            };
            pending.completer.finish(pending.head, used_len);
            if !vrings.iter().any(|c| c.same_vring(&pending.completer)) {
                vrings.push(pending.completer.clone());
            }
            released.push(pending.completer);
        }
        for completer in vrings {
            completer.signal();
        }
        for completer in released {
            completer.release();
        }
    }

    fn in_ring(&self) -> usize {
        let state = self.lock();
        state.slots.iter().filter(|slot| slot.is_some()).count()
    }
}

impl Drop for DirectRing {
    fn drop(&mut self) {
        // The kernel may still write into guest memory that requests in the ring hold:
        // wait for every one of them, for as long as a vring stop waits.
        let start = Instant::now();
        while self.in_ring() > 0 {
            if start.elapsed() > STOP_WAIT_MAX {
                self.abandon();
                return;
            }
            let timeout = types::Timespec::new().nsec(10_000_000);
            let wait = types::SubmitArgs::new().timespec(&timeout);
            let waited = self.lock().ring.submitter().submit_with_args(1, &wait);
            match waited {
                Err(error) if !matches!(error.raw_os_error(), Some(libc::EINTR | libc::ETIME)) => {
                    tracing::error!(%error, "waiting for vhost requests in io_uring");
                    self.abandon();
                    return;
                }
                _ => self.reap(),
            }
        }
    }
}

impl DirectRing {
    /// Gives up on the requests still in the ring: they are counted out of their vrings
    /// (the guest never sees them end), and the guest memory they point into is leaked, so
    /// that whatever the kernel still does with them lands in memory that stays mapped.
    fn abandon(&self) {
        let mut state = self.lock();
        let slots = std::mem::take(&mut state.slots);
        let abandoned = slots.iter().flatten().count();
        tracing::error!(
            abandoned,
            "vhost requests still in io_uring after {STOP_WAIT_MAX:?}; their memory is kept"
        );
        for pending in slots.iter().flatten() {
            pending.completer.release();
        }
        std::mem::forget(slots);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_short_transfer_goes_on_where_it_stopped() {
        let mut memory = [0u8; 96];
        let base = memory.as_mut_ptr();
        let iovec = |at: usize, len: usize| libc::iovec {
            // SAFETY: inside `memory`.
            iov_base: unsafe { base.add(at) }.cast(),
            iov_len: len,
        };
        let spans = |iovecs: &[libc::iovec]| -> Vec<(usize, usize)> {
            iovecs
                .iter()
                .map(|v| (v.iov_base as usize - base as usize, v.iov_len))
                .collect()
        };
        let mut iovecs = vec![iovec(0, 16), iovec(32, 32), iovec(80, 16)];
        skip(&mut iovecs, 8);
        assert_eq!(spans(&iovecs), [(8, 8), (32, 32), (80, 16)]);
        skip(&mut iovecs, 8);
        assert_eq!(spans(&iovecs), [(32, 32), (80, 16)], "a whole buffer");
        skip(&mut iovecs, 40);
        assert_eq!(spans(&iovecs), [(88, 8)], "across a boundary");
    }
}
