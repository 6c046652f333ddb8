//! The superblock: block 0 of an OSD's device.
//!
//! ```text
//!  0  magic "BSLTSUPR"  u64
//!  8  format version    u16
//! 10  reserved          u16
//! 12  block size        u32
//! 16  log start         u64  byte offset of the log region
//! 24  log end           u64  byte offset one past it
//! 32  first lsn         u64  LSN of the batch at log start
//! 40  uuid              16 bytes (the OSD's identity)
//! 56  checkpoint start  u64  byte offset of checkpoint area A; area B follows it
//! 64  checkpoint size   u64  bytes of each area
//! 72  crc32c            u32  of bytes 0..72
//! ```
//! Little-endian; the rest of the block is zero.

use basalt_common::Lsn;
use basalt_store::batch::BLOCK_SIZE;

/// Marks a Basalt OSD device.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BSLTSUPR");
/// The format this code writes and reads.
pub const FORMAT_VERSION: u16 = 2;

/// What the superblock says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Superblock {
    /// Byte offset of the log region.
    pub log_start_bytes: u64,
    /// Byte offset one past the log region.
    pub log_end_bytes: u64,
    /// LSN of the batch at the start of the log.
    pub first_lsn: Lsn,
    /// The OSD's identity.
    pub uuid: [u8; 16],
    /// Byte offset of checkpoint area A (area B follows).
    pub checkpoint_start_bytes: u64,
    /// Bytes of each checkpoint area.
    pub checkpoint_size_bytes: u64,
}

/// Why block 0 is not a superblock we can use.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum SuperblockError {
    /// Not a Basalt device (or never formatted).
    #[error("not a basalt osd device (magic {found:#018x})")]
    NoMagic {
        /// What was found.
        found: u64,
    },
    /// Damaged.
    #[error("superblock checksum mismatch")]
    Checksum,
    /// Written by another format.
    #[error("superblock format {version} is not {FORMAT_VERSION}")]
    Version {
        /// The version found.
        version: u16,
    },
    /// Fields that cannot be right.
    #[error("superblock describes an impossible layout: {reason}")]
    Layout {
        /// What is wrong.
        reason: &'static str,
    },
}

impl Superblock {
    /// The 4 KiB block.
    pub fn encode(&self) -> Vec<u8> {
        let mut block = vec![0u8; BLOCK_SIZE];
        block[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        block[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        block[12..16].copy_from_slice(&(BLOCK_SIZE as u32).to_le_bytes());
        block[16..24].copy_from_slice(&self.log_start_bytes.to_le_bytes());
        block[24..32].copy_from_slice(&self.log_end_bytes.to_le_bytes());
        block[32..40].copy_from_slice(&self.first_lsn.0.to_le_bytes());
        block[40..56].copy_from_slice(&self.uuid);
        block[56..64].copy_from_slice(&self.checkpoint_start_bytes.to_le_bytes());
        block[64..72].copy_from_slice(&self.checkpoint_size_bytes.to_le_bytes());
        let crc = crc32c::crc32c(&block[..72]);
        block[72..76].copy_from_slice(&crc.to_le_bytes());
        block
    }

    /// Decodes and checks block 0.
    pub fn decode(block: &[u8]) -> Result<Self, SuperblockError> {
        let field = |range: std::ops::Range<usize>| {
            block.get(range).map(|b| b.to_vec()).unwrap_or_default()
        };
        let u64_at = |at: usize| u64::from_le_bytes(field(at..at + 8).try_into().unwrap_or([0; 8]));
        let magic = u64_at(0);
        if magic != MAGIC {
            return Err(SuperblockError::NoMagic { found: magic });
        }
        // The version first: an older format has its checksum elsewhere.
        let version = u16::from_le_bytes(field(8..10).try_into().unwrap_or([0; 2]));
        if version != FORMAT_VERSION {
            return Err(SuperblockError::Version { version });
        }
        let stored = u32::from_le_bytes(field(72..76).try_into().unwrap_or([0; 4]));
        if crc32c::crc32c(&field(0..72)) != stored {
            return Err(SuperblockError::Checksum);
        }
        let block_size = u32::from_le_bytes(field(12..16).try_into().unwrap_or([0; 4]));
        let superblock = Self {
            log_start_bytes: u64_at(16),
            log_end_bytes: u64_at(24),
            first_lsn: Lsn(u64_at(32)),
            uuid: field(40..56).try_into().unwrap_or([0; 16]),
            checkpoint_start_bytes: u64_at(56),
            checkpoint_size_bytes: u64_at(64),
        };
        let aligned = |offset: u64| offset.is_multiple_of(BLOCK_SIZE as u64);
        if block_size as usize != BLOCK_SIZE {
            return Err(SuperblockError::Layout {
                reason: "block size is not 4096",
            });
        }
        if superblock.log_start_bytes < BLOCK_SIZE as u64
            || superblock.log_end_bytes <= superblock.log_start_bytes
            || !aligned(superblock.log_start_bytes)
            || !aligned(superblock.log_end_bytes)
        {
            return Err(SuperblockError::Layout {
                reason: "log region out of order or unaligned",
            });
        }
        let areas_end = superblock
            .checkpoint_size_bytes
            .checked_mul(2)
            .and_then(|n| n.checked_add(superblock.checkpoint_start_bytes));
        if superblock.checkpoint_start_bytes < BLOCK_SIZE as u64
            || superblock.checkpoint_size_bytes < BLOCK_SIZE as u64
            || !aligned(superblock.checkpoint_start_bytes)
            || !aligned(superblock.checkpoint_size_bytes)
            || areas_end.is_none_or(|end| end > superblock.log_start_bytes)
        {
            return Err(SuperblockError::Layout {
                reason: "checkpoint areas unaligned or overlapping the log",
            });
        }
        Ok(superblock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn superblock_round_trips_and_damage_is_detected() {
        let superblock = Superblock {
            log_start_bytes: 4096 + 2 * 65536,
            log_end_bytes: 1 << 30,
            first_lsn: Lsn(1),
            uuid: [7; 16],
            checkpoint_start_bytes: 4096,
            checkpoint_size_bytes: 65536,
        };
        let mut block = superblock.encode();
        assert_eq!(Superblock::decode(&block), Ok(superblock));
        block[20] ^= 1;
        assert_eq!(Superblock::decode(&block), Err(SuperblockError::Checksum));
        assert!(matches!(
            Superblock::decode(&[0u8; 4096]),
            Err(SuperblockError::NoMagic { found: 0 })
        ));
        assert!(matches!(
            Superblock::decode(&[]),
            Err(SuperblockError::NoMagic { .. })
        ));
        let bad_layout = Superblock {
            log_start_bytes: 0,
            ..superblock
        }
        .encode();
        assert!(matches!(
            Superblock::decode(&bad_layout),
            Err(SuperblockError::Layout { .. })
        ));
        let overlapping = Superblock {
            checkpoint_size_bytes: 1 << 20,
            ..superblock
        }
        .encode();
        assert!(matches!(
            Superblock::decode(&overlapping),
            Err(SuperblockError::Layout { .. })
        ));
        let mut older = superblock.encode();
        older[8] = 1;
        assert_eq!(
            Superblock::decode(&older),
            Err(SuperblockError::Version { version: 1 })
        );
    }
}
