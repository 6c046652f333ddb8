//! A raft heartbeat of one PG, as OSDs send them coalesced: one list per peer and turn
//! instead of one raft message per PG.

use crate::PgId;

/// A heartbeat (or its answer) reduced to what differs from PG to PG. The sending and
/// receiving OSDs are the frame's; nothing else of a heartbeat is set when it is sent this
/// way (a heartbeat carrying a read-index context goes as a whole raft message).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Beat {
    /// The PG.
    pub pg: PgId,
    /// An answer to a heartbeat rather than a heartbeat.
    pub answer: bool,
    /// The sender's raft term.
    pub term: u64,
    /// A heartbeat: the commit index the follower may take. An answer: the follower's.
    pub commit: u64,
}
