//! The target's Prometheus metrics (`basalt target --metrics-addr`): each bdev's I/O
//! counters (those `bdev_get_iostat` reports), and what is connected to each frontend.

use std::sync::atomic::Ordering;

use basalt_bdev::bdev::IoStatsSnapshot;
use basalt_bdev::bdev::{LATENCY_BUCKETS, latency_bucket_bound_us};
use basalt_wire::metrics::{Exposition, Histogram};

use crate::target::Target;

/// A bdev's latency buckets, as `IoStatsSnapshot` holds them.
type Buckets = [u64; LATENCY_BUCKETS];

/// A bdev's counters: each family's name (after `basalt_target_bdev_`), help, and value.
fn bdev_counters(s: &IoStatsSnapshot) -> [(&'static str, &'static str, f64); 9] {
    let seconds = |ns: u64| ns as f64 / 1e9;
    [
        ("read_ops_total", "Reads completed.", s.num_read_ops as f64),
        ("read_bytes_total", "Bytes read.", s.bytes_read as f64),
        (
            "write_ops_total",
            "Writes completed (write zeroes included).",
            s.num_write_ops as f64,
        ),
        (
            "write_bytes_total",
            "Bytes written (write zeroes included).",
            s.bytes_written as f64,
        ),
        (
            "unmap_ops_total",
            "Discards completed.",
            s.num_unmap_ops as f64,
        ),
        (
            "unmap_bytes_total",
            "Bytes discarded.",
            s.bytes_unmapped as f64,
        ),
        (
            "unmap_seconds_total",
            "Time discards took, summed.",
            seconds(s.unmap_latency_ns),
        ),
        (
            "flush_ops_total",
            "Flushes completed.",
            s.num_flush_ops as f64,
        ),
        ("errors_total", "Requests that failed.", s.num_errors as f64),
    ]
}

/// The metrics text of `target` now.
pub fn render(target: &Target) -> String {
    let mut e = Exposition::new();
    e.single(
        "basalt_target_reactors",
        "gauge",
        "Reactor threads serving frontend connections.",
        target.reactors.len() as f64,
    );

    let mut bdevs: Vec<(String, u64, IoStatsSnapshot)> = target
        .bdevs
        .list()
        .into_iter()
        .map(|listed| {
            let info = listed.bdev.info();
            let stats = listed.bdev.io_stats().unwrap_or_default();
            (info.name.clone(), info.size_bytes(), stats)
        })
        .collect();
    bdevs.sort_by(|a, b| a.0.cmp(&b.0));
    let size = bdevs.iter().map(|b| (b.0.as_str(), b.1 as f64));
    let gauge = "gauge";
    by_label(
        &mut e,
        ("basalt_target_bdev_size_bytes", gauge),
        "The bdev's size.",
        "bdev",
        size,
    );
    let counters: Vec<_> = bdevs.iter().map(|bdev| bdev_counters(&bdev.2)).collect();
    for (index, (name, help, _)) in bdev_counters(&IoStatsSnapshot::default())
        .into_iter()
        .enumerate()
    {
        let name = format!("basalt_target_bdev_{name}");
        let samples = bdevs
            .iter()
            .zip(&counters)
            .map(|(b, c)| (b.0.as_str(), c[index].2));
        by_label(&mut e, (&name, "counter"), help, "bdev", samples);
    }
    let labels: Vec<[(&str, &str); 1]> = bdevs.iter().map(|b| [("bdev", b.0.as_str())]).collect();
    let series = |pick: fn(&IoStatsSnapshot) -> (Buckets, u64, u64)| -> Vec<Histogram<'_>> {
        bdevs
            .iter()
            .zip(&labels)
            .map(|(bdev, labels)| {
                let (buckets, ops, ns) = pick(&bdev.2);
                latency(labels, &buckets, ops, ns)
            })
            .collect()
    };
    let reads = series(|s| (s.read_latency_buckets, s.num_read_ops, s.read_latency_ns));
    let help = "Time reads took.";
    e.histogram("basalt_target_bdev_read_latency_seconds", help, &reads);
    let writes = series(|s| (s.write_latency_buckets, s.num_write_ops, s.write_latency_ns));
    let help = "Time writes took.";
    e.histogram("basalt_target_bdev_write_latency_seconds", help, &writes);

    let exports = target.nbd.exports().list();
    let connections = exports
        .iter()
        .map(|x| (x.name.as_str(), x.connection_count() as f64));
    let help = "NBD clients in transmission, by export.";
    by_label(
        &mut e,
        ("basalt_target_nbd_connections", gauge),
        help,
        "export",
        connections,
    );

    let counters = &target.nvmf.counters;
    let count = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed) as f64;
    for (name, kind, help, value) in [
        (
            "admin_qpairs_total",
            "counter",
            "NVMe/TCP admin queues connected since start.",
            &counters.admin_qpairs,
        ),
        (
            "io_qpairs_total",
            "counter",
            "NVMe/TCP I/O queues connected since start.",
            &counters.io_qpairs,
        ),
        (
            "admin_qpairs_connected",
            gauge,
            "NVMe/TCP admin queues connected now.",
            &counters.current_admin_qpairs,
        ),
        (
            "io_qpairs_connected",
            gauge,
            "NVMe/TCP I/O queues connected now.",
            &counters.current_io_qpairs,
        ),
    ] {
        e.single(
            &format!("basalt_target_nvmf_{name}"),
            kind,
            help,
            count(value),
        );
    }
    if let Some(budget) = target.nvmf.data_budget() {
        let help = "Bytes of data the NVMe/TCP commands under way on all queues hold now (a command that does not fit waits).";
        e.single(
            "basalt_target_nvmf_data_budget_used_bytes",
            gauge,
            help,
            budget.in_use() as f64,
        );
        let help = "Bytes of data the NVMe/TCP commands under way may hold (num_shared_buffers x io_unit_size).";
        e.single(
            "basalt_target_nvmf_data_budget_bytes",
            gauge,
            help,
            budget.limit() as f64,
        );
        let help = "NVMe/TCP commands read and parked until the data budget has their bytes.";
        e.single(
            "basalt_target_nvmf_parked_commands",
            gauge,
            help,
            budget.parked() as f64,
        );
    }
    let subsystems: Vec<(String, usize, usize)> = target
        .nvmf
        .subsystems()
        .iter()
        .map(|subsystem| {
            let state = subsystem.lock();
            (
                subsystem.nqn.clone(),
                state.controllers.len(),
                state.namespaces.len(),
            )
        })
        .collect();
    let controllers = subsystems.iter().map(|s| (s.0.as_str(), s.1 as f64));
    let name = "basalt_target_nvmf_subsystem_controllers";
    let help = "NVMe controllers (connected hosts), by subsystem.";
    by_label(&mut e, (name, gauge), help, "subsystem", controllers);
    let namespaces = subsystems.iter().map(|s| (s.0.as_str(), s.2 as f64));
    let name = "basalt_target_nvmf_subsystem_namespaces";
    by_label(
        &mut e,
        (name, gauge),
        "Namespaces, by subsystem.",
        "subsystem",
        namespaces,
    );

    let vhost = target.vhost.list();
    let attached = vhost
        .iter()
        .map(|c| (c.name.as_str(), f64::from(u8::from(c.attached))));
    let help = "1 while a vhost-user frontend (QEMU) is connected to the controller.";
    by_label(
        &mut e,
        ("basalt_target_vhost_attached", gauge),
        help,
        "controller",
        attached,
    );
    let in_place = vhost
        .iter()
        .map(|c| (c.name.as_str(), c.in_place_requests as f64));
    let name = "basalt_target_vhost_in_place_requests_total";
    let help = "Requests served between guest memory and the bdev's file with no copy.";
    by_label(&mut e, (name, "counter"), help, "controller", in_place);
    e.finish()
}

/// A family (`name`, `kind`) of samples labelled by `key` alone: its value and the
/// sample's value.
fn by_label<'a>(
    e: &mut Exposition,
    (name, kind): (&str, &str),
    help: &str,
    key: &'a str,
    samples: impl Iterator<Item = (&'a str, f64)>,
) {
    let samples: Vec<([(&str, &str); 1], f64)> = samples
        .map(|(value, sample)| ([(key, value)], sample))
        .collect();
    let samples: Vec<(&[(&str, &str)], f64)> = samples
        .iter()
        .map(|(labels, value)| (labels.as_slice(), *value))
        .collect();
    e.family(name, kind, help, &samples);
}

/// A latency histogram series from a bdev's `buckets` (not cumulative), its operations
/// `ops` and their summed time `ns`.
fn latency<'a>(
    labels: &'a [(&'a str, &'a str)],
    buckets: &[u64],
    ops: u64,
    ns: u64,
) -> Histogram<'a> {
    let mut seen = 0;
    let buckets = buckets
        .iter()
        .enumerate()
        .map(|(index, count)| {
            seen += count;
            (latency_bucket_bound_us(index) as f64 / 1e6, seen)
        })
        .collect();
    Histogram {
        labels,
        buckets,
        sum: ns as f64 / 1e9,
        // The counters are read one by one: a request counted in a bucket since its
        // operations were read counts in the total too.
        count: ops.max(seen),
    }
}
