//! Types shared by every Basalt layer.
//!
//! - [`beat`]: a raft heartbeat of one PG, as OSDs coalesce them per peer.
//! - [`byte_size`]: sizes with units (`4MiB`, `100GiB`), as the CLI and configs take them.
//! - [`ids`]: typed identifiers (`OsdId`, `PoolId`, `PgId`, `ImageId`, `ObjectKey`, `Epoch`, `Lsn`).
//! - [`config_call`]: one entry of the target's saved configuration.
//! - [`rpc_error`]: the JSON-RPC error every target handler returns.
//! - [`send_buffer`]: a connection's encoded bytes waiting for its socket.
//!
//! This crate does no I/O and reads no clock.

pub mod beat;
pub mod byte_size;
pub mod config_call;
pub mod ids;
pub mod rpc_error;
pub mod send_buffer;

pub use beat::Beat;
pub use byte_size::ByteSize;
pub use config_call::ConfigCall;
pub use ids::{Epoch, ImageId, Lsn, ObjectKey, OsdId, PgId, PoolId};
pub use rpc_error::RpcError;
pub use send_buffer::SendBuffer;
