//! The monitor: keeper of the cluster map.
//!
//! - [`liveness`]: failure detection from heartbeats (down after a grace, out after an
//!   interval), with time as an input.
//! - [`map`]: the cluster map and the commands that change it (a deterministic state
//!   machine, replicated by the monitors' Raft group).
//! - [`placement`]: which OSDs hold each PG (rendezvous hashing over weights, failure
//!   domain host, minimal movement); a pure function the monitor runs and records.
//!
//! Planned here (issue #3): the map's Raft replication across monitors, the network side of
//! OSD boot and heartbeats, the TOML config and Prometheus metrics, and map subscriptions.

pub mod liveness;
pub mod map;
pub mod placement;
