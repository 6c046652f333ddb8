//! The monitor daemon: keeps the map on disk, answers OSDs, clients and the CLI, and turns
//! missed heartbeats into map changes.
//!
//! The map is saved whole after every change (to a temporary file, synced, then renamed over
//! `map.json`), before the change is answered or published: a change that was answered
//! survives a crash of the monitor. Subscribers wait in [`MonRequest::GetMap`] for the next
//! epoch; a `watch` channel wakes them all when the map changes.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use basalt_common::OsdId;
use basalt_wire::Message;
use basalt_wire::metrics::{self, Exposition};
use basalt_wire::tcp::{Handler, Server};
use tokio::sync::watch;

use crate::liveness::{Liveness, Verdict};
use crate::map::{ClusterMap, Command};
use crate::protocol::{ClusterStatus, MonReply, MonRequest, OsdReport, decode};

/// The file holding the map in the data directory.
pub const MAP_FILE: &str = "map.json";
/// The longest a subscriber may wait for a map in one request.
const MAP_WAIT_MAX: Duration = Duration::from_secs(30);
/// How often liveness is checked.
const CHECK_INTERVAL: Duration = Duration::from_millis(250);

/// How a monitor runs.
#[derive(Debug, Clone)]
pub struct MonConfig {
    /// Where the map is kept.
    pub data_dir: PathBuf,
    /// Where to listen.
    pub listen: SocketAddr,
    /// An OSD without heartbeats this long is marked down.
    pub grace: Duration,
    /// An OSD down this long is marked out (its PGs move).
    pub down_out_interval: Duration,
    /// Where to serve Prometheus metrics, if anywhere.
    pub metrics_addr: Option<SocketAddr>,
}

/// Why the monitor could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum MonError {
    /// The data directory or the map file.
    #[error("{path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The map file does not hold a map.
    #[error("{path}: not a cluster map: {reason}")]
    Corrupt {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
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
}

struct State {
    map: ClusterMap,
    liveness: Liveness,
    reports: BTreeMap<OsdId, Report>,
}

/// A running monitor.
pub struct Monitor {
    state: Mutex<State>,
    maps: watch::Sender<Arc<ClusterMap>>,
    map_path: PathBuf,
    /// Where it listens, once bound.
    address: std::sync::OnceLock<String>,
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

fn io_error(path: &Path) -> impl Fn(std::io::Error) -> MonError + '_ {
    move |source| MonError::Io {
        path: path.display().to_string(),
        source,
    }
}

/// Reads the saved map, or an empty one if none was saved yet.
fn load_map(path: &Path) -> Result<ClusterMap, MonError> {
    match std::fs::read(path) {
        Ok(bytes) => serde_json::from_slice(&bytes).map_err(|error| MonError::Corrupt {
            path: path.display().to_string(),
            reason: error.to_string(),
        }),
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => Ok(ClusterMap::new()),
        Err(error) => Err(io_error(path)(error)),
    }
}

/// Saves the map durably: a crash leaves either the old file or the new one.
fn save_map(path: &Path, map: &ClusterMap) -> std::io::Result<()> {
    use std::io::Write;
    let temporary = path.with_extension("json.tmp");
    let mut file = std::fs::File::create(&temporary)?;
    file.write_all(&serde_json::to_vec_pretty(map).map_err(std::io::Error::other)?)?;
    file.sync_all()?;
    std::fs::rename(&temporary, path)?;
    if let Some(dir) = path.parent() {
        std::fs::File::open(dir)?.sync_all()?;
    }
    Ok(())
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

    /// Applies a command, saves and publishes the new map.
    fn apply(&self, state: &mut State, command: &Command) -> MonReply {
        let mut next = state.map.clone();
        match next.apply(command) {
            Ok(false) => MonReply::Applied {
                changed: false,
                epoch: state.map.epoch,
            },
            Ok(true) => {
                if let Err(error) = save_map(&self.map_path, &next) {
                    tracing::error!(path = %self.map_path.display(), %error, "cannot save the map");
                    return MonReply::Error(format!(
                        "the monitor cannot save the map to {}: {error}",
                        self.map_path.display()
                    ));
                }
                tracing::info!(epoch = next.epoch.0, ?command, "map changed");
                state.map = next;
                self.maps.send_replace(Arc::new(state.map.clone()));
                MonReply::Applied {
                    changed: true,
                    epoch: state.map.epoch,
                }
            }
            Err(error) => MonReply::Error(error.to_string()),
        }
    }

    async fn handle(self: Arc<Self>, message: Message) -> Option<Message> {
        let request = match decode::<MonRequest>(&message) {
            Ok(request) => request,
            Err(error) => return Some(MonReply::Error(error).to_message()),
        };
        let reply = match request {
            MonRequest::Boot {
                uuid,
                host,
                address,
                weight,
            } => {
                let mut state = self.lock();
                let command = Command::OsdBoot {
                    uuid: uuid.clone(),
                    host,
                    address,
                    weight,
                };
                match self.apply(&mut state, &command) {
                    MonReply::Applied { .. } => {
                        let osd = state
                            .map
                            .osds
                            .values()
                            .find(|osd| osd.uuid == uuid)
                            .map(|osd| osd.id)
                            .expect("a booted osd is in the map");
                        state.liveness.heartbeat(osd, Instant::now());
                        MonReply::Booted {
                            osd,
                            map: state.map.clone(),
                        }
                    }
                    other => other,
                }
            }
            MonRequest::Heartbeat { osd, report } => self.heartbeat(osd, report),
            MonRequest::GetMap { after, wait_ms } => {
                let mut maps = self.maps.subscribe();
                let newer = |map: &Arc<ClusterMap>| after.is_none_or(|after| map.epoch > after);
                let wait = Duration::from_millis(wait_ms).min(MAP_WAIT_MAX);
                let found = tokio::time::timeout(wait, maps.wait_for(newer)).await;
                match found {
                    Ok(Ok(map)) => MonReply::Map(Some((**map).clone())),
                    _ => {
                        let map = self.map();
                        MonReply::Map(newer(&map).then(|| (*map).clone()))
                    }
                }
            }
            MonRequest::Command(command) => {
                let mut state = self.lock();
                self.apply(&mut state, &command)
            }
            MonRequest::Status => MonReply::Status(self.status()),
        };
        Some(reply.to_message())
    }

    fn heartbeat(&self, osd: OsdId, report: OsdReport) -> MonReply {
        let mut state = self.lock();
        let Some(entry) = state.map.osds.get(&osd).cloned() else {
            return MonReply::Error(format!("{osd} is not in the map; boot first"));
        };
        let now = Instant::now();
        state.liveness.heartbeat(osd, now);
        let previous = state
            .reports
            .remove(&osd)
            .map(|report| (report.at, report.report));
        state.reports.insert(
            osd,
            Report {
                at: now,
                report,
                previous,
            },
        );
        if !entry.up {
            // Back from down: marked up (and in) again, as a boot would.
            let command = Command::OsdBoot {
                uuid: entry.uuid,
                host: entry.host,
                address: entry.address,
                weight: entry.weight,
            };
            if let MonReply::Error(error) = self.apply(&mut state, &command) {
                return MonReply::Error(error);
            }
        }
        MonReply::Ok
    }

    fn status(&self) -> ClusterStatus {
        let state = self.lock();
        let mut ops = (0.0, 0.0);
        let mut bytes = (0.0, 0.0);
        let mut reports = Vec::new();
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
            reports.push((osd, report.report.clone()));
        }
        let address = self.address.get().cloned().unwrap_or_default();
        ClusterStatus {
            map: state.map.clone(),
            monitors: vec![address.clone()],
            leader: address,
            reports,
            ops_per_second: ops,
            bytes_per_second: bytes,
        }
    }

    /// Marks OSDs down or out as their heartbeats stop.
    fn check_liveness(&self) {
        let mut state = self.lock();
        for verdict in state.liveness.check(Instant::now()) {
            let command = match verdict {
                Verdict::Down(id) => {
                    tracing::warn!(%id, "no heartbeat within the grace: marking it down");
                    Command::OsdDown { id }
                }
                Verdict::Out(id) => {
                    tracing::warn!(%id, "down past the down-out interval: marking it out");
                    Command::OsdOut { id }
                }
            };
            if let MonReply::Error(error) = self.apply(&mut state, &command) {
                tracing::error!(%error, "cannot apply a liveness verdict");
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

/// Starts a monitor: loads its map, listens, and checks liveness until dropped.
pub async fn start(config: MonConfig) -> Result<Running, MonError> {
    std::fs::create_dir_all(&config.data_dir).map_err(io_error(&config.data_dir))?;
    let map_path = config.data_dir.join(MAP_FILE);
    let map = load_map(&map_path)?;
    let mut liveness = Liveness::new(config.grace, config.down_out_interval);
    let now = Instant::now();
    // OSDs that were up when the monitor stopped get a grace from now to report in.
    for osd in map.osds.values().filter(|osd| osd.up) {
        liveness.heartbeat(osd.id, now);
    }
    let listener_address = config.listen;
    let (maps, _) = watch::channel(Arc::new(map.clone()));
    let monitor = Arc::new(Monitor {
        state: Mutex::new(State {
            map,
            liveness,
            reports: BTreeMap::new(),
        }),
        maps,
        map_path,
        address: std::sync::OnceLock::new(),
    });
    let handler_monitor = monitor.clone();
    let handler: Handler =
        Arc::new(move |message| Box::pin(handler_monitor.clone().handle(message)));
    let server = Server::bind(listener_address, handler)
        .await
        .map_err(|source| MonError::Listen {
            address: listener_address,
            source,
        })?;
    let address = server.address();
    // The address is known only once bound (port 0 picks one).
    let _ = monitor.address.set(address.to_string());
    let checker = monitor.clone();
    let mut tasks = vec![tokio::spawn(async move {
        let mut interval = tokio::time::interval(CHECK_INTERVAL);
        loop {
            interval.tick().await;
            checker.check_liveness();
        }
    })];
    let mut metrics_address = None;
    if let Some(address) = config.metrics_addr {
        let rendering = monitor.clone();
        let (bound, task) = metrics::serve(address, Arc::new(move || rendering.render_metrics()))
            .await
            .map_err(|source| MonError::Listen { address, source })?;
        metrics_address = Some(bound);
        tasks.push(task);
    }
    tracing::info!(%address, epoch = monitor.map().epoch.0, "monitor started");
    Ok(Running {
        monitor,
        address,
        metrics_address,
        _server: server,
        tasks,
    })
}
