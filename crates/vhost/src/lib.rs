//! The vhost-user-blk backend of the Basalt target (issue #5): QEMU virtual machines use
//! bdevs as virtio disks through a Unix socket, on the rust-vmm crates.
//!
//! - [`request`]: virtio-blk requests parsed from descriptor chains.
//! - [`backend`]: the device (features, configuration space, vrings), requests run on
//!   the target's reactors and completed back on the vring worker.
//! - `direct`: reads and writes of a file bdev submitted by the vring thread itself,
//!   guest memory to file and back, on an io_uring per vring thread.
//! - [`inflight`]: the requests in flight, in a region the frontend keeps across the
//!   target's restarts, and replayed from it after a crash.
//! - [`relay`]: between QEMU and vhost-user-backend: the backend channel, and the
//!   in-flight region's messages, which vhost-user-backend does not handle.
//! - [`controller`]: a controller: its socket, its serving thread, reconnects.
//! - [`rpc`]: the `vhost_*` JSON-RPC methods.

pub mod backend;
pub mod controller;
mod direct;
pub mod inflight;
pub mod relay;
pub mod request;
pub mod rpc;

pub use controller::VhostServer;
