//! The engine: `workers x iodepth` request loops sharing one set of counters.
//!
//! With `verify`, every block has a generation (how often this run wrote it) in a table;
//! a loop takes a block's busy bit before touching it, so a block is never read and written
//! at once, and a read of a block this run wrote must match [`pattern::fill`] of its
//! generation. At the end every written block is read back once more.

use std::sync::Arc;
use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use basalt_io::DmaBuf;
use hdrhistogram::Histogram;

use crate::device::{Device, WorkerDevice};
use crate::pattern::{self, splitmix64};
use crate::report::{DirectionReport, LogReport, Report};
use crate::workload::{Pattern, Workload, WorkloadError};

const BUSY: u32 = 1 << 31;
/// Latencies above an hour are recorded as an hour.
const LATENCY_NS_MAX: u64 = 3600 * 1_000_000_000;
/// A block whose last write failed: its contents are unknown and not checked.
const UNKNOWN: u32 = BUSY - 1;

struct Shared {
    workload: Workload,
    blocks: u64,
    start: Instant,
    issued: AtomicU64,
    stop: AtomicBool,
    sequential_cursor: AtomicU64,
    completed_ios: AtomicU64,
    completed_bytes: AtomicU64,
    generations: Vec<AtomicU32>,
    errors: AtomicU64,
    first_error: Mutex<Option<String>>,
    verified: AtomicU64,
    mismatches: AtomicU64,
    first_mismatch: Mutex<Option<String>>,
}

#[derive(Default)]
struct Tally {
    read: Option<Histogram<u64>>,
    write: Option<Histogram<u64>>,
    read_bytes: u64,
    write_bytes: u64,
}

impl Tally {
    fn record(&mut self, is_read: bool, latency: Duration, bytes: u64) {
        let (histogram, total) = if is_read {
            (&mut self.read, &mut self.read_bytes)
        } else {
            (&mut self.write, &mut self.write_bytes)
        };
        let histogram = histogram.get_or_insert_with(|| {
            Histogram::new_with_bounds(1, LATENCY_NS_MAX, 3)
                .expect("bounds and 3 significant figures are valid")
        });
        let ns = u64::try_from(latency.as_nanos()).unwrap_or(u64::MAX).max(1);
        histogram.saturating_record(ns);
        *total += bytes;
    }

    fn merge(&mut self, other: Tally) {
        for (mine, theirs) in [(&mut self.read, other.read), (&mut self.write, other.write)] {
            match (mine.as_mut(), theirs) {
                (Some(mine), Some(theirs)) => mine
                    .add(theirs)
                    .expect("histograms with equal bounds merge"),
                (None, Some(theirs)) => *mine = Some(theirs),
                _ => {}
            }
        }
        self.read_bytes += other.read_bytes;
        self.write_bytes += other.write_bytes;
    }
}

impl Shared {
    /// Counts a failed request and stops the run, as fio does without `continue_on_error`:
    /// a device that fails (or a connection that closed) would otherwise fail every request
    /// the loops issue, as fast as they can issue them.
    fn record_error(&self, error: String) {
        self.stop.store(true, Ordering::Relaxed);
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut first = self.first_error.lock().unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(error);
    }

    fn record_mismatch(&self, message: String) {
        self.mismatches.fetch_add(1, Ordering::Relaxed);
        let mut first = self
            .first_mismatch
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        first.get_or_insert(message);
    }

    fn should_stop(&self) -> bool {
        if self.stop.load(Ordering::Relaxed) {
            return true;
        }
        if self
            .workload
            .runtime
            .is_some_and(|runtime| self.start.elapsed() >= runtime)
        {
            self.stop.store(true, Ordering::Relaxed);
            return true;
        }
        if let Some(count) = self.workload.io_count
            && self.issued.fetch_add(1, Ordering::Relaxed) >= count
        {
            return true;
        }
        false
    }

    fn pick_block(&self, rng: &mut u64) -> u64 {
        if self.workload.pattern.is_random() {
            splitmix64(rng) % self.blocks
        } else {
            self.sequential_cursor.fetch_add(1, Ordering::Relaxed) % self.blocks
        }
    }

    fn is_read(&self, rng: &mut u64) -> bool {
        match self.workload.pattern {
            Pattern::Read | Pattern::RandRead => true,
            Pattern::Write | Pattern::RandWrite => false,
            Pattern::RandRw => splitmix64(rng) % 100 < u64::from(self.workload.read_percent),
        }
    }

    /// Takes the block's busy bit; its generation, or `None` if another loop holds it.
    fn lock_block(&self, block: u64) -> Option<u32> {
        let slot = &self.generations[block as usize];
        let generation = slot.load(Ordering::Acquire);
        if generation & BUSY != 0 {
            return None;
        }
        slot.compare_exchange(
            generation,
            generation | BUSY,
            Ordering::AcqRel,
            Ordering::Relaxed,
        )
        .ok()
    }

    fn unlock_block(&self, block: u64, generation: u32) {
        self.generations[block as usize].store(generation, Ordering::Release);
    }

    fn check(&self, data: &[u8], offset_bytes: u64, generation: u32) {
        self.verified.fetch_add(1, Ordering::Relaxed);
        if let Err(mismatch) = pattern::check(data, offset_bytes, generation) {
            self.record_mismatch(format!(
                "block at offset {offset_bytes} (generation {generation}): {mismatch:?}"
            ));
        }
    }
}

async fn request_loop(shared: Arc<Shared>, device: WorkerDevice, mut rng: u64) -> Tally {
    let mut tally = Tally::default();
    let bs = shared.workload.block_size;
    let verify = shared.workload.verify;
    // Without verification every write carries one pseudo-random body, filled once, under
    // its own stamp (fio reuses its buffers the same way): filling each block anew took a
    // fifth of the bench's CPU, more than a malloc bdev spends on the write.
    let body = (!verify).then(|| {
        let mut body = DmaBuf::zeroed(bs as usize);
        pattern::fill(&mut body, 0, 1);
        body
    });
    while !shared.should_stop() {
        let is_read = shared.is_read(&mut rng);
        let mut block = shared.pick_block(&mut rng);
        let mut generation = 0;
        if verify {
            let mut locked = shared.lock_block(block);
            for _ in 0..16 {
                if locked.is_some() {
                    break;
                }
                block = shared.pick_block(&mut rng);
                locked = shared.lock_block(block);
            }
            let Some(current) = locked else {
                // Nothing was done: give the issued request back so io_count stays exact.
                if shared.workload.io_count.is_some() {
                    shared.issued.fetch_sub(1, Ordering::Relaxed);
                }
                tokio::task::yield_now().await;
                continue;
            };
            generation = current;
        }
        let offset = block * bs;
        if is_read {
            let start = Instant::now();
            let result = device.read(offset, bs).await;
            let latency = start.elapsed();
            match result {
                Ok(data) => {
                    tally.record(true, latency, bs);
                    if verify && generation != 0 && generation != UNKNOWN {
                        shared.check(&data, offset, generation);
                    }
                }
                Err(error) => shared.record_error(format!("read at {offset}: {error}")),
            }
        } else {
            let next = if generation + 1 >= UNKNOWN {
                1
            } else {
                generation + 1
            };
            let data = match &body {
                Some(body) => {
                    let mut data = body.clone();
                    pattern::stamp(&mut data, offset, next);
                    data
                }
                None => {
                    let mut data = DmaBuf::zeroed(bs as usize);
                    pattern::fill(&mut data, offset, next);
                    data
                }
            };
            let start = Instant::now();
            let result = device.write(offset, data).await;
            let latency = start.elapsed();
            match result {
                Ok(()) => {
                    tally.record(false, latency, bs);
                    generation = next;
                }
                Err(error) => {
                    shared.record_error(format!("write at {offset}: {error}"));
                    generation = UNKNOWN;
                }
            }
        }
        shared.completed_ios.fetch_add(1, Ordering::Relaxed);
        shared.completed_bytes.fetch_add(bs, Ordering::Relaxed);
        if verify {
            shared.unlock_block(block, generation);
        }
    }
    tally
}

/// Reads back every block this run wrote and checks it.
async fn verify_loop(shared: Arc<Shared>, device: WorkerDevice, cursor: Arc<AtomicU64>) {
    let bs = shared.workload.block_size;
    loop {
        let block = cursor.fetch_add(1, Ordering::Relaxed);
        if block >= shared.blocks {
            return;
        }
        let generation = shared.generations[block as usize].load(Ordering::Acquire);
        if generation == 0 || generation == UNKNOWN {
            continue;
        }
        let offset = block * bs;
        match device.read(offset, bs).await {
            Ok(data) => shared.check(&data, offset, generation),
            Err(error) => shared.record_error(format!("verify read at {offset}: {error}")),
        }
    }
}

/// A once-a-second view of a run in progress.
#[derive(Debug, Clone, Copy)]
pub struct Progress {
    /// Seconds since the start.
    pub elapsed_seconds: f64,
    /// Requests per second over the last interval.
    pub iops: f64,
    /// MiB per second over the last interval.
    pub mib_per_second: f64,
    /// Requests completed so far.
    pub ios: u64,
    /// Requests failed so far.
    pub errors: u64,
}

/// Receives [`Progress`] once a second.
pub type ProgressFn = Box<dyn Fn(Progress) + Send + Sync>;

async fn progress_loop(shared: Arc<Shared>, report: ProgressFn) {
    let mut last = (Instant::now(), 0u64, 0u64);
    loop {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = Instant::now();
        let ios = shared.completed_ios.load(Ordering::Relaxed);
        let bytes = shared.completed_bytes.load(Ordering::Relaxed);
        let seconds = now.duration_since(last.0).as_secs_f64();
        report(Progress {
            elapsed_seconds: shared.start.elapsed().as_secs_f64(),
            iops: (ios - last.1) as f64 / seconds,
            mib_per_second: (bytes - last.2) as f64 / seconds / (1 << 20) as f64,
            ios,
            errors: shared.errors.load(Ordering::Relaxed),
        });
        last = (now, ios, bytes);
    }
}

/// Runs `workload` on `device`; `target` names it in the report. Call it on a runtime with
/// `workload.workers` threads. `progress`, if given, is called once a second.
pub async fn run(
    device: &Device,
    workload: &Workload,
    target: String,
    progress: Option<ProgressFn>,
) -> Result<Report, WorkloadError> {
    let working_set = workload.check(device.size_bytes(), device.block_size_min())?;
    let blocks = working_set / workload.block_size;
    let generations = if workload.verify {
        let count = usize::try_from(blocks)
            .map_err(|_| WorkloadError::Invalid("working set too large to verify".into()))?;
        (0..count).map(|_| AtomicU32::new(0)).collect()
    } else {
        Vec::new()
    };
    let shared = Arc::new(Shared {
        workload: workload.clone(),
        blocks,
        start: Instant::now(),
        issued: AtomicU64::new(0),
        stop: AtomicBool::new(false),
        sequential_cursor: AtomicU64::new(0),
        completed_ios: AtomicU64::new(0),
        completed_bytes: AtomicU64::new(0),
        generations,
        errors: AtomicU64::new(0),
        first_error: Mutex::new(None),
        verified: AtomicU64::new(0),
        mismatches: AtomicU64::new(0),
        first_mismatch: Mutex::new(None),
    });
    let progress = progress.map(|report| tokio::spawn(progress_loop(shared.clone(), report)));
    let slots = workload.workers * workload.iodepth;
    let mut tasks = Vec::with_capacity(slots);
    let mut seed = workload.seed;
    for slot in 0..slots {
        let device = device.for_worker(slot % workload.workers);
        tasks.push(tokio::spawn(request_loop(
            shared.clone(),
            device,
            splitmix64(&mut seed),
        )));
    }
    let mut tally = Tally::default();
    for task in tasks {
        match task.await {
            Ok(slot_tally) => tally.merge(slot_tally),
            Err(error) => shared.record_error(format!("request loop failed: {error}")),
        }
    }
    let elapsed = shared.start.elapsed();
    if let Some(progress) = progress {
        progress.abort();
    }
    if workload.verify {
        let cursor = Arc::new(AtomicU64::new(0));
        let loops: Vec<_> = (0..slots)
            .map(|slot| {
                tokio::spawn(verify_loop(
                    shared.clone(),
                    device.for_worker(slot % workload.workers),
                    cursor.clone(),
                ))
            })
            .collect();
        for task in loops {
            if let Err(error) = task.await {
                shared.record_error(format!("verify loop failed: {error}"));
            }
        }
    }
    let direction = |histogram: &Option<Histogram<u64>>, bytes| {
        histogram
            .as_ref()
            .and_then(|h| DirectionReport::new(h, bytes, elapsed))
    };
    let take =
        |slot: &Mutex<Option<String>>| slot.lock().unwrap_or_else(|p| p.into_inner()).clone();
    Ok(Report {
        target,
        workload: workload.clone(),
        elapsed_seconds: elapsed.as_secs_f64(),
        read: direction(&tally.read, tally.read_bytes),
        write: direction(&tally.write, tally.write_bytes),
        errors: shared.errors.load(Ordering::Relaxed),
        first_error: take(&shared.first_error),
        verified_blocks: shared.verified.load(Ordering::Relaxed),
        verify_mismatches: shared.mismatches.load(Ordering::Relaxed),
        first_mismatch: take(&shared.first_mismatch),
        log: match device {
            Device::Log(log) => {
                let stats = log.stats();
                Some(LogReport {
                    appends: stats.appends,
                    batches: stats.batches,
                    write_amplification: stats.write_amplification(),
                })
            }
            _ => None,
        },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use basalt_bdev::{Bdev, BdevInfo};

    fn malloc(block_count: u64) -> Device {
        let bdev: Arc<dyn Bdev> = Arc::new(basalt_bdev::malloc::MallocBdev::new_named(
            "m",
            512,
            block_count,
        ));
        Device::Bdev(bdev)
    }

    fn workload(pattern: Pattern) -> Workload {
        Workload {
            pattern,
            read_percent: 50,
            block_size: 4096,
            workers: 2,
            iodepth: 4,
            runtime: None,
            io_count: Some(2000),
            working_set_bytes: 1 << 20,
            verify: true,
            seed: 7,
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verified_random_mix_is_clean_and_counts_exactly() {
        let device = malloc(1 << 12);
        let report = run(&device, &workload(Pattern::RandRw), "malloc".into(), None)
            .await
            .expect("runs");
        assert!(report.is_clean(), "{}", report.to_text());
        let reads = report.read.as_ref().map_or(0, |r| r.ios);
        let writes = report.write.as_ref().map_or(0, |w| w.ios);
        assert_eq!(reads + writes, 2000, "io_count is exact");
        assert!(reads > 0 && writes > 0);
        assert!(report.verified_blocks > 0);
        let latency = &report.write.as_ref().expect("writes").latency;
        assert!(
            latency.min_us > 0.0 && latency.max_us >= latency.mean_us,
            "{latency:?}"
        );
        assert!(
            latency.percentile("p99.9") >= latency.percentile("p10"),
            "{latency:?}"
        );
    }

    /// Unverified writes share one body but each carries its own block's stamp, so a block
    /// read back says where it was written.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn unverified_writes_carry_their_own_stamps() {
        let bdev: Arc<dyn Bdev> = Arc::new(basalt_bdev::malloc::MallocBdev::new_named(
            "m",
            512,
            1 << 11,
        ));
        let device = Device::Bdev(bdev.clone());
        let workload = Workload {
            read_percent: 0,
            io_count: Some(1000),
            ..workload_with(Pattern::RandWrite)
        };
        let report = run(&device, &workload, "malloc".into(), None)
            .await
            .expect("runs");
        assert!(report.is_clean(), "{}", report.to_text());
        let mut bodies = std::collections::HashSet::new();
        let mut written = 0;
        for block in 0..(1u64 << 20) / 4096 {
            let offset = block * 4096;
            let data = bdev
                .read(bdev.info().extent(offset, 4096).expect("in range"))
                .await
                .expect("reads");
            if data.iter().all(|&byte| byte == 0) {
                continue;
            }
            written += 1;
            let mut stamped = [0u8; 8];
            stamped.copy_from_slice(&data[0..8]);
            assert_eq!(
                u64::from_le_bytes(stamped),
                offset,
                "stamp of block {block}"
            );
            bodies.insert(data[pattern::STAMP_SIZE..].to_vec());
        }
        assert!(written > 100, "{written} blocks written");
        assert_eq!(bodies.len(), 1, "one body for every block");
        assert!(bodies.iter().all(|body| body.iter().any(|&byte| byte != 0)));
    }

    /// A device that returns wrong data must be caught: write with one run, then corrupt a
    /// block behind the bench's back, then check that the final pass reports it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn verify_catches_corruption() {
        let device = malloc(256);
        let Device::Bdev(bdev) = &device else {
            unreachable!()
        };
        let bdev = bdev.clone();
        let mut workload = workload(Pattern::Write);
        workload.io_count = Some(256);
        workload.working_set_bytes = 0;
        workload.iodepth = 1;
        workload.workers = 1;
        let shared_device = Device::Bdev(Arc::new(FaultyBdev::new(bdev, Some(8192), u64::MAX)));
        let report = run(&shared_device, &workload, "corrupting".into(), None)
            .await
            .expect("runs");
        assert_eq!(report.verify_mismatches, 1, "{}", report.to_text());
        assert!(
            report
                .first_mismatch
                .as_deref()
                .is_some_and(|m| m.contains("offset 8192")),
            "{:?}",
            report.first_mismatch
        );
    }

    /// A device whose requests fail after the first 100 must stop the run at once, with
    /// the failures counted, rather than fail requests as fast as they can be issued.
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failing_device_stops_the_run() {
        let Device::Bdev(inner) = malloc(4096) else {
            unreachable!()
        };
        let failing = Device::Bdev(Arc::new(FaultyBdev::new(inner, None, 100)));
        let mut workload = workload(Pattern::RandWrite);
        workload.io_count = None;
        workload.runtime = Some(Duration::from_secs(30));
        workload.verify = false;
        let report = run(&failing, &workload, "failing".into(), None)
            .await
            .expect("runs");
        assert!(
            report.errors >= 1 && report.errors <= 8,
            "{} errors (at most one per slot)",
            report.errors
        );
        assert!(
            report.elapsed_seconds < 10.0,
            "stopped early, not after the runtime"
        );
        assert!(!report.is_clean());
    }

    /// Writes to an OSD log device are durable appends; every one is counted by the log, and
    /// reads are refused (the run stops at the first).
    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn log_device_appends_are_counted_and_reads_refused() {
        use basalt_osd::log_device::LogDevice;
        let path = std::env::temp_dir().join(format!("basalt-bench-log-{}", std::process::id()));
        std::fs::File::create(&path)
            .expect("create")
            .set_len(64 << 20)
            .expect("set_len");
        LogDevice::format(&path, [9; 16]).await.expect("format");
        let device = Device::Log(Arc::new(LogDevice::open(&path).await.expect("open").device));
        let mut workload = workload(Pattern::RandWrite);
        workload.verify = false;
        workload.io_count = Some(200);
        let report = run(&device, &workload, "log".into(), None)
            .await
            .expect("runs");
        assert!(report.is_clean(), "{}", report.to_text());
        let log = report.log.as_ref().expect("log stats");
        assert_eq!(
            (report.write.as_ref().map(|w| w.ios), log.appends),
            (Some(200), 200)
        );
        assert!(log.batches >= 1 && log.batches <= 200, "{log:?}");
        let reads = run(
            &device,
            &workload_with(Pattern::RandRead),
            "log".into(),
            None,
        )
        .await
        .expect("runs");
        assert!(
            reads.errors >= 1
                && reads
                    .first_error
                    .as_deref()
                    .is_some_and(|e| e.contains("only written")),
            "{:?}",
            reads.first_error
        );
        std::fs::remove_file(path).expect("remove");
    }

    fn workload_with(pattern: Pattern) -> Workload {
        Workload {
            verify: false,
            ..workload(pattern)
        }
    }

    /// A bdev that misbehaves on purpose: it flips a byte of every read at
    /// `corrupt_offset`, and fails every write after `writes_left` of them.
    struct FaultyBdev {
        inner: Arc<dyn Bdev>,
        corrupt_offset: Option<u64>,
        writes_left: std::sync::atomic::AtomicU64,
    }

    impl FaultyBdev {
        fn new(inner: Arc<dyn Bdev>, corrupt_offset: Option<u64>, writes_left: u64) -> Self {
            Self {
                inner,
                corrupt_offset,
                writes_left: std::sync::atomic::AtomicU64::new(writes_left),
            }
        }
    }

    impl Bdev for FaultyBdev {
        fn info(&self) -> &BdevInfo {
            self.inner.info()
        }
        fn volatile_cache(&self) -> bool {
            self.inner.volatile_cache()
        }
        fn read(&self, extent: basalt_bdev::Extent) -> basalt_bdev::BdevFuture<'_, DmaBuf> {
            Box::pin(async move {
                let mut data = self.inner.read(extent).await?;
                if Some(extent.offset_bytes()) == self.corrupt_offset {
                    data[100] ^= 0xff;
                }
                Ok(data)
            })
        }
        fn write(
            &self,
            extent: basalt_bdev::Extent,
            data: DmaBuf,
            fua: bool,
        ) -> basalt_bdev::BdevFuture<'_, ()> {
            if self
                .writes_left
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |n| n.checked_sub(1))
                .is_err()
            {
                let error = std::io::Error::from_raw_os_error(5);
                return Box::pin(std::future::ready(Err(self.info().io_error(error))));
            }
            self.inner.write(extent, data, fua)
        }
        fn flush(&self) -> basalt_bdev::BdevFuture<'_, ()> {
            self.inner.flush()
        }
        fn write_zeroes(
            &self,
            extent: basalt_bdev::Extent,
            deallocate: bool,
        ) -> basalt_bdev::BdevFuture<'_, ()> {
            self.inner.write_zeroes(extent, deallocate)
        }
        fn discard(&self, extent: basalt_bdev::Extent) -> basalt_bdev::BdevFuture<'_, ()> {
            self.inner.discard(extent)
        }
    }
}
