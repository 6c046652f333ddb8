//! Fabrics commands (opcode 0x7f): typed views of the Connect, Property Get/Set and
//! Disconnect SQEs, the 1024 bytes of Connect data, and the Connect response's DW0.
//!
//! The fabrics command type (FCTYPE) is byte 4 of the SQE. Fields past the data pointer:
//!
//! ```text
//! Connect:       40 RECFMT u16   42 QID u16   44 SQSIZE u16 (0's based)   46 CATTR u8
//!                48 KATO u32 (milliseconds)
//! Property Get:  40 ATTRIB u8 (bits 2:0 size: 0 = 4 bytes, 1 = 8 bytes)   44 OFST u32
//! Property Set:  as Property Get, then 48 VALUE u64
//! Disconnect:    40 RECFMT u16
//! ```
//!
//! Connect data (in-capsule, 1024 bytes):
//!
//! ```text
//!    0 HOSTID 16 bytes   16 CNTLID u16 (0xffff: any, dynamic model)   18 reserved
//!  256 SUBNQN 256 bytes  512 HOSTNQN 256 bytes   768 reserved
//! ```
//!
//! NQNs are UTF-8, NUL-terminated within their 256-byte field.

use crate::command::{FABRICS, SglDescriptor, Sqe};
use crate::layout::{put_u16, u16_at};

/// Fabrics command type: Property Set.
pub const FCTYPE_PROPERTY_SET: u8 = 0x00;
/// Fabrics command type: Connect.
pub const FCTYPE_CONNECT: u8 = 0x01;
/// Fabrics command type: Property Get.
pub const FCTYPE_PROPERTY_GET: u8 = 0x04;
/// Fabrics command type: Authentication Send.
pub const FCTYPE_AUTHENTICATION_SEND: u8 = 0x05;
/// Fabrics command type: Authentication Receive.
pub const FCTYPE_AUTHENTICATION_RECEIVE: u8 = 0x06;
/// Fabrics command type: Disconnect (an I/O queue only).
pub const FCTYPE_DISCONNECT: u8 = 0x08;

/// Bytes of Connect data.
pub const CONNECT_DATA_SIZE: usize = 1024;
/// Bytes of an NQN field in Connect data.
pub const NQN_FIELD_SIZE: usize = 256;
/// Bytes of the host identifier.
pub const HOST_ID_SIZE: usize = 16;
/// Where SUBNQN starts in Connect data.
pub const CONNECT_DATA_SUBSYSTEM_NQN_OFFSET: usize = 256;
/// Where HOSTNQN starts in Connect data.
pub const CONNECT_DATA_HOST_NQN_OFFSET: usize = 512;
/// Where CNTLID sits in Connect data.
pub const CONNECT_DATA_CONTROLLER_ID_OFFSET: usize = 16;
/// CNTLID asking the controller to pick (dynamic controller model).
pub const CONTROLLER_ID_DYNAMIC: u16 = 0xffff;
/// The well-known NQN of a discovery subsystem.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";
/// Connect CATTR bit: the host asks to disable SQ flow control (no SQ head pointer
/// updates; C2HData may then carry SUCCESS).
pub const CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL: u8 = 1 << 2;

/// Property offset: controller capabilities (8 bytes).
pub const PROPERTY_CAP: u32 = 0x00;
/// Property offset: version (4 bytes).
pub const PROPERTY_VS: u32 = 0x08;
/// Property offset: controller configuration (4 bytes).
pub const PROPERTY_CC: u32 = 0x14;
/// Property offset: controller status (4 bytes).
pub const PROPERTY_CSTS: u32 = 0x1c;
/// Property offset: NVM subsystem reset (4 bytes).
pub const PROPERTY_NSSR: u32 = 0x20;

const _: () = assert!(CONNECT_DATA_HOST_NQN_OFFSET + NQN_FIELD_SIZE <= CONNECT_DATA_SIZE);
const _: () =
    assert!(CONNECT_DATA_SUBSYSTEM_NQN_OFFSET + NQN_FIELD_SIZE == CONNECT_DATA_HOST_NQN_OFFSET);

/// A fabrics SQE with the common header filled: opcode, command id, FCTYPE.
fn fabrics_sqe(command_type: u8, command_id: u16) -> Sqe {
    Sqe {
        opcode: FABRICS,
        command_id,
        namespace_id: u32::from(command_type),
        ..Sqe::default()
    }
}

/// The fields of a Connect command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ConnectCommand {
    /// Record format (0 is the only one defined).
    pub record_format: u16,
    /// The queue to create: 0 for the admin queue.
    pub queue_id: u16,
    /// Submission queue size, 0's based.
    pub sq_size: u16,
    /// Connect attributes (CATTR).
    pub attributes: u8,
    /// Keep alive timeout in milliseconds (admin queue only; 0 disables).
    pub keep_alive_timeout_ms: u32,
}

impl ConnectCommand {
    /// Reads the fields from a Connect SQE (the caller has checked opcode and FCTYPE).
    pub fn from_sqe(sqe: &Sqe) -> Self {
        Self {
            record_format: sqe.cdw10 as u16,     // bits 15:0
            queue_id: (sqe.cdw10 >> 16) as u16,  // bits 31:16
            sq_size: sqe.cdw11 as u16,           // bits 15:0
            attributes: (sqe.cdw11 >> 16) as u8, // bits 23:16
            keep_alive_timeout_ms: sqe.cdw12,
        }
    }

    /// A Connect SQE whose data (1024 bytes of [`ConnectData`]) is in the capsule.
    pub fn to_sqe(&self, command_id: u16) -> Sqe {
        Sqe {
            // 1024 fits a u32.
            data_pointer: SglDescriptor::in_capsule(CONNECT_DATA_SIZE as u32),
            cdw10: u32::from(self.record_format) | (u32::from(self.queue_id) << 16),
            cdw11: u32::from(self.sq_size) | (u32::from(self.attributes) << 16),
            cdw12: self.keep_alive_timeout_ms,
            ..fabrics_sqe(FCTYPE_CONNECT, command_id)
        }
    }
}

/// The fields of a Property Get or Property Set command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct PropertyCommand {
    /// Whether the property is 8 bytes wide (else 4).
    pub wide: bool,
    /// The property offset (`PROPERTY_*`).
    pub offset: u32,
    /// The value to set (Property Set only).
    pub value: u64,
}

impl PropertyCommand {
    /// Reads the fields from a Property Get or Set SQE.
    pub fn from_sqe(sqe: &Sqe) -> Self {
        Self {
            wide: sqe.cdw10 & 0x7 == 1,
            offset: sqe.cdw11,
            value: u64::from(sqe.cdw12) | (u64::from(sqe.cdw13) << 32),
        }
    }

    /// The size field of ATTRIB (bits 2:0); values other than 0 and 1 are reserved.
    pub fn size_field(sqe: &Sqe) -> u8 {
        (sqe.cdw10 & 0x7) as u8
    }

    /// A Property Get SQE.
    pub fn to_get_sqe(&self, command_id: u16) -> Sqe {
        Sqe {
            cdw10: u32::from(self.wide),
            cdw11: self.offset,
            ..fabrics_sqe(FCTYPE_PROPERTY_GET, command_id)
        }
    }

    /// A Property Set SQE.
    pub fn to_set_sqe(&self, command_id: u16) -> Sqe {
        Sqe {
            cdw10: u32::from(self.wide),
            cdw11: self.offset,
            cdw12: self.value as u32,
            cdw13: (self.value >> 32) as u32,
            ..fabrics_sqe(FCTYPE_PROPERTY_SET, command_id)
        }
    }
}

/// DW0 of a successful Connect response: the controller id (authentication not required).
pub fn connect_response_dw0(controller_id: u16) -> u32 {
    u32::from(controller_id)
}

/// DW0 of a Connect response with [`crate::Status::CONNECT_INVALID_PARAMETERS`]: the byte
/// offset of the invalid parameter (IPO) and whether it lies in the Connect data (IATTR
/// bit 0 set) or in the SQE (clear).
pub fn connect_invalid_parameter_dw0(offset: u16, in_data: bool) -> u32 {
    u32::from(offset) | (u32::from(in_data) << 16)
}

/// Why Connect data cannot be read. Each names the byte offset a Connect response reports
/// with IATTR set (see [`ConnectDataError::invalid_parameter_offset`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConnectDataError {
    /// The data is not 1024 bytes.
    #[error("connect data of {len_bytes} bytes, not {CONNECT_DATA_SIZE}")]
    Size {
        /// Bytes received.
        len_bytes: usize,
    },
    /// An NQN field has no NUL terminator.
    #[error(
        "nqn at connect data byte {offset} has no nul terminator in its {NQN_FIELD_SIZE} bytes"
    )]
    NqnUnterminated {
        /// Offset of the field in the Connect data.
        offset: u16,
    },
    /// An NQN field is not UTF-8.
    #[error("nqn at connect data byte {offset} is not utf-8")]
    NqnNotUtf8 {
        /// Offset of the field in the Connect data.
        offset: u16,
    },
}

impl ConnectDataError {
    /// The offset to report as IPO (with IATTR bit 0 set).
    pub fn invalid_parameter_offset(&self) -> u16 {
        match self {
            ConnectDataError::Size { .. } => 0,
            ConnectDataError::NqnUnterminated { offset }
            | ConnectDataError::NqnNotUtf8 { offset } => *offset,
        }
    }
}

/// The data of a Connect command.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ConnectData {
    /// The host identifier (a UUID-sized value chosen by the host).
    pub host_id: [u8; HOST_ID_SIZE],
    /// The controller asked for: [`CONTROLLER_ID_DYNAMIC`] on the admin queue of a
    /// dynamic controller, the controller's id on I/O queues.
    pub controller_id: u16,
    /// The NQN of the subsystem to connect to.
    pub subsystem_nqn: String,
    /// The NQN of the host.
    pub host_nqn: String,
}

impl ConnectData {
    /// Decodes 1024 bytes of untrusted Connect data.
    pub fn decode(data: &[u8]) -> Result<Self, ConnectDataError> {
        let Ok(bytes) = <&[u8; CONNECT_DATA_SIZE]>::try_from(data) else {
            return Err(ConnectDataError::Size {
                len_bytes: data.len(),
            });
        };
        let mut host_id = [0u8; HOST_ID_SIZE];
        host_id.copy_from_slice(&bytes[..HOST_ID_SIZE]);
        Ok(Self {
            host_id,
            controller_id: u16_at(bytes, CONNECT_DATA_CONTROLLER_ID_OFFSET),
            subsystem_nqn: decode_nqn(bytes, CONNECT_DATA_SUBSYSTEM_NQN_OFFSET)?,
            host_nqn: decode_nqn(bytes, CONNECT_DATA_HOST_NQN_OFFSET)?,
        })
    }

    /// Encodes 1024 bytes. Each NQN must fit its field with its terminator and hold no NUL.
    pub fn encode(&self) -> [u8; CONNECT_DATA_SIZE] {
        let mut bytes = [0u8; CONNECT_DATA_SIZE];
        bytes[..HOST_ID_SIZE].copy_from_slice(&self.host_id);
        put_u16(
            &mut bytes,
            CONNECT_DATA_CONTROLLER_ID_OFFSET,
            self.controller_id,
        );
        encode_nqn(
            &mut bytes,
            CONNECT_DATA_SUBSYSTEM_NQN_OFFSET,
            &self.subsystem_nqn,
        );
        encode_nqn(&mut bytes, CONNECT_DATA_HOST_NQN_OFFSET, &self.host_nqn);
        bytes
    }
}

fn decode_nqn(bytes: &[u8; CONNECT_DATA_SIZE], offset: usize) -> Result<String, ConnectDataError> {
    // The offsets are constants below 1024, so they fit the u16 of the error.
    let field_offset = offset as u16;
    let field = &bytes[offset..offset + NQN_FIELD_SIZE];
    let Some(len) = field.iter().position(|&b| b == 0) else {
        return Err(ConnectDataError::NqnUnterminated {
            offset: field_offset,
        });
    };
    std::str::from_utf8(&field[..len])
        .map(str::to_owned)
        .map_err(|_| ConnectDataError::NqnNotUtf8 {
            offset: field_offset,
        })
}

fn encode_nqn(bytes: &mut [u8; CONNECT_DATA_SIZE], offset: usize, nqn: &str) {
    assert!(
        nqn.len() < NQN_FIELD_SIZE,
        "nqn of {} bytes does not fit its {NQN_FIELD_SIZE}-byte field",
        nqn.len()
    );
    assert!(!nqn.contains('\0'), "nqn {nqn:?} holds a nul");
    bytes[offset..offset + nqn.len()].copy_from_slice(nqn.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn arb_nqn() -> impl Strategy<Value = String> {
        // Printable ASCII and some multi-byte characters, up to the field's limit.
        "[a-z0-9.:-]{0,100}(é|ü|日本)?[a-z0-9]{0,100}"
    }

    proptest! {
        #[test]
        fn connect_data_round_trips(host_id: [u8; 16], controller_id: u16, subsystem_nqn in arb_nqn(), host_nqn in arb_nqn()) {
            let data = ConnectData { host_id, controller_id, subsystem_nqn, host_nqn };
            prop_assert_eq!(ConnectData::decode(&data.encode()), Ok(data));
        }

        #[test]
        fn connect_data_decode_never_panics(data in proptest::collection::vec(any::<u8>(), 0..1100)) {
            let _ = ConnectData::decode(&data);
        }

        #[test]
        fn connect_command_round_trips(record_format: u16, queue_id: u16, sq_size: u16, attributes: u8, keep_alive_timeout_ms: u32, command_id: u16) {
            let connect = ConnectCommand { record_format, queue_id, sq_size, attributes, keep_alive_timeout_ms };
            let sqe = connect.to_sqe(command_id);
            prop_assert_eq!(sqe.fabrics_command_type(), FCTYPE_CONNECT);
            prop_assert_eq!(ConnectCommand::from_sqe(&Sqe::decode(&sqe.encode())), connect);
        }

        #[test]
        fn property_commands_round_trip(wide: bool, offset: u32, value: u64) {
            let property = PropertyCommand { wide, offset, value };
            let set = Sqe::decode(&property.to_set_sqe(3).encode());
            prop_assert_eq!(set.fabrics_command_type(), FCTYPE_PROPERTY_SET);
            prop_assert_eq!(PropertyCommand::from_sqe(&set), property);
            let get = property.to_get_sqe(4);
            prop_assert_eq!(get.fabrics_command_type(), FCTYPE_PROPERTY_GET);
            prop_assert_eq!(PropertyCommand::from_sqe(&get), PropertyCommand { value: 0, ..property });
        }
    }

    #[test]
    fn connect_data_fields_are_where_the_spec_puts_them() {
        let data = ConnectData {
            host_id: [0xaa; 16],
            controller_id: CONTROLLER_ID_DYNAMIC,
            subsystem_nqn: "nqn.2026-01.io.basalt:disk0".into(),
            host_nqn: "nqn.2014-08.org.nvmexpress:uuid:1".into(),
        };
        let bytes = data.encode();
        assert_eq!(&bytes[..16], &[0xaa; 16]);
        assert_eq!(&bytes[16..18], &[0xff, 0xff]);
        assert!(bytes[18..256].iter().all(|&b| b == 0));
        assert_eq!(&bytes[256..283], b"nqn.2026-01.io.basalt:disk0");
        assert_eq!(bytes[283], 0);
        assert_eq!(&bytes[512..545], b"nqn.2014-08.org.nvmexpress:uuid:1");
        assert!(bytes[768..].iter().all(|&b| b == 0));
    }

    #[test]
    fn bad_nqns_name_their_field() {
        let mut bytes = ConnectData::default().encode();
        bytes[256..512].fill(b'a');
        assert_eq!(
            ConnectData::decode(&bytes),
            Err(ConnectDataError::NqnUnterminated { offset: 256 })
        );
        let mut bytes = ConnectData::default().encode();
        bytes[512] = 0xff;
        let error = ConnectData::decode(&bytes).expect_err("not utf-8");
        assert_eq!(error, ConnectDataError::NqnNotUtf8 { offset: 512 });
        assert_eq!(error.invalid_parameter_offset(), 512);
        assert_eq!(
            ConnectData::decode(&bytes[..1000]),
            Err(ConnectDataError::Size { len_bytes: 1000 })
        );
    }

    #[test]
    fn connect_sqe_fields_are_where_the_spec_puts_them() {
        let sqe = ConnectCommand {
            record_format: 0,
            queue_id: 3,
            sq_size: 127,
            attributes: CONNECT_ATTRIBUTE_DISABLE_SQ_FLOW_CONTROL,
            keep_alive_timeout_ms: 0,
        }
        .to_sqe(9);
        let bytes = sqe.encode();
        assert_eq!(bytes[0], 0x7f);
        assert_eq!(bytes[4], 0x01, "FCTYPE");
        assert_eq!(bytes[39], 0x01, "in-capsule data descriptor");
        assert_eq!(&bytes[32..36], &[0, 4, 0, 0], "1024 bytes of data");
        assert_eq!(&bytes[40..48], &[0, 0, 3, 0, 127, 0, 0x04, 0]);
    }

    #[test]
    fn connect_response_dw0_layouts() {
        assert_eq!(connect_response_dw0(5), 5);
        assert_eq!(connect_invalid_parameter_dw0(256, true), 0x0001_0100);
        assert_eq!(connect_invalid_parameter_dw0(42, false), 42);
    }
}
