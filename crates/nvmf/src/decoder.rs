//! The streaming PDU decoder, and the errors that end (or, for a data digest, do not end)
//! a connection.
//!
//! [`decode`] looks at the start of a receive buffer: `Ok(None)` while the PDU there is
//! incomplete, else the PDU and the bytes it took. It judges as early as the bytes allow,
//! so a bad or oversized PDU is refused before the connection waits for (or buffers) the
//! rest of it:
//!
//! 1. With the 8-byte common header: the type (one this end receives, in sequence: ICReq
//!    or ICResp first and once), the flags (only the type's own; digest flags exactly as
//!    negotiated), HLEN (the type's), PDO (0 without data; else past the header and its
//!    digest, on the receiver's alignment, before the end), PLEN (exact for the types
//!    without data; for the others, data within the negotiated limit).
//! 2. With the header and its digest: the header digest, then the PDU specific header
//!    (ICReq/ICResp versions and alignments, DATAL against PLEN, in-capsule SGL).
//! 3. With the whole PDU: the data digest.
//!
//! Fields are checked in byte order, so an error names the lowest field in error, and
//! [`PduError::term_req`] builds the TermReq the connection sends before closing. A data
//! digest mismatch is not fatal: NVMe/TCP has no fatal error status for it; the PDU is
//! skipped and its command completes with a transient transport error.

use crate::command::{SGL_DESCRIPTOR_SIZE, SQE_DATA_POINTER_OFFSET, SQE_SIZE, Sqe};
use crate::completion::{CQE_SIZE, Cqe};
use crate::layout::{u16_at, u32_at};
use crate::pdu::{
    C2HData, CAPSULE_CMD_HEADER_SIZE, COMMON_HEADER_SIZE, CapsuleCmd, CapsuleResp, DIGEST_DATA,
    DIGEST_HEADER, DIGEST_SIZE, FLAG_DDGSTF, FLAG_HDGSTF, FLAG_LAST_PDU, FLAG_SUCCESS, H2CData,
    IcReq, IcResp, MAXH2CDATA_MIN, Negotiated, PDA_MAX, PDU_DATA_SIZE_MAX, PDU_TYPE_C2H_DATA,
    PDU_TYPE_C2H_TERM_REQ, PDU_TYPE_CAPSULE_CMD, PDU_TYPE_CAPSULE_RESP, PDU_TYPE_H2C_DATA,
    PDU_TYPE_H2C_TERM_REQ, PDU_TYPE_IC_REQ, PDU_TYPE_IC_RESP, PDU_TYPE_R2T, PFV_1_0, Pdu, R2T,
    Role, TERM_REQ_ERROR_DATA_SIZE_MAX, TERM_REQ_HEADER_SIZE, TERM_REQ_SIZE_MAX, TermReq,
    alignment, carries_data, carries_header_digest, flags_allowed, header_size, to_usize,
};

/// Fatal error statuses (FES) of a TermReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum FatalErrorStatus {
    /// 0x01: a header field is invalid; FEI is its byte offset in the PDU.
    InvalidHeaderField,
    /// 0x02: a PDU arrived out of sequence.
    PduSequence,
    /// 0x03: a header digest did not match.
    HeaderDigest,
    /// 0x04: data outside the range of the command's buffer (or of the R2T).
    DataOutOfRange,
    /// 0x05: more data than allowed (MAXH2CDATA, in-capsule data size, R2T limit).
    DataLimitExceeded,
    /// 0x06: a parameter this end does not support; FEI is its byte offset in the PDU.
    UnsupportedParameter,
}

impl FatalErrorStatus {
    /// The FES value on the wire.
    pub fn code(self) -> u16 {
        match self {
            FatalErrorStatus::InvalidHeaderField => 0x01,
            FatalErrorStatus::PduSequence => 0x02,
            FatalErrorStatus::HeaderDigest => 0x03,
            FatalErrorStatus::DataOutOfRange => 0x04,
            FatalErrorStatus::DataLimitExceeded => 0x05,
            FatalErrorStatus::UnsupportedParameter => 0x06,
        }
    }

    /// The status of a FES value, if it is one this crate knows.
    pub fn from_code(code: u16) -> Option<Self> {
        Some(match code {
            0x01 => FatalErrorStatus::InvalidHeaderField,
            0x02 => FatalErrorStatus::PduSequence,
            0x03 => FatalErrorStatus::HeaderDigest,
            0x04 => FatalErrorStatus::DataOutOfRange,
            0x05 => FatalErrorStatus::DataLimitExceeded,
            0x06 => FatalErrorStatus::UnsupportedParameter,
            _ => return None,
        })
    }
}

/// Why the bytes at the start of a receive buffer are not an acceptable PDU. All but
/// [`PduError::DataDigest`] end the connection; see [`PduError::term_req`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PduError {
    /// A header field is invalid.
    #[error("pdu type {pdu_type:#04x}: invalid header field at byte {offset} (value {value:#x})")]
    InvalidHeaderField {
        /// The PDU-Type byte.
        pdu_type: u8,
        /// Byte offset of the field in the PDU.
        offset: u32,
        /// The value found (truncated to 32 bits).
        value: u32,
    },
    /// ICReq or ICResp after the connection was established, or another PDU before.
    #[error("pdu type {pdu_type:#04x} is out of sequence")]
    Sequence {
        /// The PDU-Type byte.
        pdu_type: u8,
    },
    /// The header digest does not match the header.
    #[error("pdu type {pdu_type:#04x}: header digest {received:#010x}, computed {computed:#010x}")]
    HeaderDigest {
        /// The PDU-Type byte.
        pdu_type: u8,
        /// The digest received.
        received: u32,
        /// The digest of the header received.
        computed: u32,
    },
    /// The data digest does not match the data. Not fatal: skip `pdu_size_bytes` and
    /// complete the command with `Status::TRANSIENT_TRANSPORT_ERROR`.
    #[error(
        "pdu type {pdu_type:#04x} of command {command_id}: data digest {received:#010x}, computed {computed:#010x}"
    )]
    DataDigest {
        /// The PDU-Type byte.
        pdu_type: u8,
        /// The command the data belongs to.
        command_id: u16,
        /// PLEN: the bytes to skip.
        pdu_size_bytes: u32,
        /// The digest received.
        received: u32,
        /// The digest of the data received.
        computed: u32,
    },
    /// Data addressed outside what may be transferred.
    #[error("pdu type {pdu_type:#04x}: data at {offset_bytes}+{len_bytes} is out of range")]
    DataOutOfRange {
        /// The PDU-Type byte.
        pdu_type: u8,
        /// The offset claimed.
        offset_bytes: u32,
        /// The length claimed.
        len_bytes: u32,
    },
    /// More data in one PDU than this end accepts.
    #[error("pdu type {pdu_type:#04x}: {len_bytes} data bytes exceed the {limit_bytes}-byte limit")]
    DataLimitExceeded {
        /// The PDU-Type byte.
        pdu_type: u8,
        /// The data bytes claimed by PLEN.
        len_bytes: u32,
        /// The limit negotiated.
        limit_bytes: u32,
    },
    /// A parameter this end does not support.
    #[error("pdu type {pdu_type:#04x}: unsupported parameter at byte {offset} (value {value:#x})")]
    UnsupportedParameter {
        /// The PDU-Type byte.
        pdu_type: u8,
        /// Byte offset of the parameter in the PDU.
        offset: u32,
        /// The value found (truncated to 32 bits).
        value: u32,
    },
    /// A malformed TermReq. The peer is closing anyway: close without answering.
    #[error("malformed termination request: byte {offset} (value {value:#x})")]
    InvalidTermReq {
        /// Byte offset of the field in the PDU.
        offset: u32,
        /// The value found.
        value: u32,
    },
}

impl PduError {
    /// Whether the connection must end. Only a data digest mismatch lets it go on.
    pub fn is_fatal(&self) -> bool {
        !matches!(self, PduError::DataDigest { .. })
    }

    /// The FES of the TermReq to send, or `None` when none is sent: after a data digest
    /// mismatch (not fatal) and after a malformed TermReq (close silently).
    pub fn fatal_error_status(&self) -> Option<FatalErrorStatus> {
        match self {
            PduError::InvalidHeaderField { .. } => Some(FatalErrorStatus::InvalidHeaderField),
            PduError::Sequence { .. } => Some(FatalErrorStatus::PduSequence),
            PduError::HeaderDigest { .. } => Some(FatalErrorStatus::HeaderDigest),
            PduError::DataOutOfRange { .. } => Some(FatalErrorStatus::DataOutOfRange),
            PduError::DataLimitExceeded { .. } => Some(FatalErrorStatus::DataLimitExceeded),
            PduError::UnsupportedParameter { .. } => Some(FatalErrorStatus::UnsupportedParameter),
            PduError::DataDigest { .. } | PduError::InvalidTermReq { .. } => None,
        }
    }

    /// The FEI of the TermReq: the field's byte offset for invalid header fields and
    /// unsupported parameters, else 0.
    pub fn fatal_error_information(&self) -> u32 {
        match self {
            PduError::InvalidHeaderField { offset, .. }
            | PduError::UnsupportedParameter { offset, .. } => *offset,
            _ => 0,
        }
    }

    /// The TermReq this end sends before closing, echoing `error_data` (see
    /// [`term_req_error_data`]): H2CTermReq from a host, C2HTermReq from a controller.
    /// `None` when no TermReq is due.
    pub fn term_req<'a>(&self, role: Role, error_data: &'a [u8]) -> Option<Pdu<'a>> {
        let status = self.fatal_error_status()?;
        let term = TermReq {
            fatal_error_status: status.code(),
            fatal_error_information: self.fatal_error_information(),
            error_data: &error_data[..error_data.len().min(TERM_REQ_ERROR_DATA_SIZE_MAX)],
        };
        Some(match role {
            Role::Controller => Pdu::C2HTermReq(term),
            Role::Host => Pdu::H2CTermReq(term),
        })
    }
}

/// The bytes a TermReq echoes for the PDU in error at the start of `buffer`: its header
/// (HLEN bytes, or the 8-byte common header when HLEN is implausible), at most 128 bytes,
/// as many as have arrived.
pub fn term_req_error_data(buffer: &[u8]) -> &[u8] {
    let hlen = buffer.get(2).map_or(0, |&hlen| usize::from(hlen));
    let plen = buffer
        .first_chunk::<COMMON_HEADER_SIZE>()
        .map_or(0, |common| u32_at(common, 4));
    let len = if hlen < COMMON_HEADER_SIZE || hlen > to_usize(plen) {
        COMMON_HEADER_SIZE
    } else {
        hlen
    };
    &buffer[..len.min(TERM_REQ_ERROR_DATA_SIZE_MAX).min(buffer.len())]
}

/// Where the parts of a PDU lie, from its common header alone.
#[derive(Debug, Clone, Copy)]
struct Shape {
    pdu_type: u8,
    flags: u8,
    header_size: usize,
    header_digest: bool,
    data_start: usize,
    data_end: usize,
    data_digest: bool,
    pdu_size: usize,
}

/// Decodes the PDU at the start of `buffer`: `Ok(None)` while it is incomplete, else the
/// PDU and the bytes it took. Never panics, whatever the bytes.
pub fn decode<'a>(
    buffer: &'a [u8],
    negotiated: &Negotiated,
) -> Result<Option<(Pdu<'a>, usize)>, PduError> {
    let Some(common) = buffer.first_chunk::<COMMON_HEADER_SIZE>() else {
        return Ok(None);
    };
    let shape = check_common_header(common, negotiated)?;
    let header_end = shape.header_size + if shape.header_digest { DIGEST_SIZE } else { 0 };
    let Some(header_and_digest) = buffer.get(..header_end) else {
        return Ok(None);
    };
    let header = &header_and_digest[..shape.header_size];
    if shape.header_digest {
        let received = u32_at(header_and_digest, shape.header_size);
        let computed = crc32c::crc32c(header);
        if received != computed {
            return Err(PduError::HeaderDigest {
                pdu_type: shape.pdu_type,
                received,
                computed,
            });
        }
    }
    let specific = decode_specific_header(header, &shape)?;
    let Some(whole) = buffer.get(..shape.pdu_size) else {
        return Ok(None);
    };
    let data = &whole[shape.data_start..shape.data_end];
    if shape.data_digest {
        let received = u32_at(whole, shape.data_end);
        let computed = crc32c::crc32c(data);
        if received != computed {
            return Err(PduError::DataDigest {
                pdu_type: shape.pdu_type,
                command_id: specific.command_id(),
                pdu_size_bytes: u32::try_from(shape.pdu_size).unwrap_or(u32::MAX),
                received,
                computed,
            });
        }
    }
    Ok(Some((specific.with_data(data), shape.pdu_size)))
}

/// Checks the 8-byte common header (step 1) and works out where everything lies.
fn check_common_header(
    common: &[u8; COMMON_HEADER_SIZE],
    negotiated: &Negotiated,
) -> Result<Shape, PduError> {
    let [pdu_type, flags, hlen, pdo, ..] = *common;
    let plen = u32_at(common, 4);
    let invalid = |offset: u32, value: u32| PduError::InvalidHeaderField {
        pdu_type,
        offset,
        value,
    };

    if !negotiated.role.receives(pdu_type) {
        return Err(invalid(0, pdu_type.into()));
    }
    if matches!(pdu_type, PDU_TYPE_H2C_TERM_REQ | PDU_TYPE_C2H_TERM_REQ) {
        return check_term_req_header(pdu_type, flags, hlen, pdo, plen);
    }
    let initializes = matches!(pdu_type, PDU_TYPE_IC_REQ | PDU_TYPE_IC_RESP);
    if initializes == negotiated.established {
        return Err(PduError::Sequence { pdu_type });
    }

    // Byte 1: only the type's own flags; HDGSTF exactly when header digests are on.
    if flags & !flags_allowed(pdu_type) != 0 {
        return Err(invalid(1, flags.into()));
    }
    let header_digest = negotiated.header_digest && carries_header_digest(pdu_type);
    if (flags & FLAG_HDGSTF != 0) != header_digest {
        return Err(invalid(1, flags.into()));
    }
    if flags & FLAG_SUCCESS != 0 && flags & FLAG_LAST_PDU == 0 {
        return Err(invalid(1, flags.into()));
    }
    // Byte 2.
    let header_size = header_size(pdu_type);
    if usize::from(hlen) != header_size {
        return Err(invalid(2, hlen.into()));
    }
    let header_end = header_size + if header_digest { DIGEST_SIZE } else { 0 };
    // A data PDU has data when PLEN goes past its header; then DDGSTF exactly when data
    // digests are on.
    let plen_bytes = to_usize(plen);
    let has_data = carries_data(pdu_type) && plen_bytes > header_end;
    let data_digest = has_data && negotiated.data_digest;
    if (flags & FLAG_DDGSTF != 0) != data_digest {
        return Err(invalid(1, flags.into()));
    }
    let (data_start, data_end) = locate_data(
        pdu_type,
        pdo,
        plen,
        header_end,
        has_data,
        data_digest,
        negotiated,
    )?;
    Ok(Shape {
        pdu_type,
        flags,
        header_size,
        header_digest,
        data_start,
        data_end,
        data_digest,
        pdu_size: plen_bytes,
    })
}

/// Checks PDO (byte 3) and PLEN (bytes 4..8) of a PDU whose header and digest end at
/// `header_end`, and returns where its data lies.
fn locate_data(
    pdu_type: u8,
    pdo: u8,
    plen: u32,
    header_end: usize,
    has_data: bool,
    data_digest: bool,
    negotiated: &Negotiated,
) -> Result<(usize, usize), PduError> {
    let invalid = |offset: u32, value: u32| PduError::InvalidHeaderField {
        pdu_type,
        offset,
        value,
    };
    let pdo_bytes = usize::from(pdo);
    let plen_bytes = to_usize(plen);
    if !has_data {
        // PDO 0, or (as some senders do) pointing at the end; PLEN exactly the header.
        if pdo != 0 && !(carries_data(pdu_type) && pdo_bytes == header_end) {
            return Err(invalid(3, pdo.into()));
        }
        if plen_bytes != header_end {
            return Err(invalid(4, plen));
        }
        return Ok((header_end, header_end));
    }
    // Data starts past the header and its digest, aligned as this end asked.
    if pdo_bytes < header_end
        || !pdo_bytes.is_multiple_of(alignment(negotiated.receive_pda))
        || pdo_bytes >= plen_bytes
    {
        return Err(invalid(3, pdo.into()));
    }
    // At least one data byte, within the limit; checked before any data is waited for.
    let digest_size = if data_digest { DIGEST_SIZE } else { 0 };
    let Some(data_len) = plen_bytes
        .checked_sub(pdo_bytes + digest_size)
        .filter(|&len| len > 0)
    else {
        return Err(invalid(4, plen));
    };
    let limit = data_size_limit(pdu_type, negotiated);
    if data_len > to_usize(limit) {
        return Err(PduError::DataLimitExceeded {
            pdu_type,
            len_bytes: u32::try_from(data_len).unwrap_or(u32::MAX),
            limit_bytes: limit,
        });
    }
    Ok((pdo_bytes, pdo_bytes + data_len))
}

/// The most data bytes a PDU of this type may carry here.
fn data_size_limit(pdu_type: u8, negotiated: &Negotiated) -> u32 {
    let limit = if pdu_type == PDU_TYPE_CAPSULE_CMD {
        negotiated.in_capsule_data_size_max
    } else {
        negotiated.data_size_max
    };
    limit.min(PDU_DATA_SIZE_MAX)
}

/// TermReqs arrive at any time, without digests or padding. A malformed one is not
/// answered (NVMe/TCP: termination requests with invalid lengths end the connection
/// without an error report; the other fields are treated alike).
fn check_term_req_header(
    pdu_type: u8,
    flags: u8,
    hlen: u8,
    pdo: u8,
    plen: u32,
) -> Result<Shape, PduError> {
    let malformed = |offset: u32, value: u32| PduError::InvalidTermReq { offset, value };
    if flags != 0 {
        return Err(malformed(1, flags.into()));
    }
    if usize::from(hlen) != TERM_REQ_HEADER_SIZE {
        return Err(malformed(2, hlen.into()));
    }
    if pdo != 0 {
        return Err(malformed(3, pdo.into()));
    }
    let plen_bytes = to_usize(plen);
    if !(TERM_REQ_HEADER_SIZE..=TERM_REQ_SIZE_MAX).contains(&plen_bytes) {
        return Err(malformed(4, plen));
    }
    Ok(Shape {
        pdu_type,
        flags,
        header_size: TERM_REQ_HEADER_SIZE,
        header_digest: false,
        data_start: TERM_REQ_HEADER_SIZE,
        data_end: plen_bytes,
        data_digest: false,
        pdu_size: plen_bytes,
    })
}

/// A PDU whose specific header is decoded and whose data has yet to arrive.
enum Specific {
    IcReq(IcReq),
    IcResp(IcResp),
    TermReq {
        h2c: bool,
        status: u16,
        information: u32,
    },
    CapsuleCmd(Sqe),
    CapsuleResp(Cqe),
    H2CData {
        command_id: u16,
        transfer_tag: u16,
        offset_bytes: u32,
        last: bool,
    },
    C2HData {
        command_id: u16,
        offset_bytes: u32,
        last: bool,
        success: bool,
    },
    R2T(R2T),
}

impl Specific {
    /// The command a data digest error is reported against (only data PDUs have one).
    fn command_id(&self) -> u16 {
        match self {
            Specific::CapsuleCmd(sqe) => sqe.command_id,
            Specific::H2CData { command_id, .. } | Specific::C2HData { command_id, .. } => {
                *command_id
            }
            _ => 0,
        }
    }

    fn with_data(self, data: &[u8]) -> Pdu<'_> {
        match self {
            Specific::IcReq(ic) => Pdu::IcReq(ic),
            Specific::IcResp(ic) => Pdu::IcResp(ic),
            Specific::TermReq {
                h2c,
                status,
                information,
            } => {
                let term = TermReq {
                    fatal_error_status: status,
                    fatal_error_information: information,
                    error_data: data,
                };
                if h2c {
                    Pdu::H2CTermReq(term)
                } else {
                    Pdu::C2HTermReq(term)
                }
            }
            Specific::CapsuleCmd(sqe) => Pdu::CapsuleCmd(CapsuleCmd { sqe, data }),
            Specific::CapsuleResp(cqe) => Pdu::CapsuleResp(CapsuleResp { cqe }),
            Specific::H2CData {
                command_id,
                transfer_tag,
                offset_bytes,
                last,
            } => Pdu::H2CData(H2CData {
                command_id,
                transfer_tag,
                data_offset_bytes: offset_bytes,
                data,
                last,
            }),
            Specific::C2HData {
                command_id,
                offset_bytes,
                last,
                success,
            } => Pdu::C2HData(C2HData {
                command_id,
                data_offset_bytes: offset_bytes,
                data,
                last,
                success,
            }),
            Specific::R2T(r2t) => Pdu::R2T(r2t),
        }
    }
}

/// Decodes and checks the PDU specific header (step 2). `header` is exactly HLEN bytes,
/// as [`check_common_header`] established for this type.
fn decode_specific_header(header: &[u8], shape: &Shape) -> Result<Specific, PduError> {
    let pdu_type = header[0];
    let data_len = shape.data_end - shape.data_start;
    Ok(match pdu_type {
        PDU_TYPE_IC_REQ | PDU_TYPE_IC_RESP => decode_ic(header)?,
        PDU_TYPE_H2C_TERM_REQ | PDU_TYPE_C2H_TERM_REQ => Specific::TermReq {
            h2c: pdu_type == PDU_TYPE_H2C_TERM_REQ,
            status: u16_at(header, 8),
            information: u32_at(header, 10),
        },
        PDU_TYPE_CAPSULE_CMD => {
            let mut sqe = [0u8; SQE_SIZE];
            sqe.copy_from_slice(&header[COMMON_HEADER_SIZE..CAPSULE_CMD_HEADER_SIZE]);
            let sqe = Sqe::decode(&sqe);
            check_in_capsule_data(&sqe, data_len)?;
            Specific::CapsuleCmd(sqe)
        }
        PDU_TYPE_CAPSULE_RESP => {
            let mut cqe = [0u8; CQE_SIZE];
            cqe.copy_from_slice(&header[COMMON_HEADER_SIZE..COMMON_HEADER_SIZE + CQE_SIZE]);
            Specific::CapsuleResp(Cqe::decode(&cqe))
        }
        PDU_TYPE_H2C_DATA | PDU_TYPE_C2H_DATA => {
            let offset_bytes = check_data_range(header, data_len)?;
            let last = shape.flags & FLAG_LAST_PDU != 0;
            if pdu_type == PDU_TYPE_H2C_DATA {
                Specific::H2CData {
                    command_id: u16_at(header, 8),
                    transfer_tag: u16_at(header, 10),
                    offset_bytes,
                    last,
                }
            } else {
                Specific::C2HData {
                    command_id: u16_at(header, 8),
                    offset_bytes,
                    last,
                    success: shape.flags & FLAG_SUCCESS != 0,
                }
            }
        }
        PDU_TYPE_R2T => Specific::R2T(R2T {
            command_id: u16_at(header, 8),
            transfer_tag: u16_at(header, 10),
            offset_bytes: u32_at(header, 12),
            len_bytes: u32_at(header, 16),
        }),
        // `check_common_header` let only the types above through.
        _ => {
            return Err(PduError::InvalidHeaderField {
                pdu_type,
                offset: 0,
                value: pdu_type.into(),
            });
        }
    })
}

/// ICReq and ICResp share a layout: PFV, a PDA, DGST, then MAXR2T or MAXH2CDATA.
fn decode_ic(header: &[u8]) -> Result<Specific, PduError> {
    let pdu_type = header[0];
    let format_version = u16_at(header, 8);
    if format_version != PFV_1_0 {
        return Err(PduError::UnsupportedParameter {
            pdu_type,
            offset: 8,
            value: format_version.into(),
        });
    }
    let pda = header[10];
    if pda > PDA_MAX {
        return Err(PduError::InvalidHeaderField {
            pdu_type,
            offset: 10,
            value: pda.into(),
        });
    }
    // Reserved DGST bits are ignored, like every reserved field.
    let header_digest = header[11] & DIGEST_HEADER != 0;
    let data_digest = header[11] & DIGEST_DATA != 0;
    let last_field = u32_at(header, 12);
    if pdu_type == PDU_TYPE_IC_REQ {
        return Ok(Specific::IcReq(IcReq {
            format_version,
            host_pda: pda,
            header_digest,
            data_digest,
            maxr2t: last_field,
        }));
    }
    // NVMe/TCP: MAXH2CDATA is a multiple of 4, at least 4096.
    if last_field < MAXH2CDATA_MIN || !last_field.is_multiple_of(4) {
        return Err(PduError::InvalidHeaderField {
            pdu_type,
            offset: 12,
            value: last_field,
        });
    }
    Ok(Specific::IcResp(IcResp {
        format_version,
        controller_pda: pda,
        header_digest,
        data_digest,
        maxh2cdata: last_field,
    }))
}

/// In-capsule data must be what the SQE's data pointer describes: an in-capsule
/// descriptor (Data Block, Offset) at offset 0 (NVMe/TCP does not use ICDOFF) whose
/// length is the data's. An in-capsule descriptor without the data is refused alike.
fn check_in_capsule_data(sqe: &Sqe, data_len: usize) -> Result<(), PduError> {
    // Offsets in the PDU: the descriptor's address at +0, length at +8, identifier at +15.
    const SGL_AT: u32 = (COMMON_HEADER_SIZE + SQE_DATA_POINTER_OFFSET) as u32;
    const _: () = assert!(SGL_DESCRIPTOR_SIZE == 16);
    let sgl = &sqe.data_pointer;
    if data_len == 0 && !sgl.is_in_capsule() {
        return Ok(());
    }
    let unsupported = |offset: u32, value: u32| PduError::UnsupportedParameter {
        pdu_type: PDU_TYPE_CAPSULE_CMD,
        offset,
        value,
    };
    if !sgl.is_in_capsule() {
        return Err(unsupported(SGL_AT + 15, sgl.identifier.into()));
    }
    if sgl.address != 0 {
        return Err(unsupported(
            SGL_AT,
            u32::try_from(sgl.address).unwrap_or(u32::MAX),
        ));
    }
    if to_usize(sgl.length) != data_len {
        return Err(PduError::InvalidHeaderField {
            pdu_type: PDU_TYPE_CAPSULE_CMD,
            offset: SGL_AT + 8,
            value: sgl.length,
        });
    }
    Ok(())
}

/// DATAL must be the data PLEN leaves, and DATAO + DATAL must not wrap. Returns DATAO.
fn check_data_range(header: &[u8], data_len: usize) -> Result<u32, PduError> {
    let pdu_type = header[0];
    let offset_bytes = u32_at(header, 12);
    let len_bytes = u32_at(header, 16);
    if to_usize(len_bytes) != data_len {
        return Err(PduError::InvalidHeaderField {
            pdu_type,
            offset: 16,
            value: len_bytes,
        });
    }
    if offset_bytes.checked_add(len_bytes).is_none() {
        return Err(PduError::DataOutOfRange {
            pdu_type,
            offset_bytes,
            len_bytes,
        });
    }
    Ok(offset_bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::SglDescriptor;
    use crate::command::tests::arb_sqe;
    use crate::completion::tests::arb_cqe;
    use crate::pdu::{IN_CAPSULE_DATA_SIZE_ADMIN, encode, encode_header};
    use proptest::prelude::*;

    /// An owned established-traffic PDU, for strategies (a `Pdu` borrows its data).
    /// ICReq and ICResp have their own test.
    #[derive(Debug, Clone)]
    enum Owned {
        TermReq {
            h2c: bool,
            status: u16,
            information: u32,
            data: Vec<u8>,
        },
        CapsuleCmd(Sqe, Vec<u8>),
        CapsuleResp(Cqe),
        H2CData {
            command_id: u16,
            transfer_tag: u16,
            offset_bytes: u32,
            data: Vec<u8>,
            last: bool,
        },
        C2HData {
            command_id: u16,
            offset_bytes: u32,
            data: Vec<u8>,
            last: bool,
            success: bool,
        },
        R2T(R2T),
    }

    impl Owned {
        fn pdu(&self) -> Pdu<'_> {
            match self {
                Owned::TermReq {
                    h2c,
                    status,
                    information,
                    data,
                } => {
                    let term = TermReq {
                        fatal_error_status: *status,
                        fatal_error_information: *information,
                        error_data: data,
                    };
                    if *h2c {
                        Pdu::H2CTermReq(term)
                    } else {
                        Pdu::C2HTermReq(term)
                    }
                }
                Owned::CapsuleCmd(sqe, data) => Pdu::CapsuleCmd(CapsuleCmd { sqe: *sqe, data }),
                Owned::CapsuleResp(cqe) => Pdu::CapsuleResp(CapsuleResp { cqe: *cqe }),
                Owned::H2CData {
                    command_id,
                    transfer_tag,
                    offset_bytes,
                    data,
                    last,
                } => Pdu::H2CData(H2CData {
                    command_id: *command_id,
                    transfer_tag: *transfer_tag,
                    data_offset_bytes: *offset_bytes,
                    data,
                    last: *last,
                }),
                Owned::C2HData {
                    command_id,
                    offset_bytes,
                    data,
                    last,
                    success,
                } => Pdu::C2HData(C2HData {
                    command_id: *command_id,
                    data_offset_bytes: *offset_bytes,
                    data,
                    last: *last,
                    success: *success,
                }),
                Owned::R2T(r2t) => Pdu::R2T(*r2t),
            }
        }
    }

    const DATA_SIZE_MAX_IN_TESTS: u32 = 4096;

    /// Both ends of an established connection: (controller, host).
    fn established(
        header_digest: bool,
        data_digest: bool,
        controller_pda: u8,
        host_pda: u8,
    ) -> (Negotiated, Negotiated) {
        let controller = Negotiated {
            role: Role::Controller,
            established: true,
            header_digest,
            data_digest,
            receive_pda: controller_pda,
            send_pda: host_pda,
            data_size_max: DATA_SIZE_MAX_IN_TESTS,
            in_capsule_data_size_max: IN_CAPSULE_DATA_SIZE_ADMIN,
        };
        let host = Negotiated {
            role: Role::Host,
            receive_pda: host_pda,
            send_pda: controller_pda,
            in_capsule_data_size_max: 0,
            ..controller
        };
        (controller, host)
    }

    fn arb_ends() -> impl Strategy<Value = (Negotiated, Negotiated)> {
        (any::<bool>(), any::<bool>(), 0..=PDA_MAX, 0..=PDA_MAX)
            .prop_map(|(hd, dd, cpda, hpda)| established(hd, dd, cpda, hpda))
    }

    fn arb_data(max: usize) -> impl Strategy<Value = Vec<u8>> {
        proptest::collection::vec(any::<u8>(), 0..max)
    }

    /// PDUs a host sends once established.
    fn arb_h2c() -> impl Strategy<Value = Owned> {
        prop_oneof![
            (arb_sqe(), arb_data(600)).prop_map(|(mut sqe, data)| {
                if !data.is_empty() {
                    sqe.data_pointer = SglDescriptor::in_capsule(data.len() as u32);
                } else if sqe.data_pointer.is_in_capsule() {
                    sqe.data_pointer = SglDescriptor::transport(sqe.data_pointer.length);
                }
                Owned::CapsuleCmd(sqe, data)
            }),
            (
                any::<u16>(),
                any::<u16>(),
                0..u32::MAX / 2,
                arb_data(600),
                any::<bool>()
            )
                .prop_map(|(command_id, transfer_tag, offset_bytes, data, last)| {
                    Owned::H2CData {
                        command_id,
                        transfer_tag,
                        offset_bytes,
                        data,
                        last,
                    }
                }),
            (any::<u16>(), any::<u32>(), arb_data(129)).prop_map(|(status, information, data)| {
                Owned::TermReq {
                    h2c: true,
                    status,
                    information,
                    data,
                }
            }),
        ]
    }

    /// PDUs a controller sends once established.
    fn arb_c2h() -> impl Strategy<Value = Owned> {
        prop_oneof![
            arb_cqe().prop_map(Owned::CapsuleResp),
            (
                any::<u16>(),
                0..u32::MAX / 2,
                arb_data(600),
                any::<bool>(),
                any::<bool>()
            )
                .prop_map(|(command_id, offset_bytes, data, last, success)| {
                    Owned::C2HData {
                        command_id,
                        offset_bytes,
                        data,
                        last: last || success,
                        success,
                    }
                }),
            (any::<u16>(), any::<u16>(), any::<u32>(), any::<u32>()).prop_map(
                |(command_id, transfer_tag, offset_bytes, len_bytes)| Owned::R2T(R2T {
                    command_id,
                    transfer_tag,
                    offset_bytes,
                    len_bytes,
                })
            ),
            (any::<u16>(), any::<u32>(), arb_data(129)).prop_map(|(status, information, data)| {
                Owned::TermReq {
                    h2c: false,
                    status,
                    information,
                    data,
                }
            }),
        ]
    }

    /// A direction, the sender's and receiver's states and what the sender sends.
    fn arb_established_traffic(
        count: std::ops::Range<usize>,
    ) -> impl Strategy<Value = (Negotiated, Negotiated, Vec<Owned>)> {
        (arb_ends(), any::<bool>()).prop_flat_map(move |((controller, host), to_controller)| {
            let pdus = if to_controller {
                proptest::collection::vec(arb_h2c(), count.clone()).boxed()
            } else {
                proptest::collection::vec(arb_c2h(), count.clone()).boxed()
            };
            let (sender, receiver) = if to_controller {
                (host, controller)
            } else {
                (controller, host)
            };
            (Just(sender), Just(receiver), pdus)
        })
    }

    fn encoded(pdu: &Pdu<'_>, sender: &Negotiated) -> Vec<u8> {
        let mut bytes = Vec::new();
        encode(pdu, sender, &mut bytes);
        bytes
    }

    proptest! {
        #[test]
        fn established_pdus_round_trip((sender, receiver, pdus) in arb_established_traffic(1..2)) {
            let pdu = pdus[0].pdu();
            let bytes = encoded(&pdu, &sender);
            prop_assert_eq!(decode(&bytes, &receiver), Ok(Some((pdu, bytes.len()))));
            // The vectored form produces the same bytes.
            let mut parts = Vec::new();
            let digest = encode_header(&pdu, &sender, &mut parts);
            parts.extend_from_slice(pdu.data());
            parts.extend(digest.into_iter().flatten());
            prop_assert_eq!(parts, bytes);
        }

        #[test]
        fn initialize_pdus_round_trip(
            host_pda in 0..=PDA_MAX, controller_pda in 0..=PDA_MAX, header_digest: bool, data_digest: bool,
            maxr2t: u32, maxh2cdata in (MAXH2CDATA_MIN / 4)..=(u32::MAX / 4),
        ) {
            let ic_req = IcReq { format_version: PFV_1_0, host_pda, header_digest, data_digest, maxr2t };
            let bytes = encoded(&Pdu::IcReq(ic_req), &Negotiated::initial(Role::Host));
            prop_assert_eq!(decode(&bytes, &Negotiated::initial(Role::Controller)), Ok(Some((Pdu::IcReq(ic_req), 128))));
            let ic_resp = IcResp { format_version: PFV_1_0, controller_pda, header_digest, data_digest, maxh2cdata: maxh2cdata * 4 };
            let bytes = encoded(&Pdu::IcResp(ic_resp), &Negotiated::initial(Role::Controller));
            prop_assert_eq!(decode(&bytes, &Negotiated::initial(Role::Host)), Ok(Some((Pdu::IcResp(ic_resp), 128))));
        }

        /// Goal: a connection reading a stream in arbitrary pieces only ever waits or gets
        /// the PDUs sent. Method: encode several PDUs back to back, cut the stream anywhere,
        /// decode the prefix in a loop.
        #[test]
        fn every_prefix_of_a_stream_waits_for_more((sender, receiver, pdus) in arb_established_traffic(1..5), cut in any::<prop::sample::Index>()) {
            let mut stream = Vec::new();
            for pdu in &pdus {
                encode(&pdu.pdu(), &sender, &mut stream);
            }
            let cut = cut.index(stream.len() + 1);
            let mut position = 0;
            let mut decoded = 0;
            loop {
                match decode(&stream[position..cut], &receiver) {
                    Ok(Some((pdu, used))) => {
                        prop_assert_eq!(pdu, pdus[decoded].pdu());
                        position += used;
                        decoded += 1;
                    }
                    Ok(None) => break,
                    Err(error) => prop_assert!(false, "prefix of {} bytes: {}", cut, error),
                }
            }
            prop_assert_eq!(decoded == pdus.len(), cut == stream.len());
        }

        /// Goal: with both digests on, no flipped bit yields a different PDU. TermReqs
        /// carry no digest (by the spec), so they are left out.
        #[test]
        fn flipped_bits_never_decode_to_another_pdu(
            (sender, receiver, pdus) in arb_established_traffic(1..2),
            bit in any::<prop::sample::Index>(),
        ) {
            let sender = Negotiated { header_digest: true, data_digest: true, ..sender };
            let receiver = Negotiated { header_digest: true, data_digest: true, ..receiver };
            let pdu = pdus[0].pdu();
            prop_assume!(!matches!(pdu, Pdu::H2CTermReq(_) | Pdu::C2HTermReq(_)));
            let mut bytes = encoded(&pdu, &sender);
            let bit = bit.index(bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            if let Ok(Some((decoded, _))) = decode(&bytes, &receiver) {
                prop_assert_eq!(decoded, pdu, "only padding is not covered");
            }
        }

        /// Goal: flips in the digests, the header or the data are reported as digest
        /// errors, and a data digest error names the bytes to skip.
        #[test]
        fn flipped_digest_bits_are_digest_errors(
            (sender, receiver, pdus) in arb_established_traffic(1..2),
            bit in 0usize..32,
        ) {
            let sender = Negotiated { header_digest: true, data_digest: true, ..sender };
            let receiver = Negotiated { header_digest: true, data_digest: true, ..receiver };
            let pdu = pdus[0].pdu();
            let bytes = encoded(&pdu, &sender);
            let hlen = usize::from(bytes[2]);
            if carries_header_digest(pdu.pdu_type()) {
                let mut flipped = bytes.clone();
                flipped[hlen + bit / 8] ^= 1 << (bit % 8);
                let is_header_digest_error = matches!(decode(&flipped, &receiver), Err(PduError::HeaderDigest { .. }));
                prop_assert!(is_header_digest_error);
                // Any bit of the header past the common header, too.
                let mut flipped = bytes.clone();
                flipped[COMMON_HEADER_SIZE + (bit * 7) % (hlen - COMMON_HEADER_SIZE)] ^= 1 << (bit % 8);
                let is_header_digest_error = matches!(decode(&flipped, &receiver), Err(PduError::HeaderDigest { .. }));
                prop_assert!(is_header_digest_error);
            }
            if carries_data(pdu.pdu_type()) && !pdu.data().is_empty() {
                let mut flipped = bytes.clone();
                let end = flipped.len();
                flipped[end - DIGEST_SIZE + bit / 8] ^= 1 << (bit % 8);
                let error = decode(&flipped, &receiver).expect_err("data digest");
                let skips_the_pdu = matches!(error, PduError::DataDigest { pdu_size_bytes, .. } if pdu_size_bytes as usize == bytes.len());
                prop_assert!(skips_the_pdu);
                prop_assert!(!error.is_fatal());
                prop_assert_eq!(error.term_req(receiver.role, &flipped), None);
                let mut flipped = bytes.clone();
                flipped[end - DIGEST_SIZE - 1 - bit % pdu.data().len()] ^= 1;
                let is_data_digest_error = matches!(decode(&flipped, &receiver), Err(PduError::DataDigest { .. }));
                prop_assert!(is_data_digest_error);
            }
        }

    }

    proptest! {
        // Decoders of untrusted bytes get more cases than the round trips.
        #![proptest_config(ProptestConfig::with_cases(4096))]

        #[test]
        fn arbitrary_bytes_never_panic(
            bytes in proptest::collection::vec(any::<u8>(), 0..400),
            (controller, host) in arb_ends(),
            initial: bool,
        ) {
            for negotiated in [controller, host] {
                let negotiated = if initial { Negotiated::initial(negotiated.role) } else { negotiated };
                let mut position = 0;
                while let Ok(Some((_, used))) = decode(&bytes[position..], &negotiated) {
                    prop_assert!(used > 0, "progress");
                    position += used;
                }
                let _ = term_req_error_data(&bytes[position..]);
            }
        }

        /// Goal: reach the deeper checks with garbage. Method: a valid common header prefix
        /// (a real type, a plausible HLEN and small PLEN), random everything else.
        #[test]
        fn garbage_behind_a_plausible_header_never_panics(
            pdu_type in prop::sample::select(vec![0u8, 1, 2, 3, 4, 5, 6, 7, 9]),
            flags in 0u8..16, pdo: u8, plen in 0u32..800,
            tail in proptest::collection::vec(any::<u8>(), 0..800),
            (controller, host) in arb_ends(),
        ) {
            let mut bytes = vec![pdu_type, flags, header_size(pdu_type) as u8, pdo];
            bytes.extend_from_slice(&plen.to_le_bytes());
            bytes.extend_from_slice(&tail);
            for negotiated in [controller, host, Negotiated::initial(Role::Controller), Negotiated::initial(Role::Host)] {
                if let Err(error) = decode(&bytes, &negotiated)
                    && let Some(term) = error.term_req(negotiated.role, term_req_error_data(&bytes))
                {
                    let _ = encoded(&term, &negotiated);
                }
            }
        }
    }

    fn no_digests() -> (Negotiated, Negotiated) {
        established(false, false, 0, 0)
    }

    fn capsule_with_data(data: &[u8]) -> Vec<u8> {
        let (_, host) = no_digests();
        let sqe = Sqe {
            command_id: 7,
            data_pointer: SglDescriptor::in_capsule(data.len() as u32),
            ..Sqe::default()
        };
        encoded(&Pdu::CapsuleCmd(CapsuleCmd { sqe, data }), &host)
    }

    fn invalid(pdu_type: u8, offset: u32, value: u32) -> PduError {
        PduError::InvalidHeaderField {
            pdu_type,
            offset,
            value,
        }
    }

    #[test]
    fn pdus_out_of_sequence_are_sequence_errors() {
        let bytes = capsule_with_data(&[1, 2, 3, 4]);
        assert_eq!(
            decode(&bytes, &Negotiated::initial(Role::Controller)),
            Err(PduError::Sequence { pdu_type: 4 })
        );
        let ic_req = IcReq {
            format_version: PFV_1_0,
            host_pda: 0,
            header_digest: false,
            data_digest: false,
            maxr2t: 0,
        };
        let bytes = encoded(&Pdu::IcReq(ic_req), &Negotiated::initial(Role::Host));
        let (controller, _) = no_digests();
        let error = decode(&bytes, &controller).expect_err("second icreq");
        assert_eq!(error, PduError::Sequence { pdu_type: 0 });
        assert_eq!(
            error.fatal_error_status().map(FatalErrorStatus::code),
            Some(0x02)
        );
    }

    #[test]
    fn pdus_for_the_other_end_or_of_unknown_types_are_invalid_at_byte_zero() {
        let (controller, host) = no_digests();
        let r2t = encoded(
            &Pdu::R2T(R2T {
                command_id: 1,
                transfer_tag: 2,
                offset_bytes: 0,
                len_bytes: 4096,
            }),
            &controller,
        );
        assert_eq!(decode(&r2t, &controller), Err(invalid(9, 0, 9)));
        assert!(decode(&r2t, &host).is_ok());
        for pdu_type in [0x08u8, 0x0a, 0x7f, 0xff] {
            let bytes = [pdu_type, 0, 24, 0, 24, 0, 0, 0];
            for negotiated in [controller, host] {
                assert_eq!(
                    decode(&bytes, &negotiated),
                    Err(invalid(pdu_type, 0, pdu_type.into()))
                );
            }
        }
    }

    #[test]
    fn absurd_plen_is_refused_from_the_common_header_alone() {
        let (controller, _) = no_digests();
        let header = [
            PDU_TYPE_H2C_DATA,
            FLAG_LAST_PDU,
            24,
            24,
            0xff,
            0xff,
            0xff,
            0xff,
        ];
        assert_eq!(
            decode(&header, &controller),
            Err(PduError::DataLimitExceeded {
                pdu_type: PDU_TYPE_H2C_DATA,
                len_bytes: u32::MAX - 24,
                limit_bytes: DATA_SIZE_MAX_IN_TESTS,
            })
        );
        let header = [PDU_TYPE_CAPSULE_CMD, 0, 72, 72, 0xff, 0xff, 0xff, 0x7f];
        let error = decode(&header, &controller).expect_err("too big");
        assert!(matches!(
            error,
            PduError::DataLimitExceeded {
                limit_bytes: IN_CAPSULE_DATA_SIZE_ADMIN,
                ..
            }
        ));
        assert_eq!(
            error.fatal_error_status().map(FatalErrorStatus::code),
            Some(0x05)
        );
        // A type without data must have its exact size.
        let header = [PDU_TYPE_IC_REQ, 0, 128, 0, 0xff, 0xff, 0xff, 0xff];
        assert_eq!(
            decode(&header, &Negotiated::initial(Role::Controller)),
            Err(invalid(0, 4, u32::MAX))
        );
    }

    #[test]
    fn in_capsule_data_over_the_limit_is_a_data_limit_error() {
        let (controller, _) = no_digests();
        let limited = Negotiated {
            in_capsule_data_size_max: 4096,
            ..controller
        };
        assert!(decode(&capsule_with_data(&[0; 4096]), &limited).is_ok());
        assert_eq!(
            decode(&capsule_with_data(&[0; 4100]), &limited),
            Err(PduError::DataLimitExceeded {
                pdu_type: 4,
                len_bytes: 4100,
                limit_bytes: 4096
            })
        );
    }

    #[test]
    fn header_fields_are_checked_in_byte_order() {
        let (controller, _) = no_digests();
        let good = capsule_with_data(&[1, 2, 3, 4]);
        let mut bytes = good.clone();
        bytes[1] = FLAG_LAST_PDU; // not a CapsuleCmd flag
        bytes[2] = 99; // also wrong, but a later field
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 1, 4)));
        let mut bytes = good.clone();
        bytes[2] = 24;
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 2, 24)));
        let mut bytes = good.clone();
        bytes[3] = 70; // inside the header
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 3, 70)));
        let mut bytes = good.clone();
        bytes[3] = 0; // data present but PDO 0
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 3, 0)));
        let mut bytes = good.clone();
        bytes[3] = 76; // aligned, but past the end of a 76-byte PDU
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 3, 76)));
        let mut bytes = good;
        bytes[4] = 70; // shorter than the header
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 4, 70)));
    }

    #[test]
    fn a_hand_built_h2c_data_pdu_decodes_field_by_field() {
        // Goal: check the decoder against the layout itself, not against our encoder.
        // H2CData with header digest: CH, CCCID 0x0102, TTAG 0x0304, DATAO 0x1000,
        // DATAL 4, 4 reserved bytes, HDGST, data at PDO 28, no data digest: PLEN 32.
        let mut bytes = vec![0x06, 0x05, 24, 28, 32, 0, 0, 0];
        bytes.extend_from_slice(&[0x02, 0x01, 0x04, 0x03, 0x00, 0x10, 0x00, 0x00]);
        bytes.extend_from_slice(&[4, 0, 0, 0, 0, 0, 0, 0]);
        let digest = crc32c::crc32c(&bytes);
        bytes.extend_from_slice(&digest.to_le_bytes());
        bytes.extend_from_slice(b"abcd");
        let (controller, _) = established(true, false, 0, 0);
        let expected = Pdu::H2CData(H2CData {
            command_id: 0x0102,
            transfer_tag: 0x0304,
            data_offset_bytes: 0x1000,
            data: b"abcd",
            last: true,
        });
        assert_eq!(decode(&bytes, &controller), Ok(Some((expected, 32))));
        // Reserved bytes are ignored (the digest still covers them).
        bytes[20] = 0xee;
        let digest = crc32c::crc32c(&bytes[..24]);
        bytes[24..28].copy_from_slice(&digest.to_le_bytes());
        assert_eq!(decode(&bytes, &controller), Ok(Some((expected, 32))));
    }

    #[test]
    fn digest_flags_must_match_what_was_negotiated() {
        let (_, host_plain) = no_digests();
        let (controller_hd, _) = established(true, false, 0, 0);
        let (controller_dd, _) = established(false, true, 0, 0);
        let (controller_plain, _) = no_digests();
        let sqe = Sqe {
            data_pointer: SglDescriptor::transport(4096),
            ..Sqe::default()
        };
        let without_data = encoded(&Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &[] }), &host_plain);
        // Header digests on, but HDGSTF clear.
        assert_eq!(decode(&without_data, &controller_hd), Err(invalid(4, 1, 0)));
        // Data digests on: a capsule without data carries no DDGSTF (Linux hosts, SPDK).
        assert!(decode(&without_data, &controller_dd).is_ok());
        // ... but one with data must.
        let with_data = capsule_with_data(&[1, 2, 3, 4]);
        assert_eq!(decode(&with_data, &controller_dd), Err(invalid(4, 1, 0)));
        // And DDGSTF where no data digest was negotiated.
        let mut flagged = with_data.clone();
        flagged[1] = FLAG_DDGSTF;
        assert_eq!(decode(&flagged, &controller_plain), Err(invalid(4, 1, 2)));
    }

    #[test]
    fn misaligned_data_is_an_invalid_pdo() {
        // The controller asked for 16-byte alignment (CPDA 3); a host ignoring it puts data
        // right after the 72-byte header.
        let (controller, _) = established(false, false, 3, 0);
        let bytes = capsule_with_data(&[9; 8]);
        assert_eq!(bytes[3], 72);
        assert_eq!(decode(&bytes, &controller), Err(invalid(4, 3, 72)));
        let (_, aligned_host) = established(false, false, 3, 0);
        let sqe = Sqe {
            data_pointer: SglDescriptor::in_capsule(8),
            ..Sqe::default()
        };
        let aligned = encoded(
            &Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &[9; 8] }),
            &aligned_host,
        );
        assert_eq!(aligned[3], 80);
        assert!(decode(&aligned, &controller).is_ok());
    }

    #[test]
    fn data_length_fields_must_agree_with_plen() {
        let (controller, host) = no_digests();
        let pdu = Pdu::H2CData(H2CData {
            command_id: 3,
            transfer_tag: 4,
            data_offset_bytes: 0,
            data: &[5; 16],
            last: true,
        });
        let mut bytes = encoded(&pdu, &host);
        bytes[16] = 17;
        assert_eq!(decode(&bytes, &controller), Err(invalid(6, 16, 17)));
        let mut bytes = encoded(&pdu, &host);
        bytes[12..16].copy_from_slice(&(u32::MAX - 8).to_le_bytes());
        assert_eq!(
            decode(&bytes, &controller),
            Err(PduError::DataOutOfRange {
                pdu_type: 6,
                offset_bytes: u32::MAX - 8,
                len_bytes: 16
            })
        );
    }

    #[test]
    fn in_capsule_data_must_match_its_descriptor() {
        let (controller, host) = no_digests();
        let data = [1u8; 32];
        let capsule = |data_pointer: SglDescriptor, data: &[u8]| {
            let sqe = Sqe {
                data_pointer,
                ..Sqe::default()
            };
            encoded(&Pdu::CapsuleCmd(CapsuleCmd { sqe, data }), &host)
        };
        assert_eq!(
            decode(&capsule(SglDescriptor::transport(32), &data), &controller),
            Err(PduError::UnsupportedParameter {
                pdu_type: 4,
                offset: 47,
                value: 0x5a
            })
        );
        let offset = SglDescriptor {
            address: 16,
            ..SglDescriptor::in_capsule(32)
        };
        assert_eq!(
            decode(&capsule(offset, &data), &controller),
            Err(PduError::UnsupportedParameter {
                pdu_type: 4,
                offset: 32,
                value: 16
            })
        );
        assert_eq!(
            decode(&capsule(SglDescriptor::in_capsule(64), &data), &controller),
            Err(invalid(4, 40, 64))
        );
        assert_eq!(
            decode(&capsule(SglDescriptor::in_capsule(64), &[]), &controller),
            Err(invalid(4, 40, 64)),
            "an in-capsule descriptor without the data"
        );
    }

    #[test]
    fn initialize_requests_are_checked() {
        let controller = Negotiated::initial(Role::Controller);
        let ic_req = IcReq {
            format_version: PFV_1_0,
            host_pda: 0,
            header_digest: false,
            data_digest: false,
            maxr2t: 0,
        };
        let good = encoded(&Pdu::IcReq(ic_req), &Negotiated::initial(Role::Host));
        let mut bytes = good.clone();
        bytes[8] = 1;
        let error = decode(&bytes, &controller).expect_err("pfv 1");
        assert_eq!(
            error,
            PduError::UnsupportedParameter {
                pdu_type: 0,
                offset: 8,
                value: 1
            }
        );
        assert_eq!(error.fatal_error_information(), 8);
        let mut bytes = good.clone();
        bytes[10] = 32;
        assert_eq!(decode(&bytes, &controller), Err(invalid(0, 10, 32)));
        let mut bytes = good.clone();
        bytes[11] = 0xfc; // reserved DGST bits only
        assert!(decode(&bytes, &controller).is_ok());
        let mut bytes = good;
        bytes[1] = FLAG_HDGSTF;
        assert_eq!(decode(&bytes, &controller), Err(invalid(0, 1, 1)));

        let ic_resp = IcResp {
            format_version: PFV_1_0,
            controller_pda: 0,
            header_digest: false,
            data_digest: false,
            maxh2cdata: 1000,
        };
        let bytes = encoded(&Pdu::IcResp(ic_resp), &controller);
        assert_eq!(
            decode(&bytes, &Negotiated::initial(Role::Host)),
            Err(invalid(1, 12, 1000))
        );
    }

    #[test]
    fn success_without_last_pdu_is_invalid() {
        let (controller, host) = no_digests();
        let mut bytes = encoded(
            &Pdu::C2HData(C2HData {
                command_id: 1,
                data_offset_bytes: 0,
                data: &[0; 8],
                last: true,
                success: true,
            }),
            &controller,
        );
        assert_eq!(bytes[1], FLAG_LAST_PDU | FLAG_SUCCESS);
        assert!(decode(&bytes, &host).is_ok());
        bytes[1] = FLAG_SUCCESS;
        assert_eq!(decode(&bytes, &host), Err(invalid(7, 1, 8)));
    }

    #[test]
    fn a_data_digest_error_skips_one_pdu_and_names_its_command() {
        let (controller, host) = established(true, true, 0, 0);
        let mut stream = Vec::new();
        let sqe = Sqe {
            command_id: 42,
            data_pointer: SglDescriptor::in_capsule(8),
            ..Sqe::default()
        };
        encode(
            &Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &[7; 8] }),
            &host,
            &mut stream,
        );
        let first_size = stream.len();
        stream[first_size - 5] ^= 0x10; // last data byte
        let next = Pdu::H2CData(H2CData {
            command_id: 43,
            transfer_tag: 1,
            data_offset_bytes: 0,
            data: &[1; 4],
            last: true,
        });
        encode(&next, &host, &mut stream);
        let error = decode(&stream, &controller).expect_err("digest");
        let PduError::DataDigest {
            command_id,
            pdu_size_bytes,
            ..
        } = error
        else {
            panic!("not a data digest error: {error}");
        };
        assert_eq!((command_id, pdu_size_bytes as usize), (42, first_size));
        assert!(!error.is_fatal());
        assert_eq!(
            decode(&stream[first_size..], &controller),
            Ok(Some((next, stream.len() - first_size)))
        );
    }

    #[test]
    fn a_fatal_error_becomes_a_term_req_the_peer_decodes() {
        let (controller, host) = established(true, false, 0, 0);
        let mut bytes = capsule_with_data(&[1, 2, 3, 4]); // no HDGSTF: invalid flags
        bytes.truncate(8);
        let error = decode(&bytes, &controller).expect_err("flags");
        let error_data = term_req_error_data(&bytes);
        assert_eq!(
            error_data,
            &bytes[..8],
            "only the common header has arrived"
        );
        let term = error.term_req(Role::Controller, error_data).expect("fatal");
        let sent = encoded(&term, &controller);
        assert_eq!(sent.len(), 24 + 8);
        // FES 1 and FEI 1 at bytes 8 and 10, no digest on a TermReq.
        assert_eq!(&sent[..12], &[3, 0, 24, 0, 32, 0, 0, 0, 1, 0, 1, 0]);
        let Ok(Some((Pdu::C2HTermReq(received), 32))) = decode(&sent, &host) else {
            panic!("not a termreq");
        };
        assert_eq!(
            FatalErrorStatus::from_code(received.fatal_error_status),
            Some(FatalErrorStatus::InvalidHeaderField)
        );
        assert_eq!(received.fatal_error_information, 1);
        assert_eq!(received.error_data, &bytes[..8]);
    }

    #[test]
    fn term_req_error_data_takes_a_plausible_header() {
        let bytes = capsule_with_data(&[0; 200]);
        assert_eq!(term_req_error_data(&bytes).len(), 72);
        assert_eq!(term_req_error_data(&bytes[..30]).len(), 30);
        let mut bogus = bytes.clone();
        bogus[2] = 3;
        assert_eq!(term_req_error_data(&bogus).len(), 8);
        let mut bogus = bytes;
        bogus[2] = 200;
        assert_eq!(term_req_error_data(&bogus).len(), 128);
        assert_eq!(term_req_error_data(&[1, 2]), &[1, 2]);
    }

    #[test]
    fn malformed_term_reqs_are_not_answered() {
        let (controller, host) = no_digests();
        for (offset, bytes) in [
            (4u32, [PDU_TYPE_H2C_TERM_REQ, 0, 24, 0, 200, 0, 0, 0]),
            (4, [PDU_TYPE_H2C_TERM_REQ, 0, 24, 0, 20, 0, 0, 0]),
            (2, [PDU_TYPE_H2C_TERM_REQ, 0, 28, 0, 40, 0, 0, 0]),
            (1, [PDU_TYPE_H2C_TERM_REQ, 1, 24, 0, 24, 0, 0, 0]),
        ] {
            let error = decode(&bytes, &controller).expect_err("malformed");
            assert!(matches!(error, PduError::InvalidTermReq { offset: o, .. } if o == offset));
            assert!(error.is_fatal());
            assert_eq!(error.term_req(Role::Controller, &bytes), None);
        }
        // A TermReq is accepted before the connection is established.
        let term = Pdu::H2CTermReq(TermReq {
            fatal_error_status: 0x06,
            fatal_error_information: 8,
            error_data: &[0; 128],
        });
        let bytes = encoded(&term, &host);
        assert_eq!(bytes.len(), 152);
        assert_eq!(
            decode(&bytes, &Negotiated::initial(Role::Controller)),
            Ok(Some((term, 152)))
        );
    }

    #[test]
    fn fatal_error_status_codes_round_trip() {
        for code in 0..=8u16 {
            match FatalErrorStatus::from_code(code) {
                Some(status) => assert_eq!(status.code(), code),
                None => assert!(code == 0 || code > 6),
            }
        }
    }

    #[test]
    fn negotiation_then_traffic_uses_the_new_state() {
        // Goal: the controller decodes an ICReq with the initial state, answers, and then
        // decodes the host's first capsule with digests on.
        let ic_req = IcReq {
            format_version: PFV_1_0,
            host_pda: 0,
            header_digest: true,
            data_digest: true,
            maxr2t: 0,
        };
        let mut stream = encoded(&Pdu::IcReq(ic_req), &Negotiated::initial(Role::Host));
        let (_, host) = established(true, true, 0, 0);
        encode(
            &Pdu::CapsuleCmd(CapsuleCmd {
                sqe: Sqe::default(),
                data: &[],
            }),
            &host,
            &mut stream,
        );
        let Ok(Some((Pdu::IcReq(received), used))) =
            decode(&stream, &Negotiated::initial(Role::Controller))
        else {
            panic!("no icreq");
        };
        let (ic_resp, negotiated) = Negotiated::accept_ic_req(&received, 128 << 10, 8192);
        assert!(ic_resp.header_digest && ic_resp.data_digest);
        let (pdu, _) = decode(&stream[used..], &negotiated)
            .expect("valid")
            .expect("complete");
        assert_eq!(pdu.pdu_type(), PDU_TYPE_CAPSULE_CMD);
    }
}
