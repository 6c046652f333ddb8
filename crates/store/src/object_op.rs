//! What a PG's log entries do to its objects, and the PG's object index.
//!
//! A client write becomes one raft entry whose data is `[kind][meta (24 bytes)][payload]`;
//! in the OSD's log the same entry is stored as a batch entry with that kind and meta and
//! the payload as its (block-aligned) data. Applying the committed entry points the object's
//! extent map at that payload, where it already lies: the data is written once.
//!
//! Meta layout (little-endian): image id u64, object number u64, offset in object u32,
//! length u32.

use std::collections::HashMap;
use std::sync::Arc;

use basalt_common::{ImageId, ObjectKey};

use crate::batch::{BLOCK_SIZE, META_SIZE, blocks_touched};
use crate::extent_map::{ExtentMap, Piece};

/// Entry kinds in the log; values are part of the on-disk format.
pub mod kind {
    /// A raft entry with no object operation (an election's no-op, a configuration change).
    pub const RAFT_OTHER: u8 = 1;
    /// Write the payload at an object's offset.
    pub const WRITE: u8 = 2;
    /// Make a range of an object read as zeroes, freeing its space.
    pub const DISCARD: u8 = 3;
    /// A write whose payload lies on the device: how a durable write's raft entry is kept
    /// in memory (never written to the log or sent).
    pub const WRITE_REF: u8 = 4;
    /// Not a log entry's kind but the one byte of a scrub marker's raft entry data (each
    /// replica digests its PG's data as of it; the log stores it as a `RAFT_OTHER` entry
    /// holding that byte). Distinct from every log kind all the same (the OSD's start at 5).
    pub const SCRUB: u8 = 0x53;
    /// Not a log entry's kind but the first byte of a map floor's raft entry data (then a
    /// map epoch, u64): the leader took the requests after it under that map or a newer
    /// one, and a later leader takes none under an older map (stored as a `RAFT_OTHER`
    /// entry, like a scrub marker).
    pub const MAP_FLOOR: u8 = 0x46;
}

/// A durable write as kept in memory: the write's header and where its payload lies on the
/// device. Raft entry data: kind `WRITE_REF`, the write's meta, the device offset (u64).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadRef {
    /// The object.
    pub object: ObjectKey,
    /// Offset in the object.
    pub offset_bytes: u32,
    /// Length of the payload.
    pub len_bytes: u32,
    /// Where the payload lies on the device.
    pub device_offset_bytes: u64,
}

impl PayloadRef {
    /// Bytes of the log blocks the payload keeps in use (a 512-byte write keeps one).
    pub fn occupied_bytes(&self) -> u64 {
        let touched = blocks_touched(self.device_offset_bytes, u64::from(self.len_bytes));
        (touched.end - touched.start) * BLOCK_SIZE as u64
    }

    /// The reference for a write's meta (as the log stores it) and payload location.
    pub fn from_meta(meta: &[u8; META_SIZE], device_offset_bytes: u64) -> Self {
        let u64_at = |at: usize| u64::from_le_bytes(meta[at..at + 8].try_into().expect("8 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(meta[at..at + 4].try_into().expect("4 bytes"));
        Self {
            object: ObjectKey {
                image: ImageId(u64_at(0)),
                number: u64_at(8),
            },
            offset_bytes: u32_at(16),
            len_bytes: u32_at(20),
            device_offset_bytes,
        }
    }

    /// The meta of the write it stands for, as the log stores it (the inverse of
    /// [`PayloadRef::from_meta`]).
    pub fn meta(&self) -> [u8; META_SIZE] {
        let mut meta = [0u8; META_SIZE];
        meta[0..8].copy_from_slice(&self.object.image.0.to_le_bytes());
        meta[8..16].copy_from_slice(&self.object.number.to_le_bytes());
        meta[16..20].copy_from_slice(&self.offset_bytes.to_le_bytes());
        meta[20..24].copy_from_slice(&self.len_bytes.to_le_bytes());
        meta
    }

    /// The raft entry data.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(1 + META_SIZE + 8);
        bytes.push(kind::WRITE_REF);
        bytes.extend_from_slice(&self.meta());
        bytes.extend_from_slice(&self.device_offset_bytes.to_le_bytes());
        bytes
    }

    /// The reference for a write's raft entry data (an encoded [`ObjectOp::Write`]) whose
    /// payload lies at `device_offset_bytes`, read from its header alone; `None` if the data
    /// is not a write.
    pub fn of_write(data: &[u8], device_offset_bytes: u64) -> Option<Self> {
        let (&kind, rest) = data.split_first()?;
        let meta: &[u8; META_SIZE] = rest.get(..META_SIZE)?.try_into().ok()?;
        let reference = Self::from_meta(meta, device_offset_bytes);
        (kind == kind::WRITE && rest.len() - META_SIZE == reference.len_bytes as usize)
            .then_some(reference)
    }

    /// Decodes raft entry data; `None` if it is not a reference.
    pub fn decode(bytes: &[u8]) -> Option<Self> {
        if bytes.len() != 1 + META_SIZE + 8 || bytes[0] != kind::WRITE_REF {
            return None;
        }
        let meta: &[u8; META_SIZE] = bytes[1..1 + META_SIZE].try_into().ok()?;
        let offset = u64::from_le_bytes(bytes[1 + META_SIZE..].try_into().ok()?);
        Some(Self::from_meta(meta, offset))
    }

    /// The write it stands for, with its payload read back.
    pub fn with_payload(&self, data: Vec<u8>) -> ObjectOp {
        ObjectOp::Write {
            object: self.object,
            offset_bytes: self.offset_bytes,
            data,
        }
    }
}

/// An operation on an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ObjectOp {
    /// Write `data` at `offset_bytes`.
    Write {
        /// The object.
        object: ObjectKey,
        /// Offset in the object.
        offset_bytes: u32,
        /// The bytes.
        data: Vec<u8>,
    },
    /// Zero (and free) `len_bytes` at `offset_bytes`.
    Discard {
        /// The object.
        object: ObjectKey,
        /// Offset in the object.
        offset_bytes: u32,
        /// Length.
        len_bytes: u32,
    },
}

/// Why entry data is not an object operation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ObjectOpError {
    /// Shorter than kind and meta.
    #[error("object operation of {len} bytes is shorter than its header")]
    Short {
        /// Bytes given.
        len: usize,
    },
    /// A kind that is not an object operation.
    #[error("entry kind {kind} is not an object operation")]
    Kind {
        /// The kind.
        kind: u8,
    },
    /// The length field disagrees with the payload.
    #[error("write says {stated} bytes, carries {carried}")]
    Length {
        /// The length in the meta.
        stated: u32,
        /// The payload's length.
        carried: usize,
    },
}

impl ObjectOp {
    /// The entry kind.
    pub fn kind(&self) -> u8 {
        match self {
            ObjectOp::Write { .. } => kind::WRITE,
            ObjectOp::Discard { .. } => kind::DISCARD,
        }
    }

    /// The meta bytes of the log entry.
    pub fn meta(&self) -> [u8; META_SIZE] {
        let (object, offset, len) = match self {
            ObjectOp::Write {
                object,
                offset_bytes,
                data,
            } => (
                object,
                *offset_bytes,
                u32::try_from(data.len()).expect("writes are at most 4 MiB"),
            ),
            ObjectOp::Discard {
                object,
                offset_bytes,
                len_bytes,
            } => (object, *offset_bytes, *len_bytes),
        };
        // A write's and a discard's meta are laid out as a payload reference's.
        PayloadRef {
            object: *object,
            offset_bytes: offset,
            len_bytes: len,
            device_offset_bytes: 0,
        }
        .meta()
    }

    /// The payload stored as the log entry's data.
    pub fn payload(&self) -> &[u8] {
        match self {
            ObjectOp::Write { data, .. } => data,
            ObjectOp::Discard { .. } => &[],
        }
    }

    /// The raft entry data: kind, meta, payload.
    pub fn encode(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(1 + META_SIZE + self.payload().len());
        bytes.push(self.kind());
        bytes.extend_from_slice(&self.meta());
        bytes.extend_from_slice(self.payload());
        bytes
    }

    /// Decodes raft entry data.
    pub fn decode(bytes: &[u8]) -> Result<Self, ObjectOpError> {
        let (&kind, rest) = bytes.split_first().ok_or(ObjectOpError::Short { len: 0 })?;
        let (meta, payload) = rest
            .split_at_checked(META_SIZE)
            .ok_or(ObjectOpError::Short { len: bytes.len() })?;
        let meta: &[u8; META_SIZE] = meta.try_into().expect("split at META_SIZE");
        Self::from_parts(kind, meta, payload)
    }

    /// Rebuilds an operation from a log entry's kind, meta and data (replay).
    pub fn from_parts(
        kind: u8,
        meta: &[u8; META_SIZE],
        payload: &[u8],
    ) -> Result<Self, ObjectOpError> {
        let u64_at = |at: usize| u64::from_le_bytes(meta[at..at + 8].try_into().expect("8 bytes"));
        let u32_at = |at: usize| u32::from_le_bytes(meta[at..at + 4].try_into().expect("4 bytes"));
        let object = ObjectKey {
            image: ImageId(u64_at(0)),
            number: u64_at(8),
        };
        let (offset_bytes, len_bytes) = (u32_at(16), u32_at(20));
        match kind {
            kind::WRITE if len_bytes as usize == payload.len() => Ok(ObjectOp::Write {
                object,
                offset_bytes,
                data: payload.to_vec(),
            }),
            kind::WRITE => Err(ObjectOpError::Length {
                stated: len_bytes,
                carried: payload.len(),
            }),
            // Decoding is canonical (encode gives back the same bytes): a discard carries
            // no payload, so bytes after its header mean these are not a discard.
            kind::DISCARD if payload.is_empty() => Ok(ObjectOp::Discard {
                object,
                offset_bytes,
                len_bytes,
            }),
            kind::DISCARD => Err(ObjectOpError::Length {
                stated: 0,
                carried: payload.len(),
            }),
            kind => Err(ObjectOpError::Kind { kind }),
        }
    }
}

/// The objects of one PG replica: where each object's bytes are in the log.
///
/// A clone is cheap, a pointer per object: each object's extents are shared until one of
/// the two copies changes them, when that copy takes the object's own. So a checkpoint can
/// take the index as of its cut on the OSD's loop and encode it elsewhere, however large.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PgObjects {
    objects: HashMap<ObjectKey, Arc<ExtentMap>>,
}

impl PgObjects {
    /// No object written.
    pub fn new() -> Self {
        Self::default()
    }

    /// Applies a committed operation; for a write, `payload_offset_bytes` is where its
    /// payload lies on the device (from the log).
    pub fn apply(&mut self, op: &ObjectOp, payload_offset_bytes: u64) {
        match op {
            ObjectOp::Write {
                object,
                offset_bytes,
                data,
            } => {
                let map = Arc::make_mut(self.objects.entry(*object).or_default());
                map.insert(
                    u64::from(*offset_bytes),
                    data.len() as u64,
                    payload_offset_bytes,
                );
            }
            ObjectOp::Discard {
                object,
                offset_bytes,
                len_bytes,
            } => {
                let (offset, len) = (u64::from(*offset_bytes), u64::from(*len_bytes));
                let maps_any = |map: &ExtentMap| {
                    map.lookup(offset, len)
                        .iter()
                        .any(|piece| matches!(piece, Piece::Mapped { .. }))
                };
                let emptied = self.changing(object, maps_any).map(|map| {
                    map.remove(offset, len);
                    map.is_empty()
                });
                if emptied == Some(true) {
                    self.objects.remove(object);
                }
            }
        }
    }

    /// Where the bytes of a range of an object are: pieces in the log, and holes (zeroes).
    pub fn plan_read(&self, object: ObjectKey, offset_bytes: u64, len_bytes: u64) -> Vec<Piece> {
        match self.objects.get(&object) {
            Some(map) => map.lookup(offset_bytes, len_bytes),
            None if len_bytes == 0 => Vec::new(),
            None => vec![Piece::Hole {
                offset_bytes,
                len_bytes,
            }],
        }
    }

    /// Whether reading `len_bytes` of `object` from `offset_bytes` reads the log block that
    /// holds `device_offset_bytes`.
    pub fn reads_block(
        &self,
        object: ObjectKey,
        (offset_bytes, len_bytes): (u64, u64),
        device_offset_bytes: u64,
    ) -> bool {
        let block = BLOCK_SIZE as u64;
        let wanted = device_offset_bytes / block;
        self.plan_read(object, offset_bytes, len_bytes)
            .iter()
            .any(|piece| match *piece {
                Piece::Mapped {
                    len_bytes,
                    device_offset_bytes,
                    ..
                } => blocks_touched(device_offset_bytes, len_bytes).contains(&wanted),
                Piece::Hole { .. } => false,
            })
    }

    /// The extents of `object`, to change: in place if this index alone holds them; if a
    /// clone shares them (a checkpoint being encoded), copied, but only if `touched` says
    /// the change touches them.
    fn changing(
        &mut self,
        object: &ObjectKey,
        touched: impl FnOnce(&ExtentMap) -> bool,
    ) -> Option<&mut ExtentMap> {
        let map = self.objects.get_mut(object)?;
        if Arc::get_mut(map).is_none() && !touched(map) {
            return None;
        }
        Some(Arc::make_mut(map))
    }

    /// Applies a durable write known by reference.
    pub fn apply_ref(&mut self, write: &PayloadRef) {
        Arc::make_mut(self.objects.entry(write.object).or_default()).insert(
            u64::from(write.offset_bytes),
            u64::from(write.len_bytes),
            write.device_offset_bytes,
        );
    }

    /// Objects with any byte mapped.
    pub fn object_count(&self) -> usize {
        self.objects.len()
    }

    /// What the objects' index takes in a checkpoint at most: 20 bytes an object, 24 an
    /// extent, and the checksums of the blocks they refer to (4 bytes a block, and 12 a run
    /// of blocks: one run an extent at most, unless blocks of unknown checksum or poisoned
    /// ones break an extent's run, 12 bytes more each, which only damage makes).
    pub fn checkpoint_bytes(&self) -> u64 {
        self.objects
            .values()
            .map(|map| 20 + 36 * map.len() as u64 + map.occupied_bytes() / BLOCK_SIZE as u64 * 4)
            .sum()
    }

    /// Extents in all objects.
    pub fn extent_count(&self) -> usize {
        self.objects.values().map(|map| map.len()).sum()
    }

    /// The objects with any byte mapped, in key order.
    pub fn keys(&self) -> Vec<ObjectKey> {
        let mut keys: Vec<ObjectKey> = self.objects.keys().copied().collect();
        keys.sort_unstable();
        keys
    }

    /// The numbers of `image`'s objects with any byte mapped, from object `from` on, in
    /// order: at most `max` of them.
    pub fn numbers(&self, image: ImageId, from: u64, max: usize) -> Vec<u64> {
        let mut numbers: Vec<u64> = self
            .objects
            .keys()
            .filter(|key| key.image == image && key.number >= from)
            .map(|key| key.number)
            .collect();
        if numbers.len() > max {
            numbers.select_nth_unstable(max);
            numbers.truncate(max);
        }
        numbers.sort_unstable();
        numbers
    }

    /// The extents of an object, in order: (offset, length, device offset).
    pub fn extents(&self, object: ObjectKey) -> Vec<(u64, u64, u64)> {
        self.objects
            .get(&object)
            .map(|map| map.extents().collect())
            .unwrap_or_default()
    }

    /// Maps a range of an object to the device, as a checkpoint recorded it.
    pub fn insert_extent(
        &mut self,
        object: ObjectKey,
        offset_bytes: u64,
        len_bytes: u64,
        device_offset_bytes: u64,
    ) {
        Arc::make_mut(self.objects.entry(object).or_default()).insert(
            offset_bytes,
            len_bytes,
            device_offset_bytes,
        );
    }

    /// Bytes of a write's range that still read its payload at `device_offset_bytes`.
    pub fn live_bytes(&self, write: &PayloadRef) -> u64 {
        self.objects.get(&write.object).map_or(0, |map| {
            map.live_bytes(
                u64::from(write.offset_bytes),
                u64::from(write.len_bytes),
                write.device_offset_bytes,
            )
        })
    }

    /// The parts of a write's range that still read its payload, in order, each as the
    /// reference of that part alone (its offset in the object and on the device).
    pub fn live_extents(&self, write: &PayloadRef) -> Vec<PayloadRef> {
        let Some(map) = self.objects.get(&write.object) else {
            return Vec::new();
        };
        let (offset, device) = (u64::from(write.offset_bytes), write.device_offset_bytes);
        map.live_pieces(offset, u64::from(write.len_bytes), device)
            .map(|(at, len)| PayloadRef {
                object: write.object,
                offset_bytes: at as u32,
                len_bytes: len as u32,
                device_offset_bytes: device + (at - offset),
            })
            .collect()
    }

    /// Moves the parts of a write's range that still read its payload at
    /// `write.device_offset_bytes` to `new_device_offset_bytes` (a compare-and-swap: parts
    /// overwritten or discarded since are left alone). Returns the bytes moved.
    pub fn relocate(&mut self, write: &PayloadRef, new_device_offset_bytes: u64) -> u64 {
        let (offset, len) = (u64::from(write.offset_bytes), u64::from(write.len_bytes));
        let old = write.device_offset_bytes;
        self.changing(&write.object, |map| map.live_bytes(offset, len, old) > 0)
            .map_or(0, |map| {
                map.relocate(offset, len, old, new_device_offset_bytes)
            })
    }

    /// Bytes mapped in all objects.
    pub fn mapped_bytes(&self) -> u64 {
        self.objects.values().map(|map| map.mapped_bytes()).sum()
    }

    /// Bytes of the log blocks all objects' data touches ([`ExtentMap::occupied_bytes`]).
    pub fn occupied_bytes(&self) -> u64 {
        self.objects.values().map(|map| map.occupied_bytes()).sum()
    }

    /// Bytes of log blocks that packing each object's blocks into one block of the log
    /// would free (for each object, what its data occupies beyond
    /// [`ExtentMap::packed_bytes`]).
    pub fn packable_bytes(&self) -> u64 {
        self.objects
            .values()
            .map(|map| map.occupied_bytes().saturating_sub(map.packed_bytes()))
            .sum()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(number: u64) -> ObjectKey {
        ObjectKey {
            image: ImageId(7),
            number,
        }
    }

    proptest! {
        #[test]
        fn ops_round_trip(image: u64, number: u64, offset: u32, data in proptest::collection::vec(any::<u8>(), 0..300), len: u32, write: bool) {
            let object = ObjectKey { image: ImageId(image), number };
            let op = if write {
                ObjectOp::Write { object, offset_bytes: offset, data }
            } else {
                ObjectOp::Discard { object, offset_bytes: offset, len_bytes: len }
            };
            prop_assert_eq!(ObjectOp::decode(&op.encode()), Ok(op.clone()));
            prop_assert_eq!(ObjectOp::from_parts(op.kind(), &op.meta(), op.payload()), Ok(op));
        }

        /// Whatever decodes, encodes back to the same bytes: the OSD stores decoded
        /// operations in its log and rebuilds raft entries from them.
        #[test]
        fn decoding_is_canonical(bytes in proptest::collection::vec(any::<u8>(), 0..64), kind_byte in 2u8..4) {
            let mut bytes = bytes;
            if let Some(first) = bytes.first_mut() {
                *first = kind_byte;
            }
            if let Ok(op) = ObjectOp::decode(&bytes) {
                prop_assert_eq!(op.encode(), bytes);
            }
        }

        /// Applying writes and discards, then reading, matches a model of each object's
        /// bytes (a write's payload lies at its device offset; we model the device too).
        #[test]
        fn reads_see_the_last_write_or_zeroes(ops in proptest::collection::vec((0u64..3, 0u32..64, 1u32..32, any::<bool>()), 1..40)) {
            let mut objects = PgObjects::new();
            let mut device: Vec<u8> = Vec::new();
            let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
            for (n, (number, offset, len, write)) in ops.into_iter().enumerate() {
                let bytes = model.entry(number).or_insert_with(|| vec![0; 96]);
                let range = offset as usize..(offset + len) as usize;
                if write {
                    let data = vec![(n % 250) as u8 + 1; len as usize];
                    let at = device.len() as u64;
                    device.extend_from_slice(&data);
                    bytes[range].copy_from_slice(&data);
                    objects.apply(&ObjectOp::Write { object: key(number), offset_bytes: offset, data }, at);
                } else {
                    bytes[range].fill(0);
                    objects.apply(&ObjectOp::Discard { object: key(number), offset_bytes: offset, len_bytes: len }, 0);
                }
            }
            for (number, expected) in &model {
                let mut read = Vec::new();
                for piece in objects.plan_read(key(*number), 0, 96) {
                    match piece {
                        Piece::Mapped { len_bytes, device_offset_bytes, .. } => {
                            let at = device_offset_bytes as usize;
                            read.extend_from_slice(&device[at..at + len_bytes as usize]);
                        }
                        Piece::Hole { len_bytes, .. } => read.extend(std::iter::repeat_n(0, len_bytes as usize)),
                    }
                }
                prop_assert_eq!(&read, expected);
            }
        }
    }

    proptest! {
        /// The cleaner's moves never change what a read returns: a write's payload is copied
        /// to a new place and the index is moved there by compare-and-swap, whatever writes
        /// and discards came after it; and once every write is moved, nothing reads the old
        /// copies (they can be overwritten).
        #[test]
        fn relocations_never_change_what_reads_return(
            ops in proptest::collection::vec((0u64..2, 0u32..64, 1u32..32, 0u8..3, any::<prop::sample::Index>()), 1..40),
        ) {
            let mut objects = PgObjects::new();
            let mut device: Vec<u8> = Vec::new();
            let mut writes: Vec<PayloadRef> = Vec::new();
            let read_all = |objects: &PgObjects, device: &[u8]| -> Vec<Vec<u8>> {
                (0..2).map(|number| {
                    let mut read = Vec::new();
                    for piece in objects.plan_read(key(number), 0, 96) {
                        match piece {
                            Piece::Mapped { len_bytes, device_offset_bytes, .. } => {
                                let at = device_offset_bytes as usize;
                                read.extend_from_slice(&device[at..at + len_bytes as usize]);
                            }
                            Piece::Hole { len_bytes, .. } => read.extend(std::iter::repeat_n(0, len_bytes as usize)),
                        }
                    }
                    read
                }).collect()
            };
            for (n, (number, offset, len, op, pick)) in ops.into_iter().enumerate() {
                let before = read_all(&objects, &device);
                match op {
                    0 => {
                        let data = vec![(n % 250) as u8 + 1; len as usize];
                        let at = device.len() as u64;
                        device.extend_from_slice(&data);
                        let write = ObjectOp::Write { object: key(number), offset_bytes: offset, data };
                        objects.apply(&write, at);
                        writes.push(PayloadRef::from_meta(&write.meta(), at));
                        continue;
                    }
                    1 => {
                        objects.apply(&ObjectOp::Discard { object: key(number), offset_bytes: offset, len_bytes: len }, 0);
                        continue;
                    }
                    _ if writes.is_empty() => continue,
                    _ => {
                        let at = pick.index(writes.len());
                        let old = writes[at];
                        let from = old.device_offset_bytes as usize;
                        let copy = device[from..from + old.len_bytes as usize].to_vec();
                        let new_at = device.len() as u64;
                        device.extend_from_slice(&copy);
                        let live = objects.live_bytes(&old);
                        prop_assert_eq!(objects.relocate(&old, new_at), live);
                        prop_assert_eq!(objects.live_bytes(&old), 0);
                        writes[at].device_offset_bytes = new_at;
                    }
                }
                prop_assert_eq!(read_all(&objects, &device), before);
            }
            // Destroy every payload's first copy: reads still see the same bytes only if
            // nothing points at an old place any more.
            let expected = read_all(&objects, &device);
            let moved: Vec<PayloadRef> = writes.clone();
            for write in moved {
                let copy_at = device.len() as u64;
                let from = write.device_offset_bytes as usize;
                let copy = device[from..from + write.len_bytes as usize].to_vec();
                device.extend_from_slice(&copy);
                objects.relocate(&write, copy_at);
                device[from..from + write.len_bytes as usize].fill(0xEE);
            }
            prop_assert_eq!(read_all(&objects, &device), expected);
        }
    }

    #[test]
    fn payload_references_round_trip_and_are_not_operations() {
        let write = ObjectOp::Write {
            object: key(9),
            offset_bytes: 4096,
            data: vec![7; 512],
        };
        let reference = PayloadRef::from_meta(&write.meta(), 1 << 20);
        assert_eq!(reference.len_bytes, 512);
        let bytes = reference.encode();
        assert_eq!(PayloadRef::decode(&bytes), Some(reference));
        assert!(
            ObjectOp::decode(&bytes).is_err(),
            "a reference is not an operation"
        );
        assert_eq!(PayloadRef::decode(&write.encode()), None);
        assert_eq!(
            PayloadRef::of_write(&write.encode(), 1 << 20),
            Some(reference)
        );
        assert_eq!(PayloadRef::of_write(&bytes, 1 << 20), None, "not a write");
        assert_eq!(reference.with_payload(vec![7; 512]), write);
        let mut objects = PgObjects::new();
        objects.apply_ref(&reference);
        assert_eq!(
            objects.plan_read(key(9), 4096, 512),
            vec![Piece::Mapped {
                offset_bytes: 4096,
                len_bytes: 512,
                device_offset_bytes: 1 << 20
            }]
        );
    }

    #[test]
    fn bad_entries_are_refused() {
        assert_eq!(ObjectOp::decode(&[]), Err(ObjectOpError::Short { len: 0 }));
        assert_eq!(
            ObjectOp::decode(&[kind::WRITE, 1, 2]),
            Err(ObjectOpError::Short { len: 3 })
        );
        let mut bytes = ObjectOp::Write {
            object: key(1),
            offset_bytes: 0,
            data: vec![1; 10],
        }
        .encode();
        bytes.pop();
        assert_eq!(
            ObjectOp::decode(&bytes),
            Err(ObjectOpError::Length {
                stated: 10,
                carried: 9
            })
        );
        bytes[0] = kind::RAFT_OTHER;
        assert_eq!(
            ObjectOp::decode(&bytes),
            Err(ObjectOpError::Kind {
                kind: kind::RAFT_OTHER
            })
        );
    }

    #[test]
    fn an_untouched_object_reads_as_one_hole() {
        let objects = PgObjects::new();
        assert_eq!(
            objects.plan_read(key(1), 4096, 8192),
            vec![Piece::Hole {
                offset_bytes: 4096,
                len_bytes: 8192
            }]
        );
        assert_eq!(objects.object_count(), 0);
    }

    /// An image's objects are listed while any byte of them is mapped, those of other
    /// images never, in order from the one asked for, at most as many as asked.
    #[test]
    fn an_images_objects_are_listed_while_they_hold_data() {
        let mut objects = PgObjects::new();
        let other = ObjectKey {
            image: ImageId(8),
            number: 5,
        };
        for object in [key(9), key(2), key(5), other] {
            let data = vec![1; 4096];
            let write = ObjectOp::Write {
                object,
                offset_bytes: 0,
                data,
            };
            objects.apply(&write, 1 << 20);
        }
        assert_eq!(objects.numbers(ImageId(7), 0, 10), vec![2, 5, 9]);
        assert_eq!(objects.numbers(ImageId(7), 3, 10), vec![5, 9]);
        assert_eq!(objects.numbers(ImageId(7), 0, 2), vec![2, 5]);
        let discard = |len_bytes| ObjectOp::Discard {
            object: key(5),
            offset_bytes: 0,
            len_bytes,
        };
        objects.apply(&discard(1024), 0);
        assert_eq!(
            objects.numbers(ImageId(7), 3, 10),
            vec![5, 9],
            "partly mapped"
        );
        objects.apply(&discard(4096), 0);
        assert_eq!(objects.numbers(ImageId(7), 3, 10), vec![9], "emptied");
        assert_eq!(objects.numbers(ImageId(8), 0, 10), vec![5]);
    }

    /// A range reads the blocks its mapped pieces lie in, and no other: not those of the
    /// bytes overwritten since, nor any of a hole.
    #[test]
    fn a_range_reads_the_blocks_of_its_pieces() {
        let mut objects = PgObjects::new();
        let write = |offset: u32, len: u32, device: u64| PayloadRef {
            object: key(1),
            offset_bytes: offset,
            len_bytes: len,
            device_offset_bytes: device,
        };
        // 8 KiB at device 1 MiB, then its second half overwritten from device 2 MiB.
        objects.apply_ref(&write(0, 8192, 1 << 20));
        objects.apply_ref(&write(4096, 4096, 2 << 20));
        let reads = |range, device| objects.reads_block(key(1), range, device);
        assert!(reads((0, 8192), (1 << 20) + 100));
        assert!(!reads((0, 8192), (1 << 20) + 4096), "overwritten");
        assert!(reads((0, 8192), 2 << 20));
        assert!(!reads((0, 4096), 2 << 20), "outside the range");
        assert!(!reads((8192, 4096), 1 << 20), "a hole");
        assert!(
            !objects.reads_block(key(2), (0, 8192), 1 << 20),
            "another object"
        );
    }
}
