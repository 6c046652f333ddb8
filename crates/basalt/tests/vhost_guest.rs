//! QEMU virtual machines on vhost-user-blk controllers of `basalt target`: a small Linux
//! guest (scripts/guest) sees two virtio disks served by the target and runs
//! `tests/guest/vhost_blk.sh` on them. Also the controllers' RPC errors.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use basalt_vhost::inflight::queue_bytes;
use serde_json::{Value, json};
use support::{ScratchDir, TargetProcess};

use support::GUEST_RUN as RUN;

/// One TCG guest at a time: two would share the machine's two cores.
static GUEST: Mutex<()> = Mutex::new(());

#[test]
fn a_guest_uses_vhost_user_blk_controllers() {
    let _guest = GUEST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = ScratchDir::new("vhost-guest");
    let sockets = dir.join("sockets");
    std::fs::create_dir_all(&sockets).expect("socket dir");
    let target = TargetProcess::start(&dir.path, &["-S", sockets.to_str().expect("utf8")]);
    // vhost.0 on a file (reads and writes in place, on two queues), vhost.ro on RAM
    // (every request through a reactor).
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|file| file.set_len(64 << 20))
        .expect("disk file");
    target.rpc_ok(
        "bdev_uring_create",
        json!({"name": "Disk0", "filename": disk, "block_size": 512}),
    );
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"name": "Malloc1", "num_blocks": 8192, "block_size": 512}),
    );
    target.rpc_ok(
        "vhost_create_blk_controller",
        json!({"ctrlr": "vhost.0", "dev_name": "Disk0", "max_queues": 2}),
    );
    target.rpc_ok(
        "vhost_create_blk_controller",
        json!({"ctrlr": "vhost.ro", "dev_name": "Malloc1", "readonly": true, "max_queues": 1}),
    );
    let bdevs = target.rpc_ok("bdev_get_bdevs", json!({"name": "Disk0"}));
    let serial: String = bdevs[0]["uuid"]
        .as_str()
        .expect("uuid")
        .replace('-', "")
        .chars()
        .take(20)
        .collect();
    let socket = |name: &str| sockets.join(name).display().to_string();
    let boot = |script: &str, args: &[&str], done: &str| {
        let output = Command::new(RUN)
            .arg(script)
            .args(args)
            .arg("--")
            .args([
                "-chardev",
                &format!("socket,id=vu0,path={}", socket("vhost.0")),
            ])
            .args(["-device", "vhost-user-blk-pci,chardev=vu0,num-queues=2"])
            .args([
                "-chardev",
                &format!("socket,id=vu1,path={}", socket("vhost.ro")),
            ])
            .args(["-device", "vhost-user-blk-pci,chardev=vu1,num-queues=1"])
            .env("BASALT_GUEST_TIMEOUT", "600")
            .output()
            .expect("run the guest");
        let console = String::from_utf8_lossy(&output.stdout);
        assert!(
            output.status.success() && console.contains(done),
            "guest failed ({}):\n{console}\n{}\ntarget log:\n{}",
            output.status,
            String::from_utf8_lossy(&output.stderr),
            target.log_text()
        );
        if std::env::var_os("BASALT_SHOW_GUEST").is_some() {
            eprintln!("{console}");
        }
    };
    let size = (64u64 << 20).to_string();
    boot(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/guest/vhost_blk.sh"),
        &[&size, &serial],
        "vhost_blk: done",
    );
    // A new QEMU (the VM restarted) attaches to the same controllers and finds the files.
    boot(
        concat!(env!("CARGO_MANIFEST_DIR"), "/tests/guest/vhost_again.sh"),
        &[],
        "vhost_again: done",
    );
    // QEMU is gone: the controllers are detached and can be deleted.
    support::wait_for(
        "controllers detached",
        std::time::Duration::from_secs(10),
        || {
            let list = target.rpc_ok("vhost_get_controllers", Value::Null);
            list.as_array()
                .is_some_and(|l| l.iter().all(|c| c["attached"] == json!(false)))
        },
    );
    let controllers = target.rpc_ok("vhost_get_controllers", Value::Null);
    let in_place = |name: &str| {
        controllers
            .as_array()
            .and_then(|list| list.iter().find(|c| c["ctrlr"] == json!(name)))
            .and_then(|c| c["in_place_requests"].as_u64())
            .expect("a count")
    };
    assert!(in_place("vhost.0") > 1000, "{controllers}");
    assert_eq!(in_place("vhost.ro"), 0, "RAM goes through the reactors");
    let config = target.rpc_ok("save_config", Value::Null);
    assert!(
        config.to_string().contains("vhost_create_blk_controller"),
        "{config}"
    );
    target.rpc_ok("vhost_delete_controller", json!({"ctrlr": "vhost.0"}));
    assert!(!sockets.join("vhost.0").exists(), "its socket is gone");
    target.rpc_ok("bdev_uring_delete", json!({"name": "Disk0"}));
    target.stop();
}

/// The life cycle under a running VM: the guest reboots (a device reset) and attaches
/// again; then the target is killed (SIGKILL) while two fio jobs write at queue depth 16,
/// one on each of the controller's two queues, and started again from its saved
/// configuration while QEMU waits with `reconnect=1`: the requests in flight at the kill
/// are replayed, queue by queue, from the in-flight region, fio's verify passes and the
/// guest's I/O goes on; last,
/// the disk's file grows, `bdev_uring_rescan` takes it on, and the running guest sees the
/// new size (the configuration change notice).
#[test]
fn a_guest_rides_out_a_target_restart_and_a_reboot() {
    // One per vCPU of the guest: the guest's two fio jobs, one per vCPU, write on both.
    const QUEUES: usize = 2;
    let _guest = GUEST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = ScratchDir::new("vhost-restart");
    let sockets = dir.join("sockets");
    std::fs::create_dir_all(&sockets).expect("socket dir");
    let disk = dir.join("disk.img");
    std::fs::File::create(&disk)
        .and_then(|file| file.set_len(64 << 20))
        .expect("disk file");
    let socket_dir = sockets.to_str().expect("utf8");
    let mut target = TargetProcess::start(&dir.path, &["-S", socket_dir]);
    target.rpc_ok(
        "bdev_uring_create",
        json!({"name": "disk", "filename": disk, "block_size": 512}),
    );
    target.rpc_ok(
        "vhost_create_blk_controller",
        json!({"ctrlr": "vhost.r", "dev_name": "disk", "max_queues": QUEUES}),
    );
    let config = dir.join("target.json");
    std::fs::write(
        &config,
        target.rpc_ok("save_config", Value::Null).to_string(),
    )
    .expect("save the configuration");
    let mut guest = Command::new(RUN)
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/guest/vhost_restart.sh"
        ))
        .arg("--")
        .args([
            "-chardev",
            &format!(
                "socket,id=vu0,path={},reconnect=1",
                sockets.join("vhost.r").display()
            ),
        ])
        .args([
            "-device",
            &format!("vhost-user-blk-pci,chardev=vu0,num-queues={QUEUES}"),
        ])
        .env("BASALT_GUEST_TIMEOUT", "600")
        .env("BASALT_GUEST_REBOOT", "1")
        .stdout(Stdio::piped())
        .spawn()
        .expect("run the guest");
    let mut console = String::new();
    let (mut grown, mut restarted, mut marked_at_kill) = (false, false, Vec::new());
    for line in BufReader::new(guest.stdout.take().expect("stdout")).lines() {
        let line = line.expect("console");
        if line.contains("vhost_restart: grow the disk now") {
            std::fs::OpenOptions::new()
                .write(true)
                .open(&disk)
                .and_then(|file| file.set_len(96 << 20))
                .expect("grow the disk file");
            target.rpc_ok("bdev_uring_rescan", json!({"name": "disk"}));
            grown = true;
        }
        if line.contains("vhost_restart: restart the target now") {
            // The guest's requests spend little time in the target (the guest under TCG is
            // the slow side), so the kill waits for a moment the target holds some: the
            // target is stopped, its in-flight region read, and killed while stopped.
            marked_at_kill = kill_holding_requests(&mut target, QUEUES);
            std::thread::sleep(Duration::from_secs(1));
            target = TargetProcess::start(
                &dir.path,
                &["-S", socket_dir, "--config", config.to_str().expect("utf8")],
            );
            restarted = true;
        }
        console.push_str(&line);
        console.push('\n');
    }
    let status = guest.wait().expect("wait for the guest");
    if std::env::var_os("BASALT_SHOW_GUEST").is_some() {
        eprintln!("{console}");
    }
    assert!(
        status.success() && grown && restarted && console.contains("vhost_restart: done"),
        "guest failed ({status}, grown: {grown}, target restarted: {restarted}):\n{console}\ntarget log:\n{}",
        target.log_text()
    );
    assert!(console.contains("vhost_restart: rebooting"), "{console}");
    let log = target.log_text();
    assert!(
        marked_at_kill.len() == QUEUES
            && marked_at_kill.iter().all(|&count| count >= 1)
            && marked_at_kill.iter().sum::<usize>() >= 2,
        "{marked_at_kill:?} requests in flight at the kill, queue by queue"
    );
    // Each queue's, all of them, or all but one if the kill came as one was being put on
    // that queue's used ring (it was answered: the restarted target unmarks it).
    let mut replayed = vec![None; QUEUES];
    for line in log.lines().filter(|line| line.contains("vring resumed")) {
        let field = |name: &str| -> Option<usize> {
            line.split(name)
                .nth(1)?
                .split_whitespace()
                .next()?
                .parse()
                .ok()
        };
        if let (Some(queue), Some(requests)) = (field("queue="), field("requests=")) {
            assert!(
                queue < QUEUES && replayed[queue].replace(requests).is_none(),
                "queue {queue} resumed twice, or no such queue:\n{log}"
            );
        }
    }
    for (queue, (&marked, replayed)) in marked_at_kill.iter().zip(&replayed).enumerate() {
        assert!(
            replayed.is_some_and(|replayed| (marked - 1..=marked).contains(&replayed)),
            "queue {queue}: {marked} requests in flight at the kill, {replayed:?} replayed\n{log}"
        );
    }
    // The guest's reads and writes of the file bdev went in place (guest memory to the
    // file from the vring thread), since the restart too.
    let controllers = target.rpc_ok("vhost_get_controllers", json!({"name": "vhost.r"}));
    let in_place = controllers[0]["in_place_requests"]
        .as_u64()
        .expect("a count");
    assert!(
        in_place > 1000,
        "{in_place} requests in place: {controllers}"
    );
    target.stop();
}

/// A VM on a Basalt volume: a 3-replica image served by a vhost-user-blk controller to the
/// Linux virtio-blk driver (`tests/guest/vhost_image.sh`). The driver takes the image's
/// discard limit (2,048 objects of 64 KiB); fio's crc32c-verified writes on both queues
/// ride out a `kill -9` of the OSD leading the most PGs and verify again once it has
/// restarted and caught up; discards, write zeroes, and ext4 with fstrim.
#[test]
fn a_guest_runs_on_an_image_through_an_osd_crash() {
    let _guest = GUEST
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    const SIZE: u64 = 256 << 20;
    const OBJECT: u64 = 64 << 10;
    let dir = ScratchDir::new("vhost-guest-image");
    let mut cluster = support::ClusterProcesses::start_with_image(&dir.path, SIZE, Some(OBJECT));
    let sockets = dir.join("sockets");
    std::fs::create_dir_all(&sockets).expect("socket dir");
    let target = TargetProcess::start(&dir.path, &["-S", sockets.to_str().expect("utf8")]);
    target.rpc_ok(
        "bdev_basalt_create",
        json!({"name": "img", "pool": "rbd", "image": "vol", "mons": cluster.mon_addresses()}),
    );
    target.rpc_ok(
        "vhost_create_blk_controller",
        json!({"ctrlr": "vhost.img", "dev_name": "img", "max_queues": 2}),
    );

    let guest = |trigger_port: u16| {
        let mut command = support::guest_command("vhost_image.sh");
        command
            .args([
                trigger_port.to_string(),
                SIZE.to_string(),
                (2_048 * OBJECT).to_string(),
            ])
            .arg("--")
            .args([
                "-chardev",
                &format!("socket,id=vu0,path={}", sockets.join("vhost.img").display()),
            ])
            .args(["-device", "vhost-user-blk-pci,chardev=vu0,num-queues=2"]);
        command
    };
    let mut killed = None;
    let (status, console) =
        support::run_guest_serving(guest, &dir.join("console.txt"), |request| {
            cluster.guest_request(request, &mut killed)
        });
    support::check_guest(status, &console, "vhost_image: done", || target.log_text());
    target.stop();
}

/// Kills `target` (SIGKILL) at a moment it holds requests of the guest's on each of its
/// `queues` queues, two or more in all, within 30 s: stopped (SIGSTOP), the marks of its
/// in-flight region counted, killed if there are enough, else let go on for a moment. The
/// requests marked, queue by queue.
fn kill_holding_requests(target: &mut TargetProcess, queues: usize) -> Vec<usize> {
    let pid = target.child.id().to_string();
    let signal = |name: &str| {
        let status = Command::new("kill")
            .args([name, &pid])
            .status()
            .expect("kill");
        assert!(status.success(), "kill {name} {pid}");
    };
    let start = std::time::Instant::now();
    let marked = loop {
        signal("-STOP");
        wait_stopped(&pid);
        let marked = inflight_marks(&pid);
        let enough = marked.len() == queues
            && marked.iter().all(|&count| count >= 1)
            && marked.iter().sum::<usize>() >= 2;
        if enough || start.elapsed() > Duration::from_secs(30) {
            break marked;
        }
        signal("-CONT");
        std::thread::sleep(Duration::from_millis(3));
    };
    target
        .child
        .kill()
        .and_then(|()| target.child.wait())
        .expect("SIGKILL the target");
    marked
}

/// Waits until every thread of process `pid` has stopped (SIGSTOP takes effect
/// asynchronously).
fn wait_stopped(pid: &str) {
    support::wait_for("the target to stop", Duration::from_secs(5), || {
        let tasks = std::fs::read_dir(format!("/proc/{pid}/task")).expect("tasks");
        tasks.flatten().all(|task| {
            let stat = std::fs::read_to_string(task.path().join("stat")).unwrap_or_default();
            // The state follows the command's closing parenthesis.
            let state = stat.rsplit_once(") ").map(|(_, rest)| rest.chars().next());
            matches!(state, Some(Some('T' | 't')) | None)
        })
    });
}

/// The requests marked in flight, queue by queue, in the in-flight region that process `pid`
/// holds open (the layout libvhost-user uses: per queue a 16-byte header with the number
/// of descriptors at byte 10, then 16 bytes per descriptor head, the mark first; each
/// queue's part `queue_bytes` long); of the regions open, the one with the most.
fn inflight_marks(pid: &str) -> Vec<usize> {
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).expect("fds");
    fds.flatten()
        .filter(|fd| {
            std::fs::read_link(fd.path())
                .is_ok_and(|link| link.to_string_lossy().contains("basalt-vhost-inflight"))
        })
        .filter_map(|fd| std::fs::read(fd.path()).ok())
        .map(|bytes| {
            let mut queues = Vec::new();
            let mut base = 0;
            while let Some(&[low, high]) = bytes.get(base + 10..base + 12) {
                let size = u16::from_le_bytes([low, high]);
                let heads = usize::from(size);
                if heads == 0 {
                    break;
                }
                let end = (base + 16 + 16 * heads).min(bytes.len());
                queues.push(
                    bytes[base + 16..end]
                        .chunks_exact(16)
                        .filter(|state| state[0] == 1)
                        .count(),
                );
                base += queue_bytes(size) as usize;
            }
            queues
        })
        .max_by_key(|queues| queues.iter().sum::<usize>())
        .unwrap_or_default()
}

#[test]
fn vhost_methods_name_what_is_wrong() {
    let dir = ScratchDir::new("vhost-rpc");
    let target = TargetProcess::start(&dir.path, &["-S", dir.path.to_str().expect("utf8")]);
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"name": "m0", "num_blocks": 64, "block_size": 512}),
    );
    let invalid = |params: Value, needle: &str| {
        let message = target.rpc_err("vhost_create_blk_controller", params, -32602);
        assert!(message.contains(needle), "{message}");
    };
    invalid(json!({"ctrlr": "../x", "dev_name": "m0"}), "ctrlr");
    invalid(
        json!({"ctrlr": "v", "dev_name": "m0", "packed_ring": true}),
        "packed_ring",
    );
    invalid(
        json!({"ctrlr": "v", "dev_name": "m0", "max_queues": 0}),
        "max_queues",
    );
    invalid(
        json!({"ctrlr": "v", "dev_name": "m0", "cpumask": "0x0"}),
        "cpumask",
    );
    // CPU 100 has no reactor on this machine.
    let message = target.rpc_err(
        "vhost_create_blk_controller",
        json!({"ctrlr": "v", "dev_name": "m0", "cpumask": "[100]"}),
        -32602,
    );
    assert!(message.contains("selects no reactor"), "{message}");
    target.rpc_err(
        "vhost_create_blk_controller",
        json!({"ctrlr": "v", "dev_name": "nope"}),
        -19,
    );
    // A socket path that cannot be bound (a directory is there) fails the call.
    std::fs::create_dir(dir.join("blocked")).expect("dir");
    let message = target.rpc_err(
        "vhost_create_blk_controller",
        json!({"ctrlr": "blocked", "dev_name": "m0"}),
        -32603,
    );
    assert!(message.contains("blocked"), "{message}");
    target.rpc_ok(
        "vhost_create_blk_controller",
        json!({"ctrlr": "v", "dev_name": "m0", "cpumask": "0x1"}),
    );
    let listed = target.rpc_ok("vhost_get_controllers", json!({"name": "v"}));
    assert_eq!(listed[0]["cpumask"], json!("0x1"), "{listed}");
    let config = target.rpc_ok("save_config", Value::Null).to_string();
    assert!(config.contains("\"cpumask\":\"0x1\""), "{config}");
    assert!(
        dir.join("v").exists(),
        "the socket is in the socket directory"
    );
    target.rpc_err(
        "vhost_create_blk_controller",
        json!({"ctrlr": "v", "dev_name": "m0"}),
        -17,
    );
    target.rpc_err("bdev_malloc_delete", json!({"name": "m0"}), -16);
    target.rpc_err("vhost_get_controllers", json!({"name": "w"}), -19);
    target.rpc_ok("vhost_delete_controller", json!({"ctrlr": "v"}));
    target.rpc_err("vhost_delete_controller", json!({"ctrlr": "v"}), -19);
    target.rpc_ok("bdev_malloc_delete", json!({"name": "m0"}));

    // A controller whose socket file someone else removed is deleted all the same, and
    // one left so does not keep the target from stopping.
    for (ctrlr, bdev) in [("gone", "m1"), ("left", "m2")] {
        target.rpc_ok(
            "bdev_malloc_create",
            json!({"name": bdev, "num_blocks": 64, "block_size": 512}),
        );
        target.rpc_ok(
            "vhost_create_blk_controller",
            json!({"ctrlr": ctrlr, "dev_name": bdev}),
        );
        std::fs::remove_file(dir.join(ctrlr)).expect("remove the socket");
    }
    target.rpc_ok("vhost_delete_controller", json!({"ctrlr": "gone"}));
    target.stop();
}
