//! Requests in flight, kept where a restarted target finds them (vhost-user's
//! `INFLIGHT_SHMFD`). The region is a shared memory file that the backend creates on the
//! frontend's `GET_INFLIGHT_FD`; the frontend (QEMU) keeps it across the backend's
//! restarts and hands it back with `SET_INFLIGHT_FD` on every connection. Each request the
//! backend takes from a vring is marked in it, and unmarked once it is on the used ring, so
//! that after a crash the next backend replays the requests the guest is still waiting
//! for, oldest first, and neither loses one nor completes one twice.
//!
//! Layout per queue (split virtqueues, as libvhost-user lays it out, so that either
//! backend can take over the other's region): a 16-byte header (features u64, version u16,
//! desc_num u16, last_batch_head u16, used_idx u16), then per descriptor head 16 bytes
//! (inflight u8, 5 bytes padding, next u16, counter u64); each queue's part rounded up to
//! 64 bytes.
//!
//! Putting a request on the used ring is bracketed: `last_batch_head` names it first, the
//! used element and index are written, then its mark is cleared and `used_idx` follows the
//! ring. A crash between the two leaves `used_idx` behind the ring's index, and recovery
//! clears that one request's mark. Both steps run under the vring's lock, so one request
//! at a time is between them.

use std::fs::File;
use std::io;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU16, AtomicU64, Ordering};

use vm_memory::mmap::MmapRegion;
use vm_memory::{Bytes, FileOffset, GuestAddress, GuestMemory, VolatileMemory};

use crate::request::Descriptors;

/// Bytes of a queue's header.
const HEADER_BYTES: u64 = 16;
/// Bytes per descriptor head's state.
const DESC_BYTES: u64 = 16;
/// Each queue's part is a multiple of this.
const QUEUE_ALIGN: u64 = 64;
/// The layout's version, in each queue's header.
const VERSION: u16 = 1;
/// Header fields (offsets in a queue's part).
const VERSION_AT: u64 = 8;
const DESC_NUM_AT: u64 = 10;
const LAST_BATCH_HEAD_AT: u64 = 12;
const USED_IDX_AT: u64 = 14;
/// Descriptor state fields (offsets in a head's 16 bytes).
const COUNTER_AT: u64 = 8;

/// Split virtqueue descriptor flags.
const DESC_F_NEXT: u16 = 1;
const DESC_F_WRITE: u16 = 2;
const DESC_F_INDIRECT: u16 = 4;
/// Bytes of a descriptor in a table.
const DESCRIPTOR_BYTES: u64 = 16;

/// The bytes of one queue's part for `queue_size` descriptors.
pub fn queue_bytes(queue_size: u16) -> u64 {
    (HEADER_BYTES + u64::from(queue_size) * DESC_BYTES).next_multiple_of(QUEUE_ALIGN)
}

/// A new region for `queues` queues of `queue_size` descriptors, in a shared memory file:
/// nothing in flight. The file and its size.
pub fn create(queues: u16, queue_size: u16, queue_size_max: usize) -> io::Result<(File, u64)> {
    check_shape(queues, queue_size, queue_size_max)?;
    let len = u64::from(queues) * queue_bytes(queue_size);
    let file = basalt_io::unix_fds::memory_file("basalt-vhost-inflight", len)?;
    for queue in 0..u64::from(queues) {
        let base = queue * queue_bytes(queue_size);
        let write_at = std::os::unix::fs::FileExt::write_all_at;
        write_at(&file, &VERSION.to_le_bytes(), base + VERSION_AT)?;
        write_at(&file, &queue_size.to_le_bytes(), base + DESC_NUM_AT)?;
    }
    Ok((file, len))
}

fn check_shape(queues: u16, queue_size: u16, queue_size_max: usize) -> io::Result<()> {
    if queues == 0 || queue_size == 0 || usize::from(queue_size) > queue_size_max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!(
                "an in-flight region for {queues} queues of {queue_size} descriptors \
                 (1 to {queue_size_max} descriptors)"
            ),
        ));
    }
    Ok(())
}

/// One queue's bookkeeping in this process.
#[derive(Default)]
struct QueueState {
    /// The next request's submission counter (its order for a replay).
    counter: AtomicU64,
    /// The queue has not been looked at since the region was handed over.
    recovery_pending: AtomicBool,
    /// Recovered requests not started yet, oldest first ([`InflightRegion::set_replays`]).
    replays: std::sync::Mutex<std::collections::VecDeque<u16>>,
    /// Whether `replays` may hold any (read without the lock on every pass of the vring).
    replaying: AtomicBool,
}

/// A region handed over with `SET_INFLIGHT_FD`, mapped.
pub struct InflightRegion {
    map: MmapRegion<()>,
    queue_size: u16,
    queues: Vec<QueueState>,
}

impl InflightRegion {
    /// Maps `size` bytes of `file` from `offset`, for `queues` queues of `queue_size`
    /// descriptors; every queue is to be recovered before it takes new requests.
    pub fn open(
        file: File,
        offset: u64,
        size: u64,
        queues: u16,
        queue_size: u16,
        queue_size_max: usize,
    ) -> io::Result<Self> {
        check_shape(queues, queue_size, queue_size_max)?;
        let needed = u64::from(queues) * queue_bytes(queue_size);
        if size < needed {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!("an in-flight region of {size} bytes; {needed} needed"),
            ));
        }
        // A map past the file's end, or a file that shrinks under the map, would fault
        // (SIGBUS) at the first access: the file must hold the region and keep its size.
        let file_bytes = file.metadata()?.len();
        if offset
            .checked_add(needed)
            .is_none_or(|end| end > file_bytes)
        {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "an in-flight region of {needed} bytes at {offset} in a {file_bytes}-byte file"
                ),
            ));
        }
        if !basalt_io::unix_fds::size_is_sealed(&file)? {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "an in-flight region in a file whose size is not sealed",
            ));
        }
        let map = MmapRegion::from_file(FileOffset::new(file, offset), needed as usize)
            .map_err(io::Error::other)?;
        // Each queue's header says what laid it out: this layout, for this queue size.
        for queue in 0..u64::from(queues) {
            let base = (queue * queue_bytes(queue_size)) as usize;
            let field = |at: u64| {
                map.get_atomic_ref::<AtomicU16>(base + at as usize)
                    .map(|value| value.load(Ordering::Acquire))
                    .map_err(io::Error::other)
            };
            let (version, desc_num) = (field(VERSION_AT)?, field(DESC_NUM_AT)?);
            if version != VERSION || desc_num != queue_size {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "in-flight region queue {queue}: version {version} for {desc_num} \
                         descriptors; version {VERSION} for {queue_size} expected"
                    ),
                ));
            }
        }
        let queues = (0..queues)
            .map(|_| QueueState {
                counter: AtomicU64::new(0),
                recovery_pending: AtomicBool::new(true),
                replays: Default::default(),
                replaying: AtomicBool::new(false),
            })
            .collect();
        Ok(Self {
            map,
            queue_size,
            queues,
        })
    }

    /// The state of descriptor head `head` of `queue`, if the region has them.
    fn desc_at(&self, queue: u16, head: u16) -> Option<usize> {
        (usize::from(queue) < self.queues.len() && head < self.queue_size).then(|| {
            (u64::from(queue) * queue_bytes(self.queue_size)
                + HEADER_BYTES
                + u64::from(head) * DESC_BYTES) as usize
        })
    }

    /// A header field of `queue`, if the region has it.
    fn header(&self, queue: u16, field: u64) -> Option<&AtomicU16> {
        (usize::from(queue) < self.queues.len())
            .then(|| (u64::from(queue) * queue_bytes(self.queue_size) + field) as usize)
            .and_then(|at| self.u16_at(at))
    }

    /// The queues the region has parts for.
    pub fn queue_count(&self) -> usize {
        self.queues.len()
    }

    /// The descriptors per queue.
    pub fn queue_size(&self) -> u16 {
        self.queue_size
    }

    fn flag(&self, at: usize) -> Option<&AtomicU8> {
        self.map.get_atomic_ref::<AtomicU8>(at).ok()
    }

    fn u16_at(&self, at: usize) -> Option<&AtomicU16> {
        self.map.get_atomic_ref::<AtomicU16>(at).ok()
    }

    fn u64_at(&self, at: usize) -> Option<&AtomicU64> {
        self.map.get_atomic_ref::<AtomicU64>(at).ok()
    }

    /// Marks request `head` of `queue` in flight, taken from the vring after those before.
    pub fn begin(&self, queue: u16, head: u16) {
        let Some(at) = self.desc_at(queue, head) else {
            return;
        };
        let counter = self.queues[usize::from(queue)]
            .counter
            .fetch_add(1, Ordering::Relaxed);
        if let Some(slot) = self.u64_at(at + COUNTER_AT as usize) {
            slot.store(counter, Ordering::Relaxed);
        }
        if let Some(flag) = self.flag(at) {
            flag.store(1, Ordering::Release);
        }
    }

    /// Puts request `head` of `queue` on the used ring with `put` (which returns the ring's
    /// next used index once the element is there, `None` if it could not be put), and
    /// unmarks it. The caller holds the vring's lock across the call.
    pub fn finish(&self, queue: u16, head: u16, put: impl FnOnce() -> Option<u16>) {
        let desc = self.desc_at(queue, head);
        if let Some(last) = self.header(queue, LAST_BATCH_HEAD_AT) {
            last.store(head, Ordering::Release);
        }
        let Some(used) = put() else {
            return;
        };
        if let Some(flag) = desc.and_then(|at| self.flag(at)) {
            flag.store(0, Ordering::Release);
        }
        if let Some(slot) = self.header(queue, USED_IDX_AT) {
            slot.store(used, Ordering::Release);
        }
    }

    /// Whether `queue` is still to be recovered.
    pub fn recovery_pending(&self, queue: u16) -> bool {
        self.queues
            .get(usize::from(queue))
            .is_some_and(|state| state.recovery_pending.load(Ordering::Acquire))
    }

    /// Whether `queue` is still to be recovered, and from now on not (true once per region
    /// and queue).
    pub fn take_recovery(&self, queue: u16) -> bool {
        self.queues
            .get(usize::from(queue))
            .is_some_and(|state| state.recovery_pending.swap(false, Ordering::AcqRel))
    }

    /// Keeps `heads` (from [`InflightRegion::recover`]) as `queue`'s requests to replay,
    /// handed out one by one by [`InflightRegion::next_replay`] as the backend has room.
    pub fn set_replays(&self, queue: u16, heads: Vec<u16>) {
        if let Some(state) = self.queues.get(usize::from(queue)) {
            let mut replays = state.replays.lock().unwrap_or_else(|p| p.into_inner());
            state.replaying.store(!heads.is_empty(), Ordering::Release);
            *replays = heads.into();
        }
    }

    /// Whether `queue` may have requests to replay not started yet (no lock taken).
    pub fn replaying(&self, queue: u16) -> bool {
        self.queues
            .get(usize::from(queue))
            .is_some_and(|state| state.replaying.load(Ordering::Acquire))
    }

    /// `queue`'s oldest request to replay not started yet.
    pub fn next_replay(&self, queue: u16) -> Option<u16> {
        let state = self.queues.get(usize::from(queue))?;
        if !state.replaying.load(Ordering::Acquire) {
            return None;
        }
        let mut replays = state.replays.lock().unwrap_or_else(|p| p.into_inner());
        let head = replays.pop_front();
        if replays.is_empty() {
            state.replaying.store(false, Ordering::Release);
        }
        head
    }

    /// Brings `queue`'s part up to the vring, whose used index in guest memory is `used`
    /// and whose size is `vring_size`, and returns the heads of the requests still in
    /// flight, oldest first: the requests to replay. A request that reached the used ring
    /// before the crash but was not unmarked is unmarked now.
    pub fn recover(&self, queue: u16, used: u16, vring_size: u16) -> Vec<u16> {
        let (Some(used_slot), Some(last)) = (
            self.header(queue, USED_IDX_AT),
            self.header(queue, LAST_BATCH_HEAD_AT),
        ) else {
            return Vec::new();
        };
        if used_slot.load(Ordering::Acquire) != used {
            let last = last.load(Ordering::Acquire);
            if let Some(flag) = self.desc_at(queue, last).and_then(|at| self.flag(at)) {
                flag.store(0, Ordering::Release);
            }
            used_slot.store(used, Ordering::Release);
        }
        let mut pending: Vec<(u64, u16)> = (0..self.queue_size.min(vring_size))
            .filter_map(|head| {
                let at = self.desc_at(queue, head)?;
                if self.flag(at)?.load(Ordering::Acquire) != 1 {
                    return None;
                }
                let counter = self.u64_at(at + COUNTER_AT as usize)?;
                Some((counter.load(Ordering::Acquire), head))
            })
            .collect();
        pending.sort_unstable();
        let next = pending
            .last()
            .map_or(0, |&(counter, _)| counter.saturating_add(1));
        self.queues[usize::from(queue)]
            .counter
            .store(next, Ordering::Relaxed);
        pending.into_iter().map(|(_, head)| head).collect()
    }
}

/// Why a descriptor chain could not be read.
#[derive(Debug, thiserror::Error)]
pub enum ChainError {
    /// A descriptor index past the table.
    #[error("descriptor {index} past a table of {size}")]
    OutOfRange {
        /// The index.
        index: u16,
        /// The table's size.
        size: u16,
    },
    /// The chain loops or is longer than its table.
    #[error("a descriptor chain longer than its table")]
    TooLong,
    /// An indirect table of a size that is not whole descriptors, or empty.
    #[error("an indirect table of {0} bytes")]
    BadIndirect(u32),
    /// An indirect descriptor inside an indirect table.
    #[error("an indirect descriptor inside an indirect table")]
    NestedIndirect,
    /// A descriptor outside guest memory.
    #[error("a descriptor outside guest memory")]
    Memory,
}

/// One descriptor: address, length, flags, next.
fn descriptor<M: GuestMemory>(
    memory: &M,
    table: GuestAddress,
    index: u16,
) -> Result<(u64, u32, u16, u16), ChainError> {
    let at = table
        .0
        .checked_add(u64::from(index) * DESCRIPTOR_BYTES)
        .ok_or(ChainError::Memory)?;
    let mut bytes = [0u8; DESCRIPTOR_BYTES as usize];
    memory
        .read_slice(&mut bytes, GuestAddress(at))
        .map_err(|_| ChainError::Memory)?;
    Ok((
        u64::from_le_bytes(bytes[0..8].try_into().expect("8 bytes")),
        u32::from_le_bytes(bytes[8..12].try_into().expect("4 bytes")),
        u16::from_le_bytes(bytes[12..14].try_into().expect("2 bytes")),
        u16::from_le_bytes(bytes[14..16].try_into().expect("2 bytes")),
    ))
}

/// The buffers of the descriptor chain whose head is `head` in the split virtqueue whose
/// descriptor table is at `table` with `size` entries, following an indirect table as
/// the device does when it takes a chain from the available ring.
pub fn chain<M: GuestMemory>(
    memory: &M,
    table: GuestAddress,
    size: u16,
    head: u16,
) -> Result<Descriptors, ChainError> {
    let mut buffers = Descriptors::new();
    let (mut table, mut size, mut index) = (table, size, head);
    let mut indirect = false;
    loop {
        if index >= size {
            return Err(ChainError::OutOfRange { index, size });
        }
        if buffers.len() >= usize::from(size) {
            return Err(ChainError::TooLong);
        }
        let (address, len, flags, next) = descriptor(memory, table, index)?;
        if flags & DESC_F_INDIRECT != 0 && indirect {
            return Err(ChainError::NestedIndirect);
        }
        if flags & DESC_F_INDIRECT != 0 {
            let entries = u64::from(len) / DESCRIPTOR_BYTES;
            if len == 0 || u64::from(len) % DESCRIPTOR_BYTES != 0 || entries > u64::from(u16::MAX) {
                return Err(ChainError::BadIndirect(len));
            }
            (table, size, index, indirect) = (GuestAddress(address), entries as u16, 0, true);
            continue;
        }
        buffers.push((GuestAddress(address), len, flags & DESC_F_WRITE != 0));
        if flags & DESC_F_NEXT == 0 {
            return Ok(buffers);
        }
        index = next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use vm_memory::GuestMemoryMmap;

    fn region(queues: u16, queue_size: u16) -> (InflightRegion, File) {
        let (file, len) = create(queues, queue_size, 1024).expect("create");
        let region = InflightRegion::open(
            file.try_clone().expect("clone"),
            0,
            len,
            queues,
            queue_size,
            1024,
        )
        .expect("open");
        (region, file)
    }

    #[test]
    fn the_layout_is_libvhost_users() {
        assert_eq!(queue_bytes(128), 16 * 128 + 64);
        assert_eq!(queue_bytes(1), 64);
        assert_eq!(queue_bytes(3), 64);
        assert_eq!(queue_bytes(5), 128);
        let (file, len) = create(2, 8, 1024).expect("create");
        assert_eq!(len, 2 * 192);
        let mut bytes = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut bytes, 0).expect("read");
        for queue in 0..2 {
            let base = queue * 192;
            assert_eq!(
                &bytes[base + 8..base + 12],
                &[1, 0, 8, 0],
                "version, desc_num"
            );
        }
        assert!(create(0, 8, 1024).is_err());
        assert!(create(1, 2048, 1024).is_err());
        let (file, len) = create(1, 8, 1024).expect("create");
        let dup = || file.try_clone().expect("dup");
        assert!(
            InflightRegion::open(dup(), 0, len - 1, 1, 8, 1024).is_err(),
            "too small"
        );
        assert!(InflightRegion::open(dup(), 0, len, 1, 8, 1024).is_ok());
        // Laid out for another queue size, or by another version: refused.
        assert!(InflightRegion::open(dup(), 0, len, 1, 7, 1024).is_err());
        std::os::unix::fs::FileExt::write_all_at(&file, &2u16.to_le_bytes(), VERSION_AT)
            .expect("write");
        assert!(
            InflightRegion::open(dup(), 0, len, 1, 8, 1024).is_err(),
            "version 2"
        );
    }

    /// A region past the end of its file, or in a file that may shrink under the map,
    /// is refused: the first access would fault (SIGBUS) and stop the process.
    #[test]
    fn regions_past_the_file_or_in_unsealed_files_are_refused() {
        let (file, len) = create(1, 8, 1024).expect("create");
        let dup = || file.try_clone().expect("dup");
        let past = InflightRegion::open(dup(), 64, len, 1, 8, 1024);
        assert!(past.is_err_and(|error| error.to_string().contains("-byte file")));
        let far = InflightRegion::open(dup(), u64::MAX - 8, len, 1, 8, 1024);
        assert!(far.is_err(), "an offset whose end overflows");
        // The same layout in a file that can shrink: a temporary file on disk.
        let path = std::env::temp_dir().join(format!("inflight-{}", std::process::id()));
        let unsealed = std::fs::File::options()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(&path)
            .expect("temporary file");
        let _ = std::fs::remove_file(&path);
        let mut bytes = vec![0u8; len as usize];
        std::os::unix::fs::FileExt::read_exact_at(&file, &mut bytes, 0).expect("read");
        std::os::unix::fs::FileExt::write_all_at(&unsealed, &bytes, 0).expect("write");
        let refused = InflightRegion::open(unsealed, 0, len, 1, 8, 1024);
        assert!(refused.is_err_and(|error| error.to_string().contains("not sealed")));
        assert!(InflightRegion::open(dup(), 0, len, 1, 8, 1024).is_ok());
    }

    #[test]
    fn a_region_tells_what_was_in_flight_at_a_crash() {
        let (region, file) = region(2, 8);
        assert!(region.take_recovery(1));
        assert!(!region.take_recovery(1), "once");
        // Queue 1: heads 5, 2, 7 taken in that order; 2 completed (used index 1).
        for head in [5, 2, 7] {
            region.begin(1, head);
        }
        region.finish(1, 2, || Some(1));
        // Then 7 reached the used ring (index 2) but the crash came before its unmark.
        region.finish(1, 7, || None);
        let last = queue_bytes(8) as usize + LAST_BATCH_HEAD_AT as usize;
        assert_eq!(
            region.u16_at(last).expect("field").load(Ordering::Relaxed),
            7
        );

        // A new process maps the same file: 5 is replayed, 7 is not (it is on the ring).
        let len = file.metadata().expect("stat").len();
        let next = InflightRegion::open(file, 0, len, 2, 8, 1024).expect("open");
        assert!(next.take_recovery(0) && next.take_recovery(1));
        assert_eq!(next.recover(0, 0, 8), Vec::<u16>::new());
        assert_eq!(next.recover(1, 2, 8), vec![5]);
        // Recovered: the same answer again, and a new request counts after the replayed.
        assert_eq!(next.recover(1, 2, 8), vec![5]);
        next.begin(1, 3);
        assert_eq!(next.recover(1, 2, 8), vec![5, 3]);
        // Heads past a smaller vring are not replayed.
        assert_eq!(next.recover(1, 2, 4), vec![3]);
    }

    #[test]
    fn replays_come_oldest_first() {
        let (region, _file) = region(1, 16);
        for head in [9, 4, 12, 1] {
            region.begin(0, head);
        }
        region.finish(0, 4, || Some(1));
        assert_eq!(region.recover(0, 1, 16), vec![9, 12, 1]);
    }

    #[test]
    fn chains_are_read_from_the_table_and_indirect_tables() {
        let memory =
            GuestMemoryMmap::<()>::from_ranges(&[(GuestAddress(0), 1 << 16)]).expect("memory");
        let put = |table: u64, index: u64, address: u64, len: u32, flags: u16, next: u16| {
            let at = GuestAddress(table + index * 16);
            let mut bytes = [0u8; 16];
            bytes[0..8].copy_from_slice(&address.to_le_bytes());
            bytes[8..12].copy_from_slice(&len.to_le_bytes());
            bytes[12..14].copy_from_slice(&flags.to_le_bytes());
            bytes[14..16].copy_from_slice(&next.to_le_bytes());
            memory.write_slice(&bytes, at).expect("write");
        };
        let table = GuestAddress(0x1000);
        // 3 -> 6 -> 1 (the last writable).
        put(0x1000, 3, 0x8000, 16, DESC_F_NEXT, 6);
        put(0x1000, 6, 0x9000, 512, DESC_F_NEXT, 1);
        put(0x1000, 1, 0xa000, 1, DESC_F_WRITE, 0);
        assert_eq!(
            chain(&memory, table, 8, 3).expect("chain"),
            vec![
                (GuestAddress(0x8000), 16, false),
                (GuestAddress(0x9000), 512, false),
                (GuestAddress(0xa000), 1, true),
            ]
        );
        // An indirect table of two at 0x2000.
        put(0x1000, 0, 0x2000, 32, DESC_F_INDIRECT, 0);
        put(0x2000, 0, 0x8000, 16, DESC_F_NEXT, 1);
        put(0x2000, 1, 0xa000, 1, DESC_F_WRITE, 0);
        assert_eq!(chain(&memory, table, 8, 0).expect("chain").len(), 2);
        // A loop, an index past the table, an indirect table of no whole descriptor.
        put(0x1000, 2, 0x8000, 16, DESC_F_NEXT, 2);
        assert!(matches!(
            chain(&memory, table, 8, 2),
            Err(ChainError::TooLong)
        ));
        put(0x1000, 4, 0x8000, 16, DESC_F_NEXT, 9);
        assert!(matches!(
            chain(&memory, table, 8, 4),
            Err(ChainError::OutOfRange { index: 9, size: 8 })
        ));
        put(0x1000, 5, 0x2000, 20, DESC_F_INDIRECT, 0);
        assert!(matches!(
            chain(&memory, table, 8, 5),
            Err(ChainError::BadIndirect(20))
        ));
        assert!(matches!(
            chain(&memory, GuestAddress(1 << 20), 8, 0),
            Err(ChainError::Memory)
        ));
        put(0x2000, 1, 0x3000, 16, DESC_F_INDIRECT, 0);
        assert!(matches!(
            chain(&memory, table, 8, 0),
            Err(ChainError::NestedIndirect)
        ));
    }
}
