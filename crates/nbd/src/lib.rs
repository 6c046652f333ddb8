//! The NBD frontend: a fixed-newstyle NBD server exporting bdevs, an NBD client, and the
//! `nbd_*` JSON-RPC methods.
//!
//! - [`protocol`]: the wire format (constants, request and reply codecs); pure, no I/O.
//! - [`handshake`]: option haggling on the server side.
//! - [`server`]: the listener, exports, and each connection from negotiation to close.
//! - [`transmission`]: the transmission phase: pipelined requests executed concurrently and
//!   answered as they complete, in one task per connection.
//! - [`client`]: an NBD client with many requests in flight, for `basalt bench --nbd` and tests.
//! - [`rpc`]: `nbd_server_start`, `nbd_server_add_export`, `nbd_get_exports`, ...
//!
//! This crate sees only `basalt_bdev::Bdev`; it knows nothing of PGs or OSDs.
//! Protocol reference: the NBD protocol document (`doc/proto.md` of the NBD project).

pub mod client;
pub mod handshake;
pub mod protocol;
pub mod rpc;
pub mod server;
pub mod transmission;

pub use client::{NbdClient, NbdUri};
pub use server::NbdServer;
