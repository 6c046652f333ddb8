//! The distributed store as processes on loopback: a monitor, three OSDs and a target
//! exporting an image over NBD, driven by fio (its nbd engine) with crc32c verification,
//! through OSD crashes (`kill -9`) and a crash of every process.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use basalt_nvmf::command::CNS_CONTROLLER_COMMAND_SET;
use basalt_nvmf::host::HostOptions;
use basalt_wire::message::{Message, Status};
use serde_json::json;
use support::*;

#[test]
fn fio_verifies_through_an_image_while_the_busiest_leader_is_killed() {
    let dir = ScratchDir::new("cluster-kill");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "16", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "64MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");

    // fio writes 48 MiB with verification; after a second, the OSD leading the most PGs dies.
    let write = verified_write("48M");
    let fio_uri = uri.clone();
    let fio_args = write.clone();
    let started = Instant::now();
    let fio_run = std::thread::spawn(move || fio(&fio_uri, &args(&fio_args)));
    std::thread::sleep(Duration::from_secs(1));
    let victim = cluster.busiest_leader();
    let process = cluster.osd_process(victim);
    assert!(
        !fio_run.is_finished(),
        "fio finished before the kill: nothing was tested"
    );
    eprintln!(
        "killing osd.{victim} (process {process}) after {:?}",
        started.elapsed()
    );
    cluster.kill_osd(process);
    let report = fio_run.join().expect("fio thread");
    let write_report = &report["jobs"][0]["write"];
    assert_eq!(
        write_report["io_bytes"].as_u64(),
        Some(48 << 20),
        "every block was written: {write_report:#}"
    );
    let stall_ns = write_report["clat_ns"]["max"].as_f64().expect("clat max");
    eprintln!(
        "longest write while the leader died: {:.2} s",
        stall_ns / 1e9
    );
    assert!(
        stall_ns < 15e9,
        "writes stalled {:.1} s after the leader died",
        stall_ns / 1e9
    );

    // The killed OSD comes back, catches up, and its replicas equal the others'.
    cluster.start_osd(process);
    cluster.wait_osds_up(3);
    cluster.wait_clean(Duration::from_secs(60));
    cluster.wait_replicas_equal(Duration::from_secs(60));
    let mut verify = write.clone();
    verify.push("--verify_only".into());
    fio(&uri, &args(&verify));
}

/// An OSD stopped in order (SIGTERM) while writes go on first hands the PGs it leads over
/// to the others, so that no write waits for an election (nor fails: requests it is still
/// given are sent on to another replica); then it stops taking writes and ends its log in
/// an empty batch: its last batch of data is known to be whole at the restart, so that
/// damage to it while the OSD is down is found, not taken for a torn write. Last, it has
/// the monitors mark it down, without waiting for their grace.
#[test]
fn an_osd_stopped_in_order_ends_its_log_in_an_empty_batch() {
    let dir = ScratchDir::new("cluster-stop");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "64MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let fio_run = std::thread::spawn(move || {
        let job = [
            "--rw=randwrite",
            "--bs=4k",
            "--iodepth=4",
            "--size=64M",
            "--time_based",
            "--runtime=5",
        ];
        fio(&uri, &job)
    });
    std::thread::sleep(Duration::from_secs(2));
    assert!(!fio_run.is_finished(), "fio ended before the stop");
    let busiest = cluster.busiest_leader();
    let stopped = cluster.osd_process(busiest);
    let name = format!("osd.{stopped}");
    cluster.stop_osd(stopped);
    // Marked down by the monitors at once (their grace is 3 s).
    let osds = cluster.cli_json(&["osd", "ls"]);
    let down: Vec<&serde_json::Value> = osds
        .as_array()
        .expect("osds")
        .iter()
        .filter(|osd| osd["up"] == false)
        .map(|osd| &osd["id"])
        .collect();
    assert_eq!(down, [&json!(busiest)], "{osds:#}");
    let report = fio_run.join().expect("fio thread");
    let writes = &report["jobs"][0]["write"];
    assert!(writes["total_ios"].as_u64() > Some(100), "{writes:#}");
    let stall_ns = writes["clat_ns"]["max"].as_f64().expect("clat max");
    eprintln!(
        "longest write while {name} stopped: {:.3} s",
        stall_ns / 1e9
    );
    // (An election takes a second at least.)
    assert!(stall_ns < 0.9e9, "a write waited {:.3} s", stall_ns / 1e9);
    assert!(cluster.log_text(&name).contains("no pg led here any more"));

    let device = dir.join(&name).join("osd.log");
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let batches = runtime.block_on(async {
        let opened = basalt_osd::log_device::LogDevice::open(&device)
            .await
            .expect("the stopped osd's log opens");
        opened.replayed.batches
    });
    let sizes: Vec<usize> = batches.iter().map(|batch| batch.entries.len()).collect();
    assert!(
        sizes.iter().filter(|&&entries| entries > 0).count() > 10,
        "the osd wrote while it ran: {sizes:?}"
    );
    assert_eq!(sizes.last(), Some(&0), "batches' entries: {sizes:?}");
}

#[test]
fn data_survives_a_crash_of_every_process() {
    let dir = ScratchDir::new("cluster-crash");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    let metrics_port = free_port();
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "32MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let write = verified_write("16M");
    let mut write_only = write.clone();
    write_only.push("--do_verify=0".into());
    fio(&uri, &args(&write_only));

    // Everything dies at once, without a chance to flush anything.
    drop(target);
    cluster.kill_mon();
    for n in 0..3 {
        cluster.kill_osd(n);
    }
    cluster.start_mon();
    cluster.set_osd_args(0, &["--metrics-addr", &format!("127.0.0.1:{metrics_port}")]);
    // One OSD polls after each piece of work instead of sleeping; the verify reads from the
    // PGs it leads through it.
    cluster.set_osd_args(1, &["--poll-us", "200"]);
    for n in 0..3 {
        cluster.start_osd(n);
    }
    cluster.wait_osds_up(3);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let mut verify = write.clone();
    verify.push("--verify_only".into());
    fio(&uri, &args(&verify));
    cluster.wait_replicas_equal(Duration::from_secs(60));

    // Idle, the leaders hold on by heartbeats alone, which go coalesced per peer: no
    // replica calls an election (the timeout is 1 to 2 s).
    let terms = cluster.replica_terms();
    std::thread::sleep(Duration::from_secs(3));
    assert_eq!(
        cluster.replica_terms(),
        terms,
        "terms or leaders changed while idle"
    );

    // The restarted OSD serves Prometheus metrics.
    let metrics = http_get(&format!("127.0.0.1:{metrics_port}"), "/metrics");
    assert!(
        metrics.contains("# TYPE basalt_osd_writes_total counter"),
        "{metrics}"
    );
    assert!(
        metric(&metrics, "basalt_osd_heartbeats_sent_total") > 0.0,
        "{metrics}"
    );
    assert!(
        metrics.contains("basalt_osd_write_amplification"),
        "{metrics}"
    );
}

/// OSDs on raw block devices (loop devices here): a device without a Basalt superblock is
/// formatted only with `--format`, and used as it is from then on (the flag stays); the
/// data survives the OSDs' crash. A second OSD on a device or a data directory in use, or
/// a second monitor on a monitor's data directory, is refused.
#[test]
fn osds_run_on_raw_block_devices_that_no_other_process_may_use() {
    require("qemu-io");
    require("losetup");
    let dir = ScratchDir::new("cluster-block");
    let devices: Vec<LoopDevice> = (0..3)
        .map(|n| LoopDevice::new(&dir.join(&format!("disk{n}.img")), 128 << 20))
        .collect();
    let device = |n: usize| devices[n].path.to_str().expect("utf8 path").to_string();
    // Refused without --format. (Each process that should be refused gets 30 s: one
    // that started would run on.)
    let refused = run(within(30)
        .args(["osd", "--mon", "127.0.0.1:1", "--device", &device(0)])
        .arg("--data-dir")
        .arg(dir.join("refused")));
    let stderr = refused_with(&refused, "not a basalt osd device");
    assert!(stderr.contains("--format"), "{stderr}");
    let osd_on = |device: &str, data_dir: &str| {
        run(within(30)
            .args([
                "osd",
                "--mon",
                "127.0.0.1:1",
                "--format",
                "--device",
                device,
            ])
            .arg("--data-dir")
            .arg(dir.join(data_dir)))
    };
    // A device named that is not there is not made as a file.
    let missing = dir.join("no-such-device");
    let output = osd_on(missing.to_str().expect("utf8"), "missing");
    refused_with(&output, "does not exist");
    assert!(!missing.exists(), "a file made in place of the device");
    // A device that holds something else is not formatted over, even with --format.
    let write_at = |offset: u64, bytes: &[u8]| {
        use std::os::unix::fs::FileExt;
        let file = std::fs::OpenOptions::new()
            .write(true)
            .open(&devices[0].path)
            .expect("open the device");
        file.write_all_at(bytes, offset).expect("write");
        file.sync_all().expect("sync");
    };
    write_at(4096, b"a file system's label");
    refused_with(
        &osd_on(&device(0), "holds-data"),
        "holds data (at byte 4096)",
    );
    write_at(4096, &[0; 64]);
    let on_device = |n: usize| vec!["--device".to_string(), device(n), "--format".to_string()];
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        vec![format!("127.0.0.1:{}", free_port())],
        (0..3).map(|n| (None, on_device(n))).collect(),
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "16MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 0x6b 0 8M"]);

    // The device, and the data directory, are the running OSD's alone.
    let second = |device: &str, data_dir: &std::path::Path| {
        run(within(30)
            .args(["osd", "--mon", &cluster.mon_address, "--device", device])
            .arg("--data-dir")
            .arg(data_dir))
    };
    let in_use = format!("{} is in use", device(0));
    refused_with(&second(&device(0), &dir.join("second")), &in_use);
    let other = dir.join("other.log").display().to_string();
    let output = second(&other, &dir.join("osd.1"));
    refused_with(&output, "is in use by another process (pid ");
    let mon = run(within(30)
        .args(["mon", "--listen", &format!("127.0.0.1:{}", free_port())])
        .arg("--data-dir")
        .arg(dir.join("mon.0")));
    refused_with(&mon, "is in use by another process");

    // Every OSD crashes and starts again with the same flags: the devices are not
    // formatted again, the data reads back.
    drop(target);
    cluster.crash_every_osd();
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, true, &["read -P 0x6b 0 8M", "read -P 0 8M 8M"]);
    for n in 0..3 {
        let log = cluster.log_text(&format!("osd.{n}"));
        let formats = log.matches("formatted the osd device").count();
        assert_eq!(
            formats, 1,
            "osd.{n} formatted its device {formats} times: {log}"
        );
    }
}

/// `basalt`, killed if it still runs after `seconds` (one that should be refused and
/// started would run on).
fn within(seconds: u32) -> Command {
    let mut command = Command::new("timeout");
    command
        .arg(seconds.to_string())
        .arg(env!("CARGO_BIN_EXE_basalt"));
    command
}

/// Checks that the process of `output` failed, saying `expect`; its stderr.
fn refused_with(output: &std::process::Output, expect: &str) -> String {
    let stderr = String::from_utf8_lossy(&output.stderr).to_string();
    assert!(!output.status.success(), "not refused: {stderr}");
    assert!(stderr.contains(expect), "{stderr}");
    stderr
}

/// A pool whose `min_size` is its size holds writes back while one of its replicas is
/// down (as Ceph holds I/O to a PG below `min_size`; raft alone would go on with two of
/// three), and they go through once it is back.
#[test]
fn writes_wait_while_fewer_replicas_than_min_size_are_live() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-min-size");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    let pool = ["pool", "create", "rbd", "--pg-count", "1", "--size", "3"];
    cluster.cli_ok(&[&pool[..], &["--min-size", "3"]].concat());
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "16MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 0x11 0 1M"]);
    let leader = only_pg_leader(&cluster);
    let follower = (0..3)
        .find(|n| cluster.osd_id(*n) != leader)
        .expect("a follower");
    cluster.kill_osd(follower);
    // Longer than a leader counts a silent replica live.
    std::thread::sleep(Duration::from_secs(4));
    let mut writer = Command::new("qemu-io")
        .args(["-f", "raw", "-c", "write -P 0x22 0 1M", &uri])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("qemu-io");
    std::thread::sleep(Duration::from_secs(5));
    assert!(
        writer.try_wait().expect("try_wait").is_none(),
        "a write went through with 2 of 3 replicas live and min_size 3"
    );
    cluster.start_osd(follower);
    let started = Instant::now();
    let status = loop {
        if let Some(status) = writer.try_wait().expect("try_wait") {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(45),
            "the write stayed held back with every replica back"
        );
        std::thread::sleep(Duration::from_millis(100));
    };
    assert!(status.success(), "the held write failed: {status}");
    qemu_io_ok(&uri, true, &["read -P 0x22 0 1M"]);
}

/// A loop device over a sparse file, detached when dropped.
struct LoopDevice {
    path: std::path::PathBuf,
}

impl LoopDevice {
    fn new(file: &std::path::Path, len: u64) -> Self {
        sparse_file(file, len);
        let path = run_ok(Command::new("losetup").args(["-f", "--show"]).arg(file));
        Self {
            path: path.trim().into(),
        }
    }
}

impl Drop for LoopDevice {
    fn drop(&mut self) {
        let _ = Command::new("losetup").arg("-d").arg(&self.path).status();
    }
}

#[test]
fn the_cli_refuses_bad_input_with_a_clear_message() {
    let dir = ScratchDir::new("cluster-cli");
    let cluster = ClusterProcesses::start(&dir.path, 1);
    let refused = |args: &[&str], expect: &str| {
        let output = cluster.cli(args);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "basalt {args:?} succeeded");
        assert!(stderr.contains(expect), "basalt {args:?}: {stderr}");
    };
    refused(
        &["pool", "create", "p", "--pg-count", "3", "--size", "1"],
        "power of two",
    );
    refused(
        &["pool", "create", "p", "--pg-count", "4", "--size", "0"],
        "size 0",
    );
    // 2048 PG replicas on the one OSD: more than an OSD is let hold.
    refused(
        &["pool", "create", "p", "--pg-count", "2048", "--size", "1"],
        "would put 2048 PG replicas on each of the 1 OSDs in, more than 1000",
    );
    refused(
        &["image", "create", "nopool/img", "--size", "1GiB"],
        "\"nopool\" does not exist",
    );
    refused(
        &["image", "create", "noslash", "--size", "1GiB"],
        "is not POOL/NAME",
    );
    refused(&["image", "info", "nopool/img"], "does not exist");
    refused(&["pool", "rm", "nopool"], "pool \"nopool\" does not exist");
    refused(&["pg", "query", "zz"], "is not a PG id");
    // An OSD whose device would hold next to nothing once the cleaner's room is kept.
    let tiny = dir.path.join("tiny-osd");
    refused(
        &[
            "osd",
            "--data-dir",
            tiny.to_str().expect("utf-8"),
            "--device-size",
            "40MiB",
            "--sparse-device",
        ],
        "use a larger device",
    );
    // It held nothing: it is gone, so that a start with a larger size makes it again.
    assert!(!tiny.join("osd.log").exists(), "a device too small is kept");
    let tiny = tiny.to_str().expect("utf-8");
    refused(
        &["osd", "--data-dir", tiny, "--listen", "0.0.0.0:0"],
        "give the address of one interface",
    );
    let mon = run(basalt().args(["mon", "--grace", "1", "--data-dir", tiny]));
    refused_with(&mon, "--grace 1: at least 3 seconds");
    cluster.cli_ok(&["pool", "create", "p", "--pg-count", "4", "--size", "1"]);
    refused(
        &["pool", "create", "p", "--pg-count", "4", "--size", "1"],
        "already exists",
    );
    refused(&["image", "create", "p/img", "--size", "0"], "size");
    cluster.cli_ok(&[
        "image",
        "create",
        "p/img",
        "--size",
        "1GiB",
        "--object-size",
        "1MiB",
    ]);
    let info = cluster.cli_json(&["image", "info", "p/img"]);
    assert_eq!(info["size_bytes"], 1u64 << 30);
    assert_eq!(info["object_size_bytes"], 1u64 << 20);
    refused(&["pool", "rm", "p"], "still holds 1 image");
    // A PG whose only replica reads back its whole log has nothing to give up.
    let pg = cluster.cli_json(&["pg", "ls"])[0]["pg"]
        .as_str()
        .expect("a pg id")
        .to_string();
    refused(&["pg", "mark-unfound-lost", &pg], "reads back every entry");
    refused(
        &["pg", "mark-unfound-lost", "99.0"],
        "pg 99.0 does not exist",
    );
    // A PG with a leader has its quorum.
    cluster.wait_clean(Duration::from_secs(60));
    refused(&["pg", "force-quorum", &pg], "has a leader");
    refused(&["pg", "force-quorum", "99.0"], "pg 99.0 does not exist");
    refused(&["pg", "force-quorum", "zz"], "is not a PG id");
    // A client that writes past the image's end (1024 objects of 1 MiB) is refused, the
    // last object is not; once the image grows, the same write goes in.
    assert_eq!(write_object(&cluster, "img", 1023), Ok(()));
    let past = write_object(&cluster, "img", 1024).expect_err("a write past the end");
    assert!(past.contains("past the image"), "{past}");
    write_object(&cluster, "img", 1 << 40).expect_err("a write far past the end");
    cluster.cli_ok(&["image", "resize", "p/img", "--size", "2GiB"]);
    assert_eq!(write_object(&cluster, "img", 1024), Ok(()));
    assert_eq!(
        cluster.cli_json(&["image", "ls", "p"])[0]["size_bytes"],
        2u64 << 30
    );
    refused(&["image", "rm", "p/nothing"], "does not exist");
    refused(&["image", "resize", "p/img", "--size", "1000"], "size");
    // A shrink discards data for good: only when asked for in so many words.
    refused(
        &["image", "resize", "p/img", "--size", "1GiB"],
        "a resize to 1GiB would discard the data past it, for good (`basalt image resize \
         --allow-shrink` does)",
    );
    assert_eq!(
        cluster.cli_json(&["image", "info", "p/img"])["size_bytes"],
        2u64 << 30
    );
    // Status shows the client I/O going on, from the OSDs' reports.
    let mut bench = basalt()
        .args(["bench", "--image", "p/img", "--mon", &cluster.mon_address])
        .args(["--rw", "randwrite", "--runtime", "6", "--size", "16MiB"])
        .stdout(std::process::Stdio::null())
        .spawn()
        .expect("basalt bench");
    wait_for("status to show writes", Duration::from_secs(6), || {
        let client = &cluster.cli_json(&["status"])["client"];
        client["write_ops_per_second"].as_f64() > Some(0.0)
            && client["write_bytes_per_second"].as_f64() > Some(0.0)
    });
    let text = cluster.cli_ok(&["status"]);
    let client = text
        .lines()
        .find(|line| line.trim_start().starts_with("client:"))
        .unwrap_or_else(|| panic!("no client line: {text}"));
    assert!(!client.ends_with(" 0 op/s wr"), "{client}");
    assert!(bench.wait().expect("bench").success());
    cluster.cli_ok(&["image", "rm", "p/img"]);
    cluster.cli_ok(&["pool", "rm", "p"]);
    assert_eq!(cluster.cli_json(&["pool", "ls"]), json!([]));

    // No monitor at that address: a clear error, not a hang.
    let dead = format!("127.0.0.1:{}", free_port());
    let output = run(basalt().args(["status", "--mon", &dead]));
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("no monitor answered"), "{stderr}");
    let output = run(basalt()
        .args(["status"])
        .env("BASALT_CONF", dir.join("missing.toml")));
    assert!(!output.status.success());
    assert!(String::from_utf8_lossy(&output.stderr).contains("missing.toml"));
}

/// Writes 4 KiB at the start of object `number` of image `name` straight to the OSD that
/// leads its PG (a one-OSD cluster, pool of size 1), as a client would, asking again while
/// the PG has no leader yet: `Err` with the OSD's reason if refused.
fn write_object(cluster: &ClusterProcesses, name: &str, number: u64) -> Result<(), String> {
    object_call(cluster, name, number, None, |pg, epoch, term, object| {
        Message::Write {
            pg,
            epoch,
            term,
            object,
            offset_bytes: 0,
            data: vec![7; 4096],
        }
    })
    .map(|_| ())
}

/// Sends the request `make` builds for object `number` of image `name` to the PG's leader
/// (trying its members in turn), naming leader term `term`, or if `None` the term the
/// leader gives when asked; asks again while the PG has no leader yet. `Ok` with the term
/// named and the reply's data, `Err` with the OSD's reason if refused.
fn object_call(
    cluster: &ClusterProcesses,
    name: &str,
    number: u64,
    term: Option<u64>,
    make: impl Fn(basalt_common::PgId, basalt_common::Epoch, u64, basalt_common::ObjectKey) -> Message,
) -> Result<(u64, Vec<u8>), String> {
    let deadline = Instant::now() + Duration::from_secs(30);
    let mut named = term.unwrap_or(0);
    let mut member = 0;
    block_on(async {
        loop {
            let map = fetch_map(cluster).await;
            let image = map
                .images
                .values()
                .find(|image| image.name == name)
                .expect("the image");
            let object = basalt_common::ObjectKey {
                image: image.id,
                number,
            };
            let pg = map.pools[&image.pool].pg_of(object);
            let members = &map.pg(pg).expect("the pg").members;
            let osd = &map.osds[&members[member % members.len()]];
            let address = osd.address.parse().expect("address");
            let client = basalt_wire::tcp::Client::connect(address)
                .await
                .expect("connect to the osd");
            let request = make(pg, map.epoch, named, object);
            match client.call(&request).await.expect("an answer") {
                Message::Reply {
                    status: Status::Ok,
                    data,
                } => return Ok((named, data)),
                Message::Reply {
                    status: Status::StaleTerm { current },
                    ..
                } if term.is_none() => named = current,
                Message::Reply {
                    status: Status::NotLeader { .. } | Status::StaleEpoch { .. },
                    ..
                } if Instant::now() < deadline => {
                    member += 1;
                    tokio::time::sleep(Duration::from_millis(100)).await;
                }
                Message::Reply { status, .. } => return Err(format!("{status:?}")),
                other => panic!("not a reply: {other:?}"),
            }
        }
    })
}

/// `basalt pg scrub` compares each PG's replicas by the data they read back from their
/// devices: all consistent after writes; a byte flipped on one OSD's device under a written
/// block makes that block's PG inconsistent, naming that OSD, and the command fail. The
/// background scrubs (every second here) find it too: `basalt status` turns HEALTH_ERR and
/// names the PG and the OSD. `basalt pg repair` rebuilds that replica from the leader: every
/// PG is consistent again, health keeps only its warning about the device (through the
/// OSD's restart), and the OSD restarts. Damage in data
/// written after that makes it refuse to restart on the damaged log.
#[test]
fn scrub_finds_the_replica_whose_device_was_corrupted() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-scrub");
    let scrubbing = || {
        (
            None,
            vec!["--scrub-interval-seconds".to_string(), "1".to_string()],
        )
    };
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        vec![format!("127.0.0.1:{}", free_port())],
        vec![scrubbing(), scrubbing(), scrubbing()],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "16MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 0x5a 0 1M", "write -P 0x33 4M 3M"]);
    let pgs = scrub(&cluster, true);
    assert_eq!(pgs.len(), 8);
    assert!(pgs.iter().all(|pg| pg["state"] == "consistent"), "{pgs:?}");
    // Several rounds of background scrubs, all consistent.
    std::thread::sleep(Duration::from_secs(3));
    let health = cluster.health();
    assert_eq!(health.0, "HEALTH_OK", "{health:?}");
    // A PG named that does not exist is reported with the others, and fails the scrub.
    let first = pgs[0]["pg"].as_str().expect("a pg id");
    let output = cluster.cli(&["pg", "scrub", first, "9.0", "--json"]);
    assert!(!output.status.success());
    let named: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert_eq!(named[0]["state"], "consistent", "{named}");
    assert_eq!(named[1]["state"], "not compared", "{named}");
    assert!(
        named[1]["why"]
            .as_str()
            .is_some_and(|why| why.contains("pg 9.0 does not exist")),
        "{named}"
    );

    // One block of the 0x5a megabyte on osd process 1's device gets a byte flipped.
    flip_a_byte_in_a_block_of(&dir.join("osd.1").join("osd.log"), 0x5a);
    let victim = cluster.osd_id(1);
    let pgs = scrub(&cluster, false);
    let inconsistent: Vec<&serde_json::Value> = pgs
        .iter()
        .filter(|pg| pg["state"] != "consistent")
        .collect();
    assert_eq!(inconsistent.len(), 1, "{pgs:?}");
    assert_eq!(inconsistent[0]["state"], "inconsistent");
    assert_eq!(inconsistent[0]["odd"], json!([victim]), "{pgs:?}");
    let text = cluster.cli(&["pg", "scrub"]);
    let text = String::from_utf8_lossy(&text.stdout);
    assert!(
        text.contains(&format!("INCONSISTENT: osd.{victim} differs"))
            && text.contains("7 pgs consistent, 1 inconsistent, 0 not compared"),
        "{text}"
    );
    let named = format!(
        "1 pgs inconsistent: pg {} (osd.{victim})",
        inconsistent[0]["pg"].as_str().expect("a pg id")
    );
    wait_for(
        "a background scrub to find the damage",
        Duration::from_secs(30),
        || {
            let (status, checks) = cluster.health();
            status == "HEALTH_ERR" && checks.contains(&named)
        },
    );
    let text = cluster.cli_ok(&["status"]);
    assert!(
        text.contains("health: HEALTH_ERR")
            && text.contains(&named)
            && text.contains("1 active+clean+inconsistent"),
        "{text}"
    );
    let listed = cluster.cli_json(&["pg", "ls"]);
    let states: Vec<(&str, &str)> = listed
        .as_array()
        .expect("pg list")
        .iter()
        .filter_map(|pg| Some((pg["pg"].as_str()?, pg["state"].as_str()?)))
        .collect();
    let damaged_pg = inconsistent[0]["pg"].as_str().expect("a pg id");
    for (pg, state) in &states {
        let expected = if *pg == damaged_pg {
            "active+clean+inconsistent"
        } else {
            "active+clean"
        };
        assert_eq!(*state, expected, "{states:?}");
    }

    // `basalt pg repair` rebuilds that replica from the leader and scrubs again; a PG
    // whose replicas agree needs nothing.
    let damaged = inconsistent[0]["pg"].as_str().expect("a pg id").to_string();
    // (One that holds data.)
    let healthy = pgs
        .iter()
        .find(|pg| pg["state"] == "consistent" && pg["digest"] != "00000000")
        .and_then(|pg| pg["pg"].as_str())
        .expect("a consistent pg")
        .to_string();
    let output = cluster.cli(&["pg", "repair", &damaged, &healthy, "--json"]);
    let repaired: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert!(output.status.success(), "{repaired}");
    assert_eq!(repaired[0]["state"], "repaired", "{repaired}");
    assert_eq!(repaired[0]["repaired"], json!([victim]), "{repaired}");
    assert_eq!(repaired[1]["state"], "consistent", "{repaired}");
    // A replica named is rebuilt whatever the scrubs found: the leader's hands leadership
    // over first.
    let leader_of = |pg: &str| {
        let states = cluster.cli_json(&["pg", "query", pg]);
        states[0]["leader"].as_u64().expect("a leader")
    };
    let leader = leader_of(&healthy);
    let output = cluster.cli(&[
        "pg",
        "repair",
        &healthy,
        "--osd",
        &leader.to_string(),
        "--json",
    ]);
    let repaired: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert!(output.status.success(), "{repaired}");
    assert_eq!(repaired[0]["state"], "repaired", "{repaired}");
    assert_eq!(repaired[0]["repaired"], json!([leader]), "{repaired}");
    assert_ne!(leader_of(&healthy), leader);
    let output = cluster.cli(&["pg", "repair", &healthy, "--osd", "osd.99"]);
    assert!(!output.status.success());
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(text.contains("osd.99 holds no replica of pg"), "{text}");
    let pgs = scrub(&cluster, true);
    assert!(pgs.iter().all(|pg| pg["state"] == "consistent"), "{pgs:?}");
    // Health names the device that gave back damaged bytes for an hour, and nothing else.
    let checksums =
        format!("1 osds read blocks failing their checksum in the last hour: osd.{victim} (");
    let only_the_checksum_warning = |cluster: &ClusterProcesses| {
        let (status, checks) = cluster.health();
        status == "HEALTH_WARN"
            && checks.contains(&checksums)
            && serde_json::from_str::<Vec<String>>(&checks).is_ok_and(|c| c.len() == 1)
    };
    wait_for(
        "the background scrubs to find every pg consistent",
        Duration::from_secs(30),
        || only_the_checksum_warning(&cluster),
    );
    qemu_io_ok(&uri, false, &["read -P 0x5a 0 1M", "read -P 0x33 4M 3M"]);
    // The repaired OSD restarts: replay no longer goes through the damaged batch.
    cluster.kill_osd(1);
    cluster.start_osd(1);
    cluster.wait_clean(Duration::from_secs(60));
    // Still named: the monitor keeps what it heard through the OSD's restart.
    wait_for(
        "health to warn of the device alone",
        Duration::from_secs(30),
        || only_the_checksum_warning(&cluster),
    );
    // And by a monitor that restarted since: the OSD keeps its count through its restart.
    cluster.kill_mon();
    cluster.start_mon();
    wait_for(
        "health to warn of the device alone after the monitor's restart",
        Duration::from_secs(30),
        || only_the_checksum_warning(&cluster),
    );
    let pgs = scrub(&cluster, true);
    assert!(pgs.iter().all(|pg| pg["state"] == "consistent"), "{pgs:?}");

    // Damage again, in data written after the repair, that replay must go through.
    write_in_batches_of_their_own(
        &cluster,
        &uri,
        &["write -P 0x77 8M 1M", "write -P 0x44 12M 1M"],
    );
    // Restarted, the OSD replays its log, finds the damaged data with intact batches after
    // it, marks it damaged, goes on, and has its copy rebuilt from another replica. (The
    // damage is done while the OSD is down: running, its background scrubs could find it
    // first.)
    cluster.kill_osd(1);
    flip_a_byte_in_a_block_of(&dir.join("osd.1").join("osd.log"), 0x77);
    let repairs_before = repairs_of_osd_1(&cluster);
    cluster.start_osd(1);
    let why = ["replay found data in the batch of lsn", "damaged at rest"];
    let reads = ["read -P 0x77 8M 1M", "read -P 0x44 12M 1M"];
    expect_osd_1_rebuilt(&cluster, repairs_before, &why, (&uri, &reads));

    // Damage replay meets while the other replicas are down, so that no repair can be
    // done: the OSD cuts a checkpoint past it at once, which marks it; restarted with the
    // others, replay no longer goes through it, and the checkpoint's marks have the copy
    // rebuilt.
    write_in_batches_of_their_own(
        &cluster,
        &uri,
        &["write -P 0x22 10M 1M", "write -P 0x23 11M 1M"],
    );
    for n in 0..3 {
        cluster.kill_osd(n);
    }
    flip_a_byte_in_a_block_of(&dir.join("osd.1").join("osd.log"), 0x22);
    let asked = |cluster: &ClusterProcesses| {
        let log = cluster.log_text("osd.1");
        log.matches("checkpoint written as asked").count()
    };
    let checkpoints_before = asked(&cluster);
    cluster.start_osd(1);
    wait_for_telling(
        "a checkpoint past the damage",
        Duration::from_secs(60),
        || asked(&cluster) > checkpoints_before,
        || format!(": {}", cluster.log_text("osd.1")),
    );
    cluster.kill_osd(1);
    let repairs_before = repairs_of_osd_1(&cluster);
    // (The damaged one first: if its log reads the damage, it waits for the others.)
    for n in [1, 0, 2] {
        cluster.start_osd(n);
    }
    let why = ["the checkpoint marks data it reads damaged, not rebuilt yet"];
    let reads = ["read -P 0x22 10M 1M", "read -P 0x23 11M 1M"];
    expect_osd_1_rebuilt(&cluster, repairs_before, &why, (&uri, &reads));

    // Damage to a batch's header (the OSD's own records of what the batch holds): the
    // OSD refuses to start rather than drop what followed it.
    write_in_batches_of_their_own(
        &cluster,
        &uri,
        &["write -P 0x66 14M 1M", "write -P 0x55 15M 1M"],
    );
    cluster.kill_osd(1);
    flip_a_byte_in_the_header_of_a_batch_of(&dir.join("osd.1").join("osd.log"), 0x66);
    // (Under `timeout`: an OSD that started would never end.)
    let refused = run(within(60)
        .args(["osd", "--mon", &cluster.mon_addresses()[0], "--data-dir"])
        .arg(dir.join("osd.1")));
    let stderr = refused_with(&refused, "the log is damaged");
    assert!(stderr.contains("basalt osd out"), "{stderr}");
}

/// Writes each of `writes` through `uri` in turn, waiting after each until every replica
/// holds it, so that on every OSD each lies in a batch of its own and a later batch follows
/// the first: damage in the last batch of a log is taken for a torn write. (Without the
/// wait, a replica that lags behind the two that acknowledged the first write, a follower
/// or a leader whose own log write is still going, may take both in one batch: CI once saw
/// replay take the damaged batch for the torn end of the log. A replica applies only
/// what its log holds.)
fn write_in_batches_of_their_own(cluster: &ClusterProcesses, uri: &str, writes: &[&str]) {
    for write in writes {
        qemu_io_ok(uri, false, &[write]);
        cluster.wait_replicas_equal(Duration::from_secs(60));
    }
}

/// Every PG's scrub verdict (`basalt pg scrub --json`), which must succeed or fail as
/// `expect_success` says.
fn scrub(cluster: &ClusterProcesses, expect_success: bool) -> Vec<serde_json::Value> {
    let output = cluster.cli(&["pg", "scrub", "--json"]);
    assert_eq!(
        output.status.success(),
        expect_success,
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let pgs: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    pgs.as_array().expect("a list").clone()
}

/// The copies osd process 1 has rebuilt, as its log counts them.
fn repairs_of_osd_1(cluster: &ClusterProcesses) -> usize {
    cluster.log_text("osd.1").matches(" repaired pg=").count()
}

/// Waits for osd process 1 to rebuild a copy (more than `before`), then checks that its
/// log says each of `why`, that the cluster goes clean and every PG scrubs consistent, and
/// that the qemu-io `reads` pass through `uri`.
fn expect_osd_1_rebuilt(
    cluster: &ClusterProcesses,
    before: usize,
    why: &[&str],
    (uri, reads): (&str, &[&str]),
) {
    wait_for("osd.1's copy rebuilt", Duration::from_secs(90), || {
        repairs_of_osd_1(cluster) > before
    });
    let log = cluster.log_text("osd.1");
    assert!(why.iter().all(|line| log.contains(line)), "{why:?}: {log}");
    cluster.wait_clean(Duration::from_secs(60));
    let pgs = scrub(cluster, true);
    assert!(pgs.iter().all(|pg| pg["state"] == "consistent"), "{pgs:?}");
    qemu_io_ok(uri, true, reads);
}

/// A follower catching up is never sent a payload that is damaged on its leader: the
/// leader, reading the entries back to send them, finds a block failing its checksum,
/// holds them back and hands the PG to the other follower, which sends its own copy; the
/// leader's copy is rebuilt. Every replica ends equal, with the data written.
#[test]
fn a_follower_catching_up_is_never_sent_a_damaged_payload() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-damaged-entries");
    let mut cluster = ClusterProcesses::start(&dir.path, 3);
    let (_target, uri) = one_pg_image(&dir.path, &cluster, "rbd", 3);
    cluster.wait_replicas_equal(Duration::from_secs(60));
    let leader = only_pg_leader(&cluster);
    let leader_process = cluster.osd_process(leader);
    let behind = (0..3).find(|n| *n != leader_process).expect("a follower");
    cluster.kill_osd(behind);
    qemu_io_ok(&uri, false, &["write -P 0x7c 2M 1M"]);
    let name = format!("osd.{leader_process}");
    flip_a_byte_in_a_block_of(&dir.join(&name).join("osd.log"), 0x7c);
    cluster.start_osd(behind);
    wait_for(
        "the leader's damaged copy rebuilt",
        Duration::from_secs(90),
        || cluster.log_text(&name).contains(" repaired pg="),
    );
    let log = cluster.log_text(&name);
    assert!(
        log.contains("entries held back from a follower: a payload among them is damaged here")
            && log
                .contains("this replica's copy of the pg is damaged: it is rebuilt from another's"),
        "{log}"
    );
    assert_every_pg_consistent(&cluster);
    qemu_io_ok(&uri, true, &["read -P 0x5a 0 1M", "read -P 0x7c 2M 1M"]);
}

/// The leader of the cluster's one PG as its replicas know it (the newest term's): the
/// monitor's view lags behind a change of leader.
fn only_pg_leader(cluster: &ClusterProcesses) -> u32 {
    let pgs = cluster.cli_json(&["pg", "ls"]);
    let pg = pgs[0]["pg"].as_str().expect("a pg id");
    let replicas = cluster.cli_json(&["pg", "query", pg]);
    replicas
        .as_array()
        .expect("replicas")
        .iter()
        .max_by_key(|replica| replica["term"].as_u64())
        .and_then(|replica| replica["leader"].as_u64())
        .expect("a leader") as u32
}

/// Waits for the replicas to be equal, then checks that `pg scrub` finds every PG's
/// replicas agreeing.
fn assert_every_pg_consistent(cluster: &ClusterProcesses) {
    cluster.wait_replicas_equal(Duration::from_secs(60));
    let scrubbed = cluster.cli_json(&["pg", "scrub"]);
    let scrubbed = scrubbed.as_array().expect("a list");
    assert!(
        scrubbed.iter().all(|pg| pg["state"] == "consistent"),
        "{scrubbed:?}"
    );
}

/// A block of a leader's copy that the device changed under it is never read back: the
/// leader finds that it fails its checksum, hands the PG to another replica and has its
/// copy rebuilt from it, while the client's read, told to retry, gets the data written
/// from the new leader. With no other replica, the read fails instead (EIO).
#[test]
fn a_damaged_block_of_the_leader_is_never_read_back() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-damaged");
    let cluster = ClusterProcesses::start(&dir.path, 3);
    let (_target, uri) = one_pg_image(&dir.path, &cluster, "rbd", 3);
    let leader = only_pg_leader(&cluster);
    let process = cluster.osd_process(leader);
    let name = format!("osd.{process}");
    flip_a_byte_in_a_block_of(&dir.join(&name).join("osd.log"), 0x5a);
    // qemu-io checks every byte against the pattern.
    qemu_io_ok(&uri, true, &["read -P 0x5a 0 1M"]);
    let log = cluster.log_text(&name);
    assert!(
        log.contains("this replica's copy of the pg is damaged: it is rebuilt from another's"),
        "{log}"
    );
    wait_for("the damaged copy rebuilt", Duration::from_secs(60), || {
        cluster.log_text(&name).contains(" repaired pg=")
    });
    let log = cluster.log_text(&name);
    assert!(log.contains("leadership handed over for a repair"), "{log}");
    let named =
        format!("1 osds read blocks failing their checksum in the last hour: osd.{leader} (");
    wait_for(
        "health to name the damaged reads",
        Duration::from_secs(20),
        || cluster.health().1.contains(&named),
    );
    assert_eq!(cluster.health().0, "HEALTH_WARN");
    assert_every_pg_consistent(&cluster);
    qemu_io_ok(&uri, true, &["read -P 0x5a 0 1M"]);

    // A pool of one replica: nothing to rebuild from, and the damage is not read back.
    cluster.cli_ok(&["pool", "create", "one", "--pg-count", "1", "--size", "1"]);
    cluster.cli_ok(&["image", "create", "one/vol", "--size", "4MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let second = dir.join("second-target");
    std::fs::create_dir_all(&second).expect("a directory for a second target");
    let (_single, single) = export_image(&second, &cluster, "one", "vol");
    qemu_io_ok(&single, false, &["write -P 0x6b 0 64k"]);
    let pgs = cluster.cli_json(&["pg", "ls"]);
    let host = pgs
        .as_array()
        .expect("pg list")
        .iter()
        .find(|pg| pg["members"].as_array().is_some_and(|m| m.len() == 1))
        .and_then(|pg| pg["leader"].as_u64())
        .expect("the one replica leads") as u32;
    let name = format!("osd.{}", cluster.osd_process(host));
    flip_a_byte_in_a_block_of(&dir.join(&name).join("osd.log"), 0x6b);
    let (read, output) = qemu_io(&single, true, &["read -P 0x6b 0 64k"]);
    assert!(
        !read,
        "a damaged block of the only replica read back: {output}"
    );
    assert!(output.contains("Input/output error"), "{output}");
    assert!(
        cluster.log_text(&name).contains(
            "this replica's copy of the pg is damaged, and no other replica holds the pg"
        ),
        "a damaged read not reported"
    );
}

/// A PG of two replicas whose leader holds the only copy of entries past the commit index
/// (its follower was down while it took them), one of them with a payload damaged on its
/// device, has no leader once they restart: elected, that replica cannot send them, and it
/// refuses its vote to the other, whose log is shorter. `basalt status` names the PG and the
/// OSD; `basalt pg mark-unfound-lost` has that replica give them up, the other is elected,
/// and the PG takes writes again, with what was acknowledged before intact.
#[test]
fn a_pg_whose_only_copy_of_entries_is_damaged_leads_again_once_they_are_given_up() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-unfound");
    let mut cluster = ClusterProcesses::start(&dir.path, 2);
    let (_target, uri) = one_pg_image(&dir.path, &cluster, "p", 2);
    let pg = cluster.cli_json(&["pg", "ls"])[0]["pg"]
        .as_str()
        .expect("a pg id")
        .to_string();
    let leader_id = only_pg_leader(&cluster);
    let leader = cluster.osd_process(leader_id);
    let follower = 1 - leader;
    // Writes the leader takes and cannot commit, each in a batch of its own. (The follower
    // killed, not paused: a paused one would find them in its socket when it goes on.)
    cluster.kill_osd(follower);
    for (pattern, at) in [("0x99", "2M"), ("0x98", "3M"), ("0x97", "4M")] {
        let command = format!("write -P {pattern} {at} 64k");
        let output =
            run(Command::new("timeout").args(["3", "qemu-io", "-f", "raw", &uri, "-c", &command]));
        assert!(
            !output.status.success(),
            "a write acknowledged without its follower"
        );
    }
    cluster.kill_osd(leader);
    flip_a_byte_in_a_block_of(&dir.join(&format!("osd.{leader}")).join("osd.log"), 0x99);
    cluster.start_osd(follower);
    cluster.start_osd(leader);
    let named = format!("pg {pg} (osd.{leader_id})");
    wait_for(
        "health to name the pg and the osd that cannot send its entries",
        Duration::from_secs(90),
        || {
            let (_, checks) = cluster.health();
            checks.contains("cannot send") && checks.contains(&named)
        },
    );
    let output = cluster.cli(&["pg", "mark-unfound-lost", &pg]);
    let text = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{text}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        text.contains(&format!("osd.{leader_id}: gives up the entries of pg {pg}")),
        "{text}"
    );
    cluster.wait_clean(Duration::from_secs(90));
    qemu_io_ok(&uri, true, &["read -P 0x5a 0 1M"]);
    qemu_io_ok(&uri, false, &["write -P 0x11 8M 64k"]);
    qemu_io_ok(&uri, true, &["read -P 0x11 8M 64k"]);
    let (_, checks) = cluster.health();
    assert!(!checks.contains("cannot send"), "{checks}");
}

/// Flips a byte of the first block of `device` filled with `fill`.
fn flip_a_byte_in_a_block_of(device: &std::path::Path, fill: u8) {
    use std::io::{Read, Seek, Write};
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .expect("the device file");
    let mut block = vec![0u8; 4096];
    let mut at = None;
    for offset in (0u64..).step_by(4096) {
        if file.read_exact(&mut block).is_err() {
            break;
        }
        if block.iter().all(|byte| *byte == fill) {
            at = Some(offset);
            break;
        }
    }
    let at = at.expect("a written block on the device");
    file.seek(std::io::SeekFrom::Start(at)).expect("seek");
    file.write_all(&[!fill]).expect("corrupt a byte");
    file.sync_all().expect("sync");
}

/// A write that names a leader term the PG's leader no longer has is refused and lands
/// nowhere: a write held up (in a socket, say) past its client's timeout, whose retry was
/// done by another leader, must not be proposed after the writes the host sent next if its
/// OSD has led the PG again since. Here the one OSD of a pool of size 1 restarts, so that
/// it leads the PG in a later term.
#[test]
fn a_write_naming_an_old_leader_term_is_refused() {
    let dir = ScratchDir::new("cluster-term");
    let mut cluster = ClusterProcesses::start(&dir.path, 1);
    cluster.cli_ok(&["pool", "create", "p", "--pg-count", "1", "--size", "1"]);
    cluster.cli_ok(&["image", "create", "p/img", "--size", "4MiB"]);
    let write = |fill: u8| {
        move |pg, epoch, term, object| Message::Write {
            pg,
            epoch,
            term,
            object,
            offset_bytes: 0,
            data: vec![fill; 4096],
        }
    };
    let read = |pg, epoch, term, object| Message::Read {
        pg,
        epoch,
        term,
        object,
        offset_bytes: 0,
        len_bytes: 4096,
    };
    let (old, _) = object_call(&cluster, "img", 0, None, write(0x11)).expect("a write");
    assert!(old > 0, "the leader names its term");
    // A write naming no term is not proposed either: the leader answers with its term.
    let unnamed = object_call(&cluster, "img", 0, Some(0), write(0x22)).expect_err("refused");
    assert_eq!(unnamed, format!("StaleTerm {{ current: {old} }}"));

    cluster.kill_osd(0);
    cluster.start_osd(0);
    let refused = object_call(&cluster, "img", 0, Some(old), write(0x33)).expect_err("refused");
    let current: u64 = refused
        .strip_prefix("StaleTerm { current: ")
        .and_then(|rest| rest.strip_suffix(" }"))
        .and_then(|term| term.parse().ok())
        .unwrap_or_else(|| panic!("refused for another reason: {refused}"));
    assert!(current > old, "the restarted OSD leads in a later term");
    let (_, data) = object_call(&cluster, "img", 0, None, read).expect("a read");
    assert_eq!(data, vec![0x11; 4096], "the refused write did not land");
    // Nor later: it is not in the log.
    cluster.kill_osd(0);
    cluster.start_osd(0);
    let (_, data) = object_call(&cluster, "img", 0, None, read).expect("a read");
    assert_eq!(data, vec![0x11; 4096]);
    let (now, _) = object_call(&cluster, "img", 0, None, write(0x44)).expect("a write");
    assert!(now > current, "a write naming the leader's term goes in");
    let (_, data) = object_call(&cluster, "img", 0, None, read).expect("a read");
    assert_eq!(data, vec![0x44; 4096]);
}

/// A monitor cut off from the others (here, the other two stopped) stops answering map
/// reads once its election timeout passes with no leader: clients subscribed to it go to
/// another monitor instead of hearing "nothing newer" from its old map for as long as it
/// is cut off. A reader naming only it gets a clear error, and answers again once the
/// others are back.
#[test]
fn a_monitor_out_of_quorum_sends_map_readers_elsewhere() {
    let dir = ScratchDir::new("cluster-mon-out-of-quorum");
    let cluster = ClusterProcesses::start_with_mons(&dir.path, 3, 3);
    let lone = cluster.mon_addresses()[0].clone();
    let osd_ls = || run(basalt().args(["osd", "ls", "--mon", &lone]));
    assert!(osd_ls().status.success());
    cluster.signal_mon_n(1, "STOP");
    cluster.signal_mon_n(2, "STOP");
    wait_for(
        "the lone monitor to refuse map reads",
        Duration::from_secs(30),
        || {
            let output = osd_ls();
            !output.status.success()
                && String::from_utf8_lossy(&output.stderr).contains("out of touch with a quorum")
        },
    );
    cluster.signal_mon_n(1, "CONT");
    cluster.signal_mon_n(2, "CONT");
    wait_for("map reads again", Duration::from_secs(30), || {
        osd_ls().status.success()
    });
}

#[test]
fn three_monitors_survive_the_loss_of_their_leader() {
    let dir = ScratchDir::new("cluster-mons");
    let mut cluster = ClusterProcesses::start_with_mons(&dir.path, 3, 3);
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "32MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let status = cluster.cli_json(&["status"]);
    assert_eq!(
        status["monitors"].as_array().map(Vec::len),
        Some(3),
        "{status:#}"
    );
    let all_in_quorum = |cluster: &ClusterProcesses| {
        let status = cluster.cli_json(&["status"]);
        status["quorum"].as_array().map(Vec::len) == Some(3)
    };
    wait_for(
        "all three monitors in quorum",
        Duration::from_secs(10),
        || all_in_quorum(&cluster),
    );
    let leader = status["leader"].as_str().expect("a leader").to_string();
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let write = verified_write("16M");
    let mut write_only = write.clone();
    write_only.push("--do_verify=0".into());
    fio(&uri, &args(&write_only));

    // The leading monitor dies: the other two elect a leader and go on.
    let dead = cluster
        .mon_addresses()
        .iter()
        .position(|address| *address == leader)
        .expect("the leader is one of ours");
    cluster.kill_mon_n(dead);
    let started = Instant::now();
    let status = loop {
        let output = cluster.cli(&["status", "--json"]);
        if output.status.success() {
            let status: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
            if status["leader"].as_str().is_some_and(|l| l != leader) {
                break status;
            }
        }
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "no new monitor leader"
        );
        std::thread::sleep(Duration::from_millis(200));
    };
    eprintln!(
        "new monitor leader {} after {:?}",
        status["leader"],
        started.elapsed()
    );
    // Health names the dead monitor (Ceph's MON_DOWN), and the quorum leaves it out.
    wait_for(
        "health to name the dead monitor",
        Duration::from_secs(30),
        || {
            let status = cluster.cli_json(&["status"]);
            let named = status["health"]["checks"].as_array().is_some_and(|checks| {
                checks.iter().any(|check| {
                    check.as_str().is_some_and(|check| {
                        check.starts_with("1/3 monitors out of quorum: ") && check.contains(&leader)
                    })
                })
            });
            let quorum = status["quorum"].as_array().cloned().unwrap_or_default();
            named && quorum.len() == 2 && !quorum.iter().any(|monitor| *monitor == leader.as_str())
        },
    );
    // Changes still commit, through whichever monitor the CLI reaches.
    cluster.cli_ok(&["image", "create", "rbd/second", "--size", "8MiB"]);
    assert_eq!(
        cluster
            .cli_json(&["image", "ls", "rbd"])
            .as_array()
            .map(Vec::len),
        Some(2)
    );
    // The new leader detects a dead OSD.
    cluster.kill_osd(0);
    wait_for("the dead osd marked down", Duration::from_secs(30), || {
        cluster.cli_json(&["status"])["osds"]["up"] == 2
    });
    // Data written before is intact.
    let mut verify = write.clone();
    verify.push("--verify_only".into());
    fio(&uri, &args(&verify));
    // The old leader comes back as a follower and catches up.
    cluster.start_mon_n(dead);
    wait_for(
        "the restarted monitor to know the second image",
        Duration::from_secs(30),
        || {
            let output = run(basalt().args(["image", "ls", "rbd", "--json", "--mon", &leader]));
            serde_json::from_slice::<serde_json::Value>(&output.stdout)
                .is_ok_and(|images| images.as_array().map(Vec::len) == Some(2))
        },
    );
    wait_for(
        "the restarted monitor back in quorum",
        Duration::from_secs(30),
        || all_in_quorum(&cluster),
    );
}

#[test]
fn full_osds_refuse_writes_with_enospc_and_keep_the_data() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-full");
    let cluster = small_osd_cluster(&dir.path, 1, "64MiB", None, "64MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 0xab 0 8M"]);

    // More than the devices can take: refused with ENOSPC, not an OSD crash.
    let (_, text) = qemu_io(&uri, false, &["write -P 0xcd 8M 56M"]);
    assert!(text.contains("No space left on device"), "{text}");
    let osds = cluster.cli_json(&["osd", "ls"]);
    assert!(
        osds.as_array()
            .expect("osds")
            .iter()
            .all(|osd| osd["up"] == true),
        "every osd is still up: {osds:#}"
    );
    qemu_io_ok(&uri, true, &["read -P 0xab 0 8M"]);
    wait_for_full_status(&cluster);
}

/// Two OSDs of 192 MiB and one of 64 MiB (the third, which fills first), a pool of 8 PGs
/// of 3 replicas and a 128 MiB image exported over NBD: the cluster, the small OSD's id,
/// the target and the image's URI.
fn a_cluster_with_a_small_osd(
    dir: &std::path::Path,
) -> (ClusterProcesses, u32, TargetProcess, String) {
    let device = |size: &str| (None, vec!["--device-size".to_string(), size.to_string()]);
    let cluster = ClusterProcesses::start_custom(
        dir,
        vec![format!("127.0.0.1:{}", free_port())],
        vec![device("192MiB"), device("192MiB"), device("64MiB")],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "128MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let small = cluster.osd_id(2);
    let (target, uri) = export_image(dir, &cluster, "rbd", "vol");
    (cluster, small, target, uri)
}

/// Writes MiB number `mib` of the image at `uri` with a pattern of its own: false if it is
/// refused with ENOSPC.
fn write_mib(uri: &str, mib: u64) -> bool {
    let command = format!("write -P {} {mib}M 1M", mib % 250 + 1);
    let (success, text) = qemu_io(uri, false, &[&command]);
    if text.contains("No space left on device") {
        false
    } else {
        assert!(success && text.contains("wrote"), "{text}");
        true
    }
}

/// Reads back each MiB of `written` with its pattern ([`write_mib`]).
fn read_mibs(uri: &str, written: &[u64]) {
    let reads: Vec<String> = written
        .iter()
        .map(|mib| format!("read -P {} {mib}M 1M", mib % 250 + 1))
        .collect();
    qemu_io_ok(uri, true, &args(&reads));
}

/// Whether the map says OSD `id` is full.
fn flagged_full(cluster: &ClusterProcesses, id: u32) -> bool {
    cluster
        .cli_json(&["osd", "ls"])
        .as_array()
        .expect("osds")
        .iter()
        .any(|osd| osd["id"] == id && osd["full"] == true)
}

/// One OSD's device is smaller than its peers': it fills first. Once it reports itself
/// full the map says so, and the leaders of its PGs (on the larger OSDs too) refuse writes
/// with ENOSPC instead of going on without it; the replicas stay equal, every acknowledged
/// write reads back, and discards make it writable again.
#[test]
fn a_full_replica_stops_the_writes_of_its_pgs() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-full-replica");
    let (cluster, small, _target, uri) = a_cluster_with_a_small_osd(&dir.path);
    let write = |mib: u64| write_mib(&uri, mib);
    let flagged = || flagged_full(&cluster, small);
    let mut written = Vec::new();
    let mut next = 0;
    while !flagged() {
        assert!(next < 96, "osd.{small} never reported full");
        if write(next) {
            written.push(next);
        }
        next += 1;
    }
    assert!(
        written.len() >= 8,
        "some writes went before it filled: {written:?}"
    );
    // The OSD says it is full once its live data passes 18 MiB (what its 62 MiB log keeps
    // free for cleaning and raft's entries, and leaves to dead data, aside), and the
    // reserve holds what its PGs' leaders accept until the map tells them (16 MiB above
    // the cleaner's floor): past that the full replica cannot persist its raft entries
    // and falls behind for good.
    assert!(
        written.len() <= 18 + 16,
        "osd.{small} reported full too late: {} MiB written",
        written.len()
    );
    eprintln!(
        "osd.{small} full after {next} MiB, {} written",
        written.len()
    );
    let table = cluster.cli_ok(&["osd", "ls"]);
    assert!(
        table
            .lines()
            .any(|line| line.starts_with(&format!("osd.{small} ")) && line.ends_with("full")),
        "{table}"
    );
    let status = cluster.cli_ok(&["status"]);
    assert!(
        status.contains(&format!("1 osds full, writes refused: osd.{small}")),
        "{status}"
    );
    // Maps reach the OSDs by long poll, within milliseconds; this leaves room for a loaded
    // machine.
    std::thread::sleep(Duration::from_secs(2));
    // Every PG has the small OSD as a replica: no write goes now, whichever OSD leads
    // (one write into each of the image's 32 objects, over its 8 PGs).
    for object in 0..32 {
        let mib = object * 4 + 2;
        assert!(
            !write(mib),
            "a write at {mib} MiB went with osd.{small} full"
        );
    }
    cluster.wait_replicas_equal(Duration::from_secs(60));
    read_mibs(&uri, &written);
    discard_and_write_again(&cluster, small, &uri);
}

/// Discards the whole image at `uri`: the cleaner makes room on OSD `small`, its full flag
/// goes, writes go again.
fn discard_and_write_again(cluster: &ClusterProcesses, small: u32, uri: &str) {
    qemu_io_ok(uri, false, &["discard 0 128M"]);
    wait_for("the full flag to clear", Duration::from_secs(60), || {
        !flagged_full(cluster, small)
    });
    // The leaders hear of it a moment later.
    wait_for(
        "a write to go after the discard",
        Duration::from_secs(10),
        || write_mib(uri, 0),
    );
    qemu_io_ok(uri, true, &["read -P 1 0 1M"]);
}

/// As above with the monitor down while the small OSD fills: the map cannot tell the
/// leaders, its raft frames do. Writes stop as soon as it is full, none goes past it (none
/// of the PGs it is a replica of goes on without it), and once the monitor is back the
/// replicas are equal and every acknowledged write reads back.
#[test]
fn a_full_replica_stops_the_writes_of_its_pgs_with_the_monitor_down() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-full-replica-no-mon");
    let (mut cluster, small, _target, uri) = a_cluster_with_a_small_osd(&dir.path);
    cluster.kill_mon();
    let mut written = Vec::new();
    for mib in 0.. {
        assert!(mib < 96, "osd.{small} never stopped the writes");
        if !write_mib(&uri, mib) {
            break;
        }
        written.push(mib);
    }
    eprintln!("writes refused after {} MiB", written.len());
    // Where the map stops them in the test above (its live data past 18 MiB, and what the
    // leaders accept before they hear of it).
    assert!(
        (8..=18 + 16).contains(&written.len()),
        "osd.{small} stopped the writes after {} MiB",
        written.len()
    );
    // Each leader hears within a tick or two.
    std::thread::sleep(Duration::from_secs(1));
    for object in 0..32 {
        let mib = object * 4 + 2;
        assert!(
            !write_mib(&uri, mib),
            "a write at {mib} MiB went with osd.{small} full and the monitor down"
        );
    }
    cluster.start_mon();
    // The small OSD tells the new monitor too.
    wait_for("the map to say full", Duration::from_secs(30), || {
        flagged_full(&cluster, small)
    });
    cluster.wait_replicas_equal(Duration::from_secs(60));
    read_mibs(&uri, &written);
    discard_and_write_again(&cluster, small, &uri);
}

#[test]
fn an_exported_image_follows_a_resize_and_bounds_discards() {
    require("qemu-io");
    require("qemu-img");
    let dir = ScratchDir::new("cluster-resize");
    let cluster = small_osd_cluster(&dir.path, 1, "96MiB", None, "16MiB");
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let blocks =
        || target.rpc_ok("bdev_get_bdevs", json!({"name": "img"}))[0]["num_blocks"].as_u64();
    assert_eq!(blocks(), Some(32768));
    qemu_io_ok(&uri, false, &["write -P 0xa1 0 1M"]);
    cluster.cli_ok(&["image", "resize", "rbd/vol", "--size", "32MiB"]);
    wait_for("the bdev to grow", Duration::from_secs(10), || {
        blocks() == Some(65536)
    });
    // A new connection sees the new size and uses all of it.
    assert_eq!(nbd_size(&uri), 32 << 20);
    qemu_io_ok(&uri, false, &["write -P 0x3c 31M 1M"]);
    qemu_io_ok(&uri, true, &["read -P 0x3c 31M 1M", "read -P 0xa1 0 1M"]);

    // Over NVMe/TCP, the NVM command set's Identify Controller tells hosts how much one
    // Dataset Management command should cover at most (a discard is a replicated write
    // per object): 2,048 objects of 4 MiB, in 512-byte blocks, per range and per
    // command. A deallocate of the whole image then reads back as zeroes.
    let nqn = "nqn.2016-06.io.basalt:resized";
    let port = target.start_nvmf(nqn, "img");
    let (runtime, host) = nvmf_host(port, nqn, HostOptions::default());
    runtime.block_on(async {
        let page = host
            .identify(CNS_CONTROLLER_COMMAND_SET, 0)
            .await
            .expect("identify");
        let limit = (2_048u64 << 22) / 512;
        let dmrsl = u32::from_le_bytes(page[4..8].try_into().expect("4"));
        let dmsl = u64::from_le_bytes(page[8..16].try_into().expect("8"));
        assert_eq!((u64::from(dmrsl), dmsl), (limit, limit), "DMRSL, DMSL");
        host.deallocate(0, 1, &[(0, 65536)])
            .await
            .expect("deallocate");
        for lba in [0, 62 * 1024] {
            let data = host.read(0, 1, lba, 2048, 512).await.expect("read");
            assert!(
                data.iter().all(|b| *b == 0),
                "MiB at block {lba} not zeroes"
            );
        }
    });
}

/// `basalt image resize` to a smaller size and `basalt image rm` discard what they cut off
/// first: the OSDs free its space (the map's change alone left the objects on them, for
/// good after a removal), and a grow after a shrink reads zeroes where the cut data was.
#[test]
fn shrinking_or_removing_an_image_frees_its_space() {
    require("qemu-io");
    require("qemu-img");
    let dir = ScratchDir::new("cluster-image-space");
    let cluster = small_osd_cluster(&dir.path, 1, "256MiB", None, "32MiB");
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    const MIB: u64 = 1 << 20;
    let used = || used_bytes(&cluster);
    let blocks =
        || target.rpc_ok("bdev_get_bdevs", json!({"name": "img"}))[0]["num_blocks"].as_u64();
    qemu_io_ok(&uri, false, &["write -P 0xab 0 32M"]);
    wait_for("three copies of 32 MiB", Duration::from_secs(30), || {
        used() >= 3 * 32 * MIB
    });
    let shrunk = cluster.cli_ok(&SHRINK_VOL_TO_8MIB);
    assert!(
        shrunk.contains("24MiB of data cut off discarded"),
        "{shrunk}"
    );
    wait_for(
        "the 24 MiB cut off to be freed",
        Duration::from_secs(30),
        || used() <= 3 * 9 * MIB,
    );
    // The exported bdev follows the shrink: a new connection sees 8 MiB.
    wait_for("the bdev to shrink", Duration::from_secs(10), || {
        blocks() == Some(16384)
    });
    assert_eq!(nbd_size(&uri), 8 * MIB);
    cluster.cli_ok(&["image", "resize", "rbd/vol", "--size", "32MiB"]);
    wait_for("the bdev to grow", Duration::from_secs(10), || {
        blocks() == Some(65536)
    });
    assert_eq!(nbd_size(&uri), 32 * MIB);
    qemu_io_ok(&uri, true, &["read -P 0xab 0 8M", "read -P 0 8M 24M"]);

    cluster.cli_ok(&["image", "create", "rbd/other", "--size", "64MiB"]);
    bench_write_mib(&cluster, "rbd/other", 48);
    wait_for("three copies of 56 MiB", Duration::from_secs(30), || {
        used() >= 3 * 56 * MIB
    });
    cluster.cli_ok(&["image", "rm", "rbd/other"]);
    wait_for(
        "the removed image's 48 MiB to be freed",
        Duration::from_secs(30),
        || used() <= 3 * 9 * MIB,
    );
    qemu_io_ok(&uri, true, &["read -P 0xab 0 8M"]);

    // A thin image's removal discards the objects that hold data, which the PGs' leaders
    // list, not all 262,144 objects of 1 TiB.
    cluster.cli_ok(&["image", "create", "rbd/thin", "--size", "1TiB"]);
    bench_write_mib(&cluster, "rbd/thin", 1);
    let removed = cluster.cli_ok(&["image", "rm", "rbd/thin"]);
    assert!(
        removed.contains("its data is discarded (4MiB discarded)"),
        "{removed}"
    );

    // An image a target's bdev uses is not removed unless forced; once the bdev is gone,
    // it is.
    let in_use = |image: &str, bdev: &str| {
        let output = cluster.cli(&["image", "rm", image]);
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "removed in use");
        let said = format!("image {image} is in use by bdev {bdev} of pid");
        assert!(stderr.contains(&said), "{stderr}");
    };
    in_use("rbd/vol", "img");
    cluster.cli_ok(&["image", "create", "rbd/forced", "--size", "8MiB"]);
    let mons = cluster.mon_addresses();
    let forced = json!({"name": "forced", "pool": "rbd", "image": "forced", "mons": mons});
    target.rpc_ok("bdev_basalt_create", forced);
    in_use("rbd/forced", "forced");
    cluster.cli_ok(&["image", "rm", "rbd/forced", "--force"]);
    target.rpc_ok("nbd_server_remove_export", json!({"name": "img"}));
    target.rpc_ok("bdev_basalt_delete", json!({"name": "img"}));
    // Sooner than the monitors would forget a watcher that went silent (6 s): the bdev
    // said it stopped.
    wait_for(
        "the image removed once its bdev is gone",
        Duration::from_secs(4),
        || cluster.cli(&["image", "rm", "rbd/vol"]).status.success(),
    );
}

/// The size in bytes of the NBD export at `uri`, as `qemu-img info` finds it.
fn nbd_size(uri: &str) -> u64 {
    let info = run_ok(Command::new("qemu-img").args(["info", "--output=json", uri]));
    let info: serde_json::Value = serde_json::from_str(&info).expect("qemu-img json");
    info["virtual-size"].as_u64().expect("virtual-size")
}

/// Shrinks image rbd/vol to 8 MiB.
const SHRINK_VOL_TO_8MIB: [&str; 6] = [
    "image",
    "resize",
    "rbd/vol",
    "--size",
    "8MiB",
    "--allow-shrink",
];

/// Writes the first `mib` MiB of `image` with `basalt bench`, 1 MiB at a time.
fn bench_write_mib(cluster: &ClusterProcesses, image: &str, mib: u64) {
    let (count, size) = (mib.to_string(), format!("{mib}MiB"));
    let mon = cluster.mon_addresses().join(",");
    run_ok(
        basalt()
            .args(["bench", "--image", image, "--mon", &mon, "--rw", "write"])
            .args(["--bs", "1MiB", "--io-count", &count, "--size", &size]),
    );
}

/// Log bytes in use on the cluster's OSDs, as they last reported.
fn used_bytes(cluster: &ClusterProcesses) -> u64 {
    cluster.cli_json(&["status"])["used_bytes"]
        .as_u64()
        .expect("used bytes")
}

/// `basalt image rm` and a shrinking `image resize` change the map first, then discard
/// what they cut off: interrupted in between (here, with every OSD stopped), the map keeps
/// the cut-off data for discards only, health names the image, the image may not grow over
/// that data, and running the command again finishes the discard. Once the image grew back,
/// a late discard of the bytes once cut off is refused by the OSDs.
#[test]
fn an_interrupted_removal_or_shrink_is_finished_by_running_it_again() {
    let dir = ScratchDir::new("cluster-image-cut");
    let cluster = small_osd_cluster(&dir.path, 1, "256MiB", None, "16MiB");
    const MIB: u64 = 1 << 20;
    let used = || used_bytes(&cluster);
    cluster.cli_ok(&["image", "create", "rbd/gone", "--size", "32MiB"]);
    for image in ["rbd/vol", "rbd/gone"] {
        bench_write_mib(&cluster, image, 16);
    }
    wait_for("three copies of 32 MiB", Duration::from_secs(30), || {
        used() >= 3 * 32 * MIB
    });
    let images = || cluster.cli_json(&["image", "ls"]).to_string();
    // Runs the command with every OSD stopped, and kills it once the map has changed.
    interrupted(&cluster, &["image", "rm", "rbd/gone"], &|| {
        !images().contains("\"gone\"")
    });
    interrupted(
        &cluster,
        &[
            "image",
            "resize",
            "rbd/vol",
            "--size",
            "4MiB",
            "--allow-shrink",
        ],
        &|| cluster.cli_json(&["image", "info", "rbd/vol"])["size_bytes"] == 4 * MIB,
    );
    cluster.wait_clean(Duration::from_secs(60));
    let (_, checks) = cluster.health();
    assert!(
        checks.contains("rbd/gone (removed)") && checks.contains("rbd/vol (shrunk)"),
        "{checks}"
    );
    assert!(used() >= 3 * 32 * MIB, "nothing was discarded yet");
    // The name is free; the new image is another. Run again, the removal finishes the
    // earlier image's alone: the new one stays until asked for once more.
    cluster.cli_ok(&["image", "create", "rbd/gone", "--size", "32MiB"]);
    let said = cluster.cli_ok(&["image", "rm", "rbd/gone"]);
    assert!(said.contains("exists again"), "{said}");
    assert!(images().contains("\"gone\""), "the new image stays");
    wait_for(
        "the removed image's space freed",
        Duration::from_secs(30),
        || used() <= 3 * 17 * MIB,
    );
    let (_, checks) = cluster.health();
    assert!(!checks.contains("rbd/gone"), "{checks}");
    cluster.cli_ok(&["image", "rm", "rbd/gone"]);
    assert!(!images().contains("\"gone\""), "{}", images());
    cluster.cli_ok(&["image", "resize", "rbd/vol", "--size", "16MiB"]);
    wait_for("the cut-off space freed", Duration::from_secs(30), || {
        used() <= 3 * 5 * MIB
    });
    let (status, checks) = cluster.health();
    assert_eq!(status, "HEALTH_OK", "{checks}");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, true, &["read -P 0 4M 12M"]);
    // A discard of the cut-off bytes that comes late (its command slow, while another
    // finished the discard and grew the image back) is refused: the bytes hold new data.
    qemu_io_ok(&uri, false, &["write -P 0x6b 8M 4M"]);
    let late = object_call(&cluster, "vol", 2, None, |pg, epoch, term, object| {
        Message::Discard {
            cut: true,
            pg,
            epoch,
            term,
            object,
            offset_bytes: 0,
            len_bytes: 4 << 20,
        }
    });
    let refused = late.expect_err("a discard of bytes no longer cut off");
    assert!(refused.contains("kept for discards alone"), "{refused}");
    qemu_io_ok(&uri, true, &["read -P 0x6b 8M 4M"]);
}

/// A leader elected with a map older than the one its PG's log was last written under
/// takes no request until it has that map. Here OSD 0 hears of maps from one monitor
/// alone, which is killed once OSD 0 has the map of a shrink whose discard was
/// interrupted. The image is then grown back by the other monitors, new data is written
/// where the shrink had cut, and OSD 0 is made the PG's leader (its peers killed in turn).
/// A late discard of the bytes cut off (the shrink's command, slow), valid under OSD 0's
/// map, is answered "ask again" rather than taken and wiping the data; the map not coming,
/// OSD 0 hands the PG over; the data reads back once OSD 0 has the newer map.
#[test]
fn a_leader_with_a_map_older_than_its_pgs_log_takes_no_request_until_it_catches_up() {
    require("qemu-io");
    const MIB: u64 = 1 << 20;
    let dir = ScratchDir::new("cluster-map-floor");
    let mons: Vec<String> = (0..3)
        .map(|_| format!("127.0.0.1:{}", free_port()))
        .collect();
    // Fixed addresses: OSD 0 reaches its peers restarted after its map stopped.
    let listen = || vec!["--listen".to_string(), format!("127.0.0.1:{}", free_port())];
    let mut lagging = listen();
    lagging.extend(["--mon".to_string(), mons[2].clone()]);
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        mons,
        vec![(None, lagging), (None, listen()), (None, listen())],
    );
    let (_target, uri) = one_pg_image(&dir.path, &cluster, "rbd", 3);
    qemu_io_ok(&uri, false, &["write -P 0x11 12M 4M"]);
    let pg = cluster.cli_json(&["pg", "ls"])[0]["pg"]
        .as_str()
        .expect("a pg id")
        .to_string();
    // The PG's replicas (leader, term) as OSD process numbers, from those that answer.
    let replicas = |cluster: &ClusterProcesses| -> Vec<(usize, Option<usize>, u64)> {
        let states = cluster.cli_json(&["pg", "query", &pg]);
        let process =
            |osd: &serde_json::Value| osd.as_u64().map(|id| cluster.osd_process(id as u32));
        states
            .as_array()
            .expect("replicas")
            .iter()
            .filter(|state| state["error"].is_null())
            .map(|state| {
                let osd = process(&state["osd"]).expect("osd");
                (
                    osd,
                    process(&state["leader"]),
                    state["term"].as_u64().expect("term"),
                )
            })
            .collect()
    };
    let leader = |cluster: &ClusterProcesses| {
        replicas(cluster)
            .into_iter()
            .find_map(|(_, leader, _)| leader)
    };
    // Elected anew while `n` is killed, then `n` back.
    let elect_without = |cluster: &mut ClusterProcesses, n: usize| {
        cluster.kill_osd(n);
        wait_for("another leader", Duration::from_secs(30), || {
            leader(cluster).is_some_and(|leader| leader != n)
        });
        cluster.start_osd(n);
    };

    // The shrink changes the map; its command is killed before it discards anything.
    interrupted(&cluster, &SHRINK_VOL_TO_8MIB, &|| {
        cluster.cli_json(&["image", "info", "rbd/vol"])["size_bytes"] == 8 * MIB
    });
    let cut = block_on(fetch_map(&cluster));
    let image = cut.images.values().next().expect("the image").clone();
    let object = basalt_common::ObjectKey {
        image: image.id,
        number: 3,
    };
    let pg_id = cut.pools[&image.pool].pg_of(object);
    // OSD 0 leads nothing while the image changes: it would ask for the new maps forever.
    if leader(&cluster) == Some(0) {
        elect_without(&mut cluster, 0);
    }
    // OSD 0 has a map with the cut (a write there is past the image's end), then hears of
    // no newer one.
    wait_for(
        "osd 0 to have the shrink's map",
        Duration::from_secs(30),
        || {
            let write = Message::Write {
                pg: pg_id,
                epoch: cut.epoch,
                term: 0,
                object,
                offset_bytes: 0,
                data: vec![1; 4096],
            };
            matches!(call_osd(&cluster, 0, &write), Status::Invalid { message } if message.contains("past the image's 8388608"))
        },
    );
    cluster.kill_mon_n(2);

    // Grown back by the others (once they have elected a leader, if it was that one);
    // new data where the shrink had cut.
    wait_for("the grow", Duration::from_secs(60), || {
        let grow = cluster.cli(&["image", "resize", "rbd/vol", "--size", "16MiB"]);
        grow.status.success()
    });
    // Once the target has the map of the grow (its subscription had the killed monitor).
    wait_for(
        "the write past the old end",
        Duration::from_secs(30),
        || qemu_io(&uri, false, &["write -P 0x6b 12M 4M"]).0,
    );
    wait_for(
        "osd 0 to hold the new data",
        Duration::from_secs(30),
        || {
            let applied: Vec<String> = cluster
                .cli_json(&["pg", "query", &pg])
                .as_array()
                .expect("replicas")
                .iter()
                .map(|state| state["applied"].to_string())
                .collect();
            applied.len() == 3 && applied.iter().all(|a| *a == applied[0])
        },
    );
    // OSD 0 made leader: its peers' leaders killed in turn until it is elected.
    for _ in 0..20 {
        match leader(&cluster) {
            Some(0) => break,
            Some(n) => elect_without(&mut cluster, n),
            None => std::thread::sleep(Duration::from_millis(200)),
        }
    }
    let term = replicas(&cluster)
        .into_iter()
        .find(|(osd, leader, _)| *osd == 0 && *leader == Some(0))
        .map(|(_, _, term)| term)
        .expect("osd 0 elected");
    let late = Message::Discard {
        cut: true,
        pg: pg_id,
        epoch: cut.epoch,
        term,
        object,
        offset_bytes: 0,
        len_bytes: 4 << 20,
    };
    assert_eq!(
        call_osd(&cluster, 0, &late),
        Status::NotLeader { leader: None },
        "a late discard under the old map"
    );
    // Its map not coming, OSD 0 hands the PG to a voter that has it.
    wait_for("osd 0 to hand the pg over", Duration::from_secs(30), || {
        leader(&cluster).is_some_and(|leader| leader != 0)
    });
    // Once OSD 0 has the newer map, the discard is refused for good; the data is there.
    cluster.start_mon_n(2);
    wait_for(
        "osd 0 to refuse the late discard",
        Duration::from_secs(30),
        || matches!(call_osd(&cluster, 0, &late), Status::Invalid { .. }),
    );
    qemu_io_ok(&uri, true, &["read -P 0x6b 12M 4M"]);
}

/// Runs `args` (a command that changes the map, then works on the OSDs) with every OSD
/// stopped, and kills it once `changed` holds.
fn interrupted(cluster: &ClusterProcesses, args: &[&str], changed: &dyn Fn() -> bool) {
    for n in 0..3 {
        cluster.signal_osd(n, "STOP");
    }
    let mut command = basalt()
        .args(args)
        .args(["--mon", &cluster.mon_addresses().join(",")])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("spawn basalt");
    wait_for("the map's change", Duration::from_secs(30), changed);
    let _ = command.kill();
    let _ = command.wait();
    for n in 0..3 {
        cluster.signal_osd(n, "CONT");
    }
}

/// Runs `future` to its end on a runtime of its own.
fn block_on<F: std::future::Future>(future: F) -> F::Output {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(future)
}

/// The cluster's map, from its monitors.
async fn fetch_map(cluster: &ClusterProcesses) -> basalt_mon::map::ClusterMap {
    let monitors = cluster
        .mon_addresses()
        .iter()
        .map(|address| address.parse().expect("a monitor address"))
        .collect();
    basalt_mon::MonClient::new(monitors)
        .map()
        .await
        .expect("the map")
}

/// Sends `message` to OSD process `n` alone; the status it answers.
fn call_osd(cluster: &ClusterProcesses, n: usize, message: &Message) -> Status {
    block_on(async {
        let map = fetch_map(cluster).await;
        let osd = &map.osds[&basalt_common::OsdId(cluster.osd_id(n))];
        let address = osd.address.parse().expect("address");
        let client = basalt_wire::tcp::Client::connect(address)
            .await
            .expect("connect to the osd");
        match client.call(message).await.expect("an answer") {
            Message::Reply { status, .. } => status,
            other => panic!("not a reply: {other:?}"),
        }
    })
}

/// `mons` monitors and three OSDs on devices of `device_size` (the last serving metrics on
/// `metrics_port`, if given), a pool `rbd` of 8 PGs and an image `rbd/vol` of `image_size`,
/// every PG active+clean.
fn small_osd_cluster(
    dir: &std::path::Path,
    mons: usize,
    device_size: &str,
    metrics_port: Option<u16>,
    image_size: &str,
) -> ClusterProcesses {
    let device = vec!["--device-size".to_string(), device_size.to_string()];
    let mut last = device.clone();
    if let Some(port) = metrics_port {
        last.extend(["--metrics-addr".to_string(), format!("127.0.0.1:{port}")]);
    }
    let cluster = ClusterProcesses::start_custom(
        dir,
        (0..mons)
            .map(|_| format!("127.0.0.1:{}", free_port()))
            .collect(),
        vec![(None, device.clone()), (None, device), (None, last)],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", image_size]);
    cluster.wait_clean(Duration::from_secs(60));
    cluster
}

/// Writes round `round` over the hot part of the image: each MiB gets its own pattern, so a
/// read that found an older copy anywhere would see another pattern.
fn hot_round(uri: &str, round: u32) {
    let commands = hot_commands("write", round);
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    qemu_io_ok(uri, false, &commands);
}

/// qemu-io's `op` (write or read) of each MiB of the hot part with round `round`'s
/// pattern.
fn hot_commands(op: &str, round: u32) -> Vec<String> {
    (0..16u32)
        .map(|mib| {
            let pattern = (round * 16 + mib) % 251 + 1;
            format!("{op} -P {pattern} {}M 1M", 8 + mib)
        })
        .collect()
}

/// Rounds of [`hot_round`] one after another on a thread of their own, until stopped.
struct HotWriter {
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u32>,
}

impl HotWriter {
    /// Starts with round `first`.
    fn start(uri: &str, first: u32) -> Self {
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (uri, stopped) = (uri.to_string(), stop.clone());
        let thread = std::thread::spawn(move || {
            let mut round = first;
            loop {
                hot_round(&uri, round);
                if stopped.load(std::sync::atomic::Ordering::Relaxed) {
                    return round;
                }
                round += 1;
            }
        });
        Self { stop, thread }
    }

    /// Stops after the round under way; the last round written.
    fn stop(self) -> u32 {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        self.thread.join().expect("the writes")
    }
}

/// Reads the cold part and the hot part of the image back as `round` left them.
fn check_round(uri: &str, round: u32) {
    qemu_io_ok(uri, true, &["read -P 90 0 8M"]);
    check_hot_round(uri, round);
}

/// Checks that the hot part of the image holds round `round`.
fn check_hot_round(uri: &str, round: u32) {
    let commands = hot_commands("read", round);
    let commands: Vec<&str> = commands.iter().map(String::as_str).collect();
    qemu_io_ok(uri, true, &commands);
}

/// OSD devices of 96 MiB take many times their size in writes: the log is a ring whose tail
/// the cleaner empties (the 8 MiB written once are moved, not lost) and checkpoints free.
/// Every process crashes (`kill -9`) in the middle; after the restart, from the checkpoints,
/// the data reads back, the replicas are equal, and the ring goes on being reused.
#[test]
fn the_log_is_reused_over_many_laps_and_survives_crashes() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-reuse");
    let mut cluster = small_osd_cluster(&dir.path, 1, "96MiB", None, "24MiB");
    let small = vec!["--device-size".to_string(), "96MiB".to_string()];
    let metrics_port = free_port();
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    // Cold data, written once, then 16 MiB of hot data rewritten round after round: each
    // OSD holds every byte, so its log takes 16 MiB per round.
    qemu_io_ok(&uri, false, &["write -P 90 0 8M"]);
    for round in 0..10 {
        hot_round(&uri, round);
    }
    check_round(&uri, 9);

    drop(target);
    cluster.kill_mon();
    for n in 0..3 {
        cluster.kill_osd(n);
    }
    cluster.start_mon();
    let mut metrics_args = small.clone();
    metrics_args.extend([
        "--metrics-addr".to_string(),
        format!("127.0.0.1:{metrics_port}"),
    ]);
    cluster.set_osd_args(0, &args(&metrics_args));
    for n in 0..3 {
        cluster.start_osd(n);
    }
    cluster.wait_osds_up(3);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    check_round(&uri, 9);
    cluster.wait_replicas_equal(Duration::from_secs(60));

    // The ring goes on after the restart.
    for round in 10..20 {
        hot_round(&uri, round);
    }
    check_round(&uri, 19);
    cluster.wait_replicas_equal(Duration::from_secs(60));
    let metrics = http_get(&format!("127.0.0.1:{metrics_port}"), "/metrics");
    let written = metric(&metrics, "basalt_osd_log_device_bytes_total");
    let capacity = metric(&metrics, "basalt_osd_capacity_bytes");
    eprintln!(
        "osd.0 since its restart: {written} log bytes written on a {capacity}-byte ring, {} checkpoints, {} bytes relocated",
        metric(&metrics, "basalt_osd_checkpoints_total"),
        metric(&metrics, "basalt_osd_relocated_bytes_total")
    );
    assert!(
        written > 1.5 * capacity,
        "the ring was lapped after the restart"
    );
    assert!(metric(&metrics, "basalt_osd_checkpoints_total") > 0.0);
    assert!(
        metric(&metrics, "basalt_osd_relocated_bytes_total") >= (8 << 20) as f64,
        "the cold 8 MiB were moved out of the tail"
    );
}

/// Large writes overwritten in part leave dead bytes inside payloads the index still reads
/// in part: the cleaner moves only what it reads of them, so their space comes back. OSD
/// devices of 96 MiB hold a 40 MiB image written in 1 MiB pieces, then three blocks of
/// every four overwritten, 12 KiB at a time, in three rounds: the cleaner that moved whole
/// payloads kept the 40 MiB of them in use besides the 30 MiB that replaced them, and the
/// writes failed for want of space (as an OSD at half its ring in live data, whose
/// snapshot installs were overwritten block by block, cleaned without end).
#[test]
fn the_cleaner_frees_what_was_overwritten_of_large_writes() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-clean-partial");
    let metrics_port = free_port();
    let cluster = small_osd_cluster(&dir.path, 1, "96MiB", Some(metrics_port), "40MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 90 0 40M"]);
    let overwrite = |seed: u32| {
        vec![
            "--rw=write:4k".to_string(),
            "--bs=12k".to_string(),
            "--size=40M".to_string(),
            "--verify=crc32c".to_string(),
            format!("--randseed={seed}"),
            "--verify_fatal=1".to_string(),
            // A cleaner that frees nothing has writes crawl: the round stops short of the
            // whole image then, and the verify below fails, at once rather than after
            // minutes.
            "--runtime=120".to_string(),
        ]
    };
    for round in 0..3 {
        fio(&uri, &args(&overwrite(100 + round)));
    }
    let mut verify = overwrite(102);
    verify.push("--verify_only".to_string());
    fio(&uri, &args(&verify));
    // The fourth block of each 16 KiB still holds the first write.
    let kept: Vec<String> = (0..40 * 1024 / 16)
        .map(|n| format!("read -P 90 {}k 4k", n * 16 + 12))
        .collect();
    qemu_io_ok(&uri, true, &args(&kept));
    let metrics = http_get(&format!("127.0.0.1:{metrics_port}"), "/metrics");
    eprintln!(
        "osd.2: {} log bytes written, {} relocated, {} free of {}",
        metric(&metrics, "basalt_osd_log_device_bytes_total"),
        metric(&metrics, "basalt_osd_relocated_bytes_total"),
        metric(&metrics, "basalt_osd_log_free_bytes"),
        metric(&metrics, "basalt_osd_capacity_bytes")
    );
    assert!(metric(&metrics, "basalt_osd_relocated_bytes_total") > 0.0);
    cluster.wait_replicas_equal(Duration::from_secs(60));
}

/// A replica that comes back behind in every PG, on a device whose live data fills half
/// its ring, catches up by snapshots although their data does not all fit at once: an
/// install starts only when the log has room for what it is expected to write (the size
/// of the copy it replaces), besides the installs under way, and the cleaner makes that
/// room first. Before, installs started with a few MiB free, ran out of room, were given
/// up and sent again at once, and the cleaner, paused during each, never caught up.
#[test]
fn a_replica_behind_in_every_pg_catches_up_on_a_half_full_device() {
    require("fio");
    let dir = ScratchDir::new("cluster-catch-up-half-full");
    let mut cluster = small_osd_cluster(&dir.path, 1, "96MiB", None, "40MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let write = |seed: u32| {
        let mut args = verified_write("40M");
        args.retain(|arg| !arg.starts_with("--randseed"));
        args.push(format!("--randseed={seed}"));
        args
    };
    fio(&uri, &args(&write(1)));
    cluster.kill_osd(0);
    // Twice the image while it is down: every PG's log moves past what it holds.
    fio(&uri, &args(&write(2)));
    fio(&uri, &args(&write(3)));
    cluster.start_osd(0);
    cluster.wait_osds_up(3);
    cluster.wait_replicas_equal(Duration::from_secs(90));
    // Few transfers given up halfway (none in most runs; hundreds before).
    let given_up = cluster
        .log_text("osd.0")
        .matches("snapshot not installed")
        .count();
    assert!(given_up < 20, "{given_up} snapshot transfers given up");
    let mut verify = write(3);
    verify.push("--verify_only".to_string());
    fio(&uri, &args(&verify));
}

/// Writes of less than a block each keep a whole log block in use until the cleaner packs
/// the pieces of each block of an object into one block of the log: every 512-byte sector
/// of 12 MiB written one by one, twice over, would keep 96 MiB of blocks in use on 96 MiB
/// devices unpacked (with packing off, it gets ENOSPC), and goes through verified. Live data is counted by the blocks of the objects it takes packed, so a
/// sector written in every block of the image fills the log, and the OSDs report
/// themselves full and writes fail with ENOSPC. Counting 512 bytes for each write, the
/// cleaner took them for reclaimable and moved them round the ring without end; writes
/// crawled at about a hundred a second, without an error, and health stayed OK.
#[test]
fn writes_of_less_than_a_block_are_packed_and_fill_the_log_by_the_blocks_they_take() {
    require("fio");
    let dir = ScratchDir::new("cluster-sub-block");
    let cluster = small_osd_cluster(&dir.path, 1, "96MiB", None, "96MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    let mut sectors = verified_write("12M");
    sectors.retain(|arg| arg != "--bs=4k");
    sectors.extend(["--bs=512".to_string(), "--loops=2".to_string()]);
    fio(&uri, &args(&sectors));
    sectors.push("--verify_only".to_string());
    fio(&uri, &args(&sectors));
    // Sectors not packed yet take blocks: the OSDs may be nearly full, not full.
    let status = cluster.cli_ok(&["status"]);
    assert!(!status.contains("writes refused"), "{status}");

    let started = Instant::now();
    // A sector, then 3.5 KiB skipped: a sector in every block, 12 MiB in all.
    sectors_until_enospc(&uri, "--rw=write:3584", "96M", "12M");
    assert!(started.elapsed() < Duration::from_secs(50));
    // The leaders may refuse writes before the map says full (the OSD's raft frames say so
    // first).
    wait_for_full_status(&cluster);
}

/// Waits for `basalt status` to say that writes are refused for a full OSD.
fn wait_for_full_status(cluster: &ClusterProcesses) {
    wait_for("status to name a full osd", Duration::from_secs(30), || {
        cluster.cli_ok(&["status"]).contains("full, writes refused")
    });
}

/// Writes 512-byte sectors with fio through `uri` (`rw`, over `size`, `io_size` in all),
/// which must end in ENOSPC.
fn sectors_until_enospc(uri: &str, rw: &str, size: &str, io_size: &str) {
    let output = run(Command::new("fio").args([
        "--name=job",
        "--ioengine=nbd",
        &format!("--uri={uri}"),
        rw,
        "--bs=512",
        "--iodepth=8",
        &format!("--size={size}"),
        &format!("--io_size={io_size}"),
        "--output-format=json",
    ]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        !output.status.success() && stdout.contains("\"error\" : 28"),
        "fio ended without ENOSPC: {stdout}"
    );
}

/// Sectors written apart, every other one, take an extent each in the object index (four to
/// a block once packed: the holes keep them apart), about 40 bytes of every checkpoint per
/// 512 bytes written. The OSDs report themselves full once the index would take three
/// quarters of a checkpoint area (2 MiB on 128 MiB devices), before a checkpoint outgrows
/// it, which would stop the log's reuse for good: writes get ENOSPC, and once the range is
/// discarded the flag clears and writes go again. (Without the flag, fio wrote them all on
/// devices this small, whose area is a larger share of what they hold than a large
/// device's: the flag errs early, its count being an upper bound.)
#[test]
fn an_index_too_large_for_a_checkpoint_area_fills_the_osd() {
    require("fio");
    require("qemu-io");
    let dir = ScratchDir::new("cluster-index-full");
    let cluster = small_osd_cluster(&dir.path, 1, "128MiB", None, "64MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    // A sector, then one skipped: 61,440 writes, 2.4 MB of index by the count.
    sectors_until_enospc(&uri, "--rw=write:512", "60M", "30M");
    // The leaders may refuse writes before the map says full (the OSD's raft frames say so
    // first).
    wait_for_full_status(&cluster);
    let logs = ["osd.0", "osd.1", "osd.2"].map(|osd| cluster.log_text(osd));
    for log in &logs {
        assert!(!log.contains("checkpoints stop"), "{log}");
    }
    // The first to fill stops the writes of every PG (each OSD holds them all).
    assert!(
        logs.iter().any(|log| log.contains("the full flag changes")),
        "{logs:?}"
    );
    qemu_io_ok(&uri, false, &["discard 0 64M"]);
    // Every OSD's report after its discards: one never flagged full may have been at its
    // limit too (its own raft frames tell the leaders so).
    wait_for("the full flag cleared", Duration::from_secs(60), || {
        let status = cluster.cli_ok(&["status"]);
        !status.contains("writes refused") && !status.contains("nearly full")
    });
    // The leaders hear of it from the map and their peers' raft frames a moment later.
    wait_for("writes taken again", Duration::from_secs(30), || {
        qemu_io(&uri, false, &["write -P 7 0 1M"]).0
    });
    qemu_io_ok(&uri, true, &["read -P 7 0 1M", "read -P 0 1M 63M"]);
}

/// The cleaner meets data in use that fails its checksum (cold data, on a replica that no
/// client reads): it moves it all the same, marked damaged at the new place, and that
/// replica's copy of the PG is rebuilt from another. The ring goes on being reused, and
/// every byte reads back as written.
#[test]
fn the_cleaner_has_damaged_data_in_use_rebuilt_and_goes_on() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-clean-damaged");
    let (cluster, _target, uri) = clean_over_damaged_cold_data(
        &dir,
        |device| flip_a_byte_in_a_block_of(device, 90),
        &["the cleaner moved data in use that fails its checksum, marked damaged"],
    );
    for round in 10..14 {
        hot_round(&uri, round);
    }
    check_round(&uri, 13);
    qemu_io_ok(&uri, true, &["read -P 90 0 8M"]);
    assert_every_pg_consistent(&cluster);
}

/// A batch whose header was damaged after it was written no longer stops the cleaner (the
/// log would fill, the OSD be flagged full, and its PGs refuse writes): what the index
/// still reads in it is moved out, its blocks checked one by one (a flipped data byte in
/// the same batch is marked damaged and the copy rebuilt), and a checkpoint follows, so
/// that the OSD restarts without meeting it in replay.
#[test]
fn a_damaged_batch_header_does_not_stop_the_cleaner() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-clean-damaged-header");
    let damage = |device: &std::path::Path| {
        flip_a_byte_in_the_header_of_a_batch_of(device, 90);
        flip_a_byte_in_a_block_of(device, 90);
    };
    let (mut cluster, _target, uri) = clean_over_damaged_cold_data(
        &dir,
        damage,
        &[
            "a batch of the log was damaged after it was written",
            "the cleaner moved data in use out of a damaged batch, marked damaged",
        ],
    );
    for round in 10..12 {
        hot_round(&uri, round);
    }
    cluster.kill_osd(1);
    cluster.start_osd(1);
    cluster.wait_clean(Duration::from_secs(60));
    check_round(&uri, 11);
    qemu_io_ok(&uri, true, &["read -P 90 0 8M"]);
    assert_every_pg_consistent(&cluster);
    // Health still names the device after its OSD restarted (the monitor keeps what it
    // heard).
    let checksums = "1 osds read blocks failing their checksum in the last hour: osd.1 (";
    wait_for(
        "the warning back after the restart",
        Duration::from_secs(30),
        || cluster.health().1.contains(checksums),
    );
}

/// Three OSDs on 96 MiB devices take 8 MiB of cold data (pattern 90); `damage` is done to
/// osd.1's device, then 160 MiB of hot rounds (0 to 9) go through each device, so that the
/// cleaner meets the cold data. osd.1 must have logged each of `logged`, and its damaged
/// copy must be rebuilt.
fn clean_over_damaged_cold_data(
    dir: &ScratchDir,
    damage: impl FnOnce(&std::path::Path),
    logged: &[&str],
) -> (ClusterProcesses, TargetProcess, String) {
    let cluster = small_osd_cluster(&dir.path, 1, "96MiB", None, "24MiB");
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 90 0 8M"]);
    cluster.wait_replicas_equal(Duration::from_secs(60));
    damage(&dir.join("osd.1").join("osd.log"));
    for round in 0..10 {
        hot_round(&uri, round);
    }
    let log = cluster.log_text("osd.1");
    for line in logged {
        assert!(log.contains(line), "{line}: {log}");
    }
    wait_for("the damaged copy rebuilt", Duration::from_secs(60), || {
        cluster.log_text("osd.1").contains(" repaired pg=")
    });
    (cluster, target, uri)
}

/// Flips a byte in the header of the batch that holds the first block of the device
/// filled with `fill`.
fn flip_a_byte_in_the_header_of_a_batch_of(device: &std::path::Path, fill: u8) {
    use std::os::unix::fs::FileExt;
    let file = std::fs::OpenOptions::new()
        .read(true)
        .write(true)
        .open(device)
        .expect("the device file");
    let mut block = vec![0u8; 4096];
    let read = |offset: u64, block: &mut Vec<u8>| file.read_exact_at(block, offset).is_ok();
    let data = (0u64..)
        .step_by(4096)
        .map_while(|offset| {
            read(offset, &mut block).then(|| (offset, block.iter().all(|b| *b == fill)))
        })
        .find_map(|(offset, filled)| filled.then_some(offset))
        .expect("a written block on the device");
    let header = (0..data / 4096)
        .rev()
        .map(|n| n * 4096)
        .find(|offset| read(*offset, &mut block) && block.starts_with(b"BSLTBTCH"))
        .expect("a batch header before it");
    // In the first entry's descriptor, under the header's checksum.
    file.write_all_at(&[0x5a], header + 64 + 20)
        .expect("corrupt a byte");
    file.sync_all().expect("sync");
}

/// A pool of one replica has no copy to rebuild damaged data from: the cleaner moves it
/// marked damaged and goes on (before, it stopped there and the log filled up), the
/// damaged block reads as EIO wherever it has moved, through a restart, and every other
/// block reads back as written.
#[test]
fn damaged_data_of_a_single_replica_moves_on_and_reads_as_eio() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-single-damaged");
    let small = || (None, vec!["--device-size".to_string(), "96MiB".to_string()]);
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        vec![format!("127.0.0.1:{}", free_port())],
        vec![small()],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "1"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "24MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 90 0 8M"]);
    flip_a_byte_in_a_block_of(&dir.join("osd.0").join("osd.log"), 90);
    // 160 MiB through a 96 MiB device: the cleaner moves the cold 8 MiB.
    for round in 0..10 {
        hot_round(&uri, round);
    }
    check_hot_round(&uri, 9);
    let log = cluster.log_text("osd.0");
    assert!(
        log.contains("the cleaner moved data in use that fails its checksum, marked damaged"),
        "{log}"
    );
    // Exactly one MiB of the cold data holds the damaged block.
    let failing = |uri: &str| {
        (0..8)
            .filter(|mib| {
                let (read, output) = qemu_io(uri, true, &[&format!("read -P 90 {mib}M 1M")]);
                assert!(read || output.contains("Input/output error"), "{output}");
                !read
            })
            .count()
    };
    assert_eq!(failing(&uri), 1);
    // After a restart, the same (the damage is known again, from the checkpoint's poisoned
    // blocks or, before the next checkpoint, from the old copy's checksum).
    drop(target);
    cluster.kill_osd(0);
    cluster.start_osd(0);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    assert_eq!(failing(&uri), 1);
    check_hot_round(&uri, 9);
}

/// An OSD that was down while its PGs' leaders compacted their logs past it catches up by
/// snapshot: it fetches the PGs' objects, installs them, and goes on from the log; after a
/// crash it replays the installed snapshot.
#[test]
fn a_replica_far_behind_catches_up_by_snapshot() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-snapshot");
    let metrics_port = free_port();
    let mut cluster = small_osd_cluster(&dir.path, 1, "128MiB", Some(metrics_port), "24MiB");
    let (target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 90 0 8M"]);
    cluster.wait_replicas_equal(Duration::from_secs(60));

    // osd.2 stops; the others take 160 MiB of writes (more than their logs hold), so their
    // checkpoints compact the raft logs far past what osd.2 has.
    cluster.kill_osd(2);
    for round in 0..10 {
        hot_round(&uri, round);
    }
    check_round(&uri, 9);

    let restarted = Instant::now();
    cluster.start_osd(2);
    cluster.wait_osds_up(3);
    cluster.wait_replicas_equal(Duration::from_secs(120));
    let caught_up = restarted.elapsed();
    let metrics = http_get(&format!("127.0.0.1:{metrics_port}"), "/metrics");
    let installed = metric(&metrics, "basalt_osd_snapshots_installed_total");
    let received = metric(&metrics, "basalt_osd_snapshot_received_bytes_total");
    eprintln!(
        "osd.2 installed {installed} snapshots ({received} bytes of object data); replicas equal {caught_up:?} after its restart"
    );
    assert!(installed > 0.0, "osd.2 caught up by snapshot");
    assert!(
        received >= (8 << 20) as f64,
        "the cold data came in snapshots"
    );

    // osd.2 now holds a majority's copy: with osd.0 gone, reads and writes go through it.
    cluster.kill_osd(0);
    check_round(&uri, 9);
    hot_round(&uri, 10);
    check_round(&uri, 10);

    // A crash after the install: replay finds the installed snapshot.
    drop(target);
    cluster.kill_osd(2);
    cluster.start_osd(0);
    cluster.start_osd(2);
    cluster.wait_osds_up(3);
    cluster.wait_replicas_equal(Duration::from_secs(120));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    check_round(&uri, 10);
}

/// A replica that catches up by snapshot while writes go on holds, once installed, objects
/// read over a stretch of its leader's log, not the PG's state at any one entry: the scrub
/// markers in that stretch must not be digested there, or the healthy replica is named
/// inconsistent. With markers every second and writes all along, `basalt status` never
/// names a PG while osd.2 comes back, installs snapshots and catches up.
#[test]
fn background_scrubs_do_not_blame_a_replica_that_caught_up_by_snapshot() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-scrub-snapshot");
    let metrics_port = free_port();
    let osd = |metrics: Option<u16>| {
        let mut args: Vec<String> = ["--device-size", "128MiB", "--scrub-interval-seconds", "1"]
            .map(String::from)
            .to_vec();
        if let Some(port) = metrics {
            args.extend(["--metrics-addr".to_string(), format!("127.0.0.1:{port}")]);
        }
        (None, args)
    };
    let mut cluster = ClusterProcesses::start_custom(
        &dir.path,
        vec![format!("127.0.0.1:{}", free_port())],
        vec![osd(None), osd(None), osd(Some(metrics_port))],
    );
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "8", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "24MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 90 0 8M"]);
    cluster.kill_osd(2);
    for round in 0..10 {
        hot_round(&uri, round);
    }
    let inconsistent = |cluster: &ClusterProcesses| {
        let (_, checks) = cluster.health();
        checks.contains("inconsistent").then_some(checks)
    };
    // Writes go on, round after round, until osd.2 has installed snapshots and a few
    // markers came after.
    let writer = HotWriter::start(&uri, 10);
    cluster.start_osd(2);
    let installed = || {
        // Nothing installed while its metrics server is not up yet.
        if std::net::TcpStream::connect(("127.0.0.1", metrics_port)).is_err() {
            return 0.0;
        }
        let metrics = http_get(&format!("127.0.0.1:{metrics_port}"), "/metrics");
        metric(&metrics, "basalt_osd_snapshots_installed_total")
    };
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut since_install: Option<Instant> = None;
    let mut polls = 0;
    while since_install.is_none_or(|at| at.elapsed() < Duration::from_secs(4)) {
        assert!(Instant::now() < deadline, "osd.2 installed no snapshot");
        if let Some(checks) = inconsistent(&cluster) {
            panic!("a PG found inconsistent while osd.2 caught up: {checks}");
        }
        if since_install.is_none() && installed() > 0.0 {
            since_install = Some(Instant::now());
        }
        polls += 1;
        std::thread::sleep(Duration::from_millis(200));
    }
    let last = writer.stop();
    cluster.wait_replicas_equal(Duration::from_secs(120));
    // A few more markers on the caught-up replicas.
    for _ in 0..15 {
        if let Some(checks) = inconsistent(&cluster) {
            panic!("a PG found inconsistent after osd.2 caught up: {checks}");
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    eprintln!(
        "osd.2 installed {} snapshots; {polls} status polls while it caught up; rounds 10 to {last} written meanwhile",
        installed()
    );
    check_round(&uri, last);
}

/// `basalt pg repair --osd` rebuilds one OSD's replica of every PG while writes go on: in
/// the PGs it leads it hands leadership over first; the scrub after each repair finds the
/// replicas equal at its marker, and every write reads back.
#[test]
fn replicas_rebuilt_while_writes_go_on_keep_every_write() {
    require("qemu-io");
    let dir = ScratchDir::new("cluster-repair");
    let cluster = small_osd_cluster(&dir.path, 1, "256MiB", None, "24MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    qemu_io_ok(&uri, false, &["write -P 90 0 8M"]);
    hot_round(&uri, 0);
    let osd = cluster.busiest_leader();
    let writer = HotWriter::start(&uri, 1);
    let pgs: Vec<String> = cluster
        .cli_json(&["pg", "ls"])
        .as_array()
        .expect("pg list")
        .iter()
        .map(|pg| pg["pg"].as_str().expect("a pg id").to_string())
        .collect();
    assert_eq!(pgs.len(), 8);
    let mut args = vec!["pg", "repair"];
    args.extend(pgs.iter().map(String::as_str));
    let osd_arg = osd.to_string();
    args.extend(["--osd", &osd_arg, "--json"]);
    let output = cluster.cli(&args);
    let last = writer.stop();
    let repaired: serde_json::Value = serde_json::from_slice(&output.stdout).expect("json");
    assert!(output.status.success(), "{repaired}");
    for pg in repaired.as_array().expect("a list") {
        assert_eq!(pg["state"], "repaired", "{repaired}");
        assert_eq!(pg["repaired"], json!([osd]), "{repaired}");
    }
    let log = cluster.log_text(&format!("osd.{}", cluster.osd_process(osd)));
    assert_eq!(log.matches(" repaired pg=").count(), 8, "{log}");
    assert!(log.contains("leadership handed over for a repair"), "{log}");
    eprintln!("rounds 1 to {last} written while 8 replicas were rebuilt");
    assert!(last > 1, "no writes went on during the repairs");
    check_round(&uri, last);
    assert_every_pg_consistent(&cluster);
}

/// Rounds of writes through an exported image while processes die (`kill -9`) at random
/// moments: an OSD; a monitor of three and an OSD; every monitor and OSD; or every OSD and
/// then one again while it catches up. Each round writes every block of the image with a
/// pattern of its own (and the block's offset), so a block that came back from an earlier
/// round, from another place or torn fails the check. After each round: fio wrote and
/// read back everything, the replicas are equal, and a fresh read of the whole image finds
/// the round's data. The devices are small (96 MiB), so the cleaner and checkpoints run
/// across the crashes: in a run of 3 rounds by hand, each OSD's cleaner started during
/// the second round and took 12 steps, and each OSD cut 15 checkpoints.
/// `BASALT_SOAK_ROUNDS` (3 by default) and `BASALT_SOAK_SEED` (printed; it replays the
/// choice and timing of the crashes, not the machine's) for longer runs by hand.
#[test]
fn writes_survive_rounds_of_random_crashes() {
    require("fio");
    let rounds = env_number("BASALT_SOAK_ROUNDS", 3);
    let mut random = SplitMix::from_env("BASALT_SOAK_SEED");
    eprintln!("crash rounds: {rounds}");
    let dir = ScratchDir::new("cluster-soak");
    let mut cluster = small_osd_cluster(&dir.path, 3, "96MiB", None, "24MiB");
    let (_target, uri) = export_image(&dir.path, &cluster, "rbd", "vol");
    for round in 0..rounds {
        // A crash 0.2 to 2.7 s in lands in the writes.
        let writes = PatternRound::start(&uri, round, &mut random);
        std::thread::sleep(Duration::from_millis(200 + random.below(2500)));
        let crash = match random.below(4) {
            0 => {
                let n = random.below(3) as usize;
                cluster.kill_osd(n);
                std::thread::sleep(Duration::from_millis(random.below(2000)));
                cluster.start_osd(n);
                format!("osd process {n} killed")
            }
            1 => {
                cluster.kill_mon();
                for n in 0..3 {
                    cluster.kill_osd(n);
                }
                std::thread::sleep(Duration::from_millis(random.below(1000)));
                cluster.start_mon();
                for n in 0..3 {
                    cluster.start_osd(n);
                }
                "every monitor and every osd killed".to_string()
            }
            2 => {
                let (mon, n) = (random.below(3) as usize, random.below(3) as usize);
                cluster.kill_mon_n(mon);
                cluster.kill_osd(n);
                std::thread::sleep(Duration::from_millis(random.below(2000)));
                cluster.start_mon_n(mon);
                cluster.start_osd(n);
                format!("monitor {mon} and osd process {n} killed")
            }
            _ => {
                for n in 0..3 {
                    cluster.kill_osd(n);
                }
                for n in 0..3 {
                    cluster.start_osd(n);
                }
                let n = random.below(3) as usize;
                std::thread::sleep(Duration::from_millis(random.below(500)));
                cluster.kill_osd(n);
                cluster.start_osd(n);
                format!("every osd killed, then osd process {n} again after its restart")
            }
        };
        writes.report(&crash);
        writes.finish(&cluster, 3, Duration::from_secs(60));
    }
}
