//! The target: one process that owns bdevs and exports them through frontends, managed by
//! JSON-RPC 2.0 on a Unix socket with SPDK's method names (like `spdk_tgt`).
//!
//! - [`target`]: [`Target`], the state (bdev registry, NBD server) and method dispatch.
//! - [`rpc_server`]: the Unix-socket server; requests are JSON objects sent back to back
//!   without framing, as SPDK's `rpc.py` sends them.
//! - [`config`]: the `save_config` document and start-up from it.
//! - [`metrics`]: the Prometheus metrics (`--metrics-addr`).
//!
//! Frontends and bdev kinds sit below this crate and know nothing of it.

pub mod config;
pub mod metrics;
pub mod rpc_server;
pub mod target;

pub use target::Target;

/// Where `basalt target` listens for JSON-RPC unless told otherwise.
pub const DEFAULT_RPC_SOCKET: &str = "/var/tmp/basalt.sock";
