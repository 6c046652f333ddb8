//! The target's Prometheus metrics (`basalt target --metrics-addr`): each bdev's I/O
//! counters (those `bdev_get_iostat` reports), and what is connected to each frontend.

use std::sync::atomic::Ordering;

use basalt_bdev::bdev::IoStatsSnapshot;
use basalt_bdev::bdev::latency_bucket_bound_us;
use basalt_wire::metrics::{Exposition, Histogram};

use crate::target::Target;

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
    let by_bdev = |value: &dyn Fn(&(String, u64, IoStatsSnapshot)) -> f64| {
        bdevs
            .iter()
            .map(|bdev| (vec![("bdev", bdev.0.as_str())], value(bdev)))
            .collect::<Vec<_>>()
    };
    family(
        &mut e,
        "basalt_target_bdev_size_bytes",
        "gauge",
        "The bdev's size.",
        by_bdev(&|bdev| bdev.1 as f64),
    );
    let counters: Vec<_> = bdevs.iter().map(|bdev| bdev_counters(&bdev.2)).collect();
    for (index, (name, help, _)) in bdev_counters(&IoStatsSnapshot::default())
        .into_iter()
        .enumerate()
    {
        let samples = bdevs
            .iter()
            .zip(&counters)
            .map(|(bdev, counters)| (vec![("bdev", bdev.0.as_str())], counters[index].2))
            .collect();
        family(
            &mut e,
            &format!("basalt_target_bdev_{name}"),
            "counter",
            help,
            samples,
        );
    }

    for (name, help, buckets, ops, ns) in [
        (
            "read",
            "Time reads took.",
            (|s: &IoStatsSnapshot| s.read_latency_buckets) as fn(&IoStatsSnapshot) -> _,
            (|s: &IoStatsSnapshot| s.num_read_ops) as fn(&IoStatsSnapshot) -> u64,
            (|s: &IoStatsSnapshot| s.read_latency_ns) as fn(&IoStatsSnapshot) -> u64,
        ),
        (
            "write",
            "Time writes took.",
            |s| s.write_latency_buckets,
            |s| s.num_write_ops,
            |s| s.write_latency_ns,
        ),
    ] {
        let labels: Vec<[(&str, &str); 1]> = bdevs
            .iter()
            .map(|bdev| [("bdev", bdev.0.as_str())])
            .collect();
        let series: Vec<Histogram<'_>> = bdevs
            .iter()
            .zip(&labels)
            .map(|(bdev, labels)| {
                let mut seen = 0;
                let buckets = buckets(&bdev.2)
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
                    sum: ns(&bdev.2) as f64 / 1e9,
                    // The counters are read one by one: a request counted in a bucket
                    // since its operations were read counts in the total too.
                    count: ops(&bdev.2).max(seen),
                }
            })
            .collect();
        e.histogram(
            &format!("basalt_target_bdev_{name}_latency_seconds"),
            help,
            &series,
        );
    }

    let exports = target.nbd.exports().list();
    family(
        &mut e,
        "basalt_target_nbd_connections",
        "gauge",
        "NBD clients in transmission, by export.",
        exports
            .iter()
            .map(|export| {
                (
                    vec![("export", export.name.as_str())],
                    export.connection_count() as f64,
                )
            })
            .collect(),
    );

    let counters = &target.nvmf.counters;
    let count = |counter: &std::sync::atomic::AtomicU64| counter.load(Ordering::Relaxed) as f64;
    for (name, kind, help, value) in [
        (
            "admin_qpairs_total",
            "counter",
            "NVMe/TCP admin queues connected since start.",
            count(&counters.admin_qpairs),
        ),
        (
            "io_qpairs_total",
            "counter",
            "NVMe/TCP I/O queues connected since start.",
            count(&counters.io_qpairs),
        ),
        (
            "admin_qpairs_connected",
            "gauge",
            "NVMe/TCP admin queues connected now.",
            count(&counters.current_admin_qpairs),
        ),
        (
            "io_qpairs_connected",
            "gauge",
            "NVMe/TCP I/O queues connected now.",
            count(&counters.current_io_qpairs),
        ),
    ] {
        e.single(&format!("basalt_target_nvmf_{name}"), kind, help, value);
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
    for (name, help, value) in [
        (
            "controllers",
            "NVMe controllers (connected hosts), by subsystem.",
            (|s: &(String, usize, usize)| s.1) as fn(&(String, usize, usize)) -> usize,
        ),
        ("namespaces", "Namespaces, by subsystem.", |s| s.2),
    ] {
        family(
            &mut e,
            &format!("basalt_target_nvmf_subsystem_{name}"),
            "gauge",
            help,
            subsystems
                .iter()
                .map(|s| (vec![("subsystem", s.0.as_str())], value(s) as f64))
                .collect(),
        );
    }

    let controllers = target.vhost.list();
    let by_controller = |value: &dyn Fn(&basalt_vhost::controller::ControllerInfo) -> f64| {
        controllers
            .iter()
            .map(|c| (vec![("controller", c.name.as_str())], value(c)))
            .collect::<Vec<_>>()
    };
    family(
        &mut e,
        "basalt_target_vhost_attached",
        "gauge",
        "1 while a vhost-user frontend (QEMU) is connected to the controller.",
        by_controller(&|c| f64::from(u8::from(c.attached))),
    );
    family(
        &mut e,
        "basalt_target_vhost_in_place_requests_total",
        "counter",
        "Requests served between guest memory and the bdev's file with no copy.",
        by_controller(&|c| c.in_place_requests as f64),
    );
    e.finish()
}

/// A family whose samples have owned label lists.
fn family(
    e: &mut Exposition,
    name: &str,
    kind: &str,
    help: &str,
    samples: Vec<(Vec<(&str, &str)>, f64)>,
) {
    let samples: Vec<(&[(&str, &str)], f64)> = samples
        .iter()
        .map(|(labels, value)| (labels.as_slice(), *value))
        .collect();
    e.family(name, kind, help, &samples);
}
