//! The workload engine behind `basalt bench` (fastblock's block_bench).
//!
//! - [`device`]: what is measured: an in-process bdev or NBD connections (one per worker).
//! - [`workload`]: the options (pattern, block size, workers, queue depth, limits).
//! - [`pattern`]: verifiable block contents (offset and generation stamped, checksummed).
//! - [`run`]: the engine: `workers x iodepth` request loops, histograms, progress, verify.
//! - [`report`]: latency percentiles, IOPS and bandwidth, for people and as JSON.
//!
//! No timed assertion lives here: the engine measures, people and scripts judge.

pub mod device;
pub mod pattern;
pub mod report;
pub mod run;
pub mod workload;

pub use device::Device;
pub use report::Report;
pub use run::{Progress, ProgressFn, run};
pub use workload::{Pattern, Workload};
