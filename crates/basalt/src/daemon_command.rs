//! `basalt mon` and `basalt osd`: the daemons, configured by flags or a TOML file.
//!
//! ```toml
//! [cluster]
//! mons = ["127.0.0.1:6780"]
//!
//! [mon]
//! data_dir = "/var/lib/basalt/mon"
//! listen = "127.0.0.1:6780"
//! peers = ["127.0.0.1:6780", "127.0.0.1:6781", "127.0.0.1:6782"]
//! grace_seconds = 6
//! down_out_seconds = 600
//! metrics_addr = "127.0.0.1:9480"
//! max_pgs_per_osd = 1000
//!
//! [osd]
//! data_dir = "/var/lib/basalt/osd.0"
//! # device = "/dev/nvme1n1"   # default: data_dir/osd.log, a file
//! # format = true             # format a device holding no Basalt superblock
//! listen = "127.0.0.1:0"
//! host = "node1"
//! device_size = "4GiB"
//! sparse_device = false
//! metrics_addr = "127.0.0.1:9481"
//! max_moves = 4
//! scrub_interval_seconds = 604800
//! ```
//!
//! Flags win over the file.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::Duration;

use anyhow::Context;
use basalt_common::ByteSize;
use serde::Deserialize;

/// A config file: the cluster's monitors and each daemon's settings.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ConfigFile {
    /// Where the cluster is.
    #[serde(default)]
    pub cluster: ClusterSection,
    /// The monitor's settings.
    #[serde(default)]
    pub mon: MonSection,
    /// The OSD's settings.
    #[serde(default)]
    pub osd: OsdSection,
}

/// `[cluster]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClusterSection {
    /// Monitor addresses.
    #[serde(default)]
    pub mons: Vec<String>,
}

/// `[mon]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MonSection {
    data_dir: Option<PathBuf>,
    listen: Option<SocketAddr>,
    grace_seconds: Option<u64>,
    down_out_seconds: Option<u64>,
    metrics_addr: Option<SocketAddr>,
    max_pgs_per_osd: Option<u32>,
    #[serde(default)]
    peers: Vec<String>,
}

/// `[osd]`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OsdSection {
    data_dir: Option<PathBuf>,
    device: Option<PathBuf>,
    format: Option<bool>,
    listen: Option<SocketAddr>,
    host: Option<String>,
    weight: Option<f64>,
    device_size: Option<String>,
    sparse_device: Option<bool>,
    metrics_addr: Option<SocketAddr>,
    max_moves: Option<usize>,
    poll_us: Option<u64>,
    scrub_interval_seconds: Option<u64>,
}

/// Reads a config file.
pub fn read_config(path: &Path) -> anyhow::Result<ConfigFile> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    toml::from_str(&text)
        .with_context(|| format!("{} is not a valid basalt config", path.display()))
}

/// Resolves monitor addresses (`host:port`, comma-separated or one per entry), one address
/// per monitor.
pub fn resolve_mons(mons: &[String]) -> anyhow::Result<Vec<SocketAddr>> {
    use std::net::ToSocketAddrs;
    let mut addresses = Vec::new();
    for mon in mons
        .iter()
        .flat_map(|m| m.split(','))
        .filter(|m| !m.is_empty())
    {
        // One address per monitor: a name that resolves to both IPv4 and IPv6 must not
        // count as two monitors (as raft peers, it would double the group).
        let address = mon
            .to_socket_addrs()
            .with_context(|| format!("monitor address {mon:?} (expected host:port)"))?
            .next()
            .with_context(|| format!("monitor address {mon:?} resolves to nothing"))?;
        addresses.push(address);
    }
    anyhow::ensure!(!addresses.is_empty(), "no monitor address given");
    Ok(addresses)
}

/// Options of `basalt mon`.
#[derive(clap::Args)]
pub struct MonArgs {
    /// Where the map is kept.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Address to listen on.
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Seconds without heartbeats before an OSD is marked down.
    #[arg(long)]
    pub grace: Option<u64>,
    /// Seconds down before an OSD is marked out and its PGs move.
    #[arg(long)]
    pub down_out_interval: Option<u64>,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// Refuse a new pool that would put more PG replicas than this on each OSD in (each is
    /// a raft group on its OSD, and every PG is in the map). Default 1000.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_pgs_per_osd: Option<u32>,
    /// Every monitor of the cluster, this one's --listen address included (1, 3 or 5;
    /// the same list on each). Without it, this monitor is the only one.
    #[arg(long, value_delimiter = ',')]
    pub peers: Vec<String>,
    /// A TOML config file (its [mon] section).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

pub fn run_mon(args: MonArgs) -> anyhow::Result<ExitCode> {
    let file = match &args.config {
        Some(path) => read_config(path)?,
        None => ConfigFile::default(),
    };
    let section = file.mon;
    let config = basalt_mon::server::MonConfig {
        data_dir: args
            .data_dir
            .or(section.data_dir)
            .unwrap_or_else(|| PathBuf::from("/var/lib/basalt/mon")),
        listen: args
            .listen
            .or(section.listen)
            .unwrap_or_else(|| "127.0.0.1:6780".parse().expect("address")),
        grace: match args.grace.or(section.grace_seconds).unwrap_or(6) {
            seconds @ GRACE_MIN_SECONDS.. => Duration::from_secs(seconds),
            seconds => anyhow::bail!(
                "--grace {seconds}: at least {GRACE_MIN_SECONDS} seconds (OSDs send a heartbeat \
                 every {} s; a shorter grace marks live OSDs down whenever one is late, and \
                 every mark moves their PGs' leaders)",
                basalt_osd::daemon::HEARTBEAT_INTERVAL.as_secs()
            ),
        },
        down_out_interval: Duration::from_secs(
            args.down_out_interval
                .or(section.down_out_seconds)
                .unwrap_or(600),
        ),
        metrics_addr: args.metrics_addr.or(section.metrics_addr),
        max_pgs_per_osd: match args.max_pgs_per_osd.or(section.max_pgs_per_osd) {
            Some(0) => anyhow::bail!("[mon] max_pgs_per_osd: at least 1"),
            Some(max) => max,
            None => basalt_mon::map::PGS_PER_OSD_MAX_DEFAULT,
        },
        peers: match (args.peers.is_empty(), section.peers.is_empty()) {
            (false, _) => resolve_mons(&args.peers).context("--peers")?,
            (true, false) => resolve_mons(&section.peers).context("[mon] peers")?,
            // A config file shared by every node names the monitors once, in [cluster].
            (true, true) if file.cluster.mons.len() > 1 => {
                resolve_mons(&file.cluster.mons).context("[cluster] mons")?
            }
            (true, true) => Vec::new(),
        },
    };
    let monitors = config.peers.len().max(1);
    if monitors.is_multiple_of(2) {
        eprintln!(
            "basalt mon: note: {monitors} monitors survive the loss of no more than {} \
             would; an odd number (1, 3 or 5) is the usual choice",
            monitors - 1
        );
    }
    crate::control_runtime()?.block_on(async move {
        let running = basalt_mon::server::start(config).await?;
        println!("basalt mon: listening on {}", running.address);
        crate::shutdown_signal().await?;
        drop(running);
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}

/// The shortest grace `basalt mon` takes: three OSD heartbeats.
const GRACE_MIN_SECONDS: u64 = 3;

/// Options of `basalt osd` (the daemon).
#[derive(clap::Args)]
pub struct OsdArgs {
    /// Where its small files live (a lock, the checksum error count), and its device file
    /// `osd.log` unless --device names another.
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
    /// Its device: a raw block device (e.g. /dev/nvme1n1; formatted only with --format) or
    /// a file (created on first start when missing). Default: DATA_DIR/osd.log.
    #[arg(long)]
    pub device: Option<PathBuf>,
    /// Format the device if it holds no Basalt superblock (a new block device), erasing
    /// what it holds. A device that holds one is used as it is, so the flag can stay in a
    /// service's command line.
    #[arg(long)]
    pub format: bool,
    /// Monitor addresses.
    #[arg(long, value_delimiter = ',')]
    pub mon: Vec<String>,
    /// Address to listen on for clients and peers (port 0: any free port).
    #[arg(long)]
    pub listen: Option<SocketAddr>,
    /// Its host, the failure domain (default: this machine's hostname).
    #[arg(long)]
    pub host: Option<String>,
    /// Its share of PGs.
    #[arg(long)]
    pub weight: Option<f64>,
    /// Size of the device file created on first start (a block device has its own).
    #[arg(long)]
    pub device_size: Option<ByteSize>,
    /// Create the device file sparse: a hole instead of zeroes written over it, so it takes
    /// space only as the log first reaches it (quick to create; those first writes are
    /// slower). For test and development clusters.
    #[arg(long)]
    pub sparse_device: bool,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    pub metrics_addr: Option<SocketAddr>,
    /// PGs led by this OSD that may be adding members at once when PGs move (new replicas
    /// catching up), the others waiting their turn; also the snapshots it installs at
    /// once as a new replica. Default 4.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_moves: Option<u32>,
    /// Microseconds the OSD's thread stays awake after each piece of work, checking its
    /// sockets and device without sleeping, while its writes come one at a time (0: never,
    /// the default). Cuts QD1 latency; the CPU stays busy while it polls.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub poll_us: Option<u64>,
    /// Seconds between background scrubs of each PG this OSD leads: every replica reads
    /// the PG back from its device and digests it as of one entry of its log, and
    /// `basalt status` names the PGs whose replicas differ (0: never). Default a week.
    #[arg(long, value_parser = clap::value_parser!(u64).range(0..=SCRUB_INTERVAL_MAX_SECONDS))]
    pub scrub_interval_seconds: Option<u64>,
    /// A TOML config file (its [cluster] and [osd] sections).
    #[arg(long)]
    pub config: Option<PathBuf>,
}

/// The longest background scrub interval taken: a year.
const SCRUB_INTERVAL_MAX_SECONDS: u64 = 365 * 24 * 3600;

fn hostname() -> String {
    basalt_io::process::hostname().unwrap_or_else(|| "localhost".to_string())
}

pub fn run_osd(args: OsdArgs) -> anyhow::Result<ExitCode> {
    let file = match &args.config {
        Some(path) => read_config(path)?,
        None => ConfigFile::default(),
    };
    let section = file.osd;
    let mons = if args.mon.is_empty() {
        file.cluster.mons
    } else {
        args.mon
    };
    let device_size = match (args.device_size, section.device_size) {
        (Some(size), _) => size.0,
        (None, Some(text)) => {
            text.parse::<ByteSize>()
                .map_err(|error| anyhow::anyhow!("[osd] device_size {text:?}: {error}"))?
                .0
        }
        (None, None) => 4 << 30,
    };
    let config = basalt_osd::daemon::OsdConfig {
        data_dir: args
            .data_dir
            .or(section.data_dir)
            .context("--data-dir is required")?,
        device: args.device.or(section.device),
        format: args.format || section.format == Some(true),
        device_size_bytes: device_size,
        device_fill: if args.sparse_device || section.sparse_device == Some(true) {
            basalt_osd::log_device::Fill::Sparse
        } else {
            basalt_osd::log_device::Fill::Zeroes
        },
        mons: resolve_mons(&mons)?,
        listen: match args
            .listen
            .or(section.listen)
            .unwrap_or_else(|| "127.0.0.1:0".parse().expect("address"))
        {
            unspecified if unspecified.ip().is_unspecified() => anyhow::bail!(
                "--listen {unspecified}: give the address of one interface (the OSD puts it \
                 in the map, where its peers and clients look it up)"
            ),
            listen => listen,
        },
        host: args.host.or(section.host).unwrap_or_else(hostname),
        weight: args.weight.or(section.weight).unwrap_or(1.0),
        metrics_addr: args.metrics_addr.or(section.metrics_addr),
        max_moves: match (args.max_moves, section.max_moves) {
            (Some(moves), _) => moves as usize,
            (None, Some(0)) => anyhow::bail!("[osd] max_moves: at least 1"),
            (None, Some(moves)) => moves,
            (None, None) => basalt_osd::daemon::MAX_MOVES_DEFAULT,
        },
        poll: std::time::Duration::from_micros(match (args.poll_us, section.poll_us) {
            (Some(micros), _) => micros,
            (None, Some(micros)) if micros > 1_000_000 => {
                anyhow::bail!("[osd] poll_us: at most 1000000 (one second)")
            }
            (None, micros) => micros.unwrap_or(0),
        }),
        scrub_interval: match args
            .scrub_interval_seconds
            .or(section.scrub_interval_seconds)
            .unwrap_or(basalt_osd::daemon::SCRUB_INTERVAL_DEFAULT.as_secs())
        {
            0 => None,
            seconds if seconds > SCRUB_INTERVAL_MAX_SECONDS => {
                anyhow::bail!(
                    "[osd] scrub_interval_seconds: at most {SCRUB_INTERVAL_MAX_SECONDS} (a year)"
                )
            }
            seconds => Some(Duration::from_secs(seconds)),
        },
    };
    crate::control_runtime()?.block_on(async move {
        let running = basalt_osd::daemon::start(config).await?;
        println!(
            "basalt osd: {} listening on {}",
            running.id, running.address
        );
        running
            .wait(async {
                let _ = crate::shutdown_signal().await;
            })
            .await?;
        anyhow::Ok(())
    })?;
    Ok(ExitCode::SUCCESS)
}
