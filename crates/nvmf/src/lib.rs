//! The NVMe/TCP frontend of the Basalt target (issue #4). For now: the wire format alone,
//! as pure codecs with no I/O, for the connection code to come.
//!
//! - [`pdu`]: NVMe/TCP PDU layouts (common header, ICReq/ICResp, TermReqs, command and
//!   response capsules, H2CData/C2HData, R2T), the state ICReq/ICResp negotiate, and the
//!   encoder producing exact bytes (digests, padding) for batched or vectored writes.
//! - [`decoder`]: the streaming decoder over a receive buffer, and the errors that carry
//!   the fatal error status of the TermReq to send.
//! - [`command`]: the NVMe submission queue entry, its SGL data pointer, and opcodes.
//! - [`completion`]: the completion queue entry, the status field and status codes.
//! - [`fabrics`]: Connect, Property Get/Set and Disconnect, and the Connect data.
//!
//! This crate will see only `basalt_bdev::Bdev`; it knows nothing of PGs or OSDs. Every
//! decoder takes untrusted bytes and never panics on them; encoders assert what only a
//! bug in this process could get wrong. Protocol references: the NVM Express TCP
//! Transport Specification 1.0 (formerly NVMe-oF TP 8000), NVMe over Fabrics 1.1 and the
//! NVMe base specification. `docs/internals/nvmf.md` lists the choices made where the
//! implementations differ.

pub mod command;
pub mod completion;
pub mod decoder;
pub mod fabrics;
mod layout;
pub mod pdu;

pub use command::{SglDescriptor, Sqe};
pub use completion::{Cqe, Status};
pub use decoder::{FatalErrorStatus, PduError, decode, term_req_error_data};
pub use fabrics::{ConnectCommand, ConnectData, ConnectDataError, PropertyCommand};
pub use pdu::{Negotiated, Pdu, Role, encode, encode_header};
