//! The monitor's raft log on disk: an append-only file of checksummed records, each the
//! entries and hard state of one persist, synced before raft is told they are durable.
//!
//! Record: body length u32, CRC32C of the body u32 (little-endian), then the body (JSON).
//! Replay stops at the first record that is cut short or fails its checksum: a torn tail
//! from a crash mid-append, which was never acknowledged.

use std::fs::{File, OpenOptions};
use std::io::{Read, Write};
use std::path::Path;

use basalt_replication::{EntryType, HardState, RaftEntry, Restored};
use serde::{Deserialize, Serialize};

/// The largest record replay accepts.
const RECORD_SIZE_MAX: usize = 64 << 20;

#[derive(Serialize, Deserialize)]
struct Record {
    /// (index, term, entry type, data).
    entries: Vec<(u64, u64, i32, Vec<u8>)>,
    /// (term, vote, commit).
    hard_state: Option<(u64, u64, u64)>,
}

/// An open journal, appending after what replay found.
pub struct Journal {
    file: File,
}

fn entry_type(value: i32) -> EntryType {
    match value {
        1 => EntryType::EntryConfChange,
        2 => EntryType::EntryConfChangeV2,
        _ => EntryType::EntryNormal,
    }
}

impl Journal {
    /// Opens (or creates) the journal and replays it into raft state. A torn tail is cut off.
    pub fn open(path: &Path) -> std::io::Result<(Self, Restored)> {
        let mut bytes = Vec::new();
        match File::open(path) {
            Ok(mut file) => {
                file.read_to_end(&mut bytes)?;
            }
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => return Err(error),
        }
        let mut restored = Restored::default();
        let mut at = 0usize;
        while let Some(header) = bytes.get(at..at + 8) {
            let len = u32::from_le_bytes(header[0..4].try_into().expect("4 bytes")) as usize;
            let crc = u32::from_le_bytes(header[4..8].try_into().expect("4 bytes"));
            let Some(body) = bytes.get(at + 8..at + 8 + len) else {
                break; // cut short: the torn tail of a crash mid-append
            };
            let record = (len <= RECORD_SIZE_MAX && crc32c::crc32c(body) == crc)
                .then(|| serde_json::from_slice::<Record>(body).ok())
                .flatten();
            let Some(record) = record else {
                if at + 8 + len < bytes.len() {
                    // Records follow a bad one: this is not a torn tail but damage, and
                    // cutting here would drop acknowledged changes.
                    return Err(std::io::Error::new(
                        std::io::ErrorKind::InvalidData,
                        format!(
                            "{}: the record at byte {at} is corrupt and {} bytes follow it",
                            path.display(),
                            bytes.len() - at - 8 - len
                        ),
                    ));
                }
                break; // the last record, written in part: the torn tail
            };
            let entries: Vec<RaftEntry> = record
                .entries
                .into_iter()
                .map(|(index, term, kind, data)| {
                    let mut entry = RaftEntry {
                        index,
                        term,
                        data: data.into(),
                        ..RaftEntry::default()
                    };
                    entry.set_entry_type(entry_type(kind));
                    entry
                })
                .collect();
            let hard_state = record.hard_state.map(|(term, vote, commit)| HardState {
                term,
                vote,
                commit,
                ..HardState::default()
            });
            restored.add(&entries, hard_state.as_ref());
            at += 8 + len;
        }
        let file = OpenOptions::new()
            .create(true)
            .write(true)
            .truncate(false)
            .open(path)?;
        // Cut a torn tail so that new records follow the last intact one.
        file.set_len(at as u64)?;
        file.sync_all()?;
        let mut journal = Self { file };
        use std::io::Seek;
        journal.file.seek(std::io::SeekFrom::End(0))?;
        Ok((journal, restored))
    }

    /// Appends a persist and makes it durable.
    pub fn append(
        &mut self,
        entries: &[RaftEntry],
        hard_state: Option<&HardState>,
    ) -> std::io::Result<()> {
        let record = Record {
            entries: entries
                .iter()
                .map(|e| (e.index, e.term, e.get_entry_type() as i32, e.data.to_vec()))
                .collect(),
            hard_state: hard_state.map(|hs| (hs.term, hs.vote, hs.commit)),
        };
        let body = serde_json::to_vec(&record).map_err(std::io::Error::other)?;
        let mut framed = Vec::with_capacity(body.len() + 8);
        framed.extend_from_slice(&(body.len() as u32).to_le_bytes());
        framed.extend_from_slice(&crc32c::crc32c(&body).to_le_bytes());
        framed.extend_from_slice(&body);
        self.file.write_all(&framed)?;
        self.file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn entry(index: u64, term: u64, data: &[u8]) -> RaftEntry {
        RaftEntry {
            index,
            term,
            data: data.to_vec().into(),
            ..RaftEntry::default()
        }
    }

    #[test]
    fn replay_returns_what_was_appended_and_cuts_a_torn_tail() {
        let dir = std::env::temp_dir().join(format!("basalt-journal-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("dir");
        let path = dir.join("mon.journal");
        let (mut journal, restored) = Journal::open(&path).expect("open");
        assert!(restored.entries.is_empty());
        let hs = HardState {
            term: 2,
            vote: 1,
            commit: 1,
            ..HardState::default()
        };
        journal
            .append(&[entry(1, 1, b"a"), entry(2, 1, b"b")], Some(&hs))
            .expect("append");
        journal.append(&[entry(2, 2, b"c")], None).expect("append");
        drop(journal);
        // A torn record: half of a third append.
        let mut bytes = std::fs::read(&path).expect("read");
        let intact = bytes.len();
        bytes.extend_from_slice(&[200, 0, 0, 0, 1, 2, 3, 4, b'{']);
        std::fs::write(&path, &bytes).expect("write");
        let (mut journal, restored) = Journal::open(&path).expect("reopen");
        let got: Vec<(u64, u64, Vec<u8>)> = restored
            .entries
            .iter()
            .map(|e| (e.index, e.term, e.data.to_vec()))
            .collect();
        assert_eq!(got, [(1, 1, b"a".to_vec()), (2, 2, b"c".to_vec())]);
        assert_eq!(restored.hard_state.term, 2);
        assert_eq!(
            std::fs::metadata(&path).expect("meta").len() as usize,
            intact
        );
        journal
            .append(&[entry(3, 2, b"d")], None)
            .expect("append after the cut");
        drop(journal);
        let (_, restored) = Journal::open(&path).expect("reopen");
        assert_eq!(restored.entries.len(), 3);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
