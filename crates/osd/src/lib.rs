//! The OSD: one disk, the replicas of many PGs.
//!
//! - [`superblock`]: the first block of the device: what it is and where its log lives.
//! - [`log_device`]: [`log_device::LogDevice`], the log on the device with group commit:
//!   appends that arrive while a batch is being written go out together in the next one,
//!   under one durable write.
//!
//! - [`pg_log`]: raft entries and hard states as log entries (an object write's payload is
//!   the log entry's data, written once), and replay back into each PG's raft state.
//!
//! - [`daemon`]: the OSD process: PGs as raft-rs groups driven by one core task that
//!   persists through the log device, serves clients and talks to peers and monitors.
//!
//! Planned (issue #3): checkpoints of the index, log segments and their cleaner, snapshots
//! for new replicas, PG membership changes.

pub mod daemon;
pub mod log_device;
pub mod pg_log;
pub mod superblock;
