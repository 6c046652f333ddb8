//! `basalt dev`: a target on loopback with a RAM-backed NBD export, for trying Basalt out.
//!
//! Until the distributed store lands, the export is a malloc bdev: its data lives in RAM and
//! is gone when the command stops.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::Context;
use basalt_common::ByteSize;
use basalt_target::Target;
use basalt_target::rpc_server::RpcServer;
use serde_json::json;

/// Options of `basalt dev`.
#[derive(clap::Args)]
pub struct DevArgs {
    /// Directory for the JSON-RPC socket and state.
    #[arg(long, default_value = "/var/tmp/basalt-dev")]
    pub data_dir: PathBuf,
    /// Size of the exported volume.
    #[arg(long, default_value = "1GiB")]
    pub size: ByteSize,
    /// NBD port on 127.0.0.1.
    #[arg(long, default_value_t = 10809)]
    pub nbd_port: u16,
}

pub fn run(args: DevArgs) -> anyhow::Result<ExitCode> {
    crate::control_runtime()?.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

async fn serve(args: DevArgs) -> anyhow::Result<()> {
    std::fs::create_dir_all(&args.data_dir)
        .with_context(|| format!("creating {}", args.data_dir.display()))?;
    let socket = args.data_dir.join("target.sock");
    let target = Target::new(crate::core_count(), basalt_io::Placement::IncomingCpu)
        .context("starting the reactors")?;
    // 512-byte blocks: every client, however it aligns its requests, can use the volume.
    let block_size = 512u64;
    let calls = [
        (
            "bdev_malloc_create",
            json!({"name": "disk0", "num_blocks": args.size.0 / block_size, "block_size": block_size}),
        ),
        (
            "nbd_server_start",
            json!({"listen_address": "127.0.0.1", "port": args.nbd_port}),
        ),
        (
            "nbd_server_add_export",
            json!({"bdev_name": "disk0", "name": "disk0"}),
        ),
    ];
    for (method, params) in calls {
        target
            .call(method, params)
            .await
            .with_context(|| format!("{method} failed"))?;
    }
    let server =
        RpcServer::bind(&socket).with_context(|| format!("binding {}", socket.display()))?;
    let uri = format!("nbd://127.0.0.1:{}/disk0", args.nbd_port);
    println!(
        "basalt dev: a target with a {} RAM-backed volume (its data is lost when this stops)",
        args.size
    );
    println!("  NBD export:  {uri}");
    println!(
        "  JSON-RPC:    basalt rpc -s {} bdev_get_bdevs",
        socket.display()
    );
    println!(
        "  try:         qemu-io -f raw {uri} -c 'write -P 0xab 0 64k' -c 'read -P 0xab 0 64k'"
    );
    println!("  bench:       basalt bench --nbd {uri} --rw randwrite --iodepth 32 --runtime 10");
    println!("Ctrl-C stops it.");
    tokio::select! {
        result = server.run(target.clone()) => result.context("JSON-RPC server failed")?,
        result = crate::shutdown_signal() => result?,
    }
    target.nbd.stop();
    println!("basalt dev: stopped");
    Ok(())
}
