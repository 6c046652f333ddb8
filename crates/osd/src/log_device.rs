//! The OSD's log on its device, with group commit.
//!
//! Callers submit appends (entries of any PGs); one task writes them. While a batch is being
//! written, new appends wait in the queue; when the write completes, everything queued (up
//! to what one batch holds) goes out as the next batch, in one durable write (O_DIRECT with
//! `RWF_DSYNC`). One sync thus covers the writes of many PGs, and an append is answered
//! only once its batch is durable.
//!
//! A failed write leaves the device in an unknown state: the log device then refuses every
//! later append rather than guess (the OSD must restart and replay).

use std::collections::VecDeque;
use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use basalt_common::Lsn;
use basalt_io::{DmaBuf, FileEngine, OpenOptions};
use basalt_store::batch::{self, BLOCK_SIZE, DATA_SIZE_MAX, ENTRY_COUNT_MAX, Entry};
use basalt_store::log::{LogWriter, Replayed, replay_trimmed};
use basalt_store::object_op::kind;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::superblock::{Superblock, SuperblockError};

/// Bytes zeroed per write while formatting.
const FORMAT_CHUNK_BYTES: usize = 1 << 20;

/// Why the log device failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LogDeviceError {
    /// The device could not be opened, read or written.
    #[error("{path}: {source}")]
    Io {
        /// The device.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// Block 0 is not a usable superblock.
    #[error("{path}: {source}")]
    Superblock {
        /// The device.
        path: String,
        /// What is wrong.
        source: SuperblockError,
    },
    /// The device is too small for a superblock and a log.
    #[error("{path}: {size_bytes} bytes is too small for an osd log (at least {min_bytes})")]
    TooSmall {
        /// The device.
        path: String,
        /// Its size.
        size_bytes: u64,
        /// The least it must hold.
        min_bytes: u64,
    },
    /// One append holds more than a batch can.
    #[error(
        "append of {entries} entries and {data_bytes} data bytes exceeds one batch ({ENTRY_COUNT_MAX} entries, {DATA_SIZE_MAX} bytes)"
    )]
    TooLarge {
        /// Entries in the append.
        entries: usize,
        /// Data bytes in the append.
        data_bytes: usize,
    },
    /// The log region is full (segments and their cleaning are still to come); once an
    /// append is refused so, every later one is too.
    #[error("the log is full")]
    Full,
    /// An earlier write failed; nothing more is written until the OSD restarts.
    #[error("the log device failed earlier and refuses writes: {reason}")]
    Failed {
        /// The first failure.
        reason: String,
    },
    /// The writer task is gone.
    #[error("the log device is closed")]
    Closed,
}

/// Where an append landed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Appended {
    /// The batch that carried it.
    pub lsn: Lsn,
    /// Where each of its entries' data lies on the device.
    pub data_offsets_bytes: Vec<u64>,
}

/// Counters of what the log device wrote.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LogStats {
    /// Batches written (device writes, each durable).
    pub batches: u64,
    /// Appends answered.
    pub appends: u64,
    /// Entries written.
    pub entries: u64,
    /// Bytes written to the device (headers, data, padding).
    pub device_bytes: u64,
    /// Bytes of entry data.
    pub data_bytes: u64,
}

impl LogStats {
    /// Device bytes per data byte (1.0 is the ideal; a lone 4 KiB append costs 2.0).
    pub fn write_amplification(&self) -> f64 {
        if self.data_bytes == 0 {
            0.0
        } else {
            self.device_bytes as f64 / self.data_bytes as f64
        }
    }
}

#[derive(Default)]
struct Counters {
    batches: AtomicU64,
    appends: AtomicU64,
    entries: AtomicU64,
    device_bytes: AtomicU64,
    data_bytes: AtomicU64,
    /// Bytes left between the log's head and the end of its region.
    free_bytes: AtomicU64,
}

struct Append {
    entries: Vec<Entry>,
    done: oneshot::Sender<Result<Appended, LogDeviceError>>,
}

/// An open log device.
pub struct LogDevice {
    queue: mpsc::UnboundedSender<Append>,
    counters: Arc<Counters>,
    task: JoinHandle<()>,
}

/// A device just opened: the log device and what its log held.
pub struct Opened {
    /// The log device, appending after the replayed log.
    pub device: LogDevice,
    /// The intact batches found.
    pub replayed: Replayed,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> LogDeviceError + '_ {
    move |source| LogDeviceError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl LogDevice {
    /// Formats the device at `path` (an existing file or block device): writes a superblock
    /// and zeroes the log region, so nothing from an earlier life can be read as log.
    pub async fn format(path: &Path, uuid: [u8; 16]) -> Result<(), LogDeviceError> {
        let engine = FileEngine::open(path, &OpenOptions::default()).map_err(|error| {
            LogDeviceError::Io {
                path: path.display().to_string(),
                source: std::io::Error::other(error.to_string()),
            }
        })?;
        let block = BLOCK_SIZE as u64;
        let size = engine.size_bytes() / block * block;
        let min_bytes = block + batch::batch_size(&[]) as u64 + (DATA_SIZE_MAX + BLOCK_SIZE) as u64;
        if size < min_bytes {
            return Err(LogDeviceError::TooSmall {
                path: path.display().to_string(),
                size_bytes: size,
                min_bytes,
            });
        }
        let superblock = Superblock {
            log_start_bytes: block,
            log_end_bytes: size,
            first_lsn: Lsn::FIRST,
            uuid,
        };
        let mut offset = block;
        let mut zeroes = DmaBuf::zeroed(FORMAT_CHUNK_BYTES);
        while offset < size {
            let len = (size - offset).min(FORMAT_CHUNK_BYTES as u64) as usize;
            zeroes.truncate(len);
            zeroes = engine
                .write(offset, zeroes, false)
                .await
                .map_err(io_error(path))?;
            offset += len as u64;
        }
        engine.sync().await.map_err(io_error(path))?;
        // The superblock last: a device with a valid superblock has a zeroed log region.
        engine
            .write(0, DmaBuf::from_slice(&superblock.encode()), true)
            .await
            .map_err(io_error(path))?;
        Ok(())
    }

    /// Opens a formatted device, replays its log, and starts the writer after it.
    pub async fn open(path: &Path) -> Result<Opened, LogDeviceError> {
        let engine = FileEngine::open(path, &OpenOptions::default()).map_err(|error| {
            LogDeviceError::Io {
                path: path.display().to_string(),
                source: std::io::Error::other(error.to_string()),
            }
        })?;
        let block = engine
            .read(0, DmaBuf::zeroed(BLOCK_SIZE))
            .await
            .map_err(io_error(path))?;
        let superblock =
            Superblock::decode(&block).map_err(|source| LogDeviceError::Superblock {
                path: path.display().to_string(),
                source,
            })?;
        if superblock.log_end_bytes > engine.size_bytes() {
            return Err(LogDeviceError::Superblock {
                path: path.display().to_string(),
                source: SuperblockError::Layout {
                    reason: "log region past the end of the device",
                },
            });
        }
        let replayed = read_log(path, superblock).await.map_err(io_error(path))?;
        let writer = LogWriter::new(
            replayed.next_offset_bytes,
            replayed.next_lsn,
            superblock.log_end_bytes,
        );
        let (queue, appends) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::default());
        counters.free_bytes.store(
            superblock
                .log_end_bytes
                .saturating_sub(replayed.next_offset_bytes),
            Ordering::Relaxed,
        );
        let end = superblock.log_end_bytes;
        let task = tokio::spawn(write_loop(engine, writer, appends, counters.clone(), end));
        Ok(Opened {
            device: LogDevice {
                queue,
                counters,
                task,
            },
            replayed,
        })
    }

    /// Queues an append at once (in submission order) and returns its completion, which
    /// comes when the batch carrying it is durable.
    pub fn submit(
        &self,
        entries: Vec<Entry>,
    ) -> impl std::future::Future<Output = Result<Appended, LogDeviceError>> + use<> {
        let (done, answer) = oneshot::channel();
        let data_bytes = batch::batch_size(&entries) - BLOCK_SIZE;
        let refused = if entries.len() > ENTRY_COUNT_MAX || data_bytes > DATA_SIZE_MAX {
            Some(LogDeviceError::TooLarge {
                entries: entries.len(),
                data_bytes,
            })
        } else {
            self.queue
                .send(Append { entries, done })
                .err()
                .map(|_| LogDeviceError::Closed)
        };
        async move {
            if let Some(error) = refused {
                return Err(error);
            }
            answer.await.unwrap_or(Err(LogDeviceError::Closed))
        }
    }

    /// Bytes the log can still take (space is not reclaimed yet: this only shrinks).
    pub fn free_bytes(&self) -> u64 {
        self.counters.free_bytes.load(Ordering::Relaxed)
    }

    /// What has been written so far.
    pub fn stats(&self) -> LogStats {
        let c = &self.counters;
        LogStats {
            batches: c.batches.load(Ordering::Relaxed),
            appends: c.appends.load(Ordering::Relaxed),
            entries: c.entries.load(Ordering::Relaxed),
            device_bytes: c.device_bytes.load(Ordering::Relaxed),
            data_bytes: c.data_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for LogDevice {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Replays the log region, on the blocking pool (object write payloads are left on the
/// device; their entries keep where they lie): replay reads a header, then a batch, at a
/// time, through positioned reads of the file (buffered reads see what O_DIRECT wrote,
/// since direct writes invalidate the page cache over their range).
async fn read_log(path: &Path, superblock: Superblock) -> std::io::Result<Replayed> {
    let file = std::fs::File::open(path)?;
    tokio::task::spawn_blocking(move || {
        use std::os::unix::fs::FileExt;
        let read = |offset: u64, len: usize| -> std::io::Result<Vec<u8>> {
            let mut bytes = vec![0u8; len];
            file.read_exact_at(&mut bytes, offset)?;
            Ok(bytes)
        };
        // An object write's payload stays on the device: replay keeps where it lies.
        replay_trimmed(
            read,
            superblock.log_start_bytes,
            superblock.first_lsn,
            superblock.log_end_bytes,
            |entry| {
                if entry.kind == kind::WRITE {
                    entry.data = Vec::new();
                }
            },
        )
    })
    .await
    .map_err(|error| std::io::Error::other(format!("replay task failed: {error}")))?
}

async fn write_loop(
    engine: FileEngine,
    mut writer: LogWriter,
    mut appends: mpsc::UnboundedReceiver<Append>,
    counters: Arc<Counters>,
    end_bytes: u64,
) {
    let mut waiting: VecDeque<Append> = VecDeque::new();
    let mut failed: Option<String> = None;
    // Once an append did not fit, none after it is written either: a later, smaller one
    // would land where the refused one should have been, and replay would take the log
    // for whole without it.
    let mut full = false;
    loop {
        if waiting.is_empty() {
            match appends.recv().await {
                Some(append) => waiting.push_back(append),
                None => return,
            }
        }
        while let Ok(append) = appends.try_recv() {
            waiting.push_back(append);
        }
        if let Some(reason) = &failed {
            for append in waiting.drain(..) {
                let _ = append.done.send(Err(LogDeviceError::Failed {
                    reason: reason.clone(),
                }));
            }
            continue;
        }
        if full {
            for append in waiting.drain(..) {
                let _ = append.done.send(Err(LogDeviceError::Full));
            }
            continue;
        }
        // Take as many whole appends as one batch holds (each fits alone: submit checks).
        let mut group: Vec<Append> = Vec::new();
        let (mut entry_count, mut data_bytes) = (0usize, 0usize);
        while let Some(next) = waiting.front() {
            let next_data = batch::batch_size(&next.entries) - BLOCK_SIZE;
            if !group.is_empty()
                && (entry_count + next.entries.len() > ENTRY_COUNT_MAX
                    || data_bytes + next_data > DATA_SIZE_MAX)
            {
                break;
            }
            entry_count += next.entries.len();
            data_bytes += next_data;
            group.push(waiting.pop_front().expect("front exists"));
        }
        // The entries move into the batch (no copy of their data); each caller keeps its
        // answer channel and how many entries and data bytes were its own.
        let mut entries: Vec<Entry> = Vec::with_capacity(entry_count);
        let mut callers = Vec::with_capacity(group.len());
        for append in group {
            let data: u64 = append
                .entries
                .iter()
                .map(|entry| entry.data.len() as u64)
                .sum();
            callers.push((append.done, append.entries.len(), data));
            entries.extend(append.entries);
        }
        let placed = match writer.append(&entries) {
            Ok(placed) => placed,
            Err(_) => {
                tracing::error!("the log is full; it takes no more appends");
                full = true;
                for (done, _, _) in callers {
                    let _ = done.send(Err(LogDeviceError::Full));
                }
                continue;
            }
        };
        let device_bytes = placed.bytes.len() as u64;
        counters.free_bytes.store(
            end_bytes.saturating_sub(placed.offset_bytes + device_bytes),
            Ordering::Relaxed,
        );
        let written = engine
            .write(placed.offset_bytes, DmaBuf::from_slice(&placed.bytes), true)
            .await;
        if let Err(error) = written {
            let reason = format!("batch {} at {}: {error}", placed.lsn.0, placed.offset_bytes);
            tracing::error!(%reason, "log write failed; the log device refuses further writes");
            for (done, _, _) in callers {
                let _ = done.send(Err(LogDeviceError::Failed {
                    reason: reason.clone(),
                }));
            }
            failed = Some(reason);
            continue;
        }
        counters.batches.fetch_add(1, Ordering::Relaxed);
        counters
            .device_bytes
            .fetch_add(device_bytes, Ordering::Relaxed);
        let mut offsets = placed.data_offsets_bytes.into_iter();
        for (done, count, data) in callers {
            counters.appends.fetch_add(1, Ordering::Relaxed);
            counters.entries.fetch_add(count as u64, Ordering::Relaxed);
            counters.data_bytes.fetch_add(data, Ordering::Relaxed);
            let data_offsets_bytes = offsets.by_ref().take(count).collect();
            let _ = done.send(Ok(Appended {
                lsn: placed.lsn,
                data_offsets_bytes,
            }));
        }
    }
}
