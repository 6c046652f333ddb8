//! The NBD wire format: constants and codecs. No I/O; every decoder takes untrusted bytes.
//!
//! All integers on the wire are big-endian.

/// `NBDMAGIC`, first 8 bytes the server sends.
pub const INIT_MAGIC: u64 = 0x4e42_444d_4147_4943;
/// `IHAVEOPT`: newstyle negotiation, and the prefix of every client option.
pub const OPTION_MAGIC: u64 = 0x4948_4156_454f_5054;
/// Prefix of every option reply.
pub const OPTION_REPLY_MAGIC: u64 = 0x0003_e889_0455_65a9;
/// Prefix of every transmission request.
pub const REQUEST_MAGIC: u32 = 0x2560_9513;
/// Prefix of a simple reply.
pub const SIMPLE_REPLY_MAGIC: u32 = 0x6744_6698;
/// Prefix of a structured reply chunk.
pub const STRUCTURED_REPLY_MAGIC: u32 = 0x668e_33ef;

/// Handshake flags (server to client).
pub const FLAG_FIXED_NEWSTYLE: u16 = 1 << 0;
/// The server will not send 124 bytes of zeroes after NBD_OPT_EXPORT_NAME.
pub const FLAG_NO_ZEROES: u16 = 1 << 1;
/// Client flags (client to server).
pub const CLIENT_FLAG_FIXED_NEWSTYLE: u32 = 1 << 0;
/// The client does not want the 124 zero bytes.
pub const CLIENT_FLAG_NO_ZEROES: u32 = 1 << 1;

/// Transmission flags of an export.
pub const TRANSMISSION_HAS_FLAGS: u16 = 1 << 0;
/// The export is read-only.
pub const TRANSMISSION_READ_ONLY: u16 = 1 << 1;
/// NBD_CMD_FLUSH is supported.
pub const TRANSMISSION_SEND_FLUSH: u16 = 1 << 2;
/// NBD_CMD_FLAG_FUA is supported.
pub const TRANSMISSION_SEND_FUA: u16 = 1 << 3;
/// NBD_CMD_TRIM is supported.
pub const TRANSMISSION_SEND_TRIM: u16 = 1 << 5;
/// NBD_CMD_WRITE_ZEROES is supported.
pub const TRANSMISSION_SEND_WRITE_ZEROES: u16 = 1 << 6;
/// Several connections to the export see one consistent device, and a flush on one
/// covers writes completed on all.
pub const TRANSMISSION_CAN_MULTI_CONN: u16 = 1 << 8;
/// The server honours NBD_CMD_FLAG_DF (sent only with structured replies).
pub const TRANSMISSION_SEND_DF: u16 = 1 << 7;

/// Options.
pub const OPT_EXPORT_NAME: u32 = 1;
/// End negotiation without transmission.
pub const OPT_ABORT: u32 = 2;
/// List exports.
pub const OPT_LIST: u32 = 3;
/// TLS (not offered).
pub const OPT_STARTTLS: u32 = 5;
/// Export information without entering transmission.
pub const OPT_INFO: u32 = 6;
/// Export information, then transmission.
pub const OPT_GO: u32 = 7;
/// Structured replies.
pub const OPT_STRUCTURED_REPLY: u32 = 8;

/// Option reply types.
pub const REP_ACK: u32 = 1;
/// One export in reply to NBD_OPT_LIST.
pub const REP_SERVER: u32 = 2;
/// One information item in reply to NBD_OPT_INFO or NBD_OPT_GO.
pub const REP_INFO: u32 = 3;
/// Option not supported.
pub const REP_ERR_UNSUP: u32 = (1 << 31) | 1;
/// Option malformed.
pub const REP_ERR_INVALID: u32 = (1 << 31) | 3;
/// No export of that name.
pub const REP_ERR_UNKNOWN: u32 = (1 << 31) | 6;
/// Option data too large.
pub const REP_ERR_TOO_BIG: u32 = (1 << 31) | 9;

/// Information types.
pub const INFO_EXPORT: u16 = 0;
/// The export's name.
pub const INFO_NAME: u16 = 1;
/// A description of the export.
pub const INFO_DESCRIPTION: u16 = 2;
/// Minimum, preferred and maximum block sizes.
pub const INFO_BLOCK_SIZE: u16 = 3;

/// Commands.
pub const CMD_READ: u16 = 0;
/// Write.
pub const CMD_WRITE: u16 = 1;
/// Disconnect.
pub const CMD_DISC: u16 = 2;
/// Flush.
pub const CMD_FLUSH: u16 = 3;
/// Discard.
pub const CMD_TRIM: u16 = 4;
/// Write zeroes.
pub const CMD_WRITE_ZEROES: u16 = 6;

/// Command flags.
pub const CMD_FLAG_FUA: u16 = 1 << 0;
/// Write zeroes must not leave a hole.
pub const CMD_FLAG_NO_HOLE: u16 = 1 << 1;

/// Structured reply flags and types.
pub const REPLY_FLAG_DONE: u16 = 1 << 0;
/// No payload.
pub const REPLY_TYPE_NONE: u16 = 0;
/// Offset and data.
pub const REPLY_TYPE_OFFSET_DATA: u16 = 1;
/// An error code and message.
pub const REPLY_TYPE_ERROR: u16 = (1 << 15) | 1;

/// NBD errors (Linux errno values).
pub const EPERM: u32 = 1;
/// I/O error.
pub const EIO: u32 = 5;
/// Invalid request.
pub const EINVAL: u32 = 22;
/// No space (write beyond the end, or backing store full).
pub const ENOSPC: u32 = 28;
/// Operation not supported.
pub const ENOTSUP: u32 = 95;
/// The server is shutting down (or the export is going away).
pub const ESHUTDOWN: u32 = 108;

/// Bytes of a transmission request header.
pub const REQUEST_SIZE: usize = 28;
/// Bytes of a simple reply header.
pub const SIMPLE_REPLY_SIZE: usize = 16;
/// Bytes of a structured reply chunk header.
pub const STRUCTURED_REPLY_SIZE: usize = 20;
/// The largest read or write payload we accept (and advertise as maximum block size).
pub const PAYLOAD_SIZE_MAX: u32 = 32 << 20;
/// The largest option payload we read; larger ones are refused with NBD_REP_ERR_TOO_BIG.
pub const OPTION_SIZE_MAX: u32 = 64 << 10;
/// The longest export name (the protocol's own limit).
pub const EXPORT_NAME_SIZE_MAX: usize = 4096;

/// A transmission request header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Request {
    /// NBD_CMD_FLAG_* bits.
    pub flags: u16,
    /// NBD_CMD_* type.
    pub command: u16,
    /// The client's cookie, echoed in the reply.
    pub handle: u64,
    /// Byte offset.
    pub offset_bytes: u64,
    /// Byte length (payload length for writes).
    pub len_bytes: u32,
}

/// Why a request header was refused; the connection cannot continue after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("bad request magic {magic:#010x}")]
pub struct BadMagic {
    /// The magic found.
    pub magic: u32,
}

impl Request {
    /// Decodes a 28-byte header.
    pub fn decode(bytes: &[u8; REQUEST_SIZE]) -> Result<Self, BadMagic> {
        let magic = be_u32(&bytes[0..4]);
        if magic != REQUEST_MAGIC {
            return Err(BadMagic { magic });
        }
        Ok(Self {
            flags: be_u16(&bytes[4..6]),
            command: be_u16(&bytes[6..8]),
            handle: be_u64(&bytes[8..16]),
            offset_bytes: be_u64(&bytes[16..24]),
            len_bytes: be_u32(&bytes[24..28]),
        })
    }

    /// Encodes the header.
    pub fn encode(&self) -> [u8; REQUEST_SIZE] {
        let mut bytes = [0u8; REQUEST_SIZE];
        bytes[0..4].copy_from_slice(&REQUEST_MAGIC.to_be_bytes());
        bytes[4..6].copy_from_slice(&self.flags.to_be_bytes());
        bytes[6..8].copy_from_slice(&self.command.to_be_bytes());
        bytes[8..16].copy_from_slice(&self.handle.to_be_bytes());
        bytes[16..24].copy_from_slice(&self.offset_bytes.to_be_bytes());
        bytes[24..28].copy_from_slice(&self.len_bytes.to_be_bytes());
        bytes
    }

    /// Whether a payload of `len_bytes` follows the header.
    pub fn has_payload(&self) -> bool {
        self.command == CMD_WRITE
    }
}

/// A simple reply header; read data follows it when `error` is 0.
pub fn encode_simple_reply(error: u32, handle: u64) -> [u8; SIMPLE_REPLY_SIZE] {
    let mut bytes = [0u8; SIMPLE_REPLY_SIZE];
    bytes[0..4].copy_from_slice(&SIMPLE_REPLY_MAGIC.to_be_bytes());
    bytes[4..8].copy_from_slice(&error.to_be_bytes());
    bytes[8..16].copy_from_slice(&handle.to_be_bytes());
    bytes
}

/// A decoded simple reply header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SimpleReply {
    /// 0 or an NBD error.
    pub error: u32,
    /// The request's cookie.
    pub handle: u64,
}

impl SimpleReply {
    /// Decodes a 16-byte simple reply header.
    pub fn decode(bytes: &[u8; SIMPLE_REPLY_SIZE]) -> Option<Self> {
        (be_u32(&bytes[0..4]) == SIMPLE_REPLY_MAGIC).then(|| Self {
            error: be_u32(&bytes[4..8]),
            handle: be_u64(&bytes[8..16]),
        })
    }
}

/// A structured reply chunk header; `len_bytes` of payload follow it.
pub fn encode_structured_reply(
    flags: u16,
    kind: u16,
    handle: u64,
    len_bytes: u32,
) -> [u8; STRUCTURED_REPLY_SIZE] {
    let mut bytes = [0u8; STRUCTURED_REPLY_SIZE];
    bytes[0..4].copy_from_slice(&STRUCTURED_REPLY_MAGIC.to_be_bytes());
    bytes[4..6].copy_from_slice(&flags.to_be_bytes());
    bytes[6..8].copy_from_slice(&kind.to_be_bytes());
    bytes[8..16].copy_from_slice(&handle.to_be_bytes());
    bytes[16..20].copy_from_slice(&len_bytes.to_be_bytes());
    bytes
}

/// An option reply: header then `data`.
pub fn encode_option_reply(option: u32, reply: u32, data: &[u8]) -> Vec<u8> {
    let len = u32::try_from(data.len()).expect("option replies are small");
    let mut bytes = Vec::with_capacity(20 + data.len());
    bytes.extend_from_slice(&OPTION_REPLY_MAGIC.to_be_bytes());
    bytes.extend_from_slice(&option.to_be_bytes());
    bytes.extend_from_slice(&reply.to_be_bytes());
    bytes.extend_from_slice(&len.to_be_bytes());
    bytes.extend_from_slice(data);
    bytes
}

/// The payload of NBD_OPT_INFO and NBD_OPT_GO.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InfoRequest {
    /// Export name.
    pub name: String,
    /// Information types the client asks for.
    pub requests: Vec<u16>,
}

impl InfoRequest {
    /// Decodes `u32 name length, name, u16 count, count x u16`; `None` if malformed.
    pub fn decode(data: &[u8]) -> Option<Self> {
        let name_len = usize::try_from(be_u32(data.get(0..4)?)).ok()?;
        let name_end = 4usize.checked_add(name_len)?;
        let name = std::str::from_utf8(data.get(4..name_end)?)
            .ok()?
            .to_string();
        let count = usize::from(be_u16(data.get(name_end..name_end + 2)?));
        let list = data.get(name_end + 2..)?;
        if list.len() != count * 2 {
            return None;
        }
        let requests = list.chunks_exact(2).map(be_u16).collect();
        Some(Self { name, requests })
    }

    /// Encodes the payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::new();
        let name_len = u32::try_from(self.name.len()).expect("export names are short");
        bytes.extend_from_slice(&name_len.to_be_bytes());
        bytes.extend_from_slice(self.name.as_bytes());
        let count = u16::try_from(self.requests.len()).expect("few info requests");
        bytes.extend_from_slice(&count.to_be_bytes());
        for request in &self.requests {
            bytes.extend_from_slice(&request.to_be_bytes());
        }
        bytes
    }
}

/// Reads a big-endian u16 from the first two bytes (callers pass exact slices).
pub fn be_u16(bytes: &[u8]) -> u16 {
    u16::from_be_bytes([bytes[0], bytes[1]])
}

/// Reads a big-endian u32 from the first four bytes.
pub fn be_u32(bytes: &[u8]) -> u32 {
    u32::from_be_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

/// Reads a big-endian u64 from the first eight bytes.
pub fn be_u64(bytes: &[u8]) -> u64 {
    let mut array = [0u8; 8];
    array.copy_from_slice(&bytes[..8]);
    u64::from_be_bytes(array)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn request_round_trips(flags: u16, command: u16, handle: u64, offset_bytes: u64, len_bytes: u32) {
            let request = Request { flags, command, handle, offset_bytes, len_bytes };
            prop_assert_eq!(Request::decode(&request.encode()), Ok(request));
        }

        #[test]
        fn request_decode_never_panics(bytes in proptest::array::uniform28(any::<u8>())) {
            let _ = Request::decode(&bytes);
        }

        #[test]
        fn info_request_round_trips(name in "[a-z0-9/_-]{0,40}", requests in proptest::collection::vec(any::<u16>(), 0..8)) {
            let info = InfoRequest { name, requests };
            prop_assert_eq!(InfoRequest::decode(&info.encode()), Some(info));
        }

        #[test]
        fn info_request_decode_never_panics(data in proptest::collection::vec(any::<u8>(), 0..64)) {
            let _ = InfoRequest::decode(&data);
        }

        #[test]
        fn simple_reply_round_trips(error: u32, handle: u64) {
            prop_assert_eq!(SimpleReply::decode(&encode_simple_reply(error, handle)), Some(SimpleReply { error, handle }));
        }
    }

    #[test]
    fn wrong_magic_is_refused() {
        let mut bytes = Request {
            flags: 0,
            command: 0,
            handle: 1,
            offset_bytes: 0,
            len_bytes: 512,
        }
        .encode();
        bytes[0] ^= 0xff;
        assert!(Request::decode(&bytes).is_err());
    }

    #[test]
    fn info_request_with_wrong_count_is_malformed() {
        let mut data = InfoRequest {
            name: "a".into(),
            requests: vec![3],
        }
        .encode();
        data.push(0);
        assert_eq!(InfoRequest::decode(&data), None);
        assert_eq!(
            InfoRequest::decode(&[0, 0, 1, 0]),
            None,
            "name longer than the payload"
        );
    }
}
