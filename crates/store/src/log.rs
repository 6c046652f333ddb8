//! The log: batches laid out one after another in a region of the device, and replay.
//!
//! Replay reads batch after batch from where the log starts and stops at the first one
//! that is not intact or not the next in sequence: that is the end of the log. A batch is
//! acknowledged only after it was synced, and batches are written in order, so everything
//! acknowledged lies before that point and everything after it is a torn tail that the next
//! append overwrites.

use basalt_common::Lsn;

use crate::batch::{self, BLOCK_SIZE, BatchError, Entry};

/// Why an append was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// The region has no room for the batch.
    #[error("log full: batch of {needed} bytes, {available} bytes left")]
    Full {
        /// Bytes the batch needs.
        needed: u64,
        /// Bytes left in the region.
        available: u64,
    },
}

/// A batch placed in the log, ready to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedBatch {
    /// Its LSN.
    pub lsn: Lsn,
    /// Where it goes on the device.
    pub offset_bytes: u64,
    /// What to write there (a multiple of the block size).
    pub bytes: Vec<u8>,
    /// Where each entry's data lies on the device: the index points there.
    pub data_offsets_bytes: Vec<u64>,
}

/// Lays out batches in the region `[start, end)` of a device.
#[derive(Debug, Clone)]
pub struct LogWriter {
    next_offset_bytes: u64,
    next_lsn: Lsn,
    end_offset_bytes: u64,
}

impl LogWriter {
    /// A writer that appends at `next_offset_bytes` with `next_lsn` (from [`replay`], or
    /// the region's start and [`Lsn::FIRST`] for a new log).
    pub fn new(next_offset_bytes: u64, next_lsn: Lsn, end_offset_bytes: u64) -> Self {
        assert!(
            next_offset_bytes.is_multiple_of(BLOCK_SIZE as u64),
            "log offset {next_offset_bytes} not block-aligned"
        );
        assert!(
            next_offset_bytes <= end_offset_bytes,
            "log starts at {next_offset_bytes} past its end {end_offset_bytes}"
        );
        Self {
            next_offset_bytes,
            next_lsn,
            end_offset_bytes,
        }
    }

    /// Places `entries` as the next batch.
    pub fn append(&mut self, entries: &[Entry]) -> Result<PlacedBatch, LogError> {
        let needed = batch::batch_size(entries) as u64;
        let available = self.end_offset_bytes - self.next_offset_bytes;
        if needed > available {
            return Err(LogError::Full { needed, available });
        }
        let lsn = self.next_lsn;
        let bytes = batch::encode(lsn, entries);
        let header = batch::decode_header(&bytes, lsn).expect("a batch we encoded decodes");
        let offset_bytes = self.next_offset_bytes;
        let data_offsets_bytes = header
            .data_offsets()
            .map(|at| offset_bytes + at as u64)
            .collect();
        self.next_offset_bytes += needed;
        self.next_lsn = lsn.next();
        Ok(PlacedBatch {
            lsn,
            offset_bytes,
            bytes,
            data_offsets_bytes,
        })
    }
}

/// A batch found by replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplayedBatch {
    /// Its LSN.
    pub lsn: Lsn,
    /// Where it lies on the device.
    pub offset_bytes: u64,
    /// Its entries, with where each entry's data lies on the device.
    pub entries: Vec<(Entry, u64)>,
}

/// What replay found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The intact batches, in order.
    pub batches: Vec<ReplayedBatch>,
    /// Where the next batch goes.
    pub next_offset_bytes: u64,
    /// The LSN the next batch gets.
    pub next_lsn: Lsn,
    /// Why replay stopped before the end of the region (the torn tail), if it did.
    pub stopped_by: Option<BatchError>,
}

/// Replays the log that starts at `start_offset_bytes` with `first_lsn`, up to
/// `end_offset_bytes`. `read(offset, len)` reads from the device; its errors (a failing
/// disk) abort replay, since they say nothing about where the log ends.
pub fn replay<E>(
    read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    start_offset_bytes: u64,
    first_lsn: Lsn,
    end_offset_bytes: u64,
) -> Result<Replayed, E> {
    replay_trimmed(
        read,
        start_offset_bytes,
        first_lsn,
        end_offset_bytes,
        |_| {},
    )
}

/// [`replay`], with `trim` applied to each entry once its batch is verified: a caller that
/// needs only where the data lies drops it there, so replay holds metadata, not the log.
pub fn replay_trimmed<E>(
    mut read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    start_offset_bytes: u64,
    first_lsn: Lsn,
    end_offset_bytes: u64,
    mut trim: impl FnMut(&mut Entry),
) -> Result<Replayed, E> {
    let mut offset = start_offset_bytes;
    let mut lsn = first_lsn;
    let mut batches = Vec::new();
    let stopped_by = loop {
        if offset + BLOCK_SIZE as u64 > end_offset_bytes {
            break None;
        }
        let block = read(offset, BLOCK_SIZE)?;
        let header = match batch::decode_header(&block, lsn) {
            Ok(header) => header,
            Err(error) => break Some(error),
        };
        let size = header.batch_size();
        if offset + size as u64 > end_offset_bytes {
            let available = (end_offset_bytes - offset) as usize;
            break Some(BatchError::Truncated {
                needed: size,
                available,
            });
        }
        let whole = if size > BLOCK_SIZE {
            read(offset, size)?
        } else {
            block
        };
        match batch::decode_entries(&header, &whole) {
            Ok(mut entries) => {
                entries.iter_mut().for_each(&mut trim);
                let offsets = header.data_offsets().map(|at| offset + at as u64);
                batches.push(ReplayedBatch {
                    lsn,
                    offset_bytes: offset,
                    entries: entries.into_iter().zip(offsets).collect(),
                });
                offset += size as u64;
                lsn = lsn.next();
            }
            Err(error) => break Some(error),
        }
    };
    Ok(Replayed {
        batches,
        next_offset_bytes: offset,
        next_lsn: lsn,
        stopped_by,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::tests::arbitrary_entry;
    use proptest::prelude::*;

    /// A device in memory.
    struct Disk {
        bytes: Vec<u8>,
    }

    impl Disk {
        fn new(len: usize) -> Self {
            Self {
                bytes: vec![0; len],
            }
        }

        fn write(&mut self, batch: &PlacedBatch) {
            let at = batch.offset_bytes as usize;
            self.bytes[at..at + batch.bytes.len()].copy_from_slice(&batch.bytes);
        }

        fn replay(&self, start: u64, first: Lsn) -> Replayed {
            let read = |offset: u64, len: usize| -> Result<Vec<u8>, ()> {
                Ok(self.bytes[offset as usize..offset as usize + len].to_vec())
            };
            replay(read, start, first, self.bytes.len() as u64).expect("memory reads do not fail")
        }
    }

    /// An entry of PG 1.0 at Raft `index`, with `len` bytes of `byte`.
    fn entry(index: u64, byte: u8, len: usize) -> Entry {
        let pg = basalt_common::PgId {
            pool: basalt_common::PoolId(1),
            index: 0,
        };
        Entry {
            kind: 1,
            pg,
            term: 1,
            index,
            meta: [byte; 24],
            data: vec![byte; len],
        }
    }

    fn entries_of(replayed: &Replayed) -> Vec<Vec<Entry>> {
        replayed
            .batches
            .iter()
            .map(|b| b.entries.iter().map(|(e, _)| e.clone()).collect())
            .collect()
    }

    #[test]
    fn appended_batches_replay_with_their_data_offsets() {
        let mut disk = Disk::new(1 << 20);
        let mut writer = LogWriter::new(8192, Lsn::FIRST, 1 << 20);
        let mut placed = Vec::new();
        for n in 0..5u8 {
            let entry = entry(u64::from(n) + 1, n, 4096 * usize::from(n));
            let batch = writer.append(&[entry]).expect("room");
            disk.write(&batch);
            placed.push(batch);
        }
        let replayed = disk.replay(8192, Lsn::FIRST);
        assert_eq!(replayed.batches.len(), 5);
        assert_eq!(replayed.next_lsn, Lsn(6));
        assert_eq!(replayed.stopped_by, Some(BatchError::NoMagic { found: 0 }));
        for (found, written) in replayed.batches.iter().zip(&placed) {
            assert_eq!(found.offset_bytes, written.offset_bytes);
            let offsets: Vec<u64> = found.entries.iter().map(|(_, at)| *at).collect();
            assert_eq!(offsets, written.data_offsets_bytes);
            for (entry, at) in &found.entries {
                let at = *at as usize;
                assert_eq!(
                    &disk.bytes[at..at + entry.data.len()],
                    &entry.data[..],
                    "the index can read data where replay says"
                );
            }
        }
        let mut resumed = LogWriter::new(replayed.next_offset_bytes, replayed.next_lsn, 1 << 20);
        assert_eq!(
            resumed.append(&[]).expect("room").offset_bytes,
            placed[4].offset_bytes + placed[4].bytes.len() as u64
        );
    }

    #[test]
    fn a_full_log_refuses_the_batch() {
        let mut writer = LogWriter::new(0, Lsn::FIRST, 8192);
        writer.append(&[]).expect("one header fits");
        let entry = entry(1, 1, 10);
        assert_eq!(
            writer.append(&[entry]),
            Err(LogError::Full {
                needed: 8192,
                available: 4096
            })
        );
    }

    #[test]
    fn an_older_lap_ends_the_log() {
        let mut disk = Disk::new(64 << 10);
        let mut old = LogWriter::new(0, Lsn(1), 64 << 10);
        for _ in 0..10 {
            disk.write(&old.append(&[]).expect("room"));
        }
        let mut new = LogWriter::new(0, Lsn(100), 64 << 10);
        for _ in 0..3 {
            disk.write(&new.append(&[]).expect("room"));
        }
        let replayed = disk.replay(0, Lsn(100));
        assert_eq!(replayed.batches.len(), 3);
        assert_eq!(
            replayed.stopped_by,
            Some(BatchError::Lsn {
                expected: 103,
                found: 4
            })
        );
    }

    #[test]
    fn read_errors_abort_replay() {
        let result = replay(|_, _| Err("disk failed"), 0, Lsn::FIRST, 1 << 20);
        assert_eq!(result, Err("disk failed"));
    }

    #[derive(Debug, Clone)]
    enum Damage {
        /// The unsynced tail never reached the disk.
        Lost,
        /// A random byte range of the unsynced tail was overwritten with garbage.
        Garbage {
            from: prop::sample::Index,
            len: usize,
            byte: u8,
        },
        /// One bit of the unsynced tail flipped.
        Bit(prop::sample::Index),
        /// The unsynced tail is intact after all.
        None,
    }

    fn damage() -> impl Strategy<Value = Damage> {
        prop_oneof![
            Just(Damage::Lost),
            (any::<prop::sample::Index>(), 1usize..20000, any::<u8>())
                .prop_map(|(from, len, byte)| Damage::Garbage { from, len, byte }),
            any::<prop::sample::Index>().prop_map(Damage::Bit),
            Just(Damage::None),
        ]
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 200, ..ProptestConfig::default() })]

        /// A crash model: batches before `synced` are durable; the rest were in flight and
        /// may be lost, torn or garbled. Replay must return every synced batch, exactly,
        /// and only a prefix of what was written.
        #[test]
        fn replay_recovers_every_synced_batch_and_nothing_invented(
            batches in proptest::collection::vec(proptest::collection::vec(arbitrary_entry(), 0..4), 1..10),
            synced in any::<prop::sample::Index>(),
            damage in damage(),
        ) {
            let mut disk = Disk::new(2 << 20);
            let mut writer = LogWriter::new(0, Lsn::FIRST, 2 << 20);
            let placed: Vec<PlacedBatch> = batches.iter().map(|entries| writer.append(entries).expect("room")).collect();
            let synced = synced.index(placed.len() + 1);
            for batch in &placed {
                disk.write(batch);
            }
            let tail_start = placed.get(synced).map_or(writer.next_offset_bytes as usize, |b| b.offset_bytes as usize);
            let tail_end = writer.next_offset_bytes as usize;
            if tail_end > tail_start {
                match damage {
                    Damage::Lost => disk.bytes[tail_start..tail_end].fill(0),
                    Damage::Garbage { from, len, byte } => {
                        let from = tail_start + from.index(tail_end - tail_start);
                        let to = (from + len).min(tail_end);
                        disk.bytes[from..to].fill(byte);
                    }
                    Damage::Bit(at) => {
                        let bit = at.index((tail_end - tail_start) * 8);
                        disk.bytes[tail_start + bit / 8] ^= 1 << (bit % 8);
                    }
                    Damage::None => {}
                }
            }
            let replayed = disk.replay(0, Lsn::FIRST);
            let found = entries_of(&replayed);
            prop_assert!(found.len() >= synced, "lost synced batches: {} of {}", found.len(), synced);
            prop_assert!(found.len() <= batches.len());
            prop_assert_eq!(&found[..], &batches[..found.len()], "replay returned something not written");
            prop_assert_eq!(replayed.next_lsn, Lsn(found.len() as u64 + 1));
        }
    }
}
