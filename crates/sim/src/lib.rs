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
//! - **Pauses**: an OSD stops for a while (its clock does not tick, nothing reaches it);
//!   when it goes on, clients reach it before the messages sent to it meanwhile do.
//! - **Clients**: write proposals go to the OSD that believes it leads the PG; a write is
//!   acknowledged when that OSD applies it. Reads go to an OSD that believes it leads the PG
//!   and are served as the OSDs serve them ([`MultiRaft::read`]: under the leader's lease,
//!   or once a quorum confirmed the leadership), when that OSD has applied up to the
//!   read's index; a simulated clock (a step is a tenth of a tick) measures the leases.
//!   Every read must see every write acknowledged before it started: a stale read fails
//!   the run.
//! - **Membership**: every OSD hosts every PG, which starts on the first few; now and then a
//!   PG's target members change (as the monitors' map would when OSDs go out or come in)
//!   and its leader moves the voters there ([`MultiRaft::reconfigure`]).
//!
//! At the end every fault is healed and the run continues until each PG's voters are its
//! target members and agree. Then: every acknowledged write is in its PG's applied log, the
//! voters applied exactly the same entries, and any other replica a prefix of them. A failure names its seed; `cargo run -p basalt-sim --
//! --seed N` replays it.

use std::collections::{BTreeMap, VecDeque};
use std::time::{Duration, Instant};

use basalt_common::{OsdId, PgId, PoolId};
use basalt_replication::multi_raft::ELECTION_TICKS;
use basalt_replication::{
    Action, HardState, MultiRaft, RaftEntry, RaftMessage, ReadStart, Restored,
};

/// Simulation steps per raft tick.
const STEPS_PER_TICK: u64 = 10;
/// A simulation step on the clock that measures leases (a tick is 100 ms, as in the OSD).
const STEP: Duration = Duration::from_millis(10);

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
        }
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
}

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
}

struct SimOsd {
    id: OsdId,
    raft: Option<MultiRaft>,
    durable: Vec<Record>,
    in_flight: VecDeque<(u64, Record)>,
    applied: BTreeMap<PgId, Vec<(u64, Vec<u8>)>>,
    /// The index of the last entry applied (data or not), per PG.
    applied_index: BTreeMap<PgId, u64>,
    restart_at: Option<u64>,
    /// The step until which this OSD is paused.
    paused_until: Option<u64>,
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
    /// Each PG's target members.
    targets: BTreeMap<PgId, Vec<OsdId>>,
    next_read: u64,
    /// Reads waiting for a quorum's confirmation, by id.
    confirming: BTreeMap<u64, Read>,
    /// Reads waiting for their OSD to apply up to their index.
    waiting: Vec<(u64, Read)>,
    /// The first stale read seen.
    stale: Option<String>,
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
            targets: BTreeMap::new(),
            next_read: 0,
            confirming: BTreeMap::new(),
            waiting: Vec::new(),
            stale: None,
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
                in_flight: VecDeque::new(),
                applied: BTreeMap::new(),
                applied_index: BTreeMap::new(),
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

    /// (Re)starts an OSD from its durable records, as the OSD replays its log.
    fn start(&mut self, index: usize) {
        let members = self.initial();
        let seed = self.rng.next();
        let osd = &mut self.osds[index];
        let mut raft = MultiRaft::new(osd.id, seed);
        // As the OSDs run it.
        raft.set_lazy_commit(true);
        raft.set_lease(Some(
            STEP * STEPS_PER_TICK as u32 * ELECTION_TICKS as u32 / 2,
        ));
        for &pg in &self.pgs {
            let mut restored = Restored::default();
            for record in osd.durable.iter().filter(|record| record.pg == pg) {
                restored.add(&record.entries, record.hard_state.as_ref());
            }
            raft.create_group(pg, &members, restored)
                .expect("a restored group starts");
        }
        osd.raft = Some(raft);
        osd.applied.clear();
        osd.applied_index.clear();
        osd.restart_at = None;
    }

    fn crash(&mut self, index: usize) {
        let restart = self.now + 200 + self.rng.below(2000);
        let osd = &mut self.osds[index];
        osd.raft = None;
        osd.paused_until = None;
        osd.in_flight.clear();
        osd.restart_at = Some(restart);
        self.pending.retain(|_, (_, via)| *via != osd.id);
        let id = osd.id;
        self.confirming.retain(|_, read| read.via != id);
        self.waiting.retain(|(_, read)| read.via != id);
        self.outcome.crashes += 1;
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
        if self.isolated.is_none() && self.rng.chance(self.config.partition) {
            let cut = OsdId(self.rng.below(u64::from(self.config.osds)) as u32);
            self.isolated = Some((cut, self.now + 500 + self.rng.below(3000)));
            self.outcome.partitions += 1;
        }
        if self.rng.chance(self.config.reconfigure) {
            let pg = self.pgs[self.rng.below(self.pgs.len() as u64) as usize];
            let mut osds: Vec<OsdId> = self.osds.iter().map(|osd| osd.id).collect();
            let mut target = Vec::new();
            while target.len() < self.config.members as usize && !osds.is_empty() {
                target.push(osds.remove(self.rng.below(osds.len() as u64) as usize));
            }
            self.targets.insert(pg, target);
            self.outcome.reconfigurations += 1;
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
                self.crash(victim);
            }
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
        let leaders: Vec<usize> = (0..self.osds.len())
            .filter(|&i| {
                self.osds[i]
                    .running()
                    .is_some_and(|raft| raft.is_leader(pg))
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
            if let Some(missed) = acknowledged.iter().find(|id| !seen.contains(id))
                && self.stale.is_none()
            {
                self.stale = Some(format!(
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
            if let Some(raft) = self.osds[to.0 as usize].running() {
                raft.step(pg, message);
            }
        }
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
                osd.raft
                    .as_mut()
                    .expect("in-flight persists belong to up osds")
                    .on_persisted(record.pg, record.number);
                let (from, pg) = (osd.id, record.pg);
                // The messages leave now; the durable record keeps only what replay needs.
                let messages = std::mem::take(&mut record.then_send);
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
                    Action::Send { to, pg, message } => self.send(from, to, pg, message),
                    Action::Persist {
                        pg,
                        entries,
                        hard_state,
                        number,
                        then_send,
                        // The simulation never compacts: no snapshots.
                        ..
                    } => {
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
                            self.osds[index].applied_index.insert(pg, entry.index);
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
                            self.osds[index]
                                .applied
                                .entry(pg)
                                .or_default()
                                .push((entry.index, data));
                        }
                    }
                }
            }
        }
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
        }
        self.deliver_messages();
        self.complete_persists();
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

    fn check(&self) -> Result<(), String> {
        if let Some(stale) = &self.stale {
            return Err(stale.clone());
        }
        for pg in &self.pgs {
            let voters = &self.targets[pg];
            let reference = self.osds[voters[0].0 as usize]
                .applied
                .get(pg)
                .map_or(&[][..], Vec::as_slice);
            for osd in &self.osds {
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
                if !reference.starts_with(log) {
                    return Err(format!(
                        "pg {pg}: {n}, not a voter, applied {} entries that are not a \
                         prefix of the voters' {}",
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
            if let Some(id) = ids
                .iter()
                .find(|id| !log.iter().any(|(_, data)| write_id(data) == Some(**id)))
            {
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
    while !cluster.agrees() {
        if cluster.now - settle_start > config.settle_steps {
            return Err(format!(
                "seed {}: the healed cluster did not agree within {} steps",
                config.seed, config.settle_steps
            ));
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
