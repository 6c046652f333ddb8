//! The OSD: one disk, the replicas of many PGs.
//!
//! - [`superblock`]: the first block of the device: what it is and where its log lives.
//! - [`log_device`]: [`log_device::LogDevice`], the log on the device with group commit:
//!   appends that arrive while a batch is being written go out together in the next one,
//!   under one durable write.
//!
//! Planned (issue #3): PGs as raft-rs groups driven by one multi-raft loop persisting
//! through the log device, the index and its checkpoints, the wire protocol, the daemon.

pub mod log_device;
pub mod superblock;
