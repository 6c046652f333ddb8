//! A PG replica's raft log in memory, as raft-rs reads it.
//!
//! Like raft-rs's `MemStorage`, but an entry's data may be replaced once it is durable by a
//! short *reference* to where its payload lies on the device ([`PgStorage::replace_data`]),
//! so that memory holds metadata, not client data. When raft reads entries to send them to
//! a follower, a [`Hydrate`] function turns references back into whole entries; entries read
//! to be applied stay references (applying needs only where the payload is).
//!
//! The log is compacted behind the applied index ([`PgStorage::compact`]) once a checkpoint
//! holds the state it led to. A follower that needs compacted entries gets a snapshot: its
//! metadata (the compaction point) travels in raft's message, and the follower pulls the
//! PG's objects outside raft before it hands the message to raft
//! ([`PgStorage::apply_snapshot`] then resets its log there).
//!
//! Configurations are kept as of the compaction point (a snapshot carries that one) and as
//! of each configuration change applied after it (raft restarts from the last one).

use std::sync::Arc;

use raft::eraftpb::{ConfState, Entry, HardState, Snapshot, SnapshotMetadata};
use raft::{GetEntriesContext, RaftState, Storage, StorageError};

/// Turns an entry's data back into what was proposed, if the data is a reference; `None`
/// leaves it as it is. A failure to read the device is fatal (the OSD stops and replays);
/// a payload that cannot be given ([`PayloadUnavailable`]: its copy here is damaged) holds
/// the entries from it on back from the follower, and raft offers them again later.
pub type Hydrate = Arc<dyn Fn(&[u8]) -> Result<Option<Vec<u8>>, PayloadUnavailable> + Send + Sync>;

/// A payload this replica cannot send (its copy is damaged): another replica, leading
/// instead, sends its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PayloadUnavailable;

/// One PG replica's raft log.
#[derive(Clone)]
pub struct PgStorage {
    hard_state: HardState,
    /// The configuration as of the compaction point (index at or before it), then after
    /// each configuration change applied since (by the change's index). Never empty.
    confs: Vec<(u64, ConfState)>,
    /// Index of the last compacted entry (0: none), and its term.
    compacted: (u64, u64),
    /// Entries from index `compacted.0 + 1`.
    entries: Vec<Entry>,
    /// The last entry raft counts applied ([`PgStorage::set_applied`]): a snapshot a
    /// follower asks for may be as of it.
    applied: u64,
    hydrate: Option<Hydrate>,
}

impl Default for PgStorage {
    fn default() -> Self {
        Self {
            hard_state: HardState::default(),
            confs: vec![(0, ConfState::default())],
            compacted: (0, 0),
            entries: Vec::new(),
            applied: 0,
            hydrate: None,
        }
    }
}

impl PgStorage {
    /// An empty log with these voters.
    pub fn new(conf_state: ConfState, hydrate: Option<Hydrate>) -> Self {
        Self {
            confs: vec![(0, conf_state)],
            hydrate,
            ..Self::default()
        }
    }

    /// A log restored from a checkpoint: compacted up to `compacted` (index, term), with
    /// the configurations kept as of it and of the changes applied after it (in index
    /// order; an empty list counts as no voters).
    pub fn restored(
        confs: Vec<(u64, ConfState)>,
        hydrate: Option<Hydrate>,
        compacted: (u64, u64),
    ) -> Self {
        Self {
            confs: if confs.is_empty() {
                vec![(0, ConfState::default())]
            } else {
                confs
            },
            hydrate,
            compacted,
            ..Self::default()
        }
    }

    /// Appends entries; any from the first new index on are replaced (a truncated log).
    /// Entries at or before the compaction point are skipped (they are applied already).
    pub fn append(&mut self, entries: &[Entry]) -> raft::Result<()> {
        let skip = entries
            .iter()
            .take_while(|e| e.index <= self.compacted.0)
            .count();
        let entries = &entries[skip..];
        let Some(first) = entries.first() else {
            return Ok(());
        };
        let last = self.last();
        if first.index == 0 || first.index > last + 1 {
            return Err(raft::Error::Store(StorageError::Other(
                format!(
                    "entries from index {} do not follow the log's last index {last}",
                    first.index
                )
                .into(),
            )));
        }
        self.entries
            .truncate((first.index - self.compacted.0 - 1) as usize);
        self.entries.extend_from_slice(entries);
        Ok(())
    }

    /// Drops the entries up to `index` (at most the last one): the state they led to is
    /// kept elsewhere (a checkpoint).
    pub fn compact(&mut self, index: u64) {
        let index = index.min(self.last());
        if index <= self.compacted.0 {
            return;
        }
        let term = self.term(index).unwrap_or(0);
        self.entries.drain(..(index - self.compacted.0) as usize);
        self.compacted = (index, term);
        // The configuration as of the new compaction point is the last one at or before it.
        let at_or_before = self.confs.partition_point(|(at, _)| *at <= index);
        self.confs.drain(..at_or_before.saturating_sub(1));
    }

    /// Records the configuration that a change at `index` led to, once applied.
    pub fn record_conf(&mut self, index: u64, conf_state: ConfState) {
        // Never the first: it is as of the compaction point, which is applied already.
        let keep = self.confs.partition_point(|(at, _)| *at < index).max(1);
        self.confs.truncate(keep);
        self.confs.push((index, conf_state));
    }

    /// Resets the log to a snapshot: everything up to its index is the state the snapshot
    /// brought, and the log goes on after it.
    pub fn apply_snapshot(&mut self, metadata: &SnapshotMetadata) {
        self.entries.clear();
        self.compacted = (metadata.index, metadata.term);
        self.confs = vec![(metadata.index, metadata.get_conf_state().clone())];
        self.hard_state.commit = self.hard_state.commit.max(metadata.index);
    }

    /// Records that raft counts the entries up to `index` applied.
    pub fn set_applied(&mut self, index: u64) {
        self.applied = index;
    }

    /// The last compacted entry's index and term ((0, 0): none).
    pub fn compacted(&self) -> (u64, u64) {
        self.compacted
    }

    /// The entries kept, from the one after the compaction point.
    pub fn retained(&self) -> &[Entry] {
        &self.entries
    }

    /// The configuration as of the last change applied.
    pub fn conf_state(&self) -> &ConfState {
        &self.confs.last().expect("never empty").1
    }

    /// The configurations kept: as of the compaction point, then after each change
    /// applied since, with the changes' indexes.
    pub fn confs(&self) -> &[(u64, ConfState)] {
        &self.confs
    }

    /// Records the hard state.
    pub fn set_hard_state(&mut self, hard_state: HardState) {
        self.hard_state = hard_state;
    }

    /// Replaces the data of entry `index` if it is still of `term`: `replace` gets the
    /// current data and returns the new, or `None` to leave it.
    pub fn replace_data(
        &mut self,
        index: u64,
        term: u64,
        replace: impl FnOnce(&[u8]) -> Option<Vec<u8>>,
    ) {
        let Some(entry) = index
            .checked_sub(self.compacted.0 + 1)
            .and_then(|at| self.entries.get_mut(at as usize))
        else {
            return;
        };
        if entry.term != term {
            return;
        }
        if let Some(data) = replace(&entry.data) {
            entry.data = data.into();
        }
    }

    fn last(&self) -> u64 {
        self.compacted.0 + self.entries.len() as u64
    }
}

impl Storage for PgStorage {
    fn initial_state(&self) -> raft::Result<RaftState> {
        Ok(RaftState::new(
            self.hard_state.clone(),
            self.conf_state().clone(),
        ))
    }

    fn entries(
        &self,
        low: u64,
        high: u64,
        max_size: impl Into<Option<u64>>,
        context: GetEntriesContext,
    ) -> raft::Result<Vec<Entry>> {
        if low <= self.compacted.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        if high > self.last() + 1 || low > high {
            return Err(raft::Error::Store(StorageError::Unavailable));
        }
        let max_size = max_size.into();
        let mut entries = Vec::new();
        let mut size = 0u64;
        let base = self.compacted.0 + 1;
        for entry in &self.entries[(low - base) as usize..(high - base) as usize] {
            let mut entry = entry.clone();
            // Raft reads with an asynchronous context only to send entries to a follower:
            // those must carry their payload.
            if context.can_async()
                && let Some(hydrate) = &self.hydrate
            {
                match hydrate(&entry.data) {
                    Ok(Some(data)) => entry.data = data.into(),
                    Ok(None) => {}
                    // The entries before it go; raft asks for the rest again later.
                    Err(PayloadUnavailable) if !entries.is_empty() => break,
                    Err(PayloadUnavailable) => {
                        return Err(raft::Error::Store(StorageError::LogTemporarilyUnavailable));
                    }
                }
            }
            size += u64::from(protobuf::Message::compute_size(&entry));
            if !entries.is_empty() && max_size.is_some_and(|max| size > max) {
                break;
            }
            entries.push(entry);
        }
        Ok(entries)
    }

    fn term(&self, index: u64) -> raft::Result<u64> {
        if index == self.compacted.0 {
            return Ok(self.compacted.1);
        }
        if index < self.compacted.0 {
            return Err(raft::Error::Store(StorageError::Compacted));
        }
        match self.entries.get((index - self.compacted.0 - 1) as usize) {
            Some(entry) => Ok(entry.term),
            None => Err(raft::Error::Store(StorageError::Unavailable)),
        }
    }

    fn first_index(&self) -> raft::Result<u64> {
        Ok(self.compacted.0 + 1)
    }

    fn last_index(&self) -> raft::Result<u64> {
        Ok(self.last())
    }

    /// A snapshot, metadata only: the follower fetches the PG's objects itself (their
    /// state is at or after the snapshot's index; applying the entries after it makes the
    /// copy exact, since object operations set their ranges whatever was there).
    ///
    /// Its index is the compaction point, or the last configuration change applied if that
    /// is later (or the last entry applied, for a follower that asks for a snapshot): raft refuses a snapshot whose configuration does not hold the follower
    /// (a new member is in it only from the change that added it on), and the configuration
    /// must be the one as of the snapshot's index.
    fn snapshot(&self, request_index: u64, _to: u64) -> raft::Result<Snapshot> {
        let (changed, conf) = self.confs.last().expect("never empty");
        let mut index = self.compacted.0.max(*changed);
        if request_index > index && request_index <= self.applied {
            // A follower asked for one at least as recent as its own last entry, or this
            // log's end if that is before (to have its data rebuilt,
            // `MultiRaft::request_snapshot`): as of the last entry applied, whose
            // configuration is the last one recorded.
            index = self.applied;
        }
        if (self.compacted.0 == 0 && request_index == 0) || index < request_index {
            return Err(raft::Error::Store(
                StorageError::SnapshotTemporarilyUnavailable,
            ));
        }
        let mut snapshot = Snapshot::default();
        let metadata = snapshot.mut_metadata();
        metadata.index = index;
        metadata.term = self.term(index)?;
        metadata.set_conf_state(conf.clone());
        Ok(snapshot)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64, data: &[u8]) -> Entry {
        Entry {
            index,
            term,
            data: data.to_vec().into(),
            ..Entry::default()
        }
    }

    /// An entry whose payload cannot be read back is not sent, nor those after it: raft
    /// gets the ones before it, or word to try again later.
    #[test]
    fn entries_stop_before_a_payload_that_cannot_be_read_back() {
        let hydrate: Hydrate = Arc::new(|data: &[u8]| match data {
            b"ref:damaged" => Err(PayloadUnavailable),
            _ => Ok(None),
        });
        let mut storage = PgStorage::new(ConfState::default(), Some(hydrate));
        storage
            .append(&[entry(1, 1, b"a"), entry(2, 1, b"b"), entry(3, 1, b"c")])
            .expect("append");
        storage.replace_data(2, 1, |_| Some(b"ref:damaged".to_vec()));
        let sending = GetEntriesContext::empty(true);
        let sent = storage.entries(1, 4, None, sending).expect("entries");
        assert_eq!(sent.len(), 1);
        assert_eq!(&sent[0].data[..], b"a");
        assert!(matches!(
            storage.entries(2, 4, None, GetEntriesContext::empty(true)),
            Err(raft::Error::Store(StorageError::LogTemporarilyUnavailable))
        ));
        // Applying reads references only: all of them.
        let applied = storage
            .entries(1, 4, None, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(applied.len(), 3);
    }

    #[test]
    fn appends_truncate_and_references_hydrate_only_for_sending() {
        let hydrate: Hydrate = Arc::new(|data: &[u8]| {
            Ok(data
                .strip_prefix(b"ref:")
                .map(|rest| [b"full:", rest].concat()))
        });
        let mut storage = PgStorage::new(ConfState::default(), Some(hydrate));
        storage
            .append(&[entry(1, 1, b"a"), entry(2, 1, b"b"), entry(3, 1, b"c")])
            .expect("append");
        storage
            .append(&[entry(2, 2, b"x")])
            .expect("truncating append");
        assert_eq!(storage.last_index().expect("last"), 2);
        assert_eq!(storage.term(2).expect("term"), 2);
        assert!(storage.append(&[entry(5, 2, b"gap")]).is_err());
        storage.replace_data(2, 1, |_| Some(b"ref:stale term".to_vec()));
        storage.replace_data(2, 2, |_| Some(b"ref:x".to_vec()));
        let applied = storage
            .entries(1, 3, None, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(&applied[1].data[..], b"ref:x");
        let sent = storage
            .entries(1, 3, None, GetEntriesContext::empty(true))
            .expect("entries");
        assert_eq!(&sent[1].data[..], b"full:x");
        assert_eq!(&sent[0].data[..], b"a");
        let mut compacted = storage.clone();
        compacted.compact(1);
        assert_eq!(compacted.first_index().expect("first"), 2);
        assert_eq!(compacted.term(1).expect("term of the compaction point"), 1);
        assert!(compacted.term(0).is_err());
        assert!(
            compacted
                .entries(1, 3, None, GetEntriesContext::empty(false))
                .is_err()
        );
        let kept = compacted
            .entries(2, 3, None, GetEntriesContext::empty(false))
            .expect("kept");
        assert_eq!(&kept[0].data[..], b"ref:x");
        compacted
            .append(&[entry(1, 1, b"old"), entry(2, 2, b"x"), entry(3, 2, b"y")])
            .expect("append over the compaction point");
        assert_eq!(compacted.last_index().expect("last"), 3);
        compacted.replace_data(3, 2, |_| Some(b"ref:y".to_vec()));
        assert_eq!(&compacted.retained()[1].data[..], b"ref:y");
        let snapshot = compacted
            .snapshot(0, 2)
            .expect("a snapshot at the compaction point");
        assert_eq!(
            (snapshot.get_metadata().index, snapshot.get_metadata().term),
            (1, 1)
        );
        assert!(
            storage.snapshot(0, 2).is_err(),
            "nothing compacted: no snapshot"
        );
        let metadata = SnapshotMetadata {
            index: 7,
            term: 3,
            ..SnapshotMetadata::default()
        };
        compacted.apply_snapshot(&metadata);
        assert_eq!(compacted.first_index().expect("first"), 8);
        assert_eq!(compacted.last_index().expect("last"), 7);
        assert_eq!(compacted.term(7).expect("term of the snapshot"), 3);
        assert_eq!(
            compacted.initial_state().expect("state").hard_state.commit,
            7
        );
        compacted
            .append(&[entry(8, 3, b"z")])
            .expect("append after the snapshot");
        let limited = storage
            .entries(1, 3, 1, GetEntriesContext::empty(false))
            .expect("entries");
        assert_eq!(limited.len(), 1, "at least one entry, then the size limit");
        assert!(
            storage
                .entries(1, 4, None, GetEntriesContext::empty(false))
                .is_err()
        );
    }

    #[test]
    fn snapshots_carry_the_configuration_of_their_index_and_raft_restarts_from_the_last() {
        let conf = |voters: &[u64]| ConfState::from((voters.to_vec(), vec![]));
        let mut storage = PgStorage::new(conf(&[1, 2, 3]), None);
        let entries: Vec<Entry> = (1..=6).map(|i| entry(i, 1, b"e")).collect();
        storage.append(&entries).expect("append");
        storage.record_conf(2, conf(&[1, 2, 3, 4]));
        storage.record_conf(4, conf(&[1, 2, 4]));
        assert_eq!(storage.conf_state(), &conf(&[1, 2, 4]));
        assert_eq!(
            storage.initial_state().expect("state").conf_state,
            conf(&[1, 2, 4])
        );
        storage.compact(3);
        let snapshot = storage.snapshot(3, 4).expect("snapshot");
        assert_eq!(
            (
                snapshot.get_metadata().index,
                snapshot.get_metadata().get_conf_state()
            ),
            (4, &conf(&[1, 2, 4])),
            "a snapshot as of the last change applied, past the compaction point"
        );
        let kept: Vec<u64> = storage.confs().iter().map(|(at, _)| *at).collect();
        assert_eq!(kept, [2, 4]);
        // A change applied again after a restart replaces what followed it.
        storage.record_conf(4, conf(&[1, 2, 5]));
        assert_eq!(storage.confs().len(), 2);
        storage.compact(5);
        let snapshot = storage.snapshot(5, 4).expect("snapshot");
        assert_eq!(
            (
                snapshot.get_metadata().index,
                snapshot.get_metadata().get_conf_state()
            ),
            (5, &conf(&[1, 2, 5])),
            "at the compaction point, with the configuration as of it"
        );
        let restored = PgStorage::restored(storage.confs().to_vec(), None, (5, 1));
        assert_eq!(restored.conf_state(), &conf(&[1, 2, 5]));
    }
}
