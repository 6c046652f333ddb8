//! The NVMe submission queue entry (SQE) as a command capsule carries it, its SGL data
//! pointer, and the opcodes and identifiers Basalt serves.
//!
//! ```text
//!  0 opcode u8   1 flags u8 (FUSE bits 1:0, PSDT bits 7:6)   2 command id u16
//!  4 namespace id u32 (byte 4 is FCTYPE in a fabrics command)
//!  8 CDW2 u32   12 CDW3 u32   16 metadata pointer u64
//! 24 data pointer: SGL descriptor, 16 bytes (below)
//! 40 CDW10  44 CDW11  48 CDW12  52 CDW13  56 CDW14  60 CDW15 (u32 each)
//! ```
//!
//! The SGL descriptor: `0 address u64, 8 length u32, 12 reserved 3 bytes, 15 identifier`
//! (type in bits 7:4, subtype in bits 3:0). NVMe/TCP uses two kinds: in-capsule data
//! (Data Block, subtype Offset: identifier 0x01, the address is an offset into the
//! capsule's data and is 0 on TCP) and data moved by R2T/H2CData or C2HData PDUs
//! (Transport Data Block, subtype Transport Specific: identifier 0x5a, address 0).
//!
//! Every 64-byte pattern decodes to an [`Sqe`] and encodes back to the same bytes: the
//! meaning of the fields is for the controller to judge, not this codec.

use crate::layout::{put_u16, put_u32, put_u64, u16_at, u32_at, u64_at};

/// Bytes of a submission queue entry.
pub const SQE_SIZE: usize = 64;
/// Bytes of an SGL descriptor.
pub const SGL_DESCRIPTOR_SIZE: usize = 16;
/// Where the data pointer (SGL1) starts in an SQE.
pub const SQE_DATA_POINTER_OFFSET: usize = 24;

/// Admin opcode: Get Log Page.
pub const ADMIN_GET_LOG_PAGE: u8 = 0x02;
/// Admin opcode: Identify.
pub const ADMIN_IDENTIFY: u8 = 0x06;
/// Admin opcode: Abort.
pub const ADMIN_ABORT: u8 = 0x08;
/// Admin opcode: Set Features.
pub const ADMIN_SET_FEATURES: u8 = 0x09;
/// Admin opcode: Get Features.
pub const ADMIN_GET_FEATURES: u8 = 0x0a;
/// Admin opcode: Asynchronous Event Request.
pub const ADMIN_ASYNC_EVENT_REQUEST: u8 = 0x0c;
/// Admin opcode: Keep Alive.
pub const ADMIN_KEEP_ALIVE: u8 = 0x18;
/// Fabrics commands (Connect, Property Get/Set, Disconnect, ...), on admin and I/O queues
/// alike; the fabrics command type is in byte 4 (see `crate::fabrics`).
pub const FABRICS: u8 = 0x7f;

/// I/O opcode (NVM command set): Flush.
pub const IO_FLUSH: u8 = 0x00;
/// I/O opcode: Write.
pub const IO_WRITE: u8 = 0x01;
/// I/O opcode: Read.
pub const IO_READ: u8 = 0x02;
/// I/O opcode: Write Zeroes.
pub const IO_WRITE_ZEROES: u8 = 0x08;
/// I/O opcode: Dataset Management (deallocate ranges).
pub const IO_DATASET_MANAGEMENT: u8 = 0x09;

/// Identify CNS (CDW10 bits 7:0): the namespace named by NSID.
pub const CNS_NAMESPACE: u8 = 0x00;
/// Identify CNS: the controller.
pub const CNS_CONTROLLER: u8 = 0x01;
/// Identify CNS: active namespace ids above NSID.
pub const CNS_ACTIVE_NAMESPACES: u8 = 0x02;
/// Identify CNS: namespace identification descriptors (UUID, NGUID, EUI-64).
pub const CNS_NAMESPACE_DESCRIPTORS: u8 = 0x03;
/// Identify CNS: the I/O command set specific Identify Namespace (CSI in CDW11).
pub const CNS_NAMESPACE_COMMAND_SET: u8 = 0x05;
/// Identify CNS: the I/O command set specific Identify Controller (CSI in CDW11).
pub const CNS_CONTROLLER_COMMAND_SET: u8 = 0x06;

/// Log page id (Get Log Page CDW10 bits 7:0): error information.
pub const LOG_ERROR: u8 = 0x01;
/// Log page id: SMART / health information.
pub const LOG_HEALTH: u8 = 0x02;
/// Log page id: firmware slot information.
pub const LOG_FIRMWARE_SLOT: u8 = 0x03;
/// Log page id: changed namespace list.
pub const LOG_CHANGED_NAMESPACES: u8 = 0x04;
/// Log page id: commands supported and effects.
pub const LOG_COMMAND_EFFECTS: u8 = 0x05;
/// Log page id: asymmetric namespace access.
pub const LOG_ASYMMETRIC_NAMESPACE_ACCESS: u8 = 0x0c;
/// Log page id: discovery (discovery controllers only).
pub const LOG_DISCOVERY: u8 = 0x70;

/// Feature id (Set/Get Features CDW10 bits 7:0): arbitration.
pub const FEATURE_ARBITRATION: u8 = 0x01;
/// Feature id: power management.
pub const FEATURE_POWER_MANAGEMENT: u8 = 0x02;
/// Feature id: temperature threshold.
pub const FEATURE_TEMPERATURE_THRESHOLD: u8 = 0x04;
/// Feature id: error recovery.
pub const FEATURE_ERROR_RECOVERY: u8 = 0x05;
/// Feature id: volatile write cache.
pub const FEATURE_VOLATILE_WRITE_CACHE: u8 = 0x06;
/// Feature id: number of queues.
pub const FEATURE_NUMBER_OF_QUEUES: u8 = 0x07;
/// Feature id: write atomicity normal.
pub const FEATURE_WRITE_ATOMICITY: u8 = 0x0a;
/// Feature id: asynchronous event configuration.
pub const FEATURE_ASYNC_EVENT_CONFIGURATION: u8 = 0x0b;
/// Feature id: keep alive timer.
pub const FEATURE_KEEP_ALIVE_TIMER: u8 = 0x0f;
/// Feature id: host identifier.
pub const FEATURE_HOST_IDENTIFIER: u8 = 0x81;

/// Mask of the FUSE bits in the flags byte.
pub const FLAGS_FUSE_MASK: u8 = 0b0000_0011;
/// Shift of the PSDT field in the flags byte.
pub const FLAGS_PSDT_SHIFT: u8 = 6;
/// PSDT: PRPs (not valid on fabrics).
pub const PSDT_PRP: u8 = 0b00;
/// PSDT: SGL for data, metadata pointer to a contiguous buffer. What fabrics hosts set.
pub const PSDT_SGL: u8 = 0b01;
/// PSDT: SGL for data and for metadata.
pub const PSDT_SGL_METADATA_SGL: u8 = 0b10;

/// SGL descriptor type (identifier bits 7:4): Data Block.
pub const SGL_TYPE_DATA_BLOCK: u8 = 0x0;
/// SGL descriptor type: Transport Data Block.
pub const SGL_TYPE_TRANSPORT_DATA_BLOCK: u8 = 0x5;
/// SGL descriptor subtype (identifier bits 3:0): Address.
pub const SGL_SUBTYPE_ADDRESS: u8 = 0x0;
/// SGL descriptor subtype: Offset (the address is an offset into in-capsule data).
pub const SGL_SUBTYPE_OFFSET: u8 = 0x1;
/// SGL descriptor subtype: Transport Specific.
pub const SGL_SUBTYPE_TRANSPORT: u8 = 0xa;
/// Identifier of an in-capsule data descriptor (Data Block, Offset).
pub const SGL_IDENTIFIER_IN_CAPSULE: u8 = (SGL_TYPE_DATA_BLOCK << 4) | SGL_SUBTYPE_OFFSET;
/// Identifier of a transport data descriptor (Transport Data Block, Transport Specific):
/// data moves in R2T/H2CData or C2HData PDUs.
pub const SGL_IDENTIFIER_TRANSPORT: u8 =
    (SGL_TYPE_TRANSPORT_DATA_BLOCK << 4) | SGL_SUBTYPE_TRANSPORT;

/// An SGL descriptor in the unkeyed form NVMe/TCP uses. The reserved bytes are kept so
/// that any 16 bytes round-trip.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SglDescriptor {
    /// Address, or the offset into in-capsule data.
    pub address: u64,
    /// Length in bytes.
    pub length: u32,
    /// Bytes 12..15, reserved in the unkeyed descriptors NVMe/TCP uses.
    pub reserved: [u8; 3],
    /// Type (bits 7:4) and subtype (bits 3:0).
    pub identifier: u8,
}

impl SglDescriptor {
    /// An in-capsule data descriptor for `length` bytes; on TCP the data starts at offset 0.
    pub fn in_capsule(length: u32) -> Self {
        Self {
            address: 0,
            length,
            reserved: [0; 3],
            identifier: SGL_IDENTIFIER_IN_CAPSULE,
        }
    }

    /// A transport data descriptor for `length` bytes moved by data PDUs.
    pub fn transport(length: u32) -> Self {
        Self {
            address: 0,
            length,
            reserved: [0; 3],
            identifier: SGL_IDENTIFIER_TRANSPORT,
        }
    }

    /// The descriptor type (identifier bits 7:4).
    pub fn descriptor_type(&self) -> u8 {
        self.identifier >> 4
    }

    /// The descriptor subtype (identifier bits 3:0).
    pub fn subtype(&self) -> u8 {
        self.identifier & 0x0f
    }

    /// Whether the data is in the capsule.
    pub fn is_in_capsule(&self) -> bool {
        self.identifier == SGL_IDENTIFIER_IN_CAPSULE
    }

    /// Whether the data moves in data PDUs.
    pub fn is_transport(&self) -> bool {
        self.identifier == SGL_IDENTIFIER_TRANSPORT
    }

    /// Decodes 16 bytes.
    pub fn decode(bytes: &[u8; SGL_DESCRIPTOR_SIZE]) -> Self {
        Self {
            address: u64_at(bytes, 0),
            length: u32_at(bytes, 8),
            reserved: [bytes[12], bytes[13], bytes[14]],
            identifier: bytes[15],
        }
    }

    /// Encodes 16 bytes.
    pub fn encode(&self) -> [u8; SGL_DESCRIPTOR_SIZE] {
        let mut bytes = [0u8; SGL_DESCRIPTOR_SIZE];
        put_u64(&mut bytes, 0, self.address);
        put_u32(&mut bytes, 8, self.length);
        bytes[12..15].copy_from_slice(&self.reserved);
        bytes[15] = self.identifier;
        bytes
    }
}

/// A submission queue entry. Command-specific dwords stay raw; typed views of the fabrics
/// commands are in `crate::fabrics`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Sqe {
    /// The opcode (`ADMIN_*`, `IO_*` or [`FABRICS`]).
    pub opcode: u8,
    /// FUSE (bits 1:0), reserved (bits 5:2), PSDT (bits 7:6).
    pub flags: u8,
    /// The command identifier, echoed in the completion and the data PDUs.
    pub command_id: u16,
    /// The namespace id; in a fabrics command, byte 0 of it is the fabrics command type.
    pub namespace_id: u32,
    /// Command dword 2.
    pub cdw2: u32,
    /// Command dword 3.
    pub cdw3: u32,
    /// The metadata pointer.
    pub metadata_pointer: u64,
    /// The data pointer: SGL1.
    pub data_pointer: SglDescriptor,
    /// Command dword 10.
    pub cdw10: u32,
    /// Command dword 11.
    pub cdw11: u32,
    /// Command dword 12.
    pub cdw12: u32,
    /// Command dword 13.
    pub cdw13: u32,
    /// Command dword 14.
    pub cdw14: u32,
    /// Command dword 15.
    pub cdw15: u32,
}

impl Sqe {
    /// The fused-operation bits (0: normal command).
    pub fn fuse(&self) -> u8 {
        self.flags & FLAGS_FUSE_MASK
    }

    /// The PRP or SGL data transfer field (`PSDT_*`).
    pub fn psdt(&self) -> u8 {
        self.flags >> FLAGS_PSDT_SHIFT
    }

    /// The fabrics command type (byte 4), meaningful when the opcode is [`FABRICS`].
    pub fn fabrics_command_type(&self) -> u8 {
        self.namespace_id.to_le_bytes()[0]
    }

    /// Decodes 64 bytes; every pattern is an SQE.
    pub fn decode(bytes: &[u8; SQE_SIZE]) -> Self {
        let mut sgl = [0u8; SGL_DESCRIPTOR_SIZE];
        sgl.copy_from_slice(&bytes[SQE_DATA_POINTER_OFFSET..SQE_DATA_POINTER_OFFSET + 16]);
        Self {
            opcode: bytes[0],
            flags: bytes[1],
            command_id: u16_at(bytes, 2),
            namespace_id: u32_at(bytes, 4),
            cdw2: u32_at(bytes, 8),
            cdw3: u32_at(bytes, 12),
            metadata_pointer: u64_at(bytes, 16),
            data_pointer: SglDescriptor::decode(&sgl),
            cdw10: u32_at(bytes, 40),
            cdw11: u32_at(bytes, 44),
            cdw12: u32_at(bytes, 48),
            cdw13: u32_at(bytes, 52),
            cdw14: u32_at(bytes, 56),
            cdw15: u32_at(bytes, 60),
        }
    }

    /// Encodes 64 bytes.
    pub fn encode(&self) -> [u8; SQE_SIZE] {
        let mut bytes = [0u8; SQE_SIZE];
        bytes[0] = self.opcode;
        bytes[1] = self.flags;
        put_u16(&mut bytes, 2, self.command_id);
        put_u32(&mut bytes, 4, self.namespace_id);
        put_u32(&mut bytes, 8, self.cdw2);
        put_u32(&mut bytes, 12, self.cdw3);
        put_u64(&mut bytes, 16, self.metadata_pointer);
        bytes[SQE_DATA_POINTER_OFFSET..SQE_DATA_POINTER_OFFSET + 16]
            .copy_from_slice(&self.data_pointer.encode());
        put_u32(&mut bytes, 40, self.cdw10);
        put_u32(&mut bytes, 44, self.cdw11);
        put_u32(&mut bytes, 48, self.cdw12);
        put_u32(&mut bytes, 52, self.cdw13);
        put_u32(&mut bytes, 56, self.cdw14);
        put_u32(&mut bytes, 60, self.cdw15);
        bytes
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn arb_sgl() -> impl Strategy<Value = SglDescriptor> {
        (any::<u64>(), any::<u32>(), any::<[u8; 3]>(), any::<u8>()).prop_map(
            |(address, length, reserved, identifier)| SglDescriptor {
                address,
                length,
                reserved,
                identifier,
            },
        )
    }

    pub(crate) fn arb_sqe() -> impl Strategy<Value = Sqe> {
        (
            (any::<u8>(), any::<u8>(), any::<u16>(), any::<u32>()),
            (any::<u32>(), any::<u32>(), any::<u64>(), arb_sgl()),
            any::<[u32; 6]>(),
        )
            .prop_map(
                |(
                    (opcode, flags, command_id, namespace_id),
                    (cdw2, cdw3, metadata_pointer, data_pointer),
                    cdw,
                )| Sqe {
                    opcode,
                    flags,
                    command_id,
                    namespace_id,
                    cdw2,
                    cdw3,
                    metadata_pointer,
                    data_pointer,
                    cdw10: cdw[0],
                    cdw11: cdw[1],
                    cdw12: cdw[2],
                    cdw13: cdw[3],
                    cdw14: cdw[4],
                    cdw15: cdw[5],
                },
            )
    }

    proptest! {
        #[test]
        fn sqe_round_trips(sqe in arb_sqe()) {
            prop_assert_eq!(Sqe::decode(&sqe.encode()), sqe);
        }

        #[test]
        fn any_64_bytes_are_an_sqe_that_encodes_back(bytes in proptest::array::uniform32(any::<u8>()), more in proptest::array::uniform32(any::<u8>())) {
            let mut raw = [0u8; SQE_SIZE];
            raw[..32].copy_from_slice(&bytes);
            raw[32..].copy_from_slice(&more);
            prop_assert_eq!(Sqe::decode(&raw).encode(), raw);
        }

        #[test]
        fn sgl_round_trips(sgl in arb_sgl()) {
            prop_assert_eq!(SglDescriptor::decode(&sgl.encode()), sgl);
        }
    }

    #[test]
    fn a_read_sqe_has_its_fields_where_the_spec_puts_them() {
        let sqe = Sqe {
            opcode: IO_READ,
            flags: PSDT_SGL << FLAGS_PSDT_SHIFT,
            command_id: 0x1234,
            namespace_id: 1,
            data_pointer: SglDescriptor::transport(8192),
            cdw10: 0x0000_0010, // starting LBA, low dword
            cdw12: 15,          // 16 blocks, 0's based
            ..Sqe::default()
        };
        let bytes = sqe.encode();
        assert_eq!(bytes[0], 0x02);
        assert_eq!(bytes[1], 0x40, "PSDT 01b is bit 6");
        assert_eq!(&bytes[2..4], &[0x34, 0x12]);
        assert_eq!(&bytes[4..8], &[1, 0, 0, 0]);
        assert_eq!(
            &bytes[24..32],
            &[0; 8],
            "transport descriptors carry no address"
        );
        assert_eq!(&bytes[32..36], &[0x00, 0x20, 0, 0], "length 8192");
        assert_eq!(bytes[39], 0x5a, "Transport Data Block, Transport Specific");
        assert_eq!(&bytes[40..44], &[0x10, 0, 0, 0]);
        assert_eq!(&bytes[48..52], &[15, 0, 0, 0]);
        assert_eq!(sqe.psdt(), PSDT_SGL);
        assert_eq!(sqe.fuse(), 0);
    }

    #[test]
    fn sgl_identifiers_split_into_type_and_subtype() {
        let in_capsule = SglDescriptor::in_capsule(1024);
        assert_eq!(in_capsule.identifier, 0x01);
        assert_eq!(in_capsule.descriptor_type(), SGL_TYPE_DATA_BLOCK);
        assert_eq!(in_capsule.subtype(), SGL_SUBTYPE_OFFSET);
        assert!(in_capsule.is_in_capsule() && !in_capsule.is_transport());
        let transport = SglDescriptor::transport(4096);
        assert_eq!(transport.descriptor_type(), SGL_TYPE_TRANSPORT_DATA_BLOCK);
        assert_eq!(transport.subtype(), SGL_SUBTYPE_TRANSPORT);
        assert!(transport.is_transport() && !transport.is_in_capsule());
    }

    #[test]
    fn fabrics_command_type_is_byte_four() {
        let mut raw = [0u8; SQE_SIZE];
        raw[0] = FABRICS;
        raw[4] = 0x01;
        let sqe = Sqe::decode(&raw);
        assert_eq!(sqe.opcode, 0x7f);
        assert_eq!(sqe.fabrics_command_type(), 0x01);
    }
}
