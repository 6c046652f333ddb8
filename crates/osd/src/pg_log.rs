//! Raft entries and hard states as entries of the OSD's log, and back.
//!
//! A raft entry whose data is an object operation is stored with that operation's kind and
//! meta, and the operation's payload as the log entry's data: the payload lands once, where
//! the PG's object index will point. Any other raft entry (an election's no-op, a
//! configuration change) is stored whole. A hard state is an entry of its own kind.
//!
//! Meta of `RAFT_OTHER`: raft entry type u8 at byte 0. Meta of `HARD_STATE`: term, vote,
//! commit (u64 each).

use std::collections::BTreeMap;

use basalt_common::{Epoch, PgId};
use basalt_replication::{EntryType, HardState, RaftEntry, Restored};
use basalt_store::batch::{Entry, META_SIZE};
use basalt_store::checkpoint::Checkpoint;
use basalt_store::log::ReplayedBatch;
use basalt_store::object_op::{ObjectOp, PayloadRef, PgObjects, kind};

use crate::log_device::RELOCATE;
use crate::snapshot::{SNAPSHOT_BEGIN, SNAPSHOT_INSTALLED, SNAPSHOT_WRITE};

/// Kind of a log entry holding a PG's raft hard state.
pub const HARD_STATE: u8 = 16;
/// Kind of a log entry recording that this OSD stopped hosting a PG (it was removed from
/// the PG's members): replay forgets what came before it.
pub const PG_REMOVED: u8 = 20;

/// The raft entry data of a map floor at `epoch` ([`kind::MAP_FLOOR`]).
pub fn map_floor_data(epoch: Epoch) -> Vec<u8> {
    let mut data = vec![kind::MAP_FLOOR];
    data.extend_from_slice(&epoch.0.to_le_bytes());
    data
}

/// The epoch of a map floor's raft entry data; `None` for any other data.
pub fn map_floor_of(data: &[u8]) -> Option<Epoch> {
    match data.split_first() {
        Some((&kind::MAP_FLOOR, epoch)) => Some(Epoch(u64::from_le_bytes(epoch.try_into().ok()?))),
        _ => None,
    }
}

/// The log entry that records `pg` removed here.
pub fn removed_entry(pg: PgId) -> Entry {
    Entry {
        kind: PG_REMOVED,
        pg,
        term: 0,
        index: 0,
        meta: [0u8; META_SIZE],
        data: Vec::new(),
    }
}

/// The log entries for one persist of a PG: its raft entries, then its hard state.
pub fn to_log_entries(
    pg: PgId,
    entries: &[RaftEntry],
    hard_state: Option<&HardState>,
) -> Vec<Entry> {
    let mut log = Vec::with_capacity(entries.len() + 1);
    for entry in entries {
        let object_op = (entry.get_entry_type() == EntryType::EntryNormal)
            .then(|| ObjectOp::decode(&entry.data).ok())
            .flatten();
        log.push(match object_op {
            Some(op) => {
                let (kind, meta) = (op.kind(), op.meta());
                Entry {
                    kind,
                    pg,
                    term: entry.term,
                    index: entry.index,
                    meta,
                    // The decoded payload moves into the log entry: no second copy.
                    data: match op {
                        ObjectOp::Write { data, .. } => data,
                        ObjectOp::Discard { .. } => Vec::new(),
                    },
                }
            }
            None => {
                let mut meta = [0u8; META_SIZE];
                meta[0] = entry.get_entry_type() as u8;
                Entry {
                    kind: kind::RAFT_OTHER,
                    pg,
                    term: entry.term,
                    index: entry.index,
                    meta,
                    data: entry.data.to_vec(),
                }
            }
        });
    }
    if let Some(hard_state) = hard_state {
        let mut meta = [0u8; META_SIZE];
        meta[0..8].copy_from_slice(&hard_state.term.to_le_bytes());
        meta[8..16].copy_from_slice(&hard_state.vote.to_le_bytes());
        meta[16..24].copy_from_slice(&hard_state.commit.to_le_bytes());
        log.push(Entry {
            kind: HARD_STATE,
            pg,
            term: hard_state.term,
            index: 0,
            meta,
            data: Vec::new(),
        });
    }
    log
}

/// Which of a PG's hard states its persists write. One that changes only the commit index
/// is not written on its own: raft needs term and vote durable, while a lost commit index
/// is learnt again from the leader. It rides along with the PG's next entries instead,
/// which saves a device write per client write on every replica.
#[derive(Debug, Clone, Default)]
pub struct HardStates {
    /// The last hard state raft handed out, and whether it is not written yet.
    last: Option<(HardState, bool)>,
}

impl HardStates {
    /// The hard state to write with a persist of raft's `hard_state` (if it changed) and
    /// entries, if any (`with_entries`).
    pub fn to_write(
        &mut self,
        hard_state: Option<HardState>,
        with_entries: bool,
    ) -> Option<HardState> {
        match (hard_state, &mut self.last) {
            (Some(new), Some((last, unwritten)))
                if !with_entries && last.term == new.term && last.vote == new.vote =>
            {
                *last = new;
                *unwritten = true;
                None
            }
            (Some(new), _) => {
                self.last = Some((new.clone(), false));
                Some(new)
            }
            (None, Some((last, unwritten))) if with_entries && *unwritten => {
                *unwritten = false;
                Some(last.clone())
            }
            (None, _) => None,
        }
    }
}

/// Why a log entry could not be turned back into raft state.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum PgLogError {
    /// A kind this OSD does not write.
    #[error("log entry of pg {pg} has unknown kind {kind}")]
    Kind {
        /// The PG.
        pg: PgId,
        /// The kind.
        kind: u8,
    },
    /// An object operation whose fields disagree.
    #[error("log entry {index} of pg {pg}: {reason}")]
    Malformed {
        /// The PG.
        pg: PgId,
        /// Raft index.
        index: u64,
        /// What is wrong.
        reason: String,
    },
}

/// What a checkpoint and replay rebuild for the PGs of an OSD.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RestoredPgs {
    /// Each PG's raft state.
    pub groups: BTreeMap<PgId, Restored>,
    /// Each PG's object index as of its applied index (from the checkpoint).
    pub objects: BTreeMap<PgId, PgObjects>,
}

/// Rebuilds every PG's raft state and object index from the checkpoint, if any, and the
/// log replayed after it.
pub fn restore(
    checkpoint: Option<&Checkpoint>,
    batches: &[ReplayedBatch],
) -> Result<RestoredPgs, PgLogError> {
    let mut restored = RestoredPgs::default();
    // Snapshots being received: their objects, until one is installed.
    let mut asides: BTreeMap<PgId, PgObjects> = BTreeMap::new();
    for pg in checkpoint.map(|c| &c.pgs[..]).unwrap_or_default() {
        let group = restored.groups.entry(pg.pg).or_default();
        group.compacted = (pg.compacted_index, pg.compacted_term);
        group.applied = pg.applied;
        group.confs = pg
            .confs
            .iter()
            .map(|(index, bytes)| {
                basalt_replication::decode_conf(bytes)
                    .map(|conf| (*index, conf))
                    .ok_or_else(|| PgLogError::Malformed {
                        pg: pg.pg,
                        index: *index,
                        reason: "undecodable configuration".to_string(),
                    })
            })
            .collect::<Result<_, PgLogError>>()?;
        group.hard_state = HardState {
            term: pg.term,
            vote: pg.vote,
            commit: pg.commit,
            ..HardState::default()
        };
        let entries: Vec<RaftEntry> = pg
            .entries
            .iter()
            .map(|retained| {
                let mut entry = RaftEntry {
                    term: retained.term,
                    index: retained.index,
                    data: retained.data.clone().into(),
                    ..RaftEntry::default()
                };
                entry.set_entry_type(entry_type_of(retained.entry_type).ok_or_else(|| {
                    PgLogError::Malformed {
                        pg: pg.pg,
                        index: retained.index,
                        reason: format!("raft entry type {}", retained.entry_type),
                    }
                })?);
                Ok(entry)
            })
            .collect::<Result<_, PgLogError>>()?;
        group.add(&entries, None);
        let objects = restored.objects.entry(pg.pg).or_default();
        for (key, extents) in &pg.objects {
            for (offset, len, device) in extents {
                objects.insert_extent(*key, *offset, *len, *device);
            }
        }
    }
    for batch in batches {
        for (entry, data_offset) in &batch.entries {
            if entry.kind == RELOCATE {
                // A move the checkpoint before it did not see: the old copy is still in
                // place (a segment is reused only after a later checkpoint), so the index
                // may keep pointing there.
                continue;
            }
            match entry.kind {
                SNAPSHOT_BEGIN => {
                    asides.insert(entry.pg, PgObjects::new());
                    continue;
                }
                SNAPSHOT_WRITE => {
                    let data = PayloadRef::from_meta(&entry.meta, *data_offset);
                    asides.entry(entry.pg).or_default().apply_ref(&data);
                    continue;
                }
                PG_REMOVED => {
                    restored.groups.remove(&entry.pg);
                    restored.objects.remove(&entry.pg);
                    asides.remove(&entry.pg);
                    continue;
                }
                SNAPSHOT_INSTALLED => {
                    // Its transfer began before the replay start: the checkpoint there was
                    // cut after the install (none is cut during a transfer), and holds it.
                    // (Replay can start at the batch that carries this entry.)
                    let Some(objects) = asides.remove(&entry.pg) else {
                        continue;
                    };
                    let (index, term) = (meta_u64(&entry.meta, 0), meta_u64(&entry.meta, 8));
                    let conf = basalt_replication::decode_conf(&entry.data).ok_or_else(|| {
                        PgLogError::Malformed {
                            pg: entry.pg,
                            index,
                            reason: "snapshot with an undecodable configuration".to_string(),
                        }
                    })?;
                    let group = restored.groups.entry(entry.pg).or_default();
                    group.entries.clear();
                    group.compacted = (index, term);
                    group.applied = index;
                    group.confs = vec![(index, conf)];
                    group.hard_state.commit = group.hard_state.commit.max(index);
                    restored.objects.insert(entry.pg, objects);
                    continue;
                }
                _ => {}
            }
            let group = restored.groups.entry(entry.pg).or_default();
            if entry.kind == HARD_STATE {
                let hard_state = HardState {
                    term: meta_u64(&entry.meta, 0),
                    vote: meta_u64(&entry.meta, 8),
                    commit: meta_u64(&entry.meta, 16),
                    ..HardState::default()
                };
                group.add(&[], Some(&hard_state));
                continue;
            }
            let raft_entry = if entry.kind == kind::WRITE && entry.data.is_empty() {
                // Replay left the payload on the device: the entry refers to it.
                RaftEntry {
                    term: entry.term,
                    index: entry.index,
                    data: PayloadRef::from_meta(&entry.meta, *data_offset)
                        .encode()
                        .into(),
                    ..RaftEntry::default()
                }
            } else {
                from_log_entry(entry)?
            };
            group.add(&[raft_entry], None);
        }
    }
    Ok(restored)
}

/// The u64 at byte `at` of an entry's meta.
fn meta_u64(meta: &[u8; META_SIZE], at: usize) -> u64 {
    u64::from_le_bytes(meta[at..at + 8].try_into().expect("8 bytes"))
}

/// The raft entry a log entry holds.
pub fn from_log_entry(entry: &Entry) -> Result<RaftEntry, PgLogError> {
    let mut raft_entry = RaftEntry {
        term: entry.term,
        index: entry.index,
        ..RaftEntry::default()
    };
    match entry.kind {
        kind::WRITE | kind::DISCARD => {
            let op =
                ObjectOp::from_parts(entry.kind, &entry.meta, &entry.data).map_err(|error| {
                    PgLogError::Malformed {
                        pg: entry.pg,
                        index: entry.index,
                        reason: error.to_string(),
                    }
                })?;
            raft_entry.data = op.encode().into();
        }
        kind::RAFT_OTHER => {
            let entry_type = entry_type_of(entry.meta[0]).ok_or_else(|| PgLogError::Malformed {
                pg: entry.pg,
                index: entry.index,
                reason: format!("raft entry type {}", entry.meta[0]),
            })?;
            raft_entry.set_entry_type(entry_type);
            raft_entry.data = entry.data.clone().into();
        }
        kind => return Err(PgLogError::Kind { pg: entry.pg, kind }),
    }
    Ok(raft_entry)
}

/// The raft entry type stored in a `RAFT_OTHER` entry's meta (or a checkpoint).
pub fn entry_type_of(code: u8) -> Option<EntryType> {
    [
        EntryType::EntryNormal,
        EntryType::EntryConfChange,
        EntryType::EntryConfChangeV2,
    ]
    .into_iter()
    .find(|entry_type| *entry_type as u8 == code)
}

#[cfg(test)]
mod tests {
    use super::*;
    use basalt_common::{ImageId, Lsn, ObjectKey, PoolId};
    use proptest::prelude::*;

    const PG: PgId = PgId {
        pool: PoolId(1),
        index: 3,
    };

    fn arbitrary_raft_entry() -> impl Strategy<Value = RaftEntry> {
        let write = (
            any::<u64>(),
            0u32..1 << 20,
            proptest::collection::vec(any::<u8>(), 0..5000),
        )
            .prop_map(|(number, offset_bytes, data)| {
                ObjectOp::Write {
                    object: ObjectKey {
                        image: ImageId(9),
                        number,
                    },
                    offset_bytes,
                    data,
                }
                .encode()
            });
        let discard = (any::<u64>(), any::<u32>(), any::<u32>()).prop_map(
            |(number, offset_bytes, len_bytes)| {
                ObjectOp::Discard {
                    object: ObjectKey {
                        image: ImageId(9),
                        number,
                    },
                    offset_bytes,
                    len_bytes,
                }
                .encode()
            },
        );
        let other = proptest::collection::vec(any::<u8>(), 0..40);
        let floor = any::<u64>().prop_map(|epoch| map_floor_data(Epoch(epoch)));
        (
            1u64..1000,
            1u64..100,
            prop_oneof![write, discard, other, floor],
            any::<bool>(),
        )
            .prop_map(|(index, term, data, conf_change)| {
                let mut entry = RaftEntry {
                    index,
                    term,
                    ..RaftEntry::default()
                };
                if conf_change {
                    entry.set_entry_type(EntryType::EntryConfChange);
                }
                entry.data = data.into();
                entry
            })
    }

    proptest! {
        /// Raft entries and a hard state, written to the log and read back, are what raft gave.
        #[test]
        fn raft_state_survives_the_log(entries in proptest::collection::vec(arbitrary_raft_entry(), 0..6), term in 1u64..50, vote in 0u64..4, commit in 0u64..1000) {
            let hard_state = HardState { term, vote, commit, ..HardState::default() };
            let log = to_log_entries(PG, &entries, Some(&hard_state));
            for (entry, raft_entry) in log.iter().zip(&entries) {
                prop_assert_eq!(&from_log_entry(entry).expect("decodes"), raft_entry);
            }
            let batch = ReplayedBatch { lsn: Lsn(1), position: 0, offset_bytes: 4096, entries: log.into_iter().map(|e| (e, 8192)).collect(), damaged_entries: Vec::new() };
            let restored = restore(None, &[batch]).expect("restores");
            let group = &restored.groups[&PG];
            prop_assert_eq!(&group.hard_state, &hard_state);
        }
    }

    /// Raft entry `index` of `term`: a write of 4 KiB of `fill` at `offset_bytes`.
    fn write_entry(
        object: ObjectKey,
        offset_bytes: u32,
        fill: u8,
        index: u64,
        term: u64,
    ) -> RaftEntry {
        let op = ObjectOp::Write {
            object,
            offset_bytes,
            data: vec![fill; 4096],
        };
        RaftEntry {
            index,
            term,
            data: op.encode().into(),
            ..RaftEntry::default()
        }
    }

    /// A map floor is no object operation, no payload reference, no scrub marker, and
    /// gives back its epoch; other data gives none.
    #[test]
    fn map_floors_are_told_apart_from_other_entries() {
        let data = map_floor_data(Epoch(77));
        assert_eq!(map_floor_of(&data), Some(Epoch(77)));
        assert!(ObjectOp::decode(&data).is_err());
        assert!(basalt_store::object_op::PayloadRef::decode(&data).is_none());
        assert!(!crate::scrub::is_marker(&data));
        assert_eq!(map_floor_of(&data[..8]), None, "short");
        assert_eq!(map_floor_of(crate::scrub::MARKER), None);
        let write = write_entry(
            ObjectKey {
                image: ImageId(1),
                number: 0,
            },
            0,
            1,
            1,
            1,
        );
        assert_eq!(map_floor_of(&write.data), None);
    }

    #[test]
    fn an_installed_snapshot_replaces_the_pg_and_an_unfinished_one_is_dropped() {
        use crate::snapshot::{Chunk, chunk_entries, installed_entry};
        let object = ObjectKey {
            image: ImageId(1),
            number: 4,
        };
        let before = to_log_entries(PG, &[write_entry(object, 0, 1, 3, 1)], None);
        let chunk = Chunk {
            objects: vec![(object, vec![(8192, vec![2; 4096])])],
            next: None,
            applied: 0,
            map_floor: 0,
        };
        let mut received = chunk_entries(PG, chunk, true);
        let batch = |entries: Vec<Entry>, first_offset: u64| ReplayedBatch {
            lsn: Lsn(1),
            position: 0,
            offset_bytes: 0,
            entries: entries
                .into_iter()
                .enumerate()
                .map(|(n, mut e)| {
                    // Replay leaves payloads on the device.
                    if [kind::WRITE, SNAPSHOT_WRITE].contains(&e.kind) {
                        e.data.clear();
                    }
                    (e, first_offset + n as u64 * 4096)
                })
                .collect(),
            damaged_entries: Vec::new(),
        };
        // Not installed (a crash before the marker): the PG is as it was.
        let unfinished = restore(
            None,
            &[batch(before.clone(), 0), batch(received.clone(), 1 << 20)],
        )
        .expect("restores");
        assert_eq!(unfinished.groups[&PG].entries.len(), 1);
        assert!(!unfinished.objects.contains_key(&PG));
        // Installed at index 10: the raft log restarts there and the objects are the copy.
        let conf = basalt_replication::ConfState::from((vec![1, 2, 4], vec![3]));
        received.push(installed_entry(
            PG,
            10,
            2,
            basalt_replication::encode_conf(&conf),
        ));
        let installed = restore(
            None,
            &[batch(before.clone(), 0), batch(received.clone(), 1 << 20)],
        )
        .expect("restores");
        let group = &installed.groups[&PG];
        assert!(group.entries.is_empty());
        assert_eq!((group.compacted, group.applied), ((10, 2), 10));
        assert_eq!(
            group.confs,
            vec![(10, conf)],
            "the configuration of the snapshot"
        );
        assert_eq!(group.hard_state.commit, 10);
        let objects = &installed.objects[&PG];
        // SNAPSHOT_BEGIN is the first entry: the run's payload is the second.
        assert_eq!(
            objects.extents(object),
            vec![(8192, 4096, (1 << 20) + 4096)]
        );
        // Replay starting at the batch that carries the install (the checkpoint before it
        // was cut after the install) keeps what the checkpoint holds.
        let marker = received.last().cloned().expect("the install entry");
        let alone = restore(None, &[batch(vec![marker], 2 << 20)]).expect("restores");
        assert!(
            !alone.objects.contains_key(&PG),
            "no empty index replaces anything"
        );
        assert!(alone.groups.get(&PG).is_none_or(|group| group.applied == 0));
        // Removed from the PG afterwards: replay forgets it, and what follows starts anew.
        let after = to_log_entries(
            PG,
            &[RaftEntry {
                index: 1,
                term: 5,
                ..RaftEntry::default()
            }],
            None,
        );
        let removed = restore(
            None,
            &[
                batch(before, 0),
                batch(received, 1 << 20),
                batch(vec![removed_entry(PG)], 2 << 20),
                batch(after, 3 << 20),
            ],
        )
        .expect("restores");
        let group = &removed.groups[&PG];
        assert_eq!(group.compacted, (0, 0));
        assert_eq!(group.entries.len(), 1);
        assert!(group.confs.is_empty());
        assert!(!removed.objects.contains_key(&PG));
    }

    #[test]
    fn a_write_keeps_only_its_payload_as_data_and_replay_finds_it() {
        let object = ObjectKey {
            image: ImageId(1),
            number: 2,
        };
        let raft_entry = write_entry(object, 4096, 7, 5, 2);
        let log = to_log_entries(PG, std::slice::from_ref(&raft_entry), None);
        assert_eq!(
            log[0].data,
            vec![7; 4096],
            "the payload alone is the log entry's data"
        );
        assert_eq!(log[0].kind, kind::WRITE);
        let batch = ReplayedBatch {
            lsn: Lsn(1),
            position: 0,
            offset_bytes: 0,
            entries: vec![(log[0].clone(), 4096)],
            damaged_entries: Vec::new(),
        };
        let restored = restore(None, &[batch]).expect("restores");
        assert_eq!(restored.groups[&PG].entries, vec![raft_entry.clone()]);
        // As the OSD replays: the payload stays on the device, the entry refers to it.
        let mut trimmed = log[0].clone();
        trimmed.data.clear();
        let batch = ReplayedBatch {
            lsn: Lsn(1),
            position: 0,
            offset_bytes: 0,
            entries: vec![(trimmed, 4096)],
            damaged_entries: Vec::new(),
        };
        let restored = restore(None, &[batch]).expect("restores");
        let reference = PayloadRef::decode(&restored.groups[&PG].entries[0].data);
        assert_eq!(reference, PayloadRef::of_write(&raft_entry.data, 4096));
        assert_eq!(reference.map(|r| r.device_offset_bytes), Some(4096));
    }

    #[test]
    fn unknown_kinds_are_refused() {
        let entry = Entry {
            kind: 99,
            pg: PG,
            term: 1,
            index: 1,
            meta: [0; META_SIZE],
            data: Vec::new(),
        };
        assert_eq!(
            from_log_entry(&entry),
            Err(PgLogError::Kind { pg: PG, kind: 99 })
        );
    }

    /// A hard state that changes only the commit index waits for the PG's next entries;
    /// one that changes the term or the vote is written at once.
    #[test]
    fn a_commit_index_alone_rides_with_the_next_entries() {
        let hs = |term, vote, commit| HardState {
            term,
            vote,
            commit,
            ..HardState::default()
        };
        let mut states = HardStates::default();
        // The first is written: nothing says what is durable yet.
        assert_eq!(states.to_write(Some(hs(1, 2, 5)), false), Some(hs(1, 2, 5)));
        assert_eq!(states.to_write(Some(hs(1, 2, 6)), false), None);
        assert_eq!(states.to_write(Some(hs(1, 2, 7)), false), None);
        assert_eq!(states.to_write(None, false), None);
        assert_eq!(states.to_write(None, true), Some(hs(1, 2, 7)));
        assert_eq!(states.to_write(None, true), None);
        assert_eq!(states.to_write(Some(hs(1, 2, 8)), true), Some(hs(1, 2, 8)));
        assert_eq!(states.to_write(Some(hs(1, 2, 9)), false), None);
        assert_eq!(states.to_write(Some(hs(2, 0, 9)), false), Some(hs(2, 0, 9)));
        assert_eq!(states.to_write(None, true), None);
    }
}
