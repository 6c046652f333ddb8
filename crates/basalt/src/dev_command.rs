//! `basalt dev`: a whole cluster on this machine, for trying Basalt out.
//!
//! One monitor and three OSDs, each its own `basalt mon` / `basalt osd` process with its
//! data under the data directory, and a target in this process that exports the image
//! `dev/disk0` over NBD and NVMe/TCP on loopback. It writes a client config (`basalt.toml`) for the CLI,
//! prints how to connect, and on Ctrl-C or SIGTERM stops everything. Run again, it reuses
//! the data.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, ExitCode, Stdio};
use std::time::{Duration, Instant};

use anyhow::Context;
use basalt_common::ByteSize;
use basalt_mon::MonClient;
use basalt_mon::map::Command;
use basalt_target::Target;
use basalt_target::rpc_server::RpcServer;
use serde_json::json;

/// The pool `basalt dev` creates.
pub const POOL: &str = "dev";
/// The image it exports.
pub const IMAGE: &str = "disk0";
/// The NVMe subsystem that exports the image.
pub const NQN: &str = "nqn.2016-06.io.basalt:disk0";

/// Options of `basalt dev`.
#[derive(clap::Args)]
pub struct DevArgs {
    /// Directory for the daemons' data, logs, the client config and the JSON-RPC socket.
    #[arg(long, default_value = "/var/tmp/basalt-dev")]
    pub data_dir: PathBuf,
    /// Size of the exported image (when it is created).
    #[arg(long, default_value = "1GiB")]
    pub size: ByteSize,
    /// NBD port on 127.0.0.1.
    #[arg(long, default_value_t = 10809)]
    pub nbd_port: u16,
    /// NVMe/TCP port on 127.0.0.1.
    #[arg(long, default_value_t = 4420)]
    pub nvmf_port: u16,
    /// The monitor's port on 127.0.0.1.
    #[arg(long, default_value_t = 6780)]
    pub mon_port: u16,
    /// Number of OSDs.
    #[arg(long, default_value_t = 3)]
    pub osds: u32,
    /// Size of each OSD's device file (when it is created).
    #[arg(long, default_value = "4GiB")]
    pub osd_size: ByteSize,
    /// Create the OSDs' device files sparse (`basalt osd --sparse-device`): quick, and they
    /// take space only as written, but the first writes to each part are slower.
    #[arg(long)]
    pub sparse_osds: bool,
    /// PGs of the pool (when it is created).
    #[arg(long, default_value_t = 32)]
    pub pg_count: u32,
}

pub fn run(args: DevArgs) -> anyhow::Result<ExitCode> {
    crate::control_runtime()?.block_on(serve(args))?;
    Ok(ExitCode::SUCCESS)
}

/// The daemons this command started; stopped (SIGTERM, then SIGKILL) when dropped.
struct Children(Vec<(String, Child)>);

impl Children {
    fn spawn(&mut self, name: &str, log: &Path, args: &[String]) -> anyhow::Result<()> {
        let exe = std::env::current_exe().context("finding the basalt executable")?;
        let log_file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(log)
            .with_context(|| format!("opening {}", log.display()))?;
        let child = std::process::Command::new(exe)
            .args(args)
            .stdin(Stdio::null())
            .stdout(log_file.try_clone()?)
            .stderr(log_file)
            .spawn()
            .with_context(|| format!("starting {name}"))?;
        self.0.push((name.to_string(), child));
        Ok(())
    }

    /// The first child that exited, with its status.
    fn exited(&mut self) -> Option<String> {
        self.0
            .iter_mut()
            .find_map(|(name, child)| match child.try_wait() {
                Ok(Some(status)) => Some(format!("{name} exited ({status})")),
                _ => None,
            })
    }

    /// The children that exited since the last call, each reported once.
    fn newly_exited(&mut self) -> Vec<String> {
        let mut exited = Vec::new();
        self.0.retain_mut(|(name, child)| match child.try_wait() {
            Ok(Some(status)) => {
                exited.push(format!("{name} exited ({status})"));
                false
            }
            _ => true,
        });
        exited
    }
}

impl Drop for Children {
    fn drop(&mut self) {
        // The monitor last: OSDs stopping hand their PGs over (a few seconds at most when
        // all stop) and have the monitor mark them down.
        let (mons, others): (Vec<_>, Vec<_>) =
            self.0.drain(..).partition(|(name, _)| name == "mon");
        stop(others, Duration::from_secs(10));
        stop(mons, Duration::from_secs(5));
    }
}

/// Stops `children`: SIGTERM, then SIGKILL to those still running after `within`.
fn stop(mut children: Vec<(String, Child)>, within: Duration) {
    for (_, child) in &mut children {
        let _ = std::process::Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    let deadline = Instant::now() + within;
    for (_, child) in &mut children {
        while Instant::now() < deadline {
            if matches!(child.try_wait(), Ok(Some(_))) {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = child.kill();
        let _ = child.wait();
    }
}

async fn wait_until<T, F, Fut>(what: &str, timeout: Duration, mut check: F) -> anyhow::Result<T>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<Option<T>>>,
{
    let deadline = Instant::now() + timeout;
    let mut last = String::new();
    loop {
        match check().await {
            Ok(Some(value)) => return Ok(value),
            Ok(None) => {}
            Err(error) => last = format!(" (last: {error:#})"),
        }
        if Instant::now() > deadline {
            anyhow::bail!("{what} did not happen within {timeout:?}{last}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn serve(args: DevArgs) -> anyhow::Result<()> {
    let dir = &args.data_dir;
    std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    let mon_address: SocketAddr = SocketAddr::from(([127, 0, 0, 1], args.mon_port));
    let conf = dir.join("basalt.toml");
    std::fs::write(&conf, format!("[cluster]\nmons = [\"{mon_address}\"]\n"))
        .with_context(|| format!("writing {}", conf.display()))?;

    // Ctrl-C or SIGTERM while the cluster starts (minutes, when OSD devices are zeroed)
    // stops the daemons started so far too, rather than leave them running. Listened for
    // from here to the end, so that none is missed between the steps.
    let mut stop = crate::StopSignals::new()?;
    let (children, mon) = tokio::select! {
        started = start_cluster(&args, mon_address) => started?,
        () = stop.wait() => {
            println!("basalt dev: stopped while starting");
            return Ok(());
        }
    };
    serve_started(args, mon_address, conf, (children, mon), &mut stop).await
}

/// Starts the monitor and the OSDs, creates the pool and the image if missing, and waits
/// until every PG has a leader. Dropped before, it stops the daemons it started.
async fn start_cluster(
    args: &DevArgs,
    mon_address: SocketAddr,
) -> anyhow::Result<(Children, MonClient)> {
    let dir = &args.data_dir;
    let mut children = Children(Vec::new());
    children.spawn(
        "mon",
        &dir.join("mon.log"),
        &[
            "mon".into(),
            "--data-dir".into(),
            dir.join("mon").display().to_string(),
            "--listen".into(),
            mon_address.to_string(),
        ],
    )?;
    for n in 0..args.osds {
        let mut osd_args = vec![
            "osd".into(),
            "--data-dir".into(),
            dir.join(format!("osd.{n}")).display().to_string(),
            "--mon".into(),
            mon_address.to_string(),
            "--device-size".into(),
            args.osd_size.0.to_string(),
        ];
        if args.sparse_osds {
            osd_args.push("--sparse-device".into());
        }
        children.spawn(
            &format!("osd {n}"),
            &dir.join(format!("osd.{n}.log")),
            &osd_args,
        )?;
    }
    let mon = MonClient::new(vec![mon_address]);
    let osds = args.osds as usize;
    let deadline = Instant::now() + Duration::from_secs(120);
    loop {
        if let Some(exited) = children.exited() {
            anyhow::bail!("{exited}; see the logs in {}", dir.display());
        }
        if let Ok(map) = mon.map().await
            && map.osds.values().filter(|osd| osd.up).count() >= osds
        {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "the osds did not all come up within 2 minutes; see the logs in {}",
            dir.display()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let map = mon.map().await?;
    if map.pool_by_name(POOL).is_none() {
        mon.command(Command::PoolCreate {
            name: POOL.to_string(),
            pg_count: args.pg_count,
            size: args.osds.min(3),
            min_size: None,
        })
        .await?;
    }
    let map = mon.map().await?;
    if map.image_by_name(POOL, IMAGE).is_none() {
        mon.command(Command::ImageCreate {
            pool: POOL.to_string(),
            name: IMAGE.to_string(),
            size_bytes: args.size.0,
            object_size_bytes: None,
        })
        .await?;
    }
    wait_until("every pg led", Duration::from_secs(60), || async {
        let status = mon.status().await?;
        let pgs: u32 = status.map.pools.values().map(|pool| pool.pg_count).sum();
        let led: usize = status.reports.iter().map(|(_, r)| r.leading.len()).sum();
        Ok((led >= pgs as usize).then_some(()))
    })
    .await?;
    Ok((children, mon))
}

/// Exports the image and serves until Ctrl-C or SIGTERM, then stops everything.
async fn serve_started(
    args: DevArgs,
    mon_address: SocketAddr,
    conf: std::path::PathBuf,
    (mut children, mon): (Children, MonClient),
    stop: &mut crate::StopSignals,
) -> anyhow::Result<()> {
    let dir = &args.data_dir;
    let socket = dir.join("target.sock");
    let target = Target::new(
        crate::core_count(),
        basalt_io::Placement::RoundRobin,
        dir.to_path_buf(),
    )
    .context("starting the reactors")?;
    let calls = [
        (
            "bdev_basalt_create",
            json!({"name": IMAGE, "pool": POOL, "image": IMAGE, "mons": [mon_address.to_string()]}),
        ),
        (
            "nbd_server_start",
            json!({"listen_address": "127.0.0.1", "port": args.nbd_port}),
        ),
        (
            "nbd_server_add_export",
            json!({"bdev_name": IMAGE, "name": IMAGE}),
        ),
        ("nvmf_create_transport", json!({"trtype": "TCP"})),
        (
            "nvmf_create_subsystem",
            json!({"nqn": NQN, "allow_any_host": true, "serial_number": "BASALT-DEV-DISK0", "model_number": "Basalt image dev/disk0"}),
        ),
        (
            "nvmf_subsystem_add_ns",
            json!({"nqn": NQN, "namespace": {"bdev_name": IMAGE}}),
        ),
        (
            "nvmf_subsystem_add_listener",
            json!({"nqn": NQN, "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": args.nvmf_port.to_string()}}),
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
    let uri = format!("nbd://127.0.0.1:{}/{IMAGE}", args.nbd_port);
    let image_size = mon
        .map()
        .await?
        .image_by_name(POOL, IMAGE)
        .map_or(0, |image| image.size_bytes);
    println!(
        "basalt dev: 1 monitor, {} OSDs, image {POOL}/{IMAGE} ({}), data in {}",
        args.osds,
        ByteSize(image_size),
        dir.display()
    );
    println!("  NBD export:  {uri}");
    println!(
        "  NVMe/TCP:    nvme connect -t tcp -a 127.0.0.1 -s {} -n {NQN}",
        args.nvmf_port
    );
    println!("  CLI:         export BASALT_CONF={}", conf.display());
    println!("               basalt status; basalt pg ls; basalt image ls");
    println!(
        "  JSON-RPC:    basalt rpc -s {} bdev_get_bdevs",
        socket.display()
    );
    println!(
        "  try:         qemu-io -f raw {uri} -c 'write -P 0xab 0 64k' -c 'read -P 0xab 0 64k'"
    );
    println!("  bench:       basalt bench --nbd {uri} --rw randwrite --iodepth 32 --runtime 10");
    println!(
        "               basalt bench --nvmf nvme+tcp://127.0.0.1:{}/{NQN} --rw randwrite --iodepth 32 --runtime 10",
        args.nvmf_port
    );
    println!("  logs:        {}/{{mon,osd.N}}.log", dir.display());
    println!("Ctrl-C stops it.");
    let _ = std::process::Command::new(std::env::current_exe()?)
        .args(["status", "--conf"])
        .arg(&conf)
        .status();
    // Reports daemons that exit, and goes on serving: the cluster survives one.
    let watch = async {
        loop {
            tokio::time::sleep(Duration::from_secs(1)).await;
            for exited in children.newly_exited() {
                eprintln!(
                    "basalt dev: {exited}; the cluster goes on without it (see its log in {})",
                    dir.display()
                );
            }
        }
    };
    tokio::select! {
        result = server.run(target.clone()) => result.context("JSON-RPC server failed")?,
        () = stop.wait() => {}
        () = watch => {}
    }
    target.nbd.stop();
    target.nvmf.shutdown();
    target.vhost.shutdown();
    drop(children);
    println!("basalt dev: stopped");
    Ok(())
}
