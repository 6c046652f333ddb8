//! Basalt's wire format and its TCP transport.
//!
//! - [`frame`]: a 24-byte header (magic, kind, body length, request id, body CRC32C,
//!   header CRC32C) then the body. The header's own checksum lets a receiver refuse garbage
//!   before waiting for a body length that garbage claims.
//! - [`message`]: what frames carry: client writes, reads and discards with their replies
//!   (`NotLeader`, `StaleEpoch`, ...), and raft messages between OSDs.
//!
//! - [`tcp`]: frames over TCP: a pipelining client and a server with a handler.
//! - [`metrics`]: Prometheus text exposition over HTTP, for every daemon's `--metrics-addr`.
//!
//! Only `tcp` and `metrics` do I/O.
//!
//! All integers are little-endian. Every decoder takes untrusted bytes and never panics.

pub mod frame;
pub mod message;
pub mod metrics;
pub mod tcp;

pub use frame::{Frame, FrameError};
pub use message::{Message, MessageError, ObjectRange, Status};
