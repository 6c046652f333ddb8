//! Per-bdev I/O counters: a decorator that wraps any bdev and counts what passes through.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use basalt_io::DmaBuf;

use crate::bdev::{
    Bdev, BdevFuture, BdevInfo, Extent, InPlace, IoStatsSnapshot, LATENCY_BUCKETS, latency_bucket,
};

/// A bdev that counts operations, bytes and latency of the bdev it wraps.
pub struct Counted {
    inner: Box<dyn Bdev>,
    counters: Counters,
}

#[derive(Default)]
struct Counters {
    bytes_read: AtomicU64,
    num_read_ops: AtomicU64,
    bytes_written: AtomicU64,
    num_write_ops: AtomicU64,
    bytes_unmapped: AtomicU64,
    num_unmap_ops: AtomicU64,
    num_flush_ops: AtomicU64,
    num_errors: AtomicU64,
    read_latency_ns: AtomicU64,
    write_latency_ns: AtomicU64,
    unmap_latency_ns: AtomicU64,
    read_buckets: [AtomicU64; LATENCY_BUCKETS],
    write_buckets: [AtomicU64; LATENCY_BUCKETS],
}

/// Which counters an operation moves.
#[derive(Clone, Copy)]
enum Kind {
    Read,
    Write,
    Unmap,
    Flush,
}

impl Counted {
    /// Wraps `inner`.
    pub fn new(inner: Box<dyn Bdev>) -> Self {
        Self {
            inner,
            counters: Counters::default(),
        }
    }

    fn count<'a, T: Send + 'a>(
        &'a self,
        kind: Kind,
        len_bytes: u64,
        request: BdevFuture<'a, T>,
    ) -> BdevFuture<'a, T> {
        let start = Instant::now();
        Box::pin(async move {
            let result = request.await;
            self.record(kind, len_bytes, start.elapsed(), result.is_ok());
            result
        })
    }

    /// Counts one operation that ended.
    fn record(&self, kind: Kind, len_bytes: u64, elapsed: Duration, ok: bool) {
        let c = &self.counters;
        if !ok {
            c.num_errors.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let elapsed_ns = u64::try_from(elapsed.as_nanos()).unwrap_or(u64::MAX);
        // Flushes are only counted; the others also add their bytes and latency.
        let (ops, bytes_and_latency) = match kind {
            Kind::Read => (&c.num_read_ops, Some((&c.bytes_read, &c.read_latency_ns))),
            Kind::Write => (
                &c.num_write_ops,
                Some((&c.bytes_written, &c.write_latency_ns)),
            ),
            Kind::Unmap => (
                &c.num_unmap_ops,
                Some((&c.bytes_unmapped, &c.unmap_latency_ns)),
            ),
            Kind::Flush => (&c.num_flush_ops, None),
        };
        if let Some((bytes, latency)) = bytes_and_latency {
            bytes.fetch_add(len_bytes, Ordering::Relaxed);
            latency.fetch_add(elapsed_ns, Ordering::Relaxed);
        }
        let buckets = match kind {
            Kind::Read => Some(&c.read_buckets),
            Kind::Write => Some(&c.write_buckets),
            Kind::Unmap | Kind::Flush => None,
        };
        if let Some(buckets) = buckets
            && let Some(index) = latency_bucket(elapsed_ns)
        {
            buckets[index].fetch_add(1, Ordering::Relaxed);
        }
        ops.fetch_add(1, Ordering::Relaxed);
    }
}

impl Bdev for Counted {
    fn info(&self) -> &BdevInfo {
        self.inner.info()
    }

    fn read(&self, extent: Extent) -> BdevFuture<'_, DmaBuf> {
        self.count(Kind::Read, extent.len_bytes(), self.inner.read(extent))
    }

    fn write(&self, extent: Extent, data: DmaBuf, fua: bool) -> BdevFuture<'_, ()> {
        self.count(
            Kind::Write,
            extent.len_bytes(),
            self.inner.write(extent, data, fua),
        )
    }

    fn flush(&self) -> BdevFuture<'_, ()> {
        self.count(Kind::Flush, 0, self.inner.flush())
    }

    fn write_zeroes(&self, extent: Extent, deallocate: bool) -> BdevFuture<'_, ()> {
        self.count(
            Kind::Write,
            extent.len_bytes(),
            self.inner.write_zeroes(extent, deallocate),
        )
    }

    fn discard(&self, extent: Extent) -> BdevFuture<'_, ()> {
        self.count(Kind::Unmap, extent.len_bytes(), self.inner.discard(extent))
    }

    fn rescan(&self) -> Result<u64, crate::BdevError> {
        self.inner.rescan()
    }

    fn in_place(&self) -> Option<InPlace<'_>> {
        self.inner.in_place()
    }

    fn volatile_cache(&self) -> bool {
        self.inner.volatile_cache()
    }

    fn unmap_blocks_max(&self) -> Option<u64> {
        self.inner.unmap_blocks_max()
    }

    fn count_in_place(&self, write: bool, len_bytes: u64, elapsed: Duration, ok: bool) {
        let kind = if write { Kind::Write } else { Kind::Read };
        self.record(kind, len_bytes, elapsed, ok);
    }

    fn io_stats(&self) -> Option<IoStatsSnapshot> {
        let c = &self.counters;
        let get = |counter: &AtomicU64| counter.load(Ordering::Relaxed);
        Some(IoStatsSnapshot {
            bytes_read: get(&c.bytes_read),
            num_read_ops: get(&c.num_read_ops),
            bytes_written: get(&c.bytes_written),
            num_write_ops: get(&c.num_write_ops),
            bytes_unmapped: get(&c.bytes_unmapped),
            num_unmap_ops: get(&c.num_unmap_ops),
            num_flush_ops: get(&c.num_flush_ops),
            num_errors: get(&c.num_errors),
            read_latency_ns: get(&c.read_latency_ns),
            write_latency_ns: get(&c.write_latency_ns),
            unmap_latency_ns: get(&c.unmap_latency_ns),
            read_latency_buckets: c.read_buckets.each_ref().map(get),
            write_latency_buckets: c.write_buckets.each_ref().map(get),
        })
    }
}
