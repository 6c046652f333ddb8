//! `basalt`: the one binary of Basalt.
//!
//! - `basalt target`: the target process (bdevs, NBD exports) managed by JSON-RPC.
//! - `basalt rpc`: a JSON-RPC client for the target, like SPDK's `rpc.py`.
//! - `basalt bench`: the benchmark tool.
//! - `basalt dev`: a local cluster (a monitor, three OSDs, a target exporting an image).
//! - `basalt mon`, `basalt osd`: the daemons of the cluster.
//! - `basalt pool|image|osd ls|pg ls|status`: the cluster's administration.
//!
//! Only this crate knows clap, anyhow and the log format.

mod admin_command;
mod bench_command;
mod daemon_command;
mod dev_command;
mod rpc_command;
mod target_command;

use std::process::ExitCode;

use clap::{Parser, Subcommand};

/// Basalt: replicated block storage served over NVMe/TCP, vhost-user-blk and NBD.
#[derive(Parser)]
#[command(name = "basalt", version, about)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a target: bdevs exported through frontends, managed by JSON-RPC.
    Target(target_command::TargetArgs),
    /// Call a JSON-RPC method of a running target: `basalt rpc bdev_get_bdevs`.
    Rpc(rpc_command::RpcArgs),
    /// Measure a bdev or an NBD export: IOPS, bandwidth, latency percentiles.
    Bench(bench_command::BenchArgs),
    /// Start a local cluster (a monitor, three OSDs, a target exporting an image over NBD).
    Dev(dev_command::DevArgs),
    /// Run a monitor.
    Mon(daemon_command::MonArgs),
    /// Run an OSD (`basalt osd --data-dir DIR --mon ADDR`), list OSDs (`basalt osd ls`), or
    /// move data off an OSD and back (`basalt osd out|in ID`).
    Osd(OsdCommand),
    /// Create, list and remove pools.
    Pool {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        #[command(subcommand)]
        command: admin_command::PoolCommand,
    },
    /// Create, list, inspect, resize and remove images.
    Image {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        #[command(subcommand)]
        command: admin_command::ImageCommand,
    },
    /// List PGs with their members, leader and state.
    Pg {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        #[command(subcommand)]
        command: PgCommand,
    },
    /// The cluster at a glance.
    Status {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

#[derive(clap::Args)]
#[command(args_conflicts_with_subcommands = true)]
struct OsdCommand {
    #[command(subcommand)]
    action: Option<OsdAction>,
    #[command(flatten)]
    daemon: daemon_command::OsdArgs,
}

#[derive(Subcommand)]
enum OsdAction {
    /// List OSDs.
    Ls {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Mark an OSD out: its PGs move to other OSDs (it keeps running and serving them
    /// until they have).
    Out {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        /// The OSD (`3` or `osd.3`).
        id: String,
    },
    /// Mark an OSD in: PGs move to it again.
    In {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        /// The OSD (`3` or `osd.3`).
        id: String,
    },
    /// Remove an OSD from the cluster for good (a dead disk): it must be down and out,
    /// its PGs moved; its id is not given again and its device may not rejoin.
    Rm {
        #[command(flatten)]
        cluster: admin_command::ClusterArgs,
        /// The OSD (`3` or `osd.3`).
        id: String,
    },
}

#[derive(Subcommand)]
enum PgCommand {
    /// List PGs.
    Ls {
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Each replica's state of a PG: raft indexes and a digest of its data.
    Query {
        /// The PG, as `basalt pg ls` shows it (`1.3f`).
        pg: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Compares the data of each PG's replicas, read back from their devices (every PG
    /// unless some are named); fails if any differ or could not be compared.
    Scrub {
        /// PGs, as `basalt pg ls` shows them (`1.3f`); all if none.
        pgs: Vec<String>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Rebuilds the replicas of PGs whose data differs from the majority's (as the last
    /// background scrub found, or a scrub now) from the PG's leader, then scrubs the PG
    /// again to confirm; fails if a PG could not be repaired or confirmed.
    Repair {
        /// PGs, as `basalt pg ls` shows them (`1.3f`).
        #[arg(required = true)]
        pgs: Vec<String>,
        /// Rebuild this OSD's replica (an id, as `basalt osd ls` shows it), whatever the
        /// scrubs found: for a disk known to be bad.
        #[arg(long)]
        osd: Option<String>,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Has the replicas of a PG that no replica can lead give up the raft log entries they
    /// cannot send: those past their commit index whose payload is damaged and that the
    /// other replicas lack (a damaged replica would be elected, fail to send them, and step
    /// down, again and again). A write among them that was acknowledged is lost unless the
    /// replicas that may hold it too (down, or removed) come back first: the operator's
    /// last resort, for replicas lost for good, as Ceph's `mark_unfound_lost`.
    MarkUnfoundLost {
        /// The PG, as `basalt pg ls` shows it (`1.3f`).
        pg: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
    /// Makes the surviving replica of a PG with the most of its raft log the PG's only
    /// voter, when its voters removed from the cluster (`basalt osd rm`: lost for good)
    /// leave it no quorum; it then moves the PG to its members as it does any. Every member
    /// not removed (voter or learner) must answer. Its whole log counts committed, so a
    /// write acknowledged with copies on the removed OSDs alone is lost: the operator's
    /// last resort.
    ForceQuorum {
        /// The PG, as `basalt pg ls` shows it (`1.3f`).
        pg: String,
        /// JSON output.
        #[arg(long)]
        json: bool,
    },
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if matches!(
        cli.command,
        Command::Pool { .. }
            | Command::Image { .. }
            | Command::Pg { .. }
            | Command::Status { .. }
            | Command::Osd(OsdCommand {
                action: Some(_),
                ..
            })
    ) {
        basalt_io::default_sigpipe();
    }
    let default_level = match cli.command {
        Command::Target(_) | Command::Dev(_) | Command::Mon(_) => "info",
        Command::Osd(OsdCommand { action: None, .. }) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("BASALT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    // Colours only on a terminal: a log file or a pipe gets plain text.
    let colours = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(colours)
        .init();
    let result = match cli.command {
        Command::Target(args) => target_command::run(args),
        Command::Rpc(args) => rpc_command::run(args),
        Command::Bench(args) => bench_command::run(args),
        Command::Dev(args) => dev_command::run(args),
        Command::Mon(args) => daemon_command::run_mon(args),
        Command::Osd(OsdCommand {
            action: Some(OsdAction::Ls { cluster, json }),
            ..
        }) => admin_command::run_osd_ls(cluster, json),
        Command::Osd(OsdCommand {
            action: Some(OsdAction::Out { cluster, id }),
            ..
        }) => admin_command::run_osd_mark(cluster, &id, false),
        Command::Osd(OsdCommand {
            action: Some(OsdAction::In { cluster, id }),
            ..
        }) => admin_command::run_osd_mark(cluster, &id, true),
        Command::Osd(OsdCommand {
            action: Some(OsdAction::Rm { cluster, id }),
            ..
        }) => admin_command::run_osd_rm(cluster, &id),
        Command::Osd(OsdCommand { daemon, .. }) => daemon_command::run_osd(daemon),
        Command::Pool { cluster, command } => admin_command::run_pool(cluster, command),
        Command::Image { cluster, command } => admin_command::run_image(cluster, command),
        Command::Pg {
            cluster,
            command: PgCommand::Ls { json },
        } => admin_command::run_pg_ls(cluster, json),
        Command::Pg {
            cluster,
            command: PgCommand::Query { pg, json },
        } => admin_command::run_pg_query(cluster, pg, json),
        Command::Pg {
            cluster,
            command: PgCommand::Scrub { pgs, json },
        } => admin_command::run_pg_scrub(cluster, pgs, json),
        Command::Pg {
            cluster,
            command: PgCommand::Repair { pgs, osd, json },
        } => admin_command::run_pg_repair(cluster, pgs, osd, json),
        Command::Pg {
            cluster,
            command: PgCommand::MarkUnfoundLost { pg, json },
        } => admin_command::run_pg_mark_unfound_lost(cluster, pg, json),
        Command::Pg {
            cluster,
            command: PgCommand::ForceQuorum { pg, json },
        } => admin_command::run_pg_force_quorum(cluster, pg, json),
        Command::Status { cluster, json } => admin_command::run_status(cluster, json),
    };
    match result {
        Ok(code) => code,
        Err(error) => {
            eprintln!("basalt: {error:#}");
            ExitCode::FAILURE
        }
    }
}

/// A tokio runtime with `threads` workers (at least one).
fn runtime(threads: usize, name: &str) -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_multi_thread()
        .worker_threads(threads.max(1))
        .thread_name(name)
        .enable_all()
        .build()?)
}

/// The single-threaded runtime of a daemon's control plane.
fn control_runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// One per core, the default number of reactors.
fn core_count() -> usize {
    std::thread::available_parallelism().map_or(1, usize::from)
}

/// Waits for Ctrl-C or SIGTERM.
async fn shutdown_signal() -> anyhow::Result<()> {
    StopSignals::new()?.wait().await;
    Ok(())
}

/// Ctrl-C and SIGTERM, listened for from the moment this is made: one that comes before
/// [`StopSignals::wait`] is kept for it (`basalt dev` listens through its start-up).
struct StopSignals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
}

impl StopSignals {
    fn new() -> anyhow::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
        })
    }

    async fn wait(&mut self) {
        tokio::select! {
            _ = self.interrupt.recv() => {}
            _ = self.terminate.recv() => {}
        }
    }
}
