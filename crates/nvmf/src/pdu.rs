//! NVMe/TCP PDUs: their layouts, the state negotiated by ICReq/ICResp, and the encoder.
//! The decoder is in `crate::decoder`.
//!
//! Every PDU starts with an 8-byte common header (CH); all integers are little-endian:
//!
//! ```text
//! 0 PDU-Type u8   1 FLAGS u8   2 HLEN u8 (CH + PDU specific header)   3 PDO u8   4 PLEN u32
//! ```
//!
//! The whole PDU, in order: header (HLEN bytes), header digest (4 bytes, when negotiated
//! and the type carries one), padding up to PDO, data, data digest (4 bytes, when
//! negotiated, the type carries one and there is data). PLEN counts all of it.
//!
//! | type | name        | dir | HLEN | header digest | data | data digest | PDU specific header |
//! |------|-------------|-----|------|---------------|------|-------------|---------------------|
//! | 0x00 | ICReq       | H2C | 128  | no            | no   | no          | 8 PFV u16, 10 HPDA u8, 11 DGST u8, 12 MAXR2T u32 (0's based) |
//! | 0x01 | ICResp      | C2H | 128  | no            | no   | no          | 8 PFV u16, 10 CPDA u8, 11 DGST u8, 12 MAXH2CDATA u32 |
//! | 0x02 | H2CTermReq  | H2C | 24   | no            | ≤128 | no          | 8 FES u16, 10 FEI u32 |
//! | 0x03 | C2HTermReq  | C2H | 24   | no            | ≤128 | no          | as H2CTermReq |
//! | 0x04 | CapsuleCmd  | H2C | 72   | yes           | in-capsule | yes   | 8 SQE (64 bytes) |
//! | 0x05 | CapsuleResp | C2H | 24   | yes           | no   | no          | 8 CQE (16 bytes) |
//! | 0x06 | H2CData     | H2C | 24   | yes           | yes  | yes         | 8 CCCID u16, 10 TTAG u16, 12 DATAO u32, 16 DATAL u32 |
//! | 0x07 | C2HData     | C2H | 24   | yes           | yes  | yes         | 8 CCCID u16, 12 DATAO u32, 16 DATAL u32 |
//! | 0x09 | R2T         | C2H | 24   | yes           | no   | no          | 8 CCCID u16, 10 TTAG u16, 12 R2TO u32, 16 R2TL u32 |
//!
//! Other bytes of the headers are reserved: written as zeroes, ignored on receipt.
//! Flags: HDGSTF (bit 0) and DDGSTF (bit 1) say a digest is present; LAST_PDU (bit 2) on
//! H2CData and C2HData; SUCCESS (bit 3) on C2HData, only with LAST_PDU (the controller
//! then sends no response capsule). Digests are CRC32C, stored little-endian: the header
//! digest covers the HLEN header bytes, the data digest the data bytes (not the padding).
//!
//! Alignment: a PDA (HPDA in ICReq, CPDA in ICResp) is a 0's based count of dwords, 0 to
//! 31, so data starts on a multiple of 4 to 128 bytes. A PDU with data has PDO = header +
//! header digest rounded up to the receiver's alignment, zero-filled in between; a PDU
//! without data has PDO 0.

use crate::command::{SQE_SIZE, Sqe};
use crate::completion::{CQE_SIZE, Cqe};
use crate::layout::{put_u16, put_u32};

/// PDU type: Initialize Connection Request (host to controller).
pub const PDU_TYPE_IC_REQ: u8 = 0x00;
/// PDU type: Initialize Connection Response (controller to host).
pub const PDU_TYPE_IC_RESP: u8 = 0x01;
/// PDU type: Host to Controller Terminate Connection Request.
pub const PDU_TYPE_H2C_TERM_REQ: u8 = 0x02;
/// PDU type: Controller to Host Terminate Connection Request.
pub const PDU_TYPE_C2H_TERM_REQ: u8 = 0x03;
/// PDU type: Command Capsule.
pub const PDU_TYPE_CAPSULE_CMD: u8 = 0x04;
/// PDU type: Response Capsule.
pub const PDU_TYPE_CAPSULE_RESP: u8 = 0x05;
/// PDU type: Host to Controller Data.
pub const PDU_TYPE_H2C_DATA: u8 = 0x06;
/// PDU type: Controller to Host Data.
pub const PDU_TYPE_C2H_DATA: u8 = 0x07;
/// PDU type: Ready to Transfer.
pub const PDU_TYPE_R2T: u8 = 0x09;

/// Common header flag: a header digest follows the header.
pub const FLAG_HDGSTF: u8 = 1 << 0;
/// Common header flag: a data digest follows the data.
pub const FLAG_DDGSTF: u8 = 1 << 1;
/// H2CData and C2HData flag: the last data PDU of the transfer (of an R2T, for H2CData).
pub const FLAG_LAST_PDU: u8 = 1 << 2;
/// C2HData flag: the command succeeded and no response capsule follows.
pub const FLAG_SUCCESS: u8 = 1 << 3;

/// ICReq/ICResp DGST bit: header digests.
pub const DIGEST_HEADER: u8 = 1 << 0;
/// ICReq/ICResp DGST bit: data digests.
pub const DIGEST_DATA: u8 = 1 << 1;

/// Bytes of the common header.
pub const COMMON_HEADER_SIZE: usize = 8;
/// HLEN and PLEN of ICReq and ICResp.
pub const IC_SIZE: usize = 128;
/// HLEN of H2CTermReq and C2HTermReq.
pub const TERM_REQ_HEADER_SIZE: usize = 24;
/// Most bytes of a TermReq's error data (the start of the PDU in error).
pub const TERM_REQ_ERROR_DATA_SIZE_MAX: usize = 128;
/// Largest PLEN of a TermReq.
pub const TERM_REQ_SIZE_MAX: usize = TERM_REQ_HEADER_SIZE + TERM_REQ_ERROR_DATA_SIZE_MAX;
/// HLEN of CapsuleCmd: the common header and a 64-byte SQE.
pub const CAPSULE_CMD_HEADER_SIZE: usize = COMMON_HEADER_SIZE + SQE_SIZE;
/// HLEN of CapsuleResp: the common header and a 16-byte CQE.
pub const CAPSULE_RESP_HEADER_SIZE: usize = COMMON_HEADER_SIZE + CQE_SIZE;
/// HLEN of H2CData and C2HData.
pub const DATA_HEADER_SIZE: usize = 24;
/// HLEN of R2T.
pub const R2T_HEADER_SIZE: usize = 24;
/// Bytes of a header or data digest.
pub const DIGEST_SIZE: usize = 4;

/// The only PDU format version defined (NVMe/TCP 1.0).
pub const PFV_1_0: u16 = 0;
/// Largest HPDA or CPDA (0's based dwords: 128-byte alignment).
pub const PDA_MAX: u8 = 31;
/// Smallest MAXH2CDATA a controller may advertise.
pub const MAXH2CDATA_MIN: u32 = 4096;
/// In-capsule data a controller accepts on the admin queue and for fabrics commands, and
/// so before Connect has said which queue a connection is (Connect's own 1024 bytes of
/// data always travel in the capsule). SPDK accepts 8 KiB there; Linux hosts send at most
/// 8 KiB less the 64-byte SQE.
pub const IN_CAPSULE_DATA_SIZE_ADMIN: u32 = 8192;
/// Most data bytes in one PDU this crate accepts or sends, whatever was negotiated. A
/// connection holds a whole PDU in memory before acting on it, so this bounds a
/// connection's receive buffer; 4 MiB carries the largest write `basalt-wire` moves in one
/// frame.
pub const PDU_DATA_SIZE_MAX: u32 = 4 << 20;

const _: () = assert!(MAXH2CDATA_MIN <= PDU_DATA_SIZE_MAX);
const _: () = assert!(IN_CAPSULE_DATA_SIZE_ADMIN <= PDU_DATA_SIZE_MAX);
// The largest PDO (128-byte alignment past a 72-byte header and its digest) fits its u8.
const _: () = assert!(CAPSULE_CMD_HEADER_SIZE + DIGEST_SIZE <= 4 * (PDA_MAX as usize + 1));
const _: () = assert!(4 * (PDA_MAX as usize + 1) <= u8::MAX as usize);

/// Which end of the connection this is: it decides which PDU types may arrive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// The target side: receives ICReq, H2CTermReq, CapsuleCmd, H2CData.
    Controller,
    /// The initiator side: receives ICResp, C2HTermReq, CapsuleResp, C2HData, R2T.
    Host,
}

impl Role {
    /// Whether PDUs of `pdu_type` travel towards this end.
    pub fn receives(self, pdu_type: u8) -> bool {
        match self {
            Role::Controller => matches!(
                pdu_type,
                PDU_TYPE_IC_REQ | PDU_TYPE_H2C_TERM_REQ | PDU_TYPE_CAPSULE_CMD | PDU_TYPE_H2C_DATA
            ),
            Role::Host => matches!(
                pdu_type,
                PDU_TYPE_IC_RESP
                    | PDU_TYPE_C2H_TERM_REQ
                    | PDU_TYPE_CAPSULE_RESP
                    | PDU_TYPE_C2H_DATA
                    | PDU_TYPE_R2T
            ),
        }
    }
}

/// What one end of a connection knows about it: its role, whether ICReq/ICResp have
/// been exchanged, and what they settled. The decoder and encoder take it by reference;
/// the connection replaces it once the ICResp is sent (controller) or received (host).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// Which end this is.
    pub role: Role,
    /// Whether ICReq and ICResp have been exchanged. Before, only they (and TermReqs) may
    /// arrive; after, they are PDU sequence errors.
    pub established: bool,
    /// Header digests on the PDU types that carry them.
    pub header_digest: bool,
    /// Data digests on the PDU types that carry them, when they carry data.
    pub data_digest: bool,
    /// Alignment this end asked for the data it receives, as a 0's based dword count
    /// (CPDA on a controller, HPDA on a host).
    pub receive_pda: u8,
    /// Alignment the peer asked for the data it receives (HPDA on a controller, CPDA on a
    /// host).
    pub send_pda: u8,
    /// Most data bytes in one H2CData (controller: the MAXH2CDATA it advertised) or
    /// C2HData (host) PDU this end accepts.
    pub data_size_max: u32,
    /// Most in-capsule data bytes in one CapsuleCmd this end accepts (controller only).
    pub in_capsule_data_size_max: u32,
}

impl Negotiated {
    /// The state of a new connection: nothing negotiated, no digests, no data accepted.
    pub fn initial(role: Role) -> Self {
        Self {
            role,
            established: false,
            header_digest: false,
            data_digest: false,
            receive_pda: 0,
            send_pda: 0,
            data_size_max: 0,
            in_capsule_data_size_max: 0,
        }
    }

    /// The controller's answer to an ICReq, and the state it establishes. Digests are
    /// granted as asked (both are supported); CPDA is 0, since no alignment is needed
    /// here and Linux hosts refuse any other value. `maxh2cdata` and
    /// `in_capsule_data_size_max` are this controller's limits.
    pub fn accept_ic_req(
        ic_req: &IcReq,
        maxh2cdata: u32,
        in_capsule_data_size_max: u32,
    ) -> (IcResp, Negotiated) {
        assert!(
            maxh2cdata >= MAXH2CDATA_MIN && maxh2cdata.is_multiple_of(4),
            "MAXH2CDATA {maxh2cdata} must be a multiple of 4 from {MAXH2CDATA_MIN}"
        );
        let ic_resp = IcResp {
            format_version: PFV_1_0,
            controller_pda: 0,
            header_digest: ic_req.header_digest,
            data_digest: ic_req.data_digest,
            maxh2cdata,
        };
        let negotiated = Negotiated {
            role: Role::Controller,
            established: true,
            header_digest: ic_req.header_digest,
            data_digest: ic_req.data_digest,
            receive_pda: ic_resp.controller_pda,
            // The decoder refuses a larger HPDA; `min` keeps a hand-built IcReq in range.
            send_pda: ic_req.host_pda.min(PDA_MAX),
            data_size_max: maxh2cdata,
            in_capsule_data_size_max,
        };
        negotiated.check_invariants();
        (ic_resp, negotiated)
    }

    /// Asserts what the codecs rely on: alignments in range, limits within
    /// [`PDU_DATA_SIZE_MAX`].
    pub fn check_invariants(&self) {
        assert!(
            self.receive_pda <= PDA_MAX,
            "receive pda {}",
            self.receive_pda
        );
        assert!(self.send_pda <= PDA_MAX, "send pda {}", self.send_pda);
        assert!(
            self.data_size_max <= PDU_DATA_SIZE_MAX,
            "data size max {}",
            self.data_size_max
        );
        assert!(
            self.in_capsule_data_size_max <= PDU_DATA_SIZE_MAX,
            "in-capsule data size max {}",
            self.in_capsule_data_size_max
        );
    }

    /// The most bytes one received PDU can take: a connection's receive buffer needs this
    /// much room to decode any PDU the decoder accepts.
    pub fn pdu_size_max(&self) -> usize {
        if !self.established {
            return TERM_REQ_SIZE_MAX.max(IC_SIZE);
        }
        let data_max = self.data_size_max.max(self.in_capsule_data_size_max);
        // PDO is a u8, so data never starts past byte 255.
        let data_pdu_max = usize::from(u8::MAX) + to_usize(data_max) + DIGEST_SIZE;
        data_pdu_max.max(TERM_REQ_SIZE_MAX).max(IC_SIZE)
    }
}

/// Bytes of data alignment for a PDA (0's based dwords).
pub(crate) fn alignment(pda: u8) -> usize {
    4 * (usize::from(pda.min(PDA_MAX)) + 1)
}

/// Widens a wire u32 for indexing. Rust's `usize` is at least 32 bits on every target this
/// crate builds for, so the value is kept whole.
pub(crate) fn to_usize(value: u32) -> usize {
    value as usize
}

/// HLEN of a PDU type (0 for undefined types).
pub(crate) fn header_size(pdu_type: u8) -> usize {
    match pdu_type {
        PDU_TYPE_IC_REQ | PDU_TYPE_IC_RESP => IC_SIZE,
        PDU_TYPE_H2C_TERM_REQ | PDU_TYPE_C2H_TERM_REQ => TERM_REQ_HEADER_SIZE,
        PDU_TYPE_CAPSULE_CMD => CAPSULE_CMD_HEADER_SIZE,
        PDU_TYPE_CAPSULE_RESP => CAPSULE_RESP_HEADER_SIZE,
        PDU_TYPE_H2C_DATA | PDU_TYPE_C2H_DATA => DATA_HEADER_SIZE,
        PDU_TYPE_R2T => R2T_HEADER_SIZE,
        _ => 0,
    }
}

/// Whether a PDU type carries a header digest once header digests are negotiated.
pub(crate) fn carries_header_digest(pdu_type: u8) -> bool {
    matches!(
        pdu_type,
        PDU_TYPE_CAPSULE_CMD
            | PDU_TYPE_CAPSULE_RESP
            | PDU_TYPE_H2C_DATA
            | PDU_TYPE_C2H_DATA
            | PDU_TYPE_R2T
    )
}

/// Whether a PDU type may carry data placed at PDO (and then a data digest, when
/// negotiated). TermReqs carry error data right after their header, without either.
pub(crate) fn carries_data(pdu_type: u8) -> bool {
    matches!(
        pdu_type,
        PDU_TYPE_CAPSULE_CMD | PDU_TYPE_H2C_DATA | PDU_TYPE_C2H_DATA
    )
}

/// The flags a PDU type may have set.
pub(crate) fn flags_allowed(pdu_type: u8) -> u8 {
    match pdu_type {
        PDU_TYPE_CAPSULE_CMD => FLAG_HDGSTF | FLAG_DDGSTF,
        PDU_TYPE_CAPSULE_RESP | PDU_TYPE_R2T => FLAG_HDGSTF,
        PDU_TYPE_H2C_DATA => FLAG_HDGSTF | FLAG_DDGSTF | FLAG_LAST_PDU,
        PDU_TYPE_C2H_DATA => FLAG_HDGSTF | FLAG_DDGSTF | FLAG_LAST_PDU | FLAG_SUCCESS,
        _ => 0,
    }
}

/// Initialize Connection Request: the host's first PDU.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcReq {
    /// PDU format version ([`PFV_1_0`]).
    pub format_version: u16,
    /// HPDA: the alignment the host wants for C2HData, 0's based dwords (0 to 31).
    pub host_pda: u8,
    /// The host asks for header digests.
    pub header_digest: bool,
    /// The host asks for data digests.
    pub data_digest: bool,
    /// MAXR2T: R2Ts the host accepts outstanding per command, 0's based.
    pub maxr2t: u32,
}

impl IcReq {
    /// Outstanding R2Ts per command the host accepts (MAXR2T + 1).
    pub fn r2t_count_max(&self) -> u64 {
        u64::from(self.maxr2t) + 1
    }
}

/// Initialize Connection Response: the controller's answer to ICReq.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct IcResp {
    /// PDU format version ([`PFV_1_0`]).
    pub format_version: u16,
    /// CPDA: the alignment the controller wants for CapsuleCmd and H2CData data, 0's based
    /// dwords (0 to 31).
    pub controller_pda: u8,
    /// Header digests are on.
    pub header_digest: bool,
    /// Data digests are on.
    pub data_digest: bool,
    /// MAXH2CDATA: most data bytes per H2CData PDU; a multiple of 4, at least 4096.
    pub maxh2cdata: u32,
}

/// A Terminate Connection Request, H2C or C2H: the sender closes the connection after it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TermReq<'a> {
    /// Fatal error status (see `crate::FatalErrorStatus`); kept raw, since a peer may send
    /// values this crate does not know.
    pub fatal_error_status: u16,
    /// Fatal error information: the byte offset of the field in error for statuses 0x01 and
    /// 0x06, else 0.
    pub fatal_error_information: u32,
    /// The start of the PDU in error, at most [`TERM_REQ_ERROR_DATA_SIZE_MAX`] bytes.
    pub error_data: &'a [u8],
}

/// A command capsule: an SQE and any in-capsule data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsuleCmd<'a> {
    /// The command. With in-capsule data, its data pointer is an in-capsule descriptor of
    /// exactly `data.len()` bytes at offset 0 (the decoder checks; the encoder trusts).
    pub sqe: Sqe,
    /// In-capsule data (empty when the data, if any, moves in data PDUs).
    pub data: &'a [u8],
}

/// A response capsule: one CQE.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CapsuleResp {
    /// The completion.
    pub cqe: Cqe,
}

/// Host to controller data, answering an R2T.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct H2CData<'a> {
    /// CCCID: the command the data belongs to.
    pub command_id: u16,
    /// TTAG: the transfer tag of the R2T answered.
    pub transfer_tag: u16,
    /// DATAO: where the data goes in the command's data buffer.
    pub data_offset_bytes: u32,
    /// The data (DATAL bytes).
    pub data: &'a [u8],
    /// LAST_PDU: the last H2CData of this R2T.
    pub last: bool,
}

/// Controller to host data, for a command that reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct C2HData<'a> {
    /// CCCID: the command the data belongs to.
    pub command_id: u16,
    /// DATAO: where the data goes in the command's data buffer.
    pub data_offset_bytes: u32,
    /// The data (DATAL bytes).
    pub data: &'a [u8],
    /// LAST_PDU: the last C2HData of the command.
    pub last: bool,
    /// SUCCESS: the command succeeded and no CapsuleResp follows. Only with `last`, and
    /// only after the host disabled SQ flow control in Connect.
    pub success: bool,
}

/// Ready to Transfer: the controller asks for a range of a command's data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct R2T {
    /// CCCID: the command.
    pub command_id: u16,
    /// TTAG: a tag the H2CData PDUs answering this R2T repeat.
    pub transfer_tag: u16,
    /// R2TO: the offset of the range in the command's data.
    pub offset_bytes: u32,
    /// R2TL: the length of the range.
    pub len_bytes: u32,
}

/// A decoded PDU, borrowing its data from the receive buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Pdu<'a> {
    /// ICReq.
    IcReq(IcReq),
    /// ICResp.
    IcResp(IcResp),
    /// H2CTermReq.
    H2CTermReq(TermReq<'a>),
    /// C2HTermReq.
    C2HTermReq(TermReq<'a>),
    /// CapsuleCmd.
    CapsuleCmd(CapsuleCmd<'a>),
    /// CapsuleResp.
    CapsuleResp(CapsuleResp),
    /// H2CData.
    H2CData(H2CData<'a>),
    /// C2HData.
    C2HData(C2HData<'a>),
    /// R2T.
    R2T(R2T),
}

impl<'a> Pdu<'a> {
    /// The PDU-Type byte.
    pub fn pdu_type(&self) -> u8 {
        match self {
            Pdu::IcReq(_) => PDU_TYPE_IC_REQ,
            Pdu::IcResp(_) => PDU_TYPE_IC_RESP,
            Pdu::H2CTermReq(_) => PDU_TYPE_H2C_TERM_REQ,
            Pdu::C2HTermReq(_) => PDU_TYPE_C2H_TERM_REQ,
            Pdu::CapsuleCmd(_) => PDU_TYPE_CAPSULE_CMD,
            Pdu::CapsuleResp(_) => PDU_TYPE_CAPSULE_RESP,
            Pdu::H2CData(_) => PDU_TYPE_H2C_DATA,
            Pdu::C2HData(_) => PDU_TYPE_C2H_DATA,
            Pdu::R2T(_) => PDU_TYPE_R2T,
        }
    }

    /// The data the PDU carries (a TermReq's error data; empty for the types without data).
    pub fn data(&self) -> &'a [u8] {
        match self {
            Pdu::H2CTermReq(term) | Pdu::C2HTermReq(term) => term.error_data,
            Pdu::CapsuleCmd(capsule) => capsule.data,
            Pdu::H2CData(data) => data.data,
            Pdu::C2HData(data) => data.data,
            Pdu::IcReq(_) | Pdu::IcResp(_) | Pdu::CapsuleResp(_) | Pdu::R2T(_) => &[],
        }
    }
}

/// Appends the PDU's exact bytes to `out`: header, header digest, padding, data, data
/// digest. PDUs appended one after another to one buffer go out in one write.
pub fn encode(pdu: &Pdu<'_>, negotiated: &Negotiated, out: &mut Vec<u8>) {
    let data_digest = encode_header(pdu, negotiated, out);
    out.extend_from_slice(pdu.data());
    if let Some(digest) = data_digest {
        out.extend_from_slice(&digest);
    }
}

/// Appends everything of the PDU that comes before its data (header, header digest,
/// padding) and returns the data digest that must follow the data, if any. For vectored
/// writes that send the data from where it lies: header bytes, `pdu.data()`, digest.
pub fn encode_header(
    pdu: &Pdu<'_>,
    negotiated: &Negotiated,
    out: &mut Vec<u8>,
) -> Option<[u8; DIGEST_SIZE]> {
    let pdu_type = pdu.pdu_type();
    let data = pdu.data();
    let hlen = header_size(pdu_type);
    let mut header = [0u8; IC_SIZE];
    header[0] = pdu_type;
    let mut flags = encode_specific_header(pdu, &mut header);

    let header_digest = negotiated.header_digest && carries_header_digest(pdu_type);
    let placed_data = carries_data(pdu_type) && !data.is_empty();
    let data_digest = negotiated.data_digest && placed_data;
    let header_end = hlen + if header_digest { DIGEST_SIZE } else { 0 };
    let data_start = if placed_data {
        header_end.next_multiple_of(alignment(negotiated.send_pda))
    } else {
        header_end
    };
    let pdu_size = data_start + data.len() + if data_digest { DIGEST_SIZE } else { 0 };
    let pdu_size = u32::try_from(pdu_size).expect("data is bounded by PDU_DATA_SIZE_MAX");

    if header_digest {
        flags |= FLAG_HDGSTF;
    }
    if data_digest {
        flags |= FLAG_DDGSTF;
    }
    header[1] = flags;
    header[2] = u8::try_from(hlen).expect("headers are at most 128 bytes");
    // PDO is 0 when no data is placed; the const asserts above keep real values in a u8.
    header[3] = if placed_data {
        u8::try_from(data_start).expect("data starts before byte 256")
    } else {
        0
    };
    put_u32(&mut header, 4, pdu_size);

    let header = &header[..hlen];
    out.reserve(data_start + data.len() + DIGEST_SIZE);
    out.extend_from_slice(header);
    if header_digest {
        out.extend_from_slice(&crc32c::crc32c(header).to_le_bytes());
    }
    out.resize(out.len() + (data_start - header_end), 0);
    data_digest.then(|| crc32c::crc32c(data).to_le_bytes())
}

/// Writes the PDU specific header into `header` and returns the type's own flags
/// (LAST_PDU, SUCCESS). Asserts what a sender must never get wrong.
fn encode_specific_header(pdu: &Pdu<'_>, header: &mut [u8; IC_SIZE]) -> u8 {
    let data = pdu.data();
    match pdu {
        Pdu::IcReq(ic) => {
            assert!(ic.host_pda <= PDA_MAX, "hpda {}", ic.host_pda);
            put_u16(header, 8, ic.format_version);
            header[10] = ic.host_pda;
            header[11] = digest_bits(ic.header_digest, ic.data_digest);
            put_u32(header, 12, ic.maxr2t);
            0
        }
        Pdu::IcResp(ic) => {
            assert!(ic.controller_pda <= PDA_MAX, "cpda {}", ic.controller_pda);
            put_u16(header, 8, ic.format_version);
            header[10] = ic.controller_pda;
            header[11] = digest_bits(ic.header_digest, ic.data_digest);
            put_u32(header, 12, ic.maxh2cdata);
            0
        }
        Pdu::H2CTermReq(term) | Pdu::C2HTermReq(term) => {
            assert!(
                term.error_data.len() <= TERM_REQ_ERROR_DATA_SIZE_MAX,
                "termreq error data of {} bytes",
                term.error_data.len()
            );
            put_u16(header, 8, term.fatal_error_status);
            put_u32(header, 10, term.fatal_error_information);
            0
        }
        Pdu::CapsuleCmd(capsule) => {
            assert_data_size(data);
            header[COMMON_HEADER_SIZE..CAPSULE_CMD_HEADER_SIZE]
                .copy_from_slice(&capsule.sqe.encode());
            0
        }
        Pdu::CapsuleResp(capsule) => {
            header[COMMON_HEADER_SIZE..CAPSULE_RESP_HEADER_SIZE]
                .copy_from_slice(&capsule.cqe.encode());
            0
        }
        Pdu::H2CData(h2c) => {
            let len_bytes = assert_data_size(data);
            put_u16(header, 8, h2c.command_id);
            put_u16(header, 10, h2c.transfer_tag);
            put_u32(header, 12, h2c.data_offset_bytes);
            put_u32(header, 16, len_bytes);
            if h2c.last { FLAG_LAST_PDU } else { 0 }
        }
        Pdu::C2HData(c2h) => {
            assert!(!c2h.success || c2h.last, "SUCCESS without LAST_PDU");
            let len_bytes = assert_data_size(data);
            put_u16(header, 8, c2h.command_id);
            put_u32(header, 12, c2h.data_offset_bytes);
            put_u32(header, 16, len_bytes);
            (if c2h.last { FLAG_LAST_PDU } else { 0 }) | if c2h.success { FLAG_SUCCESS } else { 0 }
        }
        Pdu::R2T(r2t) => {
            put_u16(header, 8, r2t.command_id);
            put_u16(header, 10, r2t.transfer_tag);
            put_u32(header, 12, r2t.offset_bytes);
            put_u32(header, 16, r2t.len_bytes);
            0
        }
    }
}

/// The data's length as DATAL, asserting it is within [`PDU_DATA_SIZE_MAX`].
fn assert_data_size(data: &[u8]) -> u32 {
    assert!(
        data.len() <= to_usize(PDU_DATA_SIZE_MAX),
        "pdu data of {} bytes exceeds {PDU_DATA_SIZE_MAX}",
        data.len()
    );
    u32::try_from(data.len()).expect("checked against PDU_DATA_SIZE_MAX")
}

fn digest_bits(header: bool, data: bool) -> u8 {
    (if header { DIGEST_HEADER } else { 0 }) | if data { DIGEST_DATA } else { 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::command::SglDescriptor;

    fn controller() -> Negotiated {
        Negotiated {
            role: Role::Controller,
            established: true,
            header_digest: false,
            data_digest: false,
            receive_pda: 0,
            send_pda: 0,
            data_size_max: 128 << 10,
            in_capsule_data_size_max: IN_CAPSULE_DATA_SIZE_ADMIN,
        }
    }

    #[test]
    fn ic_req_bytes_match_the_spec_layout() {
        // What a Linux host sends asking for both digests: type 0, HLEN = PLEN = 128, PDO 0,
        // PFV 0, HPDA 0, DGST 0b11, MAXR2T 0 (one R2T), 112 reserved bytes.
        let ic_req = IcReq {
            format_version: PFV_1_0,
            host_pda: 0,
            header_digest: true,
            data_digest: true,
            maxr2t: 0,
        };
        let mut bytes = Vec::new();
        encode(
            &Pdu::IcReq(ic_req),
            &Negotiated::initial(Role::Host),
            &mut bytes,
        );
        let mut expected = vec![0x00, 0x00, 0x80, 0x00, 0x80, 0x00, 0x00, 0x00];
        expected.extend_from_slice(&[0x00, 0x00, 0x00, 0x03, 0x00, 0x00, 0x00, 0x00]);
        expected.resize(128, 0);
        assert_eq!(bytes, expected);
    }

    #[test]
    fn ic_resp_bytes_match_the_spec_layout() {
        let ic_req = IcReq {
            format_version: PFV_1_0,
            host_pda: 3,
            header_digest: true,
            data_digest: false,
            maxr2t: 0,
        };
        let (ic_resp, negotiated) = Negotiated::accept_ic_req(&ic_req, 0x0002_0000, 8192);
        let mut bytes = Vec::new();
        encode(
            &Pdu::IcResp(ic_resp),
            &Negotiated::initial(Role::Controller),
            &mut bytes,
        );
        let mut expected = vec![0x01, 0x00, 0x80, 0x00, 0x80, 0x00, 0x00, 0x00];
        // PFV 0, CPDA 0, DGST header only, MAXH2CDATA 128 KiB.
        expected.extend_from_slice(&[0x00, 0x00, 0x00, 0x01, 0x00, 0x00, 0x02, 0x00]);
        expected.resize(128, 0);
        assert_eq!(bytes, expected);
        assert!(negotiated.established && negotiated.header_digest && !negotiated.data_digest);
        assert_eq!((negotiated.send_pda, negotiated.receive_pda), (3, 0));
    }

    #[test]
    fn capsule_resp_with_header_digest_is_header_then_crc32c() {
        let negotiated = Negotiated {
            header_digest: true,
            data_digest: true,
            ..controller()
        };
        let cqe = Cqe {
            command_id: 0x0102,
            sq_head: 5,
            ..Cqe::default()
        };
        let mut bytes = Vec::new();
        encode(
            &Pdu::CapsuleResp(CapsuleResp { cqe }),
            &negotiated,
            &mut bytes,
        );
        assert_eq!(bytes.len(), 28);
        // Type 5, HDGSTF only (no data, so no DDGSTF), HLEN 24, PDO 0, PLEN 28.
        assert_eq!(
            &bytes[..8],
            &[0x05, 0x01, 0x18, 0x00, 0x1c, 0x00, 0x00, 0x00]
        );
        assert_eq!(&bytes[8..24], &cqe.encode());
        assert_eq!(&bytes[24..], &crc32c::crc32c(&bytes[..24]).to_le_bytes());
    }

    #[test]
    fn c2h_data_is_padded_to_the_hosts_alignment() {
        // HPDA 7: data on 32-byte boundaries. Header 24 + digest 4 = 28, so 4 bytes of pad.
        let negotiated = Negotiated {
            header_digest: true,
            data_digest: true,
            send_pda: 7,
            ..controller()
        };
        let data = [0xabu8; 10];
        let pdu = Pdu::C2HData(C2HData {
            command_id: 9,
            data_offset_bytes: 4096,
            data: &data,
            last: true,
            success: false,
        });
        let mut bytes = Vec::new();
        encode(&pdu, &negotiated, &mut bytes);
        assert_eq!(bytes.len(), 32 + 10 + 4);
        // Type 7, HDGSTF | DDGSTF | LAST_PDU, HLEN 24, PDO 32, PLEN 46.
        assert_eq!(
            &bytes[..8],
            &[0x07, 0x07, 0x18, 0x20, 0x2e, 0x00, 0x00, 0x00]
        );
        assert_eq!(&bytes[8..10], &[9, 0]);
        assert_eq!(&bytes[12..16], &4096u32.to_le_bytes());
        assert_eq!(&bytes[16..20], &10u32.to_le_bytes());
        assert_eq!(&bytes[28..32], &[0; 4], "padding is zeroes");
        assert_eq!(&bytes[32..42], &data);
        assert_eq!(&bytes[42..], &crc32c::crc32c(&data).to_le_bytes());
    }

    #[test]
    fn capsule_without_data_has_pdo_zero_and_no_data_digest() {
        let negotiated = Negotiated {
            data_digest: true,
            send_pda: 31,
            ..controller()
        };
        let sqe = Sqe {
            data_pointer: SglDescriptor::transport(4096),
            ..Sqe::default()
        };
        let mut bytes = Vec::new();
        let digest = encode_header(
            &Pdu::CapsuleCmd(CapsuleCmd { sqe, data: &[] }),
            &negotiated,
            &mut bytes,
        );
        assert_eq!(digest, None);
        assert_eq!(
            &bytes[..8],
            &[0x04, 0x00, 0x48, 0x00, 0x48, 0x00, 0x00, 0x00]
        );
    }

    #[test]
    fn crc32c_is_the_castagnoli_check_value() {
        // The standard check: CRC-32C of "123456789" (reflected, init and xorout all ones).
        assert_eq!(crc32c::crc32c(b"123456789"), 0xe306_9283);
    }

    #[test]
    fn pdu_size_max_covers_the_largest_data_pdu() {
        let negotiated = controller();
        assert!(negotiated.pdu_size_max() >= 128 + 4 + (128 << 10) + 4);
        assert_eq!(Negotiated::initial(Role::Host).pdu_size_max(), 152);
    }

    #[test]
    #[should_panic(expected = "SUCCESS without LAST_PDU")]
    fn success_without_last_is_a_programmer_error() {
        let pdu = Pdu::C2HData(C2HData {
            command_id: 1,
            data_offset_bytes: 0,
            data: &[1, 2, 3, 4],
            last: false,
            success: true,
        });
        encode(&pdu, &controller(), &mut Vec::new());
    }
}
