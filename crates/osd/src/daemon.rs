//! The OSD daemon: its log device, its PG replicas as raft groups, its clients and peers.
//!
//! One task, the *core*, owns every PG's raft state and object index; everything else talks
//! to it through one queue of [`Event`]s: client requests and raft messages from the
//! network, completed log appends, new maps, clock ticks. After each batch of events the
//! core collects what raft wants done and does it:
//!
//! - *Persist*: the entries and hard state become log entries (an object write's payload is
//!   the entry's data) and go to the log device at once, leader and followers alike; the
//!   device writes everything queued while its previous write ran in one durable write.
//!   Appends complete in order; a completion task reports each back to the core, which
//!   then tells raft and lets the messages that wait on it (acknowledgements, votes) leave.
//! - *Send*: raft messages to peers, over one connection per peer.
//! - *Apply*: committed object operations update the PG's object index (which points at
//!   the payload in the log: the data is written once), and the client that proposed the
//!   entry is answered.
//!
//! Reads are served by the leader once a quorum confirmed its leadership after the read
//! arrived (raft's read index) or less than a [`LEASE`] ago, and it has applied everything
//! committed at that point, straight from the log device through the index; holes read as
//! zeroes.
//!
//! The core also reuses the log ([`crate::reclaim`]): it cuts checkpoints, compacts raft
//! logs behind them, and cleans the ring's tail.
//!
//! A replica that needs entries its leader compacted installs a snapshot of the PG
//! ([`crate::snapshot`]): it fetches the objects from the leader before raft takes it.

use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use basalt_common::{Epoch, Lsn, ObjectKey, OsdId, PgId};
use basalt_io::{DmaBuf, FileEngine};
use basalt_mon::MonClient;
use basalt_mon::map::{ClusterMap, Command};
use basalt_mon::protocol::{LeaderlessPg, MonReply, MonRequest, OsdReport, PgScrub};
use basalt_replication::{
    Action, EntryType, Members, MultiRaft, PayloadUnavailable, ProposeError, RaftMessage,
    ReadStart, Reconfiguring, Restored, beat_of, decode_message, encode_message, heartbeat,
};
use basalt_store::batch::{self, BLOCK_SIZE, BatchError};
use basalt_store::block_sums::{BlockSums, Mismatch};
use basalt_store::checkpoint::Checkpoint;
use basalt_store::extent_map::Piece;
use basalt_store::log::{DamagedBatch, Replayed};
use basalt_store::object_op::{ObjectOp, PayloadRef, PgObjects, kind};
use basalt_wire::message::RangeOp;
use basalt_wire::metrics::{self, Exposition};
use basalt_wire::tcp::{Client, Handler, Server};
use basalt_wire::{Message, ObjectRange, Status};
use tokio::sync::{mpsc, oneshot};

use crate::log_device::{Appended, Fill, LogDevice, LogDeviceError, LogStats, ReadPin};
use crate::pg_log::{self, RestoredPgs};
use crate::reclaim::{self, Durable, Move, Retention};
use crate::scrub::DigestPlan;
use crate::snapshot::{self, Chunk, Cursor};
use crate::superblock::Superblock;

/// The log device's file in the data directory.
pub const DEVICE_FILE: &str = "osd.log";

/// The file in the data directory that keeps the count of reads that met a block failing
/// its checksum, and when the last was (milliseconds since the Unix epoch), through the
/// OSD's restarts: "COUNT MILLIS". Health names a device for an hour after it gave back
/// damaged bytes, whichever monitor leads and however often the OSD restarted.
pub const CHECKSUM_ERRORS_FILE: &str = "checksum-errors";
/// Log space kept free for raft's own entries and for followers that are a little fuller
/// (at most a sixteenth of the ring), besides the log device's reserve for the cleaner:
/// client writes wait (`Busy`) or are refused (`NoSpace`) below it.
pub const LOG_RESERVE_BYTES: u64 = 16 << 20;
/// Checkpoints write at most about one byte in this many of what the cleaner goes through
/// ([`checkpoint_room`]).
const CHECKPOINT_SHARE: u64 = 8;
/// How long writes wait (`Busy`) for the cleaner without it freeing any space, before they
/// are refused with `NoSpace`.
const BUSY_WITHOUT_PROGRESS: Duration = Duration::from_secs(10);
/// How long the cleaner works towards the room a snapshot install refused for want of it
/// needs (the leader sends it again within that time).
const WANTED_FREE_FOR: Duration = Duration::from_secs(30);
/// What a cleaner step's relocations of damaged data are, for the PGs rebuilt for it.
const MOVED_DAMAGED: &str = "the cleaner moved data in use that fails its checksum, marked damaged";
/// Raft entries kept in memory behind the applied index, for followers a little behind.
const RETAINED_ENTRIES: usize = 4096;
/// The largest write or read one request may carry: it fits one log batch and one frame.
pub const REQUEST_BYTES_MAX: u64 = basalt_wire::message::OBJECT_REQUEST_BYTES_MAX;
/// How long what a peer's frame says of whether it is full holds, unless a later one says
/// otherwise ([`Core::replicas_not_full`]); the map decides after it. A replica answers its
/// leaders' heartbeats every other tick.
const PEER_FULL_FOR: Duration = Duration::from_secs(3);
/// A raft tick.
pub const TICK: Duration = Duration::from_millis(100);
/// How long an orderly stop waits for the PGs led here to be handed over to other replicas
/// ([`MultiRaft::give_up_leadership`]); raft gives a hand-over up after an election
/// timeout, so this leaves room for a second try.
pub const STOP_HAND_OVER: Duration = Duration::from_secs(3);
/// An orderly stop in which no hand-over succeeds for this long gives up waiting: the
/// others are likely stopping too (a whole cluster stopped at once), and refuse.
const STOP_STALLED: Duration = Duration::from_millis(1500);
/// How long a replica under repair of damage in its raft log leads its PG before it steps
/// down (each time it is elected), if no other replica took the PG over by then
/// ([`MultiRaft::step_down`]): a hand-over takes less than an election timeout.
pub const STEP_DOWN_AFTER: Duration = Duration::from_secs(5);
/// How long a replica whose copy replay found damaged does not campaign, in ticks with a
/// quorum within reach: several election timeouts, for the others to elect one of them
/// ([`MultiRaft::hold_back`]).
pub const HELD_BACK_TICKS: usize = 5 * basalt_replication::multi_raft::ELECTION_TICKS;
/// How long a quorum's confirmation of a PG's leadership lets its leader serve reads
/// without asking again: half the time a follower refuses to vote after hearing from its
/// leader ([`basalt_replication::multi_raft::ELECTION_TICKS`] ticks), see
/// [`MultiRaft::set_lease`].
pub const LEASE: Duration = Duration::from_millis(
    TICK.as_millis() as u64 * basalt_replication::multi_raft::ELECTION_TICKS as u64 / 2,
);
/// Between heartbeats to the monitor.
pub const HEARTBEAT_INTERVAL: Duration = Duration::from_secs(1);
/// The most raft message bytes put in one frame to a peer (frames carry 4 MiB at most).
const BATCH_FRAME_BYTES_MAX: usize = 2 << 20;
/// The most bytes a beat takes in a frame (five variable-length integers and a byte).
const BEAT_BYTES_MAX: usize = 31;
/// How long a map subscription waits per request.
const MAP_WAIT: Duration = Duration::from_secs(20);
/// How long a leader waits for a map as new as its PG's floor before it hands the PG to a
/// voter that may have it (this OSD cut off from the monitors, not from its peers).
const BELOW_FLOOR_FOR: Duration = Duration::from_secs(5);
/// How long a leader waits for a follower it sent a snapshot to, without it asking for any
/// object data, before it counts the snapshot as failed (raft then sends another).
const SNAPSHOT_SILENCE: Duration = Duration::from_secs(30);

/// How an OSD runs.
#[derive(Debug, Clone)]
pub struct OsdConfig {
    /// Its own small files (the lock, the checksum error count), and its device file
    /// [`DEVICE_FILE`] unless `device` names another.
    pub data_dir: PathBuf,
    /// Its device: a file (created on first start when missing) or a raw block device;
    /// `None`: `data_dir`/[`DEVICE_FILE`].
    pub device: Option<PathBuf>,
    /// Formats a device that exists but holds no Basalt superblock (a block device, or a
    /// file made beforehand), erasing what it holds. A device with one is used as it is.
    pub format: bool,
    /// The size of a device file created on first start.
    pub device_size_bytes: u64,
    /// How a device file created on first start is filled (see [`Fill`]).
    pub device_fill: Fill,
    /// The monitors.
    pub mons: Vec<SocketAddr>,
    /// Where to listen for clients and peers.
    pub listen: SocketAddr,
    /// Its host (the failure domain).
    pub host: String,
    /// Its share of PGs.
    pub weight: f64,
    /// Where to serve Prometheus metrics.
    pub metrics_addr: Option<SocketAddr>,
    /// PGs led here that may be adding members at once (new replicas catching up from the
    /// log or by snapshot), the others waiting their turn; and snapshots this OSD installs
    /// at once, others refused until one ends (their leaders send them again). At least 1.
    pub max_moves: usize,
    /// How long the OSD's thread stays awake after each turn of its core, checking its
    /// sockets and its device without sleeping (zero: it sleeps at once). See [`poll_after_turns`].
    pub poll: Duration,
    /// How often each PG led here gets a background scrub (never if `None`).
    pub scrub_interval: Option<Duration>,
}

/// [`OsdConfig::scrub_interval`] unless configured: a week, as Ceph's deep scrubs.
pub const SCRUB_INTERVAL_DEFAULT: Duration = Duration::from_secs(7 * 24 * 3600);

/// [`OsdConfig::max_moves`] unless configured.
pub const MAX_MOVES_DEFAULT: usize = 4;

/// Why the OSD stopped.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum OsdError {
    /// The data directory or device.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The log device failed.
    #[error(transparent)]
    Log(#[from] LogDeviceError),
    /// The log holds something replay cannot use.
    #[error("replaying the log: {0}")]
    Replay(#[from] pg_log::PgLogError),
    /// The monitors.
    #[error("monitor: {0}")]
    Mon(String),
    /// Listening failed.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The address.
        address: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
    /// An invariant broke; the OSD stops rather than serve wrong data (a restart replays).
    #[error("internal error: {0}")]
    Internal(String),
    /// The device's log could hold next to no client data besides the room the cleaner
    /// and raft's entries need.
    #[error(
        "{path}: a log of {capacity_bytes} bytes holds {writable_bytes} bytes of client data before it is full, less than {least}; use a larger device"
    )]
    TooSmall {
        /// The device.
        path: String,
        /// Its log region.
        capacity_bytes: u64,
        /// What it would hold before it is full.
        writable_bytes: u64,
        /// The least it must hold.
        least: u64,
    },
}

/// What an OSD answers besides client I/O, as JSON in control frames.
#[derive(Debug, Clone, PartialEq, serde::Serialize, serde::Deserialize)]
pub enum OsdRequest {
    /// This replica's state of a PG (`basalt pg query`).
    PgQuery {
        /// The PG.
        pg: PgId,
    },
    /// The same without the objects and their digest (cheap): how a replica the map no
    /// longer lists learns from the PG's leader whether it was removed.
    PgConf {
        /// The PG.
        pg: PgId,
    },
    /// Rebuild this replica's data of a PG from its leader's (`basalt pg repair`): a
    /// replica that leads hands leadership over first. Answered once the copy is
    /// installed, with the state after it (without the digest).
    Repair {
        /// The PG.
        pg: PgId,
        /// Replicas that may hold bad data too: leadership is not handed to them.
        avoid: Vec<OsdId>,
    },
    /// Put a scrub marker in the PG's log now, if this replica leads it; answered with the
    /// marker's index as `last_index`.
    Scrub {
        /// The PG.
        pg: PgId,
    },
    /// Give up this replica's raft log entries of the PG from the first past its commit
    /// index whose payload it cannot read back (`basalt pg mark-unfound-lost`; see
    /// `MultiRaft::concede`); answered with the state after, `giving_up_from` set.
    MarkUnfoundLost {
        /// The PG.
        pg: PgId,
    },
    /// The numbers of `image`'s objects this PG holds data of, from object `from` on, at
    /// most [`OBJECTS_LISTED_MAX`] ([`ObjectList`]), if this replica leads the PG with a map
    /// of epoch `since` or newer: what `basalt image rm` and a shrink discard. Answered once
    /// a map floor entry proposed for it applies, so the list holds every write taken
    /// before it, and none is taken after it under a map older than `since`.
    ListObjects {
        /// The PG.
        pg: PgId,
        /// The image.
        image: basalt_common::ImageId,
        /// The first object number of interest.
        from: u64,
        /// The map epoch the list must be taken under at least (the image's removal or
        /// shrink).
        since: Epoch,
    },
    /// Make this replica the only voter of the PG, whose voters but `lost` make no quorum
    /// (`basalt pg force-quorum`; see `MultiRaft::force_quorum`); answered with the state
    /// then.
    ForceQuorum {
        /// The PG.
        pg: PgId,
        /// Voters lost for good (removed from the cluster).
        lost: Vec<OsdId>,
    },
}

/// How long a repair may go without a snapshot asked for or being installed (a leader that
/// finds no replica to hand leadership to, say) before it is given up; while one is on its
/// way, the repair goes on (one taken back, when leadership went to a replica whose copy
/// is in doubt too, counts until then).
pub const REPAIR_TIMEOUT: Duration = Duration::from_secs(120);

/// How long an [`OsdRequest::Repair`] waits for its answer: then it is told the repair is
/// still under way (a partitioned replica, one whose log has no room for the copy); asked
/// again, it waits again.
pub const REPAIR_ANSWER_WITHIN: Duration = Duration::from_secs(600);

/// A repair asked of this replica ([`OsdRequest::Repair`]).
struct Repair {
    /// Replicas not to hand leadership to.
    avoid: Vec<OsdId>,
    /// Who waits for the answer, since when.
    waiting: Vec<(oneshot::Sender<Message>, std::time::Instant)>,
    /// When it was asked, or last had a snapshot asked for or being installed.
    since: std::time::Instant,
    /// The snapshot is installed (the state after it): the answer waits for a checkpoint
    /// cut after it, so that replay no longer reads the data it replaced.
    installed: Option<PgReplicaState>,
    /// A checkpoint cut after the install is being written.
    covered: bool,
    /// The replica leadership is being handed to (logged once, not at every tick).
    heir: Option<OsdId>,
    /// A replica whose copy is in doubt too that this replica took its snapshot request
    /// back from: the next snapshot it sends (most likely the one asked for) is refused,
    /// which ends the leader's sending of it; a later one (this replica fell behind its
    /// log) is installed, without ending the repair.
    refuse_from: Option<OsdId>,
    /// Since when this replica has led the PG during the repair (see [`STEP_DOWN_AFTER`]).
    leading_since: Option<std::time::Instant>,
    /// The damage is in payloads of its raft log (which it cannot send): leading, it steps
    /// down whenever no other replica took the PG over in time.
    log_damaged: bool,
}

impl Repair {
    /// A repair asked now, avoiding no replica yet, that nobody waits for yet.
    fn new() -> Self {
        Self {
            avoid: Vec::new(),
            waiting: Vec::new(),
            since: std::time::Instant::now(),
            installed: None,
            covered: false,
            refuse_from: None,
            heir: None,
            leading_since: None,
            log_damaged: false,
        }
    }
}

/// The most object numbers one [`OsdRequest::ListObjects`] answers with.
pub const OBJECTS_LISTED_MAX: usize = 65_536;

/// The answer to [`OsdRequest::ListObjects`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ObjectList {
    /// Object numbers, in order.
    pub numbers: Vec<u64>,
    /// Whether these are all from the object asked for on (else ask again past the last).
    pub complete: bool,
}

/// One replica's state of a PG.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct PgReplicaState {
    /// The OSD.
    pub osd: OsdId,
    /// The PG.
    pub pg: PgId,
    /// Whether the OSD hosts a replica of it.
    pub hosted: bool,
    /// The leader this replica knows of.
    pub leader: Option<OsdId>,
    /// Its raft term.
    pub term: u64,
    /// Its commit index.
    pub committed: u64,
    /// The last entry applied.
    pub applied: u64,
    /// The last entry in its log.
    pub last_index: u64,
    /// The term of that entry.
    #[serde(default)]
    pub last_term: u64,
    /// Objects with data.
    pub objects: usize,
    /// Bytes mapped in them.
    pub mapped_bytes: u64,
    /// CRC32C over every object's key, mapped ranges and their bytes, in key order: equal
    /// digests mean equal data.
    pub digest: u32,
    /// The raft voters, as this replica last applied them (in a joint configuration, the
    /// incoming ones).
    #[serde(default)]
    pub voters: Vec<OsdId>,
    /// Voters leaving, in a joint configuration.
    #[serde(default)]
    pub voters_outgoing: Vec<OsdId>,
    /// Learners: new members catching up.
    #[serde(default)]
    pub learners: Vec<OsdId>,
    /// The index of the change that led to that configuration (`MultiRaft::conf_index`).
    #[serde(default)]
    pub conf_index: u64,
    /// The first of the raft log entries this replica gives up, as the operator asked
    /// (`basalt pg mark-unfound-lost`), until a leader replaces them.
    #[serde(default)]
    pub giving_up_from: Option<u64>,
    /// If it leads: the lowest index every other voter holds (`MultiRaft::voters_matched`).
    #[serde(default)]
    pub voters_matched: Option<u64>,
}

impl PgReplicaState {
    /// Whether `osd` votes in this replica's configuration (in either half of a joint one).
    pub fn votes(&self, osd: OsdId) -> bool {
        self.voters.contains(&osd) || self.voters_outgoing.contains(&osd)
    }

    /// Whether `osd` is in this replica's configuration in any role.
    pub fn includes(&self, osd: OsdId) -> bool {
        [&self.voters, &self.voters_outgoing, &self.learners]
            .iter()
            .any(|set| set.contains(&osd))
    }

    /// Whether this state, a PG's leader's answer to [`OsdRequest::PgConf`], lets replica
    /// `me`, which last held entries up to `last`, drop its copy: the leader (`asked`)
    /// leads, no longer counts `me` in any role, and its voters hold the entries up to
    /// `last`, or up to the end of its log if that is before (the entries past it were
    /// never committed). Until they do, the copy may be one of few of a committed entry (a
    /// single removal commits entries under the configuration it leaves, until the leader
    /// applies it).
    pub fn lets_go_of(&self, asked: OsdId, me: OsdId, last: u64) -> bool {
        self.leader == Some(asked)
            && self.hosted
            && !self.includes(me)
            && self
                .voters_matched
                .is_some_and(|held| held >= last.min(self.last_index))
    }
}

/// Counters the OSD reports.
#[derive(Default)]
struct Counters {
    reads: AtomicU64,
    writes: AtomicU64,
    read_bytes: AtomicU64,
    write_bytes: AtomicU64,
    /// Nanoseconds from a write's arrival to its answer, summed.
    write_nanos: AtomicU64,
    /// Nanoseconds from a read's arrival to its answer, summed.
    read_nanos: AtomicU64,
    /// Checkpoints written.
    checkpoints: AtomicU64,
    /// Index bytes the cleaner moved.
    relocated_bytes: AtomicU64,
    /// Bytes the object indexes map (refreshed on ticks).
    live_bytes: AtomicU64,
    /// PG snapshots installed here.
    snapshots_installed: AtomicU64,
    /// Object data bytes received for snapshots.
    snapshot_bytes_received: AtomicU64,
    /// Object data bytes sent for snapshots.
    snapshot_bytes_sent: AtomicU64,
    /// Frames of raft messages sent to peers.
    peer_frames: AtomicU64,
    /// Bytes of those frames.
    peer_bytes: AtomicU64,
    /// Raft heartbeats and answers sent coalesced, as beats.
    beats_sent: AtomicU64,
    /// Raft messages sent whole.
    raft_messages_sent: AtomicU64,
    /// Reads of the log that met a block failing its checksum.
    checksum_errors: AtomicU64,
    /// When the last of them was, in milliseconds since the Unix epoch (0: none yet).
    last_checksum_error_ms: AtomicU64,
}

impl Counters {
    /// Counters starting from the checksum errors `data_dir` keeps (none if it keeps
    /// none, or what it keeps does not parse).
    fn restored(data_dir: &Path) -> Self {
        let kept = std::fs::read_to_string(data_dir.join(CHECKSUM_ERRORS_FILE)).ok();
        let (count, last_ms) = kept
            .and_then(|text| {
                let (count, last) = text.trim().split_once(' ')?;
                Some((count.parse().ok()?, last.parse().ok()?))
            })
            .unwrap_or((0, 0));
        Self {
            checksum_errors: AtomicU64::new(count),
            last_checksum_error_ms: AtomicU64::new(last_ms),
            ..Self::default()
        }
    }

    /// Keeps the checksum errors in `data_dir` whenever their count changed, checked every
    /// second (a temporary file renamed over the last).
    async fn keep_checksum_errors(counters: Arc<Self>, data_dir: PathBuf) {
        let now = |counters: &Self| {
            (
                counters.checksum_errors.load(Ordering::Relaxed),
                counters.last_checksum_error_ms.load(Ordering::Relaxed),
            )
        };
        let mut kept = now(&counters);
        let mut every = tokio::time::interval(Duration::from_secs(1));
        loop {
            every.tick().await;
            let (count, last_ms) = now(&counters);
            if (count, last_ms) == kept {
                continue;
            }
            let (temporary, path) = (
                data_dir.join(format!("{CHECKSUM_ERRORS_FILE}.new")),
                data_dir.join(CHECKSUM_ERRORS_FILE),
            );
            let written = async {
                tokio::fs::write(&temporary, format!("{count} {last_ms}\n")).await?;
                tokio::fs::rename(&temporary, &path).await
            };
            match written.await {
                Ok(()) => kept = (count, last_ms),
                Err(error) => {
                    tracing::warn!(path = %path.display(), %error, "cannot keep the count of checksum errors")
                }
            }
        }
    }

    /// Counts a read that met a block failing its checksum.
    fn checksum_error(&self) {
        self.last_checksum_error_ms
            .store(unix_millis(), Ordering::Relaxed);
        self.checksum_errors.fetch_add(1, Ordering::Relaxed);
    }

    /// Seconds since the last read that met a block failing its checksum, if any.
    fn last_checksum_error_age_seconds(&self) -> Option<u64> {
        let last = self.last_checksum_error_ms.load(Ordering::Relaxed);
        (last > 0).then(|| unix_millis().saturating_sub(last) / 1000)
    }

    /// Counts and logs damage a digest of `pg` read (the digest differs from the other
    /// replicas' then: the scrub names this one).
    fn digest_damaged(&self, pg: PgId, mismatch: Option<Mismatch>) {
        if let Some(mismatch) = mismatch {
            self.checksum_error();
            tracing::error!(%pg, %mismatch, "a digest finds this replica's copy of the pg damaged");
        }
    }
}

/// Milliseconds since the Unix epoch.
fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |since| since.as_millis() as u64)
}

/// What the core hears.
enum Event {
    /// A client request, answered through `reply`.
    Request {
        message: Message,
        reply: oneshot::Sender<Message>,
    },
    /// A raft message from a peer.
    Raft { pg: PgId, message: RaftMessage },
    /// Whether peer `from` holds itself full, as each of its raft frames says.
    PeerFull { from: OsdId, full: bool },
    /// Raft heartbeats and their answers from peer `from` to this OSD (`to`), as one frame
    /// carried them.
    Beats {
        from: OsdId,
        to: OsdId,
        beats: Vec<basalt_common::Beat>,
    },
    /// A persist is durable; its write payloads (raft index, term) lie at these device
    /// offsets. `end` is the ring position and LSN after its last batch, if it wrote one.
    /// No PG: an empty persist that only moves `durable_end` ([`Core::move_durable_end`]).
    Persisted {
        pg: Option<PgId>,
        generation: u64,
        number: u64,
        snapshot: Option<(u64, u64)>,
        then_send: Vec<(OsdId, RaftMessage)>,
        payloads: Vec<(u64, u64, u64)>,
        hard_state: Option<basalt_replication::HardState>,
        last_index: Option<u64>,
        end: Option<(u64, Lsn)>,
    },
    /// The log device failed: stop.
    Failed(String),
    /// The cleaner read batches from where it got to.
    Cleaned(std::io::Result<Replayed>),
    /// The cleaner read the batch it could not take, to tell whether it was damaged after
    /// it was written (`Some`), and if so what it holds.
    Rescue(std::io::Result<Option<DamagedBatch>>),
    /// The cleaner's relocations are durable: each move's new device offset. The cleaner
    /// has then gone through the ring up to `next`.
    Relocated {
        moves: Vec<(Move, u64)>,
        next: (u64, Lsn),
    },
    /// The pieces of the blocks of objects a cleaner step packs, read back (`None` for a
    /// block whose pieces could not be read whole): its relocations go on.
    Packed {
        relocations: reclaim::Relocations,
        read: Vec<Option<Vec<u8>>>,
        next: (u64, Lsn),
    },
    /// A checkpoint was written (or not): the ring before its tail is free.
    Checkpointed {
        result: Result<(), LogDeviceError>,
        checkpoint: CheckpointMark,
    },
    /// A newer map.
    Map(Arc<ClusterMap>),
    /// A chunk of a snapshot being installed, from its leader (or why the transfer
    /// stopped); `ack` tells the fetching task to go on once the chunk is durable.
    SnapshotChunk {
        pg: PgId,
        transfer: u64,
        chunk: Result<Chunk, String>,
        ack: oneshot::Sender<bool>,
    },
    /// A PG's leader says this replica is no longer in the PG's configuration; the
    /// replica's last log entry (index, term) when it asked.
    Removed {
        pg: PgId,
        log_when_asked: Option<(u64, u64)>,
    },
    /// A membership check of a PG is over.
    MembershipChecked { pg: PgId },
    /// A read of `pg`'s data found a block that fails its checksum: this replica's copy is
    /// damaged. `read`, if any, is the client's read, waiting for its answer.
    Damaged {
        pg: PgId,
        mismatch: Mismatch,
        read: Option<ReadRequest>,
    },
    /// The payload of a raft entry of `object`, read back to be sent to a follower, lies
    /// in a block that fails its checksum (raft holds the entry back meanwhile).
    DamagedPayload {
        object: ObjectKey,
        mismatch: Mismatch,
    },
    /// An orderly stop: hand the PGs led here over, then answer `done`.
    Stop { done: oneshot::Sender<()> },
    /// A snapshot chunk is durable: its runs lie at these device offsets.
    SnapshotWritten {
        pg: PgId,
        transfer: u64,
        runs: Vec<PayloadRef>,
        last: bool,
        ack: oneshot::Sender<bool>,
    },
}

impl Event {
    /// A client request, a raft message other than beats, or a persist of entries: a step
    /// of work under way, whose next step polling may catch. Ticks, beats and the empty
    /// persists behind a follower's answers to heartbeats are not, so an idle OSD does not
    /// poll.
    fn is_work(&self) -> bool {
        matches!(
            self,
            Event::Request { .. }
                | Event::Raft { .. }
                | Event::Persisted {
                    last_index: Some(_),
                    ..
                }
        )
    }
}

/// A snapshot this replica is installing (see [`crate::snapshot`]).
struct Installing {
    /// Raft's snapshot message, stepped once the objects are durable.
    message: RaftMessage,
    /// The leader it came from.
    leader: OsdId,
    /// The objects received, mapped where their data lies in the log.
    aside: PgObjects,
    /// The transfer's first entry (`SNAPSHOT_BEGIN`) is written.
    begun: bool,
    /// Raft has the message: the install is on its way to the log and cannot be given up.
    stepped: bool,
    /// Tells this transfer's events from those of an earlier one given up.
    transfer: u64,
    /// The highest applied index of the leader among the chunks received.
    fuzzy_through: u64,
    /// Log bytes its chunks took so far.
    written: u64,
}

/// An append's completion.
type AppendFuture =
    std::pin::Pin<Box<dyn Future<Output = Result<Appended, LogDeviceError>> + Send>>;

/// An object write in an append: raft index, term, position among the append's entries.
type WriteAt = (u64, u64, usize);

/// What a written checkpoint lets the core do.
#[derive(Debug, Clone, Copy)]
struct CheckpointMark {
    sequence: u64,
    replay_position: u64,
    tail: (u64, Lsn),
    /// It was asked for (see [`Reclaim::asked`]).
    asked: bool,
}

/// The state of log reuse.
struct Reclaim {
    /// The ring position and LSN of the batch that carried the last persist the core
    /// processed: where a checkpoint cut now lets replay start (that batch may carry other
    /// persists not processed yet; replaying the processed ones again is harmless), and
    /// how far the cleaner may go.
    durable_end: (u64, Lsn),
    /// The cleaner has gone through the ring up to here.
    cleaned_to: (u64, Lsn),
    /// The position of a damaged batch the cleaner could not move data out of (counted
    /// once as a checksum error, not at every retry).
    unrescued: Option<u64>,
    /// A cleaner step is under way.
    cleaning: bool,
    /// Free space fell below the low mark: the cleaner runs until it is above the high one.
    pressed: bool,
    /// When the cleaner last started, or a checkpoint last freed space: writes that find no
    /// room wait (`Busy`) only while this is recent.
    progress_at: std::time::Instant,
    /// When the cleaner may look again after finding nothing to read.
    clean_after: std::time::Instant,
    /// The last checkpoint's sequence number (0: none yet).
    sequence: u64,
    /// Where the last checkpoint's replay starts.
    replay_position: u64,
    /// A checkpoint is being written.
    writing: bool,
    /// Checkpoints stopped (one did not fit its area).
    stopped: bool,
    /// Bytes the object index maps, refreshed on ticks.
    live_bytes: u64,
    /// Bytes of the log blocks that data touches, refreshed with `live_bytes` (a 512-byte
    /// write keeps a block in use).
    occupied_bytes: u64,
    /// Bytes of those blocks that packing the blocks of objects whose pieces lie in
    /// several would free, refreshed with them.
    packable_bytes: u64,
    /// Payload bytes of the raft entries kept in memory, refreshed on ticks.
    retained_bytes: u64,
    /// What the object index takes in a checkpoint at most, refreshed with `live_bytes`
    /// ([`PgObjects::checkpoint_bytes`]).
    index_bytes: u64,
    /// Whether live data, and whether the index, made this OSD full at the last tick
    /// ([`Core::full_by`]).
    full_by: [bool; 2],
    /// A checkpoint is wanted whatever the log written since (a repair went in: replay
    /// must not go through the damaged data it replaced).
    asked: bool,
    /// Free space a snapshot install refused for want of room needs, and until when the
    /// cleaner works towards it (then the leader's next send finds the room).
    wanted_free: (u64, std::time::Instant),
}

impl Reclaim {
    /// Free space ran short: the cleaner runs, and writes that find no room wait for it
    /// from now on (a press that found `progress_at` from long ago would refuse them with
    /// ENOSPC at once).
    fn press(&mut self) {
        if !self.pressed {
            self.pressed = true;
            self.progress_at = std::time::Instant::now();
        }
    }

    /// Bytes of the log blocks live data would keep in use once the cleaner packed the
    /// blocks of objects whose pieces lie in several (it does as it goes round the ring).
    fn packed_bytes(&self) -> u64 {
        self.occupied_bytes - self.packable_bytes
    }
}

/// One persist on its way to the device: its appends, in order.
struct PendingPersist {
    /// None: an empty persist that only moves `durable_end`.
    pg: Option<PgId>,
    /// The PG's group it is of ([`Core::generations`]).
    generation: u64,
    number: u64,
    /// A snapshot (index, term) it installs.
    snapshot: Option<(u64, u64)>,
    then_send: Vec<(OsdId, RaftMessage)>,
    hard_state: Option<basalt_replication::HardState>,
    last_index: Option<u64>,
    /// Each append's completion, and (raft index, position in the append) of its writes.
    appends: Vec<(AppendFuture, Vec<WriteAt>)>,
}

struct Proposal {
    term: u64,
    /// Log bytes this write was counted for until it is durable.
    log_bytes: u64,
    arrived: std::time::Instant,
    reply: oneshot::Sender<Message>,
    write_bytes: u64,
    /// A listing ([`OsdRequest::ListObjects`]) that waits on this entry, not a client
    /// request: of this image, from this object number on.
    listing: Option<(basalt_common::ImageId, u64)>,
}

struct ReadRequest {
    arrived: std::time::Instant,
    object: ObjectKey,
    offset_bytes: u64,
    len_bytes: u64,
    reply: oneshot::Sender<Message>,
}

/// A connection to a peer OSD, (re)made when there is something to send.
struct Peer {
    queue: mpsc::UnboundedSender<Outgoing>,
    address: Arc<Mutex<Option<SocketAddr>>>,
    link: Arc<Mutex<PeerLink>>,
}

/// The connection to a peer, shared by the core, which sends on it at once when it is up
/// and nothing waits in the peer's queue, and the peer's task, which makes it and sends
/// what waits. Sent at once, a leader's appends are on the wire before its own log write
/// is submitted (the task would run only after the core's turn, the submission included).
#[derive(Default)]
struct PeerLink {
    connection: Option<(SocketAddr, Client)>,
    /// Batches in the queue, not sent yet: while any waits, the core queues too (in order).
    queued: usize,
}

impl Peer {
    /// Sends `batch` now if the connection is up and nothing waits before it; else gives
    /// it back, counted as queued (the caller queues it).
    fn send_now(
        &self,
        (me, id): (OsdId, OsdId),
        batch: Outgoing,
        counters: &Counters,
    ) -> Result<(), Outgoing> {
        let want = *self.address.lock().unwrap_or_else(|p| p.into_inner());
        let mut link = self.link.lock().unwrap_or_else(|p| p.into_inner());
        match &link.connection {
            Some((at, client)) if link.queued == 0 && Some(*at) == want => {
                if send_batch((me, id), client, batch, counters).is_err() {
                    link.connection = None;
                }
                Ok(())
            }
            _ => {
                link.queued += 1;
                Err(batch)
            }
        }
    }
}

/// What one turn of the loop sends a peer: its raft messages, and whether this OSD is full.
struct Outgoing {
    messages: Vec<(PgId, RaftMessage)>,
    full: bool,
}

fn reply(status: Status) -> Message {
    Message::Reply {
        status,
        data: Vec::new(),
    }
}

fn invalid(message: impl Into<String>) -> Message {
    reply(Status::Invalid {
        message: message.into(),
    })
}

/// A PG's map floor: the newest map epoch its log (or a snapshot of it) says requests were
/// taken under ([`pg_log::map_floor_data`]). A leader writes the floor before the first
/// request it takes under a newer map, and in each term; a later leader with an older map
/// takes none until its map catches up. Otherwise a leader elected with a map older than an
/// image's change would take requests the change refuses: a write where the image was
/// removed or cut off (left there after the discard), or a discard of bytes cut off and
/// given back to the image since (wiping what was written there). Kept in memory: a
/// restarted OSD boots with the monitors' newest map.
#[derive(Debug, Default)]
struct MapFloor {
    /// The newest epoch seen in the PG's log, its snapshots, or proposed here.
    epoch: Epoch,
    /// The raft term and epoch of the floor this OSD last proposed as leader: proposed
    /// again in a new term (an entry of an earlier one may have been replaced since).
    proposed: Option<(u64, Epoch)>,
    /// Since when this OSD has led the PG with a map older than the floor
    /// ([`Core::hand_over_below_floor`]).
    below_since: Option<std::time::Instant>,
}

struct Core {
    id: OsdId,
    raft: MultiRaft,
    map: Arc<ClusterMap>,
    /// Raft state replayed from the log for PGs whose groups are not created yet.
    restored: BTreeMap<PgId, Restored>,
    objects: HashMap<PgId, PgObjects>,
    applied: HashMap<PgId, u64>,
    proposals: HashMap<(PgId, u64), Proposal>,
    reads: HashMap<PgId, Vec<(u64, ReadRequest)>>,
    log: Arc<LogDevice>,
    persists: mpsc::UnboundedSender<PendingPersist>,
    /// An empty persist is on its way to move `durable_end` ([`Core::move_durable_end`]).
    moving_durable_end: bool,
    peers: HashMap<OsdId, Peer>,
    engine: Arc<FileEngine>,
    counters: Arc<Counters>,
    report: Arc<Mutex<OsdReport>>,
    /// Wakes the heartbeat task to send the report now (this OSD became full or not).
    report_now: Arc<tokio::sync::Notify>,
    /// When the PGs led here get their next scrub marker.
    scrub_schedule: crate::scrub::Schedule,
    /// Each hosted PG's latest scrub digest, written by the digest tasks.
    scrubs: Arc<Mutex<BTreeMap<PgId, PgScrub>>>,
    /// Per PG, the last log index at which its objects may not be its state at any one
    /// entry: scrub markers up to it are not digested. A snapshot's objects hold writes up
    /// to its leader's applied index at the last chunk; at start, markers already in the
    /// log are not digested again (the objects restored may be from such a snapshot).
    scrub_fuzzy_through: HashMap<PgId, u64>,
    actions: Vec<Action>,
    /// Which hard states each PG's persists write.
    hard_states: HashMap<PgId, pg_log::HardStates>,
    /// Log bytes of the writes proposed here and not yet answered.
    pending_bytes: u64,
    /// The core's own queue, for the tasks it starts.
    events: mpsc::UnboundedSender<Event>,
    /// What of each PG's raft log is durable.
    durable: HashMap<PgId, Durable>,
    /// Object indexes from the checkpoint, for PGs whose groups are not created yet.
    restored_objects: BTreeMap<PgId, PgObjects>,
    reclaim: Reclaim,
    /// Raft messages of this loop turn, by peer.
    outbox: BTreeMap<OsdId, Vec<(PgId, RaftMessage)>>,
    /// Reads waiting for raft to confirm leadership, by the id given to raft.
    confirming: HashMap<u64, (PgId, ReadRequest)>,
    next_read: u64,
    /// Snapshots being installed here, by PG.
    installing: HashMap<PgId, Installing>,
    /// The most log bytes a transfer given up wrote, by PG: what an install of it writes at
    /// least (a new member has no copy of its own to go by).
    install_written: HashMap<PgId, u64>,
    /// The last snapshot transfer started.
    next_transfer: u64,
    /// Snapshots sent to followers (PG, follower): when the follower was last heard asking
    /// for data.
    snapshots_sent: HashMap<(PgId, OsdId), std::time::Instant>,
    /// Each hosted PG's group, numbered as they are created: a persist of a group removed
    /// since is not the new group's, if the PG is hosted again.
    generations: HashMap<PgId, u64>,
    next_generation: u64,
    /// What each peer's last raft frame said of whether it is full, and when it came
    /// ([`Core::replicas_not_full`]).
    peers_full: HashMap<OsdId, (bool, std::time::Instant)>,
    /// Each PG's map floor ([`MapFloor`]).
    map_floors: HashMap<PgId, MapFloor>,
    /// PGs whose leader is being asked whether this replica was removed.
    membership_checks: std::collections::HashSet<PgId>,
    /// See [`OsdConfig::max_moves`].
    max_moves: usize,
    /// Repairs asked of this replica, by PG.
    repairs: BTreeMap<PgId, Repair>,
    /// PGs whose raft log here was found holding a payload this replica cannot read back:
    /// looked at again every second ([`Core::refresh_unsendable`]), and forgotten once none
    /// is left.
    log_suspects: BTreeSet<PgId>,
    /// Of those, the PGs no replica leads as far as this one knows that still hold one past
    /// the commit index (`OsdReport::unsendable`).
    unsendable: Vec<PgId>,
    /// The PGs of which this replica is a voter and that no replica leads as far as it
    /// knows, with its configuration of each (`OsdReport::leaderless`), as of the last
    /// second.
    leaderless: Vec<LeaderlessPg>,
    /// An orderly stop under way ([`Event::Stop`]).
    stopping: Option<Stopping>,
}

/// An orderly stop under way: the PGs led here are being handed over.
struct Stopping {
    /// When it stops waiting for them.
    until: std::time::Instant,
    /// PGs still led here, and when that count last went down (or the stop began).
    led: usize,
    progress_at: std::time::Instant,
    /// Told when none is led here any more, or the wait is over.
    done: oneshot::Sender<()>,
}

impl Core {
    /// Hosts every PG the map gives this OSD, and learns peer addresses.
    fn adopt_map(&mut self, map: Arc<ClusterMap>) {
        if map.epoch < self.map.epoch {
            return;
        }
        for pool in map.pools.values() {
            for (index, entry) in pool.pgs.iter().enumerate() {
                let pg = PgId {
                    pool: pool.id,
                    index: index as u32,
                };
                // A replica with durable state stays until the PG's leader has removed it
                // from the raft group (see `check_memberships`).
                if self.raft.hosts(pg)
                    || !(entry.members.contains(&self.id) || self.restored.contains_key(&pg))
                {
                    continue;
                }
                // Kept in `restored` until the group exists: a PG that cannot be hosted
                // keeps log reuse stopped, so that its data is never freed.
                let restored = self.restored.get(&pg).cloned().unwrap_or_default();
                let durable = Durable::restored(&restored);
                let applied = restored.applied;
                if let Err(error) = self.raft.create_group(pg, entry.initial(), restored) {
                    tracing::error!(%pg, %error, "cannot host pg");
                    continue;
                }
                self.restored.remove(&pg);
                self.next_generation += 1;
                self.generations.insert(pg, self.next_generation);
                self.durable.insert(pg, durable);
                self.applied.insert(pg, applied);
                let objects = self.restored_objects.remove(&pg).unwrap_or_default();
                self.objects.insert(pg, objects);
            }
        }
        self.map = map.clone();
        // Durable state of pools removed since: forgotten, so that the log can be reused.
        let gone: Vec<PgId> = self
            .restored
            .keys()
            .filter(|pg| !map.pools.contains_key(&pg.pool))
            .copied()
            .collect();
        for pg in gone {
            self.remove_pg(pg);
        }
        for osd in map.osds.values() {
            if osd.id == self.id {
                continue;
            }
            let address = osd.address.parse::<SocketAddr>().ok();
            let peer = self
                .peers
                .entry(osd.id)
                .or_insert_with(|| spawn_peer(self.id, osd.id, self.counters.clone()));
            *peer.address.lock().unwrap_or_else(|p| p.into_inner()) = address;
        }
    }

    /// Hands over the PGs led here while an orderly stop is under way, and tells the stop
    /// once none is led here (or the time is out).
    fn advance_stop(&mut self) {
        let Some(stopping) = &mut self.stopping else {
            return;
        };
        let led = self.raft.give_up_leadership();
        let now = std::time::Instant::now();
        if led < stopping.led {
            stopping.led = led;
            stopping.progress_at = now;
        }
        if led > 0 && now < stopping.until && now - stopping.progress_at < STOP_STALLED {
            return;
        }
        if led > 0 {
            tracing::warn!(
                led,
                "stopping while leading pgs that no other replica took over in time"
            );
        } else {
            tracing::info!("no pg led here any more; stopping");
        }
        if let Some(stopping) = self.stopping.take() {
            let _ = stopping.done.send(());
        }
    }

    fn handle(&mut self, event: Event) -> Result<(), OsdError> {
        match event {
            Event::Stop { done } => {
                tracing::info!("stopping: handing over the pgs led here");
                let now = std::time::Instant::now();
                self.stopping = Some(Stopping {
                    until: now + STOP_HAND_OVER,
                    led: usize::MAX,
                    progress_at: now,
                    done,
                });
                self.advance_stop();
            }
            Event::Request { message, reply } => self.request(message, reply),
            Event::Raft { pg, message } => self.raft_message(pg, message),
            Event::PeerFull { from, full } => {
                self.peers_full
                    .insert(from, (full, std::time::Instant::now()));
            }
            Event::Beats { from, to, beats } => {
                for beat in &beats {
                    self.raft.step(beat.pg, heartbeat(beat, from, to));
                }
            }
            Event::SnapshotChunk {
                pg,
                transfer,
                chunk,
                ack,
            } => {
                if self.transfer_under_way(pg, transfer) {
                    self.snapshot_chunk(pg, chunk, ack);
                } else {
                    let _ = ack.send(false);
                }
            }
            Event::Damaged { pg, mismatch, read } => {
                // A read planned before a repair's install may find the copy it replaced:
                // only a block the index still reads is damage of this copy.
                let current = read.as_ref().is_none_or(|read| {
                    let range = (read.offset_bytes, read.len_bytes);
                    self.objects.get(&pg).is_some_and(|objects| {
                        objects.reads_block(read.object, range, mismatch.device_offset_bytes)
                    })
                });
                let reply_to = read.map(|read| read.reply);
                if current {
                    self.damaged(pg, mismatch, reply_to);
                } else if let Some(reply_to) = reply_to {
                    let _ = reply_to.send(reply(Status::Busy {
                        message: format!("pg {pg}: the read met data replaced since; retry"),
                    }));
                }
            }
            Event::DamagedPayload { object, mismatch } => {
                // An image being removed still has its objects here (until discarded).
                let image = self.map.image_range(object.image, true);
                let pool = image.and_then(|(image, _)| self.map.pools.get(&image.pool));
                match pool {
                    Some(pool) => {
                        let pg = pool.pg_of(object);
                        if !self.log_suspects.contains(&pg) {
                            tracing::warn!(%pg, "entries held back from a follower: a payload among them is damaged here");
                        }
                        self.damaged(pg, mismatch, None);
                        self.log_damaged(pg);
                    }
                    None => {
                        tracing::error!(image = object.image.0, %mismatch, "a damaged payload of an image no longer in the map");
                    }
                }
            }
            Event::SnapshotWritten {
                pg,
                transfer,
                runs,
                last,
                ack,
            } => {
                if self.transfer_under_way(pg, transfer) {
                    self.snapshot_written(pg, runs, last, ack);
                } else {
                    let _ = ack.send(false);
                }
            }
            Event::Persisted {
                pg,
                generation,
                number,
                snapshot,
                then_send,
                payloads,
                hard_state,
                last_index,
                end,
            } => {
                if let Some(end) = end {
                    self.reclaim.durable_end = end;
                }
                let Some(pg) = pg else {
                    self.moving_durable_end = false;
                    return Ok(());
                };
                if !self.raft.hosts(pg) || self.generations.get(&pg) != Some(&generation) {
                    // Removed from the PG meanwhile, and maybe added again: raft's
                    // numbers of persists started again with the new group, and this one
                    // is none of its (it would count entries persisted that are not).
                    return Ok(());
                }
                if let Some((index, _)) = snapshot
                    && let Some(leader) = self.snapshot_installed(pg, index)
                {
                    // Goes first, so that the leader takes it for the snapshot it sent;
                    // raft's answer (in `then_send`) ends the transfer too, through
                    // `MultiRaft::step`, should this be lost.
                    let installed = self.raft.snapshot_installed(leader, index);
                    self.send(leader, pg, installed);
                }
                self.durable
                    .entry(pg)
                    .or_default()
                    .persisted(last_index, hard_state);
                for (index, term, offset) in payloads {
                    // Memory keeps where the payload is, not the payload; apply uses it.
                    self.raft.replace_entry_data(pg, index, term, |data| {
                        PayloadRef::of_write(data, offset).map(|reference| reference.encode())
                    });
                }
                self.raft.on_persisted(pg, number);
                for (to, message) in then_send {
                    self.send(to, pg, message);
                }
            }
            Event::Failed(reason) => return Err(OsdError::Internal(reason)),
            Event::Removed { pg, log_when_asked } => {
                // Entries taken since the question mean a leader added this replica back
                // (an OSD out and in again while its map lags): it may already count on
                // them, so the data stays. The next check asks again.
                if self.last_log_id(pg) == log_when_asked {
                    self.remove_pg(pg);
                } else {
                    tracing::info!(%pg, "removal not applied: the replica took entries since it asked");
                }
            }
            Event::MembershipChecked { pg } => {
                self.membership_checks.remove(&pg);
            }
            Event::Cleaned(result) => self.cleaned(result),
            Event::Packed {
                relocations,
                read,
                next,
            } => {
                let packed = read.iter().filter(|read| read.is_some()).count();
                tracing::debug!(packed, of = read.len(), "blocks of objects packed");
                self.relocate(relocations.with_packs(read), next, MOVED_DAMAGED);
            }
            Event::Rescue(result) => self.rescue(result),
            Event::Relocated { moves, next } => {
                let mut bytes = 0;
                let sums = self.log.block_sums();
                for (moved, to) in &moves {
                    // Before anything reads the new place.
                    for block in &moved.damaged_blocks {
                        sums.poison(to + block * BLOCK_SIZE as u64);
                    }
                    bytes += reclaim::apply_move(moved, *to, &mut self.raft, &mut self.objects);
                }
                self.counters
                    .relocated_bytes
                    .fetch_add(bytes, Ordering::Relaxed);
                tracing::debug!(bytes, to = next.0, "relocated");
                self.stepped(next, bytes);
            }
            Event::Checkpointed { result, checkpoint } => {
                self.reclaim.writing = false;
                match result {
                    Ok(()) => {
                        tracing::debug!(
                            sequence = checkpoint.sequence,
                            tail = checkpoint.tail.0,
                            replay = checkpoint.replay_position,
                            free = self.log.free_bytes(),
                            "checkpoint written"
                        );
                        if checkpoint.asked {
                            tracing::info!(
                                sequence = checkpoint.sequence,
                                replay = checkpoint.replay_position,
                                "checkpoint written as asked: replay starts past damaged data \
                                 or the data a repair replaced"
                            );
                        }
                        if checkpoint.tail.0 > self.log.tail_position() {
                            self.reclaim.progress_at = std::time::Instant::now();
                        }
                        self.reclaim.sequence = checkpoint.sequence;
                        self.reclaim.replay_position = checkpoint.replay_position;
                        self.log.set_tail(checkpoint.tail.0);
                        self.counters.checkpoints.fetch_add(1, Ordering::Relaxed);
                        self.end_covered_repairs();
                    }
                    Err(error @ LogDeviceError::CheckpointTooLarge { .. }) => {
                        tracing::error!(%error, "checkpoints stop: the log is not reused any more");
                        self.reclaim.stopped = true;
                    }
                    Err(error) => return Err(OsdError::Internal(error.to_string())),
                }
            }
            Event::Map(map) => self.adopt_map(map),
        }
        Ok(())
    }

    /// A raft message from a peer. A snapshot that this replica needs is not stepped at
    /// once: the PG's objects are fetched first (see [`crate::snapshot`]).
    fn raft_message(&mut self, pg: PgId, message: RaftMessage) {
        if carries_references(&message) {
            tracing::warn!(%pg, from = message.from, "raft entries with payload references refused");
            return;
        }
        let Some((index, leader)) = MultiRaft::snapshot_of(&message) else {
            self.raft.step(pg, message);
            return;
        };
        if let Some(installing) = self.installing.get(&pg) {
            if installing.stepped || message.term <= installing.message.term {
                // The leader waits for the one under way.
                return;
            }
            // A newer leader's snapshot replaces an older one's.
            self.abort_install(pg, "a newer leader sent another", false);
        }
        let refused = self
            .repairs
            .get_mut(&pg)
            .and_then(|repair| repair.refuse_from.take_if(|from| *from == leader));
        if refused.is_some() {
            tracing::info!(%pg, %leader, index, "a snapshot no longer wanted refused (the repair's request was taken back)");
            let refusal = self.raft.snapshot_refusal(leader, index);
            self.send(leader, pg, refusal);
            return;
        }
        // A replica that asked for a snapshot (a repair) fetches it however recent its log.
        let requesting = self.raft.requesting_snapshot(pg);
        let behind = requesting
            || self
                .raft
                .committed(pg)
                .is_some_and(|committed| committed < index);
        if !behind || message.term < self.raft.term(pg).unwrap_or(0) {
            // Raft answers a snapshot it does not need, or a stale one, by itself.
            self.raft.step(pg, message);
            return;
        }
        if self.raft.refuses_snapshot(pg, &message) {
            // Raft would install it and drop the entries after it, which this replica may
            // have acknowledged (see `MultiRaft::refuses_snapshot`).
            tracing::info!(%pg, %leader, index, "a snapshot older than the log refused while one is asked for");
            let refusal = self.raft.snapshot_refusal(leader, index);
            self.send(leader, pg, refusal);
            return;
        }
        let address = self
            .map
            .osds
            .get(&leader)
            .and_then(|osd| osd.address.parse::<SocketAddr>().ok());
        let Some(address) = address else {
            tracing::warn!(%pg, %leader, "a snapshot from an osd with no known address; refused");
            let refusal = self.raft.snapshot_refusal(leader, index);
            self.send(leader, pg, refusal);
            return;
        };
        // The receiving side of the move throttle: a replica behind in many PGs (an OSD
        // marked in, or back after a long absence) fetches at most max_moves snapshots at
        // once, whichever leaders send them. Nor does it start one while a checkpoint is
        // due or the cleaner has work to do, since neither runs during an install: one
        // transfer after another (each given up at its first chunk for want of room, say)
        // would keep both off for good, and the room never come. The leader is told, and
        // sends the snapshot again later.
        // A repair goes ahead all the same (reads of the damaged copy fail until it is
        // in, and it is one transfer), but for a checkpoint asked for at once: one that
        // takes a damaged batch out of replay, which a crash during the install would
        // otherwise meet at the restart.
        let full = self.installing.len() >= self.max_moves;
        let reclaim_waits = self.reuse_allowed()
            && (self.reclaim.asked
                || (!self.repairs.contains_key(&pg)
                    && (self.checkpoint_due()
                        || (self.log.free_bytes() < clean_low_mark(&self.log)
                            && self.reclaimable_bytes() > 0))));
        // Nor while the log lacks room for what it is expected to write besides the
        // installs under way: given up halfway, its data would only take room the cleaner
        // must free again (it does not run meanwhile). The cleaner makes that room first.
        let short = !self.repairs.contains_key(&pg) && !self.room_to_start_install(pg);
        if full || reclaim_waits || short {
            tracing::debug!(%pg, %leader, index, installing = self.installing.len(), full, reclaim_waits, short, "a snapshot refused for now");
            let refusal = self.raft.snapshot_refusal(leader, index);
            self.send(leader, pg, refusal);
            return;
        }
        tracing::info!(%pg, %leader, index, "installing a snapshot");
        // The room it was wanted for is there: no more cleaning towards it.
        self.reclaim.wanted_free.0 = 0;
        self.next_transfer += 1;
        let transfer = self.next_transfer;
        self.installing.insert(
            pg,
            Installing {
                message,
                leader,
                aside: PgObjects::new(),
                begun: false,
                stepped: false,
                transfer,
                fuzzy_through: 0,
                written: 0,
            },
        );
        let events = self.events.clone();
        let me = self.id;
        tokio::spawn(fetch_snapshot(address, pg, index, me, transfer, events));
    }

    /// Whether `transfer` is the snapshot transfer under way for `pg` (not one given up).
    fn transfer_under_way(&self, pg: PgId, transfer: u64) -> bool {
        self.installing
            .get(&pg)
            .is_some_and(|installing| installing.transfer == transfer)
    }

    /// A chunk of a snapshot arrived: it goes to the log, and into the index kept aside
    /// once durable ([`Core::snapshot_written`]).
    fn snapshot_chunk(
        &mut self,
        pg: PgId,
        chunk: Result<Chunk, String>,
        ack: oneshot::Sender<bool>,
    ) {
        let chunk = match chunk {
            Ok(chunk) => chunk,
            Err(reason) => {
                self.abort_install(pg, &reason, true);
                let _ = ack.send(false);
                return;
            }
        };
        let Some(installing) = self.installing.get_mut(&pg) else {
            let _ = ack.send(false);
            return;
        };
        let bytes = chunk.data_bytes();
        let last = chunk.next.is_none();
        installing.fuzzy_through = installing.fuzzy_through.max(chunk.applied);
        let transfer = installing.transfer;
        let first = !installing.begun;
        // The floors of the entries the snapshot stands for.
        self.raise_map_floor(pg, Epoch(chunk.map_floor));
        let batches = batch::split(snapshot::chunk_entries(pg, chunk, first));
        let log_bytes: u64 = batches
            .iter()
            .map(|entries| batch::batch_size(entries) as u64)
            .sum();
        // The transfer holds checkpoints back, so it needs room for all it writes, and the
        // reserve must stay free for raft's persists meanwhile; short of it, the leader
        // sends the snapshot again later, and the cleaner frees what it can.
        if !self.room_for_install(pg, log_bytes) {
            self.reclaim.press();
            // What it would have written counts the chunk that found no room, or the next
            // transfer could stop at the same one again.
            if let Some(installing) = self.installing.get_mut(&pg) {
                installing.written += log_bytes;
            }
            self.abort_install(pg, "the log has no room for it now", true);
            self.want_room_for_install(pg);
            let _ = ack.send(false);
            return;
        }
        if let Some(installing) = self.installing.get_mut(&pg) {
            installing.begun = true;
            installing.written += log_bytes;
        }
        self.counters
            .snapshot_bytes_received
            .fetch_add(bytes, Ordering::Relaxed);
        // Each append, and the position and meta of each run it carries.
        type RunsAt = Vec<(usize, [u8; batch::META_SIZE])>;
        let appends: Vec<(AppendFuture, RunsAt)> = batches
            .into_iter()
            .map(|entries| {
                let runs = entries
                    .iter()
                    .enumerate()
                    .filter(|(_, entry)| entry.kind == snapshot::SNAPSHOT_WRITE)
                    .map(|(at, entry)| (at, entry.meta))
                    .collect();
                (Box::pin(self.log.submit(entries)) as AppendFuture, runs)
            })
            .collect();
        let events = self.events.clone();
        tokio::spawn(async move {
            let mut runs = Vec::new();
            for (append, metas) in appends {
                match append.await {
                    Ok(appended) => runs.extend(metas.into_iter().map(|(at, meta)| {
                        PayloadRef::from_meta(&meta, appended.data_offsets_bytes[at])
                    })),
                    Err(error) => {
                        let _ = events.send(Event::Failed(format!("snapshot data: {error}")));
                        return;
                    }
                }
            }
            let _ = events.send(Event::SnapshotWritten {
                pg,
                transfer,
                runs,
                last,
                ack,
            });
        });
    }

    /// A snapshot chunk is durable: its runs are mapped aside. After the last one, raft
    /// gets the snapshot message.
    fn snapshot_written(
        &mut self,
        pg: PgId,
        runs: Vec<PayloadRef>,
        last: bool,
        ack: oneshot::Sender<bool>,
    ) {
        let Some(installing) = self.installing.get_mut(&pg) else {
            let _ = ack.send(false);
            return;
        };
        for run in &runs {
            installing.aside.apply_ref(run);
        }
        let _ = ack.send(true);
        if !last {
            return;
        }
        if !self.room_for_install(pg, 0) {
            self.abort_install(pg, "the log has no room to install it now", true);
            return;
        }
        let Some(installing) = self.installing.get_mut(&pg) else {
            return;
        };
        let message = std::mem::take(&mut installing.message);
        installing.stepped = true;
        self.raft.step(pg, message);
        if !self.raft.has_pending_snapshot(pg) {
            // A newer term or commit index made it stale meanwhile; a newer leader may be
            // waiting for this replica to take its own snapshot.
            self.abort_install(pg, "raft no longer needs it", true);
        }
    }

    /// Whether a snapshot of `pg` being installed may write `log_bytes` more: checkpoints
    /// wait for it, so the reserve (and the headroom) must stay free for everything else.
    fn room_for_install(&self, pg: PgId, log_bytes: u64) -> bool {
        let free = self.free_for_writes();
        free >= self.install_floor(pg) + log_bytes
    }

    /// Log bytes an install of `pg` is expected to write: about the copy it replaces here
    /// (a replica behind holds about as much), with a sixteenth more for batch headers, and
    /// at least what a transfer of it given up wrote.
    fn install_estimate(&self, pg: PgId) -> u64 {
        let bytes = self.objects.get(&pg).map_or(0, PgObjects::mapped_bytes);
        let given_up = self.install_written.get(&pg).copied().unwrap_or(0);
        (bytes + bytes / 16).max(given_up)
    }

    /// The free space an install of `pg` needs to start: its floor, what it is expected to
    /// write, and what the installs under way are expected to write still.
    fn room_needed_for_install(&self, pg: PgId) -> u64 {
        let to_come: u64 = self
            .installing
            .iter()
            .filter(|(_, installing)| !installing.stepped)
            .map(|(other, installing)| {
                self.install_estimate(*other)
                    .saturating_sub(installing.written)
            })
            .sum();
        self.install_floor(pg) + to_come + self.install_estimate(pg)
    }

    /// Whether an install of `pg` may start: the log has the room it needs
    /// ([`Core::room_needed_for_install`]), or could not have it however much were
    /// cleaned, and no other install is under way (it is tried alone then, as before, and
    /// may be given up). If not, the cleaner is asked for the room.
    fn room_to_start_install(&mut self, pg: PgId) -> bool {
        let needed = self.room_needed_for_install(pg);
        if !self.reuse_allowed() || self.free_for_writes() >= needed {
            return true;
        }
        if self.attainable_free() < needed {
            return self.installing.is_empty();
        }
        self.want_room_for_install(pg);
        false
    }

    /// Has the cleaner work towards the room an install of `pg` needs, for a while (the
    /// leader sends the snapshot again meanwhile), as far as cleaning can free.
    fn want_room_for_install(&mut self, pg: PgId) {
        // Capped, when read, at what cleaning can free.
        let wanted = self.room_needed_for_install(pg);
        let until = std::time::Instant::now() + WANTED_FREE_FOR;
        self.reclaim.wanted_free = (wanted.max(self.wanted_free()), until);
    }

    /// Free log space not promised to writes in flight.
    fn free_for_writes(&self) -> u64 {
        self.log.free_bytes().saturating_sub(self.pending_bytes)
    }

    /// What [`Core::free_for_writes`] would be once cleaning freed all it could.
    fn attainable_free(&self) -> u64 {
        self.free_for_writes() + self.reclaimable_bytes()
    }

    /// The free space the cleaner works towards for a snapshot install, while it does.
    fn wanted_free(&self) -> u64 {
        let (wanted, until) = self.reclaim.wanted_free;
        if std::time::Instant::now() >= until {
            return 0;
        }
        // As far as cleaning can still free (live data may have grown since).
        wanted.min(self.attainable_free())
    }

    /// What an install of `pg` leaves free. A repair's may take half the reserve: it
    /// rebuilds a copy found damaged, typically when the log is short of room (the cleaner
    /// meets damage when it needs space), and until then reads of the PG here fail.
    fn install_floor(&self, pg: PgId) -> u64 {
        if self.repairs.contains_key(&pg) {
            self.log.reserve_bytes() / 2
        } else {
            write_floor(&self.log)
        }
    }

    /// Gives up the snapshots being installed that have not reached raft yet, when the log
    /// runs short of room: they hold checkpoints back, and only checkpoints free space.
    fn abort_installs_short_of_room(&mut self) {
        let free = self.log.free_bytes();
        if self.installing.is_empty() || free >= self.log.reserve_bytes() {
            return;
        }
        let waiting: Vec<PgId> = self
            .installing
            .iter()
            .filter(|(pg, installing)| !installing.stepped && free < self.install_floor(**pg))
            .map(|(pg, _)| *pg)
            .collect();
        for pg in waiting {
            self.abort_install(pg, "the log ran short of room", true);
        }
    }

    /// The persist that installs a snapshot is durable: the objects kept aside become the
    /// PG's, as of the snapshot's index. Returns the leader it came from, to be told.
    fn snapshot_installed(&mut self, pg: PgId, index: u64) -> Option<OsdId> {
        self.install_written.remove(&pg);
        let leader = match self.installing.remove(&pg) {
            Some(installing) => {
                self.objects.insert(pg, installing.aside);
                self.scrub_fuzzy_through
                    .insert(pg, installing.fuzzy_through.max(index));
                Some(installing.leader)
            }
            None => {
                tracing::error!(%pg, index, "a snapshot installed without its objects");
                None
            }
        };
        self.applied.insert(pg, index);
        self.counters
            .snapshots_installed
            .fetch_add(1, Ordering::Relaxed);
        tracing::info!(%pg, index, "snapshot installed");
        if let Some(repair) = self.repairs.get(&pg) {
            // The data it replaced may lie in a damaged batch: a checkpoint now keeps
            // replay from reading it again, which would stop this OSD from starting.
            self.reclaim.asked = true;
            if leader.is_some_and(|leader| repair.avoid.contains(&leader)) {
                // A copy in doubt too (a replica `basalt pg repair` found odd as well):
                // the repair goes on, and asks the next leader.
                tracing::warn!(%pg, index, "a snapshot from a replica whose copy is in doubt too installed; the repair goes on");
            } else {
                // The repair is answered once the checkpoint is written
                // ([`Core::end_covered_repairs`]).
                let state = self.replica_state(pg);
                if let Some(repair) = self.repairs.get_mut(&pg) {
                    repair.installed = Some(state);
                }
            }
        }
        leader
    }

    /// Gives up a snapshot being installed (its data in the log is never mapped), and tells
    /// its leader if asked to, so that it sends another.
    fn abort_install(&mut self, pg: PgId, reason: &str, tell_leader: bool) {
        if let Some(installing) = self.installing.remove(&pg) {
            tracing::warn!(%pg, leader = %installing.leader, reason, "snapshot not installed");
            let written = self.install_written.entry(pg).or_default();
            *written = (*written).max(installing.written);
            if tell_leader {
                // The leader raft knows now, if any, else the one that sent it.
                let leader = self
                    .raft
                    .leader(pg)
                    .filter(|leader| *leader != self.id)
                    .unwrap_or(installing.leader);
                let index =
                    MultiRaft::snapshot_of(&installing.message).map_or(0, |(index, _)| index);
                let refusal = self.raft.snapshot_refusal(leader, index);
                self.send(leader, pg, refusal);
            }
        }
    }

    /// Answers a follower's request for snapshot data: the next runs of the PG's objects,
    /// read from the device.
    fn serve_snapshot(
        &mut self,
        pg: PgId,
        index: u64,
        follower: OsdId,
        from: Option<Cursor>,
        max_bytes: u32,
        reply_to: oneshot::Sender<Message>,
    ) {
        if !self.raft.hosts(pg) {
            let _ = reply_to.send(invalid(format!("pg {pg} is not hosted here")));
            return;
        }
        let applied = self.applied.get(&pg).copied().unwrap_or(0);
        if applied < index {
            let _ = reply_to.send(reply(Status::Busy {
                message: format!("pg {pg} is applied up to {applied}, the snapshot is at {index}"),
            }));
            return;
        }
        let now = std::time::Instant::now();
        // Heard from the follower, if this is the snapshot it was sent (another one's
        // fetches do not keep it alive: it is counted failed in time if it stops).
        if self.raft.snapshot_sent(pg, follower) == Some(index)
            && let Some(heard) = self.snapshots_sent.get_mut(&(pg, follower))
        {
            *heard = now;
        }
        let empty = PgObjects::new();
        let objects = self.objects.get(&pg).unwrap_or(&empty);
        let max_bytes = u64::from(max_bytes.min(snapshot::CHUNK_BYTES));
        let (plan, next) = snapshot::plan_chunk(objects, from, max_bytes);
        type RunRead = (u64, u64, Vec<Piece>);
        let reads: Vec<(ObjectKey, Vec<RunRead>)> = plan
            .into_iter()
            .map(|(key, runs)| {
                let runs = runs
                    .into_iter()
                    .map(|(offset, len)| (offset, len, objects.plan_read(key, offset, len)))
                    .collect();
                (key, runs)
            })
            .collect();
        let pin = self.pin_reads(
            reads
                .iter()
                .flat_map(|(_, runs)| runs.iter().flat_map(|(_, _, pieces)| pieces)),
        );
        let (engine, sums) = (self.engine.clone(), self.log.block_sums());
        let counters = self.counters.clone();
        let events = self.events.clone();
        // This OSD's own map at least: the floors in the entries the snapshot stands for
        // are known here only if persisted since it started (they are no newer than the
        // map it booted with).
        let map_floor = self.map_floor(pg).max(self.map.epoch).0;
        tokio::spawn(async move {
            let _pin = pin;
            let mut chunk = Chunk {
                objects: Vec::with_capacity(reads.len()),
                next,
                applied,
                map_floor,
            };
            for (key, runs) in reads {
                let mut data = Vec::with_capacity(runs.len());
                for (offset, len, pieces) in runs {
                    match read_pieces(&engine, &sums, offset, len, &pieces).await {
                        Ok(ReadBack {
                            damaged: Some(mismatch),
                            ..
                        }) => {
                            // Never sent: the follower would take the damage for the data.
                            let _ = reply_to.send(reply(Status::Io {
                                message: format!(
                                    "pg {pg}: the leader's copy is damaged: {mismatch}"
                                ),
                            }));
                            let read = None;
                            let _ = events.send(Event::Damaged { pg, mismatch, read });
                            return;
                        }
                        Ok(ReadBack { data: bytes, .. }) => data.push((offset as u32, bytes)),
                        Err(error) => {
                            let _ = reply_to.send(reply(Status::Io {
                                message: format!("reading the log device: {error}"),
                            }));
                            return;
                        }
                    }
                }
                chunk.objects.push((key, data));
            }
            counters
                .snapshot_bytes_sent
                .fetch_add(chunk.data_bytes(), Ordering::Relaxed);
            let _ = reply_to.send(Message::Reply {
                status: Status::Ok,
                data: chunk.encode(),
            });
        });
    }

    /// Snapshots sent to followers that stopped asking for data count as failed, so that
    /// raft sends another (a follower that restarted meanwhile forgot it).
    fn watch_snapshots_sent(&mut self) {
        let raft = &mut self.raft;
        self.snapshots_sent.retain(|(pg, follower), heard| {
            if !raft.sending_snapshot(*pg, *follower) {
                return false;
            }
            if heard.elapsed() < SNAPSHOT_SILENCE {
                return true;
            }
            tracing::warn!(%pg, %follower, "a follower stopped fetching its snapshot");
            raft.snapshot_failed(*pg, *follower);
            false
        });
    }

    /// Queues a raft message for a peer; [`Core::flush`] sends each peer's queue as one frame.
    fn send(&mut self, to: OsdId, pg: PgId, message: RaftMessage) {
        self.outbox.entry(to).or_default().push((pg, message));
    }

    /// Sends what this turn of the loop produced for each peer, one frame per peer: the
    /// heartbeats of every PG led here and shared with that peer travel together, and
    /// whether this OSD is full.
    fn flush(&mut self) {
        if self.outbox.is_empty() {
            return;
        }
        let full = self.is_full();
        for (to, messages) in std::mem::take(&mut self.outbox) {
            match self.peers.get(&to) {
                Some(peer) => {
                    let batch = Outgoing { messages, full };
                    if let Err(batch) = peer.send_now((self.id, to), batch, &self.counters)
                        && peer.queue.send(batch).is_err()
                    {
                        tracing::warn!(%to, "the task sending to this peer is gone; raft messages dropped");
                    }
                }
                None => tracing::debug!(%to, "no address for peer; raft messages dropped"),
            }
        }
    }

    /// Checks a client request against the map (`op`: what a request without data does;
    /// `None` for a write); `Err` is the reply. Only a [`RangeOp::DiscardCut`] reaches what
    /// a shrink cut off and images being removed, and nothing else.
    fn check(&self, range: &ObjectRange, op: Option<RangeOp>) -> Result<(), Message> {
        let ObjectRange {
            pg,
            epoch,
            object,
            offset_bytes,
            len_bytes,
            ..
        } = *range;
        // A client whose map is newer than ours may know a pool or image we do not yet:
        // anything we cannot find is then "ask again", not a final refusal.
        let unknown = |what: String| {
            if epoch > self.map.epoch {
                reply(Status::NotLeader { leader: None })
            } else {
                invalid(what)
            }
        };
        // A discard carries no data: it may cover a whole object (checked below).
        let discard = matches!(op, Some(RangeOp::Discard | RangeOp::DiscardCut));
        if len_bytes == 0 || (len_bytes > REQUEST_BYTES_MAX && !discard) {
            return Err(invalid(format!(
                "a request of {len_bytes} bytes: from 1 byte to {REQUEST_BYTES_MAX}"
            )));
        }
        let Some(pool) = self.map.pools.get(&pg.pool) else {
            return Err(unknown(format!("pool {} does not exist", pg.pool)));
        };
        let Some(entry) = self.map.pg(pg) else {
            return Err(unknown(format!("pg {pg} does not exist")));
        };
        if epoch < entry.epoch {
            return Err(reply(Status::StaleEpoch {
                current: self.map.epoch,
            }));
        }
        // This PG's log holds requests taken under a newer map than ours (by an earlier
        // leader): none is taken here under an older one ("ask again" until ours catches
        // up).
        if self.map.epoch < self.map_floor(pg) {
            return Err(reply(Status::NotLeader { leader: None }));
        }
        // A discard of what an image's removal or shrink cut off, from a client with a
        // newer map, waits for that map here ("ask again"): this OSD must by then refuse
        // the writes of clients with older maps there, or one could land after the
        // discard.
        let cut = op == Some(RangeOp::DiscardCut);
        if cut && epoch > self.map.epoch {
            return Err(reply(Status::NotLeader { leader: None }));
        }
        let Some((image, allowed)) = self.map.image_range(object.image, cut) else {
            return Err(unknown(format!("image {} does not exist", object.image.0)));
        };
        if image.pool != pg.pool || pool.pg_of(object) != pg {
            return Err(unknown(format!(
                "object {}.{} is not in pg {pg}",
                object.image.0, object.number
            )));
        }
        if u64::from(offset_bytes) + len_bytes > image.object_size_bytes {
            return Err(invalid(format!(
                "range {offset_bytes}+{len_bytes} is outside the {}-byte object",
                image.object_size_bytes
            )));
        }
        // Past the image's end: a client that knows the image larger (a newer map) asks
        // again; anything else is refused rather than stored where no read reaches. A
        // discard of cut-off bytes goes only where no other request reaches: once an image
        // grew back over them, it would discard new data.
        let start = object
            .number
            .checked_mul(image.object_size_bytes)
            .and_then(|start| start.checked_add(u64::from(offset_bytes)));
        let inside = start.and_then(|start| Some(start..start.checked_add(len_bytes)?));
        if inside.is_none_or(|inside| inside.start < allowed.start || inside.end > allowed.end) {
            let what = if cut {
                format!("outside the bytes kept for discards alone ({allowed:?})")
            } else {
                format!("past the image's {} bytes", allowed.end)
            };
            return Err(unknown(format!(
                "object {}.{} range {offset_bytes}+{len_bytes} is {what}",
                object.image.0, object.number
            )));
        }
        if !self.raft.hosts(pg) {
            return Err(reply(Status::NotLeader {
                leader: entry.members.first().copied(),
            }));
        }
        Ok(())
    }

    fn request(&mut self, message: Message, reply_to: oneshot::Sender<Message>) {
        let Some(range) = message.object_range() else {
            match message {
                Message::Control { body } => self.control(&body, reply_to),
                Message::SnapshotRead {
                    pg,
                    index,
                    follower,
                    from,
                    max_bytes,
                } => self.serve_snapshot(pg, index, follower, from, max_bytes, reply_to),
                other => {
                    let _ = reply_to.send(invalid(format!(
                        "message kind {} is not a client request",
                        other.kind()
                    )));
                }
            }
            return;
        };
        if let Err(answer) = self.check(&range, message.range_op()) {
            let _ = reply_to.send(answer);
            return;
        }
        let (pg, object, offset_bytes) = (range.pg, range.object, range.offset_bytes);
        let op = match message {
            Message::Write { data, .. } => ObjectOp::Write {
                object,
                offset_bytes,
                data,
            },
            Message::Discard { len_bytes, .. } => ObjectOp::Discard {
                object,
                offset_bytes,
                len_bytes,
            },
            _ => {
                self.start_read(range, reply_to);
                return;
            }
        };
        // A write is proposed only in the term its client names: one that reached this OSD
        // late (held in a socket while the client, past its attempt's timeout, had it done
        // by another leader and sent the host's next writes) must not land after them if
        // this OSD has led again since. A client that names no term learns it here.
        if self.raft.is_leader(pg) {
            let current = self.raft.term(pg).unwrap_or(0);
            if range.term != current {
                let _ = reply_to.send(reply(Status::StaleTerm { current }));
                return;
            }
        }
        let write_bytes = op.payload().len() as u64;
        let log_bytes = write_bytes.div_ceil(BLOCK_SIZE as u64) * BLOCK_SIZE as u64
            + batch::DESCRIPTOR_SIZE as u64;
        // The PG's voters, looked up once for both checks (a follower answers as without
        // them: NotLeader).
        let members = self.led_members(pg);
        let checked = self.enough_replicas(pg, members.as_ref()).and_then(|()| {
            if write_bytes == 0 {
                return Ok(());
            }
            self.replicas_not_full(pg, members.as_ref())
                .and_then(|()| self.space_for(log_bytes))
        });
        if let Err(status) = checked {
            let _ = reply_to.send(reply(status));
            return;
        }
        match self
            // A leader's term is the one the request names (checked above).
            .propose_map_floor(pg, range.term)
            .and_then(|()| self.raft.propose(pg, op.encode()))
        {
            Ok(()) => {
                self.pending_bytes += log_bytes;
                let index = self.raft.last_index(pg).unwrap_or(0);
                let term = self.raft.term(pg).unwrap_or(0);
                self.proposals.insert(
                    (pg, index),
                    Proposal {
                        term,
                        log_bytes,
                        arrived: std::time::Instant::now(),
                        reply: reply_to,
                        write_bytes,
                        listing: None,
                    },
                );
            }
            Err(ProposeError::NotLeader { leader, .. }) => {
                let _ = reply_to.send(reply(Status::NotLeader { leader }));
            }
            Err(error) => {
                let _ = reply_to.send(reply(Status::NotLeader { leader: None }));
                tracing::debug!(%error, "proposal refused");
            }
        }
    }

    /// The PG's map floor ([`MapFloor`]); 0 if none is known.
    fn map_floor(&self, pg: PgId) -> Epoch {
        self.map_floors
            .get(&pg)
            .map_or(Epoch(0), |floor| floor.epoch)
    }

    /// Raises the PG's map floor to `epoch` if it is lower.
    fn raise_map_floor(&mut self, pg: PgId, epoch: Epoch) {
        let floor = self.map_floors.entry(pg).or_default();
        floor.epoch = floor.epoch.max(epoch);
    }

    /// Before a request the leader takes in `term` under a map newer than the PG's floor,
    /// or the first in that term, the floor at this map ([`MapFloor`]).
    fn propose_map_floor(&mut self, pg: PgId, term: u64) -> Result<(), ProposeError> {
        let epoch = self.map.epoch;
        let floor = self.map_floors.entry(pg).or_default();
        // In one term the leader's own entries stay in its log.
        if floor
            .proposed
            .is_some_and(|(proposed_in, proposed)| proposed_in == term && proposed >= epoch)
        {
            return Ok(());
        }
        self.propose_floor_entry(pg, term)
    }

    /// Proposes a map floor entry at this OSD's map in `pg`, the leader's `term`.
    fn propose_floor_entry(&mut self, pg: PgId, term: u64) -> Result<(), ProposeError> {
        let epoch = self.map.epoch;
        self.raft.propose(pg, pg_log::map_floor_data(epoch))?;
        let floor = self.map_floors.entry(pg).or_default();
        floor.proposed = Some((term, epoch));
        floor.epoch = floor.epoch.max(epoch);
        Ok(())
    }

    /// Hands each PG led here whose map floor has been above this OSD's map for
    /// [`BELOW_FLOOR_FOR`] to another voter: it takes no request meanwhile, and its map
    /// is not coming.
    fn hand_over_below_floor(&mut self) {
        let now = std::time::Instant::now();
        let mut due = Vec::new();
        for (pg, floor) in &mut self.map_floors {
            if self.map.epoch >= floor.epoch || !self.raft.is_leader(*pg) {
                floor.below_since = None;
                continue;
            }
            let since = *floor.below_since.get_or_insert(now);
            if now.saturating_duration_since(since) >= BELOW_FLOOR_FOR {
                floor.below_since = Some(now);
                due.push((*pg, floor.epoch));
            }
        }
        for (pg, floor) in due {
            // Not to a replica whose copy a repair here doubts.
            let avoid = self
                .repairs
                .get(&pg)
                .map(|repair| repair.avoid.clone())
                .unwrap_or_default();
            let heir = self.raft.hand_over(pg, &avoid);
            tracing::warn!(
                %pg,
                map_epoch = self.map.epoch.0,
                floor = floor.0,
                ?heir,
                "the pg's log was written under a newer map than this osd has: handing it over"
            );
        }
    }

    /// The voters of `pg` if this replica leads it; `None` for a follower, whose map may
    /// be older (the checks below leave it to answer NotLeader).
    fn led_members(&self, pg: PgId) -> Option<Members> {
        self.raft
            .is_leader(pg)
            .then(|| self.raft.members(pg))
            .flatten()
    }

    /// Holds writes to `pg` back (`Busy`: the client tries again until its deadline) while
    /// fewer of its voters are live than its pool's `min_size`, as Ceph holds I/O to a PG
    /// below it: this OSD, and the peers it had a raft frame from within
    /// [`PEER_FULL_FOR`] (a replica answers its leaders' heartbeats every other tick).
    /// At the default `min_size`, a majority of the pool's size, it holds back what raft
    /// could not commit anyway, but for a PG left with fewer voters than that.
    fn enough_replicas(&self, pg: PgId, members: Option<&Members>) -> Result<(), Status> {
        let (Some(pool), Some(members)) = (self.map.pools.get(&pg.pool), members) else {
            return Ok(());
        };
        let live = members
            .voters
            .iter()
            .filter(|osd| {
                **osd == self.id
                    || self
                        .peers_full
                        .get(osd)
                        .is_some_and(|(_, at)| at.elapsed() < PEER_FULL_FOR)
            })
            .count();
        if live >= pool.min_size as usize {
            return Ok(());
        }
        Err(Status::Busy {
            message: format!(
                "pg {pg} has {live} of its {} replicas live, fewer than its pool's min_size {}",
                members.voters.len(),
                pool.min_size
            ),
        })
    }

    /// Refuses a write to `pg` while one of its voters is full: a replica that cannot
    /// persist would fall behind for good, and the PG go on with one copy fewer. Discards
    /// still go (they free space). This OSD knows of itself at once, and of a peer from
    /// the peer's raft frames (each says whether it is full; a replica answers its
    /// leaders' heartbeats every other tick) or, without one of the last
    /// [`PEER_FULL_FOR`], from the map. The frames say the same as the peer's reports to
    /// the monitors, without them: with the monitors down, the leaders would go on into a
    /// full replica's margin and reserve, or a map flag they cannot clear would hold
    /// writes back after discards.
    fn replicas_not_full(&self, pg: PgId, members: Option<&Members>) -> Result<(), Status> {
        let Some(members) = members else {
            return Ok(());
        };
        let full = |osd: &&OsdId| {
            if **osd == self.id {
                return self.is_full();
            }
            match self.peers_full.get(osd) {
                Some((full, at)) if at.elapsed() < PEER_FULL_FOR => *full,
                _ => self
                    .map
                    .osds
                    .get(osd)
                    .is_some_and(|entry| entry.holds_writes_back()),
            }
        };
        match members
            .voters
            .iter()
            .chain(&members.voters_outgoing)
            .find(full)
        {
            Some(full) => Err(Status::NoSpace {
                message: format!("{full}, a replica of pg {pg}, is full"),
            }),
            None => Ok(()),
        }
    }

    /// Whether this OSD is full, for the map: once everything else were cleaned, its live
    /// data would leave less free than the reserve, the headroom and a margin (live data
    /// counted by the log blocks it keeps in use: a 512-byte write keeps one). It does not
    /// wait for the cleaner to find out (writes get `Busy` meanwhile): the leaders of its
    /// PGs, told by the map, must stop while the reserve, which a follower may fill with
    /// raft's entries, can still take what they accept until they hear of it. Retained
    /// raft payloads are not counted: most are live data too, and the rest goes at the
    /// next checkpoint. Once full, it stays so until a thirty-second of the ring more is
    /// free, so that the flag does not flap.
    ///
    /// Full too once the object index would take more than three quarters of a checkpoint
    /// area (the rest is for raft's retained entries): a checkpoint that does not fit stops
    /// the log's reuse for good, where a full flag stops writes until discards make the
    /// index smaller (an eighth of the area, for the flag not to flap). Data written 4 KiB
    /// at a time takes about half an area at the most an OSD holds; what fills it first is
    /// 512-byte sectors written apart, eight extents to a block, where some are missing
    /// between them (those written whole are joined).
    fn is_full(&self) -> bool {
        self.full_by().contains(&true)
    }

    /// Whether live data, and whether the index, make this OSD full ([`Core::is_full`]).
    /// Each keeps its margin against flapping only while it made this OSD full at the last
    /// tick (`Reclaim::full_by`): the other's margin would keep the flag once what set it
    /// is gone. (Not while the map says full: the leaders hear of it from this OSD's
    /// frames too, and with the monitors down the map would never say so.)
    fn full_by(&self) -> [bool; 2] {
        let [by_data, by_index] = self.reclaim.full_by;
        let ring = self.log.ring().len_bytes;
        let hysteresis = if by_data { ring / 32 } else { 0 };
        let data = if self.reuse_allowed() {
            let writable = writable_bytes(&self.log);
            writable == 0 || self.reclaim.packed_bytes() + hysteresis > writable
        } else {
            self.log.free_bytes() < kept_free_bytes(&self.log) + hysteresis
        };
        let margin = if by_index {
            self.log.checkpoint_area_bytes() / 8
        } else {
            0
        };
        [
            data,
            self.reclaim.index_bytes + margin > index_limit(&self.log),
        ]
    }

    /// How near this OSD is to full, in percent of the nearer of the limits
    /// [`Core::full_by`] checks (without their margins against flapping).
    fn fill_percent(&self) -> u64 {
        let share = |part: u64, whole: u64| {
            u64::try_from(u128::from(part) * 100 / u128::from(whole.max(1))).unwrap_or(u64::MAX)
        };
        let data = share(self.reclaim.packed_bytes(), writable_bytes(&self.log));
        data.max(share(self.reclaim.index_bytes, index_limit(&self.log)))
    }

    /// Whether the log has room for a write of `log_bytes` now; if not, the answer: `Busy`
    /// while the cleaner can free space, `NoSpace` once live data fills the log.
    fn space_for(&self, log_bytes: u64) -> Result<(), Status> {
        let free = self.free_for_writes();
        let keep = write_floor(&self.log);
        if free >= keep + log_bytes {
            return Ok(());
        }
        // Waiting makes sense while cleaning frees space; once it has freed nothing for a
        // while, what is left is live.
        // (Short of room while the cleaner is not even pressed, writes in flight hold the
        // space: they complete soon.)
        let progressing =
            !self.reclaim.pressed || self.reclaim.progress_at.elapsed() < BUSY_WITHOUT_PROGRESS;
        if self.reclaimable_bytes() > 0 && progressing {
            Err(Status::Busy {
                message: format!("{}: the log is being cleaned ({free} bytes free)", self.id),
            })
        } else {
            Err(Status::NoSpace {
                message: format!(
                    "{} is full: {} bytes of live data in {} bytes of log blocks, {} in raft logs, {free} bytes free in its log, {keep} kept in reserve",
                    self.id,
                    self.reclaim.live_bytes,
                    self.reclaim.occupied_bytes,
                    self.reclaim.retained_bytes
                ),
            })
        }
    }

    /// Whether the log may be reused: not while a checkpoint did not fit, nor while PGs
    /// restored from the log have no group (their data must never be freed).
    fn reuse_allowed(&self) -> bool {
        self.restored.is_empty() && !self.reclaim.stopped
    }

    /// Bytes of the ring that cleaning could free (an estimate that errs low: used minus
    /// the log blocks live data keeps in use, minus the payloads of retained raft entries,
    /// minus some slack for batch headers and partly live payloads). Counting live data by
    /// its bytes instead, writes of less than a block (512 bytes keep a 4 KiB block in
    /// use) looked reclaimable where they were not, and the cleaner moved them round the
    /// ring without end.
    fn reclaimable_bytes(&self) -> u64 {
        if !self.reuse_allowed() {
            return 0;
        }
        let ring = self.log.ring().len_bytes;
        let used = ring - self.log.free_bytes();
        used.saturating_sub(self.reclaim.packed_bytes() + self.reclaim.retained_bytes + ring / 32)
    }

    /// Starts a cleaner step when free space runs low and cleaning can free some.
    fn maybe_clean(&mut self) {
        let reclaim = &self.reclaim;
        // While a snapshot is installed, its data is mapped in no index the cleaner sees.
        if reclaim.cleaning
            || std::time::Instant::now() < reclaim.clean_after
            || !self.installing.is_empty()
        {
            return;
        }
        // Clean only when space runs low (live data moved costs writes), and then a little
        // more, counting what the next checkpoint frees of what was cleaned already.
        let ring = self.log.ring().len_bytes;
        let free = self.log.free_bytes()
            + reclaim
                .cleaned_to
                .0
                .saturating_sub(self.log.tail_position());
        let low = clean_low_mark(&self.log);
        // Cleaning goes on past the high mark for a snapshot install that needs the room.
        let wanted = self.wanted_free();
        let high = (low + clean_span(ring)).max(wanted);
        if free < wanted {
            self.reclaim.press();
        }
        let reclaim = &self.reclaim;
        if free >= high || (free >= low && !reclaim.pressed) || self.reclaimable_bytes() == 0 {
            self.reclaim.pressed = false;
            return;
        }
        self.reclaim.press();
        let reclaim = &self.reclaim;
        // The cleaner runs ahead of the checkpoints by at most a quarter of the ring: what
        // it moved is freed only by the next one.
        let tail = self.log.tail_position();
        let (from, lsn) = reclaim.cleaned_to;
        // A step's moves must fit the floor, whatever the free space.
        let limit = reclaim
            .durable_end
            .0
            .min(reclaim::step_limit(self.log.ring(), from))
            .min(tail + ring / 4 + crate::log_device::MAX_BATCH_BYTES);
        if limit <= from {
            if self.reclaim.durable_end.0 <= from {
                self.move_durable_end();
            }
            return;
        }
        self.reclaim.cleaning = true;
        tracing::debug!(
            from,
            limit,
            tail,
            free,
            occupied = self.reclaim.occupied_bytes,
            packable = self.reclaim.packable_bytes,
            retained = self.reclaim.retained_bytes,
            live = self.reclaim.live_bytes,
            ring,
            reclaimable = self.reclaimable_bytes(),
            "cleaner step"
        );
        let read = self
            .log
            .read_batches(from, lsn, (limit, self.reclaim.durable_end.0));
        let events = self.events.clone();
        tokio::spawn(async move {
            let _ = events.send(Event::Cleaned(read.await));
        });
    }

    /// The cleaner may not go past `durable_end`, the start of the last batch of a persist
    /// the core processed (a checkpoint cut there must leave the rest to replay). Batches
    /// written after it without a persist (snapshot chunks of transfers given up, removals)
    /// wait for the next persist to move it on, and a replica that hosts no PG yet persists
    /// nothing: short of room, it would refuse every snapshot for good. So when the cleaner
    /// has caught up with `durable_end`, nothing is persisting and more than two batches'
    /// worth lie past it, an empty append goes through the persist pipeline, in order
    /// behind every persist before it, and its completion moves `durable_end` on.
    fn move_durable_end(&mut self) {
        let behind = self
            .log
            .head_position()
            .saturating_sub(self.reclaim.durable_end.0);
        if self.moving_durable_end
            || behind <= 2 * crate::log_device::MAX_BATCH_BYTES
            || self
                .durable
                .values()
                .any(|durable| !durable.in_flight.is_empty())
        {
            return;
        }
        tracing::debug!(behind, "an empty persist to move the cleaner's limit");
        self.moving_durable_end = true;
        let append = Box::pin(self.log.submit(Vec::new())) as AppendFuture;
        let _ = self.persists.send(PendingPersist {
            pg: None,
            generation: 0,
            number: 0,
            snapshot: None,
            then_send: Vec::new(),
            hard_state: None,
            last_index: None,
            appends: vec![(append, Vec::new())],
        });
    }

    /// A cleaner step ended at `next`, having moved `moved` bytes. What it went through
    /// beyond them is freed by the next checkpoint, which may be many steps away
    /// ([`checkpoint_room`]): progress all the same, so writes waiting meanwhile get
    /// `Busy`, not `NoSpace`.
    fn stepped(&mut self, next: (u64, Lsn), moved: u64) {
        if moved < next.0.saturating_sub(self.reclaim.cleaned_to.0) {
            self.reclaim.progress_at = std::time::Instant::now();
        }
        self.reclaim.cleaned_to = next;
        self.reclaim.cleaning = false;
    }

    /// The batches a cleaner step read: relocate what is live.
    fn cleaned(&mut self, result: std::io::Result<Replayed>) {
        let replayed = match result {
            Ok(replayed) => replayed,
            Err(error) => {
                tracing::error!(%error, "the cleaner cannot read the log; it pauses");
                return self.pause_cleaner(Duration::from_secs(5));
            }
        };
        let next = (replayed.next_position, replayed.next_lsn);
        let from = self.reclaim.cleaned_to.0;
        // A read that took no batch but went on (past the rest of a lap the writer skipped,
        // or a torn batch left behind by a crash, whose LSN's batch lies at the next lap)
        // has nothing to move, and goes on below.
        if replayed.batches.is_empty() && next.0 == from {
            let durable = from < self.reclaim.durable_end.0;
            match &replayed.stopped_by {
                // A batch that fails its checks below the durable end was written whole:
                // damaged since, unless a read of the batch after it says otherwise.
                Some(error) if durable && !matches!(error, BatchError::Truncated { .. }) => {
                    let read = self
                        .log
                        .read_damaged(from, next.1, self.reclaim.durable_end.0);
                    let events = self.events.clone();
                    tokio::spawn(async move {
                        let _ = events.send(Event::Rescue(read.await));
                    });
                    return;
                }
                Some(error) => {
                    tracing::warn!(position = next.0, %error, "the cleaner found no batch; it pauses");
                }
                None => {}
            }
            return self.pause_cleaner(Duration::from_secs(1));
        }
        let sums = self.log.block_sums();
        let relocations =
            reclaim::plan_relocations(replayed.batches, &self.raft, &self.objects, &sums);
        if relocations.packs.is_empty() {
            return self.relocate(relocations, next, MOVED_DAMAGED);
        }
        // The pieces of the blocks to pack are read first, from wherever they lie.
        let reads: Vec<_> = relocations
            .packs
            .iter()
            .map(|pack| {
                let pin = self.pin_reads(&pack.pieces);
                let (start, pieces) = (pack.block_start, pack.pieces.clone());
                (pin, start, pieces)
            })
            .collect();
        let (engine, events) = (self.engine.clone(), self.events.clone());
        tokio::spawn(async move {
            let mut read = Vec::with_capacity(reads.len());
            for (_pin, start, pieces) in reads {
                let block = BLOCK_SIZE as u64;
                // Packed, the bytes get checksums anew: a block whose checksum is not
                // known (its batch's header lost) is not vouched for, and stays where it
                // is marked (the step's parts of it move as they were).
                let vouched = pieces.iter().all(|piece| match *piece {
                    Piece::Mapped {
                        device_offset_bytes: at,
                        len_bytes: len,
                        ..
                    } => batch::blocks_touched(at, len).all(|n| sums.get(n * block).is_some()),
                    Piece::Hole { .. } => true,
                });
                let back = read_pieces(&engine, &sums, start, block, &pieces).await;
                read.push(match back {
                    Ok(ReadBack {
                        data,
                        damaged: None,
                    }) if vouched => Some(data),
                    _ => None,
                });
            }
            let _ = events.send(Event::Packed {
                relocations,
                read,
                next,
            });
        });
    }

    /// The batch the cleaner could not take, read again: if it was damaged after it was
    /// written (its header fails while the batch after it is intact), what still reads it
    /// is moved out (`reclaim::plan_rescue`), the blocks that fail their checksums marked
    /// damaged, and the cleaner goes on after it; a checkpoint follows, so that replay
    /// never meets it. Anything else pauses the cleaner as before.
    fn rescue(&mut self, result: std::io::Result<Option<DamagedBatch>>) {
        let damaged = match result {
            Ok(Some(damaged)) => damaged,
            Ok(None) => {
                let position = self.reclaim.cleaned_to.0;
                tracing::warn!(position, "the cleaner found no batch; it pauses");
                return self.pause_cleaner(Duration::from_secs(1));
            }
            Err(error) => {
                tracing::error!(%error, "the cleaner cannot read the log; it pauses");
                return self.pause_cleaner(Duration::from_secs(5));
            }
        };
        let damage = &damaged.damage;
        let (position, lsn, error) = (damage.position, damage.lsn.0, &damage.error);
        let sums = self.log.block_sums();
        let ring = self.log.ring();
        let relocations =
            match reclaim::plan_rescue(&damaged, ring, &self.raft, &self.objects, &sums) {
                Ok(relocations) => relocations,
                Err(reason) => {
                    tracing::error!(
                        position,
                        lsn,
                        %error,
                        %reason,
                        "the log is damaged where the cleaner reads: this device cannot be \
                         trusted; mark the osd out and remove it"
                    );
                    if self.reclaim.unrescued.replace(position) != Some(position) {
                        self.counters.checksum_error();
                    }
                    return self.pause_cleaner(Duration::from_secs(30));
                }
            };
        tracing::error!(
            position,
            lsn,
            %error,
            bytes = damaged.bytes.len(),
            "a batch of the log was damaged after it was written: the cleaner moves what is \
             still in use out of it, checking every block"
        );
        self.counters.checksum_error();
        // Replay must not meet it: the next checkpoint starts replay after it. Repairs'
        // installs, which hold checkpoints back, wait for that one.
        self.reclaim.asked = true;
        let next = (damaged.end_position, damage.lsn.next());
        let what = "the cleaner moved data in use out of a damaged batch, marked damaged";
        self.relocate(relocations, next, what);
    }

    /// The cleaner waits `pause` before its next step.
    fn pause_cleaner(&mut self, pause: Duration) {
        self.reclaim.cleaning = false;
        self.reclaim.clean_after = std::time::Instant::now() + pause;
    }

    /// Appends the cleaner's relocations; once durable, the cleaner has gone through the
    /// ring up to `next`. The PGs with damaged data among them (`what` it is) have their
    /// copies here rebuilt.
    fn relocate(&mut self, relocations: reclaim::Relocations, next: (u64, Lsn), what: &str) {
        let reclaim::Relocations {
            appends,
            moves,
            damaged,
            packs,
        } = relocations;
        debug_assert!(packs.is_empty(), "blocks to pack not read");
        for pg in damaged {
            // Moved all the same, marked damaged at the new place; the copy is rebuilt.
            self.damaged(pg, what, None);
        }
        tracing::debug!(
            to = next.0,
            appends = appends.len(),
            moves = moves.len(),
            "cleaner read"
        );
        if appends.is_empty() {
            self.stepped(next, 0);
            return;
        }
        let pending: Vec<_> = appends
            .into_iter()
            .map(|entries| self.log.submit_relocation(entries))
            .collect();
        let events = self.events.clone();
        tokio::spawn(async move {
            let mut offsets = Vec::with_capacity(moves.len());
            for append in pending {
                match append.await {
                    Ok(appended) => offsets.extend(appended.data_offsets_bytes),
                    Err(error) => {
                        let _ = events.send(Event::Failed(format!("relocating: {error}")));
                        return;
                    }
                }
            }
            let moves = moves.into_iter().zip(offsets).collect();
            let _ = events.send(Event::Relocated { moves, next });
        });
    }

    /// Whether the log since the last checkpoint, or what the cleaner went through, calls
    /// for a checkpoint.
    fn checkpoint_due(&self) -> bool {
        let reclaim = &self.reclaim;
        if reclaim.asked {
            return true;
        }
        let ring = self.log.ring().len_bytes;
        let since = reclaim.durable_end.0 - reclaim.replay_position;
        let cleaned = reclaim
            .cleaned_to
            .0
            .saturating_sub(self.log.tail_position());
        // What the cleaner moved takes free space until the next checkpoint frees what it
        // went through (the cleaner counts what it went through as free; writes wait for
        // it to be). Below the cleaner's low mark, while the cleaner works, a checkpoint
        // follows every `checkpoint_room` cleaned (each writes the whole index); it follows
        // every step once free space is within half a span of what writes need, or while the
        // cleaner works towards the room a snapshot install needs, and at once when the
        // cleaner has stopped below the mark (counting what it cleaned as free, it would
        // not start again, and installs wait while free space is below it).
        let free = self.log.free_bytes();
        let (low, room) = (clean_low_mark(&self.log), checkpoint_room(&self.log));
        let trigger = if free < self.wanted_free()
            || free + room < low
            || (free < low && !self.reclaim.pressed)
        {
            BLOCK_SIZE as u64
        } else if free < low {
            room
        } else {
            (ring / 16).min(self.log.reserve_bytes() / 2).max(room)
        };
        since >= ring / 8 || cleaned >= trigger
    }

    /// Cuts a checkpoint when [`Core::checkpoint_due`].
    fn maybe_checkpoint(&mut self) {
        let reclaim = &self.reclaim;
        // Replay must see a snapshot's transfer whole: no checkpoint while one is under way.
        if reclaim.writing || !self.reuse_allowed() || !self.installing.is_empty() {
            return;
        }
        if !self.checkpoint_due() {
            return;
        }
        let started = std::time::Instant::now();
        let (checkpoint, objects) = self.cut_checkpoint();
        tracing::debug!(
            sequence = checkpoint.sequence,
            extents = objects.iter().map(PgObjects::extent_count).sum::<usize>(),
            loop_us = started.elapsed().as_micros() as u64,
            "checkpoint cut"
        );
        let asked = std::mem::take(&mut self.reclaim.asked);
        for repair in self.repairs.values_mut() {
            repair.covered |= repair.installed.is_some();
        }
        let mark = CheckpointMark {
            sequence: checkpoint.sequence,
            replay_position: checkpoint.replay_position,
            tail: (checkpoint.tail_position, checkpoint.tail_lsn),
            asked,
        };
        self.reclaim.writing = true;
        let (area, sums) = ((checkpoint.sequence % 2) as usize, self.log.block_sums());
        let write = self.log.write_checkpoint(area, move || {
            reclaim::complete_checkpoint(checkpoint, objects, &sums)
        });
        let events = self.events.clone();
        tokio::spawn(async move {
            let result = write.await;
            let _ = events.send(Event::Checkpointed {
                result,
                checkpoint: mark,
            });
        });
    }

    /// The checkpoint of this moment: every PG's durable raft state, the replay start after
    /// the last batch processed, and the tail the cleaner reached; and each PG's object
    /// index as of now (in the order of the checkpoint's PGs), which
    /// [`reclaim::complete_checkpoint`] puts in it off the loop. Raft logs are compacted
    /// first, as far as the retention allows.
    fn cut_checkpoint(&mut self) -> (Checkpoint, Vec<PgObjects>) {
        let pgs: Vec<PgId> = self.raft.pgs().collect();
        let ring = self.log.ring().len_bytes;
        let retention = Retention {
            entries: RETAINED_ENTRIES,
            bytes: ring / 16 / pgs.len().max(1) as u64,
            // What a leader keeps for a follower it knows to be behind (one further behind
            // gets a snapshot): an eighth of the ring across PGs.
            behind_bytes: ring / 8 / pgs.len().max(1) as u64,
        };
        let (mut states, mut objects) = (Vec::with_capacity(pgs.len()), Vec::new());
        for pg in pgs {
            let applied = self.applied.get(&pg).copied().unwrap_or(0);
            let matched = self.raft.followers_matched(pg);
            if let Some(storage) = self.raft.storage(pg) {
                // The log after a snapshot being sent stays, whatever the retention says.
                let point = reclaim::compaction_point(storage, applied, matched, retention)
                    .min(self.raft.snapshot_pin(pg).unwrap_or(u64::MAX));
                self.raft.compact(pg, point);
            }
            let Some(storage) = self.raft.storage(pg) else {
                continue;
            };
            let durable = self.durable.get(&pg);
            states.push(reclaim::pg_checkpoint(
                pg,
                storage,
                durable.unwrap_or(&Durable::default()),
                applied,
            ));
            objects.push(self.objects.get(&pg).cloned().unwrap_or_default());
        }
        let reclaim = &self.reclaim;
        // The cleaner only goes through durable batches.
        debug_assert!(reclaim.cleaned_to.0 <= reclaim.durable_end.0);
        let tail = reclaim.cleaned_to;
        let checkpoint = Checkpoint {
            sequence: reclaim.sequence + 1,
            replay_position: reclaim.durable_end.0,
            replay_lsn: reclaim.durable_end.1,
            tail_position: tail.0,
            tail_lsn: tail.1,
            pgs: states,
            ..Checkpoint::default()
        };
        (checkpoint, objects)
    }

    /// Starts a read: served at once under the PG's lease, else once a quorum confirmed the
    /// leadership after the read arrived (a leader cut off from its peers could otherwise
    /// serve a stale read while a new leader already accepts writes). A leader that has not
    /// committed an entry of its term yet sends the client elsewhere for now.
    fn start_read(&mut self, range: ObjectRange, reply_to: oneshot::Sender<Message>) {
        let pg = range.pg;
        let read = ReadRequest {
            arrived: std::time::Instant::now(),
            object: range.object,
            offset_bytes: u64::from(range.offset_bytes),
            len_bytes: range.len_bytes,
            reply: reply_to,
        };
        let id = self.next_read;
        self.next_read += 1;
        match self.raft.read(pg, &id.to_le_bytes(), read.arrived) {
            ReadStart::At(index) => self.serve_at(pg, index, read),
            ReadStart::Confirming => {
                self.confirming.insert(id, (pg, read));
            }
            ReadStart::Refused => {
                let _ = read.reply.send(reply(Status::NotLeader {
                    leader: self.raft.leader(pg).filter(|l| *l != self.id),
                }));
            }
        }
    }

    fn control(&mut self, body: &[u8], reply_to: oneshot::Sender<Message>) {
        let request: OsdRequest = match serde_json::from_slice(body) {
            Ok(request) => request,
            Err(error) => {
                let _ = reply_to.send(control_answer(Err(format!(
                    "malformed osd request: {error}"
                ))));
                return;
            }
        };
        let (pg, with_data) = match request {
            OsdRequest::PgQuery { pg } => (pg, true),
            OsdRequest::PgConf { pg } => (pg, false),
            OsdRequest::Repair { pg, avoid } => return self.repair(pg, avoid, reply_to),
            OsdRequest::Scrub { pg } => {
                let _ = reply_to.send(control_answer(self.scrub_now(pg)));
                return;
            }
            OsdRequest::ListObjects {
                pg,
                image,
                from,
                since,
            } => return self.list_objects(pg, (image, from), since, reply_to),
            OsdRequest::MarkUnfoundLost { pg } => {
                let answer = self.raft.concede(pg).map(|_| self.replica_state(pg));
                let _ = reply_to.send(control_answer(answer));
                return;
            }
            OsdRequest::ForceQuorum { pg, lost } => {
                let answer = self
                    .raft
                    .force_quorum(pg, &lost)
                    .map(|_| self.replica_state(pg));
                let _ = reply_to.send(control_answer(answer));
                return;
            }
        };
        let mut state = self.replica_state(pg);
        if !with_data {
            let _ = reply_to.send(control_answer(Ok(state)));
            return;
        }
        if let Some(objects) = self.objects.get(&pg) {
            state.objects = objects.object_count();
            state.mapped_bytes = objects.mapped_bytes();
        }
        let plan = DigestPlan::new(self.objects.get(&pg), |pieces| self.pin_reads(pieces));
        let (engine, sums) = (self.engine.clone(), self.log.block_sums());
        let counters = self.counters.clone();
        tokio::spawn(async move {
            let answer = match crate::scrub::digest(&engine, &sums, plan).await {
                Ok((digest, damaged)) => {
                    counters.digest_damaged(pg, damaged);
                    state.digest = digest;
                    Ok(state)
                }
                Err(error) => Err(format!("reading the device: {error}")),
            };
            let _ = reply_to.send(control_answer(answer));
        });
    }

    /// This replica's raft state of `pg`, without its objects and digest.
    fn replica_state(&self, pg: PgId) -> PgReplicaState {
        let members = self.raft.members(pg).unwrap_or_default();
        PgReplicaState {
            osd: self.id,
            pg,
            hosted: self.raft.hosts(pg),
            leader: self.raft.leader(pg),
            term: self.raft.term(pg).unwrap_or(0),
            committed: self.raft.committed(pg).unwrap_or(0),
            applied: self.applied.get(&pg).copied().unwrap_or(0),
            last_index: self.raft.last_index(pg).unwrap_or(0),
            last_term: self.raft.last_log_id(pg).map_or(0, |(_, term)| term),
            objects: 0,
            mapped_bytes: 0,
            digest: 0,
            voters: members.voters,
            voters_outgoing: members.voters_outgoing,
            learners: members.learners,
            conf_index: self.raft.conf_index(pg).unwrap_or(0),
            giving_up_from: self.raft.conceding(pg),
            voters_matched: self.raft.voters_matched(pg),
        }
    }

    /// Starts rebuilding this replica's data of `pg` from its leader's
    /// ([`OsdRequest::Repair`]); `reply_to` is answered when it is installed.
    fn repair(&mut self, pg: PgId, avoid: Vec<OsdId>, reply_to: oneshot::Sender<Message>) {
        if !self.raft.hosts(pg) {
            let refused = Err(format!("{} does not host pg {pg}", self.id));
            let _ = reply_to.send(control_answer(refused));
            return;
        }
        let repair = self.repairs.entry(pg).or_insert_with(Repair::new);
        repair.avoid = avoid;
        repair.waiting.push((reply_to, std::time::Instant::now()));
        tracing::info!(%pg, "repair asked: this replica's data is to be rebuilt from the leader's");
        self.advance_repairs();
    }

    /// A read found this replica's copy of `pg` damaged (a block failing its checksum): it
    /// is rebuilt from another replica's, as `basalt pg repair --osd` this OSD would do, and
    /// a client's read waiting here is told to retry; by then another replica leads and
    /// answers it. A PG that no other replica holds has no copy to rebuild from: the read
    /// fails.
    fn damaged(
        &mut self,
        pg: PgId,
        mismatch: impl std::fmt::Display,
        reply_to: Option<oneshot::Sender<Message>>,
    ) {
        let me = self.id;
        let others = self
            .raft
            .members(pg)
            .is_some_and(|members| members.voters.iter().any(|voter| *voter != me));
        // Counted once per client read, and once per repair for the others (raft offers
        // held-back entries again at every heartbeat, and the cleaner looks again).
        if reply_to.is_some() || (others && !self.repairs.contains_key(&pg)) {
            self.counters.checksum_error();
        }
        let answer = if !others {
            tracing::error!(%pg, %mismatch, "this replica's copy of the pg is damaged, and no other replica holds the pg");
            Status::Io {
                message: format!(
                    "pg {pg}: {me}'s copy of the data is damaged ({mismatch}), and no other \
                     replica holds the pg"
                ),
            }
        } else {
            if let std::collections::btree_map::Entry::Vacant(vacant) = self.repairs.entry(pg) {
                tracing::error!(%pg, %mismatch, "this replica's copy of the pg is damaged: it is rebuilt from another's");
                vacant.insert(Repair {
                    avoid: vec![me],
                    ..Repair::new()
                });
                self.advance_repairs();
            }
            Status::Busy {
                message: format!(
                    "pg {pg}: {me}'s copy of the data is damaged ({mismatch}); another replica \
                     takes the pg over while this one is rebuilt"
                ),
            }
        };
        if let Some(reply_to) = reply_to {
            let _ = reply_to.send(reply(answer));
        }
    }

    /// At start: has the copies rebuilt of the PGs whose index or raft log reads blocks
    /// marked damaged, by replay (data of a write damaged at rest, `replayed`: the PGs with
    /// the LSN of the batch) or by the checkpoint (damage found before the restart and not
    /// rebuilt yet). A checkpoint follows at once after replay met damage, so that replay
    /// does not meet it again: the checkpoint keeps those blocks marked.
    fn repair_damage_at_start(&mut self, replayed: &BTreeMap<PgId, Lsn>) {
        let sums = self.log.block_sums();
        let pgs: Vec<PgId> = self.raft.pgs().collect();
        for pg in pgs {
            let storage = self.raft.storage(pg);
            let retained = storage.map_or(&[][..], basalt_replication::PgStorage::retained);
            let (indexed, logged) = reclaim::reads_poisoned(&sums, self.objects.get(&pg), retained);
            if !indexed && !logged {
                continue;
            }
            let what = match replayed.get(&pg) {
                Some(lsn) => {
                    let lsn = lsn.0;
                    format!("replay found data in the batch of lsn {lsn} damaged at rest")
                }
                None => "the checkpoint marks data it reads damaged, not rebuilt yet".to_string(),
            };
            self.damaged(pg, what, None);
            if !self.repairs.contains_key(&pg) {
                // No other replica to rebuild from: damage replay found is counted here,
                // since no repair counts it (what the checkpoint marks was counted before).
                if replayed.contains_key(&pg) {
                    self.counters.checksum_error();
                }
            } else if logged {
                // Its log may end in entries no other replica took, whose payloads it
                // cannot send: the others elect one of them first if they can.
                self.raft.hold_back(pg, HELD_BACK_TICKS);
                self.log_damaged(pg);
            }
        }
        self.reclaim.asked |= !replayed.is_empty();
    }

    /// Lists the PGs of which this replica is a voter and that no replica leads as far as it
    /// knows (`OsdReport::leaderless`).
    fn refresh_leaderless(&mut self) {
        let raft = &self.raft;
        let me = self.id;
        self.leaderless = raft
            .pgs()
            .filter(|pg| raft.leaderless(*pg))
            .filter_map(|pg| {
                let members = raft.members(pg)?;
                members.votes(me).then_some(LeaderlessPg {
                    pg,
                    voters: members.voters,
                    voters_outgoing: members.voters_outgoing,
                })
            })
            .collect();
    }

    /// Looks again at the PGs whose raft log was found holding a payload this replica cannot
    /// read back (reads of the payloads past their commit index): those with none left are
    /// forgotten, and those no replica leads as far as this one knows are reported.
    fn refresh_unsendable(&mut self) {
        self.unsendable.clear();
        let suspects: Vec<PgId> = self.log_suspects.iter().copied().collect();
        for pg in suspects {
            if self.raft.first_unsendable(pg).is_none() {
                self.log_suspects.remove(&pg);
                continue;
            }
            let led = self.raft.leader(pg).is_some_and(|leader| leader != self.id)
                || self.raft.read_barrier(pg).is_some();
            if !led {
                self.unsendable.push(pg);
            }
        }
    }

    /// Notes that `pg`'s raft log here holds a payload this replica cannot read back (and
    /// that its repair, if any, is of such damage).
    fn log_damaged(&mut self, pg: PgId) {
        self.log_suspects.insert(pg);
        if let Some(repair) = self.repairs.get_mut(&pg) {
            repair.log_damaged = true;
        }
    }

    /// Moves each repair on: a replica that leads hands leadership over (and steps down if
    /// that takes too long and its raft log is damaged), a follower asks its leader for a
    /// snapshot (installing one from a replica not avoided ends the repair, in
    /// [`Core::snapshot_installed`]); one that
    /// takes too long is given up.
    fn advance_repairs(&mut self) {
        let now = std::time::Instant::now();
        let pgs: Vec<PgId> = self.repairs.keys().copied().collect();
        for pg in pgs {
            let Some(repair) = self.repairs.get_mut(&pg) else {
                continue;
            };
            // Those waiting too long are told it goes on (asked again, they wait again).
            let (late, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut repair.waiting)
                .into_iter()
                .partition(|(_, since)| now.duration_since(*since) > REPAIR_ANSWER_WITHIN);
            repair.waiting = waiting;
            for (reply_to, _) in late {
                let under_way = format!(
                    "pg {pg} on {}: the repair is still under way after {} s (a snapshot of the \
                     leader's asked for or being installed); ask again to wait for it",
                    self.id,
                    REPAIR_ANSWER_WITHIN.as_secs()
                );
                let _ = reply_to.send(control_answer(Err(under_way)));
            }
            if repair.installed.is_some() {
                // Checkpoints cannot be cut: nothing to wait for.
                if self.reclaim.stopped || !self.reuse_allowed() {
                    self.end_installed_repair(pg);
                }
                continue;
            }
            if !self.raft.hosts(pg) {
                let gone = format!("{} no longer hosts pg {pg}", self.id);
                self.end_repair(pg, Err(gone));
                continue;
            }
            let avoided_leader = self
                .raft
                .leader(pg)
                .filter(|leader| repair.avoid.contains(leader));
            if let Some(leader) = avoided_leader
                && !self.installing.contains_key(&pg)
                && self.raft.cancel_snapshot_request(pg)
            {
                // Leadership went, since this replica asked, to one whose copy is in doubt
                // too: its snapshot would not repair this copy. This replica takes
                // entries again once that leader stops sending the snapshot (the next
                // one it sends is refused), and asks the next leader.
                tracing::info!(%pg, %leader, "repair: the snapshot asked for is no longer wanted (the new leader's copy is in doubt too)");
                repair.refuse_from = Some(leader);
            }
            // Raft takes no entries while it asks (it would go on asking after the repair
            // were given up), so a repair whose snapshot is on its way goes on until it is
            // in (or taken back, above).
            if self.raft.requesting_snapshot(pg) || self.installing.contains_key(&pg) {
                // REPAIR_TIMEOUT counts from the last time one was on its way (a request
                // raft dropped when this replica campaigned is asked again).
                repair.since = now;
                continue;
            }
            if now.duration_since(repair.since) > REPAIR_TIMEOUT {
                let late = format!(
                    "pg {pg} on {}: no snapshot of the leader's could be asked for within {} s",
                    self.id,
                    REPAIR_TIMEOUT.as_secs()
                );
                self.end_repair(pg, Err(late));
                continue;
            }
            if !self.raft.is_leader(pg) {
                repair.leading_since = None;
            } else if repair.log_damaged
                && now.duration_since(*repair.leading_since.get_or_insert(now)) > STEP_DOWN_AFTER
            {
                // No replica took the PG over in time: none may hold entries at the end of
                // this one's log that it cannot send (damaged, and never replicated).
                if self.raft.step_down(pg, HELD_BACK_TICKS) {
                    tracing::warn!(%pg, "leadership was not handed over in time: this replica steps down and waits for the others to elect one of them");
                }
                // Again if it is elected again: the others could not elect one of them.
                (repair.leading_since, repair.heir) = (None, None);
                continue;
            } else {
                let heir = self.raft.hand_over(pg, &repair.avoid);
                match heir {
                    Some(heir) if repair.heir != Some(heir) => {
                        tracing::info!(%pg, %heir, "leadership handed over for a repair");
                    }
                    Some(_) => {}
                    None => tracing::debug!(%pg, "no caught-up replica to hand leadership to yet"),
                }
                repair.heir = heir;
                continue;
            }
            if let Some(leader) = self.raft.leader(pg)
                && repair.avoid.contains(&leader)
            {
                // Its copy may be bad too: it hands leadership over in its own repair.
                tracing::debug!(%pg, %leader, "repair waits for a leader whose copy is not in doubt");
                continue;
            }
            match self.raft.request_snapshot(pg) {
                Ok(()) => {
                    tracing::info!(%pg, "repair: a snapshot asked of the leader");
                    repair.refuse_from = None;
                }
                Err(error) => tracing::debug!(%pg, %error, "repair: no snapshot asked yet"),
            }
        }
    }

    /// Answers the repairs whose install a written checkpoint covers.
    fn end_covered_repairs(&mut self) {
        let covered: Vec<PgId> = self
            .repairs
            .iter()
            .filter(|(_, repair)| repair.covered)
            .map(|(pg, _)| *pg)
            .collect();
        for pg in covered {
            self.end_installed_repair(pg);
        }
    }

    /// Ends an installed repair with the state after its install.
    fn end_installed_repair(&mut self, pg: PgId) {
        let state = self
            .repairs
            .get(&pg)
            .and_then(|repair| repair.installed.clone());
        if let Some(state) = state {
            self.end_repair(pg, Ok(state));
        }
    }

    /// Ends the repair of `pg`, answering whoever waits for it.
    fn end_repair(&mut self, pg: PgId, result: Result<PgReplicaState, String>) {
        let Some(repair) = self.repairs.remove(&pg) else {
            return;
        };
        match &result {
            Ok(state) => tracing::info!(%pg, applied = state.applied, "repaired"),
            Err(error) => tracing::warn!(%pg, %error, "repair given up"),
        }
        for (waiting, _) in repair.waiting {
            let _ = waiting.send(control_answer(result.clone()));
        }
    }

    /// Proposes a scrub marker in `pg` now ([`OsdRequest::Scrub`]), if it is led here.
    fn scrub_now(&mut self, pg: PgId) -> Result<PgReplicaState, String> {
        self.leads(pg)?;
        self.propose_marker(pg)?;
        Ok(self.replica_state(pg))
    }

    /// `Err` naming the leader unless this replica leads `pg`.
    fn leads(&self, pg: PgId) -> Result<(), String> {
        if self.raft.is_leader(pg) {
            return Ok(());
        }
        let leader = self
            .raft
            .leader(pg)
            .map_or("none known".to_string(), |leader| leader.to_string());
        Err(format!(
            "{} does not lead pg {pg} (its leader: {leader})",
            self.id
        ))
    }

    /// Starts [`OsdRequest::ListObjects`]: proposes a map floor entry at this OSD's map,
    /// which answers the listing when it applies (`apply`).
    fn list_objects(
        &mut self,
        pg: PgId,
        listing: (basalt_common::ImageId, u64),
        since: Epoch,
        reply_to: oneshot::Sender<Message>,
    ) {
        let needed = since.max(self.map_floor(pg));
        let refused = self.leads(pg).err().or_else(|| {
            (self.map.epoch < needed).then(|| {
                format!(
                    "{} has map epoch {}, older than {}: ask again",
                    self.id, self.map.epoch.0, needed.0
                )
            })
        });
        if let Some(refused) = refused {
            let _ = reply_to.send(control_reply::<ObjectList>(Err(refused)));
            return;
        }
        // Not checked for room: a removal is how a full cluster gets room back, and the
        // entry is a few bytes (as a discard is).
        let term = self.raft.term(pg).unwrap_or(0);
        if let Err(error) = self.propose_floor_entry(pg, term) {
            let _ = reply_to.send(control_reply::<ObjectList>(Err(error.to_string())));
            return;
        }
        let index = self.raft.last_index(pg).unwrap_or(0);
        self.proposals.insert(
            (pg, index),
            Proposal {
                term,
                log_bytes: 0,
                arrived: std::time::Instant::now(),
                reply: reply_to,
                write_bytes: 0,
                listing: Some(listing),
            },
        );
    }

    /// Proposes a scrub marker in `pg`: not into the log of a full replica (it could not
    /// persist it).
    fn propose_marker(&mut self, pg: PgId) -> Result<(), String> {
        self.replicas_not_full(pg, self.led_members(pg).as_ref())
            .map_err(|status| format!("{status:?}"))?;
        self.raft
            .propose(pg, crate::scrub::MARKER.to_vec())
            .map_err(|error| error.to_string())
    }

    /// Digests `pg` as it stands at the scrub marker at `index`, just applied, and keeps
    /// the digest for the reports.
    fn scrub_at(&self, pg: PgId, index: u64) {
        if self
            .scrub_fuzzy_through
            .get(&pg)
            .is_some_and(|through| index <= *through)
        {
            tracing::debug!(%pg, index, "scrub marker not digested: the objects may be fuzzy there");
            return;
        }
        let plan = DigestPlan::new(self.objects.get(&pg), |pieces| self.pin_reads(pieces));
        let (engine, scrubs) = (self.engine.clone(), self.scrubs.clone());
        let (sums, counters) = (self.log.block_sums(), self.counters.clone());
        tokio::spawn(async move {
            match crate::scrub::digest(&engine, &sums, plan).await {
                Ok((digest, damaged)) => {
                    counters.digest_damaged(pg, damaged);
                    tracing::debug!(%pg, index, digest, "scrubbed");
                    let mut scrubs = scrubs.lock().unwrap_or_else(|p| p.into_inner());
                    let scrub = PgScrub { pg, index, digest };
                    let newer = scrubs.get(&pg).is_none_or(|known| known.index <= index);
                    if newer {
                        scrubs.insert(pg, scrub);
                    }
                }
                Err(error) => {
                    tracing::error!(%pg, index, %error, "a scrub cannot read the pg's data back from the device");
                }
            }
        });
    }

    /// Proposes a scrub marker in each PG led here whose turn it is.
    fn propose_scrubs(&mut self) {
        let leading: Vec<PgId> = self
            .raft
            .pgs()
            .filter(|pg| self.raft.is_leader(*pg))
            .collect();
        let now = std::time::Instant::now();
        for pg in self.scrub_schedule.due(leading, now) {
            // A marker not proposed (a replica full, say) is tried again.
            if let Err(error) = self.propose_marker(pg) {
                tracing::debug!(%pg, %error, "scrub marker not proposed");
                self.scrub_schedule.retry(pg, now);
            }
        }
    }

    /// Keeps the log from being reused under the device reads of these pieces until the
    /// pin is dropped (a read planned now may run after the cleaner moved its data and a
    /// checkpoint freed the old place).
    fn pin_reads<'a>(&self, pieces: impl IntoIterator<Item = &'a Piece>) -> Option<ReadPin> {
        let block = BLOCK_SIZE as u64;
        self.log
            .pin(pieces.into_iter().filter_map(|piece| match *piece {
                Piece::Mapped {
                    device_offset_bytes,
                    ..
                } => Some(device_offset_bytes / block * block),
                Piece::Hole { .. } => None,
            }))
    }

    fn serve_read(&self, pg: PgId, read: ReadRequest) {
        let pieces = self
            .objects
            .get(&pg)
            .map(|objects| objects.plan_read(read.object, read.offset_bytes, read.len_bytes))
            .unwrap_or_default();
        let pin = self.pin_reads(&pieces);
        let (engine, sums) = (self.engine.clone(), self.log.block_sums());
        let counters = self.counters.clone();
        let events = self.events.clone();
        tokio::spawn(async move {
            let _pin = pin;
            let read_back =
                read_pieces(&engine, &sums, read.offset_bytes, read.len_bytes, &pieces).await;
            let answer = match read_back {
                Ok(ReadBack {
                    damaged: Some(mismatch),
                    ..
                }) => {
                    // The core answers: this copy is not to be read until it is rebuilt.
                    let read = Some(read);
                    let _ = events.send(Event::Damaged { pg, mismatch, read });
                    return;
                }
                Ok(ReadBack {
                    data,
                    damaged: None,
                }) => {
                    counters.reads.fetch_add(1, Ordering::Relaxed);
                    counters
                        .read_bytes
                        .fetch_add(data.len() as u64, Ordering::Relaxed);
                    counters
                        .read_nanos
                        .fetch_add(read.arrived.elapsed().as_nanos() as u64, Ordering::Relaxed);
                    Message::Reply {
                        status: Status::Ok,
                        data,
                    }
                }
                Err(error) => reply(Status::Io {
                    message: format!("reading the log device: {error}"),
                }),
            };
            let _ = read.reply.send(answer);
        });
    }

    fn apply(
        &mut self,
        pg: PgId,
        entries: Vec<basalt_replication::RaftEntry>,
    ) -> Result<(), OsdError> {
        // Only the last of the scrub markers applied together is digested: each digest
        // reads the whole PG, and a replica catching up through the log meets many.
        let last_marker = entries
            .iter()
            .rev()
            .find(|entry| {
                entry.get_entry_type() == EntryType::EntryNormal
                    && crate::scrub::is_marker(&entry.data)
            })
            .map(|entry| entry.index);
        for entry in entries {
            self.applied.insert(pg, entry.index);
            let normal = entry.get_entry_type() == EntryType::EntryNormal && !entry.data.is_empty();
            let reference = normal.then(|| PayloadRef::decode(&entry.data)).flatten();
            let op = (normal && reference.is_none())
                .then(|| ObjectOp::decode(&entry.data).ok())
                .flatten();
            if let Some(reference) = &reference {
                self.objects.entry(pg).or_default().apply_ref(reference);
            }
            if Some(entry.index) == last_marker {
                self.scrub_at(pg, entry.index);
            }
            match &op {
                // A write is applied only once durable here, and then refers to its payload.
                Some(ObjectOp::Write { .. }) => {
                    return Err(OsdError::Internal(format!(
                        "pg {pg}: committed write {} is not known to be durable here",
                        entry.index
                    )));
                }
                Some(discard @ ObjectOp::Discard { .. }) => {
                    self.objects.entry(pg).or_default().apply(discard, 0);
                }
                None => {}
            }
            let is_write =
                reference.is_some() || op.as_ref().is_some_and(|op| op.kind() == kind::WRITE);
            if let Some(proposal) = self.proposals.remove(&(pg, entry.index)) {
                self.pending_bytes = self.pending_bytes.saturating_sub(proposal.log_bytes);
                let answer = if let Some((image, from)) = proposal.listing {
                    control_reply(if proposal.term == entry.term {
                        let objects = self.objects.get(&pg);
                        let numbers = objects.map_or_else(Vec::new, |objects| {
                            objects.numbers(image, from, OBJECTS_LISTED_MAX + 1)
                        });
                        let complete = numbers.len() <= OBJECTS_LISTED_MAX;
                        let numbers = numbers.into_iter().take(OBJECTS_LISTED_MAX).collect();
                        Ok(ObjectList { numbers, complete })
                    } else {
                        Err(format!(
                            "{} lost the lead of pg {pg} before the listing's entry committed",
                            self.id
                        ))
                    })
                } else if proposal.term == entry.term {
                    if is_write {
                        self.counters.writes.fetch_add(1, Ordering::Relaxed);
                        self.counters
                            .write_bytes
                            .fetch_add(proposal.write_bytes, Ordering::Relaxed);
                        self.counters.write_nanos.fetch_add(
                            proposal.arrived.elapsed().as_nanos() as u64,
                            Ordering::Relaxed,
                        );
                    }
                    reply(Status::Ok)
                } else {
                    // Another leader's entry took the index: ours was never committed.
                    reply(Status::NotLeader {
                        leader: self.raft.leader(pg),
                    })
                };
                let _ = proposal.reply.send(answer);
            }
        }
        let applied = self.applied.get(&pg).copied().unwrap_or(0);
        if let Some(waiting) = self.reads.get_mut(&pg) {
            let (ready, still): (Vec<_>, Vec<_>) = waiting
                .drain(..)
                .partition(|(barrier, _)| *barrier <= applied);
            *waiting = still;
            for (_, read) in ready {
                self.serve_read(pg, read);
            }
        }
        Ok(())
    }

    fn persist(
        &mut self,
        pg: PgId,
        entries: Vec<basalt_replication::RaftEntry>,
        hard_state: Option<basalt_replication::HardState>,
        number: u64,
        then_send: Vec<(OsdId, RaftMessage)>,
        snapshot: Option<(u64, u64)>,
    ) {
        // The persist still completes in order behind the ones before it, whether it
        // writes a hard state or not.
        let hard_state = self
            .hard_states
            .entry(pg)
            .or_default()
            .to_write(hard_state, !entries.is_empty());
        let last_index = self
            .durable
            .entry(pg)
            .or_default()
            .persisting(&entries, snapshot.map(|(index, _)| index));
        // Floors other leaders wrote (this OSD's own are known since it proposed them).
        if let Some(floor) = entries
            .iter()
            .filter_map(|entry| pg_log::map_floor_of(&entry.data))
            .max()
        {
            self.raise_map_floor(pg, floor);
        }
        let mut log_entries = Vec::new();
        if let Some((index, term)) = snapshot {
            // The log was just reset to the snapshot: its first configuration is the
            // snapshot's.
            let conf = self
                .raft
                .storage(pg)
                .and_then(|storage| storage.confs().first())
                .map(|(_, conf)| basalt_replication::encode_conf(conf))
                .unwrap_or_default();
            log_entries.push(snapshot::installed_entry(pg, index, term, conf));
        }
        log_entries.extend(pg_log::to_log_entries(pg, &entries, hard_state.as_ref()));
        let appends = batch::split(log_entries)
            .into_iter()
            .map(|entries| {
                let writes: Vec<WriteAt> = entries
                    .iter()
                    .enumerate()
                    .filter(|(_, entry)| entry.kind == kind::WRITE)
                    .map(|(at, entry)| (entry.index, entry.term, at))
                    .collect();
                (Box::pin(self.log.submit(entries)) as AppendFuture, writes)
            })
            .collect();
        let _ = self.persists.send(PendingPersist {
            pg: Some(pg),
            generation: self.generations.get(&pg).copied().unwrap_or(0),
            number,
            snapshot,
            then_send,
            hard_state,
            last_index,
            appends,
        });
    }

    /// Does what raft wants done.
    fn drive(&mut self) -> Result<(), OsdError> {
        let mut actions = std::mem::take(&mut self.actions);
        self.raft.collect(&mut actions);
        // Messages go out before this turn's log writes are queued: a leader's appends then
        // reach its followers (whose durable writes are what a commit waits for) while its
        // own write starts, rather than after it.
        actions.retain_mut(|action| {
            let Action::Send { to, pg, message } = action else {
                return true;
            };
            let message = std::mem::take(message);
            if MultiRaft::snapshot_of(&message).is_some() {
                self.snapshots_sent
                    .insert((*pg, *to), std::time::Instant::now());
            }
            self.send(*to, *pg, message);
            false
        });
        self.flush();
        for action in actions.drain(..) {
            match action {
                Action::Send { .. } => unreachable!("sent above"),
                Action::Persist {
                    pg,
                    entries,
                    hard_state,
                    number,
                    then_send,
                    snapshot,
                } => self.persist(pg, entries, hard_state, number, then_send, snapshot),
                Action::ReadIndex { pg, reads } => self.confirmed(pg, reads),
                Action::Apply { pg, entries } => self.apply(pg, entries)?,
            }
        }
        self.actions = actions;
        self.fail_deposed();
        self.flush();
        Ok(())
    }

    /// Reads whose leadership check came back: served once the PG applied up to the index.
    fn confirmed(&mut self, pg: PgId, reads: Vec<(Vec<u8>, u64)>) {
        for (context, index) in reads {
            let Some(id) = context.try_into().ok().map(u64::from_le_bytes) else {
                continue;
            };
            if let Some((_, read)) = self.confirming.remove(&id) {
                self.serve_at(pg, index, read);
            }
        }
    }

    /// Serves `read` once the PG has applied up to `index`: now, or when `apply` gets there.
    fn serve_at(&mut self, pg: PgId, index: u64, read: ReadRequest) {
        if self.applied.get(&pg).copied().unwrap_or(0) >= index {
            self.serve_read(pg, read);
        } else {
            self.reads.entry(pg).or_default().push((index, read));
        }
    }

    /// Answers the requests waiting on PGs this replica no longer leads, so that their
    /// clients go to the new leader at once instead of timing out. A write answered so may
    /// still commit (if the new leader had it): a retry then writes the same bytes again,
    /// after it in the log.
    fn fail_deposed(&mut self) {
        let raft = &self.raft;
        let deposed = |pg: &PgId| !raft.is_leader(*pg);
        if self.proposals.keys().any(|(pg, _)| deposed(pg)) {
            let keys: Vec<(PgId, u64)> = self
                .proposals
                .keys()
                .filter(|(pg, _)| deposed(pg))
                .copied()
                .collect();
            for key in keys {
                if let Some(proposal) = self.proposals.remove(&key) {
                    self.pending_bytes = self.pending_bytes.saturating_sub(proposal.log_bytes);
                    let leader = raft.leader(key.0).filter(|leader| *leader != self.id);
                    let answer = match proposal.listing {
                        Some(_) => control_reply::<ObjectList>(Err(format!(
                            "{} no longer leads pg {}",
                            self.id, key.0
                        ))),
                        None => reply(Status::NotLeader { leader }),
                    };
                    let _ = proposal.reply.send(answer);
                }
            }
        }
        if self.confirming.values().any(|(pg, _)| deposed(pg)) {
            let ids: Vec<u64> = self
                .confirming
                .iter()
                .filter(|(_, (pg, _))| deposed(pg))
                .map(|(id, _)| *id)
                .collect();
            for id in ids {
                if let Some((pg, read)) = self.confirming.remove(&id) {
                    let leader = raft.leader(pg).filter(|leader| *leader != self.id);
                    let _ = read.reply.send(reply(Status::NotLeader { leader }));
                }
            }
        }
        for (pg, waiting) in &mut self.reads {
            if !waiting.is_empty() && !raft.is_leader(*pg) {
                let leader = raft.leader(*pg).filter(|leader| *leader != self.id);
                for (_, read) in waiting.drain(..) {
                    let _ = read.reply.send(reply(Status::NotLeader { leader }));
                }
            }
        }
    }

    /// Moves the replicas of the PGs led here towards the members the map gives them, at
    /// most `max_moves` of them adding members at once.
    fn reconfigure_pgs(&mut self) {
        let led: Vec<(PgId, PgMove)> = self
            .raft
            .pgs()
            .filter(|pg| self.raft.is_leader(*pg))
            .map(|pg| (pg, self.move_of(pg)))
            .collect();
        for pg in throttle(&led, self.max_moves) {
            let Some(entry) = self.map.pg(pg) else {
                continue;
            };
            match self.raft.reconfigure(pg, &entry.members) {
                None => {}
                Some(Reconfiguring::CatchingUp(behind)) => {
                    tracing::debug!(%pg, ?behind, "new members catching up")
                }
                Some(step) => tracing::info!(%pg, members = ?entry.members, ?step, "pg membership"),
            }
        }
    }

    /// Where `pg`'s move to the map's members stands.
    fn move_of(&self, pg: PgId) -> PgMove {
        let (Some(members), Some(entry)) = (self.raft.members(pg), self.map.pg(pg)) else {
            return PgMove::None;
        };
        if !members.learners.is_empty() || !members.voters_outgoing.is_empty() {
            return PgMove::Adding;
        }
        if entry
            .members
            .iter()
            .any(|osd| !members.voters.contains(osd))
        {
            PgMove::ToStart
        } else if members
            .voters
            .iter()
            .any(|osd| !entry.members.contains(osd))
        {
            PgMove::Removing
        } else {
            PgMove::None
        }
    }

    /// For the PGs hosted here that the map does not list this OSD in: asks their leader
    /// whether this replica is still in the raft group, and stops hosting the ones it is
    /// not in (and those of removed pools).
    ///
    /// PGs restored from the log that no group could be made of are asked about too: a
    /// crash after a checkpoint without a removed PG and before its `PG_REMOVED` record
    /// was durable leaves replay the PG's last records and nothing before them. Their
    /// data, kept, would keep the log's reuse stopped for good; it goes once the PG's
    /// leader says this replica is not in the group and its voters hold these records.
    fn check_memberships(&mut self) {
        let hosted: Vec<PgId> = self
            .raft
            .pgs()
            .chain(self.restored.keys().copied())
            .collect();
        for pg in hosted {
            if self.membership_checks.contains(&pg) || self.raft.is_leader(pg) {
                continue;
            }
            if !self.map.pools.contains_key(&pg.pool) {
                self.remove_pg(pg);
                continue;
            }
            let Some(entry) = self.map.pg(pg) else {
                continue;
            };
            if entry.members.contains(&self.id) {
                continue;
            }
            let members: Vec<(OsdId, SocketAddr)> = entry
                .members
                .iter()
                .filter_map(|id| {
                    let address = self.map.osds.get(id)?.address.parse().ok()?;
                    Some((*id, address))
                })
                .collect();
            self.membership_checks.insert(pg);
            let (events, me) = (self.events.clone(), self.id);
            let log_when_asked = self.last_log_id(pg);
            tokio::spawn(async move {
                let last = log_when_asked.map_or(0, |(index, _)| index);
                for (id, address) in members {
                    let request = OsdRequest::PgConf { pg };
                    if let Ok(state) =
                        query_replica(address, &request, Duration::from_secs(5)).await
                        && state.lets_go_of(id, me, last)
                    {
                        let _ = events.send(Event::Removed { pg, log_when_asked });
                        break;
                    }
                }
                let _ = events.send(Event::MembershipChecked { pg });
            });
        }
    }

    /// The last raft log entry (index, term) of this replica of `pg`, hosted or only
    /// restored from the log.
    fn last_log_id(&self, pg: PgId) -> Option<(u64, u64)> {
        self.raft.last_log_id(pg).or_else(|| {
            let restored = self.restored.get(&pg)?;
            Some(
                (restored.entries.last())
                    .map_or(restored.compacted, |entry| (entry.index, entry.term)),
            )
        })
    }

    /// Stops hosting `pg`: this replica was removed from its raft group (or its pool is
    /// gone). The removal is logged, so that replay forgets the PG; its data becomes
    /// garbage for the cleaner.
    fn remove_pg(&mut self, pg: PgId) {
        let listed = self
            .map
            .pg(pg)
            .is_some_and(|entry| entry.members.contains(&self.id));
        let known = self.raft.hosts(pg) || self.restored.contains_key(&pg);
        if listed || !known || self.raft.is_leader(pg) {
            return;
        }
        self.abort_install(pg, "the replica was removed from the pg", false);
        self.install_written.remove(&pg);
        let removal = self.log.submit(vec![pg_log::removed_entry(pg)]);
        tokio::spawn(async move {
            if let Err(error) = removal.await {
                tracing::error!(%pg, %error, "cannot log a pg's removal");
            }
        });
        self.raft.remove_group(pg);
        self.objects.remove(&pg);
        self.applied.remove(&pg);
        self.durable.remove(&pg);
        self.hard_states.remove(&pg);
        self.reads.remove(&pg);
        self.restored.remove(&pg);
        self.restored_objects.remove(&pg);
        self.snapshots_sent.retain(|(sent, _), _| *sent != pg);
        self.scrubs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&pg);
        self.scrub_fuzzy_through.remove(&pg);
        self.map_floors.remove(&pg);
        self.refresh_live_bytes();
        self.refresh_retained_bytes();
        tracing::info!(%pg, "pg removed from this osd");
    }

    /// Counts the live bytes (a walk over the objects: their extent maps keep their counts).
    /// Log blocks that live data let go of (discards, a PG removed) are room the cleaner can
    /// make: progress, so that writes short of room wait for it (`Busy`) rather than get
    /// `NoSpace` from a cleaner that found nothing to free before (its pause is cut short).
    fn refresh_live_bytes(&mut self) {
        self.reclaim.live_bytes = self.objects.values().map(PgObjects::mapped_bytes).sum();
        let occupied = self.objects.values().map(PgObjects::occupied_bytes).sum();
        if occupied < self.reclaim.occupied_bytes {
            let now = std::time::Instant::now();
            self.reclaim.progress_at = now;
            self.reclaim.clean_after = self.reclaim.clean_after.min(now);
        }
        self.reclaim.occupied_bytes = occupied;
        self.reclaim.packable_bytes = self.objects.values().map(PgObjects::packable_bytes).sum();
        self.reclaim.index_bytes = self.objects.values().map(PgObjects::checkpoint_bytes).sum();
        self.counters
            .live_bytes
            .store(self.reclaim.live_bytes, Ordering::Relaxed);
    }

    /// Counts the log blocks that payloads of the raft entries kept in memory keep in use
    /// beyond those the object index's count has of them (at least the blocks its live
    /// bytes there fill; a walk over them all, every half second). Counted by their bytes,
    /// 512-byte writes whose index had moved to a packed block kept eight times what was
    /// counted, and the cleaner took that for reclaimable, moving live data round the ring
    /// without end.
    fn refresh_retained_bytes(&mut self) {
        let mut bytes = 0;
        for pg in self.raft.pgs() {
            let (Some(storage), objects) = (self.raft.storage(pg), self.objects.get(&pg)) else {
                continue;
            };
            // Less the blocks the index's live bytes there take at least.
            let block = BLOCK_SIZE as u64;
            bytes += storage
                .retained()
                .iter()
                .filter_map(|entry| PayloadRef::decode(&entry.data))
                .map(|reference| {
                    let live = objects.map_or(0, |objects| objects.live_bytes(&reference));
                    let indexed = live.div_ceil(block) * block;
                    reference.occupied_bytes().saturating_sub(indexed)
                })
                .sum::<u64>();
        }
        self.reclaim.retained_bytes = bytes;
    }

    /// Whether [`Core::is_full`] differs from what the last report said.
    fn full_changed(&self) -> bool {
        self.is_full() != self.report.lock().unwrap_or_else(|p| p.into_inner()).full
    }

    fn update_report(&self, capacity_bytes: u64) {
        let leading: Vec<PgId> = self
            .raft
            .pgs()
            .filter(|pg| self.raft.read_barrier(*pg).is_some())
            .collect();
        let moving = leading
            .iter()
            .copied()
            .filter(|pg| self.move_of(*pg) != PgMove::None)
            .collect();
        let c = &self.counters;
        let full = self.is_full();
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = OsdReport {
            capacity_bytes,
            used_bytes: self.reclaim.occupied_bytes,
            reads: c.reads.load(Ordering::Relaxed),
            writes: c.writes.load(Ordering::Relaxed),
            read_bytes: c.read_bytes.load(Ordering::Relaxed),
            write_bytes: c.write_bytes.load(Ordering::Relaxed),
            leading,
            epoch: self.map.epoch,
            full,
            hosted: self.raft.pgs().count() as u32,
            moving,
            writable_bytes: writable_bytes(&self.log),
            fill_percent: Some(self.fill_percent()),
            scrubs: self
                .scrubs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                // A digest of data a snapshot has replaced since (a repair's, say) no
                // longer speaks for this replica, even if it finished after the install.
                .filter(|scrub| {
                    self.raft.hosts(scrub.pg)
                        && (self.scrub_fuzzy_through.get(&scrub.pg))
                            .is_none_or(|through| scrub.index > *through)
                })
                .copied()
                .collect(),
            checksum_errors: c.checksum_errors.load(Ordering::Relaxed),
            last_checksum_error_age_seconds: c.last_checksum_error_age_seconds(),
            unsendable: self.unsendable.clone(),
            leaderless: self.leaderless.clone(),
            held: self.restored.keys().copied().collect(),
        };
    }
}

/// What a read of the log gave back: the bytes, and the first block among those read that
/// fails its checksum (the bytes are then not those written).
pub(crate) struct ReadBack {
    pub data: Vec<u8>,
    pub damaged: Option<Mismatch>,
}

/// Reads a planned range: mapped pieces from the device (aligned for O_DIRECT, every block
/// read checked against `sums`), holes as zeroes.
pub(crate) async fn read_pieces(
    engine: &FileEngine,
    sums: &BlockSums,
    offset_bytes: u64,
    len_bytes: u64,
    pieces: &[Piece],
) -> std::io::Result<ReadBack> {
    let mut data = vec![0u8; len_bytes as usize];
    let mut damaged = None;
    let block = BLOCK_SIZE as u64;
    for piece in pieces {
        if let Piece::Mapped {
            offset_bytes: at,
            len_bytes: len,
            device_offset_bytes,
        } = *piece
        {
            let start = device_offset_bytes / block * block;
            let end = (device_offset_bytes + len).div_ceil(block) * block;
            let buffer = engine
                .read(start, DmaBuf::zeroed((end - start) as usize))
                .await?;
            if damaged.is_none() {
                damaged = sums.verify(start, &buffer).err();
            }
            let skip = (device_offset_bytes - start) as usize;
            let into = (at - offset_bytes) as usize;
            data[into..into + len as usize].copy_from_slice(&buffer[skip..skip + len as usize]);
        }
    }
    Ok(ReadBack { data, damaged })
}

/// Fetches the objects of a snapshot of `pg` at `index` from `leader`, chunk by chunk: each
/// goes to the core, and the next is asked for once the core has it durable.
async fn fetch_snapshot(
    leader: SocketAddr,
    pg: PgId,
    index: u64,
    me: OsdId,
    transfer: u64,
    events: mpsc::UnboundedSender<Event>,
) {
    let client = match tokio::time::timeout(SNAPSHOT_SILENCE, Client::connect(leader)).await {
        Ok(Ok(client)) => Ok(client),
        Ok(Err(error)) => Err(error.to_string()),
        Err(_) => Err(format!("no connection to {leader}")),
    };
    let mut from = None;
    loop {
        let chunk = match &client {
            Ok(client) => fetch_chunk(client, pg, index, me, from).await,
            Err(error) => Err(error.clone()),
        };
        let next = chunk.as_ref().ok().map(|chunk| chunk.next);
        let (ack, acked) = oneshot::channel();
        if events
            .send(Event::SnapshotChunk {
                pg,
                transfer,
                chunk,
                ack,
            })
            .is_err()
        {
            return;
        }
        match (acked.await, next) {
            (Ok(true), Some(Some(cursor))) => from = Some(cursor),
            _ => return,
        }
    }
}

/// One chunk of a snapshot; a leader that has not applied up to the snapshot yet answers
/// `Busy`, and is asked again.
async fn fetch_chunk(
    client: &Client,
    pg: PgId,
    index: u64,
    me: OsdId,
    from: Option<Cursor>,
) -> Result<Chunk, String> {
    let request = Message::SnapshotRead {
        pg,
        index,
        follower: me,
        from,
        max_bytes: snapshot::CHUNK_BYTES,
    };
    let deadline = std::time::Instant::now() + SNAPSHOT_SILENCE;
    loop {
        let answer = tokio::time::timeout(SNAPSHOT_SILENCE, client.call(&request))
            .await
            .map_err(|_| "the leader did not answer".to_string())?
            .map_err(|error| error.to_string())?;
        match answer {
            Message::Reply {
                status: Status::Ok,
                data,
            } => return Chunk::decode(&data).map_err(|error| error.to_string()),
            Message::Reply {
                status: Status::Busy { .. },
                ..
            } if std::time::Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Message::Reply { status, .. } => {
                return Err(format!("the leader refused: {status:?}"));
            }
            other => return Err(format!("an answer of kind {}", other.kind())),
        }
    }
}

/// An answer to an [`OsdRequest`], as the control frame that carries it.
fn control_answer(result: Result<PgReplicaState, String>) -> Message {
    control_reply(result)
}

/// Any answer to an [`OsdRequest`], as [`ask_osd`] reads it.
fn control_reply<T: serde::Serialize>(result: Result<T, String>) -> Message {
    Message::Control {
        body: serde_json::to_vec(&result).expect("answers encode"),
    }
}

/// Asks the OSD at `address` for its replica's state of a PG (`request`): it has 2 s to
/// accept the connection and `answer_within` to answer.
pub async fn query_replica(
    address: SocketAddr,
    request: &OsdRequest,
    answer_within: Duration,
) -> Result<PgReplicaState, String> {
    ask_osd(address, request, answer_within).await
}

/// Asks the OSD at `address` (`request`) for an answer of type `T`; as [`query_replica`].
pub async fn ask_osd<T: serde::de::DeserializeOwned>(
    address: SocketAddr,
    request: &OsdRequest,
    answer_within: Duration,
) -> Result<T, String> {
    let request = Message::Control {
        body: serde_json::to_vec(request).expect("requests encode"),
    };
    let client = tokio::time::timeout(Duration::from_secs(2), Client::connect(address))
        .await
        .map_err(|_| "connect timed out".to_string())?
        .map_err(|error| error.to_string())?;
    let reply = tokio::time::timeout(answer_within, client.call(&request))
        .await
        .map_err(|_| "no answer".to_string())?
        .map_err(|error| error.to_string())?;
    match reply {
        Message::Control { body } => serde_json::from_slice::<Result<_, String>>(&body)
            .map_err(|error| format!("malformed answer: {error}"))?,
        other => Err(format!("unexpected answer of kind {}", other.kind())),
    }
}

/// The sending task from this OSD (`me`) to peer `id`: connects on demand, drops messages
/// it cannot deliver (raft resends what matters).
fn spawn_peer(me: OsdId, id: OsdId, counters: Arc<Counters>) -> Peer {
    let (queue, mut messages) = mpsc::unbounded_channel::<Outgoing>();
    let address: Arc<Mutex<Option<SocketAddr>>> = Arc::default();
    let link: Arc<Mutex<PeerLink>> = Arc::default();
    let (target, shared) = (address.clone(), link.clone());
    tokio::spawn(async move {
        let lock = || shared.lock().unwrap_or_else(|p| p.into_inner());
        let mut failed_at: Option<tokio::time::Instant> = None;
        while let Some(batch) = messages.recv().await {
            let want = *target.lock().unwrap_or_else(|p| p.into_inner());
            let connected =
                |link: &PeerLink| matches!(&link.connection, Some((at, _)) if Some(*at) == want);
            let up = connected(&lock());
            if let Some(want) = want
                && !up
                && failed_at.is_none_or(|at| at.elapsed() >= Duration::from_millis(200))
            {
                match tokio::time::timeout(Duration::from_secs(1), Client::connect(want)).await {
                    Ok(Ok(client)) => {
                        lock().connection = Some((want, client));
                        failed_at = None;
                    }
                    _ => {
                        tracing::debug!(peer = %id, %want, "cannot reach peer");
                        failed_at = Some(tokio::time::Instant::now());
                    }
                }
            }
            let mut link = lock();
            link.queued -= 1;
            if !connected(&link) {
                // No address, or none reachable: dropped (raft sends again).
                continue;
            }
            let sent = match &link.connection {
                Some((_, client)) => send_batch((me, id), client, batch, &counters),
                None => Err(()),
            };
            if sent.is_err() {
                link.connection = None;
            }
        }
    });
    Peer {
        queue,
        address,
        link,
    }
}

/// Sends one loop turn's raft messages to peer `id` on `client`: one frame, unless the
/// messages (appends of up to 1 MiB each while a replica catches up) would not fit one.
/// Heartbeats and their answers ride in the first frame as beats, a few bytes per PG.
fn send_batch(
    (me, id): (OsdId, OsdId),
    client: &Client,
    Outgoing {
        messages: batch,
        full,
    }: Outgoing,
    counters: &Counters,
) -> Result<(), ()> {
    let mut beats = Vec::new();
    let mut whole = Vec::new();
    for (pg, message) in &batch {
        match beat_of(*pg, me, id, message) {
            Some(beat) => beats.push(beat),
            None => whole.push((*pg, message)),
        }
    }
    let mut frames: Vec<Vec<(PgId, Vec<u8>)>> = vec![Vec::new()];
    let mut frame_bytes = beats.len() * BEAT_BYTES_MAX;
    for (pg, message) in whole {
        let bytes = encode_message(message);
        if frame_bytes + bytes.len() + 16 > BATCH_FRAME_BYTES_MAX
            && frames.last().is_some_and(|frame| !frame.is_empty())
        {
            frames.push(Vec::new());
            frame_bytes = 0;
        }
        frame_bytes += bytes.len() + 16;
        frames
            .last_mut()
            .expect("one frame at least")
            .push((pg, bytes));
    }
    for messages in frames {
        let (coalesced, whole) = (beats.len() as u64, messages.len() as u64);
        let wire = Message::RaftBatch {
            from: me,
            to: id,
            full,
            beats: std::mem::take(&mut beats),
            messages,
        };
        let bytes = client.send(&wire).map_err(|_| ())?;
        counters.peer_frames.fetch_add(1, Ordering::Relaxed);
        counters
            .peer_bytes
            .fetch_add(bytes as u64, Ordering::Relaxed);
        counters.beats_sent.fetch_add(coalesced, Ordering::Relaxed);
        counters
            .raft_messages_sent
            .fetch_add(whole, Ordering::Relaxed);
    }
    Ok(())
}

/// Where a PG's move to new members stands, as its leader sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum PgMove {
    /// Its voters are the map's members.
    None,
    /// Voters to remove, none to add.
    Removing,
    /// Members being added: learners catching up, or a joint configuration.
    Adding,
    /// Members to add, not started.
    ToStart,
}

/// The PGs whose leader takes its next membership step now: all but the moves to start
/// beyond `max` adding at once (those wait for a later turn, the lowest PGs first).
fn throttle(led: &[(PgId, PgMove)], max: usize) -> Vec<PgId> {
    let adding = led
        .iter()
        .filter(|(_, state)| *state == PgMove::Adding)
        .count();
    let mut waiting: Vec<PgId> = led
        .iter()
        .filter(|(_, state)| *state == PgMove::ToStart)
        .map(|(pg, _)| *pg)
        .collect();
    waiting.sort_unstable();
    waiting.truncate(max.saturating_sub(adding));
    led.iter()
        .filter(|(pg, state)| *state != PgMove::ToStart || waiting.contains(pg))
        .map(|(pg, _)| *pg)
        .collect()
}

/// Whether a raft message carries references to payloads on a device. They stay on their
/// OSD (one is hydrated into its write before it is sent): one from the network would
/// point an object at any of this device's bytes.
fn carries_references(message: &RaftMessage) -> bool {
    message
        .get_entries()
        .iter()
        .any(|entry| entry.data.first() == Some(&kind::WRITE_REF))
}

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> OsdError + '_ {
    move |source| OsdError::Io {
        path: path.display().to_string(),
        source,
    }
}

fn random_uuid() -> std::io::Result<[u8; 16]> {
    use std::io::Read;
    let mut uuid = [0u8; 16];
    std::fs::File::open("/dev/urandom")?.read_exact(&mut uuid)?;
    Ok(uuid)
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Claims the OSD's device at `path` and reads its superblock, formatting it first when
/// it is a file not there yet (of `config.device_size_bytes`), or holds no Basalt
/// superblock and `config.format` says so.
async fn prepare_device(
    path: &Path,
    config: &OsdConfig,
) -> Result<(Superblock, basalt_io::device::Claim), OsdError> {
    if !path.exists() {
        // Only the default file is made: a device named (`--device`) that is not there is
        // a typo or a node not made yet, not a file to create in its place.
        if config.device.is_some() {
            return Err(io_error(path)(std::io::Error::new(
                std::io::ErrorKind::NotFound,
                "the device given with --device does not exist",
            )));
        }
        create_device_file(path, config.device_size_bytes, config.device_fill).await?;
    }
    let claim = basalt_io::device::claim_device(path).map_err(io_error(path))?;
    let read = || {
        use std::io::Read;
        let mut block = vec![0u8; BLOCK_SIZE];
        std::fs::File::open(path)
            .and_then(|mut file| file.read_exact(&mut block))
            .map_err(io_error(path))?;
        Ok::<_, OsdError>(Superblock::decode(&block))
    };
    let refused = |error: crate::superblock::SuperblockError, hint: &str| {
        io_error(path)(std::io::Error::other(format!("{error}{hint}")))
    };
    let superblock = match read()? {
        Ok(superblock) => superblock,
        Err(error @ crate::superblock::SuperblockError::NoMagic { .. }) if !config.format => {
            return Err(refused(
                error,
                "; `basalt osd --format` formats it, erasing what it holds",
            ));
        }
        Err(crate::superblock::SuperblockError::NoMagic { .. }) => {
            // Only a blank device: one that holds a file system, a partition table, LVM or
            // another program's data (a disk whose name moved to another after a reboot,
            // with --format still in the command line) is not formatted over.
            if let Some(offset) = first_data(path).map_err(io_error(path))? {
                return Err(io_error(path)(std::io::Error::other(format!(
                    "holds data (at byte {offset}), not formatted; to use it for an OSD, \
                     erase it first (blkdiscard -z, or zeroes over its first and last MiB)"
                ))));
            }
            // Never a sparse fill on a block device: its discarded blocks need not read
            // back as zeroes.
            let block_device = basalt_io::device::is_block_device(path).map_err(io_error(path))?;
            let fill = if block_device {
                Fill::Zeroes
            } else {
                config.device_fill
            };
            LogDevice::format_as(path, random_uuid().map_err(io_error(path))?, fill).await?;
            tracing::info!(path = %path.display(), "formatted the osd device");
            read()?.map_err(|error| refused(error, ""))?
        }
        // A Basalt device that does not read right is not formatted over, even when
        // asked: it may be this OSD's, damaged.
        Err(error) => {
            return Err(refused(
                error,
                " (a Basalt device: to reuse it for a new OSD, erase its first 4 KiB first)",
            ));
        }
    };
    Ok((superblock, claim))
}

/// Where the first byte that is not zero lies in the first or last MiB of the device at
/// `path` (where file systems, partition tables, LVM and the like keep their labels), or
/// `None` when both are zeroes.
fn first_data(path: &Path) -> std::io::Result<Option<u64>> {
    use std::io::{Read, Seek, SeekFrom};
    const SPAN: u64 = 1 << 20;
    let mut file = std::fs::File::open(path)?;
    let size = basalt_io::device::size_bytes(&file)?;
    let mut buffer = vec![0u8; SPAN.min(size) as usize];
    for start in [0, size.saturating_sub(SPAN)] {
        file.seek(SeekFrom::Start(start))?;
        file.read_exact(&mut buffer)?;
        if let Some(at) = buffer.iter().position(|byte| *byte != 0) {
            return Ok(Some(start + at as u64));
        }
    }
    Ok(None)
}

/// Creates the device file at `path`, of `size_bytes`, formatted. It is made under
/// another name and renamed once formatted, so that a start cut short (Ctrl-C while it
/// writes zeroes) leaves no half-made device that later starts refuse.
async fn create_device_file(path: &Path, size_bytes: u64, fill: Fill) -> Result<(), OsdError> {
    let mut name = path.file_name().unwrap_or_default().to_os_string();
    name.push(".new");
    let new = path.with_file_name(name);
    let file = std::fs::File::create(&new).map_err(io_error(&new))?;
    file.set_len(size_bytes).map_err(io_error(&new))?;
    drop(file);
    LogDevice::format_as(&new, random_uuid().map_err(io_error(&new))?, fill).await?;
    std::fs::rename(&new, path).map_err(io_error(path))?;
    if let Some(dir) = path.parent().filter(|dir| !dir.as_os_str().is_empty()) {
        std::fs::File::open(dir)
            .and_then(|dir| dir.sync_all())
            .map_err(io_error(dir))?;
    }
    tracing::info!(path = %path.display(), size_bytes, "formatted a new osd device");
    Ok(())
}

/// A started OSD.
pub struct Running {
    /// Its id.
    pub id: OsdId,
    /// Where it listens.
    pub address: SocketAddr,
    /// Where it serves metrics.
    pub metrics_address: Option<SocketAddr>,
    core: tokio::task::JoinHandle<Result<(), OsdError>>,
    events: mpsc::UnboundedSender<Event>,
    /// Its heartbeats to the monitors.
    heartbeat: tokio::task::JoinHandle<()>,
    /// Stops the heartbeats once the one under way, if any, is answered.
    stop_heartbeats: tokio::sync::watch::Sender<bool>,
    mon: Arc<MonClient>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
    _server: Server,
    log: Arc<LogDevice>,
    /// The data directory and the device, this process's while it runs.
    _claims: [basalt_io::device::Claim; 2],
}

impl Running {
    /// Runs until the core stops (a failed device) or `shutdown` completes.
    pub async fn wait(mut self, shutdown: impl Future<Output = ()>) -> Result<(), OsdError> {
        tokio::select! {
            result = &mut self.core => result.map_err(|error| OsdError::Internal(error.to_string()))?,
            () = shutdown => {
                // The PGs led here go to other replicas first, so that clients are sent
                // there at once.
                let (done, handed_over) = oneshot::channel();
                if self.events.send(Event::Stop { done }).is_ok() {
                    let wait = STOP_HAND_OVER + Duration::from_secs(1);
                    let _ = tokio::time::timeout(wait, handed_over).await;
                }
                // Then the core, so that nothing more is appended; then an empty batch
                // after the last (see `log_device::FENCE_AFTER`), so that damage to the
                // last batch while the OSD is down is not taken for a torn write at the
                // restart.
                self.core.abort();
                let _ = (&mut self.core).await;
                let _ = tokio::time::timeout(Duration::from_secs(2), self.log.close()).await;
                // Last, the monitors mark it down at once, not after the grace. Its
                // heartbeats stop first, the one under way answered (one the monitors
                // took after the mark would mark it up again).
                let _ = self.stop_heartbeats.send(true);
                let last = tokio::time::timeout(Duration::from_secs(2), &mut self.heartbeat);
                if last.await.is_err() {
                    self.heartbeat.abort();
                }
                let down = Command::OsdDown { id: self.id };
                match tokio::time::timeout(Duration::from_secs(1), self.mon.command(down)).await {
                    Ok(Ok(_)) => tracing::info!("marked down"),
                    Ok(Err(error)) => tracing::warn!(%error, "not marked down; the monitors will after the grace"),
                    Err(_) => tracing::warn!("no monitor answered; marked down after the grace"),
                }
                Ok(())
            }
        }
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        self.core.abort();
        self.heartbeat.abort();
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// The live bytes an OSD holds at most before it reports itself full (once the log is a
/// ring): what the health check's nearly-full warning counts from. Besides the free space
/// the cleaner keeps, an eighth of the ring is left to dead data and to what cleaning
/// cannot pack. The cleaner frees the ring from its tail, in the order it was written, so
/// the live data it moves per byte it frees grows as dead data thins out: with a
/// thirty-second left, 4 KiB random writes at 97% of the limit moved 28 bytes per byte
/// written and ran at 13% of their speed on a half-full log; with an eighth, 3 bytes, at
/// 45% (`bench/near-full.sh`, docs/benchmarks.md).
fn writable_bytes(log: &LogDevice) -> u64 {
    let ring = log.ring().len_bytes;
    ring.saturating_sub(ring / 8 + kept_free_bytes(log))
}

/// Free log space an OSD keeps before it reports itself full: the reserve, the headroom
/// and two spans (the cleaner's high mark while checkpoints are small). Not the checkpoint
/// room, which moves with the checkpoints' size (retained raft entries for a follower
/// behind make one large): the limit would move with it, and a full flag set so could
/// stay, with writes stopped and no checkpoint due; at most a sixteenth of the ring of the
/// eighth left to dead data goes to it instead.
fn kept_free_bytes(log: &LogDevice) -> u64 {
    write_floor(log) + 2 * clean_span(log.ring().len_bytes)
}

/// What the object index may take of a checkpoint before the OSD is full
/// ([`Core::full_by`]): three quarters of a checkpoint area, the rest for raft's retained
/// entries.
fn index_limit(log: &LogDevice) -> u64 {
    log.checkpoint_area_bytes() / 4 * 3
}

/// Free space below which the cleaner runs: the reserve and the headroom (what writes
/// need), half a span, and the room for what the cleaner goes through before a checkpoint
/// frees it ([`checkpoint_room`]).
fn clean_low_mark(log: &LogDevice) -> u64 {
    write_floor(log) + clean_span(log.ring().len_bytes) / 2 + checkpoint_room(log)
}

/// What the cleaner goes through before a checkpoint frees it, while it works below its
/// low mark: half a span, or eight times the last checkpoint's size if that is more (at
/// most a sixteenth of the ring), so that checkpoints write at most an eighth of what the
/// cleaner goes through while they are under a 128th of the ring. Each writes the whole
/// index, about 28 bytes per extent: on a large device holding data written 4 KiB at a
/// time, gigabytes, which a checkpoint after every half span (32 MiB at most) would write
/// a hundred times over for every byte cleaned.
fn checkpoint_room(log: &LogDevice) -> u64 {
    let ring = log.ring().len_bytes;
    let share = (CHECKPOINT_SHARE * log.last_checkpoint_bytes()).min(ring / 16);
    (clean_span(ring) / 2).max(share)
}

/// Free log space client writes need besides their own: the log device's reserve (for
/// the cleaner and raft's entries) and a headroom of [`LOG_RESERVE_BYTES`], at most a
/// sixteenth of the ring.
fn write_floor(log: &LogDevice) -> u64 {
    log.reserve_bytes() + LOG_RESERVE_BYTES.min(log.ring().len_bytes / 16)
}

/// How far above what writes need free the cleaner starts, and how much further it goes
/// once started, for a ring of `ring` bytes: a sixty-fourth of it, between one cleaner step
/// and 64 MiB. It only absorbs bursts of writes (writes get `Busy` while the cleaner
/// catches up). Free space it keeps is room dead data cannot take, and the less dead data
/// the tail holds, the more live data the cleaner moves per byte it frees: with a
/// sixteenth of the ring from either mark, it moved twice as much at 90% of what the OSD
/// holds.
fn clean_span(ring: u64) -> u64 {
    let step = crate::log_device::MAX_BATCH_BYTES + BLOCK_SIZE as u64;
    (ring / 64).clamp(step, 64 << 20)
}

/// Starts an OSD: opens (or creates) its device, replays its log, listens, registers with
/// the monitors and hosts its PGs.
pub async fn start(config: OsdConfig) -> Result<Running, OsdError> {
    std::fs::create_dir_all(&config.data_dir).map_err(io_error(&config.data_dir))?;
    let dir_claim =
        basalt_io::device::claim_dir(&config.data_dir).map_err(io_error(&config.data_dir))?;
    let path = config
        .device
        .clone()
        .unwrap_or_else(|| config.data_dir.join(DEVICE_FILE));
    let made_now = !path.exists();
    let (superblock, device_claim) = prepare_device(&path, &config).await?;
    let opened = LogDevice::open(&path).await?;
    let capacity_bytes = superblock.log_end_bytes - superblock.log_start_bytes;
    // An OSD that could hold less than one largest write would report itself full at once.
    let (writable, least) = (
        writable_bytes(&opened.device),
        crate::log_device::MAX_BATCH_BYTES,
    );
    if writable < least {
        if made_now {
            // It holds nothing yet: a start with a larger --device-size makes it again.
            drop(opened);
            let _ = std::fs::remove_file(&path);
        }
        return Err(OsdError::TooSmall {
            path: path.display().to_string(),
            capacity_bytes,
            writable_bytes: writable,
            least,
        });
    }
    // Client data replay found damaged at rest, by PG, with its batch's LSN: marked so
    // (reads of it fail), and the copies of its PGs are rebuilt from the other replicas
    // once the OSD runs; so are those of PGs whose data the checkpoint marks damaged.
    let damaged_at_rest: BTreeMap<PgId, Lsn> = opened
        .replayed
        .batches
        .iter()
        .flat_map(|batch| {
            let pgs = batch
                .damaged_entries
                .iter()
                .map(|&at| batch.entries[at].0.pg);
            pgs.map(|pg| (pg, batch.lsn))
        })
        .collect();
    let poisoned_before = opened
        .checkpoint
        .as_ref()
        .is_some_and(|checkpoint| !checkpoint.poisoned_blocks.is_empty());
    let RestoredPgs {
        groups,
        objects: restored_objects,
    } = pg_log::restore(opened.checkpoint.as_ref(), &opened.replayed.batches)?;
    tracing::info!(
        checkpoint = opened.checkpoint.as_ref().map(|c| c.sequence),
        batches = opened.replayed.batches.len(),
        pgs = groups.len(),
        stopped_by = ?opened.replayed.stopped_by,
        "log replayed"
    );
    let replay_end = (opened.replayed.next_position, opened.replayed.next_lsn);
    let (sequence, replay_position, tail) = match &opened.checkpoint {
        Some(c) => (c.sequence, c.replay_position, (c.tail_position, c.tail_lsn)),
        None => (0, 0, (0, superblock.first_lsn)),
    };
    drop(opened.replayed);
    drop(opened.checkpoint);
    let log = Arc::new(opened.device);
    let running_log = log.clone();
    let engine = Arc::new(
        FileEngine::open(&path, &crate::log_device::engine_options()).map_err(|error| {
            OsdError::Io {
                path: path.display().to_string(),
                source: std::io::Error::other(error.to_string()),
            }
        })?,
    );

    let (events, mut inbox) = mpsc::unbounded_channel::<Event>();
    let core_events = events.clone();
    let handler_events = events.clone();
    let handler: Handler = Arc::new(move |message| {
        let events = handler_events.clone();
        Box::pin(async move {
            match message {
                Message::Raft { pg, message } => {
                    match decode_message(&message) {
                        Some(message) => {
                            let _ = events.send(Event::Raft { pg, message });
                        }
                        None => tracing::debug!(%pg, "undecodable raft message dropped"),
                    }
                    None
                }
                Message::RaftBatch {
                    from,
                    to,
                    full,
                    beats,
                    messages,
                } => {
                    let _ = events.send(Event::PeerFull { from, full });
                    if !beats.is_empty() {
                        let _ = events.send(Event::Beats { from, to, beats });
                    }
                    for (pg, message) in messages {
                        match decode_message(&message) {
                            Some(message) => {
                                let _ = events.send(Event::Raft { pg, message });
                            }
                            None => tracing::debug!(%pg, "undecodable raft message dropped"),
                        }
                    }
                    None
                }
                message => {
                    let (reply_to, answer) = oneshot::channel();
                    if events
                        .send(Event::Request {
                            message,
                            reply: reply_to,
                        })
                        .is_err()
                    {
                        // Stopping: the client tries another replica.
                        return Some(reply(Status::NotLeader { leader: None }));
                    }
                    Some(answer.await.unwrap_or_else(|_| {
                        if events.is_closed() {
                            // The OSD stopped meanwhile: the client tries another replica,
                            // as when a connection drops.
                            reply(Status::NotLeader { leader: None })
                        } else {
                            reply(Status::Io {
                                message: "the osd dropped the request".to_string(),
                            })
                        }
                    }))
                }
            }
        })
    });
    let server = Server::bind(config.listen, handler)
        .await
        .map_err(|source| OsdError::Listen {
            address: config.listen,
            source,
        })?;
    let address = server.address();

    let mon = Arc::new(MonClient::new(config.mons.clone()));
    let boot = MonRequest::Boot {
        uuid: hex(&superblock.uuid),
        host: config.host.clone(),
        address: address.to_string(),
        weight: config.weight,
    };
    let (id, map) = match mon.request(&boot).await {
        Ok(MonReply::Booted { osd, map }) => (osd, map),
        Ok(MonReply::Error(error)) => return Err(OsdError::Mon(error)),
        Ok(other) => {
            return Err(OsdError::Mon(format!(
                "unexpected answer to boot: {other:?}"
            )));
        }
        Err(error) => return Err(OsdError::Mon(error.to_string())),
    };
    tracing::info!(%id, %address, epoch = map.epoch.0, "osd booted");

    let (persists, mut pending) = mpsc::unbounded_channel::<PendingPersist>();
    let completion_events = events.clone();
    let mut tasks = vec![tokio::spawn(async move {
        while let Some(persist) = pending.recv().await {
            let mut payloads = Vec::new();
            let mut end = None;
            for (append, writes) in persist.appends {
                match append.await {
                    Ok(appended) => {
                        payloads.extend(writes.into_iter().map(|(index, term, at)| {
                            (index, term, appended.data_offsets_bytes[at])
                        }));
                        // The start of the batch, not its end: the batch may also carry
                        // persists the core has not heard of yet (group commit), which a
                        // checkpoint cut now must leave to replay.
                        end = Some((appended.position, appended.lsn));
                    }
                    Err(error) => {
                        let _ = completion_events.send(Event::Failed(error.to_string()));
                        return;
                    }
                }
            }
            let _ = completion_events.send(Event::Persisted {
                pg: persist.pg,
                generation: persist.generation,
                number: persist.number,
                snapshot: persist.snapshot,
                then_send: persist.then_send,
                payloads,
                hard_state: persist.hard_state,
                last_index: persist.last_index,
                end,
            });
        }
    })];

    let report = Arc::new(Mutex::new(OsdReport::default()));
    let report_now = Arc::new(tokio::sync::Notify::new());
    let heartbeat_report = report.clone();
    let heartbeat_mon = mon.clone();
    let heartbeat_now = report_now.clone();
    let (stop_heartbeats, mut heartbeats_stopped) = tokio::sync::watch::channel(false);
    let heartbeat = tokio::spawn(async move {
        let mut interval = tokio::time::interval(HEARTBEAT_INTERVAL);
        loop {
            tokio::select! {
                _ = interval.tick() => {}
                () = heartbeat_now.notified() => {}
                _ = heartbeats_stopped.changed() => return,
            }
            let report = heartbeat_report
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            match heartbeat_mon
                .request(&MonRequest::Heartbeat { osd: id, report })
                .await
            {
                Ok(MonReply::Ok) => {}
                Ok(other) => tracing::warn!(?other, "heartbeat refused"),
                Err(error) => tracing::warn!(%error, "heartbeat failed"),
            }
        }
    });
    let subscription_events = events.clone();
    let mut epoch = map.epoch;
    let subscription_mon = mon.clone();
    tasks.push(tokio::spawn(async move {
        loop {
            match subscription_mon.map_after(epoch, MAP_WAIT).await {
                Ok(Some(map)) => {
                    epoch = map.epoch;
                    if subscription_events.send(Event::Map(Arc::new(map))).is_err() {
                        return;
                    }
                }
                Ok(None) => {}
                Err(error) => {
                    tracing::warn!(%error, "map subscription failed");
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            }
        }
    }));

    let counters = Arc::new(Counters::restored(&config.data_dir));
    tasks.push(tokio::spawn(Counters::keep_checksum_errors(
        counters.clone(),
        config.data_dir.clone(),
    )));
    let mut metrics_address = None;
    if let Some(metrics_at) = config.metrics_addr {
        let (counters, report, log) = (counters.clone(), report.clone(), log.clone());
        let render = move || {
            let load = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64;
            let stats = log.stats();
            let report = report.lock().unwrap_or_else(|p| p.into_inner()).clone();
            let (counter, gauge) = ("counter", "gauge");
            let families = [
                (
                    "reads_total",
                    counter,
                    "Client reads served.",
                    load(&counters.reads),
                ),
                (
                    "writes_total",
                    counter,
                    "Client writes acknowledged.",
                    load(&counters.writes),
                ),
                (
                    "read_bytes_total",
                    counter,
                    "Bytes read by clients.",
                    load(&counters.read_bytes),
                ),
                (
                    "write_bytes_total",
                    counter,
                    "Bytes written by clients.",
                    load(&counters.write_bytes),
                ),
                (
                    "write_seconds_total",
                    counter,
                    "Time from the arrival of client writes to their answers, summed.",
                    load(&counters.write_nanos) / 1e9,
                ),
                (
                    "read_seconds_total",
                    counter,
                    "Time from the arrival of client reads to their answers, summed.",
                    load(&counters.read_nanos) / 1e9,
                ),
                (
                    "checkpoints_total",
                    counter,
                    "Checkpoints of the index and raft state written.",
                    load(&counters.checkpoints),
                ),
                (
                    "relocated_bytes_total",
                    counter,
                    "Live bytes the cleaner moved out of the log's tail.",
                    load(&counters.relocated_bytes),
                ),
                (
                    "live_bytes",
                    gauge,
                    "Bytes the object index maps.",
                    load(&counters.live_bytes),
                ),
                (
                    "snapshots_installed_total",
                    counter,
                    "PG snapshots installed here.",
                    load(&counters.snapshots_installed),
                ),
                (
                    "snapshot_received_bytes_total",
                    counter,
                    "Object data bytes received for PG snapshots.",
                    load(&counters.snapshot_bytes_received),
                ),
                (
                    "snapshot_sent_bytes_total",
                    counter,
                    "Object data bytes sent for PG snapshots.",
                    load(&counters.snapshot_bytes_sent),
                ),
                (
                    "peer_frames_sent_total",
                    counter,
                    "Frames of raft messages sent to other OSDs.",
                    load(&counters.peer_frames),
                ),
                (
                    "peer_sent_bytes_total",
                    counter,
                    "Bytes of the frames of raft messages sent to other OSDs.",
                    load(&counters.peer_bytes),
                ),
                (
                    "heartbeats_sent_total",
                    counter,
                    "Raft heartbeats and answers sent coalesced per peer, a few bytes per PG (those confirming a read go whole).",
                    load(&counters.beats_sent),
                ),
                (
                    "raft_messages_sent_total",
                    counter,
                    "Raft messages sent whole (appends, votes, heartbeats confirming reads).",
                    load(&counters.raft_messages_sent),
                ),
                (
                    "checksum_errors_total",
                    counter,
                    "Reads of the log device (client reads, snapshots sent, scrubs) that found a block whose bytes fail the checksum they were written with.",
                    load(&counters.checksum_errors),
                ),
                (
                    "log_free_bytes",
                    gauge,
                    "Bytes of the log ring not in use.",
                    log.free_bytes() as f64,
                ),
                (
                    "log_batches_total",
                    counter,
                    "Durable device writes of the log.",
                    stats.batches as f64,
                ),
                (
                    "log_entries_total",
                    counter,
                    "Entries written to the log.",
                    stats.entries as f64,
                ),
                (
                    "log_device_bytes_total",
                    counter,
                    "Bytes written to the log device.",
                    stats.device_bytes as f64,
                ),
                (
                    "checkpoint_bytes_total",
                    counter,
                    "Bytes of checkpoints written (outside the log).",
                    stats.checkpoint_bytes as f64,
                ),
                (
                    "log_data_bytes_total",
                    counter,
                    "Entry data bytes written to the log.",
                    stats.data_bytes as f64,
                ),
                (
                    "write_amplification",
                    gauge,
                    "Log device bytes per entry data byte.",
                    stats.write_amplification(),
                ),
                (
                    "pgs_leading",
                    gauge,
                    "PGs this OSD leads.",
                    report.leading.len() as f64,
                ),
                (
                    "pgs_hosted",
                    gauge,
                    "PG replicas this OSD hosts.",
                    f64::from(report.hosted),
                ),
                (
                    "used_bytes",
                    gauge,
                    "Bytes of the device in use.",
                    report.used_bytes as f64,
                ),
                (
                    "capacity_bytes",
                    gauge,
                    "Bytes of the device's log region.",
                    report.capacity_bytes as f64,
                ),
                (
                    "writable_bytes",
                    gauge,
                    "Live bytes (counted by the log blocks they keep) this OSD holds before it reports itself full.",
                    report.writable_bytes as f64,
                ),
                (
                    "map_epoch",
                    gauge,
                    "The map epoch this OSD runs.",
                    report.epoch.0 as f64,
                ),
            ];
            let mut e = Exposition::new();
            for (name, kind, help, value) in families {
                e.single(&format!("basalt_osd_{name}"), kind, help, value);
            }
            e.finish()
        };
        let (bound, task) =
            metrics::serve(metrics_at, Arc::new(render))
                .await
                .map_err(|source| OsdError::Listen {
                    address: metrics_at,
                    source,
                })?;
        metrics_address = Some(bound);
        tasks.push(task);
    }

    let seed = u64::from_le_bytes(
        random_uuid().map_err(io_error(&path))?[..8]
            .try_into()
            .expect("8 bytes"),
    );
    let mut raft = MultiRaft::new(id, seed);
    // Clients read from leaders only: followers may learn of commits lazily.
    raft.set_lazy_commit(true);
    raft.set_lease(Some(LEASE));
    // Entries keep a reference to their payload once durable; sending one to a follower
    // reads the payload back.
    let payload_file = std::fs::File::open(&path).map_err(io_error(&path))?;
    let device_path = path.display().to_string();
    let (sums, damaged) = (log.block_sums(), events.clone());
    raft.set_hydrate(Arc::new(move |data: &[u8]| {
        use std::os::unix::fs::FileExt;
        let Some(reference) = PayloadRef::decode(data) else {
            return Ok(None);
        };
        // A payload starts on a block (an entry's data does), and is checked as the batch
        // padded it.
        let at = reference.device_offset_bytes;
        debug_assert!(at.is_multiple_of(BLOCK_SIZE as u64), "a payload at {at}");
        let mut payload = vec![0u8; reference.len_bytes as usize];
        if let Err(error) = payload_file.read_exact_at(&mut payload, at) {
            // Raft cannot be told that an entry is unreadable; stop rather than send a
            // wrong one (a restart replays).
            tracing::error!(device = %device_path, %error, "cannot read a payload back");
            std::process::exit(1);
        }
        if let Err(mismatch) = sums.verify(at, &payload) {
            // Not sent: this replica hands the PG to one whose copy is whole.
            let object = reference.object;
            let _ = damaged.send(Event::DamagedPayload { object, mismatch });
            return Err(PayloadUnavailable);
        }
        Ok(Some(reference.with_payload(payload).encode()))
    }));
    let mut core = Core {
        id,
        raft,
        map: Arc::new(ClusterMap::new()),
        restored: groups,
        objects: HashMap::new(),
        applied: HashMap::new(),
        proposals: HashMap::new(),
        reads: HashMap::new(),
        log,
        persists,
        moving_durable_end: false,
        peers: HashMap::new(),
        engine,
        counters,
        report,
        report_now: report_now.clone(),
        scrub_schedule: crate::scrub::Schedule::new(config.scrub_interval),
        scrubs: Arc::new(Mutex::new(BTreeMap::new())),
        scrub_fuzzy_through: HashMap::new(),
        actions: Vec::new(),
        hard_states: HashMap::new(),
        pending_bytes: 0,
        events: core_events,
        durable: HashMap::new(),
        restored_objects,
        reclaim: Reclaim {
            durable_end: replay_end,
            cleaned_to: tail,
            unrescued: None,
            cleaning: false,
            pressed: false,
            progress_at: std::time::Instant::now(),
            clean_after: std::time::Instant::now(),
            sequence,
            replay_position,
            writing: false,
            stopped: false,
            live_bytes: 0,
            occupied_bytes: 0,
            packable_bytes: 0,
            index_bytes: 0,
            full_by: [false; 2],
            retained_bytes: 0,
            asked: false,
            wanted_free: (0, std::time::Instant::now()),
        },
        outbox: BTreeMap::new(),
        confirming: HashMap::new(),
        next_read: 0,
        installing: HashMap::new(),
        install_written: HashMap::new(),
        next_transfer: 0,
        snapshots_sent: HashMap::new(),
        peers_full: HashMap::new(),
        map_floors: HashMap::new(),
        generations: HashMap::new(),
        next_generation: 0,
        membership_checks: std::collections::HashSet::new(),
        max_moves: config.max_moves.max(1),
        repairs: BTreeMap::new(),
        log_suspects: BTreeSet::new(),
        unsendable: Vec::new(),
        leaderless: Vec::new(),
        stopping: None,
    };
    core.adopt_map(Arc::new(map));
    if poisoned_before || !damaged_at_rest.is_empty() {
        core.repair_damage_at_start(&damaged_at_rest);
    }
    core.refresh_live_bytes();
    core.refresh_retained_bytes();
    let replayed: Vec<(PgId, u64)> = core
        .raft
        .pgs()
        .map(|pg| (pg, core.raft.last_index(pg).unwrap_or(0)))
        .collect();
    core.scrub_fuzzy_through.extend(replayed);
    if !core.restored.is_empty() {
        let orphans: Vec<String> = core.restored.keys().map(ToString::to_string).collect();
        tracing::warn!(
            ?orphans,
            "the log holds pgs whose raft state could not be restored; their data is kept, and the log is not reused while it is"
        );
    }
    let turns = Arc::new(tokio::sync::Notify::new());
    let polling = !config.poll.is_zero();
    if polling {
        tasks.push(tokio::spawn(poll_after_turns(config.poll, turns.clone())));
    }
    let mut load = WriteLoad::new(core.log.stats(), std::time::Instant::now());
    let core = tokio::spawn(async move {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        let mut ticks = 0u64;
        loop {
            // This turn handled work under way (`Event::is_work`): polling may catch its
            // next step.
            let mut busy = false;
            tokio::select! {
                event = inbox.recv() => {
                    let Some(event) = event else { return Ok(()) };
                    busy |= event.is_work();
                    core.handle(event)?;
                    while let Ok(event) = inbox.try_recv() {
                        busy |= event.is_work();
                        core.handle(event)?;
                    }
                }
                _ = ticker.tick() => {
                    core.raft.tick();
                    core.watch_snapshots_sent();
                    core.advance_repairs();
                    core.reconfigure_pgs();
                    ticks += 1;
                    if ticks.is_multiple_of(10) {
                        core.check_memberships();
                        core.hand_over_below_floor();
                        core.refresh_unsendable();
                        core.refresh_leaderless();
                        core.propose_scrubs();
                    }
                    core.refresh_live_bytes();
                    if ticks.is_multiple_of(5) {
                        core.refresh_retained_bytes();
                    }
                    // Becoming full is told at once: the leaders of this OSD's PGs accept
                    // writes until the map says so, and the reserve must hold them.
                    let full_changed = core.full_changed();
                    core.reclaim.full_by = core.full_by();
                    if full_changed || ticks.is_multiple_of(5) {
                        core.update_report(capacity_bytes);
                    }
                    if full_changed {
                        tracing::warn!(
                            full = core.is_full(),
                            live_bytes = core.reclaim.packed_bytes(),
                            writable_bytes = writable_bytes(&core.log),
                            index_bytes = core.reclaim.index_bytes,
                            checkpoint_area_bytes = core.log.checkpoint_area_bytes(),
                            "the full flag changes"
                        );
                        core.report_now.notify_one();
                    }
                }
            }
            core.advance_stop();
            core.drive()?;
            core.abort_installs_short_of_room();
            core.maybe_clean();
            core.maybe_checkpoint();
            if polling && busy && load.light(core.log.stats(), std::time::Instant::now()) {
                turns.notify_one();
            }
        }
    });
    Ok(Running {
        id,
        address,
        metrics_address,
        core,
        events,
        heartbeat,
        stop_heartbeats,
        mon,
        tasks,
        _server: server,
        log: running_log,
        _claims: [dir_claim, device_claim],
    })
}

/// Whether the OSD's writes come one at a time, judged from its log device's batches: about
/// one append per batch is a lone writer, which waits on every step and gains from polling;
/// several per batch is a queue, whose batches grow while the OSD sleeps (one device write
/// and flush for more appends), and which polling would cut short.
struct WriteLoad {
    since: LogStats,
    at: std::time::Instant,
    light: bool,
}

impl WriteLoad {
    const WINDOW: Duration = Duration::from_millis(200);
    const BATCHES: u64 = 16;

    fn new(stats: LogStats, now: std::time::Instant) -> Self {
        Self {
            since: stats,
            at: now,
            light: true,
        }
    }

    /// Judges again once 16 batches have gone out since the last judgement, or once the
    /// window has passed (by the batches in it, however few); in between, the last
    /// judgement stands.
    fn light(&mut self, stats: LogStats, now: std::time::Instant) -> bool {
        let batches = stats.batches.saturating_sub(self.since.batches);
        let window_over = now.saturating_duration_since(self.at) >= Self::WINDOW;
        if batches < Self::BATCHES && !window_over {
            return self.light;
        }
        // At most 1.5 appends per batch (no batch at all: light).
        let appends = stats.appends.saturating_sub(self.since.appends);
        self.light = 2 * appends <= 3 * batches;
        self.since = stats;
        self.at = now;
        self.light
    }
}

/// Keeps the OSD's thread busy for `poll` after a turn of its core (the core asks for it
/// after a turn with work under way, [`Event::is_work`], while [`WriteLoad`] finds the
/// writes light): the task yields to the runtime in a loop, and each yield has the runtime
/// look at its sockets and the device's completion eventfd without sleeping, so an
/// acknowledgement or a completion expected within `poll` is taken without the wake-up of
/// a sleeping thread (25-30 µs on this machine's vCPUs). Each round
/// first offers the CPU to any other runnable thread (`sched_yield`): without that, three
/// polling OSDs on two vCPUs doubled the QD1 write latency (docs/benchmarks.md). A turn
/// during the window starts a new one when it ends. Off by default: the CPU stays busy
/// while the window lasts.
async fn poll_after_turns(poll: Duration, turns: Arc<tokio::sync::Notify>) {
    loop {
        turns.notified().await;
        let until = std::time::Instant::now() + poll;
        while std::time::Instant::now() < until {
            basalt_io::process::yield_cpu();
            tokio::task::yield_now().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A removed replica lets go of its copy only once the leader's voters hold what it
    /// holds (or what the leader's log holds, if that ends before).
    #[test]
    fn a_removed_replica_lets_go_once_the_voters_hold_its_entries() {
        let (leader, me) = (OsdId(1), OsdId(3));
        let state = PgReplicaState {
            osd: leader,
            pg: PgId {
                pool: basalt_common::PoolId(1),
                index: 0,
            },
            hosted: true,
            leader: Some(leader),
            term: 4,
            committed: 90,
            applied: 90,
            last_index: 100,
            last_term: 4,
            objects: 0,
            mapped_bytes: 0,
            digest: 0,
            voters: vec![OsdId(1), OsdId(2), OsdId(4)],
            voters_outgoing: Vec::new(),
            learners: Vec::new(),
            conf_index: 0,
            giving_up_from: None,
            voters_matched: Some(80),
        };
        assert!(state.lets_go_of(leader, me, 80));
        assert!(!state.lets_go_of(leader, me, 81), "a voter lacks entry 81");
        // Entries past the leader's log were never committed.
        let caught_up = PgReplicaState {
            voters_matched: Some(100),
            ..state.clone()
        };
        assert!(caught_up.lets_go_of(leader, me, 120));
        assert!(
            !caught_up.lets_go_of(OsdId(2), me, 80),
            "asked another than the leader"
        );
        let still_a_learner = PgReplicaState {
            learners: vec![me],
            ..caught_up.clone()
        };
        assert!(!still_a_learner.lets_go_of(leader, me, 80));
        let unknown = PgReplicaState {
            voters_matched: None,
            ..caught_up
        };
        assert!(
            !unknown.lets_go_of(leader, me, 80),
            "an answer without the count"
        );
    }

    fn pg(index: u32) -> PgId {
        PgId {
            pool: basalt_common::PoolId(1),
            index,
        }
    }

    /// What an idle OSD handles (beats, the empty persists behind a follower's answers
    /// to heartbeats) does not start polling; what a write does (a persist of entries, a
    /// raft append) does.
    #[test]
    fn only_work_under_way_starts_polling() {
        let persisted = |last_index| Event::Persisted {
            pg: Some(pg(1)),
            generation: 1,
            number: 1,
            snapshot: None,
            then_send: Vec::new(),
            payloads: Vec::new(),
            hard_state: None,
            last_index,
            end: None,
        };
        assert!(!persisted(None).is_work());
        assert!(persisted(Some(7)).is_work());
        let beats = Event::Beats {
            from: OsdId(1),
            to: OsdId(2),
            beats: Vec::new(),
        };
        assert!(!beats.is_work());
        let append = Event::Raft {
            pg: pg(1),
            message: RaftMessage::default(),
        };
        assert!(append.is_work());
        assert!(!Event::MembershipChecked { pg: pg(1) }.is_work());
    }

    /// An append whose entries hold payload references (never sent by an OSD) is refused;
    /// one with the writes themselves is not.
    #[test]
    fn payload_references_from_the_network_are_refused() {
        let reference = PayloadRef {
            object: ObjectKey {
                image: basalt_common::ImageId(1),
                number: 0,
            },
            offset_bytes: 0,
            len_bytes: 4096,
            device_offset_bytes: 1 << 20,
        };
        let append = |data: Vec<u8>| {
            let mut message = RaftMessage::default();
            message.mut_entries().push(basalt_replication::RaftEntry {
                data: data.into(),
                ..Default::default()
            });
            message
        };
        assert!(carries_references(&append(reference.encode())));
        let write = ObjectOp::Write {
            object: reference.object,
            offset_bytes: 0,
            data: vec![7; 4096],
        };
        assert!(!carries_references(&append(write.encode())));
        assert!(!carries_references(&RaftMessage::default()));
    }

    #[test]
    fn polling_stops_while_batches_carry_several_appends() {
        let stats = |batches, appends| LogStats {
            batches,
            appends,
            ..LogStats::default()
        };
        let start = std::time::Instant::now();
        let ms = |n| start + Duration::from_millis(n);
        let mut load = WriteLoad::new(stats(100, 100), start);
        assert!(
            load.light(stats(100, 100), start),
            "light until shown otherwise"
        );
        // One append per batch: a lone writer.
        assert!(load.light(stats(116, 116), ms(1)));
        // Too few batches to judge: the last judgement stands.
        assert!(load.light(stats(120, 150), ms(2)));
        // 16 batches with 2.5 appends each: a queue.
        assert!(!load.light(stats(136, 156), ms(3)));
        assert!(!load.light(stats(140, 170), ms(100)), "still a queue");
        // Exactly 1.5 appends per batch is still light.
        assert!(load.light(stats(152, 180), ms(101)));
        assert!(!load.light(stats(168, 220), ms(102)));
        // A window over with few batches: judged by those, a queue...
        assert!(!load.light(stats(169, 230), ms(301)));
        assert!(!load.light(stats(170, 240), ms(303)));
        // ... or one append each...
        assert!(load.light(stats(171, 241), ms(504)));
        // ... or none: light.
        assert!(!load.light(stats(187, 300), ms(505)));
        assert!(load.light(stats(187, 300), ms(706)));
    }

    #[test]
    fn moves_start_while_fewer_than_the_limit_add_members() {
        let led = [
            (pg(7), PgMove::ToStart),
            (pg(1), PgMove::Adding),
            (pg(3), PgMove::None),
            (pg(6), PgMove::Removing),
            (pg(2), PgMove::ToStart),
            (pg(5), PgMove::ToStart),
            (pg(4), PgMove::Adding),
        ];
        // Two adding, room for one more: the lowest waiting PG starts; the others wait.
        let mut next = throttle(&led, 3);
        next.sort_unstable();
        assert_eq!(next, [pg(1), pg(2), pg(3), pg(4), pg(6)]);
        // No room: only the moves under way and the PGs with nothing to add go on.
        let mut next = throttle(&led, 2);
        next.sort_unstable();
        assert_eq!(next, [pg(1), pg(3), pg(4), pg(6)]);
        let mut next = throttle(&led, 1);
        next.sort_unstable();
        assert_eq!(
            next,
            [pg(1), pg(3), pg(4), pg(6)],
            "moves under way are never held back"
        );
        // Room for all.
        assert_eq!(throttle(&led, 10).len(), led.len());
    }

    /// The cleaner leaves eight times the last checkpoint's size cleaned before a checkpoint
    /// frees it (each writes the whole index), and its low mark makes room for that; small
    /// checkpoints leave half a span. What the OSD holds before it is full does not move
    /// with them.
    #[test]
    fn checkpoints_follow_the_cleaner_by_eight_times_their_size() {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("runtime");
        runtime.block_on(async {
            let path = std::env::temp_dir().join(format!("osd-marks-{}", std::process::id()));
            std::fs::File::create(&path)
                .expect("create")
                .set_len(512 << 20)
                .expect("set_len");
            LogDevice::format_as(&path, [7; 16], Fill::Sparse)
                .await
                .expect("format");
            let log = LogDevice::open(&path).await.expect("open").device;
            let ring = log.ring().len_bytes;
            let span = clean_span(ring);
            assert_eq!(checkpoint_room(&log), span / 2, "before any checkpoint");
            let (low, writable) = (clean_low_mark(&log), writable_bytes(&log));
            assert_eq!(low, write_floor(&log) + span, "half a span and half a span");
            // A checkpoint with 3 MiB of block checksums: 24 MiB of room.
            let checkpoint = basalt_store::checkpoint::Checkpoint {
                sequence: 1,
                replay_position: 0,
                replay_lsn: Lsn::FIRST,
                tail_position: 0,
                tail_lsn: Lsn::FIRST,
                pgs: Vec::new(),
                block_sums: vec![(0, vec![0; 3 << 18])],
                poisoned_blocks: Vec::new(),
            };
            let copy = checkpoint.clone();
            log.write_checkpoint(0, move || copy)
                .await
                .expect("checkpoint");
            let size = log.last_checkpoint_bytes();
            assert!(size > 3 << 20, "{size}");
            assert_eq!(checkpoint_room(&log), 8 * size);
            assert_eq!(clean_low_mark(&log), low + 8 * size - span / 2);
            assert_eq!(
                writable_bytes(&log),
                writable,
                "the full limit does not move"
            );
            // At most a sixteenth of the ring.
            let huge = basalt_store::checkpoint::Checkpoint {
                sequence: 2,
                block_sums: vec![(0, vec![0; 5 << 18])],
                ..checkpoint
            };
            log.write_checkpoint(1, move || huge)
                .await
                .expect("checkpoint");
            assert_eq!(checkpoint_room(&log), ring / 16);
            // Opened again, the device counts the checkpoint it read.
            drop(log);
            let log = LogDevice::open(&path).await.expect("open").device;
            assert!(log.last_checkpoint_bytes() > 5 << 20);
            assert_eq!(checkpoint_room(&log), ring / 16);
            drop(log);
            std::fs::remove_file(&path).expect("remove");
        });
    }
}
