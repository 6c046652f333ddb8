//! The OSD: one disk, the replicas of many PGs.
//!
//! - [`superblock`]: the first block of the device: what it is, where its checkpoints and
//!   its log live.
//! - [`log_device`]: [`log_device::LogDevice`], the log on the device with group commit:
//!   appends that arrive while a batch is being written go out together in the next one,
//!   under one durable write. The log is a ring whose tail the OSD frees.
//!
//! - [`pg_log`]: raft entries and hard states as log entries (an object write's payload is
//!   the log entry's data, written once), and replay back into each PG's raft state.
//!
//! - [`daemon`]: the OSD process: PGs as raft-rs groups driven by one core task that
//!   persists through the log device, serves clients and talks to peers and monitors.
//!
//! - [`reclaim`]: what checkpoints hold, how far raft logs are compacted, and what the
//!   cleaner moves out of the ring's tail, so that the log is reused.
//!
//! - [`snapshot`]: PG snapshots for replicas further behind than their leader's log: the
//!   chunks that carry a PG's objects, and their log entries.
//!
//! - [`scrub`]: background scrubs (a marker in a PG's log, at which every replica digests
//!   the PG's data) and the digest itself.

pub mod daemon;
pub mod log_device;
pub mod pg_log;
pub mod reclaim;
pub mod scrub;
pub mod snapshot;
pub mod superblock;
