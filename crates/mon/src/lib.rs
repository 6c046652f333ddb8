//! The monitor: keeper of the cluster map.
//!
//! - [`placement`]: which OSDs hold each PG (rendezvous hashing over weights, failure
//!   domain host, minimal movement); a pure function the monitor runs and records.
//!
//! Planned here (issue #3): the map itself, its Raft replication across monitors, OSD boot
//! and heartbeats, and map subscriptions.

pub mod placement;
