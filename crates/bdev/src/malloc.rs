//! A RAM-backed bdev ("malloc", as SPDK calls it).
//!
//! Memory is held in chunks allocated on first write, so a large malloc bdev costs only
//! what has been written; a never-written chunk reads as zeroes, and discard or write
//! zeroes of a whole chunk frees it.

use std::sync::RwLock;

use basalt_io::DmaBuf;

use crate::bdev::{Bdev, BdevFuture, BdevInfo, Extent};

/// Bytes per chunk: small enough that thin allocation is fine-grained, large enough that
/// the chunk table of a 64 GiB bdev stays a few MiB.
pub const CHUNK_SIZE: u64 = 64 << 10;

/// What `bdev_get_bdevs` calls this kind, as SPDK does.
pub const PRODUCT_NAME: &str = "Malloc disk";

/// A RAM-backed bdev.
pub struct MallocBdev {
    info: BdevInfo,
    chunks: Vec<RwLock<Option<Box<[u8]>>>>,
}

impl MallocBdev {
    /// An all-zero bdev of `info.block_count` blocks.
    pub fn new(info: BdevInfo) -> Self {
        let chunk_count = info.size_bytes().div_ceil(CHUNK_SIZE);
        let chunks = (0..chunk_count).map(|_| RwLock::new(None)).collect();
        Self { info, chunks }
    }

    /// An all-zero bdev named `name` with a random UUID.
    pub fn new_named(name: &str, block_size: u32, block_count: u64) -> Self {
        Self::new(BdevInfo {
            name: name.to_string(),
            uuid: crate::uuid::random(),
            product_name: PRODUCT_NAME,
            block_size,
            block_count,
            optimal_io_boundary_blocks: 0,
        })
    }

    /// Bytes of RAM holding data now.
    pub fn allocated_bytes(&self) -> u64 {
        let allocated = self
            .chunks
            .iter()
            .filter(|chunk| read_lock(chunk).is_some())
            .count();
        allocated as u64 * CHUNK_SIZE
    }

    /// Calls `visit(chunk index, offset in chunk, range in the request)` for each chunk the
    /// extent touches, in order.
    fn for_each_chunk(
        &self,
        extent: Extent,
        mut visit: impl FnMut(usize, usize, std::ops::Range<usize>),
    ) {
        let mut offset = extent.offset_bytes();
        while offset < extent.end_bytes() {
            let index = (offset / CHUNK_SIZE) as usize;
            let within = (offset % CHUNK_SIZE) as usize;
            let len = (CHUNK_SIZE - offset % CHUNK_SIZE).min(extent.end_bytes() - offset) as usize;
            let start = (offset - extent.offset_bytes()) as usize;
            visit(index, within, start..start + len);
            offset += len as u64;
        }
    }

    fn zero(&self, extent: Extent) {
        self.for_each_chunk(extent, |index, within, range| {
            let mut chunk = write_lock(&self.chunks[index]);
            if range.len() as u64 == CHUNK_SIZE {
                *chunk = None;
            } else if let Some(data) = chunk.as_mut() {
                data[within..within + range.len()].fill(0);
            }
        });
    }
}

fn read_lock<T>(lock: &RwLock<T>) -> std::sync::RwLockReadGuard<'_, T> {
    // A panic while holding a chunk lock leaves bytes, not broken invariants: keep serving.
    lock.read().unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn write_lock<T>(lock: &RwLock<T>) -> std::sync::RwLockWriteGuard<'_, T> {
    lock.write()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

fn ready<T: Send + 'static>(value: T) -> BdevFuture<'static, T> {
    Box::pin(std::future::ready(Ok(value)))
}

impl Bdev for MallocBdev {
    fn info(&self) -> &BdevInfo {
        &self.info
    }

    fn volatile_cache(&self) -> bool {
        false
    }

    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        let mut buf = DmaBuf::zeroed(extent.len_bytes() as usize);
        self.for_each_chunk(extent, |index, within, range| {
            if let Some(data) = read_lock(&self.chunks[index]).as_ref() {
                buf[range.clone()].copy_from_slice(&data[within..within + range.len()]);
            }
        });
        ready(buf)
    }

    fn write(&self, extent: Extent, data: DmaBuf, _fua: bool) -> BdevFuture<'_, ()> {
        assert_eq!(data.len() as u64, extent.len_bytes(), "write buffer length");
        self.for_each_chunk(extent, |index, within, range| {
            let mut chunk = write_lock(&self.chunks[index]);
            let target =
                chunk.get_or_insert_with(|| vec![0u8; CHUNK_SIZE as usize].into_boxed_slice());
            target[within..within + range.len()].copy_from_slice(&data[range]);
        });
        ready(())
    }

    fn flush(&self) -> BdevFuture<'_, ()> {
        ready(())
    }

    fn write_zeroes(&self, extent: Extent, _deallocate: bool) -> BdevFuture<'_, ()> {
        self.zero(extent);
        ready(())
    }

    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()> {
        self.zero(extent);
        ready(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bdev(block_count: u64) -> MallocBdev {
        MallocBdev::new_named("m", 512, block_count)
    }

    fn block_on<T>(future: BdevFuture<'_, T>) -> T {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("runtime")
            .block_on(future)
            .expect("malloc never fails")
    }

    #[test]
    fn unwritten_reads_zero_and_costs_nothing() {
        let bdev = bdev(1 << 20);
        let extent = bdev.info().extent(4096, 8192).expect("extent");
        assert!(block_on(bdev.read(extent)).iter().all(|b| *b == 0));
        assert_eq!(bdev.allocated_bytes(), 0);
    }

    #[test]
    fn whole_chunk_discard_frees_memory() {
        let bdev = bdev(1024);
        let extent = bdev.info().extent(0, CHUNK_SIZE * 2).expect("extent");
        block_on(bdev.write(
            extent,
            DmaBuf::from_slice(&vec![1u8; 2 * CHUNK_SIZE as usize]),
            false,
        ));
        assert_eq!(bdev.allocated_bytes(), 2 * CHUNK_SIZE);
        let first = bdev.info().extent(0, CHUNK_SIZE).expect("extent");
        block_on(bdev.discard(first));
        assert_eq!(bdev.allocated_bytes(), CHUNK_SIZE);
        let data = block_on(bdev.read(extent));
        assert!(data[..CHUNK_SIZE as usize].iter().all(|b| *b == 0));
        assert!(data[CHUNK_SIZE as usize..].iter().all(|b| *b == 1));
    }

    proptest! {
        /// Random writes and zeroings across chunk boundaries match a flat byte model.
        #[test]
        fn matches_a_flat_model(ops in proptest::collection::vec((0u64..512, 1u64..300, any::<u8>(), any::<bool>()), 1..40)) {
            let bdev = bdev(512);
            let mut model = vec![0u8; 512 * 512];
            for (block, count, byte, zero) in ops {
                let count = count.min(512 - block);
                let extent = bdev.info().extent(block * 512, count * 512).expect("in range");
                let range = (block * 512) as usize..((block + count) * 512) as usize;
                if zero {
                    block_on(bdev.write_zeroes(extent, true));
                    model[range].fill(0);
                } else {
                    block_on(bdev.write(extent, DmaBuf::from_slice(&vec![byte; range.len()]), false));
                    model[range].fill(byte);
                }
            }
            let all = bdev.info().extent(0, 512 * 512).expect("extent");
            prop_assert!(block_on(bdev.read(all))[..] == model[..]);
        }
    }
}
