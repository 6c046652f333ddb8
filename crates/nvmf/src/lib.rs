//! The NVMe/TCP frontend of the Basalt target (issue #4): the wire format as pure codecs,
//! and the target built on them.
//!
//! - [`pdu`]: NVMe/TCP PDU layouts (common header, ICReq/ICResp, TermReqs, command and
//!   response capsules, H2CData/C2HData, R2T), the state ICReq/ICResp negotiate, and the
//!   encoder producing exact bytes (digests, padding) for batched or vectored writes.
//! - [`decoder`]: the streaming decoder over a receive buffer, and the errors that carry
//!   the fatal error status of the TermReq to send.
//! - [`command`]: the NVMe submission queue entry, its SGL data pointer, and opcodes.
//! - [`completion`]: the completion queue entry, the status field and status codes.
//! - [`fabrics`]: Connect, Property Get/Set and Disconnect, and the Connect data.
//! - [`subsystem`]: transport options, subsystems, namespaces, listen addresses, NQNs.
//! - [`identify`]: Identify data and log pages.
//! - [`controller`]: a controller's properties, features, events, keep-alive, and its
//!   admin commands.
//! - [`io_command`]: the NVM command set on a namespace's bdev.
//! - [`connection`]: one TCP connection (queue pair), from ICReq to close.
//! - [`target`]: the target: subsystems, listeners, Connect.
//! - [`host`]: a userspace initiator for `basalt bench --nvmf` and the tests.
//! - [`rpc`]: the `nvmf_*` JSON-RPC methods and their `save_config` calls.
//!
//! This crate will see only `basalt_bdev::Bdev`; it knows nothing of PGs or OSDs. Every
//! decoder takes untrusted bytes and never panics on them; encoders assert what only a
//! bug in this process could get wrong. Protocol references: the NVM Express TCP
//! Transport Specification 1.0 (formerly NVMe-oF TP 8000), NVMe over Fabrics 1.1 and the
//! NVMe base specification. `docs/internals/nvmf.md` lists the choices made where the
//! implementations differ.

pub mod budget;
pub mod command;
pub mod completion;
pub mod connection;
pub mod controller;
pub mod decoder;
pub mod fabrics;
pub mod host;
pub mod identify;
pub mod io_command;
mod layout;
pub mod pdu;
pub mod rpc;
pub mod subsystem;
pub mod target;

pub use command::{SglDescriptor, Sqe};
pub use completion::{Cqe, Status};
pub use decoder::{FatalErrorStatus, PduError, decode, term_req_error_data};
pub use fabrics::{ConnectCommand, ConnectData, ConnectDataError, PropertyCommand};
pub use pdu::{Negotiated, Pdu, Role, encode, encode_header};
pub use target::NvmfTarget;
