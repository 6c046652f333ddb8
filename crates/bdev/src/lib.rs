//! Block devices ("bdevs") of the Basalt target, and the JSON-RPC methods that manage them.
//!
//! - [`bdev`]: the [`Bdev`] trait every frontend uses, [`BdevInfo`], and [`Extent`], a byte
//!   range proven in range and block-aligned, so no kind ever sees a bad request.
//! - [`malloc`]: RAM-backed, thin (untouched chunks cost no memory).
//! - [`file`]: a file or block device through `basalt_io::FileEngine` (io_uring, O_DIRECT).
//! - [`gated`]: a decorator whose chosen operations wait for a gate (a stalled device, for
//!   frontends' tests).
//! - [`io_stats`]: a decorator counting operations, bytes and latency per bdev.
//! - [`registry`]: bdevs by name, with claims so a bdev in use cannot be deleted.
//! - [`rpc`]: `bdev_malloc_create`, `bdev_uring_create`, `bdev_get_bdevs`, ... (SPDK names).
//! - [`uuid`]: random and parsed UUIDs for bdevs.
//!
//! This crate knows nothing of frontends (NBD, NVMe/TCP, vhost) that sit above it.

pub mod bdev;
pub mod file;
pub mod gated;
pub mod image;
pub mod io_stats;
pub mod malloc;
pub mod registry;
pub mod rpc;
pub mod uuid;

pub use bdev::{Bdev, BdevError, BdevFuture, BdevInfo, Extent, IO_BYTES_MAX, InPlace};
pub use registry::BdevRegistry;
