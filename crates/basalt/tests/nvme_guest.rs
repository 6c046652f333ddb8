//! The Linux kernel's NVMe/TCP initiator, with nvme-cli, fio and ext4, against
//! `basalt target`: a small Linux guest under QEMU (scripts/guest) runs
//! `tests/guest/nvme_tcp.sh` against a target on the host's loopback. And the other way
//! round, as a cross-check: our initiator (`basalt bench --nvmf`) against the Linux
//! kernel's target in the guest (`tests/guest/nvmet.sh`). The guests run one at a time.

mod support;

use std::io::{BufRead, BufReader, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

use serde_json::json;
use support::{ScratchDir, TargetProcess};

const NQN: &str = "nqn.2016-06.io.basalt:guest";
const RESTRICTED_NQN: &str = "nqn.2016-06.io.basalt:restricted";
use support::GUEST_RUN as RUN;

/// One guest at a time: two TCG guests on a 2-core machine would each run at half speed.
static GUEST: Mutex<()> = Mutex::new(());

#[test]
fn the_linux_initiator_uses_the_target() {
    let _guest = GUEST
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = ScratchDir::new("nvme-guest");
    let target = TargetProcess::start(&dir.path, &[]);
    for (name, blocks) in [("Malloc0", 262_144), ("Malloc1", 65_536), ("Malloc2", 2048)] {
        target.rpc_ok(
            "bdev_malloc_create",
            json!({"name": name, "num_blocks": blocks, "block_size": 512}),
        );
    }
    target.rpc_ok("nvmf_create_transport", json!({"trtype": "TCP"}));
    target.rpc_ok(
        "nvmf_create_subsystem",
        json!({"nqn": NQN, "allow_any_host": true, "serial_number": "BASALTGUEST1"}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "namespace": {"bdev_name": "Malloc0"}}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "0"}}),
    );
    let subsystems = target.rpc_ok("nvmf_get_subsystems", json!({"nqn": NQN}));
    let port = subsystems[0]["listen_addresses"][0]["trsvcid"]
        .as_str()
        .expect("trsvcid")
        .to_string();
    target.rpc_ok(
        "nvmf_create_subsystem",
        json!({"nqn": RESTRICTED_NQN, "allow_any_host": false}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_host",
        json!({"nqn": RESTRICTED_NQN, "host": "nqn.2014-08.org.nvmexpress:uuid:11111111-2222-4333-8444-555555555555"}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": RESTRICTED_NQN, "namespace": {"bdev_name": "Malloc2"}}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": RESTRICTED_NQN, "listen_address": {"trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": port}}),
    );

    // The guest asks for namespace 2 to be added to its subsystem while it is connected.
    let guest = |trigger_port: u16| {
        let mut command = support::guest_command("nvme_tcp.sh");
        command.args([&port, NQN, RESTRICTED_NQN, &trigger_port.to_string()]);
        command
    };
    let (status, console) =
        support::run_guest_serving(guest, &dir.join("console.txt"), |request| {
            assert_eq!(request, "add-namespace", "unknown request from the guest");
            let nsid = target.rpc_ok(
                "nvmf_subsystem_add_ns",
                json!({"nqn": NQN, "namespace": {"bdev_name": "Malloc1", "nsid": 2}}),
            );
            assert_eq!(nsid, json!(2));
            "added"
        });
    support::check_guest(status, &console, "nvme_tcp: done", || target.log_text());

    // The controller went away with the guest's disconnect.
    support::wait_for("no controller left", Duration::from_secs(10), || {
        target.rpc_ok("nvmf_subsystem_get_controllers", json!({"nqn": NQN})) == json!([])
    });
    target.stop();
}

#[test]
fn our_initiator_uses_the_linux_target() {
    let _guest = GUEST
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let nqn = "nqn.2014-08.io.basalt:kernel";
    let trigger = TcpListener::bind("127.0.0.1:0").expect("trigger listener");
    let trigger_port = trigger.local_addr().expect("address").port();
    let forwarded = support::free_port();
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/guest/nvmet.sh");
    let mut guest = Command::new(RUN)
        .args([script, nqn, &trigger_port.to_string()])
        .env("BASALT_GUEST_TIMEOUT", "600")
        .env(
            "BASALT_GUEST_NETDEV",
            format!("hostfwd=tcp:127.0.0.1:{forwarded}-:4420"),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run the guest");

    // The guest calls back once the kernel target listens.
    trigger.set_nonblocking(true).expect("nonblocking");
    let start = Instant::now();
    let stream = loop {
        match trigger.accept() {
            Ok((stream, _)) => break stream,
            Err(error) if error.kind() == std::io::ErrorKind::WouldBlock => {
                if let Ok(Some(status)) = guest.try_wait() {
                    let output = guest.wait_with_output().expect("output");
                    panic!(
                        "guest ended ({status}) before its target listened:\n{}",
                        String::from_utf8_lossy(&output.stdout)
                    );
                }
                assert!(
                    start.elapsed() < Duration::from_secs(300),
                    "no call from the guest"
                );
                std::thread::sleep(Duration::from_millis(100));
            }
            Err(error) => panic!("accept: {error}"),
        }
    };
    stream.set_nonblocking(false).expect("blocking");
    let mut reader = BufReader::new(stream.try_clone().expect("clone"));
    let mut line = String::new();
    reader.read_line(&mut line).expect("ready line");
    assert_eq!(line.trim(), "ready");

    let uri = format!("nvme+tcp://127.0.0.1:{forwarded}/{nqn}");
    let bench = support::basalt()
        .args([
            "bench",
            "--nvmf",
            &uri,
            "--rw",
            "randwrite",
            "--verify",
            "--workers",
            "2",
            "--iodepth",
            "8",
            "--io-count",
            "1500",
            "--size",
            "16MiB",
        ])
        .output()
        .expect("basalt bench");
    let large = support::basalt()
        .args([
            "bench",
            "--nvmf",
            &uri,
            "--rw",
            "write",
            "--bs",
            "256KiB",
            "--verify",
            "--iodepth",
            "4",
            "--io-count",
            "64",
            "--size",
            "16MiB",
        ])
        .output()
        .expect("basalt bench");
    let mut stream = stream;
    stream.write_all(b"done\n").expect("tell the guest");
    let output = guest.wait_with_output().expect("guest output");
    let console = String::from_utf8_lossy(&output.stdout);
    for (what, run) in [("4 KiB", &bench), ("256 KiB", &large)] {
        let report = String::from_utf8_lossy(&run.stdout);
        assert!(
            run.status.success() && report.contains(", 0 mismatches"),
            "{what} writes against nvmet: {report}{}\nguest:\n{console}",
            String::from_utf8_lossy(&run.stderr)
        );
    }
    assert!(output.status.success(), "guest failed:\n{console}");
}

/// Basalt's main use: a 3-replica image, exported over NVMe/TCP, as the Linux kernel's
/// initiator sees it (`tests/guest/nvme_image.sh`). The kernel takes the target's discard
/// limit (DMRSL: 2,048 objects of 64 KiB here) and splits a `blkdiscard` of the whole
/// image by it; fio's crc32c-verified writes ride out a `kill -9` of the OSD leading the
/// most PGs (well inside Linux's 30 s I/O timeout, past which the kernel would reset the
/// controller), and verify again once it has restarted and caught up; more writes ride
/// out a `kill -9` of the target (Linux reconnects to the target started again from its
/// saved configuration and sends again what was not answered). Write zeroes (`blkdiscard
/// -z`) zeroes its range and nothing else.
#[test]
fn linux_uses_an_image_over_nvme_tcp_through_crashes() {
    let _guest = GUEST
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    const SIZE: u64 = 256 << 20;
    const OBJECT: u64 = 64 << 10;
    let dir = ScratchDir::new("nvme-guest-image");
    let mut cluster = support::ClusterProcesses::start_with_image(&dir.path, SIZE, Some(OBJECT));
    let mut target = TargetProcess::start(&dir.path, &[]);
    target.rpc_ok(
        "bdev_basalt_create",
        json!({"name": "img", "pool": "rbd", "image": "vol", "mons": cluster.mon_addresses()}),
    );
    let nqn = "nqn.2016-06.io.basalt:image";
    let port = target.start_nvmf(nqn, "img");
    let config = dir.join("target.json");
    std::fs::write(
        &config,
        target.rpc_ok("save_config", json!(null)).to_string(),
    )
    .expect("save the configuration");

    // The guest asks for the busiest leader to be killed, then restarted once fio is done,
    // then for the target to be killed and started again.
    let guest = |trigger_port: u16| {
        let mut command = support::guest_command("nvme_image.sh");
        command.args([
            port.to_string(),
            nqn.to_string(),
            trigger_port.to_string(),
            SIZE.to_string(),
            (2_048 * OBJECT).to_string(),
        ]);
        command
    };
    let mut killed = None;
    let killed_log = dir.join("target-killed.log");
    let (status, console) =
        support::run_guest_serving(guest, &dir.join("console.txt"), |request| {
            if request != "restart-target" {
                return cluster.guest_request(request, &mut killed);
            }
            target.kill();
            std::fs::rename(&target.log, &killed_log).expect("keep the killed target's log");
            target = TargetProcess::start(&dir.path, &["--config", config.to_str().expect("utf8")]);
            "restarted"
        });
    support::check_guest(status, &console, "nvme_image: done", || {
        let killed = std::fs::read_to_string(&killed_log).unwrap_or_default();
        format!(
            "{killed}\n(the target started again:)\n{}",
            target.log_text()
        )
    });
    target.stop();
}

/// Two `basalt target` processes as two paths to one image: each exports it as namespace 1
/// (the same UUID) of the same subsystem, with controller ids of its own
/// (`min_cntlid`/`max_cntlid`, as with SPDK), and Linux's native multipath puts both under
/// one block device (`tests/guest/nvme_multipath.sh`). fio's verified writes, sent down
/// both paths in turn, ride out a `kill -9` of one target: Linux sends the commands it had
/// under way there down the other.
#[test]
fn two_targets_are_two_paths_to_an_image() {
    let _guest = GUEST
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner());
    let dir = ScratchDir::new("nvme-guest-multipath");
    let cluster = support::ClusterProcesses::start_with_image(&dir.path, 128 << 20, None);
    let nqn = "nqn.2016-06.io.basalt:paths";
    let uuid = "5e4c8a3f-61d2-4b7e-9a0c-2f18d6b4e701";
    let start = |name: &str, cntlids: (u16, u16)| {
        let own = dir.join(name);
        std::fs::create_dir_all(&own).expect("target dir");
        let target = TargetProcess::start(&own, &[]);
        target.rpc_ok(
            "bdev_basalt_create",
            json!({"name": "img", "pool": "rbd", "image": "vol", "uuid": uuid,
                "mons": cluster.mon_addresses()}),
        );
        let port = target.start_nvmf_with(
            nqn,
            "img",
            json!({"serial_number": "BASALTPATHS1", "min_cntlid": cntlids.0,
                "max_cntlid": cntlids.1}),
        );
        (target, port.to_string())
    };
    let (mut a, port_a) = start("a", (1, 999));
    let (b, port_b) = start("b", (1000, 1999));

    let guest = |trigger_port: u16| {
        let mut command = support::guest_command("nvme_multipath.sh");
        command.args([&port_a, &port_b, nqn, &trigger_port.to_string()]);
        command
    };
    let (status, console) =
        support::run_guest_serving(guest, &dir.join("console.txt"), |request| {
            assert_eq!(request, "kill-a", "unknown request from the guest");
            a.kill();
            "killed"
        });
    support::check_guest(status, &console, "nvme_multipath: done", || {
        format!("A:\n{}\nB:\n{}", a.log_text(), b.log_text())
    });
    b.stop();
}
