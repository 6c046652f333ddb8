//! The monitor: keeper of the cluster map.
//!
//! - [`liveness`]: failure detection from heartbeats (down after a grace, out after an
//!   interval), with time as an input.
//! - [`map`]: the cluster map and the commands that change it (a deterministic state
//!   machine, replicated by the monitors' Raft group).
//! - [`placement`]: which OSDs hold each PG (rendezvous hashing over weights, failure
//!   domain host, minimal movement); a pure function the monitor runs and records.
//!
//! - [`protocol`]: the requests OSDs, clients and the CLI send, as JSON in control frames.
//! - [`server`]: the monitor daemon: the map replicated by raft across 1, 3 or 5 monitors
//!   (each persisting the log in its [`journal`]), boot, heartbeats, failure detection, map
//!   subscriptions, metrics.
//! - [`client`]: [`MonClient`], which talks to whichever monitor answers.

pub mod client;
pub mod journal;
pub mod liveness;
pub mod map;
pub mod placement;
pub mod protocol;
pub mod server;

pub use client::{MonClient, MonClientError};
