//! Checkpoints: the OSD's index and every PG's raft state, so that a restart replays only
//! the log written since, and so that the log before it can be reused.
//!
//! ```text
//! block 0 (4 KiB header)
//!  0  magic "BSLTCKPT"  u64
//!  8  format version    u16, 6 bytes reserved
//! 16  sequence number   u64  (the newer of the two areas wins)
//! 24  replay position   u64  where replay starts
//! 32  replay LSN        u64  the LSN of the batch there
//! 40  tail position     u64  the ring is free before it
//! 48  tail LSN          u64  the LSN of the batch there
//! 56  body length       u64
//! 64  body CRC32C       u32
//! 68  header CRC32C     u32  of bytes 0..68
//! block 1... the body, then zeroes to a whole block
//! ```
//!
//! The body holds, per PG: hard state, applied index, compaction point, configurations, the raft
//! entries retained after the compaction point, and the object index; then (since format 3)
//! the checksums of the log blocks the object indexes refer to, in runs (device offset,
//! count, a CRC32C per block); then (since format 4) the runs of those blocks that are
//! poisoned (device offset, count). All little-endian. Formats 2 (no checksums) and 3 (no
//! poisoned blocks) are still read.

use basalt_common::{ImageId, Lsn, ObjectKey, PgId, PoolId};

use crate::batch::BLOCK_SIZE;
use crate::block_sums::SumRun;

/// Marks a checkpoint.
pub const MAGIC: u64 = u64::from_le_bytes(*b"BSLTCKPT");
/// The format this code writes and reads.
pub const FORMAT_VERSION: u16 = 4;
/// The oldest format this code reads: one without block checksums.
pub const OLDEST_FORMAT_VERSION: u16 = 2;

/// A raft entry kept in a checkpoint (data as the OSD keeps it in memory: a write is a
/// reference to its payload on the device).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RetainedEntry {
    /// Raft index.
    pub index: u64,
    /// Raft term.
    pub term: u64,
    /// Raft entry type.
    pub entry_type: u8,
    /// Entry data.
    pub data: Vec<u8>,
}

/// An object's extents: (offset in the object, length, device offset).
pub type ObjectExtents = (ObjectKey, Vec<(u64, u64, u64)>);

/// One PG replica's state in a checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PgCheckpoint {
    /// The PG.
    pub pg: PgId,
    /// Raft hard state: term.
    pub term: u64,
    /// Raft hard state: vote.
    pub vote: u64,
    /// Raft hard state: commit index.
    pub commit: u64,
    /// The last applied raft index; the object index is as of it.
    pub applied: u64,
    /// Raft index of the last compacted entry (0: none).
    pub compacted_index: u64,
    /// Its term.
    pub compacted_term: u64,
    /// The raft configurations (encoded) as of the compaction point and after each change
    /// applied since, with the changes' raft indexes.
    pub confs: Vec<(u64, Vec<u8>)>,
    /// The entries after the compaction point that were durable at the cut, in order.
    pub entries: Vec<RetainedEntry>,
    /// The object index.
    pub objects: Vec<ObjectExtents>,
}

/// A checkpoint.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Checkpoint {
    /// Sequence number: the higher valid one of the two areas is current.
    pub sequence: u64,
    /// Where replay starts.
    pub replay_position: u64,
    /// The LSN of the batch there.
    pub replay_lsn: Lsn,
    /// The ring is free before this position.
    pub tail_position: u64,
    /// The LSN of the batch at the tail.
    pub tail_lsn: Lsn,
    /// The PGs.
    pub pgs: Vec<PgCheckpoint>,
    /// The checksums of the log blocks the object indexes refer to (see
    /// [`crate::block_sums`]), in runs.
    pub block_sums: Vec<SumRun>,
    /// The runs (device offset of the first block, count) of the blocks among those that
    /// are poisoned (see [`crate::block_sums`]).
    pub poisoned_blocks: Vec<(u64, u32)>,
}

/// Why bytes are not a usable checkpoint.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum CheckpointError {
    /// No checkpoint here (a fresh area).
    #[error("no checkpoint (magic {found:#018x})")]
    NoMagic {
        /// What was found.
        found: u64,
    },
    /// The header is damaged.
    #[error("checkpoint header checksum mismatch")]
    HeaderChecksum,
    /// The body is damaged or was torn.
    #[error("checkpoint body checksum mismatch")]
    BodyChecksum,
    /// Another format.
    #[error("checkpoint format {version} is not one of {OLDEST_FORMAT_VERSION}..={FORMAT_VERSION}")]
    Version {
        /// The version found.
        version: u16,
    },
    /// Shorter than it says, or fields that cannot be right.
    #[error("malformed checkpoint: {reason}")]
    Malformed {
        /// What is wrong.
        reason: String,
    },
}

struct Writer(Vec<u8>);

impl Writer {
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u32(&mut self, v: u32) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.0.extend_from_slice(&v.to_le_bytes());
    }
    fn len(&mut self, n: usize) {
        self.u32(u32::try_from(n).expect("checkpoint counts fit a u32"));
    }
}

struct Reader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl Reader<'_> {
    fn take(&mut self, n: usize) -> Result<&[u8], CheckpointError> {
        let end = self
            .at
            .checked_add(n)
            .filter(|end| *end <= self.bytes.len());
        let Some(end) = end else {
            return Err(CheckpointError::Malformed {
                reason: format!(
                    "{n} bytes wanted at {}, body ends at {}",
                    self.at,
                    self.bytes.len()
                ),
            });
        };
        let slice = &self.bytes[self.at..end];
        self.at = end;
        Ok(slice)
    }
    fn u8(&mut self) -> Result<u8, CheckpointError> {
        Ok(self.take(1)?[0])
    }
    fn u32(&mut self) -> Result<u32, CheckpointError> {
        Ok(u32::from_le_bytes(
            self.take(4)?.try_into().expect("4 bytes"),
        ))
    }
    fn u64(&mut self) -> Result<u64, CheckpointError> {
        Ok(u64::from_le_bytes(
            self.take(8)?.try_into().expect("8 bytes"),
        ))
    }
    /// A count of items of at least `min_size` bytes each: refused if the rest cannot hold
    /// them, so that garbage never makes us allocate.
    fn count(&mut self, min_size: usize) -> Result<usize, CheckpointError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(min_size) > self.bytes.len() - self.at {
            return Err(CheckpointError::Malformed {
                reason: format!("{n} items cannot fit in what is left"),
            });
        }
        Ok(n)
    }
}

impl Checkpoint {
    /// The bytes to write: a whole number of blocks.
    pub fn encode(&self) -> Vec<u8> {
        let mut body = Writer(Vec::new());
        body.len(self.pgs.len());
        for pg in &self.pgs {
            body.u32(pg.pg.pool.0);
            body.u32(pg.pg.index);
            for v in [
                pg.term,
                pg.vote,
                pg.commit,
                pg.applied,
                pg.compacted_index,
                pg.compacted_term,
            ] {
                body.u64(v);
            }
            body.len(pg.confs.len());
            for (index, conf) in &pg.confs {
                body.u64(*index);
                body.len(conf.len());
                body.0.extend_from_slice(conf);
            }
            body.len(pg.entries.len());
            for entry in &pg.entries {
                body.u64(entry.index);
                body.u64(entry.term);
                body.u8(entry.entry_type);
                body.len(entry.data.len());
                body.0.extend_from_slice(&entry.data);
            }
            body.len(pg.objects.len());
            for (key, extents) in &pg.objects {
                body.u64(key.image.0);
                body.u64(key.number);
                body.len(extents.len());
                for (offset, len, device) in extents {
                    body.u64(*offset);
                    body.u64(*len);
                    body.u64(*device);
                }
            }
        }
        body.len(self.block_sums.len());
        for (start, sums) in &self.block_sums {
            body.u64(*start);
            body.len(sums.len());
            for sum in sums {
                body.u32(*sum);
            }
        }
        body.len(self.poisoned_blocks.len());
        for (start, count) in &self.poisoned_blocks {
            body.u64(*start);
            body.u32(*count);
        }
        let body = body.0;
        let mut bytes = vec![0u8; BLOCK_SIZE];
        bytes[0..8].copy_from_slice(&MAGIC.to_le_bytes());
        bytes[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
        bytes[16..24].copy_from_slice(&self.sequence.to_le_bytes());
        bytes[24..32].copy_from_slice(&self.replay_position.to_le_bytes());
        bytes[32..40].copy_from_slice(&self.replay_lsn.0.to_le_bytes());
        bytes[40..48].copy_from_slice(&self.tail_position.to_le_bytes());
        bytes[48..56].copy_from_slice(&self.tail_lsn.0.to_le_bytes());
        bytes[56..64].copy_from_slice(&(body.len() as u64).to_le_bytes());
        bytes[64..68].copy_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        let crc = crc32c::crc32c(&bytes[..68]);
        bytes[68..72].copy_from_slice(&crc.to_le_bytes());
        bytes.extend_from_slice(&body);
        bytes.resize(bytes.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
        bytes
    }

    /// The total length (header block and body, in whole blocks) a header block announces:
    /// read that much, then [`Checkpoint::decode`].
    pub fn length_from_header(block: &[u8]) -> Result<usize, CheckpointError> {
        check_header(block)?;
        let body = u64::from_le_bytes(block[56..64].try_into().expect("8 bytes"));
        let total = (BLOCK_SIZE as u64)
            .checked_add(body)
            .map(|n| n.div_ceil(BLOCK_SIZE as u64) * BLOCK_SIZE as u64)
            .and_then(|n| usize::try_from(n).ok());
        total.ok_or_else(|| CheckpointError::Malformed {
            reason: format!("body of {body} bytes"),
        })
    }

    /// Decodes and checks a checkpoint.
    pub fn decode(bytes: &[u8]) -> Result<Self, CheckpointError> {
        let total = Self::length_from_header(bytes)?;
        if bytes.len() < total {
            return Err(CheckpointError::Malformed {
                reason: format!("{} bytes, header says {total}", bytes.len()),
            });
        }
        let u64_at = |at: usize| u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8"));
        let body_len = u64_at(56) as usize;
        let body = &bytes[BLOCK_SIZE..BLOCK_SIZE + body_len];
        let stored = u32::from_le_bytes(bytes[64..68].try_into().expect("4 bytes"));
        if crc32c::crc32c(body) != stored {
            return Err(CheckpointError::BodyChecksum);
        }
        let mut r = Reader { bytes: body, at: 0 };
        let pg_count = r.count(64)?;
        let mut pgs = Vec::with_capacity(pg_count);
        for _ in 0..pg_count {
            let pg = PgId {
                pool: PoolId(r.u32()?),
                index: r.u32()?,
            };
            let mut state = PgCheckpoint {
                pg,
                term: r.u64()?,
                vote: r.u64()?,
                commit: r.u64()?,
                applied: r.u64()?,
                compacted_index: r.u64()?,
                compacted_term: r.u64()?,
                ..PgCheckpoint::default()
            };
            for _ in 0..r.count(12)? {
                let index = r.u64()?;
                let len = r.u32()? as usize;
                state.confs.push((index, r.take(len)?.to_vec()));
            }
            for _ in 0..r.count(21)? {
                let (index, term, entry_type) = (r.u64()?, r.u64()?, r.u8()?);
                let len = r.u32()? as usize;
                let data = r.take(len)?.to_vec();
                state.entries.push(RetainedEntry {
                    index,
                    term,
                    entry_type,
                    data,
                });
            }
            for _ in 0..r.count(20)? {
                let key = ObjectKey {
                    image: ImageId(r.u64()?),
                    number: r.u64()?,
                };
                let n = r.count(24)?;
                let mut extents = Vec::with_capacity(n);
                for _ in 0..n {
                    extents.push((r.u64()?, r.u64()?, r.u64()?));
                }
                state.objects.push((key, extents));
            }
            pgs.push(state);
        }
        let mut block_sums = Vec::new();
        let version = u16::from_le_bytes(bytes[8..10].try_into().expect("2 bytes"));
        if version >= 3 {
            for _ in 0..r.count(12)? {
                let start = r.u64()?;
                let n = r.count(4)?;
                let mut sums = Vec::with_capacity(n);
                for _ in 0..n {
                    sums.push(r.u32()?);
                }
                block_sums.push((start, sums));
            }
        }
        let mut poisoned_blocks = Vec::new();
        if version >= 4 {
            for _ in 0..r.count(12)? {
                poisoned_blocks.push((r.u64()?, r.u32()?));
            }
        }
        if r.at != body.len() {
            return Err(CheckpointError::Malformed {
                reason: format!("{} bytes left after the last pg", body.len() - r.at),
            });
        }
        Ok(Self {
            sequence: u64_at(16),
            replay_position: u64_at(24),
            replay_lsn: Lsn(u64_at(32)),
            tail_position: u64_at(40),
            tail_lsn: Lsn(u64_at(48)),
            pgs,
            block_sums,
            poisoned_blocks,
        })
    }
}

fn check_header(block: &[u8]) -> Result<(), CheckpointError> {
    if block.len() < BLOCK_SIZE {
        return Err(CheckpointError::Malformed {
            reason: format!("header of {} bytes", block.len()),
        });
    }
    let magic = u64::from_le_bytes(block[0..8].try_into().expect("8 bytes"));
    if magic != MAGIC {
        return Err(CheckpointError::NoMagic { found: magic });
    }
    let stored = u32::from_le_bytes(block[68..72].try_into().expect("4 bytes"));
    if crc32c::crc32c(&block[..68]) != stored {
        return Err(CheckpointError::HeaderChecksum);
    }
    let version = u16::from_le_bytes(block[8..10].try_into().expect("2 bytes"));
    if !(OLDEST_FORMAT_VERSION..=FORMAT_VERSION).contains(&version) {
        return Err(CheckpointError::Version { version });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pg_checkpoint() -> impl Strategy<Value = PgCheckpoint> {
        (
            (any::<u32>(), any::<u32>(), any::<[u64; 6]>()),
            proptest::collection::vec(
                (any::<u64>(), proptest::collection::vec(any::<u8>(), 0..12)),
                0..4,
            ),
            proptest::collection::vec(
                (
                    any::<u64>(),
                    any::<u64>(),
                    any::<u8>(),
                    proptest::collection::vec(any::<u8>(), 0..40),
                ),
                0..6,
            ),
            proptest::collection::vec(
                (
                    any::<u64>(),
                    any::<u64>(),
                    proptest::collection::vec(any::<(u64, u64, u64)>(), 0..4),
                ),
                0..5,
            ),
        )
            .prop_map(|((pool, index, v), confs, entries, objects)| PgCheckpoint {
                pg: PgId {
                    pool: PoolId(pool),
                    index,
                },
                term: v[0],
                vote: v[1],
                commit: v[2],
                applied: v[3],
                compacted_index: v[4],
                compacted_term: v[5],
                confs,
                entries: entries
                    .into_iter()
                    .map(|(index, term, entry_type, data)| RetainedEntry {
                        index,
                        term,
                        entry_type,
                        data,
                    })
                    .collect(),
                objects: objects
                    .into_iter()
                    .map(|(image, number, extents)| {
                        (
                            ObjectKey {
                                image: ImageId(image),
                                number,
                            },
                            extents,
                        )
                    })
                    .collect(),
            })
    }

    fn checkpoint() -> impl Strategy<Value = Checkpoint> {
        (
            any::<[u64; 5]>(),
            proptest::collection::vec(pg_checkpoint(), 0..4),
            proptest::collection::vec(
                (any::<u64>(), proptest::collection::vec(any::<u32>(), 0..5)),
                0..4,
            ),
            proptest::collection::vec(any::<(u64, u32)>(), 0..3),
        )
            .prop_map(|(v, pgs, block_sums, poisoned_blocks)| Checkpoint {
                sequence: v[0],
                replay_position: v[1],
                replay_lsn: Lsn(v[2]),
                tail_position: v[3],
                tail_lsn: Lsn(v[4]),
                pgs,
                block_sums,
                poisoned_blocks,
            })
    }

    proptest! {
        #[test]
        fn checkpoints_round_trip(checkpoint in checkpoint()) {
            let bytes = checkpoint.encode();
            prop_assert!(bytes.len().is_multiple_of(BLOCK_SIZE));
            prop_assert_eq!(Checkpoint::length_from_header(&bytes[..BLOCK_SIZE]), Ok(bytes.len()));
            prop_assert_eq!(Checkpoint::decode(&bytes), Ok(checkpoint));
        }

        /// Any flipped bit in the header or body is caught (padding is not covered).
        #[test]
        fn any_flipped_bit_is_detected(checkpoint in checkpoint(), bit in any::<prop::sample::Index>()) {
            let mut bytes = checkpoint.encode();
            let body_len = u64::from_le_bytes(bytes[56..64].try_into().expect("8")) as usize;
            let covered: Vec<usize> = (0..72).chain(BLOCK_SIZE..BLOCK_SIZE + body_len).collect();
            let bit = bit.index(covered.len() * 8);
            bytes[covered[bit / 8]] ^= 1 << (bit % 8);
            prop_assert!(Checkpoint::decode(&bytes).is_err());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..9000), magic: bool) {
            let mut bytes = bytes;
            if magic && bytes.len() >= 72 {
                bytes[0..8].copy_from_slice(&MAGIC.to_le_bytes());
                bytes[8..10].copy_from_slice(&FORMAT_VERSION.to_le_bytes());
                let crc = crc32c::crc32c(&bytes[..68]);
                bytes[68..72].copy_from_slice(&crc.to_le_bytes());
            }
            let _ = Checkpoint::decode(&bytes);
        }
    }

    #[test]
    fn a_torn_checkpoint_is_refused() {
        let checkpoint = Checkpoint {
            sequence: 3,
            pgs: vec![PgCheckpoint {
                objects: vec![(
                    ObjectKey {
                        image: ImageId(1),
                        number: 2,
                    },
                    vec![(0, 4096, 1 << 20); 300],
                )],
                ..PgCheckpoint::default()
            }],
            ..Checkpoint::default()
        };
        let mut bytes = checkpoint.encode();
        assert!(bytes.len() > 2 * BLOCK_SIZE);
        bytes[BLOCK_SIZE + BLOCK_SIZE..].fill(0);
        assert_eq!(
            Checkpoint::decode(&bytes),
            Err(CheckpointError::BodyChecksum)
        );
        assert!(matches!(
            Checkpoint::decode(&[0u8; BLOCK_SIZE]),
            Err(CheckpointError::NoMagic { found: 0 })
        ));
    }

    /// Checkpoints written before block checksums (format 2: the body ends after the last
    /// PG) and before poisoned blocks (format 3: after the checksums' runs) still read; one
    /// of a later format than this code is refused.
    #[test]
    fn checkpoints_of_the_formats_before_this_one_read() {
        let checkpoint = Checkpoint {
            sequence: 7,
            replay_position: 8192,
            pgs: vec![PgCheckpoint {
                term: 3,
                objects: vec![(
                    ObjectKey {
                        image: ImageId(1),
                        number: 2,
                    },
                    vec![(0, 4096, 1 << 20)],
                )],
                ..PgCheckpoint::default()
            }],
            block_sums: vec![(1 << 20, vec![0xabcd])],
            ..Checkpoint::default()
        };
        let bytes = checkpoint.encode();
        let body_len = u64::from_le_bytes(bytes[56..64].try_into().expect("8")) as usize;
        let rewrite = |version: u16, cut: usize| {
            let body = &bytes[BLOCK_SIZE..BLOCK_SIZE + body_len - cut];
            let mut old = bytes[..BLOCK_SIZE].to_vec();
            old[8..10].copy_from_slice(&version.to_le_bytes());
            old[56..64].copy_from_slice(&(body.len() as u64).to_le_bytes());
            old[64..68].copy_from_slice(&crc32c::crc32c(body).to_le_bytes());
            let crc = crc32c::crc32c(&old[..68]);
            old[68..72].copy_from_slice(&crc.to_le_bytes());
            old.extend_from_slice(body);
            old.resize(old.len().div_ceil(BLOCK_SIZE) * BLOCK_SIZE, 0);
            old
        };
        // Format 3: without the count of poisoned runs (0) that ends format 4's body.
        assert_eq!(Checkpoint::decode(&rewrite(3, 4)), Ok(checkpoint.clone()));
        // Format 2: without the checksums' run either (count, offset, count, one sum).
        let format_2 = Checkpoint {
            block_sums: Vec::new(),
            ..checkpoint.clone()
        };
        assert_eq!(Checkpoint::decode(&rewrite(2, 4 + 20)), Ok(format_2));
        // Format 4 needs the count of poisoned runs.
        assert!(matches!(
            Checkpoint::decode(&rewrite(4, 4)),
            Err(CheckpointError::Malformed { .. })
        ));
        assert_eq!(
            Checkpoint::decode(&rewrite(5, 0)),
            Err(CheckpointError::Version { version: 5 })
        );
    }
}
