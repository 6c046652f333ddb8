//! Results of a run: per direction IOPS, bandwidth and latency percentiles.

use std::fmt::Write as _;
use std::time::Duration;

use hdrhistogram::Histogram;
use serde::Serialize;

use crate::workload::Workload;

/// Percentiles reported, as fractions.
pub const PERCENTILES: [(&str, f64); 6] = [
    ("p10", 10.0),
    ("p50", 50.0),
    ("p90", 90.0),
    ("p95", 95.0),
    ("p99", 99.0),
    ("p99.9", 99.9),
];

/// Latency statistics in microseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Fastest request.
    pub min_us: f64,
    /// Mean.
    pub mean_us: f64,
    /// Slowest request.
    pub max_us: f64,
    /// Standard deviation (population, "biased").
    pub stdev_us: f64,
    /// p10, p50, p90, p95, p99, p99.9.
    pub percentiles_us: Vec<(String, f64)>,
}

impl Latency {
    /// From a histogram of nanoseconds.
    pub fn from_histogram(histogram: &Histogram<u64>) -> Self {
        let us = |ns: f64| ns / 1000.0;
        Self {
            min_us: us(histogram.min() as f64),
            mean_us: us(histogram.mean()),
            max_us: us(histogram.max() as f64),
            stdev_us: us(histogram.stdev()),
            percentiles_us: PERCENTILES
                .iter()
                .map(|(name, q)| {
                    (
                        name.to_string(),
                        us(histogram.value_at_percentile(*q) as f64),
                    )
                })
                .collect(),
        }
    }

    /// The value of a named percentile.
    pub fn percentile(&self, name: &str) -> f64 {
        self.percentiles_us
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| *v)
            .unwrap_or(0.0)
    }
}

/// One direction (reads or writes).
#[derive(Debug, Clone, Serialize)]
pub struct DirectionReport {
    /// Requests completed.
    pub ios: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// Requests per second.
    pub iops: f64,
    /// MiB per second.
    pub mib_per_second: f64,
    /// Latency.
    pub latency: Latency,
    /// The same, as fastblock's block_bench prints it.
    pub block_bench: String,
}

/// The outcome of `basalt bench`.
#[derive(Debug, Clone, Serialize)]
pub struct Report {
    /// What was measured.
    pub target: String,
    /// The workload.
    pub workload: Workload,
    /// Seconds measured.
    pub elapsed_seconds: f64,
    /// Reads, if any.
    pub read: Option<DirectionReport>,
    /// Writes, if any.
    pub write: Option<DirectionReport>,
    /// Requests that failed.
    pub errors: u64,
    /// The first failure, if any.
    pub first_error: Option<String>,
    /// Blocks read back and checked (with verify).
    pub verified_blocks: u64,
    /// Blocks whose contents were wrong.
    pub verify_mismatches: u64,
    /// The first mismatch, if any.
    pub first_mismatch: Option<String>,
    /// What an OSD log device wrote, when one was measured.
    pub log: Option<LogReport>,
}

/// Group commit as the OSD log device saw it.
#[derive(Debug, Clone, Serialize)]
pub struct LogReport {
    /// Appends answered.
    pub appends: u64,
    /// Batches (durable device writes) they took.
    pub batches: u64,
    /// Device bytes per data byte.
    pub write_amplification: f64,
}

impl DirectionReport {
    /// The summary line in the format of fastblock's block_bench, which operators of that
    /// system compare against: `p0.1: 12us, p0.5: ..., biased stdv: ..., iops: ...`.
    pub fn block_bench_line(&self) -> String {
        let l = &self.latency;
        let names = [
            ("p10", "p0.1"),
            ("p50", "p0.5"),
            ("p90", "p0.9"),
            ("p95", "p0.95"),
            ("p99", "p0.99"),
            ("p99.9", "p0.999"),
        ];
        let percentiles: Vec<String> = names
            .iter()
            .map(|(ours, theirs)| format!("{theirs}: {:.0}us", l.percentile(ours)))
            .collect();
        format!(
            "{}, mean: {:.0}us, min: {:.0}us, max: {:.0}us, biased stdv: {:.0}us, iops: {:.0}",
            percentiles.join(", "),
            l.mean_us,
            l.min_us,
            l.max_us,
            l.stdev_us,
            self.iops
        )
    }

    /// From a histogram of latencies and a byte count over `elapsed`.
    pub fn new(histogram: &Histogram<u64>, bytes: u64, elapsed: Duration) -> Option<Self> {
        let ios = histogram.len();
        if ios == 0 {
            return None;
        }
        let seconds = elapsed.as_secs_f64().max(1e-9);
        let mut report = Self {
            ios,
            bytes,
            iops: ios as f64 / seconds,
            mib_per_second: bytes as f64 / seconds / (1 << 20) as f64,
            latency: Latency::from_histogram(histogram),
            block_bench: String::new(),
        };
        report.block_bench = report.block_bench_line();
        Some(report)
    }
}

impl Report {
    /// Whether the run saw no error and no mismatch.
    pub fn is_clean(&self) -> bool {
        self.errors == 0 && self.verify_mismatches == 0
    }

    /// The report for people.
    pub fn to_text(&self) -> String {
        let w = &self.workload;
        let mut text = String::new();
        let _ = writeln!(
            text,
            "basalt bench: {} bs={} iodepth={} workers={} on {} ({:.2}s)",
            w.pattern.name(),
            w.block_size,
            w.iodepth,
            w.workers,
            self.target,
            self.elapsed_seconds
        );
        for (name, direction) in [("read", &self.read), ("write", &self.write)] {
            let Some(d) = direction else { continue };
            let l = &d.latency;
            let _ = writeln!(
                text,
                "{name}: {:.0} IOPS, {:.1} MiB/s, {} ios",
                d.iops, d.mib_per_second, d.ios
            );
            let _ = writeln!(
                text,
                "  latency (us): min {:.1}, mean {:.1}, stdev {:.1}, max {:.1}",
                l.min_us, l.mean_us, l.stdev_us, l.max_us
            );
            let percentiles: Vec<String> = l
                .percentiles_us
                .iter()
                .map(|(n, v)| format!("{n} {v:.1}"))
                .collect();
            let _ = writeln!(text, "  percentiles (us): {}", percentiles.join(", "));
            let _ = writeln!(text, "  block_bench: {}", d.block_bench);
        }
        if self.errors > 0 {
            let _ = writeln!(
                text,
                "errors: {} (first: {})",
                self.errors,
                self.first_error.as_deref().unwrap_or("?")
            );
        }
        if w.verify {
            let _ = writeln!(
                text,
                "verify: {} blocks checked, {} mismatches",
                self.verified_blocks, self.verify_mismatches
            );
            if let Some(first) = &self.first_mismatch {
                let _ = writeln!(text, "  first mismatch: {first}");
            }
        }
        text
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn block_bench_line_has_the_seed_format() {
        let mut histogram =
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000_000, 3).expect("bounds");
        for ns in [10_000u64, 20_000, 30_000, 40_000] {
            histogram.record(ns).expect("in range");
        }
        let report =
            DirectionReport::new(&histogram, 4 * 4096, Duration::from_secs(1)).expect("ios");
        let line = report.block_bench_line();
        assert!(line.starts_with("p0.1: 10us, p0.5: 20us, p0.9: 40us, p0.95: 40us, p0.99: 40us, p0.999: 40us, mean: 25us"), "{line}");
        assert!(
            line.contains("biased stdv: 11us") && line.ends_with("iops: 4"),
            "{line}"
        );
    }
}
