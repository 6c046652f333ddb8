//! The NBD export of `basalt target` used by clients we did not write: qemu-img, qemu-io,
//! nbdinfo, nbdcopy, fio's nbd engine and libnbd's Python bindings (two tests also look at
//! the same target through our NVMe/TCP initiator).

mod support;

use std::process::Command;

use basalt_nvmf::completion::Status;
use basalt_nvmf::host::HostOptions;
use serde_json::{Value, json};
use support::*;

/// A target (started with `args`) with a 64 MiB malloc export "disk" of bdev "m0" and a
/// 4 MiB read-only export "ro".
fn target_with_exports(dir: &ScratchDir, args: &[&str]) -> (TargetProcess, u16) {
    let target = TargetProcess::start(&dir.path, args);
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"name": "m0", "num_blocks": 16384, "block_size": 4096}),
    );
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"name": "m1", "num_blocks": 8192, "block_size": 512}),
    );
    let port = target.start_nbd();
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "m0", "name": "disk"}),
    );
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "m1", "name": "ro", "readonly": true}),
    );
    (target, port)
}

#[test]
fn qemu_img_and_qemu_io_use_the_export() {
    require("qemu-img");
    require("qemu-io");
    let dir = ScratchDir::new("nbd-qemu");
    let (_target, port) = target_with_exports(&dir, &[]);
    let uri = format!("nbd://127.0.0.1:{port}/disk");
    let info = run_ok(Command::new("qemu-img").args(["info", "--output=json", &uri]));
    let info: Value = serde_json::from_str(&info).expect("qemu-img json");
    assert_eq!(info["virtual-size"], json!(64 << 20), "{info}");

    qemu_io_ok(
        &uri,
        false,
        &[
            "write -P 0xab 0 1M",
            "write -P 0xcd -f 1M 64k", // FUA
            "aio_write -P 0x11 2M 4k",
            "aio_write -P 0x22 3M 4k",
            "aio_flush",
            "flush",
        ],
    );
    qemu_io_ok(
        &uri,
        true,
        &[
            "read -P 0xab 0 1M",
            "read -P 0xcd 1M 64k",
            "read -P 0x11 2M 4k",
            "read -P 0x22 3M 4k",
            "read -P 0 4M 1M",
        ],
    );
    qemu_io_ok(
        &uri,
        false,
        &["discard 0 64k", "write -z 64k 64k", "write -z -u 128k 64k"],
    );
    qemu_io_ok(&uri, true, &["read -P 0 0 192k", "read -P 0xab 192k 64k"]);

    // The read-only export refuses writes; qemu-io reports the failure.
    let ro = format!("nbd://127.0.0.1:{port}/ro");
    let out = run(Command::new("qemu-io").args(["-f", "raw", &ro, "-c", "write -P 1 0 4k"]));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() && text.contains("Permission denied"),
        "{text}"
    );
    qemu_io_ok(&ro, true, &["read -P 0 0 4M"]);
}

#[test]
fn nbdinfo_lists_exports_with_sizes_and_limits() {
    require("nbdinfo");
    let dir = ScratchDir::new("nbd-nbdinfo");
    let (_target, port) = target_with_exports(&dir, &[]);
    let out = run_ok(Command::new("nbdinfo").args([
        "--list",
        "--json",
        &format!("nbd://127.0.0.1:{port}"),
    ]));
    let listing: Value = serde_json::from_str(&out).expect("nbdinfo json");
    let exports = listing["exports"].as_array().expect("exports");
    let find = |name: &str| {
        exports
            .iter()
            .find(|e| e["export-name"] == json!(name))
            .cloned()
            .unwrap_or_else(|| panic!("{name} not listed: {listing}"))
    };
    let disk = find("disk");
    assert_eq!(disk["export-size"], json!(64 << 20));
    assert_eq!(disk["can_multi_conn"], json!(true));
    assert_eq!(disk["can_flush"], json!(true));
    assert_eq!(disk["can_trim"], json!(true));
    assert_eq!(disk["can_zero"], json!(true));
    assert_eq!(disk["can_fua"], json!(true));
    assert_eq!(disk["block_size_minimum"], json!(4096));
    let ro = find("ro");
    assert_eq!(ro["is_read_only"], json!(true));
    assert_eq!(ro["export-size"], json!(4 << 20));
    assert_eq!(ro["block_size_minimum"], json!(512));
}

/// libnbd (through Debian's Python bindings) as a client that does not ask for block
/// sizes, as the kernel's `nbd-client` does not: it is told the 4 KiB-block export's
/// minimum anyway and let in (it may know it out of band), and reads a block of it.
#[test]
fn a_client_that_does_not_ask_for_block_sizes_is_told_them() {
    let python = "/usr/bin/python3";
    assert!(
        Command::new(python)
            .args(["-c", "import nbd"])
            .status()
            .is_ok_and(|status| status.success()),
        "python3-libnbd is not installed; scripts/test.sh installs it"
    );
    let dir = ScratchDir::new("nbd-block-size-unasked");
    let (_target, port) = target_with_exports(&dir, &[]);
    let script = r#"
import nbd, sys
h = nbd.NBD()
h.set_request_block_size(False)
h.connect_uri(sys.argv[1])
print(h.get_block_size(nbd.SIZE_MINIMUM), len(h.pread(4096, 0)))
"#;
    let connect = |export: &str| {
        let uri = format!("nbd://127.0.0.1:{port}/{export}");
        run_ok(Command::new(python).args(["-c", script, &uri]))
    };
    assert_eq!(connect("disk").trim(), "4096 4096");
    assert_eq!(connect("ro").trim(), "512 4096");
}

#[test]
fn nbdcopy_in_and_out_preserves_the_data() {
    require("nbdcopy");
    let dir = ScratchDir::new("nbd-nbdcopy");
    let (_target, port) = target_with_exports(&dir, &[]);
    let source = dir.join("source.bin");
    run_ok(Command::new("dd").args([
        "if=/dev/urandom",
        &format!("of={}", source.display()),
        "bs=1M",
        "count=64",
        "status=none",
    ]));
    let uri = format!("nbd://127.0.0.1:{port}/disk");
    run_ok(Command::new("nbdcopy").args(["--connections=4", source.to_str().expect("utf8"), &uri]));
    let copy = dir.join("copy.bin");
    run_ok(Command::new("nbdcopy").args([&uri, copy.to_str().expect("utf8")]));
    assert_eq!(sha256(&source), sha256(&copy));
}

/// fio writes verifiable blocks through 4 connections (multi-conn), then a second fio run
/// reads every block back and checks its crc32c; a corrupted block is then detected.
#[test]
fn fio_randwrite_verify_through_several_connections() {
    require("fio");
    let dir = ScratchDir::new("nbd-fio");
    let (target, port) = target_with_exports(&dir, &[]);
    let uri = format!("nbd://127.0.0.1:{port}/disk");
    let fio = |extra: &[&str]| {
        let mut command = Command::new("fio");
        command.args([
            "--name=verify",
            "--ioengine=nbd",
            &format!("--uri={uri}"),
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=16",
            "--numjobs=4",
            "--size=16m",
            "--offset_increment=16m",
            "--verify=crc32c",
            "--verify_state_save=0",
            "--group_reporting",
            "--output-format=json",
        ]);
        command.args(extra);
        run(&mut command)
    };
    let write = fio(&["--do_verify=0"]);
    assert!(write.status.success());
    let verify = fio(&["--verify_only"]);
    assert!(verify.status.success(), "verify failed");
    let stdout = String::from_utf8_lossy(&verify.stdout);
    let json_start = stdout.find('{').expect("fio printed json");
    let report: Value = serde_json::from_str(&stdout[json_start..]).expect("fio json");
    assert_eq!(report["jobs"][0]["error"], json!(0));
    assert!(
        report["jobs"][0]["read"]["io_bytes"].as_u64().unwrap_or(0) >= 64 << 20,
        "verify read everything"
    );
    let stats = target.rpc_ok("bdev_get_iostat", json!({"name": "m0"}));
    assert!(
        stats["bdevs"][0]["num_write_ops"].as_u64().unwrap_or(0) >= 16384,
        "{stats}"
    );

    // Overwrite one region behind fio's back: the verify pass must now fail.
    qemu_io_ok(
        &format!("nbd://127.0.0.1:{port}/disk"),
        false,
        &["write -P 0 0 64k"],
    );
    let corrupted = fio(&["--verify_only"]);
    assert!(
        !corrupted.status.success(),
        "fio must detect the overwritten blocks"
    );
}

/// `basalt target --metrics-addr`: Prometheus metrics of each bdev's I/O, counted as
/// qemu-io (over NBD) and our NVMe/TCP initiator use them, and of what is connected.
#[test]
fn target_metrics_count_what_clients_do() {
    require("qemu-io");
    let dir = ScratchDir::new("target-metrics");
    let metrics_port = free_port();
    let metrics_at = format!("127.0.0.1:{metrics_port}");
    let (target, port) = target_with_exports(&dir, &["--metrics-addr", &metrics_at]);
    let metrics = || http_get(&metrics_at, "/metrics");
    let of_m0 = |metrics: &str, name: &str| metric(metrics, &format!("{name}{{bdev=\"m0\"}}"));
    let before = metrics();
    assert_eq!(
        of_m0(&before, "basalt_target_bdev_size_bytes"),
        64.0 * 1048576.0
    );
    assert_eq!(of_m0(&before, "basalt_target_bdev_write_ops_total"), 0.0);

    let uri = format!("nbd://127.0.0.1:{port}/disk");
    qemu_io_ok(
        &uri,
        false,
        &[
            "write -P 0xab 0 1M",
            "write -P 0xcd 1M 64k",
            "read -P 0xab 0 128k",
            "discard 2M 256k",
            "flush",
        ],
    );
    let after = metrics();
    assert_eq!(
        of_m0(&after, "basalt_target_bdev_write_bytes_total"),
        1114112.0
    );
    assert_eq!(of_m0(&after, "basalt_target_bdev_write_ops_total"), 2.0);
    assert_eq!(
        of_m0(&after, "basalt_target_bdev_read_bytes_total"),
        131072.0
    );
    assert_eq!(
        of_m0(&after, "basalt_target_bdev_unmap_bytes_total"),
        262144.0
    );
    assert!(
        of_m0(&after, "basalt_target_bdev_flush_ops_total") >= 1.0,
        "{after}"
    );
    // Latency histograms: every write in the +Inf bucket and in that of 8.4 s, their
    // time summed.
    let writes = "basalt_target_bdev_write_latency_seconds";
    for series in ["_count{bdev=\"m0\"}", "_bucket{bdev=\"m0\",le=\"+Inf\"}"] {
        assert_eq!(metric(&after, &format!("{writes}{series}")), 2.0, "{after}");
    }
    let last = format!("{writes}_bucket{{bdev=\"m0\",le=\"8.388608\"}}");
    assert_eq!(metric(&after, &last), 2.0, "{after}");
    assert!(of_m0(&after, &format!("{writes}_sum")) > 0.0, "{after}");
    let reads = "basalt_target_bdev_read_latency_seconds_count";
    assert_eq!(of_m0(&after, reads), 1.0, "{after}");
    assert_eq!(of_m0(&after, "basalt_target_bdev_errors_total"), 0.0);
    // qemu-io has gone (the server sees its connection end a moment later).
    let connections = || metric(&metrics(), "basalt_target_nbd_connections{export=\"disk\"}");
    let started = std::time::Instant::now();
    while connections() != 0.0 {
        assert!(started.elapsed().as_secs() < 10, "{}", metrics());
        std::thread::sleep(std::time::Duration::from_millis(20));
    }

    // The same bdev in an NVMe subsystem, written by our initiator on two I/O queues
    // (500 writes in all).
    let nqn = "nqn.2016-06.io.basalt:metrics";
    let nvmf_port = target.start_nvmf(nqn, "m0");
    let subsystem = |name: &str| {
        metric(
            &metrics(),
            &format!("basalt_target_nvmf_subsystem_{name}{{subsystem=\"{nqn}\"}}"),
        )
    };
    assert_eq!(subsystem("namespaces"), 1.0);
    assert_eq!(subsystem("controllers"), 0.0);
    run_ok(basalt().args([
        "bench",
        "--nvmf",
        &format!("nvme+tcp://127.0.0.1:{nvmf_port}/{nqn}"),
        "--rw",
        "randwrite",
        "--workers",
        "2",
        "--io-count",
        "500",
        "--size",
        "4MiB",
    ]));
    let nvmf = metrics();
    assert_eq!(
        of_m0(&nvmf, "basalt_target_bdev_write_ops_total"),
        2.0 + 500.0,
        "{nvmf}"
    );
    assert!(
        metric(&nvmf, "basalt_target_nvmf_io_qpairs_total") >= 2.0,
        "{nvmf}"
    );
    assert!(
        metric(&nvmf, "basalt_target_nvmf_admin_qpairs_total") >= 1.0,
        "{nvmf}"
    );
    // The transport's data budget: 511 x 128 KiB by default, all of it back once the
    // bench's commands ended.
    assert_eq!(
        metric(&nvmf, "basalt_target_nvmf_data_budget_bytes"),
        511.0 * 131_072.0,
        "{nvmf}"
    );
    assert_eq!(
        metric(&nvmf, "basalt_target_nvmf_data_budget_used_bytes"),
        0.0,
        "{nvmf}"
    );
    assert_eq!(
        metric(&nvmf, "basalt_target_nvmf_parked_commands"),
        0.0,
        "{nvmf}"
    );
}

/// A tmpfs mounted for a test, unmounted (lazily) when dropped.
struct Tmpfs(std::path::PathBuf);

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// A file bdev whose filesystem is full: writes past the room left fail with ENOSPC at
/// the host (qemu-io over NBD reads "No space left on device"; NVMe's capacity exceeded,
/// not retried, at our initiator), and what was written before reads back (a full disk
/// is a clear error, never lost data). Needs root, for the mount.
#[test]
fn a_full_filesystem_refuses_writes_with_enospc() {
    require("qemu-io");
    require("mount");
    let dir = ScratchDir::new("nbd-enospc");
    let mount = dir.path.join("small");
    std::fs::create_dir_all(&mount).expect("mount point");
    run_ok(
        Command::new("mount")
            .args(["-t", "tmpfs", "-o", "size=2M", "tmpfs"])
            .arg(&mount),
    );
    let _mounted = Tmpfs(mount.clone());
    // 64 MiB of file over 2 MiB of filesystem (tmpfs takes no O_DIRECT: buffered).
    let file = mount.join("disk");
    std::fs::File::create(&file)
        .and_then(|f| f.set_len(64 << 20))
        .expect("sparse file");
    let target = TargetProcess::start(&dir.path, &[]);
    target.rpc_ok(
        "bdev_uring_create",
        json!({"filename": file, "name": "f", "block_size": 512, "buffered": true}),
    );
    let port = target.start_nbd();
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "f", "name": "f"}),
    );
    let uri = format!("nbd://127.0.0.1:{port}/f");
    qemu_io_ok(&uri, false, &["write -P 0x11 0 1M"]);
    let (_, text) = qemu_io(&uri, false, &["write -P 0x22 8M 4M"]);
    assert!(text.contains("No space left on device"), "{text}");
    qemu_io_ok(&uri, true, &["read -P 0x11 0 1M"]);

    let nqn = "nqn.2016-06.io.basalt:full";
    let nvmf_port = target.start_nvmf(nqn, "f");
    let (runtime, host) = nvmf_host(nvmf_port, nqn, HostOptions::default());
    runtime.block_on(async {
        let refused = host
            .write(0, 1, 32 * 1024, vec![0x33; 4 << 20], 512, false)
            .await
            .expect_err("no room for 4 MiB");
        assert_eq!(
            refused.status(),
            Some(Status::CAPACITY_EXCEEDED.with_dnr()),
            "{refused}"
        );
        let data = host.read(0, 1, 0, 2048, 512).await.expect("read");
        assert!(data.iter().all(|b| *b == 0x11), "the first MiB kept");
    });
}
