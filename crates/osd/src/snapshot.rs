//! PG snapshots: how a replica that needs entries its leader compacted away gets the PG's
//! objects (design: `docs/internals/store.md`, *PG snapshots*).
//!
//! Raft's snapshot message carries metadata only: the leader's compaction point A (index,
//! term). The follower does not hand it to raft at once. It pulls the PG's objects from the
//! leader in chunks ([`Message::SnapshotRead`](basalt_wire::Message::SnapshotRead), answered
//! with an encoded [`Chunk`]), writes each to its own log as `SNAPSHOT_WRITE` entries (the
//! first chunk after a `SNAPSHOT_BEGIN`) and maps them in an object index kept aside. When
//! the last chunk is durable it steps the message into raft; raft resets the PG's log to A,
//! and the persist that records that (`SNAPSHOT_INSTALLED`) swaps the aside index in.
//!
//! The copy is fuzzy: the leader goes on applying writes while it is read, so each object is
//! as of some index at or after A. Raft then applies the entries after A, which makes it
//! exact: a write or discard sets its range whatever it held, so applying it again over a
//! newer copy leaves what it left the first time, and every later entry follows.
//!
//! A crash before `SNAPSHOT_INSTALLED` leaves the old index and raft log in force (replay
//! drops an aside index that was not installed). No checkpoint is cut and the cleaner does
//! not run while a snapshot is being installed, so replay always sees a transfer whole.

use basalt_common::{ImageId, ObjectKey, PgId};
use basalt_store::batch::{Entry, META_SIZE};
use basalt_store::object_op::{ObjectOp, PgObjects};

/// Kind of a log entry that starts a snapshot's transfer: the PG's aside index is emptied.
pub const SNAPSHOT_BEGIN: u8 = 17;
/// Kind of a log entry carrying a snapshot's object data (meta as a write's).
pub const SNAPSHOT_WRITE: u8 = 18;
/// Kind of a log entry recording that a snapshot was installed: meta holds its raft index
/// and term (u64 each); the aside index becomes the PG's.
pub const SNAPSHOT_INSTALLED: u8 = 19;

/// Bytes of object data a chunk carries at most (it travels in one frame).
pub const CHUNK_BYTES: u32 = 2 << 20;

/// The longest run of object data in a chunk: longer ones are split, so that each fits a
/// log entry and a chunk.
pub const RUN_BYTES_MAX: u64 = 1 << 20;

/// Bytes a run adds to a chunk besides its data (offset, length).
const RUN_HEADER_BYTES: u64 = 8;
/// Bytes an object adds to a chunk besides its runs (key, run count).
const OBJECT_HEADER_BYTES: u64 = 20;

/// Where a transfer goes on: an object, and an offset in it.
pub type Cursor = (ObjectKey, u32);

/// An object's data in a chunk: (offset in the object, bytes) runs, in order.
pub type ObjectRuns = (ObjectKey, Vec<(u32, Vec<u8>)>);

/// What to read of an object for a chunk: (offset, length) runs, in order.
pub type PlannedRuns = (ObjectKey, Vec<(u64, u64)>);

/// Some of a PG's object data, in key and offset order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Chunk {
    /// Objects and their data: (offset in the object, bytes) runs, in order; what no run
    /// covers reads as zeroes.
    pub objects: Vec<ObjectRuns>,
    /// Where the next chunk starts; `None`: this was the last.
    pub next: Option<Cursor>,
    /// The leader's applied index when it read the chunk: the installed objects may hold
    /// writes up to there, so they are the PG's state at no single entry before it (a
    /// scrub marker up to there is not digested).
    pub applied: u64,
    /// The PG's map floor at the leader (`Core::map_floors`): the entries the snapshot
    /// stands for were taken under that map or older ones.
    pub map_floor: u64,
}

/// Why bytes are not a chunk.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("malformed snapshot chunk: {0}")]
pub struct ChunkError(&'static str);

impl Chunk {
    /// The encoding: object count u32; per object: image u64, number u64, run count u32;
    /// per run: offset u32, length u32, bytes; then 0, or 1 and the next cursor (image u64,
    /// number u64, offset u32); then the leader's applied index u64 and the PG's map floor
    /// u64 (absent from an older leader's chunks: 0).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        let count = |n: usize| u32::try_from(n).expect("chunks are bounded").to_le_bytes();
        let put_key = |out: &mut Vec<u8>, key: &ObjectKey| {
            out.extend_from_slice(&key.image.0.to_le_bytes());
            out.extend_from_slice(&key.number.to_le_bytes());
        };
        out.extend_from_slice(&count(self.objects.len()));
        for (key, runs) in &self.objects {
            put_key(&mut out, key);
            out.extend_from_slice(&count(runs.len()));
            for (offset, data) in runs {
                out.extend_from_slice(&offset.to_le_bytes());
                out.extend_from_slice(&count(data.len()));
                out.extend_from_slice(data);
            }
        }
        match &self.next {
            None => out.push(0),
            Some((key, offset)) => {
                out.push(1);
                put_key(&mut out, key);
                out.extend_from_slice(&offset.to_le_bytes());
            }
        }
        out.extend_from_slice(&self.applied.to_le_bytes());
        out.extend_from_slice(&self.map_floor.to_le_bytes());
        out
    }

    /// Decodes a chunk; anything short, long or inconsistent is an error.
    pub fn decode(bytes: &[u8]) -> Result<Self, ChunkError> {
        let mut rest = bytes;
        let mut take = |n: usize| -> Result<&[u8], ChunkError> {
            let (head, tail) = rest
                .split_at_checked(n)
                .ok_or(ChunkError("shorter than it says"))?;
            rest = tail;
            Ok(head)
        };
        let u32_of = |b: &[u8]| u32::from_le_bytes(b.try_into().expect("4 bytes"));
        let u64_of = |b: &[u8]| u64::from_le_bytes(b.try_into().expect("8 bytes"));
        let objects_count = u32_of(take(4)?) as usize;
        // Each object takes at least 20 bytes: refuse counts the bytes cannot hold.
        if objects_count > bytes.len() / 20 {
            return Err(ChunkError("more objects than bytes"));
        }
        let mut objects = Vec::with_capacity(objects_count);
        for _ in 0..objects_count {
            let key = ObjectKey {
                image: ImageId(u64_of(take(8)?)),
                number: u64_of(take(8)?),
            };
            let runs_count = u32_of(take(4)?) as usize;
            if runs_count > bytes.len() / 8 {
                return Err(ChunkError("more runs than bytes"));
            }
            let mut runs = Vec::with_capacity(runs_count);
            for _ in 0..runs_count {
                let offset = u32_of(take(4)?);
                let len = u32_of(take(4)?) as u64;
                if len == 0 || len > RUN_BYTES_MAX {
                    return Err(ChunkError("run length out of range"));
                }
                // No object is larger: a run past it would map bytes no image reads.
                if u64::from(offset) + len > basalt_mon::map::OBJECT_SIZE_MAX {
                    return Err(ChunkError("run past the largest object"));
                }
                runs.push((offset, take(len as usize)?.to_vec()));
            }
            objects.push((key, runs));
        }
        let next = match take(1)?[0] {
            0 => None,
            1 => {
                let key = ObjectKey {
                    image: ImageId(u64_of(take(8)?)),
                    number: u64_of(take(8)?),
                };
                Some((key, u32_of(take(4)?)))
            }
            _ => return Err(ChunkError("bad next flag")),
        };
        let applied = u64_of(take(8)?);
        // Short of 8 bytes (an older leader's chunk has none): 0, and any bytes left over
        // are refused below.
        let map_floor = take(8).map_or(0, u64_of);
        if !rest.is_empty() {
            return Err(ChunkError("trailing bytes"));
        }
        Ok(Self {
            objects,
            next,
            applied,
            map_floor,
        })
    }

    /// Bytes of object data.
    pub fn data_bytes(&self) -> u64 {
        self.objects
            .iter()
            .flat_map(|(_, runs)| runs)
            .map(|(_, data)| data.len() as u64)
            .sum()
    }
}

/// The log entries for a received chunk: its runs as `SNAPSHOT_WRITE` entries, after a
/// `SNAPSHOT_BEGIN` if it is the first.
pub fn chunk_entries(pg: PgId, chunk: Chunk, first: bool) -> Vec<Entry> {
    let local = |kind: u8, meta: [u8; META_SIZE], data: Vec<u8>| Entry {
        kind,
        pg,
        term: 0,
        index: 0,
        meta,
        data,
    };
    let mut entries = Vec::new();
    if first {
        entries.push(local(SNAPSHOT_BEGIN, [0; META_SIZE], Vec::new()));
    }
    for (object, runs) in chunk.objects {
        for (offset_bytes, data) in runs {
            let meta = ObjectOp::Write {
                object,
                offset_bytes,
                data: Vec::new(),
            }
            .meta();
            let mut meta = meta;
            // The write's meta, with the run's length.
            meta[20..24].copy_from_slice(
                &u32::try_from(data.len())
                    .expect("runs are at most 1 MiB")
                    .to_le_bytes(),
            );
            entries.push(local(SNAPSHOT_WRITE, meta, data));
        }
    }
    entries
}

/// The log entry that records a snapshot (raft index, term) installed, with the raft
/// configuration (encoded) as of it.
pub fn installed_entry(pg: PgId, index: u64, term: u64, conf: Vec<u8>) -> Entry {
    let mut meta = [0u8; META_SIZE];
    meta[0..8].copy_from_slice(&index.to_le_bytes());
    meta[8..16].copy_from_slice(&term.to_le_bytes());
    Entry {
        kind: SNAPSHOT_INSTALLED,
        pg,
        term,
        index: 0,
        meta,
        data: conf,
    }
}

/// What to read for the next chunk of `objects` from `from` on: runs of mapped bytes
/// (offset, length; contiguous extents merged, split at [`RUN_BYTES_MAX`]) of objects in key
/// order, at most `max_bytes` of them (at least one run), and where the chunk after starts
/// (`None`: nothing is left).
pub fn plan_chunk(
    objects: &PgObjects,
    from: Option<Cursor>,
    max_bytes: u64,
) -> (Vec<PlannedRuns>, Option<Cursor>) {
    let keys = objects.keys();
    let start = from.map_or(0, |(key, _)| keys.partition_point(|k| *k < key));
    let mut plan: Vec<PlannedRuns> = Vec::new();
    let mut bytes = 0u64;
    for key in &keys[start..] {
        let skip_below = match from {
            Some((from_key, offset)) if from_key == *key => u64::from(offset),
            _ => 0,
        };
        for (offset, len) in runs(objects, *key) {
            let end = offset + len;
            if end <= skip_below {
                continue;
            }
            let offset = offset.max(skip_below);
            let len = end - offset;
            // What the run costs in the chunk's encoding: its bytes, its offset and length,
            // and its object's header if it starts one.
            let new_object = plan.last().is_none_or(|(last, _)| last != key);
            let cost = len + RUN_HEADER_BYTES + if new_object { OBJECT_HEADER_BYTES } else { 0 };
            if bytes > 0 && bytes + cost > max_bytes {
                let at = u32::try_from(offset).expect("offsets in an object fit a u32");
                return (plan, Some((*key, at)));
            }
            bytes += cost;
            match plan.last_mut() {
                Some((last, object_runs)) if last == key => object_runs.push((offset, len)),
                _ => plan.push((*key, vec![(offset, len)])),
            }
        }
    }
    (plan, None)
}

/// An object's mapped bytes as runs: contiguous extents merged, runs split at
/// [`RUN_BYTES_MAX`].
fn runs(objects: &PgObjects, key: ObjectKey) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (mut offset, mut len, _) in objects.extents(key) {
        while len > 0 {
            match runs.last_mut() {
                Some((run_offset, run_len))
                    if *run_offset + *run_len == offset && *run_len < RUN_BYTES_MAX =>
                {
                    let take = len.min(RUN_BYTES_MAX - *run_len);
                    *run_len += take;
                    offset += take;
                    len -= take;
                }
                _ => {
                    let take = len.min(RUN_BYTES_MAX);
                    runs.push((offset, take));
                    offset += take;
                    len -= take;
                }
            }
        }
    }
    runs
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn key(number: u64) -> ObjectKey {
        ObjectKey {
            image: ImageId(3),
            number,
        }
    }

    proptest! {
        #[test]
        fn chunks_round_trip(
            objects in proptest::collection::vec(
                (any::<u64>(), proptest::collection::vec((0u32..(63 << 20), proptest::collection::vec(any::<u8>(), 1..40)), 0..4)),
                0..5,
            ),
            next in proptest::option::of((any::<u64>(), any::<u32>())),
            (applied, map_floor) in (any::<u64>(), any::<u64>()),
        ) {
            let chunk = Chunk {
                objects: objects.into_iter().map(|(number, runs)| (key(number), runs)).collect(),
                next: next.map(|(number, offset)| (key(number), offset)),
                applied,
                map_floor,
            };
            let bytes = chunk.encode();
            prop_assert_eq!(Chunk::decode(&bytes), Ok(chunk.clone()));
            // An older leader's chunk, without the floor: floor 0.
            let older = Chunk::decode(&bytes[..bytes.len() - 8]);
            prop_assert_eq!(older, Ok(Chunk { map_floor: 0, ..chunk }));
        }

        /// A run past the largest object an image may have is refused, however it fits
        /// in 32 bits.
        #[test]
        fn runs_past_the_largest_object_are_refused(offset in ((64u32 << 20) - 39)..=u32::MAX) {
            let chunk = Chunk {
                objects: vec![(key(1), vec![(offset, vec![7; 40])])],
                next: None,
                applied: 0,
                map_floor: 0,
            };
            prop_assert!(Chunk::decode(&chunk.encode()).is_err());
        }

        #[test]
        fn garbage_never_panics(bytes in proptest::collection::vec(any::<u8>(), 0..200)) {
            if let Ok(chunk) = Chunk::decode(&bytes) {
                // The same bytes, but for the floor an older leader leaves out.
                let encoded = chunk.encode();
                prop_assert!(encoded == bytes || (encoded[..encoded.len() - 8] == bytes[..] && chunk.map_floor == 0));
            }
        }

        /// Chunks planned one after another cover every mapped byte once, in order, each
        /// within the budget (or one run when a run is larger).
        #[test]
        fn planned_chunks_cover_every_mapped_byte(
            writes in proptest::collection::vec((0u64..12, 0u64..600, 1u64..400), 0..40),
            max_bytes in 4096u64..(3 << 20),
        ) {
            let mut objects = PgObjects::new();
            for (n, (number, block, blocks)) in writes.iter().enumerate() {
                objects.insert_extent(key(*number), block * 4096, blocks * 4096, (n as u64) << 32);
            }
            let mut from = None;
            let mut covered: Vec<(ObjectKey, u64, u64)> = Vec::new();
            loop {
                let (plan, next) = plan_chunk(&objects, from, max_bytes);
                let bytes: u64 = plan.iter().flat_map(|(_, runs)| runs).map(|(_, len)| len).sum();
                prop_assert!(bytes <= max_bytes.max(RUN_BYTES_MAX));
                for (key, runs) in plan {
                    for (offset, len) in runs {
                        prop_assert!(len <= RUN_BYTES_MAX);
                        if let Some((last_key, last_offset, last_len)) = covered.last().copied() {
                            prop_assert!((last_key, last_offset + last_len) <= (key, offset));
                        }
                        covered.push((key, offset, len));
                    }
                }
                match next {
                    None => break,
                    Some(cursor) => {
                        prop_assert!(bytes > 0);
                        from = Some(cursor);
                    }
                }
            }
            for key in objects.keys() {
                let mapped: u64 = objects.extents(key).iter().map(|(_, len, _)| len).sum();
                let sent: u64 = covered.iter().filter(|(k, _, _)| *k == key).map(|(_, _, len)| len).sum();
                prop_assert_eq!(sent, mapped);
            }
        }
    }
}
