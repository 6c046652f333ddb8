//! The NVMe completion queue entry (CQE) as a response capsule carries it, and the status
//! codes Basalt answers with.
//!
//! ```text
//!  0 DW0 u32 (command specific)   4 DW1 u32 (command specific)
//!  8 SQ head pointer u16   10 SQ id u16   12 command id u16   14 status u16
//! ```
//!
//! The status field: bit 0 phase tag, bits 8:1 status code (SC), bits 11:9 status code
//! type (SCT), bits 13:12 command retry delay (CRD), bit 14 more (M), bit 15 do not retry
//! (DNR). Over fabrics the phase tag is not used; it is kept so that any 16 bytes
//! round-trip.

use crate::layout::{put_u16, put_u32, u16_at, u32_at};

/// Bytes of a completion queue entry.
pub const CQE_SIZE: usize = 16;

/// Status code type: generic command status.
pub const SCT_GENERIC: u8 = 0x0;
/// Status code type: command specific status.
pub const SCT_COMMAND_SPECIFIC: u8 = 0x1;
/// Status code type: media and data integrity errors.
pub const SCT_MEDIA: u8 = 0x2;
/// Status code type: path related status.
pub const SCT_PATH: u8 = 0x3;
/// Status code type: vendor specific.
pub const SCT_VENDOR_SPECIFIC: u8 = 0x7;

/// A completion status without its phase tag: SC, SCT, CRD, M and DNR as they sit in bits
/// 15:1 of the status field (bit 0 is always clear here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Status(u16);

impl Status {
    /// Successful completion.
    pub const SUCCESS: Status = Status::new(SCT_GENERIC, 0x00);
    /// Invalid command opcode.
    pub const INVALID_OPCODE: Status = Status::new(SCT_GENERIC, 0x01);
    /// Invalid field in command.
    pub const INVALID_FIELD: Status = Status::new(SCT_GENERIC, 0x02);
    /// Command id conflict.
    pub const COMMAND_ID_CONFLICT: Status = Status::new(SCT_GENERIC, 0x03);
    /// Data transfer error.
    pub const DATA_TRANSFER_ERROR: Status = Status::new(SCT_GENERIC, 0x04);
    /// Internal error.
    pub const INTERNAL_ERROR: Status = Status::new(SCT_GENERIC, 0x06);
    /// Command abort requested.
    pub const ABORTED_BY_REQUEST: Status = Status::new(SCT_GENERIC, 0x07);
    /// Command aborted due to SQ deletion (also: the queue was torn down).
    pub const ABORTED_SQ_DELETION: Status = Status::new(SCT_GENERIC, 0x08);
    /// Invalid namespace or format.
    pub const INVALID_NAMESPACE_OR_FORMAT: Status = Status::new(SCT_GENERIC, 0x0b);
    /// Command sequence error (for example a command before Connect).
    pub const COMMAND_SEQUENCE_ERROR: Status = Status::new(SCT_GENERIC, 0x0c);
    /// Data SGL length invalid.
    pub const DATA_SGL_LENGTH_INVALID: Status = Status::new(SCT_GENERIC, 0x0f);
    /// SGL descriptor type invalid.
    pub const SGL_DESCRIPTOR_TYPE_INVALID: Status = Status::new(SCT_GENERIC, 0x11);
    /// SGL offset invalid.
    pub const SGL_OFFSET_INVALID: Status = Status::new(SCT_GENERIC, 0x16);
    /// Host identifier inconsistent format.
    pub const HOST_ID_INCONSISTENT_FORMAT: Status = Status::new(SCT_GENERIC, 0x18);
    /// Keep alive timer expired.
    pub const KEEP_ALIVE_EXPIRED: Status = Status::new(SCT_GENERIC, 0x19);
    /// Keep alive timeout invalid.
    pub const KEEP_ALIVE_INVALID: Status = Status::new(SCT_GENERIC, 0x1a);
    /// Transient transport error: what a command gets when a data digest of its data
    /// failed (the host may retry it).
    pub const TRANSIENT_TRANSPORT_ERROR: Status = Status::new(SCT_GENERIC, 0x22);
    /// LBA out of range (generic, I/O command set range 0x80..).
    pub const LBA_OUT_OF_RANGE: Status = Status::new(SCT_GENERIC, 0x80);
    /// Capacity exceeded.
    pub const CAPACITY_EXCEEDED: Status = Status::new(SCT_GENERIC, 0x81);
    /// Namespace not ready.
    pub const NAMESPACE_NOT_READY: Status = Status::new(SCT_GENERIC, 0x82);

    /// Invalid queue identifier.
    pub const INVALID_QUEUE_ID: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x01);
    /// Invalid queue size.
    pub const INVALID_QUEUE_SIZE: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x02);
    /// Abort command limit exceeded.
    pub const ABORT_LIMIT_EXCEEDED: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x03);
    /// Asynchronous event request limit exceeded.
    pub const ASYNC_EVENT_LIMIT_EXCEEDED: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x05);
    /// Invalid log page.
    pub const INVALID_LOG_PAGE: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x09);
    /// Feature identifier not saveable.
    pub const FEATURE_NOT_SAVEABLE: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x0d);
    /// Feature not changeable.
    pub const FEATURE_NOT_CHANGEABLE: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x0e);
    /// Feature not namespace specific.
    pub const FEATURE_NOT_NAMESPACE_SPECIFIC: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x0f);
    /// NVM command set: attempted write to a read-only range.
    pub const WRITE_TO_READ_ONLY_RANGE: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x82);
    /// Fabrics: incompatible format (Connect record format, for example).
    pub const FABRICS_INCOMPATIBLE_FORMAT: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x80);
    /// Fabrics: controller busy.
    pub const FABRICS_CONTROLLER_BUSY: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x81);
    /// Fabrics: Connect invalid parameters (DW0 says which: see `crate::fabrics`).
    pub const CONNECT_INVALID_PARAMETERS: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x82);
    /// Fabrics: Connect restart discovery.
    pub const CONNECT_RESTART_DISCOVERY: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x83);
    /// Fabrics: Connect invalid host (this host may not use this subsystem).
    pub const CONNECT_INVALID_HOST: Status = Status::new(SCT_COMMAND_SPECIFIC, 0x84);

    /// Write fault.
    pub const WRITE_FAULT: Status = Status::new(SCT_MEDIA, 0x80);
    /// Unrecovered read error.
    pub const UNRECOVERED_READ_ERROR: Status = Status::new(SCT_MEDIA, 0x81);

    /// A status of type `sct` (3 bits) and code `sc`, with CRD, M and DNR clear.
    pub const fn new(sct: u8, sc: u8) -> Self {
        Status((((sct & 0x7) as u16) << 9) | ((sc as u16) << 1))
    }

    /// The status from bits 15:1 of a status field (bit 0, the phase tag, is ignored).
    pub const fn from_field(field: u16) -> Self {
        Status(field & !1)
    }

    /// The status as bits 15:1 of a status field, phase tag clear.
    pub const fn field(self) -> u16 {
        self.0
    }

    /// This status with Do Not Retry set: retrying the same command will fail again.
    pub const fn with_dnr(self) -> Self {
        Status(self.0 | (1 << 15))
    }

    /// This status with More set: the error log holds more about it.
    pub const fn with_more(self) -> Self {
        Status(self.0 | (1 << 14))
    }

    /// The status code.
    pub const fn sc(self) -> u8 {
        (self.0 >> 1) as u8
    }

    /// The status code type.
    pub const fn sct(self) -> u8 {
        ((self.0 >> 9) & 0x7) as u8
    }

    /// The command retry delay selector (0 to 3).
    pub const fn retry_delay(self) -> u8 {
        ((self.0 >> 12) & 0x3) as u8
    }

    /// Whether More is set.
    pub const fn more(self) -> bool {
        self.0 & (1 << 14) != 0
    }

    /// Whether Do Not Retry is set.
    pub const fn dnr(self) -> bool {
        self.0 & (1 << 15) != 0
    }

    /// Whether the command succeeded (SCT and SC zero; CRD, M and DNR do not count).
    pub const fn is_success(self) -> bool {
        self.sct() == SCT_GENERIC && self.sc() == 0
    }
}

/// A completion queue entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cqe {
    /// Dword 0, command specific (Connect: the controller id; Property Get: low value).
    pub dw0: u32,
    /// Dword 1, command specific (Property Get: high value).
    pub dw1: u32,
    /// The submission queue head pointer.
    pub sq_head: u16,
    /// The submission queue id.
    pub sq_id: u16,
    /// The command identifier of the command completed.
    pub command_id: u16,
    /// The status.
    pub status: Status,
    /// The phase tag (unused over fabrics).
    pub phase: bool,
}

impl Cqe {
    /// Decodes 16 bytes; every pattern is a CQE.
    pub fn decode(bytes: &[u8; CQE_SIZE]) -> Self {
        let field = u16_at(bytes, 14);
        Self {
            dw0: u32_at(bytes, 0),
            dw1: u32_at(bytes, 4),
            sq_head: u16_at(bytes, 8),
            sq_id: u16_at(bytes, 10),
            command_id: u16_at(bytes, 12),
            status: Status::from_field(field),
            phase: field & 1 != 0,
        }
    }

    /// Encodes 16 bytes.
    pub fn encode(&self) -> [u8; CQE_SIZE] {
        let mut bytes = [0u8; CQE_SIZE];
        put_u32(&mut bytes, 0, self.dw0);
        put_u32(&mut bytes, 4, self.dw1);
        put_u16(&mut bytes, 8, self.sq_head);
        put_u16(&mut bytes, 10, self.sq_id);
        put_u16(&mut bytes, 12, self.command_id);
        put_u16(&mut bytes, 14, self.status.field() | u16::from(self.phase));
        bytes
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn arb_cqe() -> impl Strategy<Value = Cqe> {
        (
            any::<u32>(),
            any::<u32>(),
            any::<u16>(),
            any::<u16>(),
            any::<u16>(),
            any::<u16>(),
        )
            .prop_map(|(dw0, dw1, sq_head, sq_id, command_id, field)| Cqe {
                dw0,
                dw1,
                sq_head,
                sq_id,
                command_id,
                status: Status::from_field(field),
                phase: field & 1 != 0,
            })
    }

    proptest! {
        #[test]
        fn cqe_round_trips(cqe in arb_cqe()) {
            prop_assert_eq!(Cqe::decode(&cqe.encode()), cqe);
        }

        #[test]
        fn any_16_bytes_are_a_cqe_that_encodes_back(raw in proptest::array::uniform16(any::<u8>())) {
            prop_assert_eq!(Cqe::decode(&raw).encode(), raw);
        }

        #[test]
        fn status_parts_round_trip(sct in 0u8..8, sc: u8, dnr: bool, more: bool) {
            let mut status = Status::new(sct, sc);
            if dnr { status = status.with_dnr(); }
            if more { status = status.with_more(); }
            prop_assert_eq!(status.sct(), sct);
            prop_assert_eq!(status.sc(), sc);
            prop_assert_eq!(status.dnr(), dnr);
            prop_assert_eq!(status.more(), more);
            prop_assert_eq!(status.retry_delay(), 0);
            prop_assert_eq!(status.field() & 1, 0, "the phase tag is not part of a status");
        }
    }

    #[test]
    fn status_field_bits_are_where_the_spec_puts_them() {
        // SCT 1, SC 0x82, DNR: 0x8000 | 1 << 9 | 0x82 << 1.
        let status = Status::CONNECT_INVALID_PARAMETERS.with_dnr();
        assert_eq!(status.field(), 0x8000 | 0x0200 | 0x0104);
        let cqe = Cqe {
            dw0: 0x0001_0002,
            dw1: 0,
            sq_head: 7,
            sq_id: 1,
            command_id: 0xbeef,
            status,
            phase: true,
        };
        assert_eq!(
            cqe.encode(),
            [2, 0, 1, 0, 0, 0, 0, 0, 7, 0, 1, 0, 0xef, 0xbe, 0x05, 0x83]
        );
    }

    #[test]
    fn success_ignores_retry_bits_but_not_codes() {
        assert!(Status::SUCCESS.is_success());
        assert!(Status::SUCCESS.with_dnr().is_success());
        assert!(!Status::INVALID_FIELD.is_success());
        assert!(!Status::new(SCT_MEDIA, 0).is_success());
        assert_eq!(Status::LBA_OUT_OF_RANGE.sc(), 0x80);
        assert_eq!(Status::UNRECOVERED_READ_ERROR.sct(), SCT_MEDIA);
    }
}
