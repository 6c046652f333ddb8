//! `basalt target`.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use basalt_io::Placement;
use basalt_target::rpc_server::RpcServer;
use basalt_target::{DEFAULT_RPC_SOCKET, Target, config};

/// Options of `basalt target`.
#[derive(clap::Args)]
pub struct TargetArgs {
    /// JSON-RPC Unix socket (created with mode 0600).
    #[arg(short = 'r', long, default_value = DEFAULT_RPC_SOCKET)]
    pub rpc_socket: PathBuf,
    /// Start from this configuration (the JSON `save_config` returns).
    #[arg(short = 'c', long)]
    pub config: Option<PathBuf>,
    /// Directory of the vhost-user sockets (one per controller, named after it).
    #[arg(short = 'S', long, default_value = "/var/tmp")]
    pub vhost_socket_dir: PathBuf,
    /// Reactor threads serving frontend connections (default: one per core).
    #[arg(short = 'm', long)]
    pub reactors: Option<usize>,
    /// Where new connections (NBD connections, NVMe/TCP queue pairs) go: round-robin (each
    /// to the next reactor), incoming-cpu (the reactor on the CPU the connection's packets
    /// arrive on), or weighted-round-robin (smooth, by --reactor-weights).
    #[arg(long, default_value = "round-robin")]
    pub reactor_placement: Placement,
    /// Weights of the reactors for weighted-round-robin, one per reactor (e.g. 2,1 gives
    /// the first reactor twice the connections of the second).
    #[arg(long, value_delimiter = ',')]
    pub reactor_weights: Vec<u32>,
    /// Microseconds an NVMe/TCP queue pair polls its socket and its commands in flight
    /// before its reactor sleeps (0: no polling). Pays most when the reactors have CPUs of
    /// their own (`-m` and `taskset`); on a machine shared with the clients it offers the
    /// CPU to them at each round.
    #[arg(long, default_value_t = 0, value_parser = clap::value_parser!(u64).range(0..=1_000_000))]
    pub poll_us: u64,
    /// Serve Prometheus metrics on this address (each bdev's I/O counters, what is
    /// connected to each frontend).
    #[arg(long)]
    pub metrics_addr: Option<std::net::SocketAddr>,
}

pub fn run(args: TargetArgs) -> anyhow::Result<ExitCode> {
    // The control plane (JSON-RPC, accepting connections) runs on this thread; connections
    // are served by the target's reactor threads.
    crate::control_runtime()?.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: TargetArgs) -> anyhow::Result<()> {
    let reactors = args.reactors.unwrap_or_else(crate::core_count);
    let target = Target::new(
        reactors,
        args.reactor_placement,
        args.vhost_socket_dir.clone(),
    )
    .context("starting the reactors")?;
    if !args.reactor_weights.is_empty() {
        if args.reactor_placement != Placement::WeightedRoundRobin {
            anyhow::bail!("--reactor-weights needs --reactor-placement weighted-round-robin");
        }
        target
            .reactors
            .set_weights(&args.reactor_weights)
            .context("--reactor-weights")?;
    }
    target
        .reactors
        .set_poll(std::time::Duration::from_micros(args.poll_us));
    if let Some(path) = &args.config {
        config::load(&target, path)
            .await
            .context("loading the configuration")?;
    }
    // Served until the process ends.
    if let Some(address) = args.metrics_addr {
        let rendered = target.clone();
        let render = std::sync::Arc::new(move || basalt_target::metrics::render(&rendered));
        let (bound, _served) = basalt_wire::metrics::serve(address, render)
            .await
            .with_context(|| format!("serving metrics on {address}"))?;
        tracing::info!(address = %bound, "metrics served");
    }
    let server = RpcServer::bind(&args.rpc_socket)
        .with_context(|| format!("binding the JSON-RPC socket {}", args.rpc_socket.display()))?;
    tracing::info!(socket = %args.rpc_socket.display(), "target ready for JSON-RPC");
    tokio::select! {
        result = server.run(target.clone()) => result.context("JSON-RPC server failed")?,
        result = crate::shutdown_signal() => result?,
    }
    tracing::info!("target stopping");
    target.nbd.stop();
    target.nvmf.shutdown();
    target.vhost.shutdown();
    Ok(())
}
