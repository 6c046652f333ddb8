//! Frames: one message each, identified by a request id that its reply repeats.
//!
//! ```text
//!  0 magic u16 (0xb5a1)   2 kind u16   4 body length u32   8 request id u64
//! 16 body crc32c u32     20 header crc32c u32 (of bytes 0..20)   24 body
//! ```

/// Bytes of a frame header.
pub const HEADER_SIZE: usize = 24;
/// The largest body: a 4 MiB write with room for its fields.
pub const BODY_SIZE_MAX: usize = (4 << 20) + 4096;
/// Marks a frame.
pub const MAGIC: u16 = 0xb5a1;

/// A decoded frame, borrowing its body from the buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Frame<'a> {
    /// The message kind.
    pub kind: u16,
    /// The request id (a reply carries its request's).
    pub request_id: u64,
    /// The body.
    pub body: &'a [u8],
}

/// Why bytes are not a frame. The connection cannot continue after one of these.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum FrameError {
    /// Not a frame header.
    #[error("bad frame magic {found:#06x}")]
    Magic {
        /// What was found.
        found: u16,
    },
    /// The header is damaged.
    #[error("frame header checksum mismatch")]
    HeaderChecksum,
    /// The body is larger than any message.
    #[error("frame body of {len} bytes exceeds the {BODY_SIZE_MAX}-byte maximum")]
    TooLarge {
        /// The length claimed.
        len: u64,
    },
    /// The body is damaged.
    #[error("frame body checksum mismatch (request {request_id})")]
    BodyChecksum {
        /// The request.
        request_id: u64,
    },
}

/// Encodes a frame.
pub fn encode(kind: u16, request_id: u64, body: &[u8]) -> Vec<u8> {
    assert!(
        body.len() <= BODY_SIZE_MAX,
        "frame body of {} bytes",
        body.len()
    );
    let mut bytes = Vec::with_capacity(HEADER_SIZE + body.len());
    bytes.extend_from_slice(&MAGIC.to_le_bytes());
    bytes.extend_from_slice(&kind.to_le_bytes());
    bytes.extend_from_slice(&(body.len() as u32).to_le_bytes());
    bytes.extend_from_slice(&request_id.to_le_bytes());
    bytes.extend_from_slice(&crc32c::crc32c(body).to_le_bytes());
    let header_crc = crc32c::crc32c(&bytes[..20]);
    bytes.extend_from_slice(&header_crc.to_le_bytes());
    bytes.extend_from_slice(body);
    bytes
}

/// Decodes the frame at the start of `buffer`: `Ok(None)` while it is incomplete, else the
/// frame and the bytes it took.
pub fn decode(buffer: &[u8]) -> Result<Option<(Frame<'_>, usize)>, FrameError> {
    let Some(header) = buffer.first_chunk::<HEADER_SIZE>() else {
        return Ok(None);
    };
    let magic = u16::from_le_bytes([header[0], header[1]]);
    if magic != MAGIC {
        return Err(FrameError::Magic { found: magic });
    }
    let stored_header_crc = u32::from_le_bytes([header[20], header[21], header[22], header[23]]);
    if crc32c::crc32c(&header[..20]) != stored_header_crc {
        return Err(FrameError::HeaderChecksum);
    }
    let kind = u16::from_le_bytes([header[2], header[3]]);
    let len = u32::from_le_bytes([header[4], header[5], header[6], header[7]]) as usize;
    if len > BODY_SIZE_MAX {
        return Err(FrameError::TooLarge { len: len as u64 });
    }
    let request_id = u64::from_le_bytes(header[8..16].try_into().expect("8 bytes"));
    let Some(body) = buffer.get(HEADER_SIZE..HEADER_SIZE + len) else {
        return Ok(None);
    };
    let body_crc = u32::from_le_bytes([header[16], header[17], header[18], header[19]]);
    if crc32c::crc32c(body) != body_crc {
        return Err(FrameError::BodyChecksum { request_id });
    }
    Ok(Some((
        Frame {
            kind,
            request_id,
            body,
        },
        HEADER_SIZE + len,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn frames_round_trip_and_wait_for_their_end(kind: u16, request_id: u64, body in proptest::collection::vec(any::<u8>(), 0..2000), cut in any::<prop::sample::Index>()) {
            let bytes = encode(kind, request_id, &body);
            let (frame, used) = decode(&bytes).expect("valid").expect("complete");
            prop_assert_eq!(frame, Frame { kind, request_id, body: &body });
            prop_assert_eq!(used, bytes.len());
            let cut = cut.index(bytes.len());
            prop_assert_eq!(decode(&bytes[..cut]), Ok(None), "a prefix is incomplete, not an error");
        }

        #[test]
        fn a_flipped_bit_is_an_error(body in proptest::collection::vec(any::<u8>(), 1..500), bit in any::<prop::sample::Index>()) {
            let mut bytes = encode(3, 9, &body);
            let bit = bit.index(bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            // A flip in the length field may make the frame look incomplete; never valid.
            prop_assert!(!matches!(decode(&bytes), Ok(Some(_))));
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = decode(&bytes);
        }
    }

    #[test]
    fn oversized_bodies_are_refused_from_the_header() {
        let mut bytes = encode(1, 1, &[]);
        bytes[4..8].copy_from_slice(&(u32::MAX).to_le_bytes());
        let crc = crc32c::crc32c(&bytes[..20]);
        bytes[20..24].copy_from_slice(&crc.to_le_bytes());
        assert_eq!(
            decode(&bytes),
            Err(FrameError::TooLarge {
                len: u64::from(u32::MAX)
            })
        );
    }
}
