//! The CRC32C of every 4 KiB block of the log region, as it was written: what a read
//! checks its blocks against, so that a device that changed a block under us (a bad
//! sector, a bit flipped at rest, a stray write) is caught before its bytes reach a client
//! or another replica.
//!
//! A batch's entry checksums cover replay: each entry's data is checked when the log is
//! read back on start. Reads of data whose batch lies before the replay point would go
//! unchecked, and an entry's checksum spans its whole data, while a read wants a few blocks
//! of it. So the OSD keeps one checksum per block of the ring: set when a batch is written
//! or replayed, and kept for the blocks the object index refers to in checkpoints.
//!
//! The table is shared by the writer and the readers: each slot is an atomic, 0 while
//! nothing is known of the block (a checkpoint of an older format, say), else the
//! checksum with bit 32 set. Bit 33 marks a block *poisoned*: it holds data that failed
//! its checksum where it was before the cleaner moved it here, and fails every read until
//! it is written again.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::batch::BLOCK_SIZE;
use crate::log::Ring;

const KNOWN: u64 = 1 << 32;
const POISONED: u64 = 1 << 33;

/// A block whose bytes are not those written there.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("the block at device offset {device_offset_bytes} {}", describe(self))]
pub struct Mismatch {
    /// Where the block is.
    pub device_offset_bytes: u64,
    /// The checksum of what was written.
    pub expected: u32,
    /// The checksum of what was read.
    pub found: u32,
    /// The block holds data that was damaged before the cleaner moved it there.
    pub poisoned: bool,
}

fn describe(mismatch: &Mismatch) -> String {
    if mismatch.poisoned {
        "holds data that failed its checksum before the cleaner moved it there".to_string()
    } else {
        format!(
            "fails its checksum (CRC32C {:#010x}, written as {:#010x})",
            mismatch.found, mismatch.expected
        )
    }
}

/// Checksums of blocks in runs: a run is the device offset of its first block and the
/// checksums of consecutive blocks from there. How checkpoints store them.
pub type SumRun = (u64, Vec<u32>);

/// The checksum of each block of a ring.
#[derive(Debug)]
pub struct BlockSums {
    start_bytes: u64,
    sums: Box<[AtomicU64]>,
}

impl BlockSums {
    /// Nothing known of any block of `ring`.
    pub fn new(ring: Ring) -> Self {
        let blocks = ring.len_bytes / BLOCK_SIZE as u64;
        Self {
            start_bytes: ring.start_bytes,
            sums: (0..blocks).map(|_| AtomicU64::new(0)).collect(),
        }
    }

    fn slot(&self, device_offset_bytes: u64) -> Option<&AtomicU64> {
        let block = device_offset_bytes.checked_sub(self.start_bytes)? / BLOCK_SIZE as u64;
        self.sums.get(usize::try_from(block).ok()?)
    }

    /// The slot's value for the block at `device_offset_bytes` (0 outside the ring).
    fn value(&self, device_offset_bytes: u64) -> u64 {
        self.slot(device_offset_bytes)
            .map_or(0, |slot| slot.load(Ordering::Acquire))
    }

    /// Records `data` as written at `device_offset_bytes` (a block boundary): whole blocks,
    /// or an entry's data, which a batch zero-pads to a whole block. Blocks outside the
    /// ring are not recorded.
    pub fn record(&self, device_offset_bytes: u64, data: &[u8]) {
        for (i, chunk) in data.chunks(BLOCK_SIZE).enumerate() {
            self.set(
                device_offset_bytes + (i * BLOCK_SIZE) as u64,
                block_sum(chunk),
            );
        }
    }

    /// Sets the checksum of the block at `device_offset_bytes`.
    pub fn set(&self, device_offset_bytes: u64, sum: u32) {
        if let Some(slot) = self.slot(device_offset_bytes) {
            slot.store(KNOWN | u64::from(sum), Ordering::Release);
        }
    }

    /// The checksum of the block at `device_offset_bytes`, if known (and not poisoned).
    pub fn get(&self, device_offset_bytes: u64) -> Option<u32> {
        let value = self.value(device_offset_bytes);
        (value & (KNOWN | POISONED) == KNOWN).then_some(value as u32)
    }

    /// Marks the block at `device_offset_bytes` poisoned: every read of it fails until it
    /// is written again.
    pub fn poison(&self, device_offset_bytes: u64) {
        if let Some(slot) = self.slot(device_offset_bytes) {
            slot.fetch_or(KNOWN | POISONED, Ordering::AcqRel);
        }
    }

    /// Whether the block at `device_offset_bytes` is poisoned.
    pub fn is_poisoned(&self, device_offset_bytes: u64) -> bool {
        self.value(device_offset_bytes) & POISONED != 0
    }

    /// Poisons every block the device range `(offset, len)` touches.
    pub fn poison_range(&self, offset: u64, len: u64) {
        for at in blocks(offset, len) {
            self.poison(at);
        }
    }

    /// Whether any block the device range `(offset, len)` touches is poisoned.
    pub fn any_poisoned(&self, offset: u64, len: u64) -> bool {
        blocks(offset, len).any(|at| self.is_poisoned(at))
    }

    /// Checks `data` read at `device_offset_bytes` (a block boundary; whole blocks, or an
    /// entry's data, taken as zero-padded like [`BlockSums::record`]) against the checksums
    /// written: the first block that differs, if any. Blocks of unknown checksum pass.
    pub fn verify(&self, device_offset_bytes: u64, data: &[u8]) -> Result<(), Mismatch> {
        for (i, chunk) in data.chunks(BLOCK_SIZE).enumerate() {
            let at = device_offset_bytes + (i * BLOCK_SIZE) as u64;
            let value = self.value(at);
            if value & KNOWN == 0 {
                continue;
            }
            let (expected, poisoned) = (value as u32, value & POISONED != 0);
            let found = block_sum(chunk);
            if poisoned || found != expected {
                return Err(Mismatch {
                    device_offset_bytes: at,
                    expected,
                    found,
                    poisoned,
                });
            }
        }
        Ok(())
    }

    /// The known checksums of every block that the device ranges `(offset, length)` touch,
    /// as runs in device order, each block once, and the runs (first block's offset,
    /// count) of those poisoned.
    pub fn runs(
        &self,
        ranges: impl IntoIterator<Item = (u64, u64)>,
    ) -> (Vec<SumRun>, Vec<(u64, u32)>) {
        let block = BLOCK_SIZE as u64;
        let mut poisoned: Vec<(u64, u32)> = Vec::new();
        // The block spans in device order (one per range, not per block: a checkpoint of
        // a large device lists many blocks).
        let mut spans: Vec<(u64, u64)> = ranges
            .into_iter()
            .filter(|(_, len)| *len > 0)
            .map(|(offset, len)| (offset / block, (offset + len).div_ceil(block)))
            .collect();
        spans.sort_unstable();
        let mut runs: Vec<SumRun> = Vec::new();
        let mut next = None;
        let mut covered_to = 0;
        for (first, end) in spans {
            for number in first.max(covered_to)..end {
                let at = number * block;
                if self.is_poisoned(at) {
                    match poisoned.last_mut() {
                        Some((start, count)) if *start + u64::from(*count) * block == at => {
                            *count += 1;
                        }
                        _ => poisoned.push((at, 1)),
                    }
                }
                let Some(sum) = self.get(at) else {
                    next = None;
                    continue;
                };
                match runs.last_mut() {
                    Some((_, sums)) if next == Some(at) => sums.push(sum),
                    _ => runs.push((at, vec![sum])),
                }
                next = Some(at + block);
            }
            covered_to = covered_to.max(end);
        }
        (runs, poisoned)
    }

    /// Sets the checksums that `runs` give, and poisons the blocks of `poisoned`.
    pub fn load(&self, runs: &[SumRun], poisoned: &[(u64, u32)]) {
        for (start, sums) in runs {
            for (i, sum) in sums.iter().enumerate() {
                self.set(start + (i * BLOCK_SIZE) as u64, *sum);
            }
        }
        for (start, count) in poisoned {
            self.poison_range(*start, u64::from(*count) * BLOCK_SIZE as u64);
        }
    }
}

/// The device offsets of the blocks the range `(offset, len)` touches.
fn blocks(offset: u64, len: u64) -> impl Iterator<Item = u64> {
    let block = BLOCK_SIZE as u64;
    (offset - offset % block..offset + len).step_by(BLOCK_SIZE)
}

/// The checksum of a block holding `chunk` (at most a block), zero-padded.
fn block_sum(chunk: &[u8]) -> u32 {
    static ZEROES: [u8; BLOCK_SIZE] = [0; BLOCK_SIZE];
    let sum = crc32c::crc32c(chunk);
    match BLOCK_SIZE.checked_sub(chunk.len()) {
        Some(0) | None => sum,
        Some(padding) => crc32c::crc32c_append(sum, &ZEROES[..padding]),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const B: u64 = BLOCK_SIZE as u64;

    fn ring() -> Ring {
        Ring {
            start_bytes: 3 * B,
            len_bytes: 16 * B,
        }
    }

    fn blocks(fills: &[u8]) -> Vec<u8> {
        fills
            .iter()
            .flat_map(|fill| std::iter::repeat_n(*fill, BLOCK_SIZE))
            .collect()
    }

    #[test]
    fn a_block_changed_after_it_was_written_fails_and_the_others_pass() {
        let sums = BlockSums::new(ring());
        let written = blocks(&[1, 2, 3]);
        sums.record(5 * B, &written);
        assert_eq!(sums.verify(5 * B, &written), Ok(()));
        let mut read = written.clone();
        read[BLOCK_SIZE + 17] ^= 0x40;
        let mismatch = sums.verify(5 * B, &read).expect_err("a changed block");
        assert_eq!(mismatch.device_offset_bytes, 6 * B);
        assert_eq!(
            mismatch.expected,
            crc32c::crc32c(&written[BLOCK_SIZE..2 * BLOCK_SIZE])
        );
        assert_ne!(mismatch.found, mismatch.expected);
        // The blocks read on either side of it are fine on their own.
        assert_eq!(sums.verify(5 * B, &read[..BLOCK_SIZE]), Ok(()));
        assert_eq!(sums.verify(7 * B, &read[2 * BLOCK_SIZE..]), Ok(()));
    }

    #[test]
    fn blocks_of_unknown_checksum_pass_and_outside_the_ring_nothing_is_kept() {
        let sums = BlockSums::new(ring());
        assert_eq!(sums.verify(4 * B, &blocks(&[9])), Ok(()));
        sums.record(0, &blocks(&[1, 1, 1, 1]));
        sums.record(19 * B, &blocks(&[1]));
        assert_eq!(sums.get(0), None);
        assert_eq!(sums.get(19 * B), None);
        assert_eq!(sums.get(3 * B), Some(crc32c::crc32c(&blocks(&[1]))));
    }

    #[test]
    fn padded_data_sums_as_the_block_a_batch_writes() {
        let sums = BlockSums::new(ring());
        let data = vec![7u8; BLOCK_SIZE + 100];
        sums.record(8 * B, &data);
        let mut padded = data.clone();
        padded.resize(2 * BLOCK_SIZE, 0);
        assert_eq!(sums.verify(8 * B, &padded), Ok(()));
        assert_eq!(
            sums.verify(8 * B, &data),
            Ok(()),
            "the data alone, as padded"
        );
        padded[BLOCK_SIZE + 200] = 1;
        assert!(sums.verify(8 * B, &padded).is_err());
    }

    #[test]
    fn runs_cover_the_blocks_ranges_touch_and_load_back() {
        let sums = BlockSums::new(ring());
        sums.record(3 * B, &blocks(&[1, 2, 3, 4, 5, 6, 7, 8]));
        // Two ranges sharing block 4, one within block 9, and a block not known (12).
        let (runs, poisoned) =
            sums.runs([(4 * B + 10, B), (4 * B, 100), (9 * B + 5, 10), (12 * B, B)]);
        let sum = |fill: u8| crc32c::crc32c(&blocks(&[fill]));
        assert_eq!(
            runs,
            vec![(4 * B, vec![sum(2), sum(3)]), (9 * B, vec![sum(7)])]
        );
        assert_eq!(poisoned, vec![]);
        let loaded = BlockSums::new(ring());
        loaded.load(&runs, &poisoned);
        for at in [4 * B, 5 * B, 9 * B] {
            assert_eq!(loaded.get(at), sums.get(at));
        }
        assert_eq!(loaded.get(3 * B), None);
    }

    /// A poisoned block fails every read, even of the bytes its checksum was computed from,
    /// is listed apart in runs, loads back poisoned, and is cleared by a write.
    #[test]
    fn a_poisoned_block_fails_until_written_again() {
        let sums = BlockSums::new(ring());
        let written = blocks(&[1, 2]);
        sums.record(5 * B, &written);
        sums.poison(6 * B);
        let mismatch = sums.verify(5 * B, &written).expect_err("poisoned");
        assert!(mismatch.poisoned && mismatch.device_offset_bytes == 6 * B);
        assert!(mismatch.to_string().contains("before the cleaner moved it"));
        assert_eq!(sums.get(6 * B), None);
        let (runs, poisoned) = sums.runs([(5 * B, 2 * B)]);
        assert_eq!(
            runs,
            vec![(5 * B, vec![crc32c::crc32c(&written[..BLOCK_SIZE])])]
        );
        assert_eq!(poisoned, vec![(6 * B, 1)]);
        let loaded = BlockSums::new(ring());
        loaded.load(&runs, &poisoned);
        assert!(loaded.verify(5 * B, &written).is_err());
        assert!(loaded.verify(5 * B, &written[..BLOCK_SIZE]).is_ok());
        sums.record(6 * B, &written[BLOCK_SIZE..]);
        assert_eq!(sums.verify(5 * B, &written), Ok(()));
    }
}
