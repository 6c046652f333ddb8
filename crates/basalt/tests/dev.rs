//! `basalt dev`, the README's main command: it starts a target with an NBD export that
//! qemu-io can use, prints how to connect, and stops cleanly on SIGTERM.

mod support;

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::time::Duration;

use support::*;

#[test]
fn dev_serves_a_volume_that_qemu_io_uses_and_stops_on_sigterm() {
    require("qemu-io");
    let dir = ScratchDir::new("dev");
    let port = {
        let probe = std::net::TcpListener::bind("127.0.0.1:0").expect("free port");
        probe.local_addr().expect("addr").port()
    };
    let mut child = basalt()
        .args([
            "dev",
            "--size",
            "64MiB",
            "--nbd-port",
            &port.to_string(),
            "--data-dir",
        ])
        .arg(&dir.path)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn basalt dev");
    let stdout = child.stdout.take().expect("stdout");
    let mut lines = BufReader::new(stdout).lines();
    let mut printed = String::new();
    let uri = loop {
        let line = lines
            .next()
            .expect("basalt dev printed its export")
            .expect("utf8 line");
        printed.push_str(&line);
        printed.push('\n');
        if let Some(start) = line.find("nbd://") {
            break line[start..]
                .split_whitespace()
                .next()
                .expect("uri")
                .to_string();
        }
    };
    assert_eq!(uri, format!("nbd://127.0.0.1:{port}/disk0"), "{printed}");
    let socket = dir.join("target.sock");
    wait_for("the dev target's socket", Duration::from_secs(20), || {
        socket.exists()
    });
    qemu_io_ok(&uri, false, &["write -P 0xab 0 64k", "flush"]);
    qemu_io_ok(&uri, true, &["read -P 0xab 0 64k", "read -P 0 64k 64k"]);
    let bdevs = run_ok(
        basalt()
            .arg("rpc")
            .arg("-s")
            .arg(&socket)
            .arg("bdev_get_bdevs"),
    );
    assert!(bdevs.contains("\"disk0\""), "{bdevs}");

    run_ok(Command::new("kill").args(["-TERM", &child.id().to_string()]));
    let status = child.wait().expect("wait");
    assert!(status.success(), "basalt dev exited with {status}");
    let rest: Vec<String> = lines.map_while(Result::ok).collect();
    assert!(rest.iter().any(|line| line.contains("stopped")), "{rest:?}");
    assert!(!socket.exists(), "the socket is removed on exit");
}
