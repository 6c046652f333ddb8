//! The block device interface that every frontend uses.
//!
//! Requests are checked once, when a frontend turns its protocol's offset and length into
//! an [`Extent`] with [`BdevInfo::extent`]; a kind's implementation can then trust them.

use std::future::Future;
use std::io;
use std::pin::Pin;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use basalt_io::DmaBuf;

/// The largest read or write a bdev accepts in one request. Write zeroes and discard are
/// not limited: they carry no data.
pub const IO_BYTES_MAX: u64 = 128 << 20;

/// Block sizes a bdev may have.
pub const BLOCK_SIZE_MIN: u32 = 512;
/// The largest block size a bdev may have.
pub const BLOCK_SIZE_MAX: u32 = 65536;

/// A request in flight. It borrows the bdev; callers hold an `Arc<dyn Bdev>`.
pub type BdevFuture<'a, T> = Pin<Box<dyn Future<Output = Result<T, BdevError>> + Send + 'a>>;

/// Why a bdev request failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BdevError {
    /// The range reaches past the last block.
    #[error("bdev {bdev}: range {offset_bytes}+{len_bytes} is past the end ({size_bytes} bytes)")]
    OutOfRange {
        /// The bdev.
        bdev: String,
        /// Start of the range.
        offset_bytes: u64,
        /// Length of the range.
        len_bytes: u64,
        /// Size of the bdev.
        size_bytes: u64,
    },
    /// Offset or length is not a multiple of the block size.
    #[error(
        "bdev {bdev}: range {offset_bytes}+{len_bytes} is not aligned to its {block_size}-byte blocks"
    )]
    Misaligned {
        /// The bdev.
        bdev: String,
        /// Start of the range.
        offset_bytes: u64,
        /// Length of the range.
        len_bytes: u64,
        /// Block size of the bdev.
        block_size: u32,
    },
    /// The range is empty.
    #[error("bdev {bdev}: zero-length request at {offset_bytes}")]
    Empty {
        /// The bdev.
        bdev: String,
        /// Start of the range.
        offset_bytes: u64,
    },
    /// A read or write larger than [`IO_BYTES_MAX`].
    #[error("bdev {bdev}: {len_bytes}-byte request is larger than the {IO_BYTES_MAX}-byte maximum")]
    TooLarge {
        /// The bdev.
        bdev: String,
        /// Length asked for.
        len_bytes: u64,
    },
    /// The device or file failed.
    #[error("bdev {bdev}: {source}")]
    Io {
        /// The bdev.
        bdev: String,
        /// The system error.
        source: io::Error,
    },
}

impl BdevError {
    /// Whether what backs the bdev did not answer in time (an image's cluster without a
    /// leader for its PG past the client's deadline): the bdev is not ready rather than
    /// broken, and a retry later may succeed.
    pub fn is_timeout(&self) -> bool {
        matches!(self, BdevError::Io { source, .. } if source.kind() == io::ErrorKind::TimedOut)
    }

    /// The errno a frontend should report: `EINVAL` for bad requests, `ENOSPC` when the
    /// backing store is full (or a file would grow past its limit), `EPERM` when it refuses
    /// writes, `EIO` for other failures.
    pub fn errno(&self) -> i32 {
        match self {
            BdevError::OutOfRange { .. }
            | BdevError::Misaligned { .. }
            | BdevError::Empty { .. }
            | BdevError::TooLarge { .. } => libc_errno::EINVAL,
            BdevError::Io { source, .. } => match source.raw_os_error() {
                Some(libc_errno::ENOSPC | libc_errno::EDQUOT | libc_errno::EFBIG) => {
                    libc_errno::ENOSPC
                }
                Some(libc_errno::EOPNOTSUPP) => libc_errno::EOPNOTSUPP,
                Some(libc_errno::EROFS | libc_errno::EPERM) => libc_errno::EPERM,
                _ => libc_errno::EIO,
            },
        }
    }
}

/// The Linux errno values this crate reports (stable ABI numbers).
pub mod libc_errno {
    /// Operation not permitted.
    pub const EPERM: i32 = 1;
    /// Input/output error.
    pub const EIO: i32 = 5;
    /// File too large.
    pub const EFBIG: i32 = 27;
    /// Read-only file system.
    pub const EROFS: i32 = 30;
    /// Invalid argument.
    pub const EINVAL: i32 = 22;
    /// No space left on device.
    pub const ENOSPC: i32 = 28;
    /// Operation not supported.
    pub const EOPNOTSUPP: i32 = 95;
    /// Disk quota exceeded.
    pub const EDQUOT: i32 = 122;
}

/// What a bdev is: fixed when it is created, but for the block count of a bdev that
/// [`Bdev::rescan`] grew.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BdevInfo {
    /// Unique name in the target.
    pub name: String,
    /// UUID, lower-case hyphenated.
    pub uuid: String,
    /// What kind of device, as SPDK names it (`Malloc disk`, `URING bdev`).
    pub product_name: &'static str,
    /// Bytes per block.
    pub block_size: u32,
    /// Number of blocks.
    pub block_count: u64,
    /// Requests should not cross multiples of this many blocks (0: no boundary).
    pub optimal_io_boundary_blocks: u32,
}

impl BdevInfo {
    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.block_count * u64::from(self.block_size)
    }

    /// Checks a read or write range: aligned, non-empty, in range, at most [`IO_BYTES_MAX`].
    pub fn data_extent(&self, offset_bytes: u64, len_bytes: u64) -> Result<Extent, BdevError> {
        if len_bytes > IO_BYTES_MAX {
            return Err(BdevError::TooLarge {
                bdev: self.name.clone(),
                len_bytes,
            });
        }
        self.extent(offset_bytes, len_bytes)
    }

    /// Checks a range for write zeroes or discard: aligned, non-empty, in range.
    pub fn extent(&self, offset_bytes: u64, len_bytes: u64) -> Result<Extent, BdevError> {
        let block_size = u64::from(self.block_size);
        if len_bytes == 0 {
            return Err(BdevError::Empty {
                bdev: self.name.clone(),
                offset_bytes,
            });
        }
        if !offset_bytes.is_multiple_of(block_size) || !len_bytes.is_multiple_of(block_size) {
            return Err(BdevError::Misaligned {
                bdev: self.name.clone(),
                offset_bytes,
                len_bytes,
                block_size: self.block_size,
            });
        }
        match offset_bytes.checked_add(len_bytes) {
            Some(end) if end <= self.size_bytes() => Ok(Extent {
                offset_bytes,
                len_bytes,
            }),
            _ => Err(BdevError::OutOfRange {
                bdev: self.name.clone(),
                offset_bytes,
                len_bytes,
                size_bytes: self.size_bytes(),
            }),
        }
    }

    /// An I/O error of this bdev.
    pub fn io_error(&self, source: io::Error) -> BdevError {
        BdevError::Io {
            bdev: self.name.clone(),
            source,
        }
    }
}

/// A byte range of a bdev that [`BdevInfo::extent`] checked: block-aligned, non-empty,
/// within the device. Only that function makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Extent {
    offset_bytes: u64,
    len_bytes: u64,
}

impl Extent {
    /// First byte.
    pub fn offset_bytes(&self) -> u64 {
        self.offset_bytes
    }

    /// Length in bytes (non-zero).
    pub fn len_bytes(&self) -> u64 {
        self.len_bytes
    }

    /// One past the last byte.
    pub fn end_bytes(&self) -> u64 {
        self.offset_bytes + self.len_bytes
    }
}

/// Counters of one bdev since it was created, as `bdev_get_iostat` reports them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct IoStatsSnapshot {
    /// Bytes read.
    pub bytes_read: u64,
    /// Read requests completed.
    pub num_read_ops: u64,
    /// Bytes written (write zeroes included).
    pub bytes_written: u64,
    /// Write requests completed.
    pub num_write_ops: u64,
    /// Bytes discarded.
    pub bytes_unmapped: u64,
    /// Discard requests completed.
    pub num_unmap_ops: u64,
    /// Flush requests completed.
    pub num_flush_ops: u64,
    /// Requests that failed.
    pub num_errors: u64,
    /// Total read latency in nanoseconds.
    pub read_latency_ns: u64,
    /// Total write latency in nanoseconds.
    pub write_latency_ns: u64,
    /// Total discard latency in nanoseconds.
    pub unmap_latency_ns: u64,
    /// Reads by latency: bucket `i` counts those that took more than bucket `i - 1`'s
    /// bound and at most [`latency_bucket_bound_us`]`(i)`; the slower are in no bucket.
    pub read_latency_buckets: [u64; LATENCY_BUCKETS],
    /// Writes by latency, as the reads.
    pub write_latency_buckets: [u64; LATENCY_BUCKETS],
}

/// Latency buckets counted per bdev: bounds from 8 µs to about 8.4 s, each twice the last.
pub const LATENCY_BUCKETS: usize = 21;

/// The upper bound of latency bucket `index`, in microseconds.
pub const fn latency_bucket_bound_us(index: usize) -> u64 {
    8 << index
}

/// The latency bucket a request that took `elapsed_ns` counts in; `None` past the last.
pub fn latency_bucket(elapsed_ns: u64) -> Option<usize> {
    let us = elapsed_ns.div_ceil(1000);
    // The smallest k with us <= 8 << k.
    let index = match us {
        0..=8 => 0,
        _ => (u64::BITS - ((us - 1) >> 3).leading_zeros()) as usize,
    };
    (index < LATENCY_BUCKETS).then_some(index)
}

/// The file under a bdev, to read and write in place ([`Bdev::in_place`]).
#[derive(Debug, Clone, Copy)]
pub struct InPlace<'a> {
    /// The open file; offsets are the bdev's.
    pub file: &'a std::fs::File,
    /// Every buffer's address and length must be a multiple of this (O_DIRECT).
    pub alignment: u32,
}

/// A block device. Every request's range was checked by [`BdevInfo::extent`].
pub trait Bdev: Send + Sync {
    /// What the device is.
    fn info(&self) -> &BdevInfo;

    /// Reads the extent.
    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf>;

    /// Writes `data` (exactly `extent.len_bytes()` long); with `fua`, durable on return.
    fn write(&self, extent: Extent, data: DmaBuf, fua: bool) -> BdevFuture<'_, ()>;

    /// Makes every completed write durable.
    fn flush(&self) -> BdevFuture<'_, ()>;

    /// Whether a completed write, write zeroes or discard may sit in a volatile cache (the
    /// page cache, a disk's write cache) until [`Bdev::flush`]: a file's. A frontend that
    /// tells its host there is no such cache writes with `fua` and flushes after zeroing.
    /// Malloc bdevs keep nothing across a restart, and an image's writes are durable on a
    /// majority of its replicas when they complete: `false`. (No default: a wrapper that
    /// forgot to forward it would lose the FUA.)
    fn volatile_cache(&self) -> bool;

    /// Makes the extent read as zeroes; `deallocate` lets the device free its space.
    fn write_zeroes(&self, extent: Extent, deallocate: bool) -> BdevFuture<'_, ()>;

    /// Frees the extent; it reads as zeroes afterwards on every Basalt kind.
    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()>;

    /// Counters, where the bdev keeps them (the registry's decorator does).
    fn io_stats(&self) -> Option<IoStatsSnapshot> {
        None
    }

    /// The file under the bdev, for a frontend that moves data between it and memory of
    /// its own itself (vhost's vring threads submit guest memory to io_uring); `None`:
    /// only through the requests above. Such I/O is counted with [`Bdev::count_in_place`].
    fn in_place(&self) -> Option<InPlace<'_>> {
        None
    }

    /// Counts a read or write done on [`Bdev::in_place`]'s file (where the bdev keeps
    /// counters: the registry's decorator does).
    fn count_in_place(&self, _write: bool, _len_bytes: u64, _elapsed: Duration, _ok: bool) {}

    /// The blocks one discard or write zeroes should cover at most, for frontends to tell
    /// their hosts, where a large one would take long: a host gives up on a request after
    /// its I/O timeout (30 s for Linux NVMe) and resets the controller. `None`: any size
    /// (a file's or memory's are quick).
    fn unmap_blocks_max(&self) -> Option<u64> {
        None
    }

    /// Takes on the size of what backs the bdev now (a file or block device that grew, an
    /// image resized) and returns the block count. Bdevs whose size cannot change refuse
    /// (`EOPNOTSUPP`).
    fn rescan(&self) -> Result<u64, BdevError> {
        Err(self
            .info()
            .io_error(io::Error::from_raw_os_error(libc_errno::EOPNOTSUPP)))
    }
}

/// Infos per chunk of [`ResizableInfo`], and chunks at most.
const INFOS_PER_CHUNK: usize = 64;
/// How many times a bdev can change size (a chunk of infos is allocated as needed).
const RESIZES_MAX: usize = INFOS_PER_CHUNK * INFOS_PER_CHUNK - 1;

/// A chunk of [`ResizableInfo`]'s infos.
type InfoChunk = Box<[OnceLock<BdevInfo>]>;

/// Whether a bdev may take on a smaller size ([`ResizableInfo::resize`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Shrink {
    Refused,
    Allowed,
}

/// The info of a bdev whose size can change: the info at creation and after each change,
/// each set once, so that a reference [`Bdev::info`] handed out stays valid while the bdev
/// lives; an index points at the latest. No lock on the I/O path, nothing leaked; chunks
/// of infos are made as the changes need them.
pub(crate) struct ResizableInfo {
    chunks: Box<[OnceLock<InfoChunk>]>,
    current: AtomicUsize,
    /// Size changes, one at a time.
    resizing: Mutex<()>,
}

impl ResizableInfo {
    pub(crate) fn new(info: BdevInfo) -> Self {
        let chunks = (0..INFOS_PER_CHUNK).map(|_| OnceLock::new()).collect();
        let resizable = Self {
            chunks,
            current: AtomicUsize::new(0),
            resizing: Mutex::new(()),
        };
        resizable.cell(0).set(info).expect("a fresh cell");
        resizable
    }

    /// Info `index`'s cell (its chunk made if it was not).
    fn cell(&self, index: usize) -> &OnceLock<BdevInfo> {
        let chunk = self.chunks[index / INFOS_PER_CHUNK]
            .get_or_init(|| (0..INFOS_PER_CHUNK).map(|_| OnceLock::new()).collect());
        &chunk[index % INFOS_PER_CHUNK]
    }

    /// The latest info.
    pub(crate) fn get(&self) -> &BdevInfo {
        self.cell(self.current.load(Ordering::Acquire))
            .get()
            .expect("the current info is set")
    }

    /// Takes on the block count that `measure` finds (it runs under the resize lock) and
    /// returns it. A smaller one is refused unless `shrink` allows it: blocks a guest may
    /// hold data in would vanish under it (an image's shrink was asked for in so many words
    /// and its data cut off is discarded; a file that shrank is an accident). `what` names
    /// what backs the bdev, for the errors.
    pub(crate) fn resize(
        &self,
        what: &str,
        shrink: Shrink,
        measure: impl FnOnce(&BdevInfo) -> Result<u64, BdevError>,
    ) -> Result<u64, BdevError> {
        let _one_at_a_time = self.resizing.lock().unwrap_or_else(|p| p.into_inner());
        let current = self.get();
        let block_count = measure(current)?;
        if block_count < current.block_count && shrink == Shrink::Refused {
            return Err(current.io_error(io::Error::new(
                io::ErrorKind::InvalidInput,
                format!(
                    "{what} shrank to {block_count} blocks from {}; a bdev only grows",
                    current.block_count
                ),
            )));
        }
        if block_count != current.block_count {
            let next = self.current.load(Ordering::Acquire) + 1;
            let resized = BdevInfo {
                block_count,
                ..current.clone()
            };
            if next > RESIZES_MAX || self.cell(next).set(resized).is_err() {
                return Err(current.io_error(io::Error::other(format!(
                    "it has changed size {RESIZES_MAX} times, the most a bdev can; delete it \
                     and create it again"
                ))));
            }
            self.current.store(next, Ordering::Release);
        }
        Ok(block_count)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn errors_of_the_os_map_to_what_frontends_report() {
        let io = |errno| BdevError::Io {
            bdev: "b".into(),
            source: std::io::Error::from_raw_os_error(errno),
        };
        for (errno, reported) in [
            (libc_errno::ENOSPC, libc_errno::ENOSPC),
            (libc_errno::EDQUOT, libc_errno::ENOSPC),
            (libc_errno::EFBIG, libc_errno::ENOSPC),
            (libc_errno::EINVAL, libc_errno::EIO),
            (libc_errno::EROFS, libc_errno::EPERM),
            (libc_errno::EPERM, libc_errno::EPERM),
            (libc_errno::EOPNOTSUPP, libc_errno::EOPNOTSUPP),
            (libc_errno::EIO, libc_errno::EIO),
            (61, libc_errno::EIO), // ENODATA
        ] {
            assert_eq!(io(errno).errno(), reported, "errno {errno}");
        }
    }

    #[test]
    fn latencies_fall_in_the_bucket_of_the_first_bound_they_do_not_pass() {
        for (ns, bucket) in [
            (0, Some(0)),
            (8_000, Some(0)),
            (8_001, Some(1)),
            (16_000, Some(1)),
            (16_001, Some(2)),
            (1_000_000, Some(7)), // 1 ms: at most 1,024 µs
            (8_388_608_000, Some(20)),
            (8_388_608_001, None),
            (u64::MAX, None),
        ] {
            assert_eq!(latency_bucket(ns), bucket, "{ns} ns");
            if let Some(index) = bucket {
                assert!(ns <= latency_bucket_bound_us(index) * 1000, "{ns} ns");
            }
        }
    }

    fn info(block_size: u32, block_count: u64) -> BdevInfo {
        BdevInfo {
            name: "b".into(),
            uuid: String::new(),
            product_name: "test",
            block_size,
            block_count,
            optimal_io_boundary_blocks: 0,
        }
    }

    #[test]
    fn a_size_shrinks_only_where_allowed_and_earlier_infos_stay_valid() {
        let sized = ResizableInfo::new(info(512, 100));
        let first = sized.get();
        let shrunk = sized.resize("f", Shrink::Refused, |_| Ok(50));
        assert!(
            shrunk
                .expect_err("refused")
                .to_string()
                .contains("only grows")
        );
        assert_eq!(sized.get().block_count, 100);
        assert_eq!(
            sized
                .resize("f", Shrink::Refused, |_| Ok(150))
                .expect("resized"),
            150
        );
        assert_eq!(
            sized
                .resize("i", Shrink::Allowed, |_| Ok(40))
                .expect("resized"),
            40
        );
        assert_eq!(sized.get().block_count, 40);
        assert!(sized.get().extent(39 * 512, 512).is_ok());
        assert!(
            sized.get().extent(40 * 512, 512).is_err(),
            "past the new end"
        );
        // A reference handed out before still reads what it read.
        assert_eq!(first.block_count, 100);
        // The same size again takes no slot; each change takes one, up to the limit.
        for _ in 0..10 {
            sized
                .resize("i", Shrink::Allowed, |_| Ok(40))
                .expect("resized");
        }
        let mut changes = 2;
        while sized
            .resize("i", Shrink::Allowed, |current| Ok(current.block_count ^ 1))
            .is_ok()
        {
            changes += 1;
        }
        assert_eq!(changes, RESIZES_MAX);
    }

    #[test]
    fn extent_checks_each_rule() {
        let info = info(512, 8);
        assert!(info.extent(0, 4096).is_ok());
        assert!(matches!(
            info.extent(512, 4096),
            Err(BdevError::OutOfRange { .. })
        ));
        assert!(matches!(
            info.extent(1, 512),
            Err(BdevError::Misaligned { .. })
        ));
        assert!(matches!(
            info.extent(0, 100),
            Err(BdevError::Misaligned { .. })
        ));
        assert!(matches!(info.extent(0, 0), Err(BdevError::Empty { .. })));
        assert!(matches!(
            info.extent(u64::MAX - 511, 512),
            Err(BdevError::OutOfRange { .. })
        ));
        let big = self::info(4096, 1 << 30);
        assert!(matches!(
            big.data_extent(0, IO_BYTES_MAX + 4096),
            Err(BdevError::TooLarge { .. })
        ));
        assert!(
            big.extent(0, IO_BYTES_MAX + 4096).is_ok(),
            "zeroing is not size-limited"
        );
    }

    proptest! {
        #[test]
        fn accepted_extents_are_inside_and_aligned(
            block_shift in 9u32..13, block_count in 1u64..1 << 20,
            offset in any::<u64>(), len in any::<u64>(),
        ) {
            let info = info(1 << block_shift, block_count);
            if let Ok(extent) = info.extent(offset, len) {
                prop_assert!(extent.len_bytes() > 0);
                prop_assert!(extent.end_bytes() <= info.size_bytes());
                prop_assert_eq!(extent.offset_bytes() % u64::from(info.block_size), 0);
                prop_assert_eq!(extent.len_bytes() % u64::from(info.block_size), 0);
            }
        }
    }
}
