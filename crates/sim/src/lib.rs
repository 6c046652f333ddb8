//! Deterministic simulation of Basalt's replication layer (STYLE.md §9).
//!
//! Several OSDs, each with a [`MultiRaft`] hosting every PG, run in one thread on a seeded
//! generator. Production code runs; only its surroundings are simulated:
//!
//! - **Disk**: a persist completes a few steps after it is issued, in order, those issued
//!   while a write is under way together in the next one (group commit); a crash loses
//!   every persist still in flight (a torn tail), never one already complete.
//! - **Network**: every message is delayed by a random number of steps (so messages
//!   reorder), some are lost, and for a while one OSD may be cut off from the others.
//! - **Crashes**: an OSD loses all volatile state and restarts later from its durable
//!   records, as the real OSD replays its log.
//! - **Orderly stops**: half the crashes are stops as the OSD's SIGTERM: the OSD hands the
//!   PGs it leads over ([`MultiRaft::give_up_leadership`]; it never campaigns again nor
//!   takes a hand-over, but votes), until it leads none or its time is out, then crashes.
//! - **Pauses**: an OSD stops for a while (its clock does not tick, nothing reaches it);
//!   when it goes on, clients reach it before the messages sent to it meanwhile do.
//! - **Clients**: write proposals go to the OSD that believes it leads the PG; a write is
//!   acknowledged when that OSD applies it. Reads go to an OSD that believes it leads the PG
//!   and are served as the OSDs serve them ([`MultiRaft::read`]: under the leader's lease,
//!   or once a quorum confirmed the leadership), when that OSD has applied up to the
//!   read's index; a simulated clock (a step is a tenth of a tick) measures the leases.
//!   Every read must see every write acknowledged before it started: a stale read fails
//!   the run.
//! - **Checkpoints and snapshots**: now and then an OSD cuts a checkpoint as the OSD does
//!   ([`reclaim::compaction_point`] and [`reclaim::pg_checkpoint`], with a short retention):
//!   raft logs are compacted, and once the checkpoint is durable (a crash before loses it)
//!   the records before it are dropped. A restart replays the last durable checkpoint and
//!   the records after it with the OSD's own [`pg_log::restore`]. A follower sent a snapshot
//!   fetches the PG's state from its leader (a copy as of the leader's applied index, at or
//!   after the snapshot's, as the OSD's fuzzy copy), steps the message into raft, and
//!   installs the copy when the persist that records it is durable; raft then applies the
//!   entries after the snapshot again, and each must equal what the copy holds at its index.
//!   A leader whose follower stops fetching counts the snapshot failed after a silence.
//! - **Damage and repairs**: now and then a voter's copy of a PG loses a write (its device
//!   damaged it; the damage survives crashes until a snapshot replaces the copy). The OSD
//!   never serves a damaged copy (reads there are dropped, a snapshot is not fetched from
//!   it) and repairs it as the OSD does: a leader hands leadership over, a follower asks
//!   its leader for a snapshot ([`MultiRaft::request_snapshot`]) and installs it however
//!   recent its log; restarted, it is held back from campaigning for a while
//!   ([`MultiRaft::hold_back`]), as an OSD whose replay met damage. Half the damage is to
//!   the payload of the last write of a raft log not applied yet: the replica cannot send
//!   it (its hydrate fails, as the OSD's does on a block failing its checksum), so that,
//!   leading, it hands over or steps down ([`MultiRaft::step_down`]) as the OSD's repairs
//!   do. A copy never repaired differs from the others at the end.
//! - **Membership**: every OSD hosts every PG, which starts on the first few; now and then a
//!   PG's target members change (as the monitors' map would when OSDs go out or come in)
//!   and its leader moves the voters there ([`MultiRaft::reconfigure`]).
//!
//! At the end every fault is healed and the run continues until each PG's voters are its
//! target members and agree. Then: every acknowledged write is in its PG's applied log, the
//! voters applied exactly the same entries, and any other replica a prefix of them. A failure names its seed; `cargo run -p basalt-sim --
//! --seed N` replays it.

use std::collections::{BTreeMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use basalt_common::{Lsn, OsdId, PgId, PoolId};
use basalt_osd::reclaim::{self, Durable, Retention};
use basalt_osd::{pg_log, snapshot};
use basalt_replication::multi_raft::ELECTION_TICKS;
use basalt_replication::{
    Action, HardState, MultiRaft, PayloadUnavailable, RaftEntry, RaftMessage, ReadStart,
    quorum_without,
};
use basalt_store::batch::{Entry, META_SIZE};
use basalt_store::checkpoint::Checkpoint;
use basalt_store::log::ReplayedBatch;

/// Simulation steps per raft tick.
const STEPS_PER_TICK: u64 = 10;
/// Steps of the simulation in `duration` of the OSD's time (counted in its ticks).
const fn steps_of(duration: Duration) -> u64 {
    duration.as_millis() as u64 / basalt_osd::daemon::TICK.as_millis() as u64 * STEPS_PER_TICK
}
/// How long a replica under repair of damage in its raft log leads before it steps down
/// (the OSD's `STEP_DOWN_AFTER`), in steps.
const STEP_DOWN_STEPS: u64 = steps_of(basalt_osd::daemon::STEP_DOWN_AFTER);
/// A simulation step on the clock that measures leases (a tick is 100 ms, as in the OSD).
const STEP: Duration = Duration::from_millis(10);
/// How long an orderly stop waits for its hand-overs (the OSD's `STOP_HAND_OVER`), in
/// steps.
const STOP_STEPS: u64 = steps_of(basalt_osd::daemon::STOP_HAND_OVER);
/// Ticks after which a leader counts a snapshot failed if its follower has not fetched any
/// of it (the OSD's 30 s).
const SNAPSHOT_SILENCE_TICKS: u64 = 300;

/// What one run does.
#[derive(Debug, Clone)]
pub struct SimConfig {
    /// The seed; the whole run follows from it.
    pub seed: u64,
    /// OSDs (every PG has a replica on each).
    pub osds: u32,
    /// Members of each PG: the first OSDs at the start.
    pub members: u32,
    /// Chance per step of a new target membership for a random PG.
    pub reconfigure: f64,
    /// PGs.
    pub pgs: u32,
    /// Steps with faults and client writes, before healing.
    pub steps: u64,
    /// Steps allowed for the healed cluster to converge.
    pub settle_steps: u64,
    /// Chance per message of being lost.
    pub loss: f64,
    /// Longest message delay, in steps.
    pub delay_max: u64,
    /// Longest persist, in steps.
    pub persist_max: u64,
    /// Chance per step of a crash (of a random up OSD).
    pub crash: f64,
    /// Chance per step of cutting a random OSD off.
    pub partition: f64,
    /// Chance per step of pausing a random OSD.
    pub pause: f64,
    /// Chance per step of a client write.
    pub write: f64,
    /// Chance per step of a client read.
    pub read: f64,
    /// Chance per step, per OSD, of cutting a checkpoint.
    pub checkpoint: f64,
    /// Entries a checkpoint keeps behind the applied index (the OSD's retention).
    pub retained_entries: usize,
    /// Entries a leader keeps for a follower it knows to be behind (one further behind
    /// gets a snapshot).
    pub behind_entries: u64,
    /// Chance per step of damage to a voter's copy of a PG.
    pub damage: f64,
    /// Halfway through the faults (once no copy is damaged), one OSD is lost for good (it
    /// never restarts), and every PG's target members leave it, as the monitors' map would
    /// once it is marked out; no copy of a PG is damaged while the lost OSD is still one of
    /// its voters. Damage with the only other good copy lost is lost data, not a fault the
    /// replication could survive.
    pub lose_osd: bool,
    /// With [`SimConfig::lose_osd`], a second OSD is lost at the same step: PGs that had
    /// both as voters may be left without a quorum, and writes acknowledged with copies on
    /// the two alone are lost with them (the final check spares those; see
    /// [`Outcome::forgone`]).
    pub lose_two: bool,
}

impl SimConfig {
    /// The default mix of faults for `seed`.
    pub fn new(seed: u64) -> Self {
        Self {
            seed,
            osds: 4,
            members: 3,
            reconfigure: 0.0005,
            pgs: 4,
            steps: 20_000,
            settle_steps: 50_000,
            loss: 0.02,
            delay_max: 8,
            persist_max: 6,
            crash: 0.0004,
            partition: 0.0003,
            pause: 0.0003,
            write: 0.1,
            read: 0.5,
            checkpoint: 0.002,
            retained_entries: 8,
            behind_entries: 16,
            damage: 0.0003,
            lose_osd: false,
            lose_two: false,
        }
    }

    /// A harsher run: `osds` OSDs, `pgs` PGs, and the chances of crashes, partitions,
    /// pauses, damage and membership changes multiplied by `faults`.
    pub fn harsher(mut self, osds: u32, pgs: u32, faults: f64) -> Self {
        self.osds = osds;
        self.pgs = pgs;
        self.crash *= faults;
        self.partition *= faults;
        self.pause *= faults;
        self.damage *= faults;
        self.reconfigure *= faults;
        self
    }
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Writes proposed.
    pub proposed: u64,
    /// Writes acknowledged.
    pub acknowledged: u64,
    /// Crashes.
    pub crashes: u64,
    /// Partitions.
    pub partitions: u64,
    /// Pauses.
    pub pauses: u64,
    /// Steps until the healed cluster agreed.
    pub settle_steps: u64,
    /// Target membership changes.
    pub reconfigurations: u64,
    /// Reads served.
    pub reads: u64,
    /// Of them, reads served under a lease (no quorum asked).
    pub lease_reads: u64,
    /// Checkpoints made durable.
    pub checkpoints: u64,
    /// Restarts from a checkpoint.
    pub checkpoint_restarts: u64,
    /// Snapshots installed.
    pub snapshots: u64,
    /// Copies damaged.
    pub damaged: u64,
    /// Of those, damage to the payload of an entry of a raft log not applied yet.
    pub log_damaged: u64,
    /// Damaged leaders that stepped down, no other replica having taken the PG over.
    pub step_downs: u64,
    /// Damaged copies replaced by a snapshot of the leader's.
    pub repairs: u64,
    /// Orderly stops begun (each ends in a crash, counted in `crashes`).
    pub stops: u64,
    /// Of them, stops of an OSD that led PGs then.
    pub stops_leading: u64,
    /// Stops that ended with every PG handed over (before their time was out).
    pub stops_handed_over: u64,
    /// OSDs lost for good ([`SimConfig::lose_osd`]), and the PGs that had to leave them.
    pub lost: (u64, u64),
    /// Replicas that gave up raft log entries they could not send, as the operator asked
    /// (`basalt pg mark-unfound-lost`) of PGs the healed cluster left without a leader
    /// for [`OPERATOR_AFTER`] steps.
    pub conceded: u64,
    /// PGs whose surviving replica with the most of the log was made their only voter, as
    /// the operator asked (`basalt pg force-quorum`) of PGs the healed cluster left without
    /// a leader for [`OPERATOR_AFTER`] steps with voters lost for good.
    pub forced: u64,
    /// Acknowledged writes lost with the OSDs lost for good: no surviving replica held
    /// them when the operator forced a quorum ([`SimConfig::lose_two`]).
    pub forgone: u64,
    /// Acknowledged writes whose data the replica made the only voter held past the end of
    /// its log, from a snapshot's fuzzy copy: entries of its own term take their indexes,
    /// and the OSD keeps their data in its objects, outside any entry.
    pub carried: u64,
}

/// Steps of the healed cluster for which a PG has had no leader before the operator has
/// its replicas give up the entries they cannot send (`MultiRaft::concede`), and again as
/// many steps later.
pub const OPERATOR_AFTER: u64 = 10_000;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn below(&mut self, bound: u64) -> u64 {
        self.next() % bound.max(1)
    }

    fn chance(&mut self, probability: f64) -> bool {
        ((self.next() >> 11) as f64 / (1u64 << 53) as f64) < probability
    }
}

/// A persist in flight, or on the durable record list.
#[derive(Clone)]
struct Record {
    pg: PgId,
    entries: Vec<RaftEntry>,
    hard_state: Option<HardState>,
    number: u64,
    then_send: Vec<(OsdId, RaftMessage)>,
    /// The snapshot this persist installs.
    snapshot: Option<Installed>,
    /// The last index it makes durable ([`Durable::persisting`]).
    last_index: Option<u64>,
    /// The group commit that made it durable (the step it completed at).
    group: u64,
}

impl Record {
    /// The record as the OSD writes it to its log.
    fn log_entries(&self) -> Vec<Entry> {
        let mut log = Vec::new();
        if let Some(installed) = &self.snapshot {
            // The OSD writes the transfer's start with its first chunk; the sim's copy is
            // whole at once.
            log.push(Entry {
                kind: snapshot::SNAPSHOT_BEGIN,
                pg: self.pg,
                term: 0,
                index: 0,
                meta: [0; META_SIZE],
                data: Vec::new(),
            });
            log.push(snapshot::installed_entry(
                self.pg,
                installed.index,
                installed.term,
                installed.conf.clone(),
            ));
        }
        log.extend(pg_log::to_log_entries(
            self.pg,
            &self.entries,
            self.hard_state.as_ref(),
        ));
        log
    }
}

/// A PG's state in the simulation: the writes applied, by raft index.
type State = Vec<(u64, Vec<u8>)>;

/// A snapshot installed by a persist.
#[derive(Clone)]
struct Installed {
    index: u64,
    term: u64,
    /// The configuration as of it, encoded.
    conf: Vec<u8>,
    /// The leader's state, copied when fetched.
    state: State,
    leader: OsdId,
}

/// A snapshot a follower was sent and installs.
struct Installing {
    message: RaftMessage,
    leader: OsdId,
    index: u64,
    /// The step at which the follower fetches the state.
    fetch_at: u64,
    /// The leader's state, once fetched (until its persist is handed out).
    fetched: Option<State>,
    /// Raft has the message (the state was fetched).
    stepped: bool,
}

/// A checkpoint: the OSD's, and each PG's state as of it.
#[derive(Clone)]
struct SimCheckpoint {
    checkpoint: Checkpoint,
    states: BTreeMap<PgId, State>,
}

/// A checkpoint being written.
struct Cutting {
    durable_at: u64,
    /// The durable records it covers (the first ones).
    covers: usize,
    checkpoint: SimCheckpoint,
}

struct SimOsd {
    id: OsdId,
    raft: Option<MultiRaft>,
    /// The records written after the checkpoint, in order.
    durable: Vec<Record>,
    /// The last durable checkpoint.
    checkpoint: Option<SimCheckpoint>,
    cutting: Option<Cutting>,
    /// What of each PG's raft log is durable, as the OSD tracks it for checkpoints.
    durable_state: BTreeMap<PgId, Durable>,
    installing: BTreeMap<PgId, Installing>,
    /// Snapshots this OSD sent, and the step it last heard from their followers.
    snapshots_sent: BTreeMap<(PgId, OsdId), u64>,
    /// The PGs whose copy here is damaged (on the device: crashes keep it, and applying
    /// the write again after a restart reads the same damaged payload) until a snapshot's
    /// install replaces it, with the index of the write lost.
    damaged: BTreeMap<PgId, u64>,
    /// The data of entries of its raft logs whose payloads are damaged on the device (they
    /// cannot be sent: the OSD's hydrate fails), by PG, until a snapshot's install.
    unreadable: Arc<Mutex<BTreeMap<Vec<u8>, PgId>>>,
    /// PGs whose damage is in their raft log, which step down when they have led too long,
    /// as the OSD's repairs do, with the step from which this replica has led them.
    may_step_down: BTreeMap<PgId, Option<u64>>,
    /// Which hard states each PG's persists write (the OSD's rule).
    hard_states: BTreeMap<PgId, pg_log::HardStates>,
    in_flight: VecDeque<(u64, Record)>,
    applied: BTreeMap<PgId, State>,
    /// The index of the last entry applied (data or not), per PG.
    applied_index: BTreeMap<PgId, u64>,
    restart_at: Option<u64>,
    /// The step until which this OSD is paused.
    paused_until: Option<u64>,
    /// An orderly stop under way: the step by which it ends.
    stopping_until: Option<u64>,
    /// Lost for good ([`SimConfig::lose_osd`]): it never restarts.
    lost: bool,
}

/// A snapshot's install replaced an OSD's damaged copy of `pg`: its payloads (`unreadable`)
/// and its steps down (`may_step_down`) are forgotten.
fn repaired(
    unreadable: &Mutex<BTreeMap<Vec<u8>, PgId>>,
    may_step_down: &mut BTreeMap<PgId, Option<u64>>,
    pg: PgId,
) {
    let mut unreadable = unreadable.lock().expect("not poisoned");
    unreadable.retain(|_, of| *of != pg);
    may_step_down.remove(&pg);
}

impl SimOsd {
    /// The OSD's raft, if it is up and not paused.
    fn running(&mut self) -> Option<&mut MultiRaft> {
        if self.paused_until.is_some() {
            return None;
        }
        self.raft.as_mut()
    }
}

struct Cluster {
    config: SimConfig,
    rng: Rng,
    now: u64,
    osds: Vec<SimOsd>,
    pgs: Vec<PgId>,
    network: Vec<(u64, OsdId, OsdId, PgId, RaftMessage)>,
    isolated: Option<(OsdId, u64)>,
    faults: bool,
    next_write: u64,
    pending: BTreeMap<u64, (PgId, OsdId)>,
    /// Each PG's acknowledged writes, in the order they were acknowledged.
    acknowledged: BTreeMap<PgId, Vec<u64>>,
    /// Acknowledged writes the checks spare since a quorum was forced: lost with the OSDs
    /// lost for good ([`Outcome::forgone`]), or held by the replica made the only voter
    /// outside its log ([`Outcome::carried`]).
    spared: std::collections::BTreeSet<u64>,
    /// Each PG's target members.
    targets: BTreeMap<PgId, Vec<OsdId>>,
    next_read: u64,
    /// Reads waiting for a quorum's confirmation, by id.
    confirming: BTreeMap<u64, Read>,
    /// Reads waiting for their OSD to apply up to their index.
    waiting: Vec<(u64, Read)>,
    /// The first broken invariant seen while running (a stale read, an entry applied
    /// again that differs from a snapshot's copy).
    failure: Option<String>,
    /// The clock at step 0.
    epoch: Instant,
    outcome: Outcome,
}

/// A client read of a PG.
struct Read {
    pg: PgId,
    via: OsdId,
    /// How many of the PG's writes were acknowledged when the read started: it must see
    /// them all.
    acknowledged: usize,
    started: u64,
}

fn write_id(data: &[u8]) -> Option<u64> {
    let bytes: [u8; 8] = data.get(..8)?.try_into().ok()?;
    (data.len() == 8).then(|| u64::from_le_bytes(bytes))
}

impl Cluster {
    fn new(config: SimConfig) -> Self {
        let pgs: Vec<PgId> = (0..config.pgs)
            .map(|index| PgId {
                pool: PoolId(1),
                index,
            })
            .collect();
        let mut cluster = Self {
            rng: Rng(config.seed),
            now: 0,
            osds: Vec::new(),
            pgs,
            network: Vec::new(),
            isolated: None,
            faults: true,
            next_write: 1,
            pending: BTreeMap::new(),
            acknowledged: BTreeMap::new(),
            spared: std::collections::BTreeSet::new(),
            targets: BTreeMap::new(),
            next_read: 0,
            confirming: BTreeMap::new(),
            waiting: Vec::new(),
            failure: None,
            epoch: Instant::now(),
            outcome: Outcome::default(),
            config,
        };
        let initial = cluster.initial();
        for &pg in &cluster.pgs {
            cluster.targets.insert(pg, initial.clone());
        }
        for n in 0..cluster.config.osds {
            cluster.osds.push(SimOsd {
                id: OsdId(n),
                raft: None,
                durable: Vec::new(),
                checkpoint: None,
                cutting: None,
                durable_state: BTreeMap::new(),
                installing: BTreeMap::new(),
                snapshots_sent: BTreeMap::new(),
                damaged: BTreeMap::new(),
                unreadable: Arc::new(Mutex::new(BTreeMap::new())),
                may_step_down: BTreeMap::new(),
                hard_states: BTreeMap::new(),
                in_flight: VecDeque::new(),
                applied: BTreeMap::new(),
                applied_index: BTreeMap::new(),
                stopping_until: None,
                lost: false,
                restart_at: None,
                paused_until: None,
            });
        }
        for index in 0..cluster.osds.len() {
            cluster.start(index);
        }
        cluster
    }

    /// The members every PG starts with.
    fn initial(&self) -> Vec<OsdId> {
        (0..self.config.members.min(self.config.osds))
            .map(OsdId)
            .collect()
    }

    /// Notes the first broken invariant.
    fn fail(&mut self, failure: String) {
        self.failure.get_or_insert(failure);
    }

    /// (Re)starts an OSD from its last checkpoint and the records after it, as the OSD
    /// replays its log.
    fn start(&mut self, index: usize) {
        let members = self.initial();
        let seed = self.rng.next();
        let osd = &mut self.osds[index];
        let batches: Vec<ReplayedBatch> = osd
            .durable
            .iter()
            .enumerate()
            .map(|(n, record)| ReplayedBatch {
                lsn: Lsn(n as u64 + 1),
                position: 0,
                offset_bytes: 0,
                entries: record.log_entries().into_iter().map(|e| (e, 0)).collect(),
                damaged_entries: Vec::new(),
            })
            .collect();
        let checkpoint = osd.checkpoint.as_ref();
        let mut restored = pg_log::restore(checkpoint.map(|c| &c.checkpoint), &batches)
            .expect("the records the simulation wrote replay");
        if checkpoint.is_some() {
            self.outcome.checkpoint_restarts += 1;
        }
        // Each PG's state: the checkpoint's, or the last snapshot installed after it.
        let mut states = checkpoint.map(|c| c.states.clone()).unwrap_or_default();
        for record in &osd.durable {
            if let Some(installed) = &record.snapshot {
                states.insert(record.pg, installed.state.clone());
            }
        }
        let mut raft = MultiRaft::new(osd.id, seed);
        // As the OSDs run it.
        raft.set_lazy_commit(true);
        // Entries whose payloads are damaged here cannot be sent.
        let unreadable = osd.unreadable.clone();
        raft.set_hydrate(Arc::new(move |data: &[u8]| {
            let unreadable = unreadable.lock().expect("not poisoned");
            match unreadable.contains_key(data) {
                true => Err(PayloadUnavailable),
                false => Ok(None),
            }
        }));
        raft.set_lease(Some(
            STEP * STEPS_PER_TICK as u32 * ELECTION_TICKS as u32 / 2,
        ));
        osd.applied.clear();
        osd.applied_index.clear();
        osd.durable_state.clear();
        for &pg in &self.pgs {
            let group = restored.groups.remove(&pg).unwrap_or_default();
            osd.durable_state.insert(pg, Durable::restored(&group));
            osd.applied_index.insert(pg, group.applied);
            let mut state = states.remove(&pg).unwrap_or_default();
            if let Some(lost) = osd.damaged.get(&pg) {
                // The device still holds the damage.
                state.retain(|(at, _)| at != lost);
            }
            osd.applied.insert(pg, state);
            raft.create_group(pg, &members, group)
                .expect("a restored group starts");
            if osd.damaged.contains_key(&pg) {
                // As an OSD whose replay met the damage: the others elect one of them
                // first if they can.
                raft.hold_back(pg, basalt_osd::daemon::HELD_BACK_TICKS);
            }
        }
        osd.raft = Some(raft);
        osd.restart_at = None;
    }

    /// Crashes an OSD. The device may have made durable more than the OSD heard of: some of
    /// the group commits in flight (whole, in order: a torn one is discarded by replay),
    /// and the checkpoint being written.
    fn crash(&mut self, index: usize) {
        let restart = self.now + 200 + self.rng.below(2000);
        let groups: Vec<u64> = {
            let mut ats: Vec<u64> = self.osds[index]
                .in_flight
                .iter()
                .map(|(at, _)| *at)
                .collect();
            ats.dedup();
            ats
        };
        let kept_groups = self.rng.below(groups.len() as u64 + 1) as usize;
        let checkpoint_kept = self.rng.chance(0.5);
        let osd = &mut self.osds[index];
        if let Some(cutting) = osd.cutting.take()
            && checkpoint_kept
        {
            osd.durable.drain(..cutting.covers);
            osd.checkpoint = Some(cutting.checkpoint);
        }
        if let Some(&last) = groups[..kept_groups].last() {
            while osd.in_flight.front().is_some_and(|(at, _)| *at <= last) {
                let (_, mut record) = osd.in_flight.pop_front().expect("checked");
                // Durable, but nothing was sent after it.
                record.then_send.clear();
                if record.snapshot.is_some() && osd.damaged.remove(&record.pg).is_some() {
                    self.outcome.repairs += 1;
                    repaired(&osd.unreadable, &mut osd.may_step_down, record.pg);
                }
                osd.durable.push(record);
            }
        }
        osd.raft = None;
        osd.paused_until = None;
        osd.stopping_until = None;
        osd.in_flight.clear();
        osd.hard_states.clear();
        osd.installing.clear();
        osd.snapshots_sent.clear();
        osd.restart_at = Some(restart);
        self.pending.retain(|_, (_, via)| *via != osd.id);
        let id = osd.id;
        self.confirming.retain(|_, read| read.via != id);
        self.waiting.retain(|(_, read)| read.via != id);
        self.outcome.crashes += 1;
    }

    /// Begins an orderly stop of an OSD (unless one is under way).
    fn begin_stop(&mut self, index: usize) {
        let until = self.now + STOP_STEPS;
        let osd = &mut self.osds[index];
        if osd.stopping_until.is_some() {
            return;
        }
        let Some(raft) = osd.raft.as_mut() else {
            return;
        };
        osd.stopping_until = Some(until);
        self.outcome.stops += 1;
        if raft.give_up_leadership() > 0 {
            self.outcome.stops_leading += 1;
        }
    }

    /// Goes on with the orderly stops under way, at each tick: hand-overs again (raft gives
    /// one up after an election timeout); the OSD crashes once it leads no PG, or its time
    /// is out.
    fn advance_stops(&mut self) {
        let now = self.now;
        for index in 0..self.osds.len() {
            let osd = &mut self.osds[index];
            let Some(until) = osd.stopping_until else {
                continue;
            };
            let Some(raft) = osd.running() else {
                continue;
            };
            let led = raft.give_up_leadership();
            if led == 0 || now >= until {
                if led == 0 {
                    self.outcome.stops_handed_over += 1;
                }
                self.crash(index);
            }
        }
    }

    fn can_talk(&self, from: OsdId, to: OsdId) -> bool {
        match self.isolated {
            Some((cut, _)) => from != cut && to != cut,
            None => true,
        }
    }

    fn send(&mut self, from: OsdId, to: OsdId, pg: PgId, message: RaftMessage) {
        if self.faults && self.rng.chance(self.config.loss) {
            return;
        }
        let at = self.now + 1 + self.rng.below(self.config.delay_max);
        self.network.push((at, from, to, pg, message));
    }

    fn inject_faults(&mut self) {
        if let Some((_, until)) = self.isolated
            && self.now >= until
        {
            self.isolated = None;
        }
        if !self.faults {
            return;
        }
        // Once no copy is damaged (losing the other copies of a damaged one would be a
        // second fault).
        if self.config.lose_osd
            && self.now >= self.config.steps / 2
            && !self.osds.iter().any(|osd| osd.lost)
            && self.osds.iter().all(|osd| osd.damaged.is_empty())
        {
            self.lose_osd();
            if self.config.lose_two {
                self.lose_osd();
            }
        }
        if self.isolated.is_none() && self.rng.chance(self.config.partition) {
            let cut = OsdId(self.rng.below(u64::from(self.config.osds)) as u32);
            self.isolated = Some((cut, self.now + 500 + self.rng.below(3000)));
            self.outcome.partitions += 1;
        }
        if self.rng.chance(self.config.reconfigure) {
            let pg = self.pgs[self.rng.below(self.pgs.len() as u64) as usize];
            self.retarget(pg);
        }
        if self.rng.chance(self.config.pause) {
            let victim = self.rng.below(self.osds.len() as u64) as usize;
            let until = self.now + 100 + self.rng.below(1000);
            let osd = &mut self.osds[victim];
            if osd.raft.is_some() && osd.paused_until.is_none() {
                osd.paused_until = Some(until);
                self.outcome.pauses += 1;
            }
        }
        if self.rng.chance(self.config.crash) {
            let up: Vec<usize> = (0..self.osds.len())
                .filter(|&i| self.osds[i].raft.is_some())
                .collect();
            if !up.is_empty() {
                let victim = up[self.rng.below(up.len() as u64) as usize];
                if self.rng.chance(0.5) {
                    self.begin_stop(victim);
                } else {
                    self.crash(victim);
                }
            }
        }
    }

    /// New target members for `pg`, among the OSDs not lost.
    fn retarget(&mut self, pg: PgId) {
        let mut osds: Vec<OsdId> = self
            .osds
            .iter()
            .filter(|osd| !osd.lost)
            .map(|osd| osd.id)
            .collect();
        let mut target = Vec::new();
        while target.len() < self.config.members as usize && !osds.is_empty() {
            target.push(osds.remove(self.rng.below(osds.len() as u64) as usize));
        }
        self.targets.insert(pg, target);
        self.outcome.reconfigurations += 1;
    }

    /// Loses an OSD for good: it crashes and never restarts, and the PGs it was a target
    /// member of get others.
    fn lose_osd(&mut self) {
        let alive: Vec<usize> = (0..self.osds.len())
            .filter(|n| !self.osds[*n].lost)
            .collect();
        let victim = alive[self.rng.below(alive.len() as u64) as usize];
        if self.osds[victim].raft.is_some() {
            self.crash(victim);
        }
        let osd = &mut self.osds[victim];
        osd.lost = true;
        osd.restart_at = None;
        osd.stopping_until = None;
        let id = osd.id;
        let pgs: Vec<PgId> = self
            .targets
            .iter()
            .filter(|(_, target)| target.contains(&id))
            .map(|(pg, _)| *pg)
            .collect();
        self.outcome.lost.0 += 1;
        self.outcome.lost.1 += pgs.len() as u64;
        for pg in pgs {
            self.retarget(pg);
        }
    }

    fn propose_writes(&mut self) {
        if !self.faults || !self.rng.chance(self.config.write) {
            return;
        }
        let pg = self.pgs[self.rng.below(self.pgs.len() as u64) as usize];
        let Some(index) = self
            .osds
            .iter_mut()
            .position(|osd| osd.running().is_some_and(|raft| raft.is_leader(pg)))
        else {
            return;
        };
        let id = self.next_write;
        let osd = &mut self.osds[index];
        let raft = osd.running().expect("leader is up");
        if raft.propose(pg, id.to_le_bytes().to_vec()).is_ok() {
            self.next_write += 1;
            self.pending.insert(id, (pg, osd.id));
            self.outcome.proposed += 1;
        }
    }

    /// Starts a client read at an OSD that believes it leads the PG (any of them, if
    /// several do).
    fn start_reads(&mut self) {
        if !self.faults || !self.rng.chance(self.config.read) {
            return;
        }
        let pg = self.pgs[self.rng.below(self.pgs.len() as u64) as usize];
        // A damaged copy is never read (the OSD's checksums catch it).
        let leaders: Vec<usize> = (0..self.osds.len())
            .filter(|&i| {
                let osd = &mut self.osds[i];
                !osd.damaged.contains_key(&pg)
                    && osd.running().is_some_and(|raft| raft.is_leader(pg))
            })
            .collect();
        if leaders.is_empty() {
            return;
        }
        let index = leaders[self.rng.below(leaders.len() as u64) as usize];
        let read = Read {
            pg,
            via: self.osds[index].id,
            acknowledged: self.acknowledged.get(&pg).map_or(0, Vec::len),
            started: self.now,
        };
        let id = self.next_read;
        self.next_read += 1;
        let now = self.epoch + STEP * self.now as u32;
        let raft = self.osds[index].running().expect("a leader is up");
        match raft.read(pg, &id.to_le_bytes(), now) {
            ReadStart::At(at) => {
                self.outcome.lease_reads += 1;
                self.waiting.push((at, read));
            }
            ReadStart::Confirming => {
                self.confirming.insert(id, read);
            }
            ReadStart::Refused => {}
        }
    }

    /// Serves the reads whose OSD has applied up to their index, from what it applied.
    fn serve_reads(&mut self) {
        let osds = &self.osds;
        let (ready, waiting): (Vec<_>, Vec<_>) = std::mem::take(&mut self.waiting)
            .into_iter()
            .partition(|(at, read)| {
                osds[read.via.0 as usize]
                    .applied_index
                    .get(&read.pg)
                    .copied()
                    >= Some(*at)
            });
        self.waiting = waiting;
        for (at, read) in ready {
            if self.osds[read.via.0 as usize]
                .damaged
                .contains_key(&read.pg)
            {
                // Met the damage: answered Busy, and the client retries elsewhere.
                continue;
            }
            self.outcome.reads += 1;
            let seen: std::collections::BTreeSet<u64> = self.osds[read.via.0 as usize]
                .applied
                .get(&read.pg)
                .into_iter()
                .flatten()
                .filter(|(index, _)| *index <= at)
                .filter_map(|(_, data)| write_id(data))
                .collect();
            let acknowledged = self
                .acknowledged
                .get(&read.pg)
                .map_or(&[][..], |ids| &ids[..read.acknowledged]);
            let spared = &self.spared;
            if let Some(missed) = acknowledged
                .iter()
                .find(|id| !seen.contains(id) && !spared.contains(id))
            {
                self.fail(format!(
                    "pg {}: a read started at step {} and served by {} at index {at} misses \
                     write {missed}, acknowledged before it started",
                    read.pg, read.started, read.via
                ));
            }
        }
    }

    fn deliver_messages(&mut self) {
        let now = self.now;
        let osds = &self.osds;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.network)
            .into_iter()
            .partition(|m| m.0 <= now && osds[m.2.0 as usize].paused_until.is_none());
        self.network = later;
        for (_, from, to, pg, message) in due {
            if !self.can_talk(from, to) {
                continue;
            }
            if self.osds[to.0 as usize].running().is_some() {
                self.raft_message(to.0 as usize, pg, message);
            }
        }
    }

    /// A raft message reaches an up OSD. A snapshot that it needs is not stepped at once:
    /// the PG's state is fetched first, as the OSD does.
    fn raft_message(&mut self, index: usize, pg: PgId, message: RaftMessage) {
        let fetch_at = self.now + 1 + self.rng.below(4 * self.config.delay_max);
        let osd = &mut self.osds[index];
        let raft = osd.raft.as_mut().expect("the osd is up");
        let Some((snapshot_index, leader)) = MultiRaft::snapshot_of(&message) else {
            raft.step(pg, message);
            return;
        };
        if let Some(installing) = osd.installing.get(&pg) {
            if installing.stepped || message.term <= installing.message.term {
                // The leader waits for the one under way.
                return;
            }
            // A newer leader's snapshot replaces an older one's.
            osd.installing.remove(&pg);
        }
        // A replica that asked for a snapshot (a repair) fetches it however recent its log.
        let requesting = raft.requesting_snapshot(pg);
        let behind = requesting
            || raft
                .committed(pg)
                .is_some_and(|committed| committed < snapshot_index);
        if !behind || message.term < raft.term(pg).unwrap_or(0) {
            // Raft answers a snapshot it does not need, or a stale one, by itself.
            raft.step(pg, message);
            return;
        }
        if raft.refuses_snapshot(pg, &message) {
            // Raft would drop the entries after it, which this replica may have
            // acknowledged (see `MultiRaft::refuses_snapshot`).
            let from = osd.id;
            let refusal = raft.snapshot_refusal(leader, snapshot_index);
            self.send(from, leader, pg, refusal);
            return;
        }
        osd.installing.insert(
            pg,
            Installing {
                message,
                leader,
                index: snapshot_index,
                fetch_at,
                fetched: None,
                stepped: false,
            },
        );
    }

    /// Followers fetch the state of the snapshots they were sent from the leader that sent
    /// them (a copy as of its applied index), and hand raft the message. A fetch fails if
    /// the leader is down, paused, cut off or not applied up to the snapshot yet, or the
    /// network loses it: the leader is told, and sends another later.
    fn fetch_snapshots(&mut self) {
        for index in 0..self.osds.len() {
            if self.osds[index].running().is_none() {
                continue;
            }
            let due: Vec<PgId> = self.osds[index]
                .installing
                .iter()
                .filter(|(_, installing)| !installing.stepped && installing.fetch_at <= self.now)
                .map(|(pg, _)| *pg)
                .collect();
            let me = self.osds[index].id;
            for pg in due {
                let (leader, snapshot_index) = {
                    let installing = &self.osds[index].installing[&pg];
                    (installing.leader, installing.index)
                };
                let lost = self.faults && self.rng.chance(self.config.loss);
                let copy = if lost || !self.can_talk(me, leader) {
                    None
                } else {
                    let now = self.now;
                    let source = &mut self.osds[leader.0 as usize];
                    let applied = source.applied_index.get(&pg).copied().unwrap_or(0);
                    let hosts = source.running().is_some_and(|raft| raft.hosts(pg));
                    // A damaged copy is never sent (the OSD's chunk reads check it).
                    let serves =
                        hosts && applied >= snapshot_index && !source.damaged.contains_key(&pg);
                    if serves && let Some(raft) = source.raft.as_ref() {
                        for ((sent, follower), heard) in &mut source.snapshots_sent {
                            if *sent == pg
                                && raft.snapshot_sent(pg, *follower) == Some(snapshot_index)
                            {
                                *heard = now;
                            }
                        }
                    }
                    serves.then(|| source.applied.get(&pg).cloned().unwrap_or_default())
                };
                // The OSD's copy is fuzzy: each object as of some index at or after the
                // snapshot's. So is this one: every entry up to the snapshot, and about
                // half of those after it (up to the leader's applied index).
                let copy = copy.map(|state| {
                    state
                        .into_iter()
                        .filter(|(at, _)| *at <= snapshot_index || self.rng.chance(0.5))
                        .collect::<State>()
                });
                let osd = &mut self.osds[index];
                let raft = osd.raft.as_mut().expect("the osd is up");
                let Some(copy) = copy else {
                    osd.installing.remove(&pg);
                    let refusal = raft.snapshot_refusal(leader, snapshot_index);
                    self.send(me, leader, pg, refusal);
                    continue;
                };
                let installing = osd.installing.get_mut(&pg).expect("due above");
                installing.fetched = Some(copy);
                installing.stepped = true;
                let message = std::mem::take(&mut installing.message);
                raft.step(pg, message);
                if !raft.has_pending_snapshot(pg) {
                    // A newer term or commit made it stale meanwhile.
                    osd.installing.remove(&pg);
                    let refusal = raft.snapshot_refusal(leader, snapshot_index);
                    self.send(me, leader, pg, refusal);
                }
            }
        }
    }

    /// Damages a voter's copy of a PG now and then (a write lost from it), unless another
    /// copy of the PG is damaged already.
    fn damage(&mut self) {
        if !self.faults || !self.rng.chance(self.config.damage) {
            return;
        }
        let pg = self.pgs[self.rng.below(self.pgs.len() as u64) as usize];
        if self.osds.iter().any(|osd| osd.damaged.contains_key(&pg)) {
            return;
        }
        // Nor while a lost OSD is still a voter of the PG anywhere (a second fault: the
        // lost copy may be the only good one).
        let lost = |id: &OsdId| self.osds[id.0 as usize].lost;
        let degraded = self
            .osds
            .iter()
            .filter_map(|osd| osd.raft.as_ref())
            .filter_map(|raft| raft.members(pg))
            .any(|members| {
                members
                    .voters
                    .iter()
                    .chain(&members.voters_outgoing)
                    .any(lost)
            });
        if degraded {
            return;
        }
        let voters = &self.targets[&pg];
        let victim = voters[self.rng.below(voters.len() as u64) as usize];
        let pick = self.rng.next();
        let osd = &mut self.osds[victim.0 as usize];
        let Some(raft) = osd.raft.as_ref() else {
            return;
        };
        if pick >> 63 == 1 {
            // The payload of the last write of its raft log not applied yet: it cannot be
            // sent (another replica may hold the only other copies, or none may), and once
            // applied, what it maps is damaged.
            let applied = osd.applied_index.get(&pg).copied().unwrap_or(0);
            let Some(entry) = raft.storage(pg).and_then(|storage| {
                let retained = storage.retained().iter().rev();
                retained
                    .filter(|entry| entry.index > applied)
                    .find(|entry| write_id(&entry.data).is_some())
            }) else {
                return;
            };
            osd.damaged.insert(pg, entry.index);
            let mut unreadable = osd.unreadable.lock().expect("not poisoned");
            unreadable.insert(entry.data.to_vec(), pg);
            osd.may_step_down.insert(pg, None);
            self.outcome.damaged += 1;
            self.outcome.log_damaged += 1;
            return;
        }
        let Some(state) = osd.applied.get_mut(&pg).filter(|state| !state.is_empty()) else {
            return;
        };
        let removed = state.remove((pick % state.len() as u64) as usize);
        osd.damaged.insert(pg, removed.0);
        self.outcome.damaged += 1;
    }

    /// Moves each damaged copy's repair on, as the OSD does: a leader hands leadership
    /// over, a follower that knows a leader asks it for a snapshot.
    fn advance_repairs(&mut self) {
        let now = self.now;
        for osd in &mut self.osds {
            if osd.paused_until.is_some() {
                continue;
            }
            let Some(raft) = osd.raft.as_mut() else {
                continue;
            };
            let pgs: Vec<PgId> = osd.damaged.keys().copied().collect();
            for pg in pgs {
                if raft.requesting_snapshot(pg) || osd.installing.contains_key(&pg) {
                    continue;
                }
                let leading = raft.is_leader(pg);
                if let Some(since) = osd.may_step_down.get_mut(&pg) {
                    // Damage in its raft log: leading too long, it steps down.
                    if !leading {
                        *since = None;
                    } else if now - *since.get_or_insert(now) > STEP_DOWN_STEPS {
                        *since = None;
                        raft.step_down(pg, basalt_osd::daemon::HELD_BACK_TICKS);
                        self.outcome.step_downs += 1;
                        continue;
                    }
                }
                if leading {
                    raft.hand_over(pg, &[osd.id]);
                } else if raft.leader(pg).is_some() {
                    // Fails while this replica's last entry is of an older term: asked
                    // again at the next tick.
                    let _ = raft.request_snapshot(pg);
                }
            }
        }
    }

    /// Snapshots sent to followers that stopped fetching count as failed, so that raft
    /// sends another (a follower that restarted meanwhile forgot it).
    fn watch_snapshots_sent(&mut self) {
        let now = self.now;
        for osd in &mut self.osds {
            if osd.paused_until.is_some() {
                continue;
            }
            let Some(raft) = osd.raft.as_mut() else {
                continue;
            };
            osd.snapshots_sent.retain(|(pg, follower), heard| {
                if !raft.sending_snapshot(*pg, *follower) {
                    return false;
                }
                if now - *heard < SNAPSHOT_SILENCE_TICKS * STEPS_PER_TICK {
                    return true;
                }
                raft.snapshot_failed(*pg, *follower);
                false
            });
        }
    }

    /// Cuts a checkpoint at a random up OSD now and then, as the OSD does: raft logs are
    /// compacted behind the applied index as far as the retention allows, and each PG's
    /// durable raft state and state go into the checkpoint, durable a few steps later.
    fn cut_checkpoints(&mut self) {
        let retention = Retention {
            entries: self.config.retained_entries,
            bytes: u64::MAX,
            // The simulation's entries carry 8 bytes each.
            behind_bytes: 8 * self.config.behind_entries,
        };
        for index in 0..self.osds.len() {
            let now = self.now;
            let osd = &mut self.osds[index];
            if let Some(cutting) = &osd.cutting
                && cutting.durable_at <= now
                && osd.paused_until.is_none()
            {
                let cutting = osd.cutting.take().expect("checked above");
                osd.durable.drain(..cutting.covers);
                osd.checkpoint = Some(cutting.checkpoint);
                self.outcome.checkpoints += 1;
            }
        }
        if !self.faults
            || !self
                .rng
                .chance(self.config.checkpoint * self.osds.len() as f64)
        {
            return;
        }
        let index = self.rng.below(self.osds.len() as u64) as usize;
        let durable_at = self.now + 1 + self.rng.below(self.config.persist_max);
        let again = self.rng.chance(0.5);
        let osd = &mut self.osds[index];
        // None is cut while a snapshot is being installed (replay sees a transfer whole).
        if osd.cutting.is_some() || !osd.installing.is_empty() || osd.paused_until.is_some() {
            return;
        }
        let Some(raft) = osd.raft.as_mut() else {
            return;
        };
        let mut checkpoint = SimCheckpoint {
            checkpoint: Checkpoint::default(),
            states: BTreeMap::new(),
        };
        for &pg in &self.pgs {
            let applied = osd.applied_index.get(&pg).copied().unwrap_or(0);
            let matched = raft.followers_matched(pg);
            let Some(storage) = raft.storage(pg) else {
                continue;
            };
            // The log after a snapshot being sent stays, whatever the retention says.
            let point = reclaim::compaction_point(storage, applied, matched, retention)
                .min(raft.snapshot_pin(pg).unwrap_or(u64::MAX));
            raft.compact(pg, point);
            let storage = raft.storage(pg).expect("hosted above");
            let durable = osd.durable_state.get(&pg).cloned().unwrap_or_default();
            checkpoint
                .checkpoint
                .pgs
                .push(reclaim::pg_checkpoint(pg, storage, &durable, applied));
            let state = osd.applied.get(&pg).cloned().unwrap_or_default();
            checkpoint.states.insert(pg, state);
        }
        // The OSD's replay starts at the batch of the last persist it processed, which may
        // hold others: now and then the last group commit is replayed again.
        let last_group = osd.durable.last().map(|record| record.group);
        let covers = match last_group {
            Some(group) if again => osd
                .durable
                .iter()
                .position(|record| record.group == group)
                .unwrap_or(osd.durable.len()),
            _ => osd.durable.len(),
        };
        osd.cutting = Some(Cutting {
            durable_at,
            covers,
            checkpoint,
        });
    }

    fn complete_persists(&mut self) {
        for index in 0..self.osds.len() {
            if self.osds[index].paused_until.is_some() {
                continue;
            }
            while let Some((at, _)) = self.osds[index].in_flight.front() {
                if *at > self.now {
                    break;
                }
                let (_, mut record) = self.osds[index]
                    .in_flight
                    .pop_front()
                    .expect("front exists");
                let osd = &mut self.osds[index];
                let (from, pg) = (osd.id, record.pg);
                let raft = osd
                    .raft
                    .as_mut()
                    .expect("in-flight persists belong to up osds");
                let mut messages = Vec::new();
                if let Some(installed) = &record.snapshot {
                    // The copy becomes the PG's state, as of the snapshot; the leader is
                    // told first, so that it takes the answer for the snapshot it sent.
                    osd.installing.remove(&pg);
                    if osd.damaged.remove(&pg).is_some() {
                        self.outcome.repairs += 1;
                        repaired(&osd.unreadable, &mut osd.may_step_down, pg);
                    }
                    osd.applied.insert(pg, installed.state.clone());
                    osd.applied_index.insert(pg, installed.index);
                    let answer = raft.snapshot_installed(installed.leader, installed.index);
                    messages.push((installed.leader, answer));
                    self.outcome.snapshots += 1;
                }
                osd.durable_state
                    .entry(pg)
                    .or_default()
                    .persisted(record.last_index, record.hard_state.clone());
                raft.on_persisted(pg, record.number);
                // The messages leave now; the durable record keeps only what replay needs.
                messages.append(&mut record.then_send);
                osd.durable.push(record);
                for (to, message) in messages {
                    self.send(from, to, pg, message);
                }
            }
        }
    }

    fn run_actions(&mut self) {
        for index in 0..self.osds.len() {
            let mut actions = Vec::new();
            match self.osds[index].running() {
                Some(raft) => raft.collect(&mut actions),
                None => continue,
            }
            let from = self.osds[index].id;
            for action in actions {
                match action {
                    Action::Send { to, pg, message } => {
                        if MultiRaft::snapshot_of(&message).is_some() {
                            self.osds[index].snapshots_sent.insert((pg, to), self.now);
                        }
                        self.send(from, to, pg, message)
                    }
                    Action::Persist {
                        pg,
                        entries,
                        hard_state,
                        number,
                        then_send,
                        snapshot,
                    } => {
                        // As the OSD writes them: a commit index alone waits for entries.
                        let hard_state = self.osds[index]
                            .hard_states
                            .entry(pg)
                            .or_default()
                            .to_write(hard_state, !entries.is_empty());
                        let snapshot = match snapshot {
                            Some(at) => match self.installed(index, pg, at) {
                                Ok(installed) => Some(installed),
                                Err(failure) => {
                                    self.fail(failure);
                                    continue;
                                }
                            },
                            None => None,
                        };
                        let last_index = self.osds[index]
                            .durable_state
                            .entry(pg)
                            .or_default()
                            .persisting(&entries, snapshot.as_ref().map(|s| s.index));
                        // The log device completes persists in order, with group commit:
                        // while one write is under way, what comes meanwhile gathers into
                        // the next one, which starts when it ends.
                        let in_flight = &self.osds[index].in_flight;
                        let first = in_flight.front().map(|(at, _)| *at);
                        let last = in_flight.back().map(|(at, _)| *at);
                        let at = match (first, last) {
                            (Some(first), Some(last)) if last > first => last,
                            (_, last) => {
                                last.unwrap_or(self.now).max(self.now)
                                    + 1
                                    + self.rng.below(self.config.persist_max)
                            }
                        };
                        let record = Record {
                            pg,
                            entries,
                            hard_state,
                            number,
                            then_send,
                            snapshot,
                            last_index,
                            group: at,
                        };
                        self.osds[index].in_flight.push_back((at, record));
                    }
                    Action::ReadIndex { reads, .. } => {
                        for (context, at) in reads {
                            let Some(id) = context.try_into().ok().map(u64::from_le_bytes) else {
                                continue;
                            };
                            if let Some(read) = self.confirming.remove(&id) {
                                self.waiting.push((at, read));
                            }
                        }
                    }
                    Action::Apply { pg, entries } => {
                        for entry in entries {
                            let previous = self.osds[index].applied_index.insert(pg, entry.index);
                            if previous.is_some_and(|previous| entry.index <= previous) {
                                self.fail(format!(
                                    "pg {pg}: {from} applied entry {} after entry {}",
                                    entry.index,
                                    previous.unwrap_or(0)
                                ));
                            }
                            if entry.data.is_empty() {
                                continue;
                            }
                            let data = entry.data.to_vec();
                            if let Some(id) = write_id(&data)
                                && self.pending.get(&id) == Some(&(pg, from))
                            {
                                self.pending.remove(&id);
                                self.acknowledged.entry(pg).or_default().push(id);
                            }
                            if self.osds[index].damaged.get(&pg) == Some(&entry.index) {
                                // Applied again, it refers to the same damaged payload.
                                continue;
                            }
                            let state = self.osds[index].applied.entry(pg).or_default();
                            // A snapshot's copy (or a checkpoint's, cut before the entries
                            // after the copy's index were applied again) may hold this entry
                            // already, which applying again leaves as it was, or entries
                            // after it.
                            match state.binary_search_by_key(&entry.index, |e| e.0) {
                                Ok(at) if state[at].1 == data => {}
                                Ok(_) => self.fail(format!(
                                    "pg {pg}: {from} applied entry {} that differs from the one \
                                     its state holds there",
                                    entry.index
                                )),
                                Err(at) => state.insert(at, (entry.index, data)),
                            }
                        }
                    }
                }
            }
        }
    }

    /// The snapshot a persist of `pg` installs at `at` (index, term): the state fetched
    /// for it, and the configuration raft reset the log to.
    fn installed(&mut self, index: usize, pg: PgId, at: (u64, u64)) -> Result<Installed, String> {
        let osd = &mut self.osds[index];
        let installing = osd.installing.get_mut(&pg);
        let Some((leader, Some(state))) = installing
            .filter(|installing| installing.index == at.0)
            .map(|installing| (installing.leader, installing.fetched.take()))
        else {
            return Err(format!(
                "pg {pg}: {} installs a snapshot at {} that it did not fetch",
                osd.id, at.0
            ));
        };
        let conf = osd
            .raft
            .as_ref()
            .and_then(|raft| raft.storage(pg))
            .and_then(|storage| storage.confs().first())
            .map(|(_, conf)| basalt_replication::encode_conf(conf))
            .unwrap_or_default();
        Ok(Installed {
            index: at.0,
            term: at.1,
            conf,
            state,
            leader,
        })
    }

    fn restart_due(&mut self) {
        for index in 0..self.osds.len() {
            if self.osds[index]
                .restart_at
                .is_some_and(|at| at <= self.now || !self.faults)
            {
                self.start(index);
            }
        }
    }

    fn step(&mut self) {
        self.now += 1;
        self.inject_faults();
        self.restart_due();
        let (now, faults) = (self.now, self.faults);
        for index in 0..self.osds.len() {
            let osd = &mut self.osds[index];
            if osd
                .paused_until
                .is_some_and(|until| until <= now || !faults)
            {
                osd.paused_until = None;
                // What was sent to it meanwhile reaches it over the next steps.
                let id = osd.id;
                for message in self.network.iter_mut().filter(|m| m.2 == id) {
                    message.0 = message
                        .0
                        .max(now + 1 + self.rng.below(self.config.delay_max));
                }
            }
        }
        // Clients first: one that reaches an OSD just back from a pause does so before
        // the messages sent to it meanwhile.
        self.start_reads();
        if self.now.is_multiple_of(STEPS_PER_TICK) {
            for osd in &mut self.osds {
                if let Some(raft) = osd.running() {
                    raft.tick();
                    for (pg, target) in &self.targets {
                        raft.reconfigure(*pg, target);
                    }
                }
            }
            self.watch_snapshots_sent();
            self.advance_repairs();
            self.advance_stops();
        }
        self.damage();
        self.deliver_messages();
        self.fetch_snapshots();
        self.complete_persists();
        self.cut_checkpoints();
        self.propose_writes();
        self.run_actions();
        self.serve_reads();
    }

    /// Whether every PG has one leader, whose voters are the PG's target members, that has
    /// committed its whole log, and every voter has applied exactly that log. (Equal applied
    /// logs alone are not enough: a new leader commits older entries only once an entry of
    /// its own term is replicated.)
    fn agrees(&self) -> bool {
        self.pgs.iter().all(|pg| {
            let leaders: Vec<&MultiRaft> = self
                .osds
                .iter()
                .filter_map(|osd| osd.raft.as_ref())
                .filter(|raft| raft.is_leader(*pg))
                .collect();
            let [leader] = leaders.as_slice() else {
                return false;
            };
            let target = &self.targets[pg];
            let Some(mut members) = leader.members(*pg) else {
                return false;
            };
            members.voters.sort_unstable();
            let mut wanted = target.clone();
            wanted.sort_unstable();
            if members.voters != wanted
                || !members.learners.is_empty()
                || !members.voters_outgoing.is_empty()
            {
                return false;
            }
            let last = leader.last_index(*pg);
            let reference = self.osds[target[0].0 as usize].applied.get(pg);
            target.iter().all(|id| {
                let osd = &self.osds[id.0 as usize];
                osd.raft
                    .as_ref()
                    .is_some_and(|raft| raft.committed(*pg) == last)
                    && osd.applied_index.get(pg).copied() == last
                    && osd.applied.get(pg) == reference
            })
        })
    }

    /// Whether a replica of `pg` leads it and has committed an entry of its term.
    fn led(&self, pg: PgId) -> bool {
        self.osds.iter().any(|osd| {
            osd.raft
                .as_ref()
                .is_some_and(|raft| raft.read_barrier(pg).is_some())
        })
    }

    /// The operator's last resort (`basalt pg mark-unfound-lost`) for PGs that have had no
    /// leader for [`OPERATOR_AFTER`] steps of the healed cluster (every OSD up but those
    /// lost for good): every replica is asked to give up the entries it cannot send (those
    /// that hold none refuse).
    fn mark_unfound_lost(&mut self, pgs: &[PgId]) {
        for &pg in pgs {
            for osd in &mut self.osds {
                if let Some(raft) = osd.raft.as_mut()
                    && raft.concede(pg).is_ok()
                {
                    self.outcome.conceded += 1;
                }
            }
        }
    }

    /// The operator's way out (`basalt pg force-quorum`) for PGs that have had no leader
    /// for [`OPERATOR_AFTER`] steps of the healed cluster, if voters were lost for good:
    /// the replica with the most up-to-date log (last term, then last index; a voter rather
    /// than another) among the others (all up: every one answers) is made the only voter;
    /// it refuses if the voters left make a quorum.
    fn force_quorum(&mut self, pgs: &[PgId]) {
        let lost: Vec<OsdId> = self
            .osds
            .iter()
            .filter(|osd| osd.lost)
            .map(|osd| osd.id)
            .collect();
        if lost.is_empty() {
            return;
        }
        for &pg in pgs {
            // As the command: the newest configuration a replica applied may not leave a
            // quorum.
            let confs: Vec<(u64, _)> = self
                .osds
                .iter()
                .filter_map(|osd| {
                    let raft = osd.raft.as_ref()?;
                    Some((raft.conf_index(pg)?, raft.members(pg)?))
                })
                .collect();
            let newest = confs.iter().map(|(index, _)| *index).max().unwrap_or(0);
            let electable = confs.iter().any(|(index, m)| {
                *index == newest
                    && quorum_without(&m.voters, &m.voters_outgoing, |osd| lost.contains(osd))
            });
            if electable {
                continue;
            }
            let best = self
                .osds
                .iter()
                .filter_map(|osd| {
                    let raft = osd.raft.as_ref()?;
                    let voter = raft.members(pg)?.votes(osd.id);
                    let (index, term) = raft.last_log_id(pg)?;
                    Some(((term, index, voter), osd.id.0 as usize))
                })
                .max();
            // What the survivors hold: acknowledged writes that none holds were lost with
            // the lost OSDs; every other must survive the choice. (Not the data a
            // snapshot's fuzzy copy brought a replica past its log: the replica made the
            // only voter keeps its own, outside its log, and sends the others a snapshot.)
            let held: std::collections::BTreeSet<u64> = self
                .osds
                .iter()
                .filter(|osd| !osd.lost)
                .flat_map(|osd| {
                    let raft = osd.raft.as_ref();
                    let last = raft.and_then(|raft| raft.last_index(pg)).unwrap_or(0);
                    let storage = raft.and_then(|raft| raft.storage(pg));
                    let applied = osd.applied.get(&pg).into_iter().flatten();
                    let logged = storage.map_or(&[][..], |storage| storage.retained());
                    applied
                        .filter(move |(index, _)| *index <= last)
                        .map(|(_, data)| &data[..])
                        .chain(logged.iter().map(|entry| &entry.data[..]))
                        .filter_map(write_id)
                })
                .collect();
            if let Some((_, best)) = best
                && let Some(raft) = self.osds[best].raft.as_mut()
                && raft.force_quorum(pg, &lost).is_ok()
            {
                self.outcome.forced += 1;
                // A snapshot's fuzzy copy may have brought it the data of entries past its
                // log, which entries of its own term replace at their indexes now: the OSD
                // keeps that data in its objects, outside any entry (snapshots copy it on).
                let last = self.osds[best]
                    .raft
                    .as_ref()
                    .and_then(|raft| raft.last_index(pg))
                    .unwrap_or(0);
                if let Some(state) = self.osds[best].applied.get_mut(&pg) {
                    let past = state.partition_point(|(index, _)| *index <= last);
                    let carried: Vec<u64> = state
                        .drain(past..)
                        .filter_map(|(_, data)| write_id(&data))
                        .collect();
                    self.outcome.carried += carried.len() as u64;
                    self.spared.extend(carried);
                }
                let gone: Vec<u64> = self
                    .acknowledged
                    .get(&pg)
                    .into_iter()
                    .flatten()
                    .filter(|id| !held.contains(id) && !self.spared.contains(id))
                    .copied()
                    .collect();
                self.outcome.forgone += gone.len() as u64;
                self.spared.extend(gone);
            }
        }
    }

    /// Each replica's state, one line per replica of each PG (for a failure that
    /// `BASALT_SIM_STATE` asks to describe).
    fn state(&self) -> String {
        let mut out = String::new();
        for pg in &self.pgs {
            out += &format!("\npg {pg}: target {:?}", self.targets[pg]);
            for osd in &self.osds {
                let Some(raft) = osd.raft.as_ref() else {
                    out += &format!("\n  {}: down", osd.id);
                    continue;
                };
                out += &format!(
                    "\n  {}: leader {:?} (leads: {}), term {:?}, last {:?}, committed {:?}, \
                     applied {:?}, members {:?}, requesting {}, installing {:?}, damaged \
                     {:?}, paused {}, held back {:?}",
                    osd.id,
                    raft.leader(*pg),
                    raft.is_leader(*pg),
                    raft.term(*pg),
                    raft.last_log_id(*pg),
                    raft.committed(*pg),
                    osd.applied_index.get(pg),
                    raft.members(*pg),
                    raft.requesting_snapshot(*pg),
                    osd.installing
                        .get(pg)
                        .map(|i| (i.leader, i.index, i.stepped)),
                    osd.damaged.get(pg),
                    osd.paused_until.is_some(),
                    raft.held_back(*pg),
                );
            }
        }
        out
    }

    fn check(&self) -> Result<(), String> {
        if let Some(failure) = &self.failure {
            return Err(failure.clone());
        }
        for pg in &self.pgs {
            let voters = &self.targets[pg];
            let reference = self.osds[voters[0].0 as usize]
                .applied
                .get(pg)
                .map_or(&[][..], Vec::as_slice);
            // A lost OSD's state went with it (what it held in memory at its last crash
            // may predate a repair that its durable records hold).
            for osd in self.osds.iter().filter(|osd| !osd.lost) {
                let log = osd.applied.get(pg).map_or(&[][..], Vec::as_slice);
                let n = osd.id;
                if voters.contains(&n) && log != reference {
                    return Err(format!(
                        "pg {pg}: voters {n} and {} applied {} and {} entries; they differ",
                        voters[0],
                        log.len(),
                        reference.len()
                    ));
                }
                if osd.damaged.contains_key(pg) {
                    // Known damaged, never read; dropped once the PG leaves it.
                    continue;
                }
                // Up to its applied index the same entries as the voters; after it, only
                // some of theirs (a snapshot's fuzzy copy not applied over yet).
                let applied = osd.applied_index.get(pg).copied().unwrap_or(0);
                let upto = |log: &[(u64, Vec<u8>)]| log.partition_point(|(at, _)| *at <= applied);
                if log[..upto(log)] != reference[..upto(reference)]
                    || !log[upto(log)..]
                        .iter()
                        .all(|entry| reference.contains(entry))
                {
                    return Err(format!(
                        "pg {pg}: {n}, not a voter, applied {} entries up to index {applied} \
                         that are not the voters' {}, or holds others that they do not",
                        log.len(),
                        reference.len()
                    ));
                }
                if !log.windows(2).all(|pair| pair[0].0 < pair[1].0) {
                    return Err(format!("pg {pg}: {n} applied entries out of index order"));
                }
            }
        }
        for (pg, ids) in &self.acknowledged {
            let voter = self.targets[pg][0];
            let log = self.osds[voter.0 as usize]
                .applied
                .get(pg)
                .map_or(&[][..], Vec::as_slice);
            if let Some(id) = ids.iter().find(|id| {
                !self.spared.contains(id)
                    && !log.iter().any(|(_, data)| write_id(data) == Some(**id))
            }) {
                return Err(format!("acknowledged write {id} of pg {pg} is lost"));
            }
        }
        Ok(())
    }
}

/// Runs one simulation; `Err` describes the first broken invariant, with the seed.
pub fn run(config: &SimConfig) -> Result<Outcome, String> {
    let mut cluster = Cluster::new(config.clone());
    for _ in 0..config.steps {
        cluster.step();
    }
    cluster.faults = false;
    cluster.isolated = None;
    let settle_start = cluster.now;
    // When each PG last had a leader that committed an entry of its term.
    let mut led_at: BTreeMap<PgId, u64> = BTreeMap::new();
    while !cluster.agrees() {
        for pg in cluster.pgs.clone() {
            if cluster.led(pg) {
                led_at.insert(pg, cluster.now);
            }
        }
        let stuck: Vec<PgId> = cluster
            .pgs
            .iter()
            .filter(|pg| {
                let since = led_at.get(pg).copied().unwrap_or(0).max(settle_start);
                cluster.now - since >= OPERATOR_AFTER
            })
            .copied()
            .collect();
        if !stuck.is_empty() {
            cluster.mark_unfound_lost(&stuck);
            cluster.force_quorum(&stuck);
            for pg in stuck {
                // Asked again as long again after.
                led_at.insert(pg, cluster.now);
            }
        }
        if cluster.now - settle_start > config.settle_steps {
            // A broken invariant says more than the want of agreement it caused.
            let failure = cluster.check().err().unwrap_or_else(|| {
                format!(
                    "the healed cluster did not agree within {} steps",
                    config.settle_steps
                )
            });
            let state = if std::env::var_os("BASALT_SIM_STATE").is_some() {
                cluster.state()
            } else {
                String::new()
            };
            return Err(format!("seed {}: {failure}{state}", config.seed));
        }
        cluster.step();
    }
    cluster.outcome.settle_steps = cluster.now - settle_start;
    cluster.outcome.acknowledged =
        cluster.acknowledged.values().map(Vec::len).sum::<usize>() as u64;
    cluster
        .check()
        .map_err(|failure| format!("seed {}: {failure}", config.seed))?;
    Ok(cluster.outcome)
}
