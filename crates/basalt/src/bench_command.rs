//! `basalt bench`.

use std::io::IsTerminal;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{Context, bail};
use basalt_bdev::Bdev;
use basalt_bdev::file::{FileBdev, FileBdevOptions};
use basalt_bdev::malloc::MallocBdev;
use basalt_bench::{Device, Pattern, Progress, ProgressFn, Workload};
use basalt_common::ByteSize;
use basalt_nbd::NbdUri;
use basalt_nvmf::host::NvmfUri;
use basalt_osd::log_device::LogDevice;

/// Options of `basalt bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    /// An in-process bdev: `malloc:SIZE` (e.g. malloc:1GiB) or `file:PATH`.
    #[arg(long, conflicts_with = "nbd", required_unless_present_any = ["nbd", "nvmf", "osd_log", "image"])]
    pub bdev: Option<String>,
    /// A Basalt image, POOL/NAME, through the native client (the monitors from --mon,
    /// --conf or $BASALT_CONF).
    #[arg(long, conflicts_with_all = ["bdev", "nbd", "osd_log"])]
    pub image: Option<String>,
    #[command(flatten)]
    pub cluster: crate::admin_command::ClusterArgs,
    /// An NBD export: nbd://HOST[:PORT]/EXPORT (one connection per worker).
    #[arg(long)]
    pub nbd: Option<NbdUri>,
    /// An NVMe/TCP subsystem's first namespace: nvme+tcp://ADDRESS[:PORT]/NQN (one I/O
    /// queue per worker).
    #[arg(long, conflicts_with_all = ["bdev", "nbd", "image", "osd_log"])]
    pub nvmf: Option<NvmfUri>,
    /// An OSD log device on this file or block device, FORMATTED FIRST (its contents are
    /// lost); each write is one durable 4 KiB-aligned append. Writes only.
    #[arg(long, conflicts_with_all = ["bdev", "nbd"])]
    pub osd_log: Option<PathBuf>,
    /// Worker threads (and NBD connections).
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Requests in flight per worker.
    #[arg(long, default_value_t = 1)]
    pub iodepth: usize,
    /// Bytes per request.
    #[arg(long, default_value = "4KiB")]
    pub bs: ByteSize,
    /// read, write, randread, randwrite or randrw.
    #[arg(long, default_value = "randread")]
    pub rw: Pattern,
    /// Percentage of reads with --rw randrw.
    #[arg(long, default_value_t = 50)]
    pub rwmixread: u8,
    /// Seconds to run (default 10 unless --io-count is given).
    #[arg(long)]
    pub runtime: Option<f64>,
    /// Requests to issue.
    #[arg(long)]
    pub io_count: Option<u64>,
    /// Bytes of the device to use, from offset 0 (default: all of it).
    #[arg(long)]
    pub size: Option<ByteSize>,
    /// Check what is read against what was written; read every written block back at the end.
    #[arg(long)]
    pub verify: bool,
    /// Open file bdevs through the page cache (for filesystems that refuse O_DIRECT).
    #[arg(long)]
    pub buffered: bool,
    /// Write the bytes used once, sequentially in 1 MiB requests, before the measured run
    /// (reads of a fresh malloc bdev would otherwise read blocks never written, which
    /// cost no copy).
    #[arg(long)]
    pub prefill: bool,
    /// Seed of the random offsets.
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Print the report as JSON.
    #[arg(long)]
    pub json: bool,
}

pub fn run(args: BenchArgs) -> anyhow::Result<ExitCode> {
    let runtime = match (args.runtime, args.io_count) {
        (Some(seconds), _) if !(seconds > 0.0 && seconds.is_finite()) => {
            bail!("--runtime must be a positive number of seconds")
        }
        (Some(seconds), _) => Some(Duration::from_secs_f64(seconds)),
        (None, Some(_)) => None,
        (None, None) => Some(Duration::from_secs(10)),
    };
    let workload = Workload {
        pattern: args.rw,
        read_percent: args.rwmixread,
        block_size: args.bs.0,
        workers: args.workers,
        iodepth: args.iodepth,
        runtime,
        io_count: args.io_count,
        working_set_bytes: args.size.map_or(0, |size| size.0),
        verify: args.verify,
        seed: args.seed,
    };
    let report = crate::runtime(args.workers, "bench")?.block_on(async {
        let (device, target) = open_device(&args).await?;
        if args.prefill {
            prefill(&device, &workload, target.clone()).await?;
        }
        let live = std::io::stderr().is_terminal();
        let progress = live.then(|| Box::new(print_progress) as ProgressFn);
        let report = basalt_bench::run(&device, &workload, target, progress).await;
        if live {
            eprintln!();
        }
        report.context("invalid workload")
    })?;
    if args.json {
        println!("{}", serde_json::to_string_pretty(&report)?);
    } else {
        print!("{}", report.to_text());
        if let Some(stats) = &report.log {
            println!(
                "osd log: {} appends in {} batches ({:.1} per batch), write amplification {:.3}",
                stats.appends,
                stats.batches,
                stats.appends as f64 / stats.batches.max(1) as f64,
                stats.write_amplification
            );
        }
    }
    Ok(if report.is_clean() {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// Writes the bytes `workload` uses once, sequentially, 1 MiB per request (less when its
/// requests are larger than the working set), four in flight.
async fn prefill(device: &Device, workload: &Workload, target: String) -> anyhow::Result<()> {
    let size = match workload.working_set_bytes {
        0 => device.size_bytes(),
        bytes => bytes,
    };
    let block_size = (1u64 << 20).min(size) / workload.block_size.max(1) * workload.block_size;
    if block_size == 0 {
        bail!(
            "nothing to prefill: the device holds no whole {}-byte request",
            workload.block_size
        );
    }
    let fill = Workload {
        pattern: Pattern::Write,
        block_size,
        workers: 1,
        iodepth: 4,
        runtime: None,
        io_count: Some(size / block_size),
        working_set_bytes: size,
        verify: false,
        ..workload.clone()
    };
    let report = basalt_bench::run(device, &fill, target, None)
        .await
        .context("invalid prefill")?;
    if !report.is_clean() {
        bail!("the prefill saw errors: {}", report.to_text());
    }
    Ok(())
}

async fn open_device(args: &BenchArgs) -> anyhow::Result<(Device, String)> {
    if let Some(spec) = &args.image {
        let (pool, name) = spec
            .split_once('/')
            .with_context(|| format!("--image {spec:?} is not POOL/NAME"))?;
        let cluster = basalt_client::Cluster::connect(args.cluster.mons()?).await?;
        let image = cluster.open_image(pool, name)?;
        return Ok((Device::Image(Arc::new(image)), format!("image {spec}")));
    }
    if let Some(path) = &args.osd_log {
        if !matches!(args.rw, Pattern::Write | Pattern::RandWrite) {
            bail!("--osd-log takes writes only (--rw write or randwrite)");
        }
        LogDevice::format(path, [0; 16])
            .await
            .with_context(|| format!("formatting {}", path.display()))?;
        let opened = LogDevice::open(path)
            .await
            .with_context(|| format!("opening {}", path.display()))?;
        return Ok((
            Device::Log(Arc::new(opened.device)),
            format!("osd log {}", path.display()),
        ));
    }
    if let Some(uri) = &args.nbd {
        let device = Device::connect_nbd(uri, args.workers)
            .await
            .with_context(|| {
                format!(
                    "connecting to nbd://{}:{}/{}",
                    uri.host, uri.port, uri.export
                )
            })?;
        return Ok((
            device,
            format!("nbd://{}:{}/{}", uri.host, uri.port, uri.export),
        ));
    }
    if let Some(uri) = &args.nvmf {
        let device = Device::connect_nvmf(uri, args.workers, args.iodepth)
            .await
            .with_context(|| format!("connecting to nvme+tcp://{}/{}", uri.address, uri.nqn))?;
        return Ok((device, format!("nvme+tcp://{}/{}", uri.address, uri.nqn)));
    }
    let spec = args.bdev.as_deref().unwrap_or_default();
    let bdev: Arc<dyn Bdev> = if let Some(size) = spec.strip_prefix("malloc:") {
        let size: ByteSize = size.parse()?;
        let block_size = 512u32;
        if size.0 < u64::from(block_size) {
            bail!("malloc size {size} is smaller than one {block_size}-byte block");
        }
        Arc::new(MallocBdev::new_named(
            "bench",
            block_size,
            size.0 / u64::from(block_size),
        ))
    } else if let Some(path) = spec.strip_prefix("file:") {
        let options = FileBdevOptions {
            block_size: 512,
            buffered: args.buffered,
            queue_depth: 256,
        };
        Arc::new(FileBdev::open(
            &PathBuf::from(path),
            "bench".into(),
            basalt_bdev::uuid::random(),
            &options,
        )?)
    } else {
        bail!("--bdev {spec:?} is neither malloc:SIZE nor file:PATH");
    };
    Ok((Device::Bdev(bdev), spec.to_string()))
}

/// The live progress line, rewritten in place on a terminal.
fn print_progress(progress: Progress) {
    eprint!(
        "\r[{:>4.0}s] {:>10.0} IOPS {:>9.1} MiB/s  {} ios  {} errors ",
        progress.elapsed_seconds,
        progress.iops,
        progress.mib_per_second,
        progress.ios,
        progress.errors
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The prefill writes every block of the working set, and nothing past it.
    #[tokio::test]
    async fn prefill_writes_the_working_set_once() {
        let bdev: Arc<dyn Bdev> = Arc::new(MallocBdev::new_named("fill", 512, 8192));
        let device = Device::Bdev(bdev.clone());
        let workload = Workload {
            pattern: Pattern::RandRead,
            read_percent: 50,
            block_size: 4096,
            workers: 1,
            iodepth: 1,
            runtime: Some(Duration::from_secs(1)),
            io_count: None,
            working_set_bytes: 3 << 20,
            verify: false,
            seed: 1,
        };
        prefill(&device, &workload, "fill".to_string())
            .await
            .expect("prefill");
        let info = bdev.info().clone();
        for block in 0..(4u64 << 20) / 4096 {
            let extent = info.data_extent(block * 4096, 4096).expect("extent");
            let data = bdev.read(extent).await.expect("read");
            let written = data.iter().any(|byte| *byte != 0);
            assert_eq!(written, block < (3 << 20) / 4096, "block {block}");
        }
    }
}
