//! The OSD storage engine (design: `docs/internals/store.md`).
//!
//! - [`batch`]: the on-disk format of a batch, what one device write carries: a 4 KiB
//!   header block of entry descriptors, then each entry's data, block-aligned.
//! - [`extent_map`]: where an object's bytes are in the log; unmapped ranges read as
//!   zeroes (thin provisioning).
//! - [`object_op`]: object writes and discards as PG log entries (the payload is the
//!   entry's data, so it is written once) and the PG's object index they update.
//! - [`log`]: [`log::LogWriter`] lays batches out in a ring of the device; [`log::replay`]
//!   reads them back, around the ring, and stops at the first torn, corrupt or stale batch.
//! - [`checkpoint`]: the index and every PG's raft state, written so that restarts replay
//!   only the recent log and the older log can be reused.
//! - [`block_sums`]: the checksum of every block of the log as written, which reads check.
//!
//! This crate does no I/O and reads no clock: it encodes bytes and says where they go, and
//! it decodes bytes the caller read. The OSD writes them with io_uring; the simulator with a
//! simulated disk that tears writes.
//!

pub mod batch;
pub mod block_sums;
pub mod checkpoint;
pub mod extent_map;
pub mod log;
pub mod object_op;
