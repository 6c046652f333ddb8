//! Reusing the log: what goes into a checkpoint, how far raft logs are compacted, and what
//! the cleaner moves out of the ring's tail (design: `docs/internals/store.md`, *The ring,
//! checkpoints and the cleaner*).
//!
//! The core calls these; they do no I/O. The order that makes freeing safe:
//!
//! 1. The cleaner reads the batches at the tail (below the durable end of the log) and
//!    relocates every payload that the object index still reads, or that a retained raft
//!    entry still refers to, with a `RELOCATE` entry appended at the head.
//! 2. Once those are durable, the index and the raft entries are moved to the new copies
//!    by compare-and-swap (a write that came in meanwhile wins).
//! 3. A checkpoint cut after that records the index, the raft state and, as its tail, the
//!    position the cleaner reached. Once it is durable, the ring before that tail is free.
//!
//! Replay skips `RELOCATE` entries: after a crash before step 3 the index of the older
//! checkpoint points at the old copies, which are still in place.

use std::collections::{HashMap, VecDeque};

use basalt_common::{ObjectKey, PgId};
use basalt_replication::{HardState, MultiRaft, PgStorage, RaftEntry, Restored};
use basalt_store::batch::BLOCK_SIZE;
use basalt_store::batch::{self, Entry};
use basalt_store::block_sums::BlockSums;
use basalt_store::checkpoint::{Checkpoint, PgCheckpoint, RetainedEntry};
use basalt_store::extent_map::Piece;
use basalt_store::log::{DamagedBatch, ReplayedBatch, Ring};
use basalt_store::object_op::{PayloadRef, PgObjects};

use crate::log_device::{MAX_BATCH_BYTES, PAYLOAD_KINDS, RELOCATE};

/// How far a cleaner step from `from` reads (whole batches below it): so that what it
/// moves fits the log device's floor (`FLOOR_BYTES`, two largest batches and a block),
/// however the relocations fall.
///
/// The relocations take at most the bytes of the batches read (they carry a subset of
/// their entries, split as greedily), and the writer may skip the end of a lap before one
/// of them (less than a batch). So a step reads at most a largest batch and a block, up to
/// the end of the lap if that comes first (a batch never crosses it). A step from the rest
/// of a lap the writer skipped finds no batch there, and its read goes on at the next lap
/// (`store::log::read_durable` looks there), where the next step starts.
///
/// At least one batch is always within reach of a step from a batch's start: a batch is at
/// most a largest batch.
pub fn step_limit(ring: Ring, from: u64) -> u64 {
    let step = MAX_BATCH_BYTES + BLOCK_SIZE as u64;
    let lap_end = from - from % ring.len_bytes + ring.len_bytes;
    (from + step).min(lap_end)
}

/// What of a PG's raft log is known durable here.
#[derive(Debug, Clone, Default)]
pub struct Durable {
    /// The last hard state written.
    pub hard_state: HardState,
    /// The last index of the entries written (a later persist may have truncated the log
    /// before it, in which case its own last index replaced this).
    pub last_index: u64,
    /// Persists on their way to the device, in order: the first index of their entries.
    pub in_flight: VecDeque<Option<u64>>,
}

impl Durable {
    /// What a PG's state read back at a start holds durable.
    pub fn restored(restored: &Restored) -> Self {
        Self {
            hard_state: restored.hard_state.clone(),
            last_index: restored
                .entries
                .last()
                .map_or(restored.compacted.0, |entry| entry.index),
            in_flight: VecDeque::new(),
        }
    }

    /// A persist of `entries`, or of a snapshot at index `snapshot`, goes to the device:
    /// the last index it makes durable, for [`Durable::persisted`].
    pub fn persisting(&mut self, entries: &[RaftEntry], snapshot: Option<u64>) -> Option<u64> {
        let first = entries.first().map(|entry| entry.index);
        self.in_flight
            .push_back(first.or(snapshot.map(|index| index + 1)));
        entries.last().map(|entry| entry.index).or(snapshot)
    }

    /// The oldest persist in flight is durable: its last index ([`Durable::persisting`]),
    /// and its hard state.
    pub fn persisted(&mut self, last_index: Option<u64>, hard_state: Option<HardState>) {
        self.in_flight.pop_front();
        if let Some(last_index) = last_index {
            self.last_index = last_index;
        }
        if let Some(hard_state) = hard_state {
            self.hard_state = hard_state;
        }
    }

    /// The last index up to which the log in memory is durable: entries from the first
    /// index of a persist in flight on replaced what was durable there.
    pub fn bound(&self) -> u64 {
        let in_flight = self.in_flight.iter().flatten().min().copied();
        in_flight.map_or(self.last_index, |first| {
            self.last_index.min(first.saturating_sub(1))
        })
    }
}

/// How much of a PG's raft log is kept in memory behind its applied index, for followers a
/// little behind.
#[derive(Debug, Clone, Copy)]
pub struct Retention {
    /// Entries.
    pub entries: usize,
    /// Payload bytes.
    pub bytes: u64,
    /// Payload bytes a leader keeps, however many entries, for a follower it knows to be
    /// further behind (catching up from the log is cheaper than a snapshot).
    pub behind_bytes: u64,
}

/// The log an entry's payload keeps in use (its blocks), or its data's bytes if kept in
/// memory only.
fn payload_bytes(entry: &RaftEntry) -> u64 {
    PayloadRef::decode(&entry.data).map_or(entry.data.len() as u64, |r| r.occupied_bytes())
}

/// The index before the oldest entry that `retention` keeps.
fn window_start(storage: &PgStorage, retention: Retention) -> u64 {
    let retained = storage.retained();
    let mut bytes = 0u64;
    for (kept, entry) in retained.iter().rev().enumerate() {
        bytes += payload_bytes(entry);
        if kept >= retention.entries || bytes > retention.bytes {
            return entry.index;
        }
    }
    storage.compacted().0
}

/// How far to compact a PG's raft log: behind the applied index, keeping the retention
/// window; a leader also keeps what its followers still need, up to `behind_bytes`.
pub fn compaction_point(
    storage: &PgStorage,
    applied: u64,
    followers_matched: Option<u64>,
    retention: Retention,
) -> u64 {
    let window = window_start(storage, retention).min(applied);
    match followers_matched {
        Some(matched) => {
            let hard = window_start(
                storage,
                Retention {
                    entries: usize::MAX,
                    bytes: retention.behind_bytes,
                    behind_bytes: retention.behind_bytes,
                },
            )
            .min(applied);
            window.min(matched).max(hard)
        }
        None => window,
    }
}

/// A PG's part of a checkpoint: its durable raft state and the entries retained in memory
/// that are durable; [`complete_checkpoint`] adds its object index.
pub fn pg_checkpoint(
    pg: PgId,
    storage: &PgStorage,
    durable: &Durable,
    applied: u64,
) -> PgCheckpoint {
    let bound = durable.bound();
    let (compacted_index, compacted_term) = storage.compacted();
    let entries: Vec<RetainedEntry> = storage
        .retained()
        .iter()
        .take_while(|entry| entry.index <= bound)
        .map(|entry| RetainedEntry {
            index: entry.index,
            term: entry.term,
            entry_type: entry.get_entry_type() as u8,
            data: entry.data.to_vec(),
        })
        .collect();
    let last = entries.last().map_or(compacted_index, |entry| entry.index);
    let hard_state = &durable.hard_state;
    PgCheckpoint {
        pg,
        term: hard_state.term,
        vote: hard_state.vote,
        // What was applied was committed, whatever the last hard state written says.
        commit: hard_state.commit.max(applied).min(last),
        applied: applied.min(last),
        compacted_index,
        compacted_term,
        // Raft restarts from the configuration as of the applied index, and applies the
        // changes after it again.
        confs: storage
            .confs()
            .iter()
            .enumerate()
            .filter(|(n, (index, _))| *n == 0 || *index <= applied.min(last))
            .map(|(_, (index, conf))| (*index, basalt_replication::encode_conf(conf)))
            .collect(),
        entries,
        objects: Vec::new(),
    }
}

/// Completes a checkpoint cut on the OSD's loop, away from it: each PG's object index as of
/// the cut (`objects`, in the order of `checkpoint.pgs`; a clone of the live index, which
/// shares its extents until they change) and the checksums of the blocks the index and the
/// retained entries refer to (after a restart, replay gives only those of the batches
/// after the checkpoint). On a large device holding data written 4 KiB at a time, the index
/// has millions of extents: listing them, their checksums and the encoding took about 180
/// ns per extent (a timing by hand), by that rate a second for 6 million, during which the
/// loop, where it ran before, served nothing and sent no heartbeats. Those blocks lie after the cut's tail, which no write reuses before a later
/// checkpoint is durable, so their checksums do not change meanwhile.
pub fn complete_checkpoint(
    mut checkpoint: Checkpoint,
    objects: Vec<PgObjects>,
    sums: &BlockSums,
) -> Checkpoint {
    debug_assert_eq!(checkpoint.pgs.len(), objects.len());
    for (state, objects) in checkpoint.pgs.iter_mut().zip(&objects) {
        state.objects = objects
            .keys()
            .into_iter()
            .map(|key| (key, objects.extents(key)))
            .collect();
    }
    let extents = checkpoint.pgs.iter().flat_map(|state| {
        state
            .objects
            .iter()
            .flat_map(|(_, extents)| extents.iter().map(|(_, len, device)| (*device, *len)))
    });
    let payloads = checkpoint.pgs.iter().flat_map(|state| {
        state.entries.iter().filter_map(|entry| {
            PayloadRef::decode(&entry.data).map(|reference| {
                (
                    reference.device_offset_bytes,
                    u64::from(reference.len_bytes),
                )
            })
        })
    });
    let (block_sums, poisoned_blocks) = sums.runs(extents.chain(payloads));
    checkpoint.block_sums = block_sums;
    checkpoint.poisoned_blocks = poisoned_blocks;
    checkpoint
}

/// A payload the cleaner moves: where it was, and the raft entry (index, term) that refers
/// to it, if one does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Move {
    /// The PG.
    pub pg: PgId,
    /// The payload as it was.
    pub from: PayloadRef,
    /// The raft entry whose data refers to it.
    pub raft_entry: Option<(u64, u64)>,
    /// Its blocks (counted from its first) whose data failed its checksum where it was:
    /// poisoned at the new place, so that reads of them still fail there.
    pub damaged_blocks: Vec<u64>,
    /// For a block of an object packed ([`Pack`]; `from` is then the object's block), the
    /// pieces it carries, each from where it was to its place in the block.
    pub pieces: Vec<PayloadRef>,
}

/// A block of an object whose pieces lie in several blocks of the log (written less than a
/// block at a time, or overwritten so): the cleaner reads them and writes them packed into
/// one block, laid out as in the object, so that they keep one block in use, not one each.
#[derive(Debug)]
pub struct Pack {
    /// The PG.
    pub pg: PgId,
    /// The object.
    pub object: ObjectKey,
    /// Where the block starts in the object.
    pub block_start: u64,
    /// Its pieces as the index maps them (holes included) when planned.
    pub pieces: Vec<Piece>,
    /// The relocations of what of the block the cleaner's step read, to append instead if
    /// the pieces cannot be read back whole.
    pub instead: Vec<(Entry, Move)>,
}

/// What the cleaner does with the batches it read from the ring's tail.
#[derive(Debug, Default)]
pub struct Relocations {
    /// Appends (each fits one batch) of the payloads still in use.
    pub appends: Vec<Vec<Entry>>,
    /// In the same order, the moves their entries carry.
    pub moves: Vec<Move>,
    /// The PGs of payloads still in use that failed their checksum: moved all the same,
    /// marked damaged, and these PGs' copies here are to be rebuilt.
    pub damaged: Vec<PgId>,
    /// The blocks of objects to pack (read first, then appended before `appends`).
    pub packs: Vec<Pack>,
}

impl Relocations {
    /// Puts the packed blocks (each with its bytes read back, or `None` if they could not
    /// be) before the other appends, or what the step read of them where they could not.
    pub fn with_packs(mut self, read: Vec<Option<Vec<u8>>>) -> Self {
        let mut entries = Vec::new();
        let mut moves = Vec::new();
        for (pack, data) in std::mem::take(&mut self.packs).into_iter().zip(read) {
            match data {
                Some(data) => {
                    let (entry, moved) = pack.packed(data);
                    entries.push(entry);
                    moves.push(moved);
                }
                None => {
                    for (entry, moved) in pack.instead {
                        entries.push(entry);
                        moves.push(moved);
                    }
                }
            }
        }
        moves.append(&mut self.moves);
        self.moves = moves;
        // Split together, so that the packs take no batch header of their own.
        entries.extend(std::mem::take(&mut self.appends).into_iter().flatten());
        self.appends = batch::split(entries);
        self
    }
}

impl Pack {
    /// The block's pieces, if it is one to pack: those mapped lie in two blocks of the log
    /// or more, and none of those blocks holds data still read of another block of the
    /// object (so each is freed once they are moved). A piece of a large write whose
    /// blocks in the log straddle the object's shares them with the object's blocks next
    /// to it: moving it alone would free nothing.
    fn pieces(objects: &PgObjects, object: ObjectKey, block_start: u64) -> Option<Vec<Piece>> {
        let block = BLOCK_SIZE as u64;
        let pieces = objects.plan_read(object, block_start, block);
        let mut device_blocks = Vec::new();
        for piece in &pieces {
            let Piece::Mapped {
                offset_bytes,
                len_bytes,
                device_offset_bytes,
            } = *piece
            else {
                continue;
            };
            // The object's bytes that the blocks of the log it lies in would hold, written
            // with it: those still read there must be within the block.
            let touched = batch::blocks_touched(device_offset_bytes, len_bytes);
            let into_first = device_offset_bytes % block;
            let from = offset_bytes.saturating_sub(into_first);
            let to = offset_bytes + (touched.end - touched.start) * block - into_first;
            let shared = objects
                .plan_read(object, from, to - from)
                .iter()
                .any(|other| {
                    matches!(*other, Piece::Mapped {
                    offset_bytes: at,
                    len_bytes: len,
                    device_offset_bytes: device,
                } if device.wrapping_sub(at) == device_offset_bytes.wrapping_sub(offset_bytes)
                    && (at < block_start || at + len > block_start + block))
                });
            if shared {
                return None;
            }
            device_blocks.extend(touched);
        }
        device_blocks.sort_unstable();
        device_blocks.dedup();
        (device_blocks.len() > 1).then_some(pieces)
    }

    /// The relocation of the block packed, with its bytes as read back.
    fn packed(self, data: Vec<u8>) -> (Entry, Move) {
        let block = PayloadRef {
            object: self.object,
            offset_bytes: self.block_start as u32,
            len_bytes: BLOCK_SIZE as u32,
            device_offset_bytes: 0,
        };
        let pieces = self
            .pieces
            .iter()
            .filter_map(|piece| match *piece {
                Piece::Mapped {
                    offset_bytes,
                    len_bytes,
                    device_offset_bytes,
                } => Some(PayloadRef {
                    object: self.object,
                    offset_bytes: offset_bytes as u32,
                    len_bytes: len_bytes as u32,
                    device_offset_bytes,
                }),
                Piece::Hole { .. } => None,
            })
            .collect();
        let entry = Entry {
            kind: RELOCATE,
            pg: self.pg,
            term: 0,
            index: 0,
            meta: block.meta(),
            data,
        };
        let moved = Move {
            pg: self.pg,
            from: block,
            raft_entry: None,
            damaged_blocks: Vec::new(),
            pieces,
        };
        (entry, moved)
    }
}

/// Plans the relocations for a run of batches from the ring's tail. A payload still in use
/// whose data fails its checksum is moved too, with the blocks that fail (by `sums`; all
/// of them where its checksums are not known) marked to be poisoned at the new place: the
/// cleaner never stops for damage, and the damage is never taken for data.
pub fn plan_relocations(
    batches: Vec<ReplayedBatch>,
    raft: &MultiRaft,
    objects: &HashMap<PgId, PgObjects>,
    sums: &BlockSums,
) -> Relocations {
    let mut relocations = Vec::new();
    let mut moves = Vec::new();
    let mut damaged = Vec::new();
    let mut packs = Packs::default();
    for batch in batches {
        for (at, (entry, data_offset)) in batch.entries.into_iter().enumerate() {
            let Some((mut moved, runs)) = live_payload(&entry, data_offset, raft, objects) else {
                continue;
            };
            // Blocks failing their checksums, or poisoned by an earlier move (the entry's
            // own checksum, over the bytes moved, passes then): poisoned again.
            let entry_damaged = batch.damaged_entries.contains(&at);
            moved.damaged_blocks = damaged_blocks(sums, data_offset, &entry.data, entry_damaged);
            // The copy is rebuilt only if something still reads a damaged block (a payload
            // overwritten in part may hold damage nothing reads).
            let from = moved.from;
            let range = (u64::from(from.offset_bytes), u64::from(from.len_bytes));
            let indexed = moved.damaged_blocks.iter().any(|i| {
                let at = data_offset + i * BLOCK_SIZE as u64;
                objects
                    .get(&entry.pg)
                    .is_some_and(|objects| objects.reads_block(from.object, range, at))
            });
            let read = indexed || (moved.raft_entry.is_some() && !moved.damaged_blocks.is_empty());
            if read && !damaged.contains(&entry.pg) {
                damaged.push(entry.pg);
            }
            let (term, index) = moved
                .raft_entry
                .map_or((0, 0), |(index, term)| (term, index));
            let block = BLOCK_SIZE as u64;
            // The blocks of objects to pack that its runs start or end in go with the
            // packs (a raft entry refers to the whole payload: it moves whole).
            let (runs, cut) = match moved.raft_entry {
                None => packs.cut(runs, entry.pg, objects),
                Some(_) => (runs, Vec::new()),
            };
            let runs = join_runs(runs);
            // Each run is an entry of its own: a batch header per ENTRY_COUNT_MAX of them
            // counts, or a step's relocations could outgrow what it read (the floor).
            let headers = runs.len().div_ceil(batch::ENTRY_COUNT_MAX) as u64;
            let run_blocks: u64 = headers
                + runs
                    .iter()
                    .map(|run| u64::from(run.len_bytes).div_ceil(block))
                    .sum::<u64>();
            if cut.is_empty()
                && (moved.raft_entry.is_some()
                    || runs.is_empty()
                    || run_blocks >= u64::from(from.len_bytes).div_ceil(block))
            {
                relocations.push(Entry {
                    kind: RELOCATE,
                    pg: entry.pg,
                    term,
                    index,
                    meta: entry.meta,
                    data: entry.data,
                });
                moves.push(moved);
                continue;
            }
            // Overwritten in part: only what the index still reads moves, or the dead
            // bytes of the payload would go round the ring with it for good.
            let damaged_blocks = std::mem::take(&mut moved.damaged_blocks);
            let relocation = |run: PayloadRef| {
                let skip = (run.device_offset_bytes - data_offset) as usize;
                let relocated = Entry {
                    kind: RELOCATE,
                    pg: entry.pg,
                    term,
                    index,
                    meta: run.meta(),
                    data: entry.data[skip..skip + run.len_bytes as usize].to_vec(),
                };
                let (device, len) = (run.device_offset_bytes, u64::from(run.len_bytes));
                let moved = Move {
                    pg: entry.pg,
                    from: run,
                    raft_entry: None,
                    damaged_blocks: moved_damage(device, len, |old| {
                        damaged_blocks.contains(&((old - data_offset) / block))
                    }),
                    pieces: Vec::new(),
                };
                (relocated, moved)
            };
            for run in runs {
                let (relocated, moved) = relocation(run);
                relocations.push(relocated);
                moves.push(moved);
            }
            for (pack, run) in cut {
                packs.packs[pack].instead.push(relocation(run));
            }
        }
    }
    Relocations {
        appends: batch::split(relocations),
        moves,
        damaged,
        packs: packs.packs,
    }
}

/// The blocks of objects a cleaner step packs, by PG, object and block.
#[derive(Default)]
struct Packs {
    packs: Vec<Pack>,
    by_block: HashMap<(PgId, ObjectKey, u64), Option<usize>>,
}

impl Packs {
    /// Cuts from the live extents of a payload of `pg` the parts in blocks of their object
    /// to pack (only the first and last block of an extent can be: every block between is
    /// either held whole by it, in one block of the log, or shares its blocks of the log
    /// with its neighbours). Returns what is left of the extents, and the parts cut, each
    /// with the index of its pack.
    fn cut(
        &mut self,
        runs: Vec<PayloadRef>,
        pg: PgId,
        objects: &HashMap<PgId, PgObjects>,
    ) -> (Vec<PayloadRef>, Vec<(usize, PayloadRef)>) {
        let Some(pg_objects) = objects.get(&pg) else {
            return (runs, Vec::new());
        };
        let block = BLOCK_SIZE as u64;
        let mut left = Vec::new();
        let mut cut = Vec::new();
        for run in runs {
            let start = u64::from(run.offset_bytes);
            let end = start + u64::from(run.len_bytes);
            let part = |from: u64, to: u64| PayloadRef {
                offset_bytes: from as u32,
                len_bytes: (to - from) as u32,
                device_offset_bytes: run.device_offset_bytes + (from - start),
                ..run
            };
            let mut pack_of = |block_start: u64| {
                *self
                    .by_block
                    .entry((pg, run.object, block_start))
                    .or_insert_with(|| {
                        let pieces = Pack::pieces(pg_objects, run.object, block_start)?;
                        self.packs.push(Pack {
                            pg,
                            object: run.object,
                            block_start,
                            pieces,
                            instead: Vec::new(),
                        });
                        Some(self.packs.len() - 1)
                    })
            };
            let (first, last) = (start / block * block, (end - 1) / block * block);
            let (mut from, mut to) = (start, end);
            if let Some(pack) = pack_of(first) {
                from = (first + block).min(end);
                cut.push((pack, part(start, from)));
            }
            if last > first
                && let Some(pack) = pack_of(last)
            {
                to = last;
                cut.push((pack, part(last, end)));
            }
            if from < to {
                left.push(part(from, to));
            }
        }
        (left, cut)
    }
}

/// Plans the relocations out of a batch whose header cannot be read (`damaged`: written
/// whole, changed since). Its entries are unknown, but what still reads it is not: the
/// object index's extents and the raft entries kept for followers that refer to payloads
/// within its bytes. Each is moved (an extent alone, or with the neighbours of its object
/// less than a block away, or a kept entry's whole payload, which carries the index's
/// extents in it along), and each block of the moved data that fails its checksum, is
/// poisoned, or has no checksum known (the header that would have vouched for it is lost)
/// is marked to be poisoned at the new place. What else the batch held (hard states, other
/// raft entries) lives in memory and goes into the next checkpoint.
///
/// A payload lies within one batch, so one that lies across an end of the batch's bytes
/// says that end is wrong (client data that happened to look like the next batch's header):
/// an error then, and nothing is moved, for what lies past the wrong end would be freed.
pub fn plan_rescue(
    damaged: &DamagedBatch,
    ring: Ring,
    raft: &MultiRaft,
    objects: &HashMap<PgId, PgObjects>,
    sums: &BlockSums,
) -> Result<Relocations, String> {
    let start = ring.device_offset(damaged.damage.position);
    let end = start + damaged.bytes.len() as u64;
    // Whether data in use lies in the batch's bytes; an error if across an end of them.
    let inside = |device: u64, len: u64| {
        if device >= start && device + len <= end {
            Ok(true)
        } else if device + len <= start || device >= end {
            Ok(false)
        } else {
            Err(format!(
                "data in use at device bytes {device}..{} lies across an end of the damaged \
                 batch's bytes {start}..{end}: where the batch ends is not known",
                device + len
            ))
        }
    };
    let candidate = |pg, from, raft_entry| Move {
        pg,
        from,
        raft_entry,
        damaged_blocks: Vec::new(),
        pieces: Vec::new(),
    };
    let mut candidates: Vec<Move> = Vec::new();
    for pg in raft.pgs() {
        let Some(storage) = raft.storage(pg) else {
            continue;
        };
        for kept in storage.retained() {
            let Some(reference) = PayloadRef::decode(&kept.data) else {
                continue;
            };
            let (device, len) = (
                reference.device_offset_bytes,
                u64::from(reference.len_bytes),
            );
            if inside(device, len)? {
                candidates.push(candidate(pg, reference, Some((kept.index, kept.term))));
            }
        }
    }
    let kept = candidates.len();
    let mut pgs: Vec<&PgId> = objects.keys().collect();
    pgs.sort_unstable();
    for pg in pgs {
        let pg_objects = &objects[pg];
        for key in pg_objects.keys() {
            let mut extents = Vec::new();
            for (offset, len, device) in pg_objects.extents(key) {
                if !inside(device, len)? {
                    continue;
                }
                // Less what kept entries' payloads carry (an extent may span the payloads
                // of writes next to each other in the batch, joined).
                let shift = |at: u64, offset: u64| i128::from(at) - i128::from(offset);
                let carriers = candidates[..kept].iter().filter(|other| {
                    let from = &other.from;
                    other.pg == *pg
                        && from.object == key
                        && shift(from.device_offset_bytes, u64::from(from.offset_bytes))
                            == shift(device, offset)
                });
                let mut parts = vec![(device, len)];
                for carrier in carriers {
                    let from = carrier.from.device_offset_bytes;
                    let to = from + u64::from(carrier.from.len_bytes);
                    parts = parts
                        .into_iter()
                        .flat_map(|(at, n)| {
                            let before = (at < from).then(|| (at, from.min(at + n) - at));
                            let after = (at + n > to).then(|| (to.max(at), at + n - to.max(at)));
                            before.into_iter().chain(after)
                        })
                        .collect();
                }
                extents.extend(parts.into_iter().map(|(at, n)| PayloadRef {
                    object: key,
                    offset_bytes: (offset + (at - device)) as u32,
                    len_bytes: n as u32,
                    device_offset_bytes: at,
                }));
            }
            candidates.extend(
                join_runs(extents)
                    .into_iter()
                    .map(|run| candidate(*pg, run, None)),
            );
        }
    }
    let mut relocations = Vec::new();
    let mut moves = Vec::new();
    let mut damaged_pgs = Vec::new();
    for mut moved in candidates {
        let from = moved.from;
        let at = (from.device_offset_bytes - start) as usize;
        moved.damaged_blocks = rescued_damage(sums, start, &damaged.bytes, &from);
        if !moved.damaged_blocks.is_empty() && !damaged_pgs.contains(&moved.pg) {
            damaged_pgs.push(moved.pg);
        }
        let (index, term) = moved.raft_entry.unwrap_or((0, 0));
        relocations.push(Entry {
            kind: RELOCATE,
            pg: moved.pg,
            term,
            index,
            meta: from.meta(),
            data: damaged.bytes[at..at + from.len_bytes as usize].to_vec(),
        });
        moves.push(moved);
    }
    Ok(Relocations {
        appends: batch::split(relocations),
        moves,
        damaged: damaged_pgs,
        packs: Vec::new(),
    })
}

/// `run` with `extent` taken in, if it is of the same payload (the same distance between
/// object and device offsets) and less than a block further: one move then.
fn joined(run: &PayloadRef, extent: &PayloadRef) -> Option<PayloadRef> {
    let end = run.device_offset_bytes + u64::from(run.len_bytes);
    let (offset, device) = (u64::from(extent.offset_bytes), extent.device_offset_bytes);
    (same_payload(run, offset, device) && device < end + BLOCK_SIZE as u64).then(|| PayloadRef {
        len_bytes: (device + u64::from(extent.len_bytes) - run.device_offset_bytes) as u32,
        ..*run
    })
}

/// Extents, in order, as moves: those of one payload less than a block apart taken
/// together.
fn join_runs(extents: Vec<PayloadRef>) -> Vec<PayloadRef> {
    let mut runs: Vec<PayloadRef> = Vec::new();
    for extent in extents {
        match runs.last().and_then(|run| joined(run, &extent)) {
            Some(run) => *runs.last_mut().expect("a run") = run,
            None => runs.push(extent),
        }
    }
    runs
}

/// Whether the object's bytes at `offset`, read at `device`, lie in `payload` where it
/// holds them (at or after its start, at the same distance on the device as in the object).
fn same_payload(payload: &PayloadRef, offset: u64, device: u64) -> bool {
    let into_object = offset.checked_sub(u64::from(payload.offset_bytes));
    let into_device = device.checked_sub(payload.device_offset_bytes);
    into_object.is_some() && into_object == into_device
}

/// The blocks of a payload moved out of a damaged batch (`bytes`, from device offset
/// `start`), counted from its first at the new place, that hold bytes of a block that fails
/// its checksum, is poisoned, or has no checksum known where it was. The payload may start
/// within a block (an extent of a write overwritten in part), so a block at the new place
/// may hold bytes of two blocks of the old.
fn rescued_damage(sums: &BlockSums, start: u64, bytes: &[u8], from: &PayloadRef) -> Vec<u64> {
    let (device, len) = (from.device_offset_bytes, u64::from(from.len_bytes));
    moved_damage(device, len, |old| {
        let at = (old - start) as usize;
        // Nothing vouches for a block of unknown checksum: the header is lost.
        block_damaged(sums, old, &bytes[at..at + BLOCK_SIZE], true)
    })
}

/// The blocks, counted from the first at the new place, of `len` bytes moved from
/// `device` that hold bytes of an old block (named by its device offset) that is `bad`.
/// The bytes may start within a block, so a block at the new place may hold bytes of two
/// blocks of the old.
fn moved_damage(device: u64, len: u64, bad: impl Fn(u64) -> bool) -> Vec<u64> {
    let block = BLOCK_SIZE as u64;
    (0..len.div_ceil(block))
        .filter(|j| {
            let first = device + j * block;
            let last = (first + block).min(device + len) - 1;
            (first - first % block..=last - last % block)
                .step_by(BLOCK_SIZE)
                .any(&bad)
        })
        .collect()
}

/// The blocks of `data` (an entry's, read at `data_offset`) that fail their checksums (or
/// are poisoned); if the entry's own checksum failed (`entry_damaged`), those whose
/// checksums are not known too (the damage may be in any of them).
fn damaged_blocks(
    sums: &BlockSums,
    data_offset: u64,
    data: &[u8],
    entry_damaged: bool,
) -> Vec<u64> {
    (0u64..)
        .zip(data.chunks(BLOCK_SIZE))
        .filter(|(i, chunk)| {
            block_damaged(
                sums,
                data_offset + i * BLOCK_SIZE as u64,
                chunk,
                entry_damaged,
            )
        })
        .map(|(i, _)| i)
        .collect()
}

/// Whether the block at `at`, read as `chunk`, fails its checksum or is poisoned, or, if
/// `unknown_is_damaged`, has no checksum known.
fn block_damaged(sums: &BlockSums, at: u64, chunk: &[u8], unknown_is_damaged: bool) -> bool {
    let unknown = sums.get(at).is_none() && !sums.is_poisoned(at);
    sums.verify(at, chunk).is_err() || (unknown_is_damaged && unknown)
}

/// The move of `entry`'s payload (at `data_offset`) if something still reads it there: the
/// object index, or a raft entry kept for followers; with the extents of it the index
/// reads.
fn live_payload(
    entry: &Entry,
    data_offset: u64,
    raft: &MultiRaft,
    objects: &HashMap<PgId, PgObjects>,
) -> Option<(Move, Vec<PayloadRef>)> {
    // A snapshot's object data is mapped like a write's once installed (the cleaner does
    // not run while one is being installed).
    if !PAYLOAD_KINDS.contains(&entry.kind) {
        // Anything else lives in memory and goes into checkpoints.
        return None;
    }
    let pg = entry.pg;
    let from = PayloadRef::from_meta(&entry.meta, data_offset);
    let raft_entry = (entry.index != 0)
        .then(|| raft.storage(pg))
        .flatten()
        .and_then(|storage| {
            let first = storage.compacted().0 + 1;
            let at = entry.index.checked_sub(first)?;
            let kept = storage.retained().get(at as usize)?;
            let reference = PayloadRef::decode(&kept.data)?;
            (kept.term == entry.term && reference.device_offset_bytes == data_offset)
                .then_some((entry.index, entry.term))
        });
    let runs = objects
        .get(&pg)
        .map(|objects| objects.live_extents(&from))
        .unwrap_or_default();
    let moved = Move {
        pg,
        from,
        raft_entry,
        damaged_blocks: Vec::new(),
        pieces: Vec::new(),
    };
    (!runs.is_empty() || raft_entry.is_some()).then_some((moved, runs))
}

/// What of a PG reads blocks marked poisoned in `sums` (data found damaged, whose copy is
/// to be rebuilt): its object index (`objects`), its raft entries kept in memory
/// (`retained`: entries this replica may be the only one to hold), each `true` if so.
pub fn reads_poisoned(
    sums: &BlockSums,
    objects: Option<&PgObjects>,
    retained: &[RaftEntry],
) -> (bool, bool) {
    let indexed = objects.is_some_and(|objects| {
        objects.keys().into_iter().any(|key| {
            let extents = objects.extents(key);
            extents
                .iter()
                .any(|&(_, len, device)| sums.any_poisoned(device, len))
        })
    });
    let logged = retained.iter().any(|entry| {
        PayloadRef::decode(&entry.data).is_some_and(|reference| {
            let len = u64::from(reference.len_bytes);
            sums.any_poisoned(reference.device_offset_bytes, len)
        })
    });
    (indexed, logged)
}

/// Applies a durable move: the index and the raft entry follow the payload to `to` where
/// they still read it at its old place. Returns the index bytes moved.
pub fn apply_move(
    moved: &Move,
    to: u64,
    raft: &mut MultiRaft,
    objects: &mut HashMap<PgId, PgObjects>,
) -> u64 {
    let bytes = objects.get_mut(&moved.pg).map_or(0, |objects| {
        if moved.pieces.is_empty() {
            return objects.relocate(&moved.from, to);
        }
        // A packed block: each piece to its place in it.
        let start = u64::from(moved.from.offset_bytes);
        moved
            .pieces
            .iter()
            .map(|piece| objects.relocate(piece, to + (u64::from(piece.offset_bytes) - start)))
            .sum()
    });
    if let Some((index, term)) = moved.raft_entry {
        let old = moved.from.device_offset_bytes;
        raft.replace_entry_data(moved.pg, index, term, |data| {
            let reference = PayloadRef::decode(data)?;
            (reference.device_offset_bytes == old).then(|| {
                PayloadRef {
                    device_offset_bytes: to,
                    ..reference
                }
                .encode()
            })
        });
    }
    bytes
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::log_device::FLOOR_BYTES;
    use basalt_common::OsdId;
    use basalt_common::{ImageId, Lsn, ObjectKey, PoolId};
    use basalt_store::batch::DATA_SIZE_MAX;
    use basalt_store::log::{LogWriter, read_durable};
    use basalt_store::object_op::{ObjectOp, kind};
    use proptest::prelude::*;

    fn entries(sizes: &[usize]) -> Vec<Entry> {
        sizes
            .iter()
            .map(|&len| Entry {
                kind: kind::WRITE,
                pg: PgId {
                    pool: PoolId(1),
                    index: 0,
                },
                term: 1,
                index: 1,
                meta: [0; 24],
                data: vec![0; len],
            })
            .collect()
    }

    /// A step that meets a skipped lap end finds no batch there, and its read goes on at
    /// the next lap, where the next step finds that lap's first batch.
    #[test]
    fn a_step_goes_on_past_a_skipped_lap_end() {
        let largest = || entries(&[DATA_SIZE_MAX]);
        let ring = Ring {
            start_bytes: 0,
            len_bytes: 2 * MAX_BATCH_BYTES + 3 * BLOCK_SIZE as u64,
        };
        let mut disk = vec![0u8; ring.len_bytes as usize];
        let mut writer = LogWriter::new(ring, 0, Lsn(1), 0);
        let mut last = None;
        for _ in 0..3 {
            let placed = writer.append(&largest()).expect("room");
            let at = placed.offset_bytes as usize;
            disk[at..at + placed.bytes.len()].copy_from_slice(&placed.bytes);
            writer.set_tail(placed.position);
            last = Some(placed);
        }
        let last = last.expect("placed");
        assert_eq!(
            last.position, ring.len_bytes,
            "the third skipped the end of the lap"
        );
        let read = |offset: u64, len: usize| -> Result<Vec<u8>, ()> {
            Ok(disk[offset as usize..offset as usize + len].to_vec())
        };
        let from = 2 * MAX_BATCH_BYTES;
        let durable_end = last.position;
        let limit = step_limit(ring, from);
        let found = read_durable(read, ring, (from, last.lsn), (limit, durable_end)).expect("read");
        assert!(found.batches.is_empty());
        assert_eq!(
            (found.next_position, found.next_lsn),
            (ring.len_bytes, last.lsn)
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(12))]

        /// Over batches of any sizes written around a ring, a cleaner step from the end of
        /// each batch still in the ring reads at least one batch, its relocations (every
        /// entry it read, split as the cleaner splits them) take no more bytes than it
        /// read, and those leave room in the floor for one skipped lap end.
        #[test]
        fn a_cleaner_step_reads_a_batch_and_fits_the_floor(
            batches in proptest::collection::vec(
                proptest::collection::vec(
                    prop_oneof![1..=8192usize, 1..=DATA_SIZE_MAX / 2, Just(DATA_SIZE_MAX)],
                    1..3,
                ),
                20..40,
            ),
        ) {
            let ring = Ring {
                start_bytes: 0,
                len_bytes: 5 * MAX_BATCH_BYTES + 3 * BLOCK_SIZE as u64,
            };
            let mut disk = vec![0u8; ring.len_bytes as usize];
            let mut writer = LogWriter::new(ring, 0, Lsn(1), 0);
            // (position after the batch, LSN after it): where a step can start.
            let mut starts = vec![(0, Lsn(1))];
            let (mut tail, mut last_position) = (0, 0);
            for sizes in &batches {
                let mut sizes = sizes.clone();
                while batch::batch_size(&entries(&sizes)) - BLOCK_SIZE > DATA_SIZE_MAX {
                    sizes.pop();
                }
                // Keep the last three batches (the ring holds at least four of any size).
                tail = starts[starts.len().saturating_sub(3)].0;
                writer.set_tail(tail);
                let placed = writer.append(&entries(&sizes)).expect("room");
                let at = placed.offset_bytes as usize;
                disk[at..at + placed.bytes.len()].copy_from_slice(&placed.bytes);
                last_position = placed.position;
                starts.push((placed.position + placed.bytes.len() as u64, placed.lsn.next()));
            }
            let read = |offset: u64, len: usize| -> Result<Vec<u8>, ()> {
                Ok(disk[offset as usize..offset as usize + len].to_vec())
            };
            // As the cleaner reads: up to the start of the last batch written, durable.
            let durable_end = last_position;
            let in_ring = starts.iter().filter(|(from, _)| *from >= tail && *from < durable_end);
            for &(from, lsn) in in_ring {
                let step = |(from, lsn)| {
                    let limit = step_limit(ring, from).min(durable_end);
                    let found = read_durable(read, ring, (from, lsn), (limit, durable_end))
                        .expect("read");
                    (limit, found)
                };
                let (mut limit, mut found) = step((from, lsn));
                if found.batches.is_empty() {
                    // The rest of a lap the writer skipped: the read went on at the next.
                    let next = found.next_position;
                    prop_assert!(
                        next > from && next.is_multiple_of(ring.len_bytes) && next <= durable_end,
                        "no batch from {from} to {limit}, next {next}"
                    );
                    if next == durable_end {
                        // The cleaner waits there for the batch's persist.
                        continue;
                    }
                    (limit, found) = step((next, found.next_lsn));
                }
                prop_assert!(!found.batches.is_empty(), "no batch from {from} to {limit}");
                // A step reads adjacent batches (never across a skipped lap end).
                let bytes = found.next_position - found.batches[0].position;
                let relocated: u64 = batch::split(
                    found.batches.iter().flat_map(|b| b.entries.iter().map(|(e, _)| e.clone())),
                )
                .iter()
                .map(|run| batch::batch_size(run) as u64)
                .sum();
                prop_assert!(relocated <= bytes, "{relocated} bytes relocate {bytes}");
                prop_assert!(
                    relocated + MAX_BATCH_BYTES - BLOCK_SIZE as u64 <= FLOOR_BYTES,
                    "a step of {bytes} bytes from {from}"
                );
            }
        }
    }

    /// A PG reads poisoned blocks when an extent of its index or a payload its kept raft
    /// entries refer to covers one, however partially; not when they lie elsewhere.
    #[test]
    fn a_pg_reads_poisoned_blocks_through_its_index_or_its_raft_entries() {
        let ring = Ring {
            start_bytes: 8192,
            len_bytes: 1 << 20,
        };
        let object = basalt_common::ObjectKey {
            image: basalt_common::ImageId(1),
            number: 0,
        };
        let mut objects = PgObjects::new();
        // A write's second half: it starts in the middle of the block at 16 KiB and ends
        // in the middle of the next.
        objects.insert_extent(object, 0, 4096, 16384 + 2048);
        let reference = PayloadRef {
            object,
            offset_bytes: 0,
            len_bytes: 4096,
            device_offset_bytes: 65536,
        };
        let retained = [RaftEntry {
            data: reference.encode().into(),
            ..RaftEntry::default()
        }];
        let reads = |poisoned: &[u64]| {
            let sums = BlockSums::new(ring);
            for at in poisoned {
                sums.poison(*at);
            }
            reads_poisoned(&sums, Some(&objects), &retained)
        };
        assert_eq!(reads(&[]), (false, false));
        assert_eq!(
            reads(&[8192, 12288, 24576, 61440, 69632]),
            (false, false),
            "next to them"
        );
        assert_eq!(reads(&[16384]), (true, false), "the extent's first block");
        assert_eq!(reads(&[20480]), (true, false), "the extent's last block");
        assert_eq!(reads(&[65536]), (false, true), "the raft entry's payload");
    }

    #[test]
    fn the_durable_bound_stops_before_a_persist_in_flight() {
        let mut durable = Durable {
            last_index: 10,
            ..Durable::default()
        };
        assert_eq!(durable.bound(), 10);
        durable.in_flight.push_back(None);
        assert_eq!(durable.bound(), 10, "a persist of a hard state alone");
        durable.in_flight.push_back(Some(8));
        assert_eq!(
            durable.bound(),
            7,
            "entries 8.. in memory replace durable ones"
        );
        durable.in_flight.push_back(Some(11));
        assert_eq!(durable.bound(), 7);
    }

    /// A ring of `blocks` blocks after a first block.
    fn ring_of(blocks: u64) -> Ring {
        Ring {
            start_bytes: 4096,
            len_bytes: blocks * BLOCK_SIZE as u64,
        }
    }

    fn test_pg() -> PgId {
        PgId {
            pool: PoolId(1),
            index: 0,
        }
    }

    /// Object `number` of the tests' image.
    fn object(number: u64) -> ObjectKey {
        ObjectKey {
            image: ImageId(7),
            number,
        }
    }

    /// A batch whose header is damaged after it was written: what the index still reads
    /// in it is moved (the pieces of a write overwritten in the middle as one move, since
    /// they share its payload), nothing else, with the data it held; the block whose byte
    /// was flipped too is marked damaged, and only for the move that holds it.
    #[test]
    fn what_the_index_reads_in_a_batch_with_a_damaged_header_is_moved() {
        let pg = test_pg();
        let blocks = |n| n * BLOCK_SIZE;
        // Batch 1 (damaged later): object 1 gets 4 blocks, object 2 gets 2 blocks.
        // Batch 2 overwrites 1 KiB inside object 1's second block and all of object 2;
        // batch 3 follows.
        let (first, damaged, objects, sums) = a_damaged_first_batch(&[
            vec![write(1, 0, 0xa1, blocks(4)), write(2, 0, 0xa2, blocks(2))],
            vec![write(1, 4608, 0xb1, 1024), write(2, 0, 0xb2, blocks(2))],
            vec![write(3, 0, 0xc3, blocks(1))],
        ]);
        let ring = ring_of(64);
        let raft = MultiRaft::new(OsdId(0), 1);
        let index = HashMap::from([(pg, objects)]);
        let planned = plan_rescue(&damaged, ring, &raft, &index, &sums).expect("a plan");
        // Object 1 still reads batch 1 but for 1 KiB in its second block: one move, as its
        // two extents share that block; object 2 is overwritten whole.
        assert_eq!(planned.moves.len(), 1, "{:?}", planned.moves);
        let moved = &planned.moves[0];
        assert_eq!(moved.from.object, object(1));
        assert_eq!(moved.from.offset_bytes, 0);
        assert_eq!(moved.from.len_bytes, 4 * BLOCK_SIZE as u32);
        assert_eq!(moved.from.device_offset_bytes, first.data_offsets_bytes[0]);
        assert_eq!(moved.raft_entry, None);
        assert_eq!(moved.damaged_blocks, vec![0]);
        assert_eq!(planned.damaged, vec![pg]);
        let relocated: Vec<&Entry> = planned.appends.iter().flatten().collect();
        assert_eq!(relocated.len(), 1);
        assert_eq!(relocated[0].kind, RELOCATE);
        assert_eq!(
            PayloadRef::from_meta(&relocated[0].meta, moved.from.device_offset_bytes),
            moved.from
        );
        let mut expected = vec![0xa1; 4 * BLOCK_SIZE];
        expected[10] ^= 0xff;
        assert_eq!(relocated[0].data, expected);
    }

    /// Two writes next to each other in an object and in a damaged batch are one extent of
    /// the index; a raft entry kept for a follower carries the second's payload, so the
    /// index's move out of the batch takes only the first, not both again.
    #[test]
    fn a_joined_extent_is_moved_less_what_a_kept_entry_carries() {
        let pg = test_pg();
        let block = BLOCK_SIZE;
        let (first, damaged, objects, sums) = a_damaged_first_batch(&[
            vec![
                write(1, 0, 0xa1, block),
                write(1, block as u32, 0xa2, block),
            ],
            vec![write(3, 0, 0xc3, block)],
        ]);
        let [a, b] = [0, 1].map(|n| first.data_offsets_bytes[n]);
        assert_eq!(b, a + block as u64, "the two payloads run on");
        assert_eq!(objects.extents(object(1)), vec![(0, 2 * block as u64, a)]);
        let kept = PayloadRef {
            object: object(1),
            offset_bytes: block as u32,
            len_bytes: block as u32,
            device_offset_bytes: b,
        };
        let mut raft = MultiRaft::new(OsdId(0), 1);
        let entry = RaftEntry {
            index: 1,
            term: 1,
            data: kept.encode().into(),
            ..RaftEntry::default()
        };
        let restored = Restored {
            entries: vec![entry],
            ..Restored::default()
        };
        raft.create_group(pg, &[OsdId(0)], restored).expect("group");
        let index = HashMap::from([(pg, objects)]);
        let planned = plan_rescue(&damaged, ring_of(64), &raft, &index, &sums).expect("a plan");
        let moved: Vec<(PayloadRef, Option<(u64, u64)>)> = planned
            .moves
            .iter()
            .map(|moved| (moved.from, moved.raft_entry))
            .collect();
        let first_write = PayloadRef {
            len_bytes: block as u32,
            offset_bytes: 0,
            device_offset_bytes: a,
            ..kept
        };
        assert_eq!(moved, vec![(kept, Some((1, 1))), (first_write, None)]);
    }

    /// A write of `len` bytes of `fill` at `offset_bytes` into object `number`.
    fn write(number: u64, offset_bytes: u32, fill: u8, len: usize) -> ObjectOp {
        ObjectOp::Write {
            object: object(number),
            offset_bytes,
            data: vec![fill; len],
        }
    }

    /// Writes `batches` (of the tests' PG) into a 64-block ring and its index, then damages
    /// the first batch's header and its first data block: that batch as placed, read as
    /// damaged, and the index and checksums.
    fn a_damaged_first_batch(
        batches: &[Vec<ObjectOp>],
    ) -> (
        basalt_store::log::PlacedBatch,
        DamagedBatch,
        PgObjects,
        BlockSums,
    ) {
        use basalt_store::log::read_damaged;
        let (ring, pg) = (ring_of(64), test_pg());
        let mut disk = vec![0u8; (ring.start_bytes + ring.len_bytes) as usize];
        let sums = BlockSums::new(ring);
        let mut objects = PgObjects::new();
        let mut writer = LogWriter::new(ring, 0, Lsn(1), 0);
        let mut first_batch = None;
        for ops in batches {
            let log: Vec<Entry> = ops.iter().map(|op| logged(op, pg, 1)).collect();
            let placed = writer.append(&log).expect("room");
            let at = placed.offset_bytes as usize;
            disk[at..at + placed.bytes.len()].copy_from_slice(&placed.bytes);
            for (op, offset) in ops.iter().zip(&placed.data_offsets_bytes) {
                sums.record(*offset, op.payload());
                objects.apply(op, *offset);
            }
            first_batch.get_or_insert(placed);
        }
        let first = first_batch.expect("written");
        // The header, and the first block of the first write's data, are damaged.
        let header = first.offset_bytes as usize;
        disk[header + 100] ^= 0xff;
        let object_1_data = first.data_offsets_bytes[0] as usize;
        disk[object_1_data + 10] ^= 0xff;
        let read = |offset: u64, len: usize| -> Result<Vec<u8>, ()> {
            Ok(disk[offset as usize..offset as usize + len].to_vec())
        };
        let damaged = read_damaged(read, ring, (0, Lsn(1)), ring.len_bytes)
            .expect("reads")
            .expect("a damaged batch");
        assert_eq!(damaged.end_position, first.bytes.len() as u64);
        (first, damaged, objects, sums)
    }

    /// A write as the log holds it (term 1).
    fn logged(op: &ObjectOp, pg: PgId, index: u64) -> Entry {
        Entry {
            kind: op.kind(),
            pg,
            term: 1,
            index,
            meta: op.meta(),
            data: op.payload().to_vec(),
        }
    }

    /// A log on a disk in memory, with an object index of what was written to it.
    struct Written {
        ring: Ring,
        pg: PgId,
        disk: Vec<u8>,
        sums: BlockSums,
        writer: LogWriter,
        index: HashMap<PgId, PgObjects>,
        raft: MultiRaft,
        placed: Vec<basalt_store::log::PlacedBatch>,
    }

    impl Written {
        /// Each list of writes (object, offset, fill byte, length) as a batch, applied.
        fn new(batches: &[Vec<(u64, u32, u8, u32)>]) -> Self {
            let ring = ring_of(256);
            let mut written = Self {
                ring,
                pg: test_pg(),
                disk: vec![0u8; (ring.start_bytes + ring.len_bytes) as usize],
                sums: BlockSums::new(ring),
                writer: LogWriter::new(ring, 0, Lsn(1), 0),
                index: HashMap::new(),
                raft: MultiRaft::new(OsdId(0), 1),
                placed: Vec::new(),
            };
            for writes in batches {
                let ops: Vec<ObjectOp> = writes
                    .iter()
                    .map(|&(number, offset_bytes, fill, len)| ObjectOp::Write {
                        object: object(number),
                        offset_bytes,
                        data: (0..len).map(|i| fill ^ (i % 251) as u8).collect(),
                    })
                    .collect();
                let pg = written.pg;
                let log: Vec<Entry> = ops.iter().map(|op| logged(op, pg, 0)).collect();
                let batch = written.append(&log);
                let objects = written.index.entry(pg).or_default();
                for (op, offset) in ops.iter().zip(&batch.data_offsets_bytes) {
                    objects.apply(op, *offset);
                }
                written.placed.push(batch);
            }
            written
        }

        fn append(&mut self, log: &[Entry]) -> basalt_store::log::PlacedBatch {
            let placed = self.writer.append(log).expect("room");
            let at = placed.offset_bytes as usize;
            self.disk[at..at + placed.bytes.len()].copy_from_slice(&placed.bytes);
            for (entry, offset) in log.iter().zip(&placed.data_offsets_bytes) {
                self.sums.record(*offset, &entry.data);
            }
            placed
        }

        fn objects(&self) -> &PgObjects {
            &self.index[&self.pg]
        }

        /// The first 8 blocks of object `number` as the index reads them.
        fn read_object(&self, number: u64) -> Vec<u8> {
            let pieces = self
                .objects()
                .plan_read(object(number), 0, 8 * BLOCK_SIZE as u64);
            self.read_pieces(&pieces)
        }

        fn read_pieces(&self, pieces: &[basalt_store::extent_map::Piece]) -> Vec<u8> {
            use basalt_store::extent_map::Piece;
            pieces
                .iter()
                .flat_map(|piece| match *piece {
                    Piece::Mapped {
                        len_bytes,
                        device_offset_bytes,
                        ..
                    } => self.disk[device_offset_bytes as usize..][..len_bytes as usize].to_vec(),
                    Piece::Hole { len_bytes, .. } => vec![0; len_bytes as usize],
                })
                .collect()
        }

        /// A cleaner step's plan for the first batch.
        fn plan_first_batch(&self) -> Relocations {
            let read = |offset: u64, len: usize| -> Result<Vec<u8>, ()> {
                Ok(self.disk[offset as usize..offset as usize + len].to_vec())
            };
            let (first, second) = (&self.placed[0], &self.placed[1]);
            let limit = first.position + first.bytes.len() as u64;
            let found = read_durable(read, self.ring, (0, first.lsn), (limit, second.position))
                .expect("read");
            assert_eq!(found.batches.len(), 1);
            plan_relocations(found.batches, &self.raft, &self.index, &self.sums)
        }

        /// The relocations written at the head and the moves applied; the first batch is
        /// overwritten then, as its place would be once freed.
        fn relocate(&mut self, planned: Relocations) {
            let relocated: Vec<Entry> = planned.appends.concat();
            for (entry, moved) in relocated.iter().zip(&planned.moves) {
                let from = PayloadRef::from_meta(&entry.meta, moved.from.device_offset_bytes);
                assert_eq!(from, moved.from);
            }
            let batch = self.append(&relocated);
            for (moved, to) in planned.moves.iter().zip(&batch.data_offsets_bytes) {
                apply_move(moved, *to, &mut self.raft, &mut self.index);
            }
            let first = &self.placed[0];
            let old = first.offset_bytes as usize;
            self.disk[old..old + first.bytes.len()].fill(0xee);
        }
    }

    /// A payload the index reads only in part moves only those parts, and reads return the
    /// same after the moves, with the old copy gone. Moving whole payloads carried their
    /// overwritten bytes round the ring for good: an OSD at half its ring in live data,
    /// whose snapshot installs were then overwritten block by block, cleaned without end.
    #[test]
    fn only_what_the_index_reads_of_a_payload_moves() {
        let block = BLOCK_SIZE as u32;
        // Batch 1: 8 blocks of object 1, 2 of object 2. Batch 2 overwrites object 1 from
        // 512 bytes into its block 1 to 1 KiB into block 3, a block from 512 bytes into
        // its block 5, and its block 7. (Its first two writes straddle the object's blocks
        // in the log, so no block of the object is packed.)
        let mut written = Written::new(&[
            vec![(1, 0, 0xa1, 8 * block), (2, 0, 0xa2, 2 * block)],
            vec![
                (1, block + 512, 0xb1, 2 * block + 512),
                (1, 5 * block + 512, 0xb2, block),
                (1, 7 * block, 0xb3, block),
            ],
        ]);
        // Object 1's block 4 in batch 1 is damaged since: moved as it is, marked damaged.
        let data = written.placed[0].data_offsets_bytes.clone();
        written.disk[(data[0] + 4 * u64::from(block)) as usize + 100] ^= 0xff;
        let before = [written.read_object(1), written.read_object(2)];

        let planned = written.plan_first_batch();
        assert!(planned.packs.is_empty());
        // Object 1 still reads its block 0 and 512 bytes of block 1, from 1 KiB into block
        // 3 to 512 bytes into block 5 (a move from within a block), and from 512 bytes
        // into block 6 to its end; object 2 is read whole.
        let moved: Vec<(ObjectKey, u32, u32, u64)> = planned
            .moves
            .iter()
            .map(|m| {
                let from = m.from;
                (
                    from.object,
                    from.offset_bytes,
                    from.len_bytes,
                    from.device_offset_bytes,
                )
            })
            .collect();
        assert_eq!(
            moved,
            vec![
                (object(1), 0, block + 512, data[0]),
                (
                    object(1),
                    3 * block + 1024,
                    2 * block - 512,
                    data[0] + 3 * u64::from(block) + 1024
                ),
                (
                    object(1),
                    6 * block + 512,
                    block - 512,
                    data[0] + 6 * u64::from(block) + 512
                ),
                (object(2), 0, 2 * block, data[1]),
            ]
        );
        let bytes: usize = planned.appends.iter().flatten().map(|e| e.data.len()).sum();
        assert_eq!(bytes, 6 * BLOCK_SIZE - 512);
        // The second move's first two blocks at the new place hold bytes of the damaged
        // block.
        let damaged: Vec<&[u64]> = planned
            .moves
            .iter()
            .map(|m| m.damaged_blocks.as_slice())
            .collect();
        assert_eq!(damaged, [&[][..], &[0, 1][..], &[][..], &[][..]]);
        assert_eq!(planned.damaged, vec![written.pg]);
        written.relocate(planned);
        assert_eq!([written.read_object(1), written.read_object(2)], before);
    }

    proptest! {
        /// What [`PgObjects::checkpoint_bytes`] counts is at least what the index adds to a
        /// checkpoint, with the checksums of its blocks: the OSD reports itself full by it
        /// before a checkpoint outgrows its area.
        #[test]
        fn the_index_takes_no_more_of_a_checkpoint_than_counted(
            writes in proptest::collection::vec((0u64..3, 0u64..64, 1u64..16, 0u64..200), 1..80),
            spread in any::<bool>(),
        ) {
            // Each write in a block of its own (a run of checksums each), or next to others.
            let ring = Ring { start_bytes: 0, len_bytes: 4 << 20 };
            let sums = BlockSums::new(ring);
            for block in 0..1024u64 {
                sums.set(block * BLOCK_SIZE as u64, block as u32);
            }
            let mut objects = PgObjects::new();
            for (number, sector, sectors, device) in writes {
                let (offset, len) = (sector * 512, (sectors * 512).min(64 * 512 - sector * 512));
                let device = if spread { device * 2 * BLOCK_SIZE as u64 } else { device * 512 };
                objects.insert_extent(object(number), offset, len.max(512), device);
            }
            let pg = PgId { pool: PoolId(1), index: 0 };
            let bare = Checkpoint {
                pgs: vec![PgCheckpoint { pg, ..PgCheckpoint::default() }],
                ..Checkpoint::default()
            };
            let whole = complete_checkpoint(bare.clone(), vec![objects.clone()], &sums);
            // The body's length, from the header (the whole is padded to a block).
            let body = |checkpoint: &Checkpoint| {
                u64::from_le_bytes(checkpoint.encode()[56..64].try_into().expect("8 bytes"))
            };
            let added = body(&whole) - body(&bare);
            prop_assert!(added <= objects.checkpoint_bytes(), "{added} > {}", objects.checkpoint_bytes());
        }
    }

    /// A block of an object whose pieces lie in several blocks of the log (sectors written
    /// one at a time) is packed into one when the cleaner meets one of them: the pieces it
    /// did not read are read back from where they lie. Reads return the same after, with
    /// the step's batch gone, and the object keeps a block of the log per block of its
    /// own. If the pieces cannot be read back, what the step read of the block is moved
    /// as it was instead.
    #[test]
    fn blocks_written_a_sector_at_a_time_are_packed_when_the_cleaner_meets_them() {
        let (block, b) = (BLOCK_SIZE as u32, BLOCK_SIZE as u64);
        for read_back in [true, false] {
            // Batch 1: 4 blocks of object 1. Batch 2: two sectors of its block 1, each in a
            // block of the log of its own, and a sector of its block 6 alone.
            let mut written = Written::new(&[
                vec![(1, 0, 0xa1, 4 * block)],
                vec![
                    (1, block + 1024, 0xb1, 512),
                    (1, block + 2560, 0xb2, 512),
                    (1, 6 * block, 0xb3, 512),
                ],
            ]);
            let before = written.read_object(1);
            let objects = written.objects();
            // Unpacked, the pieces of block 1 keep the batch's block 1 in use (counted for
            // each of its three pieces, not next to each other in the object) and one
            // block per sector: 9 blocks counted, 5 once packed.
            assert_eq!(objects.occupied_bytes(), 9 * b);
            assert_eq!(objects.packable_bytes(), 4 * b);

            let mut planned = written.plan_first_batch();
            assert_eq!(planned.packs.len(), 1, "{:?}", planned.packs);
            let pack = &planned.packs[0];
            assert_eq!((pack.object, pack.block_start), (object(1), b));
            // What is left of the batch moves as it was: blocks 0, 2 and 3.
            let moved: Vec<(u32, u32)> = planned
                .moves
                .iter()
                .map(|m| (m.from.offset_bytes, m.from.len_bytes))
                .collect();
            assert_eq!(moved, [(0, block), (2 * block, 2 * block)]);
            // What the step read of block 1, should its pieces not be read back.
            let instead: Vec<(u32, u32)> = pack
                .instead
                .iter()
                .map(|(_, m)| (m.from.offset_bytes, m.from.len_bytes))
                .collect();
            assert_eq!(
                instead,
                [(block, 1024), (block + 1536, 1024), (block + 3072, 1024)]
            );
            let read = read_back.then(|| written.read_pieces(&pack.pieces));
            planned = planned.with_packs(vec![read]);
            written.relocate(planned);
            assert_eq!(written.read_object(1), before);
            // Packed: blocks 0, 2 and 3 moved, block 1 packed into one, and block 6's
            // sector. Not: the three parts of block 1 the step read moved, each into a
            // block of its own, and the two sectors where they were.
            let occupied = if read_back { 5 } else { 9 };
            assert_eq!(written.objects().occupied_bytes(), occupied * b);
            // Packed, the five pieces of block 1 lie in the new block as in the object: one
            // extent (each takes room in every checkpoint).
            let extents = written.objects().extents(object(1));
            let whole = extents
                .iter()
                .any(|&(at, len, _)| at <= b && at + len >= 2 * b);
            assert_eq!(whole, read_back, "{extents:?}");
        }
    }
}
