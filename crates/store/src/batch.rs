//! The batch: the unit of one device write in the OSD's log.
//!
//! ```text
//! block 0: header
//!   0  magic "BSLTBTCH"      u64
//!   8  format version       u16
//!  10  entry count          u16
//!  12  reserved             u32 (zero)
//!  16  lsn                  u64  the batch's position in the log, 1, 2, 3, ...
//!  24  data blocks          u32  how many 4 KiB blocks of data follow the header
//!  28  header crc32c        u32  of the whole 4 KiB block with this field zeroed
//!  32  reserved             32 bytes (zero)
//!  64  descriptors, 64 bytes each:
//!        0 kind u8, 1..4 reserved, 4 pool u32, 8 pg index u32, 12 data crc32c u32,
//!       16 term u64, 24 index u64, 32 meta [u8; 24] (kind-specific), 56 data len u32,
//!       60 first data block u32 (counted from the first block after the header)
//! blocks 1..: each entry's data, starting on a block boundary, zero-padded to one
//! ```
//!
//! All integers are little-endian. Every entry's data is checksummed separately, and the
//! header checksum covers the descriptors, so a batch is accepted only when everything it
//! says and carries is intact.

use basalt_common::{Lsn, PgId, PoolId};

/// The block size of the log: every batch and every entry's data start on a block.
pub const BLOCK_SIZE: usize = 4096;
/// The blocks (numbered from the device's start) that `len_bytes` (more than none) from
/// `offset_bytes` touch.
pub fn blocks_touched(offset_bytes: u64, len_bytes: u64) -> std::ops::Range<u64> {
    let block = BLOCK_SIZE as u64;
    offset_bytes / block..(offset_bytes + len_bytes).div_ceil(block)
}

/// Bytes of a descriptor.
pub const DESCRIPTOR_SIZE: usize = 64;
/// Bytes before the first descriptor.
pub const HEADER_FIXED_SIZE: usize = 64;
/// The most entries one batch carries.
pub const ENTRY_COUNT_MAX: usize = (BLOCK_SIZE - HEADER_FIXED_SIZE) / DESCRIPTOR_SIZE;
/// The most data one batch carries.
pub const DATA_SIZE_MAX: usize = 4 << 20;
/// The most data one entry carries.
pub const ENTRY_DATA_SIZE_MAX: usize = DATA_SIZE_MAX;
/// Marks a batch header.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BSLTBTCH");
/// The format this code writes and reads.
pub const FORMAT_VERSION: u16 = 1;
/// Bytes of an entry's kind-specific metadata.
pub const META_SIZE: usize = 24;

const _: () = assert!(HEADER_FIXED_SIZE + ENTRY_COUNT_MAX * DESCRIPTOR_SIZE <= BLOCK_SIZE);
const _: () = assert!(DATA_SIZE_MAX.is_multiple_of(BLOCK_SIZE));

/// One log entry: a PG's Raft entry, hard state or other record; the layer above gives
/// `kind` and `meta` their meaning.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Entry {
    /// What the entry is (defined by the layer above).
    pub kind: u8,
    /// The PG it belongs to.
    pub pg: PgId,
    /// Raft term.
    pub term: u64,
    /// Raft index.
    pub index: u64,
    /// Kind-specific fields (e.g. the object and offset of a write).
    pub meta: [u8; META_SIZE],
    /// The payload (e.g. the data of a write); may be empty.
    pub data: Vec<u8>,
}

/// Why bytes are not a valid batch. On replay this ends the log: it is the torn tail.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum BatchError {
    /// No batch header here.
    #[error("no batch header (magic {found:#018x})")]
    NoMagic {
        /// What was found.
        found: u64,
    },
    /// A format this code does not read.
    #[error("batch format {version} is not {FORMAT_VERSION}")]
    Version {
        /// The version found.
        version: u16,
    },
    /// The header's checksum does not match.
    #[error("batch header checksum mismatch")]
    HeaderChecksum,
    /// A header from another place in the log (an older lap, or misdirected).
    #[error("batch lsn {found} where {expected} was expected")]
    Lsn {
        /// Expected.
        expected: u64,
        /// Found.
        found: u64,
    },
    /// A descriptor that points outside the batch or overlaps another.
    #[error("entry {entry} of the batch is malformed: {reason}")]
    Descriptor {
        /// Which entry.
        entry: usize,
        /// What is wrong.
        reason: &'static str,
    },
    /// An entry's data does not match its checksum (a torn or corrupt data write).
    #[error("entry {entry} data checksum mismatch")]
    DataChecksum {
        /// Which entry.
        entry: usize,
    },
    /// The batch is cut short.
    #[error("batch of {needed} bytes, only {available} available")]
    Truncated {
        /// Bytes the batch needs.
        needed: usize,
        /// Bytes there are.
        available: usize,
    },
}

/// A decoded header: where its entries' data lies.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Header {
    /// The batch's LSN.
    pub lsn: Lsn,
    /// Blocks of data after the header.
    pub data_blocks: u32,
    descriptors: Vec<Descriptor>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
struct Descriptor {
    kind: u8,
    pg: PgId,
    data_crc: u32,
    term: u64,
    index: u64,
    meta: [u8; META_SIZE],
    data_len: u32,
    first_block: u32,
}

impl Header {
    /// Bytes of the whole batch (header and data).
    pub fn batch_size(&self) -> usize {
        BLOCK_SIZE * (1 + self.data_blocks as usize)
    }

    /// Where each entry's data starts, in bytes from the start of the batch.
    pub fn data_offsets(&self) -> impl Iterator<Item = usize> + '_ {
        self.descriptors
            .iter()
            .map(|d| BLOCK_SIZE * (1 + d.first_block as usize))
    }
}

/// Bytes a batch of these entries takes.
pub fn batch_size(entries: &[Entry]) -> usize {
    BLOCK_SIZE
        + entries
            .iter()
            .map(|e| e.data.len().next_multiple_of(BLOCK_SIZE))
            .sum::<usize>()
}

/// Splits entries, in order, into runs that each fit one batch ([`ENTRY_COUNT_MAX`]
/// entries and [`DATA_SIZE_MAX`] bytes of block-rounded data at most; an entry too large for
/// any batch goes alone, for the log to refuse).
pub fn split(entries: impl IntoIterator<Item = Entry>) -> Vec<Vec<Entry>> {
    let mut runs: Vec<Vec<Entry>> = Vec::new();
    let mut data_bytes = 0usize;
    for entry in entries {
        let len = entry.data.len().next_multiple_of(BLOCK_SIZE);
        let full = runs
            .last()
            .is_none_or(|run| run.len() >= ENTRY_COUNT_MAX || data_bytes + len > DATA_SIZE_MAX);
        if full {
            runs.push(Vec::new());
            data_bytes = 0;
        }
        data_bytes += len;
        runs.last_mut().expect("a run").push(entry);
    }
    runs
}

/// Encodes entries as the batch at `lsn`. Callers keep to [`ENTRY_COUNT_MAX`] entries and
/// [`DATA_SIZE_MAX`] bytes of data; more is a programmer error.
pub fn encode(lsn: Lsn, entries: &[Entry]) -> Vec<u8> {
    assert!(
        entries.len() <= ENTRY_COUNT_MAX,
        "{} entries in one batch",
        entries.len()
    );
    let size = batch_size(entries);
    assert!(
        size - BLOCK_SIZE <= DATA_SIZE_MAX,
        "{} bytes of data in one batch",
        size - BLOCK_SIZE
    );
    let mut bytes = vec![0u8; size];
    let mut next_block = 0u32;
    for (number, entry) in entries.iter().enumerate() {
        let at = HEADER_FIXED_SIZE + number * DESCRIPTOR_SIZE;
        let d = &mut bytes[at..at + DESCRIPTOR_SIZE];
        d[0] = entry.kind;
        d[4..8].copy_from_slice(&entry.pg.pool.0.to_le_bytes());
        d[8..12].copy_from_slice(&entry.pg.index.to_le_bytes());
        d[12..16].copy_from_slice(&crc32c::crc32c(&entry.data).to_le_bytes());
        d[16..24].copy_from_slice(&entry.term.to_le_bytes());
        d[24..32].copy_from_slice(&entry.index.to_le_bytes());
        d[32..56].copy_from_slice(&entry.meta);
        let len = u32::try_from(entry.data.len()).expect("entry data is at most DATA_SIZE_MAX");
        d[56..60].copy_from_slice(&len.to_le_bytes());
        d[60..64].copy_from_slice(&next_block.to_le_bytes());
        let start = BLOCK_SIZE * (1 + next_block as usize);
        bytes[start..start + entry.data.len()].copy_from_slice(&entry.data);
        next_block +=
            u32::try_from(entry.data.len().div_ceil(BLOCK_SIZE)).expect("bounded by DATA_SIZE_MAX");
    }
    bytes[0..8].copy_from_slice(&MAGIC.to_le_bytes());
    bytes[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
    bytes[10..12].copy_from_slice(&(entries.len() as u16).to_le_bytes());
    bytes[16..24].copy_from_slice(&lsn.0.to_le_bytes());
    bytes[24..28].copy_from_slice(&next_block.to_le_bytes());
    let crc = crc32c::crc32c(&bytes[..BLOCK_SIZE]);
    bytes[28..32].copy_from_slice(&crc.to_le_bytes());
    debug_assert_eq!(
        decode(&bytes, lsn).map(|decoded| decoded.len()),
        Ok(entries.len())
    );
    bytes
}

/// Decodes and checks a header block that should be the batch at `expected`.
pub fn decode_header(block: &[u8], expected: Lsn) -> Result<Header, BatchError> {
    let Some(block) = block.get(..BLOCK_SIZE) else {
        return Err(BatchError::Truncated {
            needed: BLOCK_SIZE,
            available: block.len(),
        });
    };
    let magic = le_u64(&block[0..8]);
    if magic != MAGIC {
        return Err(BatchError::NoMagic { found: magic });
    }
    let mut zeroed = [0u8; BLOCK_SIZE];
    zeroed.copy_from_slice(block);
    zeroed[28..32].fill(0);
    if crc32c::crc32c(&zeroed) != le_u32(&block[28..32]) {
        return Err(BatchError::HeaderChecksum);
    }
    let version = le_u16(&block[8..10]);
    if version != FORMAT_VERSION {
        return Err(BatchError::Version { version });
    }
    let lsn = le_u64(&block[16..24]);
    if lsn != expected.0 {
        return Err(BatchError::Lsn {
            expected: expected.0,
            found: lsn,
        });
    }
    let count = usize::from(le_u16(&block[10..12]));
    if count > ENTRY_COUNT_MAX {
        return Err(BatchError::Descriptor {
            entry: count,
            reason: "more entries than fit",
        });
    }
    let data_blocks = le_u32(&block[24..28]);
    if data_blocks as usize > DATA_SIZE_MAX / BLOCK_SIZE {
        return Err(BatchError::Descriptor {
            entry: 0,
            reason: "more data than a batch holds",
        });
    }
    let mut descriptors = Vec::with_capacity(count);
    let mut next_block = 0u32;
    for entry in 0..count {
        let at = HEADER_FIXED_SIZE + entry * DESCRIPTOR_SIZE;
        let d = &block[at..at + DESCRIPTOR_SIZE];
        let mut meta = [0u8; META_SIZE];
        meta.copy_from_slice(&d[32..56]);
        let descriptor = Descriptor {
            kind: d[0],
            pg: PgId {
                pool: PoolId(le_u32(&d[4..8])),
                index: le_u32(&d[8..12]),
            },
            data_crc: le_u32(&d[12..16]),
            term: le_u64(&d[16..24]),
            index: le_u64(&d[24..32]),
            meta,
            data_len: le_u32(&d[56..60]),
            first_block: le_u32(&d[60..64]),
        };
        // Entries lie in order, each starting where the previous one's blocks end.
        if descriptor.first_block != next_block {
            return Err(BatchError::Descriptor {
                entry,
                reason: "data not where the previous entry ends",
            });
        }
        let blocks = descriptor.data_len.div_ceil(BLOCK_SIZE as u32);
        next_block = next_block
            .checked_add(blocks)
            .filter(|end| *end <= data_blocks)
            .ok_or(BatchError::Descriptor {
                entry,
                reason: "data past the end of the batch",
            })?;
        descriptors.push(descriptor);
    }
    if next_block != data_blocks {
        return Err(BatchError::Descriptor {
            entry: count,
            reason: "data blocks not all used",
        });
    }
    Ok(Header {
        lsn: expected,
        data_blocks,
        descriptors,
    })
}

/// Checks the data of a batch whose header decoded, and returns its entries.
pub fn decode_entries(header: &Header, batch: &[u8]) -> Result<Vec<Entry>, BatchError> {
    let (entries, damaged) = decode_entries_with_damage(header, batch)?;
    match damaged.first() {
        Some(&entry) => Err(BatchError::DataChecksum { entry }),
        None => Ok(entries),
    }
}

/// The entries of a batch whose header decoded, each with the data read, and the positions
/// of those whose data fails its checksum: for a batch known to have been written whole
/// (durable), where a failing checksum is damage, not a torn write.
pub fn decode_entries_with_damage(
    header: &Header,
    batch: &[u8],
) -> Result<(Vec<Entry>, Vec<usize>), BatchError> {
    if batch.len() < header.batch_size() {
        return Err(BatchError::Truncated {
            needed: header.batch_size(),
            available: batch.len(),
        });
    }
    let mut damaged = Vec::new();
    let entries = header
        .descriptors
        .iter()
        .enumerate()
        .map(|(entry, d)| {
            let start = BLOCK_SIZE * (1 + d.first_block as usize);
            let data = &batch[start..start + d.data_len as usize];
            if crc32c::crc32c(data) != d.data_crc {
                damaged.push(entry);
            }
            Entry {
                kind: d.kind,
                pg: d.pg,
                term: d.term,
                index: d.index,
                meta: d.meta,
                data: data.to_vec(),
            }
        })
        .collect();
    Ok((entries, damaged))
}

/// Decodes a whole batch that should be the one at `expected`.
pub fn decode(batch: &[u8], expected: Lsn) -> Result<Vec<Entry>, BatchError> {
    let header = decode_header(batch, expected)?;
    decode_entries(&header, batch)
}

fn le_u16(bytes: &[u8]) -> u16 {
    u16::from_le_bytes([bytes[0], bytes[1]])
}

fn le_u32(bytes: &[u8]) -> u32 {
    u32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]])
}

fn le_u64(bytes: &[u8]) -> u64 {
    let mut array = [0u8; 8];
    array.copy_from_slice(&bytes[..8]);
    u64::from_le_bytes(array)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use proptest::prelude::*;

    pub(crate) fn arbitrary_entry() -> impl Strategy<Value = Entry> {
        (
            any::<u8>(),
            0u32..8,
            0u32..256,
            any::<u64>(),
            any::<u64>(),
            any::<[u8; META_SIZE]>(),
            proptest::collection::vec(any::<u8>(), 0..9000),
        )
            .prop_map(|(kind, pool, index, term, raft_index, meta, data)| Entry {
                kind,
                pg: PgId {
                    pool: PoolId(pool),
                    index,
                },
                term,
                index: raft_index,
                meta,
                data,
            })
    }

    proptest! {
        /// Runs keep the entries' order and each fits one batch.
        #[test]
        fn split_keeps_order_and_fills_batches(sizes in proptest::collection::vec(0usize..(1 << 20), 0..200)) {
            let entries: Vec<Entry> = sizes.iter().enumerate().map(|(n, len)| Entry {
                kind: 2,
                pg: PgId { pool: PoolId(1), index: 0 },
                term: 1,
                index: n as u64,
                meta: [0; META_SIZE],
                data: vec![0; *len],
            }).collect();
            let runs = split(entries.clone());
            for (run, next) in runs.iter().zip(runs.iter().skip(1)) {
                prop_assert!(batch_size(run) - BLOCK_SIZE <= DATA_SIZE_MAX);
                prop_assert!(run.len() <= ENTRY_COUNT_MAX);
                // A run ends only when the next entry would not fit.
                let mut longer = run.clone();
                longer.push(next[0].clone());
                prop_assert!(longer.len() > ENTRY_COUNT_MAX || batch_size(&longer) - BLOCK_SIZE > DATA_SIZE_MAX);
            }
            prop_assert_eq!(runs.into_iter().flatten().collect::<Vec<_>>(), entries);
        }

        #[test]
        fn batches_round_trip(lsn in 1u64..u64::MAX, entries in proptest::collection::vec(arbitrary_entry(), 0..6)) {
            let bytes = encode(Lsn(lsn), &entries);
            prop_assert_eq!(bytes.len() % BLOCK_SIZE, 0);
            prop_assert_eq!(decode(&bytes, Lsn(lsn)), Ok(entries));
        }

        #[test]
        fn any_flipped_bit_is_detected(entries in proptest::collection::vec(arbitrary_entry(), 1..4), bit in any::<prop::sample::Index>()) {
            let mut bytes = encode(Lsn(5), &entries);
            let bit = bit.index(bytes.len() * 8);
            bytes[bit / 8] ^= 1 << (bit % 8);
            // Padding bytes are not covered: a flip there changes nothing that is read.
            let decoded = decode(&bytes, Lsn(5));
            prop_assert!(decoded.is_err() || decoded == Ok(entries));
        }

        #[test]
        fn decoding_garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..9000), lsn in any::<u64>()) {
            let _ = decode(&bytes, Lsn(lsn));
        }
    }

    #[test]
    fn wrong_lsn_is_refused() {
        let bytes = encode(Lsn(7), &[]);
        assert_eq!(
            decode(&bytes, Lsn(8)),
            Err(BatchError::Lsn {
                expected: 8,
                found: 7
            })
        );
    }

    #[test]
    fn data_is_block_aligned_and_separately_checked() {
        let entry = |byte: u8, len: usize| Entry {
            kind: 1,
            pg: PgId {
                pool: PoolId(1),
                index: 2,
            },
            term: 3,
            index: 4,
            meta: [9; META_SIZE],
            data: vec![byte; len],
        };
        let entries = [entry(1, 4096), entry(2, 100), entry(3, 0), entry(4, 5000)];
        let mut bytes = encode(Lsn(1), &entries);
        let header = decode_header(&bytes, Lsn(1)).expect("header");
        let offsets: Vec<usize> = header.data_offsets().collect();
        assert_eq!(offsets, [4096, 8192, 12288, 12288]);
        assert_eq!(bytes.len(), 4096 * 5);
        bytes[8192 + 50] ^= 0xff;
        assert_eq!(
            decode(&bytes, Lsn(1)),
            Err(BatchError::DataChecksum { entry: 1 })
        );
    }
}
