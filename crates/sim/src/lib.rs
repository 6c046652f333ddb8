//! Deterministic simulation of Basalt's replication layer (STYLE.md §9).
//!
//! Several OSDs, each with a [`MultiRaft`] hosting every PG, run in one thread on a seeded
//! generator. Production code runs; only its surroundings are simulated:
//!
//! - **Disk**: a persist completes a few steps after it is issued, in order; a crash loses
//!   every persist still in flight (a torn tail), never one already complete.
//! - **Network**: every message is delayed by a random number of steps (so messages
//!   reorder), some are lost, and for a while one OSD may be cut off from the others.
//! - **Crashes**: an OSD loses all volatile state and restarts later from its durable
//!   records, as the real OSD replays its log.
//! - **Clients**: write proposals go to the OSD that believes it leads the PG; a write is
//!   acknowledged when that OSD applies it.
//! - **Membership**: every OSD hosts every PG, which starts on the first few; now and then a
//!   PG's target members change (as the monitors' map would when OSDs go out or come in)
//!   and its leader moves the voters there ([`MultiRaft::reconfigure`]).
//!
//! At the end every fault is healed and the run continues until each PG's voters are its
//! target members and agree. Then: every acknowledged write is in its PG's applied log, the
//! voters applied exactly the same entries, and any other replica a prefix of them. A failure names its seed; `cargo run -p basalt-sim --
//! --seed N` replays it.

use std::collections::{BTreeMap, VecDeque};

use basalt_common::{OsdId, PgId, PoolId};
use basalt_replication::{Action, HardState, MultiRaft, RaftEntry, RaftMessage, Restored};

/// Simulation steps per raft tick.
const STEPS_PER_TICK: u64 = 10;

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
    /// Chance per step of a client write.
    pub write: f64,
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
            write: 0.2,
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
    /// Steps until the healed cluster agreed.
    pub settle_steps: u64,
    /// Target membership changes.
    pub reconfigurations: u64,
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
    acknowledged: BTreeMap<u64, PgId>,
    /// Each PG's target members.
    targets: BTreeMap<PgId, Vec<OsdId>>,
    outcome: Outcome,
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
        osd.in_flight.clear();
        osd.restart_at = Some(restart);
        self.pending.retain(|_, (_, via)| *via != osd.id);
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
            .iter()
            .position(|osd| osd.raft.as_ref().is_some_and(|raft| raft.is_leader(pg)))
        else {
            return;
        };
        let id = self.next_write;
        let osd = &mut self.osds[index];
        let raft = osd.raft.as_mut().expect("leader is up");
        if raft.propose(pg, id.to_le_bytes().to_vec()).is_ok() {
            self.next_write += 1;
            self.pending.insert(id, (pg, osd.id));
            self.outcome.proposed += 1;
        }
    }

    fn deliver_messages(&mut self) {
        let now = self.now;
        let (due, later): (Vec<_>, Vec<_>) = std::mem::take(&mut self.network)
            .into_iter()
            .partition(|m| m.0 <= now);
        self.network = later;
        for (_, from, to, pg, message) in due {
            if !self.can_talk(from, to) {
                continue;
            }
            if let Some(raft) = self.osds[to.0 as usize].raft.as_mut() {
                raft.step(pg, message);
            }
        }
    }

    fn complete_persists(&mut self) {
        for index in 0..self.osds.len() {
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
            match self.osds[index].raft.as_mut() {
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
                        // The log device completes persists in order.
                        let last = self.osds[index]
                            .in_flight
                            .back()
                            .map_or(self.now, |(at, _)| *at);
                        let at = last.max(self.now) + 1 + self.rng.below(self.config.persist_max);
                        let record = Record {
                            pg,
                            entries,
                            hard_state,
                            number,
                            then_send,
                        };
                        self.osds[index].in_flight.push_back((at, record));
                    }
                    Action::ReadIndex { .. } => {}
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
                                self.acknowledged.insert(id, pg);
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
        if self.now.is_multiple_of(STEPS_PER_TICK) {
            for osd in &mut self.osds {
                if let Some(raft) = osd.raft.as_mut() {
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
        for (id, pg) in &self.acknowledged {
            let voter = self.targets[pg][0];
            let log = self.osds[voter.0 as usize]
                .applied
                .get(pg)
                .map_or(&[][..], Vec::as_slice);
            if !log.iter().any(|(_, data)| write_id(data) == Some(*id)) {
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
    cluster.outcome.acknowledged = cluster.acknowledged.len() as u64;
    cluster
        .check()
        .map_err(|failure| format!("seed {}: {failure}", config.seed))?;
    Ok(cluster.outcome)
}
