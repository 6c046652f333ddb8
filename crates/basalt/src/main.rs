//! `basalt`: the one binary of Basalt.
//!
//! - `basalt target`: the target process (bdevs, NBD exports) managed by JSON-RPC.
//! - `basalt rpc`: a JSON-RPC client for the target, like SPDK's `rpc.py`.
//! - `basalt bench`: the benchmark tool.
//! - `basalt dev`: a local target with a RAM-backed NBD export, for trying Basalt out.
//!
//! Only this crate knows clap, anyhow and the log format.

mod bench_command;
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
    /// Start a local target with a RAM-backed NBD export and print how to connect.
    Dev(dev_command::DevArgs),
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let default_level = match cli.command {
        Command::Target(_) | Command::Dev(_) => "info",
        _ => "warn",
    };
    let filter = tracing_subscriber::EnvFilter::try_from_env("BASALT_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_level));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Target(args) => target_command::run(args),
        Command::Rpc(args) => rpc_command::run(args),
        Command::Bench(args) => bench_command::run(args),
        Command::Dev(args) => dev_command::run(args),
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
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;
    tokio::select! {
        result = tokio::signal::ctrl_c() => result?,
        _ = terminate.recv() => {}
    }
    Ok(())
}
