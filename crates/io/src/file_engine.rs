//! A file or block device with many requests in flight.
//!
//! The preferred backend is one io_uring per open file, driven by a dedicated thread: callers
//! push operations onto a shared queue and ring an eventfd; the thread turns them into
//! submission entries (up to the queue depth in flight), waits for completions and answers
//! each caller through a oneshot channel. Where the kernel refuses io_uring (seccomp, old
//! kernels), the same operations run as blocking `pread`/`pwrite` calls on tokio's blocking
//! pool, so callers never see the difference.
//!
//! [`OpenOptions::inline`] drops the thread: callers submit their entries themselves and a
//! task on the opening runtime reaps completions when the ring's eventfd fires. An I/O then
//! wakes one thread (the caller's, through its epoll) instead of three, which on a small VM
//! is most of what a lone durable write costs beyond the disk. An operation that finds the
//! ring idle is submitted at once; one that finds others in flight is left for the reaper
//! task, which lets the tasks already woken queue theirs first, so a burst of reads costs
//! one `io_uring_enter` (and one doorbell of a virtio disk) instead of one each.
//!
//! Invariant: an operation (and so its buffer) stays in a slot table from the moment its
//! entry is pushed until its completion is reaped; the kernel never writes into memory we
//! freed. Dropping a ring waits for the operations still in flight.
#![allow(unsafe_code)]

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use io_uring::{IoUring, opcode, squeue, types};
use tokio::io::Interest;
use tokio::io::unix::AsyncFd;
use tokio::sync::oneshot;

use crate::DmaBuf;
use crate::device;

/// The deepest queue an engine accepts.
pub const QUEUE_DEPTH_MAX: u32 = 4096;

/// How to open a file.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Bypass the page cache with O_DIRECT (buffers and offsets must then be aligned to
    /// the device's logical block size).
    pub direct: bool,
    /// Open read-only.
    pub read_only: bool,
    /// Requests in flight at most (io_uring backend).
    pub queue_depth: u32,
    /// Use blocking `pread`/`pwrite` even where io_uring works (tests of the fallback).
    pub force_blocking: bool,
    /// Submit from the calling thread and reap completions on a task of the tokio runtime
    /// the file is opened in (no ring thread). Meant for a file used from one
    /// single-threaded runtime; outside a runtime the ring thread is used.
    pub inline: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            direct: true,
            read_only: false,
            queue_depth: 128,
            force_blocking: false,
            inline: false,
        }
    }
}

/// Why a file could not be opened.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OpenError {
    /// The filesystem does not support O_DIRECT (tmpfs, some FUSE filesystems).
    #[error(
        "{path}: the filesystem refuses O_DIRECT (ramfs does, and tmpfs before Linux 6.6); put the file on a disk-backed \
         filesystem or open it buffered (\"buffered\": true), which goes through the page cache"
    )]
    DirectRefused {
        /// The file.
        path: PathBuf,
    },
    /// Any other failure to open or inspect the file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The system error.
        source: io::Error,
    },
    /// A bad option.
    #[error("queue depth {queue_depth} is not in 1..={QUEUE_DEPTH_MAX}")]
    QueueDepth {
        /// The depth asked for.
        queue_depth: u32,
    },
}

/// What `allocate` does to a byte range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocateMode {
    /// Reads return zeroes; space stays allocated (`FALLOC_FL_ZERO_RANGE`).
    ZeroRange,
    /// Reads return zeroes; space is given back (`FALLOC_FL_PUNCH_HOLE`).
    PunchHole,
}

impl AllocateMode {
    fn flags(self) -> i32 {
        match self {
            AllocateMode::ZeroRange => libc::FALLOC_FL_ZERO_RANGE,
            AllocateMode::PunchHole => libc::FALLOC_FL_PUNCH_HOLE | libc::FALLOC_FL_KEEP_SIZE,
        }
    }
}

/// An open file or block device.
pub struct FileEngine {
    path: PathBuf,
    size_bytes: u64,
    backend: Backend,
    /// A second descriptor of the same open file, for callers that submit their own I/O.
    file: File,
    direct: bool,
}

enum Backend {
    Uring(UringHandle),
    Inline(InlineRing),
    Blocking(Arc<File>),
}

impl Backend {
    /// Runs one operation on a ring backend.
    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> io::Result<T> {
        match self {
            Backend::Uring(ring) => ring.call(make).await,
            Backend::Inline(ring) => ring.call(make).await,
            Backend::Blocking(_) => unreachable!("callers run blocking calls themselves"),
        }
    }
}

impl FileEngine {
    /// Opens `path` (which must exist).
    pub fn open(path: &Path, options: &OpenOptions) -> Result<Self, OpenError> {
        if options.queue_depth == 0 || options.queue_depth > QUEUE_DEPTH_MAX {
            return Err(OpenError::QueueDepth {
                queue_depth: options.queue_depth,
            });
        }
        let io_error = |source| OpenError::Io {
            path: path.to_path_buf(),
            source,
        };
        let mut open = std::fs::OpenOptions::new();
        open.read(true).write(!options.read_only);
        if options.direct {
            open.custom_flags(libc::O_DIRECT);
        }
        let file = match open.open(path) {
            Ok(file) => file,
            Err(error) if options.direct && error.raw_os_error() == Some(libc::EINVAL) => {
                return Err(OpenError::DirectRefused {
                    path: path.to_path_buf(),
                });
            }
            Err(error) => return Err(io_error(error)),
        };
        let size_bytes = device::size_bytes(&file).map_err(io_error)?;
        let duplicate = file.try_clone().map_err(io_error)?;
        let runtime = tokio::runtime::Handle::try_current().ok();
        let backend = if options.force_blocking {
            Backend::Blocking(Arc::new(file))
        } else if let Some(runtime) = runtime.filter(|_| options.inline) {
            match InlineRing::start(file, options.queue_depth, &runtime) {
                Ok(ring) => Backend::Inline(ring),
                Err((file, error)) => {
                    tracing::warn!(path = %path.display(), %error,
                        "io_uring refused; using blocking pread/pwrite");
                    Backend::Blocking(Arc::new(file))
                }
            }
        } else {
            match UringHandle::start(file, options.queue_depth, path) {
                Ok(handle) => Backend::Uring(handle),
                Err((Some(file), error)) => {
                    tracing::warn!(path = %path.display(), %error,
                        "io_uring refused; using blocking pread/pwrite");
                    Backend::Blocking(Arc::new(file))
                }
                Err((None, error)) => return Err(io_error(error)),
            }
        };
        Ok(Self {
            path: path.to_path_buf(),
            size_bytes,
            backend,
            file: duplicate,
            direct: options.direct,
        })
    }

    /// The open file, for a caller that submits its own reads and writes (with O_DIRECT,
    /// see [`FileEngine::is_direct`], their buffers must be aligned as the device asks).
    pub fn file(&self) -> &File {
        &self.file
    }

    /// Whether the file is open with O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// The path this engine was opened with.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The size of the file or device when it was opened.
    pub fn size_bytes(&self) -> u64 {
        self.size_bytes
    }

    /// Whether requests go through io_uring (else blocking calls).
    pub fn is_uring(&self) -> bool {
        !matches!(self.backend, Backend::Blocking(_))
    }

    /// Whether requests are submitted from the caller's thread ([`OpenOptions::inline`]).
    pub fn is_inline(&self) -> bool {
        matches!(self.backend, Backend::Inline(_))
    }

    /// Reads `buf.len()` bytes at `offset_bytes` into `buf` and gives it back.
    pub async fn read(&self, offset_bytes: u64, buf: DmaBuf) -> io::Result<DmaBuf> {
        match &self.backend {
            Backend::Blocking(file) => {
                let file = file.clone();
                blocking(move || {
                    let mut buf = buf;
                    file.read_exact_at(&mut buf, offset_bytes)?;
                    Ok(buf)
                })
                .await
            }
            ring => {
                ring.call(|reply| Op::Read {
                    offset_bytes,
                    buf,
                    reply,
                })
                .await
            }
        }
    }

    /// Writes `buf` at `offset_bytes`; with `fua` the data is durable when this returns.
    pub async fn write(&self, offset_bytes: u64, buf: DmaBuf, fua: bool) -> io::Result<DmaBuf> {
        match &self.backend {
            Backend::Blocking(file) => {
                let file = file.clone();
                blocking(move || {
                    file.write_all_at(&buf, offset_bytes)?;
                    if fua {
                        file.sync_data()?;
                    }
                    Ok(buf)
                })
                .await
            }
            ring => {
                let len = buf.len();
                let (mut moved, buf) = ring
                    .call(|reply| Op::Write {
                        offset_bytes,
                        buf,
                        fua,
                        reply,
                    })
                    .await?;
                // A short write: the filesystem (or a quota, or a size limit) ran out of
                // room part way. The rest is written again, which says why (ENOSPC,
                // EDQUOT, EFBIG) or goes on; a plain EIO would hide it from the host.
                let mut done = moved;
                while done < len {
                    if moved == 0 {
                        return Err(io::Error::new(
                            io::ErrorKind::WriteZero,
                            format!("short write: {done} of {len} bytes"),
                        ));
                    }
                    let rest = DmaBuf::from_slice(&buf[done..]);
                    (moved, _) = ring
                        .call(|reply| Op::Write {
                            offset_bytes: offset_bytes + done as u64,
                            buf: rest,
                            fua,
                            reply,
                        })
                        .await?;
                    done += moved;
                }
                Ok(buf)
            }
        }
    }

    /// Makes every completed write durable (`fdatasync`).
    pub async fn sync(&self) -> io::Result<()> {
        match &self.backend {
            Backend::Blocking(file) => {
                let file = file.clone();
                blocking(move || file.sync_data()).await
            }
            ring => ring.call(|reply| Op::Sync { reply }).await,
        }
    }

    /// Zeroes a byte range, keeping or releasing its space (`fallocate`).
    pub async fn allocate(
        &self,
        mode: AllocateMode,
        offset_bytes: u64,
        len_bytes: u64,
    ) -> io::Result<()> {
        match &self.backend {
            Backend::Blocking(file) => {
                let file = file.clone();
                blocking(move || fallocate(&file, mode, offset_bytes, len_bytes)).await
            }
            ring => {
                ring.call(|reply| Op::Allocate {
                    mode,
                    offset_bytes,
                    len_bytes,
                    reply,
                })
                .await
            }
        }
    }
}

async fn blocking<T: Send + 'static>(
    work: impl FnOnce() -> io::Result<T> + Send + 'static,
) -> io::Result<T> {
    tokio::task::spawn_blocking(work)
        .await
        .unwrap_or_else(|error| {
            Err(io::Error::other(format!(
                "blocking i/o task failed: {error}"
            )))
        })
}

fn fallocate(file: &File, mode: AllocateMode, offset_bytes: u64, len_bytes: u64) -> io::Result<()> {
    let offset =
        i64::try_from(offset_bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    let len = i64::try_from(len_bytes).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: fallocate only reads its integer arguments; the fd is open for the call.
    let rc = unsafe { libc::fallocate(file.as_raw_fd(), mode.flags(), offset, len) };
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(())
    }
}

type Reply<T> = oneshot::Sender<io::Result<T>>;

/// One request for the ring thread. It owns its buffer until the completion is reaped.
enum Op {
    Read {
        offset_bytes: u64,
        buf: DmaBuf,
        reply: Reply<DmaBuf>,
    },
    /// Answered with the bytes written, which may be fewer than asked.
    Write {
        offset_bytes: u64,
        buf: DmaBuf,
        fua: bool,
        reply: Reply<(usize, DmaBuf)>,
    },
    Sync {
        reply: Reply<()>,
    },
    Allocate {
        mode: AllocateMode,
        offset_bytes: u64,
        len_bytes: u64,
        reply: Reply<()>,
    },
}

impl Op {
    /// The submission entry; the buffer pointer stays valid while `self` lives.
    fn entry(&mut self, fd: types::Fd) -> squeue::Entry {
        match self {
            Op::Read {
                offset_bytes, buf, ..
            } => opcode::Read::new(fd, buf.as_mut_ptr(), entry_len(buf.len()))
                .offset(*offset_bytes)
                .build(),
            Op::Write {
                offset_bytes,
                buf,
                fua,
                ..
            } => {
                let flags = if *fua { libc::RWF_DSYNC } else { 0 };
                opcode::Write::new(fd, buf.as_ptr(), entry_len(buf.len()))
                    .offset(*offset_bytes)
                    .rw_flags(flags)
                    .build()
            }
            Op::Sync { .. } => opcode::Fsync::new(fd)
                .flags(types::FsyncFlags::DATASYNC)
                .build(),
            Op::Allocate {
                mode,
                offset_bytes,
                len_bytes,
                ..
            } => opcode::Fallocate::new(fd, *len_bytes)
                .offset(*offset_bytes)
                .mode(mode.flags())
                .build(),
        }
    }

    /// Answers the caller with the kernel's result `res` (bytes moved, or -errno).
    fn complete(self, res: i32) {
        let status = if res < 0 {
            Err(io::Error::from_raw_os_error(-res))
        } else {
            Ok(res as usize)
        };
        // A caller that went away no longer wants the answer; dropping it is correct.
        match self {
            Op::Read { buf, reply, .. } => {
                let _ = reply.send(status.and_then(|moved| full_transfer(moved, buf)));
            }
            Op::Write { buf, reply, .. } => {
                let _ = reply.send(status.map(|moved| (moved.min(buf.len()), buf)));
            }
            Op::Sync { reply } | Op::Allocate { reply, .. } => {
                let _ = reply.send(status.map(|_| ()));
            }
        }
    }

    fn fail(self, error: io::Error) {
        match self {
            Op::Read { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Op::Write { reply, .. } => {
                let _ = reply.send(Err(error));
            }
            Op::Sync { reply } | Op::Allocate { reply, .. } => {
                let _ = reply.send(Err(error));
            }
        }
    }
}

fn entry_len(len: usize) -> u32 {
    u32::try_from(len).expect("callers split requests below 4 GiB")
}

/// A short read is reported as an error rather than resubmitted: within bounds it only
/// happens when the file shrank under us, and the caller then sees it fail.
fn full_transfer(moved: usize, buf: DmaBuf) -> io::Result<DmaBuf> {
    if moved == buf.len() {
        Ok(buf)
    } else {
        Err(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!("short transfer: {moved} of {} bytes", buf.len()),
        ))
    }
}

/// The queue between callers and the ring thread.
struct Shared {
    pending: Mutex<Vec<Op>>,
    wake: File,
    closing: AtomicBool,
}

impl Shared {
    fn ring_bell(&self) {
        // The eventfd counter saturates far beyond any backlog; a failed write only means the
        // counter is already non-zero, so the thread is awake anyway.
        let _ = (&self.wake).write(&1u64.to_ne_bytes());
    }
}

struct UringHandle {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

const WAKE_TAG: u64 = u64::MAX;

impl UringHandle {
    /// Starts the ring thread. When io_uring itself is refused, the file comes back so the
    /// caller can fall back to blocking calls.
    fn start(file: File, queue_depth: u32, path: &Path) -> Result<Self, (Option<File>, io::Error)> {
        let ring = match IoUring::new(queue_depth + 1) {
            Ok(ring) => ring,
            Err(error) => return Err((Some(file), error)),
        };
        let wake = match eventfd() {
            Ok(fd) => File::from(fd),
            Err(error) => return Err((Some(file), error)),
        };
        let shared = Arc::new(Shared {
            pending: Mutex::new(Vec::new()),
            wake,
            closing: AtomicBool::new(false),
        });
        let thread_shared = shared.clone();
        let file_name = path
            .file_name()
            .map(|n| n.to_string_lossy())
            .unwrap_or_default();
        let name: String = format!("uring:{file_name}").chars().take(15).collect();
        std::thread::Builder::new()
            .name(name)
            .spawn(move || ring_loop(ring, file, &thread_shared, queue_depth as usize))
            .map(|thread| Self {
                shared,
                thread: Some(thread),
            })
            .map_err(|error| (None, error))
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> io::Result<T> {
        let (reply, answer) = oneshot::channel();
        self.shared
            .pending
            .lock()
            .expect("pending lock poisoned")
            .push(make(reply));
        self.shared.ring_bell();
        answer
            .await
            .unwrap_or_else(|_| Err(io::Error::other("io_uring thread stopped")))
    }
}

impl Drop for UringHandle {
    fn drop(&mut self) {
        self.shared.closing.store(true, Ordering::Release);
        self.shared.ring_bell();
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// A new non-blocking, close-on-exec eventfd (an io_uring's completion bell, or a bell
/// rung to wake a thread).
pub fn eventfd() -> io::Result<OwnedFd> {
    // SAFETY: eventfd takes two integers and returns a new descriptor or -1.
    let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: fd is a fresh descriptor that nothing else owns.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// An io_uring submitted to by its callers and reaped by a task ([`OpenOptions::inline`]).
struct InlineRing {
    state: Arc<Mutex<InlineState>>,
    /// Wakes the reaper to submit what callers queued.
    submit: Arc<tokio::sync::Notify>,
    reaper: tokio::task::JoinHandle<()>,
}

/// The slot table of an inline ring; `ring` is declared first so that dropping the state
/// closes it before the file, after [`Drop`] has waited for every operation in flight.
struct InlineState {
    ring: IoUring,
    fd: types::Fd,
    slots: Vec<Option<Op>>,
    free: Vec<usize>,
    backlog: VecDeque<Op>,
    _file: File,
}

impl InlineRing {
    fn start(
        file: File,
        queue_depth: u32,
        runtime: &tokio::runtime::Handle,
    ) -> Result<Self, (File, io::Error)> {
        let ring = match IoUring::new(queue_depth) {
            Ok(ring) => ring,
            Err(error) => return Err((file, error)),
        };
        let completions = match eventfd() {
            Ok(fd) => fd,
            Err(error) => return Err((file, error)),
        };
        if let Err(error) = ring.submitter().register_eventfd(completions.as_raw_fd()) {
            return Err((file, error));
        }
        let _context = runtime.enter();
        // SAFETY: the File owns the eventfd, which stays open (the same description) for
        // as long as the AsyncFd that owns the File.
        let registered =
            unsafe { AsyncFd::register_with_interest(File::from(completions), Interest::READABLE) };
        let completions = match registered {
            Ok(fd) => fd,
            Err(error) => return Err((file, error.into_parts().1)),
        };
        let depth = queue_depth as usize;
        let state = Arc::new(Mutex::new(InlineState {
            ring,
            fd: types::Fd(file.as_raw_fd()),
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            backlog: VecDeque::new(),
            _file: file,
        }));
        let submit = Arc::new(tokio::sync::Notify::new());
        let reaper = runtime.spawn(reap_inline(state.clone(), completions, submit.clone()));
        Ok(Self {
            state,
            submit,
            reaper,
        })
    }

    async fn call<T>(&self, make: impl FnOnce(Reply<T>) -> Op) -> io::Result<T> {
        let (reply, answer) = oneshot::channel();
        {
            let mut state = self.state.lock().expect("inline ring lock poisoned");
            state.backlog.push_back(make(reply));
            if state.in_flight() == 0 {
                state.fill_and_submit();
            } else {
                // A burst's notifications fold into one wake-up of the reaper.
                self.submit.notify_one();
            }
        }
        answer
            .await
            .unwrap_or_else(|_| Err(io::Error::other("io_uring closed")))
    }
}

impl Drop for InlineRing {
    fn drop(&mut self) {
        // The state (and so the buffers in flight) goes with its last owner, whose drop
        // waits for the kernel to finish with them.
        self.reaper.abort();
    }
}

impl InlineState {
    fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Moves queued operations into free slots and submits them, without waiting.
    fn fill_and_submit(&mut self) {
        while !self.backlog.is_empty() {
            let Some(slot) = self.free.pop() else { break };
            let Some(mut op) = self.backlog.pop_front() else {
                break;
            };
            let entry = op.entry(self.fd).user_data(slot as u64);
            // SAFETY: the op (owner of any buffer the entry points into) is stored in
            // slots[slot] right below and stays there until this entry's completion is reaped.
            if unsafe { self.ring.submission().push(&entry) }.is_err() {
                self.free.push(slot);
                self.backlog.push_front(op);
                break;
            }
            self.slots[slot] = Some(op);
        }
        // Nothing new to hand over: no system call (a reap calls this after every wake).
        if self.ring.submission().is_empty() {
            return;
        }
        loop {
            match self.ring.submit() {
                Ok(_) => return,
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => {}
                // The completion queue is full or the kernel is short of memory: what is
                // in the submission queue goes in at the next reap.
                Err(error)
                    if matches!(error.raw_os_error(), Some(libc::EBUSY | libc::EAGAIN))
                        && self.in_flight() > 0 =>
                {
                    return;
                }
                Err(error) => {
                    tracing::error!(%error, "io_uring submit failed");
                    return;
                }
            }
        }
    }

    /// Answers every completed operation.
    fn reap(&mut self) {
        let reaped: Vec<(u64, i32)> = self
            .ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (tag, res) in reaped {
            let slot = tag as usize;
            if let Some(op) = self.slots.get_mut(slot).and_then(Option::take) {
                self.free.push(slot);
                op.complete(res);
            }
        }
    }
}

impl Drop for InlineState {
    fn drop(&mut self) {
        while self.in_flight() > 0 {
            match self.ring.submit_and_wait(1) {
                Ok(_) => self.reap(),
                Err(error) if error.raw_os_error() == Some(libc::EINTR) => {}
                Err(error) => {
                    // The kernel may still write into these buffers: leak them.
                    tracing::error!(%error, "io_uring wait failed on close; buffers leaked");
                    for op in self.slots.drain(..).flatten() {
                        std::mem::forget(op);
                    }
                    break;
                }
            }
        }
        for op in self.backlog.drain(..) {
            op.fail(io::Error::other("io_uring closed"));
        }
    }
}

/// Reaps an inline ring's completions whenever its eventfd fires, and submits what callers
/// left to it.
async fn reap_inline(
    state: Arc<Mutex<InlineState>>,
    completions: AsyncFd<File>,
    submit: Arc<tokio::sync::Notify>,
) {
    let mut counter = [0u8; 8];
    loop {
        let readable = tokio::select! {
            readable = completions.readable() => readable,
            () = submit.notified() => {
                // The tasks woken with the caller queue their operations first.
                tokio::task::yield_now().await;
                state.lock().expect("inline ring lock poisoned").fill_and_submit();
                continue;
            }
        };
        let Ok(mut ready) = readable else {
            return;
        };
        match completions.get_ref().read(&mut counter) {
            // The counter is back at zero: a completion posted from here on fires again.
            Ok(_) => ready.clear_ready(),
            Err(error) if error.kind() == io::ErrorKind::WouldBlock => {
                ready.clear_ready();
                continue;
            }
            Err(error) => {
                tracing::error!(%error, "io_uring eventfd read failed");
                return;
            }
        }
        let mut state = state.lock().expect("inline ring lock poisoned");
        state.reap();
        state.fill_and_submit();
    }
}

fn ring_loop(mut ring: IoUring, file: File, shared: &Shared, depth: usize) {
    let fd = types::Fd(file.as_raw_fd());
    let wake_fd = types::Fd(shared.wake.as_raw_fd());
    let mut slots: Vec<Option<Op>> = (0..depth).map(|_| None).collect();
    let mut free: Vec<usize> = (0..depth).rev().collect();
    let mut backlog: VecDeque<Op> = VecDeque::new();
    let mut wake_armed = false;
    loop {
        if !wake_armed {
            let poll = opcode::PollAdd::new(wake_fd, libc::POLLIN as u32)
                .build()
                .user_data(WAKE_TAG);
            // SAFETY: a poll entry refers to no memory of ours.
            if unsafe { ring.submission().push(&poll) }.is_ok() {
                wake_armed = true;
            }
        }
        backlog.extend(
            shared
                .pending
                .lock()
                .expect("pending lock poisoned")
                .drain(..),
        );
        while !backlog.is_empty() {
            let Some(slot) = free.pop() else { break };
            let Some(mut op) = backlog.pop_front() else {
                break;
            };
            let entry = op.entry(fd).user_data(slot as u64);
            // SAFETY: the op (owner of any buffer the entry points into) is stored in
            // slots[slot] right below and stays there until this entry's completion is reaped.
            if unsafe { ring.submission().push(&entry) }.is_err() {
                free.push(slot);
                backlog.push_front(op);
                break;
            }
            slots[slot] = Some(op);
        }
        let in_flight = depth - free.len();
        if shared.closing.load(Ordering::Acquire) && in_flight == 0 && backlog.is_empty() {
            break;
        }
        match ring.submit_and_wait(1) {
            Ok(_) => {}
            Err(error) if error.raw_os_error() == Some(libc::EINTR) => continue,
            Err(error) if error.raw_os_error() == Some(libc::EBUSY) => {}
            Err(error) => {
                tracing::error!(%error, "io_uring submit failed; failing queued requests");
                for op in backlog.drain(..) {
                    op.fail(io::Error::new(error.kind(), error.to_string()));
                }
            }
        }
        let reaped: Vec<(u64, i32)> = ring
            .completion()
            .map(|cqe| (cqe.user_data(), cqe.result()))
            .collect();
        for (tag, res) in reaped {
            if tag == WAKE_TAG {
                wake_armed = false;
                let mut counter = [0u8; 8];
                let _ = (&shared.wake).read(&mut counter);
                continue;
            }
            let slot = tag as usize;
            if let Some(op) = slots.get_mut(slot).and_then(Option::take) {
                free.push(slot);
                op.complete(res);
            }
        }
    }
    // Closing with the wake poll still armed is fine: a poll holds no buffer of ours.
    drop(ring);
    drop(file);
}

#[cfg(test)]
mod tests {
    use super::*;

    fn temp_file(name: &str, len: u64) -> PathBuf {
        let dir = std::env::var_os("CARGO_TARGET_TMPDIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| PathBuf::from("/var/tmp"));
        let path = dir.join(format!("basalt-io-{name}-{}", std::process::id()));
        let file = File::create(&path).expect("create");
        file.set_len(len).expect("set_len");
        path
    }

    async fn round_trip(options: OpenOptions, name: &str) {
        let path = temp_file(name, 1 << 20);
        let engine = FileEngine::open(&path, &options).expect("open");
        assert_eq!(
            engine.is_uring(),
            !options.force_blocking,
            "the backend under test is the one asked for"
        );
        assert_eq!(engine.is_inline(), options.inline);
        assert_eq!(engine.size_bytes(), 1 << 20);
        let data = DmaBuf::from_slice(&[0xabu8; 8192]);
        engine.write(4096, data, false).await.expect("write");
        engine
            .write(3 * 4096, DmaBuf::from_slice(&[7u8; 4096]), true)
            .await
            .expect("fua write");
        engine.sync().await.expect("sync");
        let back = engine
            .read(0, DmaBuf::zeroed(4 * 4096))
            .await
            .expect("read");
        assert!(back[..4096].iter().all(|b| *b == 0));
        assert!(back[4096..3 * 4096].iter().all(|b| *b == 0xab));
        assert!(back[3 * 4096..].iter().all(|b| *b == 7));
        engine
            .allocate(AllocateMode::PunchHole, 4096, 4096)
            .await
            .expect("punch");
        engine
            .allocate(AllocateMode::ZeroRange, 3 * 4096, 4096)
            .await
            .expect("zero");
        let back = engine
            .read(0, DmaBuf::zeroed(4 * 4096))
            .await
            .expect("read");
        assert!(
            back[..2 * 4096].iter().all(|b| *b == 0),
            "punched range reads zero"
        );
        assert!(
            back[2 * 4096..3 * 4096].iter().all(|b| *b == 0xab),
            "neighbour kept"
        );
        assert!(
            back[3 * 4096..].iter().all(|b| *b == 0),
            "zeroed range reads zero"
        );
        let past_end = engine.read(1 << 20, DmaBuf::zeroed(4096)).await;
        assert!(past_end.is_err(), "a read past the end is a short transfer");
        drop(engine);
        std::fs::remove_file(path).expect("remove");
    }

    #[tokio::test]
    async fn uring_backend_round_trips() {
        round_trip(OpenOptions::default(), "uring").await;
    }

    #[tokio::test]
    async fn inline_backend_round_trips() {
        round_trip(
            OpenOptions {
                inline: true,
                ..OpenOptions::default()
            },
            "inline",
        )
        .await;
    }

    #[test]
    fn inline_outside_a_runtime_uses_the_ring_thread() {
        let path = temp_file("inline-no-runtime", 1 << 20);
        let options = OpenOptions {
            inline: true,
            ..OpenOptions::default()
        };
        let engine = FileEngine::open(&path, &options).expect("open");
        assert!(engine.is_uring() && !engine.is_inline());
        drop(engine);
        std::fs::remove_file(path).expect("remove");
    }

    #[tokio::test]
    async fn blocking_backend_round_trips() {
        round_trip(
            OpenOptions {
                force_blocking: true,
                ..OpenOptions::default()
            },
            "blocking",
        )
        .await;
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_requests_in_flight_complete() {
        many_in_flight(false, "depth").await;
    }

    /// Beyond the queue depth, the inline ring queues operations and submits them as slots
    /// free up, from its reaper.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn many_requests_in_flight_complete_inline() {
        many_in_flight(true, "depth-inline").await;
    }

    async fn many_in_flight(inline: bool, name: &str) {
        let path = temp_file(name, 4 << 20);
        let engine = Arc::new(
            FileEngine::open(
                &path,
                &OpenOptions {
                    queue_depth: 8,
                    inline,
                    ..OpenOptions::default()
                },
            )
            .expect("open"),
        );
        assert_eq!(engine.is_inline(), inline);
        let mut tasks = Vec::new();
        for block in 0..256u64 {
            let engine = engine.clone();
            tasks.push(tokio::spawn(async move {
                let buf = DmaBuf::from_slice(&[(block % 251) as u8; 4096]);
                engine.write(block * 4096, buf, false).await.expect("write");
                let back = engine
                    .read(block * 4096, DmaBuf::zeroed(4096))
                    .await
                    .expect("read");
                assert!(
                    back.iter().all(|b| *b == (block % 251) as u8),
                    "block {block}"
                );
            }));
        }
        for task in tasks {
            task.await.expect("task");
        }
        drop(engine);
        std::fs::remove_file(path).expect("remove");
    }

    /// procfs refuses O_DIRECT on every kernel (tmpfs accepts it since Linux 6.6, ramfs
    /// never does), so it stands in for any such filesystem.
    #[test]
    fn o_direct_refusal_names_the_file_and_the_remedy() {
        let path = Path::new("/proc/self/status");
        let options = OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        };
        let error = FileEngine::open(path, &options)
            .err()
            .expect("procfs refuses O_DIRECT");
        let message = error.to_string();
        assert!(
            matches!(error, OpenError::DirectRefused { .. }),
            "{message}"
        );
        assert!(
            message.contains("/proc/self/status") && message.contains("buffered"),
            "{message}"
        );
        let buffered = OpenOptions {
            direct: false,
            ..options
        };
        assert!(
            FileEngine::open(path, &buffered).is_ok(),
            "buffered open is the way in"
        );
    }
}
