//! Disk I/O for Basalt: the one crate (with `vhost`'s guest memory) that holds `unsafe`.
//!
//! - [`dma_buf`]: [`DmaBuf`], a heap buffer aligned for O_DIRECT.
//! - [`file_engine`]: [`FileEngine`], a file or block device driven by an io_uring thread
//!   with many requests in flight, or by blocking `pread`/`pwrite` where io_uring is
//!   refused; both complete async callers.
//! - [`device`]: facts about a path (block device or not, its size).
//! - [`reactor`]: [`Reactors`], threads that each run a single-threaded runtime and own the
//!   connections handed to them.
//! - [`unix_fds`]: bytes and file descriptors over a Unix stream socket (`SCM_RIGHTS`).
//! - [`tcp_options`]: keep-alive, which finds peers gone without closing.
//!
//! Invariant: a buffer handed to the kernel stays owned by the engine until its completion
//! arrives, so the kernel never writes into freed memory.

pub mod device;
pub mod dma_buf;
pub mod file_engine;
pub mod process;
pub mod reactor;
pub mod tcp_options;
pub mod unix_fds;

pub use dma_buf::DmaBuf;
pub use file_engine::{AllocateMode, FileEngine, OpenError, OpenOptions};
pub use reactor::{Placement, Reactors, pin_current_thread};

pub use process::default_sigpipe;
