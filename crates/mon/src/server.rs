//! The monitor daemon: the cluster map replicated by raft across 1, 3 or 5 monitors.
//!
//! Every map change is a command in the monitors' raft log (one raft group, the same
//! multi-raft driver the OSDs use): the leader proposes it, each monitor persists it in its
//! [`Journal`] (synced) before acknowledging, and once committed every monitor applies it to
//! its map in log order. A change is answered only once applied, so an answered change
//! survives the loss of a minority of monitors and a crash of all of them (the map is
//! rebuilt on start by replaying the journal).
//!
//! The leader does everything that needs one decision: commands, OSD boots and heartbeats,
//! failure detection, status. A follower forwards those requests to the leader. Any monitor
//! answers map subscriptions ([`MonRequest::GetMap`]) from its own map.

use std::collections::{BTreeMap, HashMap};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use basalt_common::{Epoch, ImageId, OsdId, PgId, PoolId};
use basalt_replication::{
    Action, MultiRaft, RaftMessage, Restored, decode_message, encode_message,
};
use basalt_wire::Message;
use basalt_wire::metrics::{self, Exposition};
use basalt_wire::tcp::{Client, Handler, Server};
use tokio::sync::{mpsc, oneshot, watch};

use crate::journal::Journal;
use crate::liveness::{Liveness, Verdict};
use crate::map::{ClusterMap, Command};
use crate::protocol::{ClusterStatus, MonReply, MonRequest, OsdReport, WATCH_TTL, decode};

/// The journal's file in the data directory.
pub const JOURNAL_FILE: &str = "mon.journal";
/// The monitors' raft group (not a PG of any pool).
const MON_GROUP: PgId = PgId {
    pool: PoolId(u32::MAX),
    index: 0,
};
/// A raft tick.
const TICK: Duration = Duration::from_millis(100);
/// A monitor the leader heard from within this long is in its quorum (`basalt status`):
/// two election timeouts, while a follower answers the leader's heartbeats every two
/// ticks.
const QUORUM_HEARD_WITHIN: Duration = Duration::from_secs(2);
/// The longest a subscriber may wait for a map in one request.
const MAP_WAIT_MAX: Duration = Duration::from_secs(30);
/// How often the leader checks liveness.
const CHECK_INTERVAL: Duration = Duration::from_millis(250);
/// How long a request waits for a leader to exist.
const LEADER_WAIT: Duration = Duration::from_secs(5);

/// How a monitor runs.
#[derive(Debug, Clone)]
pub struct MonConfig {
    /// Where the journal is kept.
    pub data_dir: PathBuf,
    /// Where to listen; must be one of `peers` when peers are given.
    pub listen: SocketAddr,
    /// Every monitor of the cluster, this one included (empty: this one alone).
    pub peers: Vec<SocketAddr>,
    /// An OSD without heartbeats this long is marked down.
    pub grace: Duration,
    /// An OSD down this long is marked out (its PGs move).
    pub down_out_interval: Duration,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
    /// A new pool is refused when it would put more PG replicas than this on each OSD in
    /// (see [`crate::map::PGS_PER_OSD_MAX_DEFAULT`]).
    pub max_pgs_per_osd: u32,
}

/// Why the monitor could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MonError {
    /// The data directory or the journal.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The configuration is inconsistent.
    #[error("{0}")]
    Config(String),
    /// Listening failed.
    #[error("cannot listen on {address}: {source}")]
    Listen {
        /// The address.
        address: SocketAddr,
        /// The error.
        source: std::io::Error,
    },
}

struct Report {
    at: Instant,
    report: OsdReport,
    /// The one before, for rates.
    previous: Option<(Instant, OsdReport)>,
    /// The OSD's reads that met damage, kept through its restarts (its own count, kept in
    /// its data directory, may fall back by the errors of its last second, or to zero if
    /// the file is lost), so that health goes on naming a device that gave back damaged
    /// bytes.
    checksum_errors: ChecksumErrors,
}

/// An OSD's reads that met damage, as the monitor saw them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct ChecksumErrors {
    /// Counted before the OSD's last restart.
    before_restart: u64,
    /// When the last one was.
    last: Option<Instant>,
}

impl ChecksumErrors {
    /// What `report` (arriving `now`) adds to what was known when the OSD reported
    /// `previous` (its count falls when it restarted).
    fn update(self, previous: Option<&OsdReport>, report: &OsdReport, now: Instant) -> Self {
        let before_restart = match previous {
            Some(previous) if report.checksum_errors < previous.checksum_errors => {
                // What the OSD's count lost at its restart.
                self.before_restart + previous.checksum_errors - report.checksum_errors
            }
            _ => self.before_restart,
        };
        let reported = report
            .last_checksum_error_age_seconds
            .and_then(|age| now.checked_sub(Duration::from_secs(age)));
        Self {
            before_restart,
            last: self.last.max(reported),
        }
    }

    /// `report` with these counts in it, as of `now`.
    fn apply(self, mut report: OsdReport, now: Instant) -> OsdReport {
        report.checksum_errors += self.before_restart;
        report.last_checksum_error_age_seconds = self
            .last
            .map(|last| now.saturating_duration_since(last).as_secs());
        report
    }
}

struct State {
    map: ClusterMap,
    liveness: Liveness,
    reports: BTreeMap<OsdId, Report>,
    /// The raft term of the lead for which liveness was last restarted (each lead of
    /// this monitor's restarts it: heartbeats went to another monitor meanwhile).
    liveness_term: Option<u64>,
    /// When each other monitor (by rank) last sent this one a raft message.
    heard: BTreeMap<usize, Instant>,
    /// Since when this monitor leads, and in which raft term; `None` while it does not.
    leading_since: Option<(Instant, u64)>,
    /// Each image's watchers ([`MonRequest::Watch`]).
    watchers: ImageWatchers,
}

/// Each image's watchers, by who: when last heard from, and whether it watches (false: it
/// said it stopped; kept for [`WATCH_TTL`], so that a renewal sent before and arriving
/// after counts for nothing). Time is an argument.
#[derive(Default)]
struct ImageWatchers(BTreeMap<ImageId, BTreeMap<String, (Instant, bool)>>);

impl ImageWatchers {
    /// `watcher` says, at `now`, that it watches `image` (`present`) or stopped.
    fn heard(&mut self, image: ImageId, watcher: String, present: bool, now: Instant) {
        let watchers = self.0.entry(image).or_default();
        // Each request runs in a task of its own: a renewal sent before the watcher
        // stopped may come after it said so.
        let stopped = matches!(watchers.get(&watcher), Some((_, false)));
        if !(present && stopped) {
            watchers.insert(watcher, (now, present));
        }
    }

    /// The watchers of `image` at `now`: those that watch and were heard from within
    /// [`WATCH_TTL`].
    fn of(&self, image: ImageId, now: Instant) -> Vec<String> {
        self.0.get(&image).map_or_else(Vec::new, |watchers| {
            watchers
                .iter()
                .filter(|(_, (at, present))| {
                    *present && now.saturating_duration_since(*at) <= WATCH_TTL
                })
                .map(|(watcher, _)| watcher.clone())
                .collect()
        })
    }

    /// Forgets what was last heard of more than [`WATCH_TTL`] before `now`.
    fn prune(&mut self, now: Instant) {
        self.0.retain(|_, watchers| {
            watchers.retain(|_, (at, _)| now.saturating_duration_since(*at) <= WATCH_TTL);
            !watchers.is_empty()
        });
    }
}

/// What the core task hears.
enum Event {
    Propose {
        command: Command,
        reply: oneshot::Sender<MonReply>,
    },
    Raft(RaftMessage),
}

/// A running monitor's shared half (the core task owns raft).
pub struct Monitor {
    state: Mutex<State>,
    maps: watch::Sender<Arc<ClusterMap>>,
    events: mpsc::UnboundedSender<Event>,
    /// The leader's rank, as the core last saw it.
    leader: watch::Receiver<Option<usize>>,
    rank: usize,
    peers: Vec<SocketAddr>,
    forward: tokio::sync::Mutex<Option<(SocketAddr, Arc<Client>)>>,
}

/// A monitor serving on its address; dropping it stops it.
pub struct Running {
    /// The monitor.
    pub monitor: Arc<Monitor>,
    /// Where it listens.
    pub address: SocketAddr,
    /// Where it serves metrics.
    pub metrics_address: Option<SocketAddr>,
    _server: Server,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Running {
    fn drop(&mut self) {
        for task in &self.tasks {
            task.abort();
        }
    }
}

fn io_error(path: &std::path::Path) -> impl Fn(std::io::Error) -> MonError + '_ {
    move |source| MonError::Io {
        path: path.display().to_string(),
        source,
    }
}

impl Monitor {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// The current map.
    pub fn map(&self) -> Arc<ClusterMap> {
        self.maps.borrow().clone()
    }

    /// Whether this monitor leads.
    pub fn is_leader(&self) -> bool {
        *self.leader.borrow() == Some(self.rank)
    }

    /// Proposes a command and waits until it is applied here.
    async fn propose(&self, command: Command) -> MonReply {
        let (reply, answer) = oneshot::channel();
        if self.events.send(Event::Propose { command, reply }).is_err() {
            return MonReply::unavailable("the monitor is stopping");
        }
        match tokio::time::timeout(Duration::from_secs(10), answer).await {
            Ok(Ok(reply)) => reply,
            _ => MonReply::Unavailable {
                reason: "the monitors did not commit the change in time (no quorum?)".to_string(),
                maybe_done: true,
            },
        }
    }

    /// Waits for a leader; `Some(rank)`.
    async fn await_leader(&self) -> Option<usize> {
        let mut leader = self.leader.clone();
        let found = tokio::time::timeout(LEADER_WAIT, leader.wait_for(Option::is_some)).await;
        found.ok().and_then(|value| value.ok().and_then(|v| *v))
    }

    /// Sends a request to the leader and returns its answer.
    async fn forward(&self, rank: usize, message: Message) -> Message {
        let address = self.peers[rank];
        let client = {
            let mut current = self.forward.lock().await;
            match current.as_ref() {
                Some((at, client)) if *at == address => Some(client.clone()),
                _ => match tokio::time::timeout(Duration::from_secs(2), Client::connect(address))
                    .await
                {
                    Ok(Ok(client)) => {
                        let client = Arc::new(client);
                        *current = Some((address, client.clone()));
                        Some(client)
                    }
                    _ => None,
                },
            }
        };
        let Some(client) = client else {
            return MonReply::unavailable(format!("the leading monitor {address} is unreachable"))
                .to_message();
        };
        match tokio::time::timeout(Duration::from_secs(15), client.call(&message)).await {
            Ok(Ok(reply)) => reply,
            _ => {
                *self.forward.lock().await = None;
                MonReply::Unavailable {
                    reason: format!("the leading monitor {address} did not answer"),
                    maybe_done: true,
                }
                .to_message()
            }
        }
    }

    async fn handle(self: Arc<Self>, message: Message) -> Option<Message> {
        if let Message::Raft { pg, message } = &message {
            if *pg == MON_GROUP
                && let Some(message) = decode_message(message)
            {
                // Raft numbers monitors from 1 (rank 0 is raft id 1).
                if let Some(rank) = (message.from as usize)
                    .checked_sub(1)
                    .filter(|rank| *rank < self.peers.len())
                {
                    self.lock().heard.insert(rank, Instant::now());
                }
                let _ = self.events.send(Event::Raft(message));
            }
            return None;
        }
        let request = match decode::<MonRequest>(&message) {
            Ok(request) => request,
            Err(error) => return Some(MonReply::Error(error).to_message()),
        };
        if let MonRequest::GetMap { after, wait_ms } = request {
            // A monitor out of touch with a quorum (no leader known: its election timeout
            // passed without one) may hold an old map, and would say "nothing newer" to a
            // subscriber for as long as it is cut off, while the OSDs go by newer ones: the
            // client is sent on to another monitor instead.
            let out_of_quorum = || {
                MonReply::unavailable(
                    "this monitor is out of touch with a quorum: its map may be old",
                )
                .to_message()
            };
            let mut leader = self.leader.clone();
            if leader.borrow().is_none() {
                return Some(out_of_quorum());
            }
            let mut maps = self.maps.subscribe();
            let newer = |map: &Arc<ClusterMap>| after.is_none_or(|after| map.epoch > after);
            let wait = Duration::from_millis(wait_ms).min(MAP_WAIT_MAX);
            let found = tokio::time::timeout(wait, async {
                tokio::select! {
                    map = maps.wait_for(newer) => map.ok().map(|map| (*map).clone()),
                    _ = leader.wait_for(Option::is_none) => None,
                }
            })
            .await;
            let reply = match found {
                Ok(Some(map)) => MonReply::Map(Some((*map).clone())),
                _ if self.leader.borrow().is_none() => return Some(out_of_quorum()),
                _ => {
                    let map = self.map();
                    MonReply::Map(newer(&map).then(|| (*map).clone()))
                }
            };
            return Some(reply.to_message());
        }
        // Everything else is the leader's.
        let Some(leader) = self.await_leader().await else {
            return Some(
                MonReply::unavailable("no monitor leads: the monitors have no quorum").to_message(),
            );
        };
        if leader != self.rank {
            return Some(self.forward(leader, message).await);
        }
        let reply = match request {
            MonRequest::Boot {
                uuid,
                host,
                address,
                weight,
            } => {
                let command = Command::OsdBoot {
                    uuid: uuid.clone(),
                    host,
                    address,
                    weight,
                };
                match self.propose(command).await {
                    MonReply::Applied { .. } => {
                        let mut state = self.lock();
                        match state
                            .map
                            .osds
                            .values()
                            .find(|osd| osd.uuid == uuid)
                            .map(|osd| osd.id)
                        {
                            Some(osd) => {
                                state.liveness.heartbeat(osd, Instant::now());
                                MonReply::Booted {
                                    osd,
                                    map: state.map.clone(),
                                }
                            }
                            None => MonReply::Error("the booted osd is not in the map".to_string()),
                        }
                    }
                    other => other,
                }
            }
            MonRequest::Heartbeat { osd, report } => self.heartbeat(osd, report).await,
            MonRequest::Command(command) => self.propose(command).await,
            MonRequest::Status => MonReply::Status(self.status()),
            MonRequest::Watch {
                image,
                watcher,
                present,
            } => {
                let now = Instant::now();
                self.lock().watchers.heard(image, watcher, present, now);
                MonReply::Ok
            }
            MonRequest::Watchers { image } => self.watchers(image).await,
            MonRequest::GetMap { .. } => unreachable!("answered above"),
        };
        Some(reply.to_message())
    }

    async fn heartbeat(&self, osd: OsdId, report: OsdReport) -> MonReply {
        // An OSD's first heartbeats, before its core has looked at its log (epoch 0), say
        // nothing of it.
        let full = (report.epoch != Epoch(0)).then_some(report.full);
        let (back_up, full_changed) = {
            let mut state = self.lock();
            let Some(entry) = state.map.osds.get(&osd).cloned() else {
                if state.map.removed.contains_key(&osd) {
                    return MonReply::Error(format!("{osd} was removed from the cluster"));
                }
                return MonReply::Error(format!("{osd} is not in the map; boot first"));
            };
            let now = Instant::now();
            state.liveness.heartbeat(osd, now);
            let old = state.reports.remove(&osd);
            let checksum_errors = old
                .as_ref()
                .map_or_else(ChecksumErrors::default, |old| old.checksum_errors);
            let checksum_errors =
                checksum_errors.update(old.as_ref().map(|old| &old.report), &report, now);
            let previous = old.map(|old| (old.at, old.report));
            state.reports.insert(
                osd,
                Report {
                    at: now,
                    report,
                    previous,
                    checksum_errors,
                },
            );
            let full_changed = full.filter(|full| *full != entry.full);
            ((!entry.up).then_some(entry), full_changed)
        };
        if let Some(entry) = back_up {
            // Back from down: marked up (and in) again, as a boot would.
            let command = Command::OsdBoot {
                uuid: entry.uuid,
                host: entry.host,
                address: entry.address,
                weight: entry.weight,
            };
            match self.propose(command).await {
                MonReply::Applied { .. } => {}
                other => return other,
            }
        }
        if let Some(full) = full_changed {
            if full {
                tracing::warn!(%osd, "osd full: the leaders of its pgs refuse writes");
            } else {
                tracing::info!(%osd, "osd no longer full");
            }
            match self.propose(Command::OsdFull { id: osd, full }).await {
                MonReply::Applied { .. } => {}
                other => return other,
            }
        }
        MonReply::Ok
    }

    /// [`MonRequest::Watchers`]: once this monitor has led for [`WATCH_TTL`] in one raft
    /// term, so that every watcher has told it of itself since it leads ("ask again" if
    /// its lead ended or began anew meanwhile).
    async fn watchers(&self, image: ImageId) -> MonReply {
        let since = self.lock().leading_since;
        let led =
            |since: Option<(Instant, u64)>| since.map_or(Duration::ZERO, |(at, _)| at.elapsed());
        tokio::time::sleep(WATCH_TTL.saturating_sub(led(since))).await;
        let state = self.lock();
        if !self.is_leader() || led(state.leading_since) < WATCH_TTL {
            return MonReply::unavailable("the monitors' leader is new: ask again");
        }
        MonReply::Watchers(state.watchers.of(image, Instant::now()))
    }

    fn status(&self) -> ClusterStatus {
        let state = self.lock();
        let mut ops = (0.0, 0.0);
        let mut bytes = (0.0, 0.0);
        let mut reports = Vec::new();
        let now = Instant::now();
        for (&osd, report) in &state.reports {
            if !state.map.osds.get(&osd).is_some_and(|entry| entry.up) {
                continue;
            }
            if let Some((at, previous)) = &report.previous {
                let seconds = report.at.duration_since(*at).as_secs_f64().max(1e-3);
                let rate = |now: u64, then: u64| now.saturating_sub(then) as f64 / seconds;
                ops.0 += rate(report.report.reads, previous.reads);
                ops.1 += rate(report.report.writes, previous.writes);
                bytes.0 += rate(report.report.read_bytes, previous.read_bytes);
                bytes.1 += rate(report.report.write_bytes, previous.write_bytes);
            }
            reports.push((
                osd,
                report.checksum_errors.apply(report.report.clone(), now),
            ));
        }
        let in_quorum = |rank: &usize| {
            *rank == self.rank
                || state
                    .heard
                    .get(rank)
                    .is_some_and(|at| now.saturating_duration_since(*at) <= QUORUM_HEARD_WITHIN)
        };
        ClusterStatus {
            map: state.map.clone(),
            monitors: self.peers.iter().map(ToString::to_string).collect(),
            quorum: (0..self.peers.len())
                .filter(in_quorum)
                .map(|rank| self.peers[rank].to_string())
                .collect(),
            leader: self.peers[self.rank].to_string(),
            reports,
            ops_per_second: ops,
            bytes_per_second: bytes,
        }
    }

    /// The leader marks OSDs down or out as their heartbeats stop.
    async fn check_liveness(&self) {
        let verdicts = {
            let mut state = self.lock();
            let lead = state.leading_since.map(|(_, term)| term);
            if lead.is_some() && lead != state.liveness_term {
                // A new leader gives every up OSD a grace from now to report in.
                let now = Instant::now();
                let up: Vec<OsdId> = state
                    .map
                    .osds
                    .values()
                    .filter(|o| o.up)
                    .map(|o| o.id)
                    .collect();
                for osd in up {
                    state.liveness.heartbeat(osd, now);
                }
            }
            state.liveness_term = lead;
            if lead.is_none() {
                return;
            }
            state.watchers.prune(Instant::now());
            let mut verdicts = state.liveness.check(Instant::now());
            // An OSD removed from the map is no longer watched.
            verdicts.retain(|verdict| {
                let (Verdict::Down(id) | Verdict::Out(id)) = *verdict;
                let known = state.map.osds.contains_key(&id);
                if !known {
                    state.liveness.forget(id);
                }
                known
            });
            verdicts
        };
        for verdict in verdicts {
            let command = match verdict {
                Verdict::Down(id) => {
                    tracing::warn!(%id, "no heartbeat within the grace: marking it down");
                    Command::OsdDown { id }
                }
                Verdict::Out(id) => {
                    tracing::warn!(%id, "down past the down-out interval: marking it out");
                    Command::OsdOut { id, auto: true }
                }
            };
            match self.propose(command).await {
                MonReply::Applied { .. } => {}
                other => tracing::error!(?other, "cannot apply a liveness verdict"),
            }
        }
    }
    fn render_metrics(&self) -> String {
        let state = self.lock();
        let map = &state.map;
        let mut e = Exposition::new();
        e.single(
            "basalt_mon_epoch",
            "gauge",
            "The cluster map's epoch.",
            map.epoch.0 as f64,
        );
        let count = |f: &dyn Fn(&crate::map::OsdEntry) -> bool| {
            map.osds.values().filter(|osd| f(osd)).count() as f64
        };
        e.single(
            "basalt_osds",
            "gauge",
            "OSDs in the map.",
            map.osds.len() as f64,
        );
        e.single("basalt_osds_up", "gauge", "OSDs up.", count(&|osd| osd.up));
        e.single(
            "basalt_osds_in",
            "gauge",
            "OSDs in.",
            count(&|osd| osd.is_in),
        );
        e.single("basalt_pools", "gauge", "Pools.", map.pools.len() as f64);
        e.single("basalt_images", "gauge", "Images.", map.images.len() as f64);
        let pgs: u64 = map
            .pools
            .values()
            .map(|pool| u64::from(pool.pg_count))
            .sum();
        e.single("basalt_pgs", "gauge", "PGs in all pools.", pgs as f64);
        let used: u64 = state.reports.values().map(|r| r.report.used_bytes).sum();
        let capacity: u64 = state
            .reports
            .values()
            .map(|r| r.report.capacity_bytes)
            .sum();
        e.single(
            "basalt_used_bytes",
            "gauge",
            "Bytes used on the OSDs' devices.",
            used as f64,
        );
        e.single(
            "basalt_capacity_bytes",
            "gauge",
            "Bytes of the OSDs' devices.",
            capacity as f64,
        );
        e.finish()
    }
}

/// The raft side of a monitor: owns the group, the journal and the proposals in flight.
struct Core {
    monitor: Arc<Monitor>,
    raft: MultiRaft,
    journal: Journal,
    /// The data directory, this process's while the core runs.
    _claim: basalt_io::device::Claim,
    /// [`MonConfig::max_pgs_per_osd`].
    max_pgs_per_osd: u32,
    proposals: HashMap<u64, (u64, oneshot::Sender<MonReply>)>,
    peers: HashMap<OsdId, mpsc::UnboundedSender<RaftMessage>>,
    leader: watch::Sender<Option<usize>>,
}

impl Core {
    fn send(&self, to: OsdId, message: RaftMessage) {
        if let Some(peer) = self.peers.get(&to) {
            let _ = peer.send(message);
        }
    }

    fn handle(&mut self, event: Event) {
        match event {
            Event::Raft(message) => {
                // The monitors are a fixed set (raft ids 1 to n): a sender outside it is
                // no monitor of ours, and a leader outside it would have no address.
                let monitors = self.monitor.peers.len() as u64;
                if (1..=monitors).contains(&message.from) {
                    self.raft.step(MON_GROUP, message);
                }
            }
            Event::Propose { command, reply } => {
                // Checked here, before the command goes in the log, not when it applies.
                let refusal = self
                    .monitor
                    .lock()
                    .map
                    .refusal(&command, self.max_pgs_per_osd);
                if let Some(refusal) = refusal {
                    let _ = reply.send(MonReply::Error(refusal));
                    return;
                }
                let data = serde_json::to_vec(&command).expect("commands encode");
                match self.raft.propose(MON_GROUP, data) {
                    Ok(()) => {
                        let index = self.raft.last_index(MON_GROUP).unwrap_or(0);
                        let term = self.raft.term(MON_GROUP).unwrap_or(0);
                        self.proposals.insert(index, (term, reply));
                    }
                    Err(error) => {
                        let _ = reply.send(MonReply::unavailable(format!(
                            "the monitor cannot propose: {error}"
                        )));
                    }
                }
            }
        }
    }

    fn drive(&mut self) -> std::io::Result<()> {
        let mut actions = Vec::new();
        self.raft.collect(&mut actions);
        for action in actions {
            match action {
                Action::Send { to, message, .. } => self.send(to, message),
                Action::Persist {
                    entries,
                    hard_state,
                    number,
                    then_send,
                    ..
                } => {
                    self.journal.append(&entries, hard_state.as_ref())?;
                    self.raft.on_persisted(MON_GROUP, number);
                    for (to, message) in then_send {
                        self.send(to, message);
                    }
                }
                Action::ReadIndex { .. } => {}
                Action::Apply { entries, .. } => {
                    for entry in entries {
                        let proposal = self.proposals.remove(&entry.index);
                        if entry.data.is_empty() {
                            continue;
                        }
                        let reply = match serde_json::from_slice::<Command>(&entry.data) {
                            Ok(command) => self.apply(&command),
                            Err(error) => {
                                MonReply::Error(format!("undecodable command in the log: {error}"))
                            }
                        };
                        if let Some((term, answer)) = proposal {
                            let reply = if term == entry.term {
                                reply
                            } else {
                                MonReply::unavailable("leadership changed; the change was not made")
                            };
                            let _ = answer.send(reply);
                        }
                    }
                }
            }
        }
        let leader = self.raft.leader(MON_GROUP).map(|osd| osd.0 as usize);
        // A lead of its own begins (or begins anew, in a later term): image watchers have
        // WATCH_TTL to tell this monitor of themselves.
        let term = self.raft.term(MON_GROUP).unwrap_or(0);
        let leads = leader == Some(self.monitor.rank);
        {
            let mut state = self.monitor.lock();
            match state.leading_since {
                Some((_, since_term)) if leads && since_term == term => {}
                _ if leads => {
                    state.leading_since = Some((Instant::now(), term));
                    state.watchers = ImageWatchers::default();
                }
                _ => state.leading_since = None,
            }
        }
        self.leader.send_if_modified(|current| {
            let changed = *current != leader;
            *current = leader;
            changed
        });
        Ok(())
    }

    fn apply(&self, command: &Command) -> MonReply {
        let mut state = self.monitor.lock();
        match state.map.apply(command) {
            Ok(changed) => {
                if changed {
                    tracing::info!(epoch = state.map.epoch.0, ?command, "map changed");
                    self.monitor.maps.send_replace(Arc::new(state.map.clone()));
                }
                MonReply::Applied {
                    changed,
                    epoch: state.map.epoch,
                }
            }
            Err(error) => MonReply::Error(error.to_string()),
        }
    }
}

/// A peer monitor's sending task: connects on demand and drops what it cannot deliver.
fn spawn_peer(address: SocketAddr) -> mpsc::UnboundedSender<RaftMessage> {
    let (queue, mut messages) = mpsc::unbounded_channel::<RaftMessage>();
    tokio::spawn(async move {
        let mut connection: Option<Client> = None;
        let mut failed_at: Option<tokio::time::Instant> = None;
        while let Some(message) = messages.recv().await {
            if connection.is_none() {
                if failed_at.is_some_and(|at| at.elapsed() < Duration::from_millis(200)) {
                    continue;
                }
                match tokio::time::timeout(Duration::from_secs(1), Client::connect(address)).await {
                    Ok(Ok(client)) => connection = Some(client),
                    _ => {
                        failed_at = Some(tokio::time::Instant::now());
                        continue;
                    }
                }
            }
            let wire = Message::Raft {
                pg: MON_GROUP,
                message: encode_message(&message),
            };
            if connection.as_ref().is_some_and(|c| c.send(&wire).is_err()) {
                connection = None;
            }
        }
    });
    queue
}

/// Starts a monitor: replays its journal, listens, and joins the monitors' raft group.
pub async fn start(config: MonConfig) -> Result<Running, MonError> {
    std::fs::create_dir_all(&config.data_dir).map_err(io_error(&config.data_dir))?;
    let mut peers = config.peers.clone();
    if peers.is_empty() {
        peers.push(config.listen);
    }
    peers.sort();
    peers.dedup();
    let rank = peers
        .iter()
        .position(|peer| *peer == config.listen)
        .ok_or_else(|| {
            MonError::Config(format!(
                "--listen {} is not one of the monitors given with --peers ({})",
                config.listen,
                peers
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(",")
            ))
        })?;
    let claim =
        basalt_io::device::claim_dir(&config.data_dir).map_err(io_error(&config.data_dir))?;
    let journal_path = config.data_dir.join(JOURNAL_FILE);
    let (journal, restored): (Journal, Restored) =
        Journal::open(&journal_path).map_err(io_error(&journal_path))?;
    tracing::info!(entries = restored.entries.len(), "journal replayed");
    let members: Vec<OsdId> = (0..peers.len()).map(|rank| OsdId(rank as u32)).collect();
    // Only election timeouts depend on it: distinct per process and rank is enough.
    let seed = u64::from(std::process::id()) ^ ((rank as u64) << 32);
    let mut raft = MultiRaft::new(OsdId(rank as u32), seed);
    raft.create_group(MON_GROUP, &members, restored)
        .map_err(|error| MonError::Config(format!("the journal does not restore: {error}")))?;

    let (events, mut inbox) = mpsc::unbounded_channel();
    let (leader_sender, leader) = watch::channel(None);
    let (maps, _) = watch::channel(Arc::new(ClusterMap::new()));
    let monitor = Arc::new(Monitor {
        state: Mutex::new(State {
            map: ClusterMap::new(),
            liveness: Liveness::new(config.grace, config.down_out_interval),
            reports: BTreeMap::new(),
            liveness_term: None,
            heard: BTreeMap::new(),
            leading_since: None,
            watchers: ImageWatchers::default(),
        }),
        maps,
        events,
        leader,
        rank,
        peers: peers.clone(),
        forward: tokio::sync::Mutex::new(None),
    });
    let handler_monitor = monitor.clone();
    let handler: Handler =
        Arc::new(move |message| Box::pin(handler_monitor.clone().handle(message)));
    let server = Server::bind(config.listen, handler)
        .await
        .map_err(|source| MonError::Listen {
            address: config.listen,
            source,
        })?;
    let address = server.address();

    let mut core = Core {
        monitor: monitor.clone(),
        raft,
        journal,
        _claim: claim,
        max_pgs_per_osd: config.max_pgs_per_osd,
        proposals: HashMap::new(),
        peers: peers
            .iter()
            .enumerate()
            .filter(|(r, _)| *r != rank)
            .map(|(r, address)| (OsdId(r as u32), spawn_peer(*address)))
            .collect(),
        leader: leader_sender,
    };
    let journal_display = journal_path.display().to_string();
    let mut tasks = vec![tokio::spawn(async move {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                event = inbox.recv() => {
                    let Some(event) = event else { return };
                    core.handle(event);
                    while let Ok(event) = inbox.try_recv() {
                        core.handle(event);
                    }
                }
                _ = ticker.tick() => core.raft.tick(),
            }
            if let Err(error) = core.drive() {
                tracing::error!(journal = %journal_display, %error, "cannot write the journal; the monitor stops");
                std::process::exit(1);
            }
        }
    })];
    let checker = monitor.clone();
    tasks.push(tokio::spawn(async move {
        let mut interval = tokio::time::interval(CHECK_INTERVAL);
        loop {
            interval.tick().await;
            checker.check_liveness().await;
        }
    }));
    let mut metrics_address = None;
    if let Some(address) = config.metrics_addr {
        let rendering = monitor.clone();
        let (bound, task) = metrics::serve(address, Arc::new(move || rendering.render_metrics()))
            .await
            .map_err(|source| MonError::Listen { address, source })?;
        metrics_address = Some(bound);
        tasks.push(task);
    }
    tracing::info!(%address, rank, monitors = peers.len(), "monitor started");
    Ok(Running {
        monitor,
        address,
        metrics_address,
        _server: server,
        tasks,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watcher counts while heard from within WATCH_TTL; one that said it stopped does
    /// not, nor does its renewal that arrives after that; other images' watchers never.
    #[test]
    fn image_watchers_count_while_they_renew_and_not_after_they_stop() {
        let start = Instant::now();
        let at = |seconds| start + Duration::from_secs(seconds);
        let (image, other) = (ImageId(1), ImageId(2));
        let mut watchers = ImageWatchers::default();
        watchers.heard(image, "a".into(), true, at(0));
        watchers.heard(image, "b".into(), true, at(0));
        watchers.heard(other, "c".into(), true, at(0));
        assert_eq!(watchers.of(image, at(1)), vec!["a", "b"]);
        // "a" stops; its renewal sent before comes after.
        watchers.heard(image, "a".into(), false, at(2));
        watchers.heard(image, "a".into(), true, at(2));
        assert_eq!(watchers.of(image, at(2)), vec!["b"]);
        // "b" renews no more: gone after WATCH_TTL.
        let ttl = WATCH_TTL.as_secs();
        assert_eq!(watchers.of(image, at(ttl)), vec!["b"]);
        assert!(watchers.of(image, at(ttl + 1)).is_empty());
        assert_eq!(watchers.of(other, at(1)), vec!["c"]);
        // Pruned, the stop of "a" is forgotten too: "a" may watch again.
        watchers.prune(at(3 + ttl));
        assert!(watchers.0.is_empty());
        watchers.heard(image, "a".into(), true, at(3 + ttl));
        assert_eq!(watchers.of(image, at(3 + ttl)), vec!["a"]);
    }

    fn report(checksum_errors: u64, age: Option<u64>) -> OsdReport {
        OsdReport {
            checksum_errors,
            last_checksum_error_age_seconds: age,
            ..OsdReport::default()
        }
    }

    /// An OSD that restarts with the count its data directory kept, short of the last
    /// second's errors, or whole: the monitor adds only what the count lost.
    #[test]
    fn checksum_errors_kept_by_the_osd_are_not_counted_twice() {
        let start = Instant::now() + Duration::from_secs(100);
        let at = |seconds| start + Duration::from_secs(seconds);
        let first = report(5, Some(1));
        let known = ChecksumErrors::default().update(None, &first, at(0));
        // Restarted with the count its file kept, one short of what it had reported.
        let restarted = report(4, Some(3));
        let known = known.update(Some(&first), &restarted, at(2));
        assert_eq!(known.apply(restarted.clone(), at(2)).checksum_errors, 5);
        // Restarted with its count kept whole: nothing added.
        let whole = report(4, Some(5));
        let known = known.update(Some(&restarted), &whole, at(4));
        assert_eq!(known.apply(whole, at(4)).checksum_errors, 5);
    }

    /// An OSD that restarts reports no damage any more (its file lost: its counts start
    /// again); the monitor keeps what it heard before, and adds what comes after.
    #[test]
    fn checksum_errors_are_kept_through_an_osd_restart() {
        let start = Instant::now() + Duration::from_secs(100);
        let at = |seconds| start + Duration::from_secs(seconds);
        let first = report(2, Some(10));
        let known = ChecksumErrors::default().update(None, &first, at(0));
        assert_eq!(known.apply(first.clone(), at(0)), first);
        // Restarted: nothing of its own to say.
        let restarted = report(0, None);
        let known = known.update(Some(&first), &restarted, at(5));
        assert_eq!(known.apply(restarted.clone(), at(5)), report(2, Some(15)));
        // A new one since the restart.
        let again = report(1, Some(0));
        let known = known.update(Some(&restarted), &again, at(20));
        assert_eq!(known.apply(again.clone(), at(30)), report(3, Some(10)));
        // And the next heartbeat, with nothing new.
        let known = known.update(Some(&again), &report(1, Some(12)), at(32));
        assert_eq!(
            known.apply(report(1, Some(12)), at(32)),
            report(3, Some(12))
        );
    }
}
