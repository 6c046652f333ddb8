//! Multi-raft for Basalt's PGs: one raft-rs group per PG replica, driven without I/O.
//!
//! - [`multi_raft`]: [`MultiRaft`], every PG replica of one OSD. It takes ticks, messages
//!   and proposals and returns [`Action`]s: messages to send, entries and hard states to make
//!   durable (with the messages that may only leave after that), committed entries to apply.
//!   The OSD executes them with its log device and the network; the simulator (`sim`) with a
//!   simulated disk and network, on one thread, from a seed.
//!
//! Invariants: nothing here does I/O or reads a clock; a replica acknowledges (its persisted
//! messages leave) only after the caller reported its entries durable.

pub mod multi_raft;
pub mod storage;

pub use multi_raft::{
    Action, Concession, Members, MultiRaft, ProposeError, ReadStart, Reconfiguring, Restored,
    beat_of, decode_conf, decode_message, encode_conf, encode_message, heartbeat, quorum_without,
};
pub use raft::eraftpb::{
    ConfState, Entry as RaftEntry, EntryType, HardState, Message as RaftMessage,
};
pub use storage::{Hydrate, PayloadUnavailable, PgStorage};
