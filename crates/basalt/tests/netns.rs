//! Three OSD hosts in network namespaces (veth pairs on a bridge); the monitor and the
//! client are in the test's own namespace. The host that leads the most PGs is cut off from
//! the other hosts (it still reaches the monitor and the client): it acknowledges no write,
//! the majority elects new leaders and the client goes on; once healed, the replicas
//! converge and every block verifies.

mod support;

use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::json;
use support::*;

/// The namespaces, veths and bridge of one test; removed on drop.
struct Hosts {
    bridge: String,
    namespaces: Vec<String>,
    subnet: String,
}

fn ip(args: &[&str]) {
    run_ok(Command::new("ip").args(args));
}

impl Hosts {
    fn new(count: usize) -> Self {
        let tag = std::process::id() % 10_000;
        let hosts = Self {
            bridge: format!("bsbr{tag}"),
            namespaces: (1..=count).map(|n| format!("bsh{tag}-{n}")).collect(),
            subnet: format!("10.213.{}", tag % 250),
        };
        ip(&["link", "add", &hosts.bridge, "type", "bridge"]);
        ip(&[
            "addr",
            "add",
            &format!("{}.254/24", hosts.subnet),
            "dev",
            &hosts.bridge,
        ]);
        ip(&["link", "set", &hosts.bridge, "up"]);
        for (n, netns) in hosts.namespaces.iter().enumerate() {
            let (outside, inside) = (format!("bsv{tag}o{n}"), format!("bsv{tag}i{n}"));
            ip(&["netns", "add", netns]);
            ip(&[
                "link", "add", &outside, "type", "veth", "peer", "name", &inside,
            ]);
            ip(&["link", "set", &inside, "netns", netns]);
            ip(&["link", "set", &outside, "master", &hosts.bridge, "up"]);
            let address = format!("{}/24", hosts.address(n));
            ip(&["-n", netns, "addr", "add", &address, "dev", &inside]);
            ip(&["-n", netns, "link", "set", &inside, "up"]);
            ip(&["-n", netns, "link", "set", "lo", "up"]);
        }
        hosts
    }

    /// Host `n`'s address.
    fn address(&self, n: usize) -> String {
        format!("{}.{}", self.subnet, n + 1)
    }

    /// The address of the bridge (the test's side).
    fn gateway(&self) -> String {
        format!("{}.254", self.subnet)
    }

    /// Cuts host `n` off from the other hosts, or heals the cut: blackhole routes on both
    /// sides.
    fn cut(&self, n: usize, cut: bool) {
        let verb = if cut { "add" } else { "del" };
        for other in (0..self.namespaces.len()).filter(|other| *other != n) {
            let to_other = format!("{}/32", self.address(other));
            let to_n = format!("{}/32", self.address(n));
            ip(&[
                "-n",
                &self.namespaces[n],
                "route",
                verb,
                "blackhole",
                &to_other,
            ]);
            ip(&[
                "-n",
                &self.namespaces[other],
                "route",
                verb,
                "blackhole",
                &to_n,
            ]);
        }
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        for netns in &self.namespaces {
            let _ = Command::new("ip").args(["netns", "del", netns]).status();
        }
        let _ = Command::new("ip")
            .args(["link", "del", &self.bridge])
            .status();
    }
}

fn metric(address: &str, name: &str) -> f64 {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).expect("connect to metrics");
    write!(stream, "GET /metrics HTTP/1.1\r\nHost: test\r\n\r\n").expect("request");
    let mut response = String::new();
    stream.read_to_string(&mut response).expect("response");
    response
        .lines()
        .find_map(|line| line.strip_prefix(&format!("{name} "))?.parse().ok())
        .unwrap_or_else(|| panic!("no {name} in {response}"))
}

fn fio_args(offset: &str, extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = [
        "--rw=randwrite",
        "--bs=4k",
        "--iodepth=8",
        "--size=16M",
        "--verify=crc32c",
        "--randseed=99",
        "--verify_fatal=1",
    ]
    .iter()
    .map(ToString::to_string)
    .collect();
    args.push(format!("--offset={offset}"));
    args.extend(extra.iter().map(ToString::to_string));
    args
}

fn fio_run(uri: &str, args: &[String]) -> serde_json::Value {
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    fio(uri, &args)
}

#[test]
fn a_partitioned_leader_acknowledges_nothing_and_the_majority_goes_on() {
    let dir = ScratchDir::new("netns");
    let hosts = Hosts::new(3);
    let mon = format!("{}:{}", hosts.gateway(), free_port());
    let osds = (0..3)
        .map(|n| {
            let address = hosts.address(n);
            (
                Some(hosts.namespaces[n].clone()),
                vec![
                    "--listen".to_string(),
                    format!("{address}:0"),
                    "--host".to_string(),
                    format!("host{n}"),
                    "--metrics-addr".to_string(),
                    format!("{address}:9100"),
                ],
            )
        })
        .collect();
    let cluster = ClusterProcesses::start_custom(&dir.path, vec![mon.clone()], osds);
    cluster.cli_ok(&["pool", "create", "rbd", "--pg-count", "16", "--size", "3"]);
    cluster.cli_ok(&["image", "create", "rbd/vol", "--size", "64MiB"]);
    cluster.wait_clean(Duration::from_secs(60));
    let hosts_in_map: Vec<String> = cluster
        .cli_json(&["osd", "ls"])
        .as_array()
        .expect("osds")
        .iter()
        .map(|osd| osd["host"].as_str().expect("host").to_string())
        .collect();
    assert_eq!(hosts_in_map.len(), 3);

    let target = TargetProcess::start(&dir.path, &[]);
    target.rpc_ok(
        "bdev_basalt_create",
        json!({"name": "img", "pool": "rbd", "image": "vol", "mons": [mon]}),
    );
    let port = target.start_nbd();
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "img", "name": "img"}),
    );
    let uri = format!("nbd://127.0.0.1:{port}/img");
    fio_run(&uri, &fio_args("0", &["--do_verify=0"]));

    // Cut off the host that leads the most PGs.
    let leader = cluster.busiest_leader();
    let n = cluster.osd_process(leader);
    let led: Vec<String> = cluster
        .cli_json(&["pg", "ls"])
        .as_array()
        .expect("pgs")
        .iter()
        .filter(|pg| pg["leader"].as_u64() == Some(u64::from(leader)))
        .map(|pg| pg["pg"].as_str().expect("pg").to_string())
        .collect();
    let metrics = format!("{}:9100", hosts.address(n));
    eprintln!("cutting off host{n} (osd.{leader})");
    hosts.cut(n, true);
    std::thread::sleep(Duration::from_millis(500));
    let acknowledged = metric(&metrics, "basalt_osd_writes_total");
    // Asked directly, the cut-off leader serves no read: it cannot confirm its leadership.
    let answer = read_from(&mon, leader, &led);
    let status = answer.map(|message| match message {
        basalt_wire::Message::Reply { status, .. } => format!("{status:?}"),
        other => format!("kind {}", other.kind()),
    });
    assert_ne!(
        status.as_deref(),
        Some("Ok"),
        "the isolated osd served a read"
    );
    let started = Instant::now();
    let report = fio_run(&uri, &fio_args("32M", &[]));
    eprintln!(
        "16 MiB written and verified around the cut in {:?}; longest write {:.2} s",
        started.elapsed(),
        report["jobs"][0]["write"]["clat_ns"]["max"]
            .as_f64()
            .unwrap_or(0.0)
            / 1e9
    );
    assert_eq!(
        metric(&metrics, "basalt_osd_writes_total"),
        acknowledged,
        "the isolated osd acknowledged writes"
    );
    wait_for(
        "the isolated osd to lead nothing",
        Duration::from_secs(20),
        || {
            cluster
                .cli_json(&["pg", "ls"])
                .as_array()
                .expect("pgs")
                .iter()
                .all(|pg| pg["leader"].as_u64() != Some(u64::from(leader)))
        },
    );

    // Healed: the replicas converge and everything written verifies.
    hosts.cut(n, false);
    cluster.wait_clean(Duration::from_secs(60));
    cluster.wait_replicas_equal(Duration::from_secs(60));
    fio_run(&uri, &fio_args("0", &["--verify_only"]));
    fio_run(&uri, &fio_args("32M", &["--verify_only"]));
    drop(target);
    drop(cluster);
}

/// Sends a 4 KiB read of an object of `rbd/vol` in one of the PGs `led` (as `pg ls` names
/// them) straight to `osd`; its answer, or `None` after 3 s.
fn read_from(mon: &str, osd: u32, led: &[String]) -> Option<basalt_wire::Message> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let client = basalt_mon::MonClient::new(vec![mon.parse().expect("mon address")]);
        let map = client.map().await.expect("map");
        let pool = map.pool_by_name("rbd").expect("pool");
        let image = map.image_by_name("rbd", "vol").expect("image");
        let (pg, object) = (0..1024)
            .map(|number| basalt_common::ObjectKey {
                image: image.id,
                number,
            })
            .map(|object| (pool.pg_of(object), object))
            .find(|(pg, _)| led.contains(&pg.to_string()))
            .expect("an object in a pg the osd led");
        let address = map.osds[&basalt_common::OsdId(osd)]
            .address
            .parse()
            .expect("osd address");
        let connection = basalt_wire::tcp::Client::connect(address)
            .await
            .expect("connect");
        let read = basalt_wire::Message::Read {
            pg,
            epoch: map.epoch,
            term: 0,
            object,
            offset_bytes: 0,
            len_bytes: 4096,
        };
        tokio::time::timeout(Duration::from_secs(3), connection.call(&read))
            .await
            .ok()
            .and_then(Result::ok)
    })
}
