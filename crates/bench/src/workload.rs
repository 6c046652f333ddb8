//! What a benchmark run does.

use std::str::FromStr;
use std::time::Duration;

/// The access pattern.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Pattern {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Random reads.
    RandRead,
    /// Random writes.
    RandWrite,
    /// Random reads and writes; the workload's `read_percent` are reads.
    RandRw,
}

impl Pattern {
    /// Whether offsets are random.
    pub fn is_random(self) -> bool {
        matches!(
            self,
            Pattern::RandRead | Pattern::RandWrite | Pattern::RandRw
        )
    }

    /// fio's name for it.
    pub fn name(self) -> &'static str {
        match self {
            Pattern::Read => "read",
            Pattern::Write => "write",
            Pattern::RandRead => "randread",
            Pattern::RandWrite => "randwrite",
            Pattern::RandRw => "randrw",
        }
    }
}

impl FromStr for Pattern {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, Self::Err> {
        match text {
            "read" => Ok(Pattern::Read),
            "write" => Ok(Pattern::Write),
            "randread" => Ok(Pattern::RandRead),
            "randwrite" => Ok(Pattern::RandWrite),
            "randrw" => Ok(Pattern::RandRw),
            _ => Err(format!(
                "unknown rw {text:?} (read, write, randread, randwrite, randrw)"
            )),
        }
    }
}

/// A benchmark's parameters.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Workload {
    /// Access pattern.
    pub pattern: Pattern,
    /// Percentage of reads in `randrw` (0 to 100).
    pub read_percent: u8,
    /// Bytes per request.
    pub block_size: u64,
    /// Worker threads (and NBD connections).
    pub workers: usize,
    /// Requests in flight per worker.
    pub iodepth: usize,
    /// Stop after this long...
    #[serde(serialize_with = "seconds")]
    pub runtime: Option<Duration>,
    /// ...or after this many requests, whichever comes first.
    pub io_count: Option<u64>,
    /// Bytes of the device used, from offset 0 (0: the whole device).
    pub working_set_bytes: u64,
    /// Check every read against what was written, and read everything back at the end.
    pub verify: bool,
    /// Seed of the offset generators.
    pub seed: u64,
}

fn seconds<S: serde::Serializer>(
    runtime: &Option<Duration>,
    serializer: S,
) -> Result<S::Ok, S::Error> {
    match runtime {
        Some(runtime) => serializer.serialize_some(&runtime.as_secs_f64()),
        None => serializer.serialize_none(),
    }
}

/// Why a workload cannot run.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum WorkloadError {
    /// A parameter out of range.
    #[error("{0}")]
    Invalid(String),
}

impl Workload {
    /// Checks the workload against a device of `size_bytes` and `block_size_min`; returns
    /// the working set actually used.
    pub fn check(&self, size_bytes: u64, block_size_min: u64) -> Result<u64, WorkloadError> {
        let invalid = |message: String| Err(WorkloadError::Invalid(message));
        if self.block_size == 0 || !self.block_size.is_multiple_of(block_size_min.max(1)) {
            return invalid(format!(
                "bs {} is not a multiple of the device's {block_size_min}-byte blocks",
                self.block_size
            ));
        }
        if self.workers == 0 || self.iodepth == 0 {
            return invalid("workers and iodepth must be at least 1".into());
        }
        if self.read_percent > 100 {
            return invalid(format!("rwmixread {} is more than 100", self.read_percent));
        }
        if self.runtime.is_none() && self.io_count.is_none() {
            return invalid("give a runtime or an io count".into());
        }
        let working_set = if self.working_set_bytes == 0 {
            size_bytes
        } else {
            self.working_set_bytes
        };
        if working_set > size_bytes {
            return invalid(format!(
                "size {working_set} is larger than the device ({size_bytes} bytes)"
            ));
        }
        let blocks = working_set / self.block_size;
        if blocks == 0 {
            return invalid(format!(
                "size {working_set} holds no {}-byte block",
                self.block_size
            ));
        }
        Ok(blocks * self.block_size)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn workload() -> Workload {
        Workload {
            pattern: Pattern::RandWrite,
            read_percent: 50,
            block_size: 4096,
            workers: 1,
            iodepth: 1,
            runtime: None,
            io_count: Some(1),
            working_set_bytes: 0,
            verify: false,
            seed: 1,
        }
    }

    #[test]
    fn check_refuses_bad_parameters() {
        assert_eq!(workload().check(1 << 20, 512), Ok(1 << 20));
        assert!(
            Workload {
                block_size: 1000,
                ..workload()
            }
            .check(1 << 20, 512)
            .is_err()
        );
        assert!(
            Workload {
                iodepth: 0,
                ..workload()
            }
            .check(1 << 20, 512)
            .is_err()
        );
        assert!(
            Workload {
                io_count: None,
                ..workload()
            }
            .check(1 << 20, 512)
            .is_err()
        );
        assert!(
            Workload {
                working_set_bytes: 2 << 20,
                ..workload()
            }
            .check(1 << 20, 512)
            .is_err()
        );
        assert!(
            Workload {
                read_percent: 101,
                ..workload()
            }
            .check(1 << 20, 512)
            .is_err()
        );
        assert_eq!(
            Workload {
                working_set_bytes: 10_000,
                ..workload()
            }
            .check(1 << 20, 512),
            Ok(8192)
        );
    }

    #[test]
    fn patterns_parse_by_fio_name() {
        for pattern in [
            Pattern::Read,
            Pattern::Write,
            Pattern::RandRead,
            Pattern::RandWrite,
            Pattern::RandRw,
        ] {
            assert_eq!(pattern.name().parse::<Pattern>(), Ok(pattern));
        }
        assert!("rw".parse::<Pattern>().is_err());
    }
}
