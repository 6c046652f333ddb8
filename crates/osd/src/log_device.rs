//! The OSD's log on its device, with group commit, used as a ring.
//!
//! Callers submit appends (entries of any PGs); one task writes them. While a batch is being
//! written, new appends wait in the queue; when the write completes, everything queued (up
//! to what one batch holds) goes out as the next batch, in one durable write (O_DIRECT with
//! `RWF_DSYNC`). One sync thus covers the writes of many PGs, and an append is answered
//! only once its batch is durable.
//!
//! The log region is a ring (`basalt_store::log`): the OSD frees its tail
//! ([`LogDevice::set_tail`]) once a checkpoint no longer needs it and the cleaner moved its
//! live data, and the writer reuses it only behind the reads still in flight there
//! ([`LogDevice::pin`]). Appends wait while the ring is full. The last [`FLOOR_BYTES`] of
//! free space are kept for the cleaner's relocations ([`LogDevice::submit_relocation`]),
//! which may overtake waiting appends: they free space, and their order does not matter.
//!
//! Two checkpoint areas sit between the superblock and the log; [`LogDevice::open`] takes
//! the newest valid checkpoint and replays the log from where it says.
//!
//! A failed write leaves the device in an unknown state: the log device then refuses every
//! later append rather than guess (the OSD must restart and replay).

use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use basalt_common::Lsn;
use basalt_io::{AllocateMode, DmaBuf, FileEngine, OpenOptions};
use basalt_store::batch::{self, BLOCK_SIZE, DATA_SIZE_MAX, ENTRY_COUNT_MAX, Entry};
use basalt_store::block_sums::BlockSums;
use basalt_store::checkpoint::{Checkpoint, CheckpointError};
use basalt_store::log::{
    DamagedBatch, LogWriter, Replayed, Ring, read_damaged, read_durable, replay_sparing,
};
use basalt_store::object_op::kind;
use tokio::sync::{Notify, mpsc, oneshot};
use tokio::task::JoinHandle;

use crate::superblock::{Superblock, SuperblockError};

/// The largest batch: a header block and the most data.
pub const MAX_BATCH_BYTES: u64 = (BLOCK_SIZE + DATA_SIZE_MAX) as u64;
/// Free space only the cleaner's relocations may use: what one cleaner step moves (a
/// largest batch and a block) and one skipped lap end (less than a batch); see
/// [`crate::reclaim::step_limit`].
pub const FLOOR_BYTES: u64 = 2 * MAX_BATCH_BYTES + BLOCK_SIZE as u64;

/// How long the writer waits after a batch with entries before it writes an empty batch
/// after it, if nothing else came. Replay tells a batch damaged at rest from one torn by a
/// crash by the intact batch after it (a torn batch is always the last): without one, the
/// last batch of a log idle since, damaged, would be taken for torn and its entries
/// (acknowledged writes, votes) dropped. So only batches written within this time before a
/// crash are in doubt.
const FENCE_AFTER: std::time::Duration = std::time::Duration::from_secs(1);

/// Bytes zeroed per write while formatting.
const FORMAT_CHUNK_BYTES: usize = 1 << 20;

/// How formatting leaves a device's log region: zeroes either way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fill {
    /// Zeroes written over it: the space is allocated once, so the log's writes later
    /// overwrite in place and a sync need not record new extents (the default).
    Zeroes,
    /// A hole punched over it: quick, and a file takes space only as the log first reaches
    /// it (those first writes cost the allocation). For test and development clusters.
    Sparse,
}

/// Kind of a log entry that moves live data out of the ring's tail (local to one replica,
/// never replicated; replay skips it, see `docs/internals/store.md`). Meta as a write's;
/// term and index are the raft entry's whose payload it carries, or 0.
pub const RELOCATE: u8 = 5;

/// The kinds of log entries whose data is an object's payload, with the rest of the entry
/// in its descriptor: the object index and raft entries refer to the data where it lies,
/// and replay keeps only that place. Replay on start takes such an entry whose data was
/// damaged at rest (its blocks are marked damaged, and the PG's copy is rebuilt).
pub const PAYLOAD_KINDS: [u8; 3] = [kind::WRITE, RELOCATE, crate::snapshot::SNAPSHOT_WRITE];

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
    /// The device is too small for a superblock, checkpoints and a log.
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
    /// A checkpoint does not fit its area.
    #[error("a checkpoint of {bytes} bytes exceeds its area of {area_bytes} bytes")]
    CheckpointTooLarge {
        /// Its size.
        bytes: u64,
        /// The area's.
        area_bytes: u64,
    },
    /// A batch of the log was damaged after it was written (the one after it is intact):
    /// what the log held past it cannot be trusted to be whole.
    #[error(
        "{path}: the log is damaged: the batch of lsn {lsn} at ring position {position} fails \
         its checks ({error}), though the batch written after it (at {next_position}) is \
         intact, so it was written whole and has changed since; the osd does not start on a \
         device that lost records of its own (client data damaged so is marked damaged and \
         rebuilt from the other replicas; this is not that). Mark it out (`basalt osd out ID`) so that its \
         PGs are copied from the other replicas, then remove it (`basalt osd rm ID`) and \
         give the disk a fresh device"
    )]
    Damaged {
        /// The device.
        path: String,
        /// The damaged batch's LSN.
        lsn: u64,
        /// Its position in the ring.
        position: u64,
        /// What is wrong with it.
        error: String,
        /// Where the intact batch after it lies.
        next_position: u64,
    },
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
    /// That batch's ring position.
    pub position: u64,
    /// The ring position just after that batch: with the next LSN, where a replay that
    /// must see everything up to this append may start at the latest.
    pub end_position: u64,
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
    /// Bytes of checkpoints written (outside the log's ring).
    pub checkpoint_bytes: u64,
}

impl LogStats {
    /// Device bytes per data byte (1.0 is the ideal; a lone 4 KiB append costs 2.0, and 3.0
    /// with the empty batch written after it when nothing follows it within a second).
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
    checkpoint_bytes: AtomicU64,
    /// The size of the last checkpoint written (or being written).
    last_checkpoint_bytes: AtomicU64,
    /// The position after the last batch placed.
    head_position: AtomicU64,
    /// The writer may reuse the ring before this position: the tail the checkpoints
    /// freed, or the first position a read in flight still needs if that is lower.
    tail_position: AtomicU64,
    /// Milliseconds of quiet after which the writer puts an empty batch after the last
    /// (see [`FENCE_AFTER`]); 0 for never.
    fence_after_ms: AtomicU64,
}

/// What the writer may reuse: the tail the checkpoints freed, held back by reads in flight.
struct Tail {
    state: Mutex<TailState>,
    counters: Arc<Counters>,
    moved: Arc<Notify>,
}

#[derive(Default)]
struct TailState {
    /// The ring before this position is free as far as checkpoints go.
    freed: u64,
    /// Positions reads in flight start at, each with its number of reads.
    pins: BTreeMap<u64, usize>,
}

impl Tail {
    fn lock(&self) -> std::sync::MutexGuard<'_, TailState> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Tells the writer where it may reuse the ring up to, waking it if that moved on.
    fn publish(&self, state: &TailState) {
        let reusable = state
            .pins
            .keys()
            .next()
            .map_or(state.freed, |&pinned| pinned.min(state.freed));
        let before = self
            .counters
            .tail_position
            .swap(reusable, Ordering::Relaxed);
        debug_assert!(reusable >= before, "the reusable tail went back");
        if reusable > before {
            self.moved.notify_one();
        }
    }
}

/// A read in flight on the log device: until it is dropped, the ring from its position on
/// is not reused (see [`LogDevice::pin`]).
#[must_use = "the read is protected only while its pin lives"]
pub struct ReadPin {
    tail: Arc<Tail>,
    position: u64,
}

impl ReadPin {
    /// The ring position it holds the writer back from.
    pub fn position(&self) -> u64 {
        self.position
    }
}

impl Drop for ReadPin {
    fn drop(&mut self) {
        let mut state = self.tail.lock();
        if let Some(count) = state.pins.get_mut(&self.position) {
            *count -= 1;
            if *count == 0 {
                state.pins.remove(&self.position);
            }
        }
        self.tail.publish(&state);
    }
}

struct Append {
    entries: Vec<Entry>,
    /// A relocation may use the reserve and overtake waiting appends.
    relocation: bool,
    done: oneshot::Sender<Result<Appended, LogDeviceError>>,
}

/// The most a checkpoint's device write carries ([`LogDevice::write_checkpoint_in`]).
pub const CHECKPOINT_WRITE_BYTES: usize = 1 << 30;

/// An open log device.
pub struct LogDevice {
    queue: mpsc::UnboundedSender<Append>,
    counters: Arc<Counters>,
    tail: Arc<Tail>,
    ring: Ring,
    reserve_bytes: u64,
    superblock: Superblock,
    engine: Arc<FileEngine>,
    path: String,
    task: JoinHandle<()>,
    sums: Arc<BlockSums>,
}

/// A device just opened: the log device and what its log held.
pub struct Opened {
    /// The log device, appending after the replayed log.
    pub device: LogDevice,
    /// The newest valid checkpoint, if any: replay started where it says.
    pub checkpoint: Option<Checkpoint>,
    /// The intact batches found after the checkpoint (or from the start).
    pub replayed: Replayed,
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> LogDeviceError + '_ {
    move |source| LogDeviceError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn open_engine(path: &Path) -> Result<FileEngine, LogDeviceError> {
    FileEngine::open(path, &engine_options()).map_err(|error| LogDeviceError::Io {
        path: path.display().to_string(),
        source: std::io::Error::other(error.to_string()),
    })
}

/// How the OSD opens its device: an O_DIRECT io_uring submitted from the OSD's own thread
/// (inline), so that a log write hands off to no other thread on its way to the disk.
pub fn engine_options() -> OpenOptions {
    OpenOptions {
        inline: true,
        ..OpenOptions::default()
    }
}

/// The layout of a device of `size` bytes: checkpoint areas of a 64th of it each (at least
/// 1 MiB; an extent of the index takes 24 bytes), then the log.
fn layout(size: u64, uuid: [u8; 16]) -> Superblock {
    let block = BLOCK_SIZE as u64;
    let area = (size / 64).max(1 << 20).div_ceil(block) * block;
    Superblock {
        log_start_bytes: block + 2 * area,
        log_end_bytes: size / block * block,
        first_lsn: Lsn::FIRST,
        uuid,
        checkpoint_start_bytes: block,
        checkpoint_size_bytes: area,
    }
}

impl LogDevice {
    /// Formats the device at `path` (an existing file or block device): writes a superblock
    /// and zeroes the checkpoint areas and the log region, so nothing from an earlier life
    /// can be read as log or checkpoint (and the ring is allocated space, overwritten in
    /// place from then on).
    pub async fn format(path: &Path, uuid: [u8; 16]) -> Result<(), LogDeviceError> {
        Self::format_as(path, uuid, Fill::Zeroes).await
    }

    /// [`LogDevice::format`], the log region filled as `fill` says.
    pub async fn format_as(path: &Path, uuid: [u8; 16], fill: Fill) -> Result<(), LogDeviceError> {
        let engine = open_engine(path)?;
        let superblock = layout(engine.size_bytes(), uuid);
        let size = superblock.log_end_bytes;
        // Room for client writes besides the reserve.
        let min_bytes = superblock.log_start_bytes + 6 * MAX_BATCH_BYTES;
        if size < min_bytes {
            return Err(LogDeviceError::TooSmall {
                path: path.display().to_string(),
                size_bytes: size,
                min_bytes,
            });
        }
        let mut offset = BLOCK_SIZE as u64;
        if fill == Fill::Sparse {
            match engine
                .allocate(AllocateMode::PunchHole, offset, size - offset)
                .await
            {
                Ok(()) => offset = size,
                // Zeroes written instead where holes cannot be punched.
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "no hole punched; zeroes written instead")
                }
            }
        }
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

    /// Opens a formatted device, loads its newest checkpoint, replays the log after it, and
    /// starts the writer after that.
    pub async fn open(path: &Path) -> Result<Opened, LogDeviceError> {
        let engine = open_engine(path)?;
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
        let ring = Ring {
            start_bytes: superblock.log_start_bytes,
            len_bytes: superblock.log_end_bytes - superblock.log_start_bytes,
        };
        let (checkpoint, checkpoint_bytes) = read_checkpoints(path, superblock)
            .await
            .map_err(io_error(path))?
            .map_or((None, 0), |(checkpoint, len)| (Some(checkpoint), len));
        let (start, lsn, tail) = match &checkpoint {
            Some(c) => (c.replay_position, c.replay_lsn, c.tail_position),
            None => (0, superblock.first_lsn, 0),
        };
        // What the checkpoint knows of the blocks its index refers to, then what the
        // batches replayed wrote after it, then the checkpoint's poisoned blocks: a copy
        // the cleaner moved and poisoned may lie after the replay start (relocations do
        // not move it), and replay would take its bytes for data. No batch written after
        // the checkpoint lies where its index refers: those places are not free yet.
        let sums = Arc::new(BlockSums::new(ring));
        if let Some(checkpoint) = &checkpoint {
            sums.load(&checkpoint.block_sums, &[]);
        }
        let limit = tail + ring.len_bytes;
        let replayed = read_log(path, ring, (start, lsn), (limit, limit), Some(sums.clone()))
            .await
            .map_err(io_error(path))?;
        if let Some(damage) = &replayed.damaged {
            return Err(LogDeviceError::Damaged {
                path: path.display().to_string(),
                lsn: damage.lsn.0,
                position: damage.position,
                error: damage.error.to_string(),
                next_position: damage.next_position,
            });
        }
        if let Some(checkpoint) = &checkpoint {
            sums.load(&[], &checkpoint.poisoned_blocks);
        }
        let writer = LogWriter::new(ring, replayed.next_position, replayed.next_lsn, tail);
        let (queue, appends) = mpsc::unbounded_channel();
        let counters = Arc::new(Counters::default());
        counters
            .last_checkpoint_bytes
            .store(checkpoint_bytes, Ordering::Relaxed);
        counters
            .fence_after_ms
            .store(FENCE_AFTER.as_millis() as u64, Ordering::Relaxed);
        counters
            .head_position
            .store(replayed.next_position, Ordering::Relaxed);
        counters.tail_position.store(tail, Ordering::Relaxed);
        let tail_moved = Arc::new(Notify::new());
        // The OSD keeps the reserve free of client writes: room for raft's own entries on
        // replicas fuller than their leader (each leader admits writes by its own free
        // space; the cleaner's moves and checkpoints make replicas differ by a few steps),
        // and for the cleaner. Appends other than relocations may use all of it but the
        // floor: what one cleaner step needs.
        let reserve_bytes = (ring.len_bytes / 8).clamp(2 * FLOOR_BYTES, 256 << 20)
            / BLOCK_SIZE as u64
            * BLOCK_SIZE as u64
            + FLOOR_BYTES;
        let task = tokio::spawn(write_loop(
            engine,
            writer,
            appends,
            counters.clone(),
            tail_moved.clone(),
            FLOOR_BYTES,
            sums.clone(),
        ));
        let tail = Arc::new(Tail {
            state: Mutex::new(TailState {
                freed: tail,
                pins: BTreeMap::new(),
            }),
            counters: counters.clone(),
            moved: tail_moved,
        });
        Ok(Opened {
            device: LogDevice {
                queue,
                counters,
                tail,
                ring,
                reserve_bytes,
                superblock,
                engine: Arc::new(open_engine(path)?),
                path: path.display().to_string(),
                task,
                sums,
            },
            checkpoint,
            replayed,
        })
    }

    fn enqueue(
        &self,
        entries: Vec<Entry>,
        relocation: bool,
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
                .send(Append {
                    entries,
                    relocation,
                    done,
                })
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

    /// Queues an append at once (in submission order) and returns its completion, which
    /// comes when the batch carrying it is durable.
    pub fn submit(
        &self,
        entries: Vec<Entry>,
    ) -> impl std::future::Future<Output = Result<Appended, LogDeviceError>> + use<> {
        self.enqueue(entries, false)
    }

    /// Queues the cleaner's relocations: they may use the reserve, and go before appends
    /// that wait for space.
    pub fn submit_relocation(
        &self,
        entries: Vec<Entry>,
    ) -> impl std::future::Future<Output = Result<Appended, LogDeviceError>> + use<> {
        self.enqueue(entries, true)
    }

    /// Frees the ring before `position` (it only moves forward): the writer reuses it
    /// behind the reads still in flight there.
    pub fn set_tail(&self, position: u64) {
        let mut state = self.tail.lock();
        state.freed = state.freed.max(position);
        self.tail.publish(&state);
    }

    /// The ring is free before this position as far as checkpoints go (reads in flight
    /// may hold its reuse back a little longer).
    pub fn tail_position(&self) -> u64 {
        self.tail.lock().freed
    }

    /// Keeps the ring from being reused under a read of the log region at these device
    /// offsets (each at the start of a block it reads, in data the index or a retained
    /// entry still refers to, so at or after the tail): until the pin is dropped, however
    /// far checkpoints free the ring, the writer stops before the first of them. Without
    /// it, a read planned before the cleaner moved its data could find it overwritten by a
    /// later lap. `None` when there is no offset.
    pub fn pin(&self, device_offsets: impl IntoIterator<Item = u64>) -> Option<ReadPin> {
        let region = self.ring.start_bytes..self.ring.start_bytes + self.ring.len_bytes;
        let mut state = self.tail.lock();
        // The window starts at the tail the writer goes by, read under the lock: every
        // pin is at or after it, so it never moves back.
        let from = self.counters.tail_position.load(Ordering::Relaxed);
        let position = device_offsets
            .into_iter()
            .filter(|offset| region.contains(offset))
            .map(|offset| self.ring.position_at(offset, from))
            .min()?;
        debug_assert!(
            position < self.counters.head_position.load(Ordering::Relaxed),
            "a read of the log beyond its head"
        );
        *state.pins.entry(position).or_default() += 1;
        Some(ReadPin {
            tail: self.tail.clone(),
            position,
        })
    }

    /// Bytes of the ring not in use (the reserve included), as far as checkpoints go: what
    /// the cleaner, checkpoints and write admission reason from. Reads in flight may hold
    /// the writer back from the last of it for as long as they take (appends then wait).
    pub fn free_bytes(&self) -> u64 {
        (self.tail_position() + self.ring.len_bytes).saturating_sub(self.head_position())
    }

    /// The ring position where the next batch goes.
    pub fn head_position(&self) -> u64 {
        self.counters.head_position.load(Ordering::Relaxed)
    }

    /// Free bytes kept from client writes (see [`FLOOR_BYTES`] for what only the cleaner
    /// may use).
    pub fn reserve_bytes(&self) -> u64 {
        self.reserve_bytes
    }

    /// The log region.
    pub fn ring(&self) -> Ring {
        self.ring
    }

    /// Bytes of each checkpoint area.
    pub fn checkpoint_area_bytes(&self) -> u64 {
        self.superblock.checkpoint_size_bytes
    }

    /// Writes the checkpoint that `build` gives durably to area `area` (0 or 1). `build`
    /// and the encoding run on the blocking pool: a checkpoint of a large index takes a
    /// while to list and encode.
    pub fn write_checkpoint<B: FnOnce() -> Checkpoint + Send + 'static>(
        &self,
        area: usize,
        build: B,
    ) -> impl std::future::Future<Output = Result<(), LogDeviceError>> + use<B> {
        self.write_checkpoint_in(area, build, CHECKPOINT_WRITE_BYTES)
    }

    /// [`LogDevice::write_checkpoint`] in device writes of at most `write_bytes` (a multiple
    /// of the block size) each, one after another, each durable before the next: the
    /// kernel moves at most about 2 GiB per read or write, and the checkpoint of a large
    /// index is larger. A crash between two leaves the area torn, which its checksums
    /// tell; the other area's checkpoint stays in force.
    pub fn write_checkpoint_in<B: FnOnce() -> Checkpoint + Send + 'static>(
        &self,
        area: usize,
        build: B,
        write_bytes: usize,
    ) -> impl std::future::Future<Output = Result<(), LogDeviceError>> + use<B> {
        assert!(write_bytes > 0 && write_bytes.is_multiple_of(BLOCK_SIZE));
        let area_bytes = self.superblock.checkpoint_size_bytes;
        let offset = self.superblock.checkpoint_start_bytes + area as u64 * area_bytes;
        let engine = self.engine.clone();
        let path = self.path.clone();
        let counters = self.counters.clone();
        async move {
            // The copy into buffers for the device too: a checkpoint may be hundreds of MB.
            let (len, writes) = tokio::task::spawn_blocking(move || {
                let encoded = build().encode();
                let writes: Vec<DmaBuf> = encoded
                    .chunks(write_bytes)
                    .map(DmaBuf::from_slice)
                    .collect();
                (encoded.len() as u64, writes)
            })
            .await
            .map_err(|error| LogDeviceError::Io {
                path: path.clone(),
                source: std::io::Error::other(format!("checkpoint task failed: {error}")),
            })?;
            if len > area_bytes {
                return Err(LogDeviceError::CheckpointTooLarge {
                    bytes: len,
                    area_bytes,
                });
            }
            counters.last_checkpoint_bytes.store(len, Ordering::Relaxed);
            let mut at = offset;
            for write in writes {
                let bytes = write.len() as u64;
                engine
                    .write(at, write, true)
                    .await
                    .map_err(|source| LogDeviceError::Io {
                        path: path.clone(),
                        source,
                    })?;
                at += bytes;
            }
            counters.checkpoint_bytes.fetch_add(len, Ordering::Relaxed);
            Ok(())
        }
    }

    /// The size of the last checkpoint written, counting one being written (at first, the
    /// one read when the device was opened; 0 if none).
    pub fn last_checkpoint_bytes(&self) -> u64 {
        self.counters.last_checkpoint_bytes.load(Ordering::Relaxed)
    }

    /// Reads the batches from `position` (whose batch has `lsn`) up to `limit` whole, data
    /// included: what the cleaner examines. The batch at `durable_end` is known durable
    /// (see [`read_durable`]).
    pub fn read_batches(
        &self,
        position: u64,
        lsn: Lsn,
        (limit, durable_end): (u64, u64),
    ) -> impl std::future::Future<Output = std::io::Result<Replayed>> + use<> {
        let path = self.path.clone();
        let ring = self.ring;
        let limits = (limit, durable_end);
        async move { read_log(Path::new(&path), ring, (position, lsn), limits, None).await }
    }

    /// The batch at `position` (of `lsn`) if it was written whole and damaged since (the
    /// batch after it is intact; see [`read_damaged`] for `durable_end`), with its bytes:
    /// what the cleaner moves live data out of when it cannot read the batch's header.
    pub fn read_damaged(
        &self,
        position: u64,
        lsn: Lsn,
        durable_end: u64,
    ) -> impl std::future::Future<Output = std::io::Result<Option<DamagedBatch>>> + use<> {
        let path = PathBuf::from(&self.path);
        let ring = self.ring;
        on_blocking_pool(path, move |read| {
            read_damaged(read, ring, (position, lsn), durable_end)
        })
    }

    /// The checksum of every block of the log as written, which reads check.
    pub fn block_sums(&self) -> Arc<BlockSums> {
        self.sums.clone()
    }

    /// Puts an empty batch after the last, for an orderly stop once nothing else appends:
    /// the batch before it is then known to have been written whole, so that damage to it
    /// while the OSD is down is not taken for a torn write at the restart (see
    /// [`FENCE_AFTER`]).
    pub async fn close(&self) -> Result<Appended, LogDeviceError> {
        // An empty append shares its batch with appends queued before it: one waits for
        // those, and then one goes alone.
        self.submit(Vec::new()).await?;
        self.submit(Vec::new()).await
    }

    /// Sets how long a quiet log waits before the writer puts an empty batch after the
    /// last ([`FENCE_AFTER`] by default); `None`: never (tests that count batches).
    pub fn set_fence_after(&self, after: Option<std::time::Duration>) {
        let ms = after.map_or(0, |after| after.as_millis().max(1) as u64);
        self.counters.fence_after_ms.store(ms, Ordering::Relaxed);
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
            checkpoint_bytes: c.checkpoint_bytes.load(Ordering::Relaxed),
        }
    }
}

impl Drop for LogDevice {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// Reads both checkpoint areas and returns the valid checkpoint with the higher sequence
/// number (a torn or damaged one is passed over: the other is still whole), and its size.
async fn read_checkpoints(
    path: &Path,
    superblock: Superblock,
) -> std::io::Result<Option<(Checkpoint, u64)>> {
    let file = std::fs::File::open(path)?;
    tokio::task::spawn_blocking(move || {
        let mut best: Option<(Checkpoint, u64)> = None;
        for area in 0..2u64 {
            let offset =
                superblock.checkpoint_start_bytes + area * superblock.checkpoint_size_bytes;
            let header = pread(&file, offset, BLOCK_SIZE)?;
            let len = match Checkpoint::length_from_header(&header) {
                Ok(len) => len,
                Err(error @ CheckpointError::Version { .. }) => {
                    return Err(other_format(area, &error));
                }
                Err(_) => continue,
            };
            if len as u64 > superblock.checkpoint_size_bytes {
                tracing::warn!(area, len, "checkpoint longer than its area ignored");
                continue;
            }
            let bytes = pread(&file, offset, len)?;
            match Checkpoint::decode(&bytes) {
                Ok(checkpoint) => {
                    if best
                        .as_ref()
                        .is_none_or(|(b, _)| b.sequence < checkpoint.sequence)
                    {
                        best = Some((checkpoint, len as u64));
                    }
                }
                Err(error @ CheckpointError::Version { .. }) => {
                    return Err(other_format(area, &error));
                }
                Err(error) => tracing::warn!(area, %error, "checkpoint ignored"),
            }
        }
        Ok(best)
    })
    .await
    .map_err(|error| std::io::Error::other(format!("checkpoint task failed: {error}")))?
}

/// A checkpoint of another format is refused, not passed over: replay from the start of
/// the ring would miss what the checkpoint holds once the log has been reused.
fn other_format(area: u64, error: &CheckpointError) -> std::io::Error {
    std::io::Error::new(
        std::io::ErrorKind::InvalidData,
        format!(
            "checkpoint area {area}: {error}; this device was written by another version of \
             basalt and cannot be read by this one"
        ),
    )
}

/// `len` bytes of `file` at `offset`, through a positioned read (buffered reads see what
/// O_DIRECT wrote, since direct writes invalidate the page cache over their range).
fn pread(file: &std::fs::File, offset: u64, len: usize) -> std::io::Result<Vec<u8>> {
    use std::os::unix::fs::FileExt;
    let mut bytes = vec![0u8; len];
    file.read_exact_at(&mut bytes, offset)?;
    Ok(bytes)
}

/// Replays the log from `start` up to `limit`, on the blocking pool, reading a header, then
/// a batch, at a time. Unless `keep_payloads`, object write payloads are left on the device
/// (their entries keep where they lie), so that replay holds metadata, not the log.
async fn read_log(
    path: &Path,
    ring: Ring,
    (start, lsn): (u64, Lsn),
    (limit, durable_end): (u64, u64),
    replaying: Option<Arc<BlockSums>>,
) -> std::io::Result<Replayed> {
    on_blocking_pool(path.to_path_buf(), move |read| {
        match replaying {
            // Replay on start records the blocks' checksums and keeps only where the
            // payloads lie.
            Some(sums) => {
                let payload = |entry: &Entry| PAYLOAD_KINDS.contains(&entry.kind);
                let trim = |entry: &mut Entry, offset, damaged| {
                    if damaged {
                        // Which of its blocks changed is unknown: reads of any fail.
                        sums.poison_range(offset, entry.data.len() as u64);
                    } else {
                        sums.record(offset, &entry.data);
                    }
                    if payload(entry) {
                        entry.data = Vec::new();
                    }
                };
                replay_sparing(read, ring, (start, lsn), limit, &payload, trim)
            }
            // The cleaner reads durable batches and keeps the payloads it may move; it
            // takes a damaged batch too and decides what its damage means.
            None => read_durable(read, ring, (start, lsn), (limit, durable_end)),
        }
    })
    .await
}

/// A device read for the log's readers: `(offset, len)` to bytes.
type DeviceRead<'a> = &'a mut dyn FnMut(u64, usize) -> std::io::Result<Vec<u8>>;

/// Runs `task` on the blocking pool with positioned reads of the device file at `path`.
async fn on_blocking_pool<T: Send + 'static>(
    path: PathBuf,
    task: impl FnOnce(DeviceRead<'_>) -> std::io::Result<T> + Send + 'static,
) -> std::io::Result<T> {
    let file = std::fs::File::open(&path)?;
    tokio::task::spawn_blocking(move || task(&mut |offset, len| pread(&file, offset, len)))
        .await
        .map_err(|error| std::io::Error::other(format!("read task failed: {error}")))?
}

/// Takes from the front of `waiting` as many whole appends as one batch holds (each fits
/// alone: submit checks), only relocations if `relocations_only`.
fn take_group(waiting: &mut VecDeque<Append>, relocations_only: bool) -> Vec<Append> {
    let mut group: Vec<Append> = Vec::new();
    let (mut entry_count, mut data_bytes) = (0usize, 0usize);
    let mut at = 0;
    while at < waiting.len() {
        let next = &waiting[at];
        if relocations_only && !next.relocation {
            at += 1;
            continue;
        }
        let next_data = batch::batch_size(&next.entries) - BLOCK_SIZE;
        if !group.is_empty()
            && (entry_count + next.entries.len() > ENTRY_COUNT_MAX
                || data_bytes + next_data > DATA_SIZE_MAX)
        {
            break;
        }
        entry_count += next.entries.len();
        data_bytes += next_data;
        group.push(waiting.remove(at).expect("index in range"));
    }
    group
}

/// Whether the batch `group` makes fits at the head with `keep` bytes left free (counting
/// what it skips at the end of a lap).
fn fits(group: &[Append], writer: &LogWriter, keep: u64) -> bool {
    let size = (BLOCK_SIZE
        + group
            .iter()
            .map(|append| batch::batch_size(&append.entries) - BLOCK_SIZE)
            .sum::<usize>()) as u64;
    let head = writer.next_position();
    writer.ring().place(head, size) + size - head + keep <= writer.free_bytes()
}

async fn write_loop(
    engine: FileEngine,
    mut writer: LogWriter,
    mut appends: mpsc::UnboundedReceiver<Append>,
    counters: Arc<Counters>,
    tail_moved: Arc<Notify>,
    floor_bytes: u64,
    sums: Arc<BlockSums>,
) {
    let mut waiting: VecDeque<Append> = VecDeque::new();
    let mut failed: Option<String> = None;
    let mut short_of_room = false;
    // Whether the last batch written holds no entry (see `FENCE_AFTER`): not known of the
    // log replayed.
    let mut fenced = false;
    loop {
        let fence_after = counters.fence_after_ms.load(Ordering::Relaxed);
        if waiting.is_empty() && !fenced && failed.is_none() && fence_after > 0 {
            let quiet = std::time::Duration::from_millis(fence_after);
            match tokio::time::timeout(quiet, appends.recv()).await {
                Ok(Some(append)) => waiting.push_back(append),
                Ok(None) => return,
                Err(_) => {
                    // Quiet: an empty append of its own, written as any other, if still
                    // wanted (the interval may have been turned off while the writer waited)
                    // and with room (the floor is the cleaner's; else tried again later).
                    writer.set_tail(counters.tail_position.load(Ordering::Relaxed));
                    let wanted = counters.fence_after_ms.load(Ordering::Relaxed) > 0;
                    if !wanted || !fits(&[], &writer, floor_bytes) {
                        continue;
                    }
                    waiting.push_back(Append {
                        entries: Vec::new(),
                        relocation: false,
                        done: oneshot::channel().0,
                    });
                }
            }
        }
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
        writer.set_tail(counters.tail_position.load(Ordering::Relaxed));
        // Appends in order while they leave the floor free; else relocations alone, which
        // may use it; else wait for the tail to move (or for a relocation to arrive).
        let mut group = take_group(&mut waiting, false);
        let appends_fit = fits(&group, &writer, floor_bytes);
        if !appends_fit {
            // Put them back, in order, and try the relocations alone.
            for append in group.into_iter().rev() {
                waiting.push_front(append);
            }
            group = take_group(&mut waiting, true);
            if group.is_empty() || !fits(&group, &writer, 0) {
                for append in group.into_iter().rev() {
                    waiting.push_front(append);
                }
                if !short_of_room {
                    // Client writes stop well before this (the OSD reports itself full):
                    // raft's entries filled the reserve.
                    tracing::warn!(
                        waiting = waiting.len(),
                        free_bytes = writer.free_bytes(),
                        "appends wait for room in the log"
                    );
                    short_of_room = true;
                }
                tokio::select! {
                    () = tail_moved.notified() => {}
                    append = appends.recv() => match append {
                        Some(append) => waiting.push_back(append),
                        None => return,
                    },
                }
                continue;
            }
        }
        if short_of_room && appends_fit {
            tracing::info!("appends go on: the log has room again");
            short_of_room = false;
        }
        // The entries move into the batch (no copy of their data); each caller keeps its
        // answer channel and how many entries and data bytes were its own.
        let entry_count = group.iter().map(|a| a.entries.len()).sum();
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
            Err(error) => {
                // `fits` checked the room: this is a bug, not a full log.
                let reason = format!("placing a batch: {error}");
                tracing::error!(%reason, "the log device refuses further writes");
                for (done, _, _) in callers {
                    let _ = done.send(Err(LogDeviceError::Failed {
                        reason: reason.clone(),
                    }));
                }
                failed = Some(reason);
                continue;
            }
        };
        let device_bytes = placed.bytes.len() as u64;
        let end_position = placed.position + device_bytes;
        // The data blocks (the header is never read as data). Set before the write: the
        // blocks are free, and nothing refers to them before the write completes.
        sums.record(
            placed.offset_bytes + BLOCK_SIZE as u64,
            &placed.bytes[BLOCK_SIZE..],
        );
        counters
            .head_position
            .store(end_position, Ordering::Relaxed);
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
        fenced = entries.is_empty();
        let mut offsets = placed.data_offsets_bytes.into_iter();
        for (done, count, data) in callers {
            counters.appends.fetch_add(1, Ordering::Relaxed);
            counters.entries.fetch_add(count as u64, Ordering::Relaxed);
            counters.data_bytes.fetch_add(data, Ordering::Relaxed);
            let data_offsets_bytes = offsets.by_ref().take(count).collect();
            let _ = done.send(Ok(Appended {
                lsn: placed.lsn,
                position: placed.position,
                end_position,
                data_offsets_bytes,
            }));
        }
    }
}
