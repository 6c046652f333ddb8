//! `basalt dev`, the README's main command: it starts a monitor, three OSDs and a target
//! with an NBD export that qemu-io can use, prints how to connect, stops cleanly on
//! SIGTERM, and started again serves the same data.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

/// Spawns `basalt dev` in `dir` (a 64 MiB image, 256 MiB OSDs, sparse or not), its
/// stdout piped.
fn spawn_dev(
    dir: &ScratchDir,
    (nbd_port, nvmf_port): (u16, u16),
    mon_port: u16,
    sparse: bool,
) -> std::process::Child {
    let mut command = basalt();
    command.args([
        "dev",
        "--size",
        "64MiB",
        "--osd-size",
        "256MiB",
        "--pg-count",
        "8",
    ]);
    if sparse {
        command.arg("--sparse-osds");
    }
    command
        .args(["--nbd-port", &nbd_port.to_string()])
        .args(["--nvmf-port", &nvmf_port.to_string()])
        .args(["--mon-port", &mon_port.to_string(), "--data-dir"])
        .arg(&dir.path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn basalt dev")
}

/// Starts `basalt dev` in `dir`, checks that it printed how to connect (NBD, NVMe/TCP, the
/// CLI's config); returns it, the URI it printed and its remaining output.
fn start_dev(
    dir: &ScratchDir,
    (nbd_port, nvmf_port): (u16, u16),
    mon_port: u16,
) -> (
    std::process::Child,
    String,
    std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    let mut child = spawn_dev(dir, (nbd_port, nvmf_port), mon_port, true);
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut printed = String::new();
    let uri = loop {
        let line = next_line(&mut lines, &mut printed);
        if let Some(start) = line.find("nbd://") {
            break line[start..]
                .split_whitespace()
                .next()
                .expect("uri")
                .to_string();
        }
    };
    assert_eq!(
        uri,
        format!("nbd://127.0.0.1:{nbd_port}/disk0"),
        "{printed}"
    );
    // The rest of how to connect, up to the last line of it.
    while !printed.contains("Ctrl-C stops it.") {
        next_line(&mut lines, &mut printed);
    }
    let connect =
        format!("nvme connect -t tcp -a 127.0.0.1 -s {nvmf_port} -n nqn.2016-06.io.basalt:disk0");
    assert!(printed.contains(&connect), "{printed}");
    let conf = format!("export BASALT_CONF={}", dir.join("basalt.toml").display());
    assert!(printed.contains(&conf), "{printed}");
    (child, uri, lines)
}

/// The next line `basalt dev` prints, added to `printed`.
fn next_line(
    lines: &mut std::io::Lines<BufReader<std::process::ChildStdout>>,
    printed: &mut String,
) -> String {
    let line = lines
        .next()
        .unwrap_or_else(|| panic!("basalt dev stopped printing: {printed}"))
        .expect("utf8 line");
    printed.push_str(&line);
    printed.push('\n');
    line
}

fn stop_dev(
    mut child: std::process::Child,
    lines: std::io::Lines<BufReader<std::process::ChildStdout>>,
) {
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = child.wait().expect("wait");
    assert!(status.success(), "basalt dev exited with {status}");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|line| line.contains("stopped")), "{rest:?}");
}

#[test]
fn dev_serves_an_image_that_qemu_io_uses_and_keeps_it_across_restarts() {
    require("qemu-io");
    let dir = ScratchDir::new("dev");
    let (ports, mon_port) = ((free_port(), free_port()), free_port());
    let (child, uri, lines) = start_dev(&dir, ports, mon_port);
    let socket = dir.join("target.sock");
    wait_for("the dev target's socket", Duration::from_secs(20), || {
        socket.exists()
    });
    qemu_io_ok(&uri, false, &["write -P 0xab 0 64k", "flush"]);
    qemu_io_ok(&uri, true, &["read -P 0xab 0 64k", "read -P 0 32M 64k"]);
    let bdevs = run_ok(
        basalt()
            .arg("rpc")
            .arg("-s")
            .arg(&socket)
            .arg("bdev_get_bdevs"),
    );
    assert!(bdevs.contains("\"disk0\""), "{bdevs}");
    // The CLI finds the cluster through the config file that dev wrote.
    let status = run_ok(
        basalt()
            .arg("status")
            .env("BASALT_CONF", dir.join("basalt.toml")),
    );
    assert!(status.contains("3 osds: 3 up, 3 in"), "{status}");
    assert!(status.contains("8 active+clean"), "{status}");

    // The same image over NVMe/TCP, through our initiator: written and verified on two
    // I/O queues, 8 commands in flight on each.
    let nvmf = format!(
        "nvme+tcp://127.0.0.1:{}/nqn.2016-06.io.basalt:disk0",
        ports.1
    );
    let report = run_ok(basalt().args([
        "bench",
        "--nvmf",
        &nvmf,
        "--rw",
        "randwrite",
        "--verify",
        "--workers",
        "2",
        "--iodepth",
        "8",
        "--io-count",
        "2000",
        "--size",
        "8MiB",
    ]));
    assert!(report.contains(", 0 mismatches"), "{report}");
    // fastblock's block_bench summary line, for those who compare against it.
    assert!(report.contains("  block_bench: p0.1: "), "{report}");
    assert!(report.contains(", biased stdv: "), "{report}");
    assert!(!report.contains("errors:"), "{report}");
    qemu_io_ok(&uri, false, &["write -P 0xab 0 64k", "flush"]);
    stop_dev(child, lines);
    assert!(!socket.exists(), "the socket is removed on exit");
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", mon_port)).is_err(),
        "the monitor stopped with dev"
    );

    // Started again on the same directory: the same image, the same data.
    let (child, uri, lines) = start_dev(&dir, ports, mon_port);
    qemu_io_ok(&uri, true, &["read -P 0xab 0 64k", "read -P 0 32M 64k"]);
    stop_dev(child, lines);
}

/// SIGTERM while `basalt dev` starts its cluster (here as soon as its OSDs are spawned):
/// it stops the daemons it started and exits, leaving none running.
#[test]
fn dev_stopped_while_starting_leaves_no_daemon_running() {
    let dir = ScratchDir::new("dev-early-stop");
    // Devices zeroed (not sparse): the OSDs take a while to start.
    let mut child = spawn_dev(&dir, (free_port(), free_port()), free_port(), false);
    wait_for("the osds to be spawned", Duration::from_secs(20), || {
        dir.join("osd.2.log").exists()
    });
    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = child.wait().expect("wait");
    assert!(status.success(), "basalt dev exited with {status}");
    let mut printed = String::new();
    std::io::Read::read_to_string(&mut child.stdout.take().expect("stdout"), &mut printed)
        .expect("stdout");
    assert!(printed.contains("stopped while starting"), "{printed}");
    // No process left with the data directory on its command line.
    let path = dir.path.display().to_string();
    let left: Vec<String> = std::fs::read_dir("/proc")
        .expect("/proc")
        .filter_map(|entry| {
            let cmdline = std::fs::read(entry.ok()?.path().join("cmdline")).ok()?;
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            cmdline.contains(&path).then_some(cmdline)
        })
        .collect();
    assert!(left.is_empty(), "left running: {left:?}");
}
