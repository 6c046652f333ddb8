//! Where an object's bytes are: non-overlapping extents, each pointing at the log.
//!
//! A write maps its range to where its data landed in the log, replacing whatever was
//! mapped there; a discard unmaps its range. A range that nothing maps reads as zeroes:
//! that is thin provisioning. Lookups split a range into mapped pieces and holes.

use std::collections::BTreeMap;

use crate::batch::{BLOCK_SIZE, blocks_touched};

/// A mapped range: `len_bytes` of the object starting at the key, stored at
/// `device_offset_bytes` in the log.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Mapping {
    len_bytes: u64,
    device_offset_bytes: u64,
}

/// The first and last blocks `len` bytes from `offset` touch.
fn blocks(offset: u64, len: u64) -> (u64, u64) {
    let touched = blocks_touched(offset, len);
    (touched.start, touched.end - 1)
}

impl Mapping {
    /// The log blocks its data touches, first and last: what it keeps in use there, since
    /// the log stores data in whole blocks (a 512-byte write takes a block).
    fn device_blocks(&self) -> (u64, u64) {
        blocks(self.device_offset_bytes, self.len_bytes)
    }
}

/// Bytes of the log blocks and of the object's blocks that the extent at `start` touches.
fn spans(start: u64, mapping: &Mapping) -> [i64; 2] {
    let (first, last) = mapping.device_blocks();
    let (first_in_object, last_in_object) = blocks(start, mapping.len_bytes);
    [last - first + 1, last_in_object - first_in_object + 1].map(|n| (n * BLOCK_SIZE as u64) as i64)
}

/// What two extents next to each other in the object share, in bytes: the log block the
/// first ends in and the second starts in, if the same; the object's block likewise.
fn shared(before: Option<(u64, Mapping)>, after: Option<(u64, Mapping)>) -> [i64; 2] {
    let (Some((start, first)), Some((next, second))) = (before, after) else {
        return [0, 0];
    };
    let block = BLOCK_SIZE as i64;
    [
        i64::from(first.device_blocks().1 == second.device_blocks().0) * block,
        i64::from(blocks(start, first.len_bytes).1 == next / BLOCK_SIZE as u64) * block,
    ]
}

/// One piece of a lookup.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Piece {
    /// `len_bytes` at `device_offset_bytes` in the log.
    Mapped {
        /// Offset in the object.
        offset_bytes: u64,
        /// Length.
        len_bytes: u64,
        /// Where the bytes are on the device.
        device_offset_bytes: u64,
    },
    /// `len_bytes` never written or discarded: zeroes.
    Hole {
        /// Offset in the object.
        offset_bytes: u64,
        /// Length.
        len_bytes: u64,
    },
}

/// The extents of one object.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ExtentMap {
    extents: BTreeMap<u64, Mapping>,
    /// The sum of the extents' lengths, kept as they change.
    mapped_bytes: u64,
    /// [`ExtentMap::occupied_bytes`], kept as extents change.
    occupied_bytes: u64,
    /// [`ExtentMap::packed_bytes`], kept as extents change.
    packed_bytes: u64,
}

impl ExtentMap {
    /// An object with nothing written.
    pub fn new() -> Self {
        Self::default()
    }

    /// Whether nothing is mapped (the object reads as zeroes and can be forgotten).
    pub fn is_empty(&self) -> bool {
        self.extents.is_empty()
    }

    /// The number of extents.
    pub fn len(&self) -> usize {
        self.extents.len()
    }

    /// Bytes mapped.
    pub fn mapped_bytes(&self) -> u64 {
        self.mapped_bytes
    }

    /// Bytes of the log blocks the extents' data touches, where [`ExtentMap::mapped_bytes`]
    /// counts 512 bytes for a 512-byte write that keeps a whole block in use. A block two
    /// extents next to each other in the object share counts once; one that extents
    /// further apart share (the two pieces of a write overwritten within a block) counts
    /// for each, so this errs high there.
    pub fn occupied_bytes(&self) -> u64 {
        self.occupied_bytes
    }

    /// Bytes of the object's own blocks that data is mapped in: what its data would take
    /// in the log with each block of the object in one block of the log (the cleaner
    /// packs an object's block so when its pieces lie in several).
    pub fn packed_bytes(&self) -> u64 {
        self.packed_bytes
    }

    /// The extent before `start` and the one after it.
    fn neighbours(&self, start: u64) -> [Option<(u64, Mapping)>; 2] {
        use std::ops::Bound::{Excluded, Unbounded};
        let before = self.extents.range(..start).next_back();
        let after = self.extents.range((Excluded(start), Unbounded)).next();
        [before, after].map(|extent| extent.map(|(&at, &mapping)| (at, mapping)))
    }

    /// Counts the change of the extent at `start` from `old` to `new` (either may be
    /// none) between its neighbours.
    fn count(&mut self, start: u64, old: Option<Mapping>, new: Option<Mapping>) {
        let [before, after] = self.neighbours(start);
        let mut delta = [0i64; 2];
        let mut add = |terms: [i64; 2], sign: i64| {
            delta[0] += sign * terms[0];
            delta[1] += sign * terms[1];
        };
        for (mapping, sign) in [(old, -1), (new, 1)] {
            match mapping {
                Some(mapping) => {
                    let extent = Some((start, mapping));
                    add(spans(start, &mapping), sign);
                    add(shared(before, extent), -sign);
                    add(shared(extent, after), -sign);
                }
                // With no extent at `start`, its neighbours are next to each other.
                None => add(shared(before, after), -sign),
            }
        }
        let len = |mapping: Option<Mapping>| mapping.map_or(0, |mapping| mapping.len_bytes);
        self.mapped_bytes = self.mapped_bytes + len(new) - len(old);
        self.occupied_bytes = self
            .occupied_bytes
            .checked_add_signed(delta[0])
            .expect("occupancy");
        self.packed_bytes = self
            .packed_bytes
            .checked_add_signed(delta[1])
            .expect("packing");
    }

    /// Puts `mapping` at `start`, replacing any at the same start, and counts it.
    fn put(&mut self, start: u64, mapping: Mapping) {
        let old = self.extents.insert(start, mapping);
        self.count(start, old, Some(mapping));
    }

    /// Takes the mapping at `start` out, uncounted.
    fn take(&mut self, start: u64) -> Option<Mapping> {
        let old = self.extents.remove(&start)?;
        self.count(start, Some(old), None);
        Some(old)
    }

    /// Maps `[offset, offset + len)` to `device_offset`, replacing what was there.
    pub fn insert(&mut self, offset_bytes: u64, len_bytes: u64, device_offset_bytes: u64) {
        if len_bytes == 0 {
            return;
        }
        self.remove(offset_bytes, len_bytes);
        self.put(
            offset_bytes,
            Mapping {
                len_bytes,
                device_offset_bytes,
            },
        );
        self.join(offset_bytes);
        // A full check walks every extent: only of small maps (the unit tests'), or debug
        // builds' OSDs crawl under writes of 512 bytes (thousands of extents an object).
        debug_assert!(
            self.extents.len() > 256 || self.check_invariants().is_ok(),
            "{:?}",
            self.check_invariants()
        );
    }

    /// Joins the extent at `start` with the one before it and the one after it where both
    /// the object's bytes and the log's run on from one to the other: the pieces of a block
    /// the cleaner packed (sectors written one at a time, laid out in the packed block as in
    /// the object), writes next to each other in one batch. Each extent takes about 28
    /// bytes in every checkpoint: an object whose every 512-byte sector was written apart
    /// kept eight per block, and a checkpoint of such data outgrew its area (a 64th of the
    /// device) once live data passed a third of the device.
    fn join(&mut self, start: u64) {
        let Some(&mapping) = self.extents.get(&start) else {
            return;
        };
        let runs_on = |(at, first): (u64, Mapping), (next, second): (u64, Mapping)| {
            at + first.len_bytes == next
                && first.device_offset_bytes + first.len_bytes == second.device_offset_bytes
        };
        let [before, after] = self.neighbours(start);
        let mut joined = (start, mapping);
        if let Some(before) = before
            && runs_on(before, joined)
        {
            self.take(start);
            joined = (
                before.0,
                Mapping {
                    len_bytes: before.1.len_bytes + mapping.len_bytes,
                    ..before.1
                },
            );
            self.put(joined.0, joined.1);
        }
        if let Some(after) = after
            && runs_on(joined, after)
        {
            self.take(after.0);
            let len_bytes = joined.1.len_bytes + after.1.len_bytes;
            self.put(
                joined.0,
                Mapping {
                    len_bytes,
                    ..joined.1
                },
            );
        }
    }

    /// Unmaps `[offset, offset + len)`; it reads as zeroes afterwards.
    pub fn remove(&mut self, offset_bytes: u64, len_bytes: u64) {
        let end = offset_bytes + len_bytes;
        // Extents that start before the range and reach into it keep their head.
        if let Some((&start, &mapping)) = self.extents.range(..offset_bytes).next_back() {
            let mapping_end = start + mapping.len_bytes;
            if mapping_end > offset_bytes {
                self.put(
                    start,
                    Mapping {
                        len_bytes: offset_bytes - start,
                        ..mapping
                    },
                );
                if mapping_end > end {
                    let tail = Mapping {
                        len_bytes: mapping_end - end,
                        device_offset_bytes: mapping.device_offset_bytes + (end - start),
                    };
                    self.put(end, tail);
                }
            }
        }
        // Extents that start inside the range lose what the range covers.
        let inside: Vec<(u64, Mapping)> = self
            .extents
            .range(offset_bytes..end)
            .map(|(k, v)| (*k, *v))
            .collect();
        for (start, mapping) in inside {
            self.take(start);
            let mapping_end = start + mapping.len_bytes;
            if mapping_end > end {
                let tail = Mapping {
                    len_bytes: mapping_end - end,
                    device_offset_bytes: mapping.device_offset_bytes + (end - start),
                };
                self.put(end, tail);
            }
        }
    }

    /// Splits `[offset, offset + len)` into mapped pieces and holes, in order.
    pub fn lookup(&self, offset_bytes: u64, len_bytes: u64) -> Vec<Piece> {
        let end = offset_bytes + len_bytes;
        let mut pieces = Vec::new();
        let mut cursor = offset_bytes;
        let before = self.extents.range(..offset_bytes).next_back();
        let overlapping = before
            .into_iter()
            .chain(self.extents.range(offset_bytes..end));
        for (&start, mapping) in overlapping {
            let mapping_end = start + mapping.len_bytes;
            if mapping_end <= cursor {
                continue;
            }
            if start > cursor {
                pieces.push(Piece::Hole {
                    offset_bytes: cursor,
                    len_bytes: start - cursor,
                });
                cursor = start;
            }
            let piece_end = mapping_end.min(end);
            pieces.push(Piece::Mapped {
                offset_bytes: cursor,
                len_bytes: piece_end - cursor,
                device_offset_bytes: mapping.device_offset_bytes + (cursor - start),
            });
            cursor = piece_end;
        }
        if cursor < end {
            pieces.push(Piece::Hole {
                offset_bytes: cursor,
                len_bytes: end - cursor,
            });
        }
        pieces
    }

    /// The extents, in order: (offset in the object, length, device offset).
    pub fn extents(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.extents
            .iter()
            .map(|(&start, m)| (start, m.len_bytes, m.device_offset_bytes))
    }

    /// Bytes of `[offset, offset + len)` that still map to the data written at
    /// `device_offset` for that range (byte `offset + i` at `device_offset + i`): what of a
    /// log entry's payload is live.
    pub fn live_bytes(&self, offset_bytes: u64, len_bytes: u64, device_offset_bytes: u64) -> u64 {
        self.live_pieces(offset_bytes, len_bytes, device_offset_bytes)
            .map(|(_, len)| len)
            .sum()
    }

    /// The parts of `[offset, offset + len)` that still map to the data written at
    /// `device_offset` for that range, in order: (offset in the object, length).
    pub fn live_pieces(
        &self,
        offset_bytes: u64,
        len_bytes: u64,
        device_offset_bytes: u64,
    ) -> impl Iterator<Item = (u64, u64)> {
        self.lookup(offset_bytes, len_bytes)
            .into_iter()
            .filter_map(move |piece| match piece {
                Piece::Mapped {
                    offset_bytes: at,
                    len_bytes: len,
                    device_offset_bytes: device,
                } if device == device_offset_bytes + (at - offset_bytes) => Some((at, len)),
                _ => None,
            })
    }

    /// Compare-and-swap of a move: every part of `[offset, offset + len)` that still maps
    /// to `old_device_offset` (byte `offset + i` at `old + i`) maps to `new + i` instead;
    /// any other part is left alone. Returns the bytes moved.
    pub fn relocate(
        &mut self,
        offset_bytes: u64,
        len_bytes: u64,
        old_device_offset_bytes: u64,
        new_device_offset_bytes: u64,
    ) -> u64 {
        let mut moved = 0;
        for piece in self.lookup(offset_bytes, len_bytes) {
            if let Piece::Mapped {
                offset_bytes: at,
                len_bytes: len,
                device_offset_bytes: device,
            } = piece
                && device == old_device_offset_bytes + (at - offset_bytes)
            {
                self.insert(at, len, new_device_offset_bytes + (at - offset_bytes));
                moved += len;
            }
        }
        moved
    }

    /// Extents are non-empty and do not overlap, and their lengths add up to the count kept.
    pub fn check_invariants(&self) -> Result<(), String> {
        let total: u64 = self.extents.values().map(|m| m.len_bytes).sum();
        if total != self.mapped_bytes {
            return Err(format!(
                "extents hold {total} bytes, {} counted",
                self.mapped_bytes
            ));
        }
        let extents: Vec<_> = self.extents.iter().map(|(&at, &m)| (at, m)).collect();
        let mut counts = [0i64; 2];
        for (n, &(start, mapping)) in extents.iter().enumerate() {
            let spans = spans(start, &mapping);
            let shared = shared(n.checked_sub(1).map(|p| extents[p]), Some((start, mapping)));
            for i in 0..2 {
                counts[i] += spans[i] - shared[i];
            }
        }
        let kept = [self.occupied_bytes, self.packed_bytes].map(|n| n as i64);
        if counts != kept {
            return Err(format!(
                "extents occupy {} bytes in {} of the object's, {kept:?} counted",
                counts[0], counts[1]
            ));
        }
        let mut previous_end = 0;
        for (&start, mapping) in &self.extents {
            if mapping.len_bytes == 0 {
                return Err(format!("empty extent at {start}"));
            }
            if start < previous_end {
                return Err(format!(
                    "extent at {start} overlaps the previous one ending at {previous_end}"
                ));
            }
            previous_end = start + mapping.len_bytes;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The model: for each byte of a small object, the device byte it maps to.
    fn resolve(map: &ExtentMap, len: u64) -> Vec<Option<u64>> {
        let mut bytes = Vec::new();
        for piece in map.lookup(0, len) {
            match piece {
                Piece::Mapped {
                    len_bytes,
                    device_offset_bytes,
                    ..
                } => {
                    bytes.extend((0..len_bytes).map(|i| Some(device_offset_bytes + i)));
                }
                Piece::Hole { len_bytes, .. } => bytes.extend((0..len_bytes).map(|_| None)),
            }
        }
        bytes
    }

    #[test]
    fn overwrite_in_the_middle_splits_the_extent() {
        let mut map = ExtentMap::new();
        map.insert(0, 12288, 1_000_000);
        map.insert(4096, 4096, 5_000_000);
        assert_eq!(
            map.lookup(0, 16384),
            vec![
                Piece::Mapped {
                    offset_bytes: 0,
                    len_bytes: 4096,
                    device_offset_bytes: 1_000_000
                },
                Piece::Mapped {
                    offset_bytes: 4096,
                    len_bytes: 4096,
                    device_offset_bytes: 5_000_000
                },
                Piece::Mapped {
                    offset_bytes: 8192,
                    len_bytes: 4096,
                    device_offset_bytes: 1_008_192
                },
                Piece::Hole {
                    offset_bytes: 12288,
                    len_bytes: 4096
                },
            ]
        );
        map.remove(0, 16384);
        assert!(map.is_empty());
    }

    /// Extents count the log blocks their data touches: whole blocks exactly, a 512-byte
    /// write as a block, and the two pieces of a write overwritten in the middle of a
    /// block each count that block; a block that extents next to each other in the object
    /// share counts once. Packed, each block of the object would take one.
    #[test]
    fn occupancy_counts_the_blocks_data_touches() {
        let block = BLOCK_SIZE as u64;
        let mut map = ExtentMap::new();
        let counts = |map: &ExtentMap| {
            let counts = [map.mapped_bytes(), map.occupied_bytes(), map.packed_bytes()];
            counts.map(|bytes| bytes as f64 / block as f64)
        };
        map.insert(0, 4 * block, 10 * block);
        assert_eq!(counts(&map), [4.0, 4.0, 4.0]);
        map.insert(block + 512, 512, 20 * block);
        assert_eq!(counts(&map), [4.0, 6.0, 4.0]);
        // The eight sectors of the object's block 8, each in a block of its own.
        for sector in 0..8 {
            map.insert(8 * block + sector * 512, 512, (30 + sector) * block);
        }
        assert_eq!(counts(&map), [5.0, 14.0, 5.0]);
        // Six of them packed into one block: it counts once.
        for sector in 1..7 {
            let at = 8 * block + sector * 512;
            map.relocate(at, 512, (30 + sector) * block, 40 * block + sector * 512);
        }
        assert_eq!(counts(&map), [5.0, 9.0, 5.0]);
        // One sector less, between two packed ones: they still share the block.
        map.remove(8 * block + 3 * 512, 512);
        assert_eq!(counts(&map), [4.875, 9.0, 5.0]);
        map.remove(8 * block, 512);
        map.remove(8 * block + 7 * 512, 512);
        assert_eq!(counts(&map), [4.625, 7.0, 5.0]);
        map.remove(0, 16 * block);
        assert_eq!(counts(&map), [0.0, 0.0, 0.0]);
    }

    proptest! {
        /// Random writes and discards give the same byte-to-device mapping as a flat model;
        /// writes that run on from the bytes before them or into those after them in the
        /// object and on the device both (as the pieces of a packed block) join them.
        #[test]
        fn matches_a_flat_model(ops in proptest::collection::vec((any::<bool>(), 0u64..64, 1u64..24, 0u8..3), 1..40)) {
            const LEN: u64 = 96;
            let mut map = ExtentMap::new();
            let mut model: Vec<Option<u64>> = vec![None; LEN as usize];
            let mut next = 1u64 << 20;
            for (write, offset, len, place) in ops {
                let len = len.min(LEN - offset);
                if write {
                    let before = offset.checked_sub(1).and_then(|at| model[at as usize]);
                    let after = model.get((offset + len) as usize).copied().flatten();
                    let device = match (place, before, after) {
                        (1, Some(byte), _) => byte + 1,
                        (2, _, Some(byte)) if byte >= len => byte - len,
                        _ => {
                            next += 1000;
                            next
                        }
                    };
                    map.insert(offset, len, device);
                    for i in 0..len {
                        model[(offset + i) as usize] = Some(device + i);
                    }
                } else {
                    map.remove(offset, len);
                    for i in 0..len {
                        model[(offset + i) as usize] = None;
                    }
                }
                prop_assert_eq!(map.check_invariants(), Ok(()));
                prop_assert_eq!(map.mapped_bytes(), model.iter().filter(|b| b.is_some()).count() as u64);
            }
            prop_assert_eq!(resolve(&map, LEN), model.clone());
            prop_assert_eq!(map.mapped_bytes(), model.iter().filter(|b| b.is_some()).count() as u64);
            // As few extents as the mapping allows: one per run of bytes that follow each
            // other in the object and on the device.
            let runs = (0..LEN as usize)
                .filter(|&at| {
                    model[at].is_some()
                        && (at == 0 || model[at - 1].is_none() || model[at - 1].map(|b| b + 1) != model[at])
                })
                .count();
            prop_assert_eq!(map.len(), runs);
        }

        /// The counts kept as extents change (of blocks, 512-byte sectors at most a few
        /// blocks apart on the device) agree with a count over all extents.
        #[test]
        fn block_counts_agree_with_a_recount(ops in proptest::collection::vec((0u8..3, 0u64..64, 1u64..24, 0u64..48), 1..60)) {
            let mut map = ExtentMap::new();
            for (op, sector, sectors, device) in ops {
                let (offset, len, device) = (sector * 512, sectors * 512, (1 << 20) + device * 512);
                match op {
                    0 => map.insert(offset, len, device),
                    1 => map.remove(offset, len),
                    _ => {
                        map.relocate(offset, len, device, device + (1 << 16));
                    }
                }
                prop_assert_eq!(map.check_invariants(), Ok(()));
            }
        }

        /// Lookups of any sub-range agree with the whole-object lookup.
        #[test]
        fn sub_range_lookups_agree(ops in proptest::collection::vec((0u64..64, 1u64..24), 1..20), from in 0u64..96, len in 0u64..96) {
            let mut map = ExtentMap::new();
            for (n, (offset, size)) in ops.into_iter().enumerate() {
                map.insert(offset, size, 10_000 * (n as u64 + 1));
            }
            let len = len.min(96 - from);
            let whole = resolve(&map, 96);
            let mut part = Vec::new();
            for piece in map.lookup(from, len) {
                match piece {
                    Piece::Mapped { len_bytes, device_offset_bytes, .. } => part.extend((0..len_bytes).map(|i| Some(device_offset_bytes + i))),
                    Piece::Hole { len_bytes, .. } => part.extend((0..len_bytes).map(|_| None)),
                }
            }
            prop_assert_eq!(&part[..], &whole[from as usize..(from + len) as usize]);
        }
    }
}
