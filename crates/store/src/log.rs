//! The log: a ring of batches in a region of the device, and replay.
//!
//! Every batch has a *position*: a byte count that grows forever; it lies at device offset
//! `start + position % len`. A batch never crosses the end of the region: one that does not
//! fit before it goes to the start of the next lap. Space before the *tail* position is
//! free (its contents moved elsewhere or dead, and a checkpoint no longer needs it), so the
//! head may run up to `tail + len`.
//!
//! Replay reads batch after batch from a start position and LSN. Where a position holds no
//! intact batch with the expected LSN, the writer may have skipped to the next lap: replay
//! looks there, for exactly that LSN, and otherwise stops: that is the end of the log. A
//! batch is acknowledged only after it was synced, and one write is in flight at a time, so
//! everything acknowledged lies before that point. An LSN is never written twice, so stale
//! batches of earlier laps (older LSNs) are never taken for the next one.

use basalt_common::Lsn;

use crate::batch::{self, BLOCK_SIZE, BatchError, Entry};

/// The most bytes a batch takes: a header block and the most data.
const LARGEST_BATCH: u64 = (BLOCK_SIZE + batch::DATA_SIZE_MAX) as u64;

/// The log region of a device, `[start, start + len)`, used as a ring.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Ring {
    /// Device offset of the region.
    pub start_bytes: u64,
    /// Its length, a multiple of the block size.
    pub len_bytes: u64,
}

impl Ring {
    /// The device offset of a position.
    pub fn device_offset(&self, position: u64) -> u64 {
        self.start_bytes + position % self.len_bytes
    }

    /// The position at `device_offset` in the lap-long window that starts at `from`: the
    /// one position among those the ring holds (from its tail up to a lap further) that
    /// lies there.
    pub fn position_at(&self, device_offset: u64, from: u64) -> u64 {
        let in_lap = (device_offset - self.start_bytes) % self.len_bytes;
        let position = from - from % self.len_bytes + in_lap;
        if position < from {
            position + self.len_bytes
        } else {
            position
        }
    }

    /// Where a batch of `size` bytes goes if the head is at `position`: there, or at the
    /// start of the next lap if it would cross the end of the region.
    pub fn place(&self, position: u64, size: u64) -> u64 {
        let in_lap = position % self.len_bytes;
        if in_lap + size > self.len_bytes {
            position - in_lap + self.len_bytes
        } else {
            position
        }
    }

    /// The start of the lap after the one `position` is in.
    fn next_lap(&self, position: u64) -> u64 {
        position - position % self.len_bytes + self.len_bytes
    }
}

/// Why an append was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum LogError {
    /// The ring has no free room for the batch until its tail moves on.
    #[error("log full: batch of {needed} bytes, {available} bytes free")]
    Full {
        /// Bytes the batch needs (with what it skips at the end of a lap).
        needed: u64,
        /// Bytes free.
        available: u64,
    },
    /// The batch is larger than the region.
    #[error("a batch of {needed} bytes exceeds the {region} bytes of the log region")]
    TooLarge {
        /// Bytes the batch needs.
        needed: u64,
        /// Bytes of the region.
        region: u64,
    },
}

/// A batch placed in the log, ready to be written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PlacedBatch {
    /// Its LSN.
    pub lsn: Lsn,
    /// Its position in the ring.
    pub position: u64,
    /// Where it goes on the device.
    pub offset_bytes: u64,
    /// What to write there (a multiple of the block size).
    pub bytes: Vec<u8>,
    /// Where each entry's data lies on the device: the index points there.
    pub data_offsets_bytes: Vec<u64>,
}

/// Lays out batches in a ring.
#[derive(Debug, Clone)]
pub struct LogWriter {
    ring: Ring,
    next_position: u64,
    next_lsn: Lsn,
    tail_position: u64,
}

impl LogWriter {
    /// A writer that appends at `next_position` with `next_lsn` (from [`replay`]), with the
    /// ring free before `tail_position`.
    pub fn new(ring: Ring, next_position: u64, next_lsn: Lsn, tail_position: u64) -> Self {
        assert!(
            ring.len_bytes.is_multiple_of(BLOCK_SIZE as u64)
                && ring.start_bytes.is_multiple_of(BLOCK_SIZE as u64)
                && ring.len_bytes > 0,
            "log region {ring:?} not block-aligned"
        );
        assert!(
            next_position.is_multiple_of(BLOCK_SIZE as u64),
            "log position {next_position} not block-aligned"
        );
        assert!(
            tail_position <= next_position && next_position <= tail_position + ring.len_bytes,
            "log head {next_position} outside its tail {tail_position} + {}",
            ring.len_bytes
        );
        Self {
            ring,
            next_position,
            next_lsn,
            tail_position,
        }
    }

    /// The ring it writes.
    pub fn ring(&self) -> Ring {
        self.ring
    }

    /// The position the next batch starts from (before any skip to the next lap).
    pub fn next_position(&self) -> u64 {
        self.next_position
    }

    /// The LSN of the next batch.
    pub fn next_lsn(&self) -> Lsn {
        self.next_lsn
    }

    /// Bytes between the head and the end of the free space.
    pub fn free_bytes(&self) -> u64 {
        self.tail_position + self.ring.len_bytes - self.next_position
    }

    /// Frees the ring up to `tail_position` (it only moves forward).
    pub fn set_tail(&mut self, tail_position: u64) {
        self.tail_position = self
            .tail_position
            .max(tail_position.min(self.next_position));
    }

    /// Places `entries` as the next batch.
    pub fn append(&mut self, entries: &[Entry]) -> Result<PlacedBatch, LogError> {
        let size = batch::batch_size(entries) as u64;
        if size > self.ring.len_bytes {
            return Err(LogError::TooLarge {
                needed: size,
                region: self.ring.len_bytes,
            });
        }
        let position = self.ring.place(self.next_position, size);
        let needed = position + size - self.next_position;
        let available = self.free_bytes();
        if needed > available {
            return Err(LogError::Full { needed, available });
        }
        let lsn = self.next_lsn;
        let bytes = batch::encode(lsn, entries);
        let header = batch::decode_header(&bytes, lsn).expect("a batch we encoded decodes");
        let offset_bytes = self.ring.device_offset(position);
        let data_offsets_bytes = header
            .data_offsets()
            .map(|at| offset_bytes + at as u64)
            .collect();
        self.next_position = position + size;
        self.next_lsn = lsn.next();
        Ok(PlacedBatch {
            lsn,
            position,
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
    /// Its position in the ring.
    pub position: u64,
    /// Where it lies on the device.
    pub offset_bytes: u64,
    /// Its entries, with where each entry's data lies on the device.
    pub entries: Vec<(Entry, u64)>,
    /// The positions (in `entries`) of those whose data fails its checksum: from
    /// [`read_durable`], which takes such batches, and from [`replay_sparing`], which takes
    /// those written whole when their caller can spare the data; [`replay`] stops at them.
    pub damaged_entries: Vec<usize>,
}

/// What replay found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Replayed {
    /// The intact batches, in order.
    pub batches: Vec<ReplayedBatch>,
    /// Where the next batch goes (before any skip to the next lap).
    pub next_position: u64,
    /// The LSN the next batch gets.
    pub next_lsn: Lsn,
    /// Why replay stopped before the end of the free space (the torn tail), if it did.
    pub stopped_by: Option<BatchError>,
    /// The batch replay stopped at was damaged, not torn: the batch after it is intact.
    pub damaged: Option<Damage>,
}

/// A batch that fails its checks though the batch after it is intact. Batches are written
/// one at a time, the next only once the last is durable, so a torn write can only be the
/// last batch; one followed by its successor was written whole and has changed since (the
/// device corrupted it). Replay stops there all the same, but what follows it was
/// acknowledged: the caller must not carry on as if the log ended there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Damage {
    /// The damaged batch's LSN.
    pub lsn: Lsn,
    /// Its position in the ring.
    pub position: u64,
    /// What is wrong with it.
    pub error: BatchError,
    /// Where the intact batch after it lies.
    pub next_position: u64,
}

/// Replays the log from `start_position` with `first_lsn`, reading no further than
/// `limit_position` (the tail plus the ring's length: beyond it lies live older data).
/// `read(offset, len)` reads from the device; its errors (a failing disk) abort replay,
/// since they say nothing about where the log ends.
pub fn replay<E>(
    read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    start_position: u64,
    first_lsn: Lsn,
    limit_position: u64,
) -> Result<Replayed, E> {
    let from = (start_position, first_lsn);
    let keep = |_: &mut Entry, _, _| {};
    read_log(
        read,
        ring,
        from,
        limit_position,
        keep,
        Reading::Replay(None),
    )
}

/// A batch read back: its size, its entries, where each entry's data lies, and which
/// entries' data fails its checksum (always none unless read as durable).
type FoundBatch = (u64, Vec<Entry>, Vec<u64>, Vec<usize>);

/// The batch at `position` if it is intact, has LSN `lsn` and fits in its lap and below
/// `limit`.
fn read_batch<E>(
    read: &mut impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    (position, lsn): (u64, Lsn),
    limit: u64,
    durable: bool,
) -> Result<Result<FoundBatch, BatchError>, E> {
    let available =
        (limit.saturating_sub(position)).min(ring.len_bytes - position % ring.len_bytes) as usize;
    if available < BLOCK_SIZE {
        return Ok(Err(BatchError::Truncated {
            needed: BLOCK_SIZE,
            available,
        }));
    }
    let offset = ring.device_offset(position);
    let block = read(offset, BLOCK_SIZE)?;
    let header = match batch::decode_header(&block, lsn) {
        Ok(header) => header,
        Err(error) => return Ok(Err(error)),
    };
    let size = header.batch_size();
    if size > available {
        return Ok(Err(BatchError::Truncated {
            needed: size,
            available,
        }));
    }
    let whole = if size > BLOCK_SIZE {
        read(offset, size)?
    } else {
        block
    };
    let decoded = if durable {
        batch::decode_entries_with_damage(&header, &whole)
    } else {
        batch::decode_entries(&header, &whole).map(|entries| (entries, Vec::new()))
    };
    Ok(decoded.map(|(entries, damaged)| {
        let offsets = header.data_offsets().map(|at| offset + at as u64).collect();
        (size as u64, entries, offsets, damaged)
    }))
}

/// [`replay`], going on past data damaged at rest, with `trim` applied to each entry once
/// its batch is verified: told the device offset of the entry's data and whether that data
/// is damaged, a caller that needs only where the data lies drops it there, so that replay
/// holds metadata, not the log.
///
/// A batch whose header is intact but some of whose entries' data fails its checksum, while
/// the batch after it is intact (so it was written whole: see [`Damage`]), is taken when
/// `spare` says the caller can do without the data of each of those entries (it knows where
/// the data lay and marks it damaged), with them named in
/// [`ReplayedBatch::damaged_entries`]. Any other damage ends replay as in [`replay`]; a
/// torn last batch is still the end of the log.
pub fn replay_sparing<E>(
    read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    from: (u64, Lsn),
    limit_position: u64,
    spare: &dyn Fn(&Entry) -> bool,
    trim: impl FnMut(&mut Entry, u64, bool),
) -> Result<Replayed, E> {
    read_log(
        read,
        ring,
        from,
        limit_position,
        trim,
        Reading::Replay(Some(spare)),
    )
}

/// How [`read_log`] takes a batch that fails its checks.
#[derive(Clone, Copy)]
enum Reading<'a> {
    /// On start: the log ends there, unless the batch was written whole and the damaged
    /// data can be spared (see [`replay_sparing`]).
    Replay(Option<&'a dyn Fn(&Entry) -> bool>),
    /// Batches up to the batch at this durable end were written whole (see
    /// [`read_durable`]).
    Durable(u64),
}

/// [`replay`] over batches known to be durable (before the writer's durable end,
/// as the cleaner reads them): a batch whose header is intact but some of whose entries'
/// data fails its checksum was damaged after it was written, not torn. It is taken, with
/// those entries named in [`ReplayedBatch::damaged_entries`], so that the caller can tell
/// whether the damage is still of use to anyone.
///
/// `durable_end` is the start of a batch known whole and durable, at or past the limit:
/// whether a batch that fails its checks is a torn write left behind (the batch of its LSN
/// written after the crash went to the next lap) is told by a look at the next lap, as far
/// as that batch's end, even past the limit. A torn batch left behind whose successor lies
/// past the limit is passed over: the read ends at the next lap, with the same LSN.
pub fn read_durable<E>(
    read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    (start_position, first_lsn): (u64, Lsn),
    (limit_position, durable_end): (u64, u64),
) -> Result<Replayed, E> {
    let from = (start_position, first_lsn);
    let keep = |_: &mut Entry, _, _| {};
    read_log(
        read,
        ring,
        from,
        limit_position,
        keep,
        Reading::Durable(durable_end),
    )
}

fn read_log<E>(
    mut read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    (start_position, first_lsn): (u64, Lsn),
    limit_position: u64,
    mut trim: impl FnMut(&mut Entry, u64, bool),
    reading: Reading<'_>,
) -> Result<Replayed, E> {
    let (durable_end, spare) = match reading {
        Reading::Replay(spare) => (None, spare),
        Reading::Durable(end) => (Some(end), None),
    };
    let durable = durable_end.is_some();
    let mut position = start_position;
    let mut lsn = first_lsn;
    let mut batches = Vec::new();
    let stopped_by = loop {
        if position >= limit_position {
            break None;
        }
        let mut found = read_batch(&mut read, ring, (position, lsn), limit_position, durable)?;
        // The writer skips to the next lap when a batch does not fit in this one. So a
        // batch that fails its checks here may lie there; and one taken as damaged (read as
        // durable) may be a torn write left behind, if the batch of its LSN written after
        // the crash lies there (the writer goes on at the torn batch's place).
        let intact = found.as_ref().is_ok_and(|batch| batch.3.is_empty());
        if !intact {
            let next_lap = ring.next_lap(position);
            // Read as durable, the next lap is looked at as far as the end of the batch at
            // the durable end (a batch of this LSN there was written after this one).
            let look = durable_end.map_or(limit_position, |end| {
                limit_position.max(end + LARGEST_BATCH)
            });
            let skipped = if position.is_multiple_of(ring.len_bytes) || next_lap >= look {
                None
            } else {
                read_batch(&mut read, ring, (next_lap, lsn), look, durable)?.ok()
            };
            match skipped {
                Some(batch) if next_lap < limit_position => {
                    position = next_lap;
                    found = Ok(batch);
                }
                // Past the limit but durable: this one is passed over, and the next read
                // starts there.
                Some(_) if durable_end.is_some_and(|end| next_lap <= end) => {
                    position = next_lap;
                    break None;
                }
                // One of this LSN lies there, not known to be durable: nothing is taken.
                Some(_) => {
                    break Some(match &found {
                        Err(error) => error.clone(),
                        Ok((_, _, _, damaged)) => BatchError::DataChecksum { entry: damaged[0] },
                    });
                }
                None => {
                    if let Err(error) = &found {
                        let spared = match spare {
                            Some(spare) => {
                                let at = (position, lsn);
                                spared_batch(&mut read, ring, at, limit_position, spare)?
                            }
                            None => None,
                        };
                        match spared {
                            Some((at, batch)) => (position, found) = (at, Ok(batch)),
                            None => break Some(error.clone()),
                        }
                    }
                }
            }
        }
        let (size, mut entries, offsets, damaged_entries) = found.expect("errors ended the loop");
        for (at, (entry, offset)) in entries.iter_mut().zip(&offsets).enumerate() {
            trim(entry, *offset, damaged_entries.contains(&at));
        }
        batches.push(ReplayedBatch {
            lsn,
            position,
            offset_bytes: ring.device_offset(position),
            entries: entries.into_iter().zip(offsets).collect(),
            damaged_entries,
        });
        position += size;
        lsn = lsn.next();
    };
    // The batch may have been placed at the start of the next lap (the writer skips there
    // when a batch does not fit): replay tried it too, and it may be the damaged one.
    let damaged = stopped_by
        .as_ref()
        .and_then(|_| find_damage(&mut read, ring, (position, lsn), limit_position));
    Ok(Replayed {
        batches,
        next_position: position,
        next_lsn: lsn,
        stopped_by,
        damaged,
    })
}

/// The batch of LSN `lsn` expected at `position`, or where the writer may have put it
/// instead ([`places`]), whose header is intact but some of whose entries' data fails its
/// checksum, if it was written whole (the batch after it is intact: [`damage_at`]) and
/// `spare` holds for each of those entries; with where it lies.
fn spared_batch<E>(
    read: &mut impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    (position, lsn): (u64, Lsn),
    limit: u64,
    spare: &dyn Fn(&Entry) -> bool,
) -> Result<Option<(u64, FoundBatch)>, E> {
    for at in places(ring, position, limit) {
        let Ok(batch) = read_batch(read, ring, (at, lsn), limit, true)? else {
            continue;
        };
        let (_, entries, _, damaged) = &batch;
        if damaged.iter().all(|&entry| spare(&entries[entry]))
            && damage_at(read, ring, at, lsn, limit).is_some()
        {
            return Ok(Some((at, batch)));
        }
    }
    Ok(None)
}

/// Where the batch of the LSN expected at `position` may lie, below `limit`: there, and at
/// the start of the next lap if the writer may have skipped there (it does when a batch
/// does not fit in the rest of a lap).
fn places(ring: Ring, position: u64, limit: u64) -> impl Iterator<Item = u64> {
    let next_lap = ring.next_lap(position);
    let skip_possible = !position.is_multiple_of(ring.len_bytes) && next_lap < limit;
    std::iter::once(position).chain(skip_possible.then_some(next_lap))
}

/// A batch of the log that was written whole and damaged since, with its place: where the
/// batch after it lies tells where it ends.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DamagedBatch {
    /// The damage.
    pub damage: Damage,
    /// The position after the damaged batch: the next batch's, or the end of the lap if
    /// the writer skipped there after it.
    pub end_position: u64,
    /// The bytes from the damaged batch's position to `end_position`.
    pub bytes: Vec<u8>,
}

/// The batch of LSN `lsn` at `position` if it fails its checks while the batch after it is
/// intact (see [`Damage`]), with its bytes: what a cleaner needs to move what is still in
/// use out of a batch whose header it cannot read (the live payloads are known from the
/// index, and their blocks from their checksums). The batch after it is looked for as far
/// as the end of the batch at `durable_end`, which is whole (see [`read_durable`]). `None`
/// if the batch is intact, or nothing says it was written whole.
pub fn read_damaged<E>(
    mut read: impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    (position, lsn): (u64, Lsn),
    durable_end: u64,
) -> Result<Option<DamagedBatch>, E> {
    let limit = durable_end + LARGEST_BATCH;
    let Some(damage) = find_damage(&mut read, ring, (position, lsn), limit) else {
        return Ok(None);
    };
    let end_position = damage.next_position.min(ring.next_lap(damage.position));
    let bytes = read(
        ring.device_offset(damage.position),
        (end_position - damage.position) as usize,
    )?;
    Ok(Some(DamagedBatch {
        damage,
        end_position,
        bytes,
    }))
}

/// The damage of the batch of LSN `lsn` expected at `position`, or where the writer may
/// have put it instead ([`places`], [`damage_at`]).
fn find_damage<E>(
    read: &mut impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    (position, lsn): (u64, Lsn),
    limit: u64,
) -> Option<Damage> {
    places(ring, position, limit).find_map(|at| damage_at(read, ring, at, lsn, limit))
}

/// The damage of the batch of LSN `lsn` at `position`, which failed its checks, if the
/// batch of the next LSN lies intact after it (header and every entry's data checked):
/// exactly where the writer put it when this batch's header is intact (right after it, or
/// at the next lap if it did not fit there), else its header may be anywhere within a
/// largest batch's reach. Older laps and formatted space hold lower LSNs or none, so only
/// a batch written after this one can match. A read error gives no verdict: replay itself
/// reached here, so the log is read as it was before.
fn damage_at<E>(
    read: &mut impl FnMut(u64, usize) -> Result<Vec<u8>, E>,
    ring: Ring,
    position: u64,
    lsn: Lsn,
    limit: u64,
) -> Option<Damage> {
    let error = match read_batch(read, ring, (position, lsn), limit, false) {
        Ok(Err(error)) => error,
        // Intact after all (a read that raced nothing here), or unreadable: no verdict.
        Ok(Ok(_)) | Err(_) => return None,
    };
    let block = BLOCK_SIZE as u64;
    let header = read(ring.device_offset(position), BLOCK_SIZE).ok()?;
    let candidates: Vec<u64> = match batch::decode_header(&header, lsn) {
        Ok(header) => {
            let end = position + header.batch_size() as u64;
            vec![end, ring.next_lap(end)]
        }
        Err(_) => {
            // A successor's header lies at most a largest batch after this one's.
            let from = position + block;
            let end = (position + 2 * block + batch::DATA_SIZE_MAX as u64)
                .min(ring.next_lap(position))
                .min(limit);
            let mut found = Vec::new();
            if from < end {
                let next = lsn.next();
                let bytes = read(ring.device_offset(from), (end - from) as usize).ok()?;
                found.extend(
                    bytes
                        .chunks_exact(BLOCK_SIZE)
                        .enumerate()
                        .filter(|(_, header)| batch::decode_header(header, next).is_ok())
                        .map(|(at, _)| from + at as u64 * block),
                );
            }
            found.push(ring.next_lap(position));
            found
        }
    };
    let next_position = candidates.into_iter().find(|&at| {
        at < limit
            && matches!(
                read_batch(read, ring, (at, lsn.next()), limit, false),
                Ok(Ok(_))
            )
    })?;
    Some(Damage {
        lsn,
        position,
        error,
        next_position,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::tests::arbitrary_entry;
    use proptest::prelude::*;

    #[test]
    fn a_device_offset_maps_back_to_its_position_in_the_window() {
        let ring = Ring {
            start_bytes: 8192,
            len_bytes: 10 * 4096,
        };
        for from in [0, 4096, 39 * 4096, 40 * 4096, 41 * 4096, 123 * 4096 + 512] {
            for position in from..from + ring.len_bytes {
                if position % 512 == 0 {
                    let offset = ring.device_offset(position);
                    assert_eq!(ring.position_at(offset, from), position, "from {from}");
                }
            }
        }
    }

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

        /// The whole disk as one ring.
        fn ring(&self) -> Ring {
            Ring {
                start_bytes: 0,
                len_bytes: self.bytes.len() as u64,
            }
        }

        fn replay(&self, start: u64, first: Lsn) -> Replayed {
            self.replay_ring(self.ring(), start, first, start + self.bytes.len() as u64)
        }

        fn replay_ring(&self, ring: Ring, start: u64, first: Lsn, limit: u64) -> Replayed {
            let read = |offset, len| self.read(offset, len);
            replay(read, ring, start, first, limit).expect("memory reads do not fail")
        }

        /// Reads as the cleaner does ([`read_durable`]), from `start` (with `first`).
        fn read_durable(&self, (start, first): (u64, Lsn), limits: (u64, u64)) -> Replayed {
            let read = |offset, len| self.read(offset, len);
            read_durable(read, self.ring(), (start, first), limits)
                .expect("memory reads do not fail")
        }

        fn read(&self, offset: u64, len: usize) -> Result<Vec<u8>, ()> {
            Ok(self.bytes[offset as usize..offset as usize + len].to_vec())
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
        let ring = disk.ring();
        let mut writer = LogWriter::new(ring, 8192, Lsn::FIRST, 8192);
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
        let mut resumed = LogWriter::new(ring, replayed.next_position, replayed.next_lsn, 8192);
        assert_eq!(
            resumed.append(&[]).expect("room").offset_bytes,
            placed[4].offset_bytes + placed[4].bytes.len() as u64
        );
    }

    #[test]
    fn a_full_log_refuses_the_batch_until_its_tail_moves() {
        let ring = Ring {
            start_bytes: 4096,
            len_bytes: 12288,
        };
        let mut writer = LogWriter::new(ring, 0, Lsn::FIRST, 0);
        writer.append(&[]).expect("one header fits");
        let entry = entry(1, 1, 10);
        writer
            .append(std::slice::from_ref(&entry))
            .expect("two blocks fit");
        assert_eq!(
            writer.append(std::slice::from_ref(&entry)),
            Err(LogError::Full {
                needed: 8192,
                available: 0
            })
        );
        writer.set_tail(4096);
        // The first lap is full; the next starts where the freed block lies, too small.
        assert_eq!(
            writer.append(std::slice::from_ref(&entry)),
            Err(LogError::Full {
                needed: 8192,
                available: 4096
            })
        );
        writer.set_tail(12288);
        let placed = writer.append(&[entry]).expect("room after the tail moved");
        assert_eq!((placed.position, placed.offset_bytes), (12288, 4096));
        assert_eq!(writer.free_bytes(), 4096);
        let last = writer
            .append(&[])
            .expect("a header fills the last free block");
        assert_eq!((last.position, last.offset_bytes), (20480, 12288));
        assert_eq!(writer.free_bytes(), 0);
    }

    /// Five batches of one 4 KiB entry each, the byte at the device offset `flip` names
    /// (if any) flipped.
    fn five_batches(
        flip: impl FnOnce(&[PlacedBatch]) -> Option<u64>,
    ) -> (Replayed, Vec<PlacedBatch>) {
        let (disk, placed) = five_batches_on_disk(flip);
        (disk.replay(0, Lsn::FIRST), placed)
    }

    /// Five batches of one 4 KiB entry each (entry n holds byte n - 1), one byte flipped
    /// where `flip` says.
    fn five_batches_on_disk(
        flip: impl FnOnce(&[PlacedBatch]) -> Option<u64>,
    ) -> (Disk, Vec<PlacedBatch>) {
        let mut disk = Disk::new(1 << 20);
        let mut writer = LogWriter::new(disk.ring(), 0, Lsn::FIRST, 0);
        let placed: Vec<PlacedBatch> = (0..5u8)
            .map(|n| {
                let batch = writer
                    .append(&[entry(u64::from(n) + 1, n, 4096)])
                    .expect("room");
                disk.write(&batch);
                batch
            })
            .collect();
        if let Some(at) = flip(&placed) {
            disk.bytes[at as usize] ^= 0xff;
        }
        (disk, placed)
    }

    /// Read as durable batches (as the cleaner reads), a batch whose data changed after it
    /// was written is taken, its damaged entry named, and reading goes on past it; a batch
    /// whose header changed still ends the reading.
    #[test]
    fn durable_batches_are_read_past_damaged_data() {
        let durable = |disk: &Disk| {
            let limit = disk.bytes.len() as u64;
            disk.read_durable((0, Lsn::FIRST), (limit, limit))
        };
        let (disk, placed) =
            five_batches_on_disk(|placed| Some(placed[2].data_offsets_bytes[0] + 100));
        let read = durable(&disk);
        let damaged: Vec<Vec<usize>> = read
            .batches
            .iter()
            .map(|batch| batch.damaged_entries.clone())
            .collect();
        assert_eq!(damaged, [vec![], vec![], vec![0], vec![], vec![]]);
        assert_eq!(read.batches[2].entries[0].0.data[100], 2 ^ 0xff);
        assert_eq!(
            read.batches[2].entries[0].1,
            placed[2].data_offsets_bytes[0]
        );
        assert_eq!(read.damaged, None);
        // Replay of the same disk stops at it.
        assert_eq!(disk.replay(0, Lsn::FIRST).batches.len(), 2);
        let (disk, _) = five_batches_on_disk(|placed| Some(placed[2].offset_bytes + 40));
        let read = durable(&disk);
        assert_eq!(read.batches.len(), 2);
        assert_eq!(read.damaged.map(|damage| damage.lsn), Some(Lsn(3)));
    }

    /// A batch torn by a crash, left behind when the batch written after the restart with
    /// its LSN did not fit in the rest of the lap, is not taken for damage: reading goes
    /// on at the next lap, where that batch is.
    #[test]
    fn a_torn_batch_left_behind_is_not_taken_for_damage() {
        const K: u64 = 1024;
        let mut disk = Disk::new(64 << 10);
        let ring = disk.ring();
        // Batch 1 at 40 KiB, then batch 2, torn: its header written, its data not.
        let mut writer = LogWriter::new(ring, 40 * K, Lsn::FIRST, 40 * K);
        disk.write(&writer.append(&[entry(1, 1, 4096)]).expect("room"));
        let torn = writer.append(&[entry(2, 2, 4096)]).expect("room");
        disk.write(&PlacedBatch {
            bytes: torn.bytes[..BLOCK_SIZE].to_vec(),
            ..torn.clone()
        });
        // After the restart, batch 2 again, too large for the rest of the lap.
        let mut writer = LogWriter::new(ring, torn.position, Lsn(2), 40 * K);
        let again = writer.append(&[entry(2, 9, 8 * 4096)]).expect("room");
        assert_eq!(again.position, ring.len_bytes, "placed at the next lap");
        disk.write(&again);
        let end = again.position + again.bytes.len() as u64;
        let read = disk.read_durable((40 * K, Lsn::FIRST), (end, end));
        let found: Vec<(Lsn, u64, Vec<usize>)> = read
            .batches
            .iter()
            .map(|batch| (batch.lsn, batch.position, batch.damaged_entries.clone()))
            .collect();
        assert_eq!(
            found,
            [(Lsn(1), 40 * K, vec![]), (Lsn(2), ring.len_bytes, vec![])]
        );
        assert_eq!(read.next_lsn, Lsn(3));
        // A read that ends at the end of the lap (a cleaner's step) looks at the next lap
        // all the same, as far as the durable end's batch: the torn batch is passed over,
        // and the next read starts at the next lap (found in review: taken for damage, it
        // had the cleaner expect batch 3 after it, which is nowhere).
        let lap_end = ring.len_bytes;
        let durable = again.position;
        let passed = disk.read_durable((40 * K, Lsn::FIRST), (lap_end, durable));
        assert_eq!(passed.batches.len(), 1);
        assert_eq!((passed.next_position, passed.next_lsn), (lap_end, Lsn(2)));
        assert_eq!(passed.stopped_by, None);
        // Not known to be durable there: nothing is taken.
        let stopped = disk.read_durable((40 * K, Lsn::FIRST), (lap_end, torn.position));
        assert_eq!(stopped.batches.len(), 1);
        assert_eq!(
            (stopped.next_position, stopped.next_lsn),
            (torn.position, Lsn(2))
        );
        assert_eq!(
            stopped.stopped_by,
            Some(BatchError::DataChecksum { entry: 0 })
        );
    }

    /// A batch with damaged data near the end of a lap, whose successor follows it in the
    /// lap, is taken for damage by a read that ends before the successor (a cleaner's step
    /// up to the durable end): no batch of its LSN lies at the next lap (found in review: a
    /// version that stopped before it whenever the next lap was out of reach stalled the
    /// cleaner there for good).
    #[test]
    fn damage_near_a_lap_end_is_taken_up_to_the_durable_end() {
        const K: u64 = 1024;
        let mut disk = Disk::new(64 << 10);
        let ring = disk.ring();
        let mut writer = LogWriter::new(ring, 40 * K, Lsn::FIRST, 40 * K);
        let damaged = writer.append(&[entry(1, 1, 4096)]).expect("room");
        let next = writer.append(&[entry(2, 2, 4096)]).expect("room");
        assert!(next.position < ring.len_bytes, "in the same lap");
        disk.write(&damaged);
        disk.write(&next);
        disk.bytes[damaged.data_offsets_bytes[0] as usize + 7] ^= 0xff;
        let read = disk.read_durable((40 * K, Lsn::FIRST), (next.position, next.position));
        let found: Vec<(Lsn, Vec<usize>)> = read
            .batches
            .iter()
            .map(|batch| (batch.lsn, batch.damaged_entries.clone()))
            .collect();
        assert_eq!(found, [(Lsn(1), vec![0])]);
        assert_eq!((read.next_position, read.next_lsn), (next.position, Lsn(2)));
    }

    #[test]
    fn a_damaged_batch_followed_by_an_intact_one_is_told_from_a_torn_tail() {
        // A byte of the third batch's data flipped: replay stops there, and says the
        // fourth batch, written after it, is intact.
        let (replayed, placed) = five_batches(|placed| Some(placed[2].data_offsets_bytes[0] + 100));
        assert_eq!(replayed.batches.len(), 2);
        assert_eq!(
            replayed.stopped_by,
            Some(BatchError::DataChecksum { entry: 0 })
        );
        assert_eq!(
            replayed.damaged,
            Some(super::Damage {
                lsn: Lsn(3),
                position: placed[2].position,
                error: BatchError::DataChecksum { entry: 0 },
                next_position: placed[3].position,
            })
        );
        // Its header damaged instead: the same, though its length is unknown.
        let (replayed, placed) = five_batches(|placed| Some(placed[2].offset_bytes + 40));
        assert_eq!(replayed.batches.len(), 2);
        let damage = replayed.damaged.expect("damage found");
        assert_eq!(
            (damage.lsn, damage.position, damage.next_position),
            (Lsn(3), placed[2].position, placed[3].position)
        );
        // The last batch torn: nothing after it, an ordinary end of the log.
        let (replayed, _) = five_batches(|placed| Some(placed[4].data_offsets_bytes[0] + 100));
        assert_eq!(replayed.batches.len(), 4);
        assert_eq!(
            replayed.stopped_by,
            Some(BatchError::DataChecksum { entry: 0 })
        );
        assert_eq!(replayed.damaged, None);
        // Nor is the end of an intact log damage.
        let (replayed, _) = five_batches(|_| None);
        assert_eq!(replayed.batches.len(), 5);
        assert_eq!(replayed.damaged, None);
    }

    /// Replay sparing damaged data takes a batch written whole whose data changed since
    /// when the caller can spare that data, tells the trim which entries' data is damaged,
    /// and goes on; data it cannot spare, a damaged header and a torn last batch end it.
    #[test]
    fn replay_goes_on_past_damaged_data_it_can_spare() {
        let sparing = |disk: &Disk, spare: &dyn Fn(&Entry) -> bool| {
            let mut told = Vec::new();
            let read = |offset, len| disk.read(offset, len);
            let limit = disk.bytes.len() as u64;
            let trim = |entry: &mut Entry, _: u64, damaged: bool| told.push((entry.index, damaged));
            let replayed = replay_sparing(read, disk.ring(), (0, Lsn::FIRST), limit, spare, trim)
                .expect("memory reads do not fail");
            (replayed, told)
        };
        let (disk, placed) =
            five_batches_on_disk(|placed| Some(placed[2].data_offsets_bytes[0] + 100));
        let (replayed, told) = sparing(&disk, &|entry| entry.index == 3);
        assert_eq!(replayed.batches.len(), 5);
        assert_eq!(replayed.batches[2].damaged_entries, vec![0]);
        assert_eq!(replayed.batches[2].position, placed[2].position);
        assert_eq!(replayed.stopped_by, Some(BatchError::NoMagic { found: 0 }));
        assert_eq!(replayed.damaged, None);
        assert_eq!(
            told,
            [(1, false), (2, false), (3, true), (4, false), (5, false)]
        );
        // An entry the caller cannot do without: damage, as in plain replay.
        let (replayed, _) = sparing(&disk, &|entry| entry.index != 3);
        assert_eq!(replayed.batches.len(), 2);
        assert_eq!(replayed.damaged.map(|damage| damage.lsn), Some(Lsn(3)));
        // The header damaged: what the batch held is unknown.
        let (disk, _) = five_batches_on_disk(|placed| Some(placed[2].offset_bytes + 40));
        let (replayed, _) = sparing(&disk, &|_| true);
        assert_eq!(replayed.batches.len(), 2);
        assert_eq!(replayed.damaged.map(|damage| damage.lsn), Some(Lsn(3)));
        // The last batch torn: the end of the log, not damage to spare.
        let (disk, _) = five_batches_on_disk(|placed| Some(placed[4].data_offsets_bytes[0] + 9));
        let (replayed, told) = sparing(&disk, &|_| true);
        assert_eq!(replayed.batches.len(), 4);
        assert_eq!(
            replayed.stopped_by,
            Some(BatchError::DataChecksum { entry: 0 })
        );
        assert_eq!(replayed.damaged, None);
        assert!(told.iter().all(|(_, damaged)| !damaged), "{told:?}");
    }

    /// A 64 KiB ring with seven batches of one 4 KiB entry (8 KiB each, LSNs 1 to 7), its
    /// tail at 32 KiB: room for one more such batch before the end of the lap.
    fn a_lap_short_of_its_end() -> (Disk, LogWriter) {
        let mut disk = Disk::new(64 << 10);
        let mut writer = LogWriter::new(disk.ring(), 0, Lsn::FIRST, 0);
        for n in 0..7 {
            disk.write(&writer.append(&[entry(n + 1, 1, 4096)]).expect("room"));
        }
        writer.set_tail(32 << 10);
        (disk, writer)
    }

    /// Damaged data in a batch the writer put at the next lap (its LSN's batch torn by a
    /// crash where it was first written, and the batch written after the restart did not
    /// fit in the rest of the lap) is spared there; the torn batch left behind is not.
    #[test]
    fn damaged_data_at_the_next_lap_is_spared_there() {
        let (mut disk, mut writer) = a_lap_short_of_its_end();
        let ring = disk.ring();
        let torn = writer.append(&[entry(8, 2, 4096)]).expect("room");
        disk.write(&torn);
        disk.bytes[torn.data_offsets_bytes[0] as usize + 3] ^= 0xff;
        // After the restart, the batch of the same LSN is larger and goes to the next lap.
        let mut restarted = LogWriter::new(ring, torn.position, Lsn(8), 32 << 10);
        let rewritten = restarted.append(&[entry(8, 3, 8192)]).expect("room");
        assert_eq!(rewritten.position, 64 << 10, "placed at the next lap");
        disk.write(&rewritten);
        let after = restarted.append(&[entry(9, 4, 4096)]).expect("room");
        disk.write(&after);
        disk.bytes[rewritten.data_offsets_bytes[0] as usize + 5000] ^= 0xff;
        let read = |offset, len| disk.read(offset, len);
        let (from, limit) = ((32 << 10, Lsn(5)), (32 << 10) + ring.len_bytes);
        let replayed = replay_sparing(read, ring, from, limit, &|_| true, |_, _, _| {})
            .expect("memory reads do not fail");
        let taken: Vec<(u64, Lsn, Vec<usize>)> = replayed
            .batches
            .iter()
            .map(|b| (b.position, b.lsn, b.damaged_entries.clone()))
            .collect();
        assert_eq!(
            taken,
            [
                (32 << 10, Lsn(5), vec![]),
                (40 << 10, Lsn(6), vec![]),
                (48 << 10, Lsn(7), vec![]),
                (64 << 10, Lsn(8), vec![0]),
                (after.position, Lsn(9), vec![]),
            ]
        );
        assert_eq!(replayed.damaged, None);
        // Plain replay stops there, and calls it damage.
        let replayed = disk.replay_ring(ring, 32 << 10, Lsn(5), limit);
        assert_eq!(replayed.batches.len(), 3);
        let damage = replayed.damaged.expect("damage");
        assert_eq!((damage.lsn, damage.position), (Lsn(8), 64 << 10));
    }

    #[test]
    fn damage_is_found_after_a_largest_batch_and_at_the_next_lap() {
        // A largest batch (4 MiB of data) with its header damaged: its successor's header
        // lies a whole largest batch after it.
        let mut disk = Disk::new(16 << 20);
        let mut writer = LogWriter::new(disk.ring(), 0, Lsn::FIRST, 0);
        let placed: Vec<PlacedBatch> = [4096, batch::DATA_SIZE_MAX, 4096]
            .iter()
            .enumerate()
            .map(|(n, len)| {
                let batch = writer
                    .append(&[entry(n as u64 + 1, 1, *len)])
                    .expect("room");
                disk.write(&batch);
                batch
            })
            .collect();
        disk.bytes[placed[1].offset_bytes as usize + 40] ^= 0xff;
        let damage = disk.replay(0, Lsn::FIRST).damaged.expect("damage found");
        assert_eq!(
            (damage.lsn, damage.position, damage.next_position),
            (Lsn(2), placed[1].position, placed[2].position)
        );

        // A batch the writer placed at the next lap (it did not fit before the lap's end),
        // damaged there, with its successor after it.
        let (mut disk, mut writer) = a_lap_short_of_its_end();
        let ring = disk.ring();
        let skipped = writer.append(&[entry(8, 2, 8192)]).expect("room");
        assert_eq!(skipped.position, 64 << 10, "placed at the next lap");
        disk.write(&skipped);
        let after = writer.append(&[entry(9, 3, 4096)]).expect("room");
        disk.write(&after);
        disk.bytes[skipped.data_offsets_bytes[0] as usize + 1] ^= 0xff;
        let replayed = disk.replay_ring(ring, 32 << 10, Lsn(5), (32 << 10) + ring.len_bytes);
        assert_eq!(replayed.batches.len(), 3);
        assert_eq!(
            replayed.damaged,
            Some(super::Damage {
                lsn: Lsn(8),
                position: skipped.position,
                error: BatchError::DataChecksum { entry: 0 },
                next_position: after.position,
            })
        );
    }

    #[test]
    fn a_torn_last_batch_is_not_taken_for_damage() {
        // Its data holds what looks like the next batch (a guest's bytes may): with the
        // torn batch's header intact, only where the writer would have put the next batch
        // counts.
        let mut disk = Disk::new(1 << 20);
        let mut writer = LogWriter::new(disk.ring(), 0, Lsn::FIRST, 0);
        let first = writer.append(&[entry(1, 1, 4096)]).expect("room");
        disk.write(&first);
        let mut forged = batch::encode(Lsn(3), &[]);
        forged.resize(8192, 0);
        let mut torn_entry = entry(2, 0, 8192);
        torn_entry.data = forged;
        let torn = writer.append(&[torn_entry]).expect("room");
        disk.write(&torn);
        disk.bytes[torn.data_offsets_bytes[0] as usize + 4096] ^= 0xff;
        let replayed = disk.replay(0, Lsn::FIRST);
        assert_eq!(replayed.batches.len(), 1);
        assert_eq!(
            replayed.stopped_by,
            Some(BatchError::DataChecksum { entry: 0 })
        );
        assert_eq!(replayed.damaged, None);

        // A read error while looking for the successor gives no verdict, and replay
        // itself goes on as before.
        let (_, placed) = five_batches(|_| None);
        let mut disk = Disk::new(1 << 20);
        for batch in &placed {
            disk.write(batch);
        }
        disk.bytes[placed[2].data_offsets_bytes[0] as usize] ^= 0xff;
        let successor = placed[3].offset_bytes as usize;
        let read = |offset: u64, len: usize| -> Result<Vec<u8>, ()> {
            let (from, to) = (offset as usize, offset as usize + len);
            if from <= successor && successor < to {
                return Err(());
            }
            Ok(disk.bytes[from..to].to_vec())
        };
        let replayed = replay(read, disk.ring(), 0, Lsn::FIRST, 1 << 20).expect("replayed");
        assert_eq!(replayed.batches.len(), 2);
        assert_eq!(replayed.damaged, None);
    }

    #[test]
    fn an_older_lap_ends_the_log() {
        let mut disk = Disk::new(64 << 10);
        let ring = disk.ring();
        let mut old = LogWriter::new(ring, 0, Lsn(1), 0);
        for _ in 0..10 {
            disk.write(&old.append(&[]).expect("room"));
        }
        let mut new = LogWriter::new(ring, 0, Lsn(100), 0);
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
        let ring = Ring {
            start_bytes: 0,
            len_bytes: 1 << 20,
        };
        let result = replay(|_, _| Err("disk failed"), ring, 0, Lsn::FIRST, 1 << 20);
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
        #![proptest_config(ProptestConfig { cases: 100, ..ProptestConfig::default() })]

        /// A ring reused over many laps: the tail follows the head at a distance, a replay
        /// starts at some earlier batch (a checkpoint's start), and the last batch written
        /// may be torn. Replay returns exactly the batches from the start on, through every
        /// lap and skip, and stops at the torn one.
        #[test]
        fn replay_follows_the_ring_over_many_laps(
            sizes in proptest::collection::vec(0usize..5, 20..120),
            keep in 2usize..6,
            from in any::<prop::sample::Index>(),
            torn in any::<bool>(),
        ) {
            let ring = Ring { start_bytes: 4096, len_bytes: 10 * 4096 };
            let mut disk = Disk::new(11 * 4096);
            let mut writer = LogWriter::new(ring, 0, Lsn::FIRST, 0);
            let mut placed: Vec<(PlacedBatch, Vec<Entry>)> = Vec::new();
            for (n, blocks) in sizes.iter().enumerate() {
                // Free everything but the last `keep` batches.
                if placed.len() > keep {
                    writer.set_tail(placed[placed.len() - keep].0.position);
                }
                let entries = vec![entry(n as u64 + 1, n as u8, blocks * 4096)];
                let batch = match writer.append(&entries) {
                    Ok(batch) => batch,
                    Err(LogError::Full { .. }) => continue,
                    Err(error) => panic!("{error}"),
                };
                prop_assert!(batch.offset_bytes + batch.bytes.len() as u64 <= 11 * 4096);
                disk.write(&batch);
                placed.push((batch, entries));
            }
            let tail = placed[placed.len().saturating_sub(keep)].0.position;
            let from = placed.len().saturating_sub(keep) + from.index(keep.min(placed.len()));
            let expected_len = if torn {
                let (last, _) = placed.last().expect("some batches");
                let at = last.offset_bytes as usize + 100;
                disk.bytes[at] ^= 0xFF;
                placed.len() - 1 - from
            } else {
                placed.len() - from
            };
            let (start, _) = &placed[from];
            let replayed = disk.replay_ring(ring, start.position, start.lsn, tail + ring.len_bytes);
            prop_assert_eq!(replayed.batches.len(), expected_len);
            for (found, (written, entries)) in replayed.batches.iter().zip(&placed[from..]) {
                prop_assert_eq!(found.position, written.position);
                prop_assert_eq!(found.lsn, written.lsn);
                let found: Vec<Entry> = found.entries.iter().map(|(e, _)| e.clone()).collect();
                prop_assert_eq!(&found, entries);
            }
            let next = placed.get(from + expected_len).map(|(b, _)| b.lsn).unwrap_or(writer.next_lsn());
            prop_assert_eq!(replayed.next_lsn, next);
        }
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
            let mut writer = LogWriter::new(disk.ring(), 0, Lsn::FIRST, 0);
            let placed: Vec<PlacedBatch> = batches.iter().map(|entries| writer.append(entries).expect("room")).collect();
            let synced = synced.index(placed.len() + 1);
            for batch in &placed {
                disk.write(batch);
            }
            let tail_start = placed.get(synced).map_or(writer.next_position() as usize, |b| b.offset_bytes as usize);
            let tail_end = writer.next_position() as usize;
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
