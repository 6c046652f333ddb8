//! JSON-RPC of `basalt target`: every method's happy path and error cases, rpc.py framing,
//! the `basalt rpc` client, and restart from `save_config`.

mod support;

use std::io::Write;
use std::os::unix::fs::PermissionsExt;
use std::os::unix::net::UnixStream;
use std::process::Command;

use serde_json::{Value, json};
use support::*;

const INVALID_PARAMS: i64 = -32602;
const METHOD_NOT_FOUND: i64 = -32601;
const EXISTS: i64 = -17;
const NO_DEVICE: i64 = -19;
const BUSY: i64 = -16;

#[test]
fn target_methods_and_their_errors() {
    let dir = ScratchDir::new("rpc-methods");
    let target = TargetProcess::start(&dir.path, &[]);

    let methods = target.rpc_ok("rpc_get_methods", Value::Null);
    for method in [
        "bdev_malloc_create",
        "bdev_malloc_delete",
        "bdev_uring_create",
        "bdev_aio_create",
        "bdev_get_bdevs",
        "bdev_get_iostat",
        "nbd_server_start",
        "nbd_server_add_export",
        "nbd_server_remove_export",
        "nbd_get_exports",
        "save_config",
        "basalt_get_version",
    ] {
        assert!(
            methods.as_array().expect("list").contains(&json!(method)),
            "{method} missing from {methods}"
        );
    }
    let version = target.rpc_ok("basalt_get_version", Value::Null);
    assert!(
        version["version"]
            .as_str()
            .is_some_and(|v| v.starts_with("basalt ")),
        "{version}"
    );
    target.rpc_err("no_such_method", Value::Null, METHOD_NOT_FOUND);

    // Malloc bdevs.
    assert_eq!(
        target.rpc_ok(
            "bdev_malloc_create",
            json!({"num_blocks": 1024, "block_size": 4096})
        ),
        json!("Malloc0")
    );
    assert_eq!(
        target.rpc_ok(
            "bdev_malloc_create",
            json!({"name": "m1", "num_blocks": 64, "block_size": 512})
        ),
        json!("m1")
    );
    let message = target.rpc_err(
        "bdev_malloc_create",
        json!({"name": "m1", "num_blocks": 64, "block_size": 512}),
        EXISTS,
    );
    assert!(message.contains("m1"), "{message}");
    let message = target.rpc_err(
        "bdev_malloc_create",
        json!({"num_blocks": 64, "block_size": 513}),
        INVALID_PARAMS,
    );
    assert!(message.contains("block_size"), "{message}");
    let message = target.rpc_err(
        "bdev_malloc_create",
        json!({"block_size": 512}),
        INVALID_PARAMS,
    );
    assert!(message.contains("num_blocks"), "{message}");
    let message = target.rpc_err(
        "bdev_malloc_create",
        json!({"num_blocks": 64, "block_size": 512, "sise": 1}),
        INVALID_PARAMS,
    );
    assert!(message.contains("sise"), "{message}");
    let bdevs = target.rpc_ok("bdev_get_bdevs", Value::Null);
    assert_eq!(bdevs.as_array().map(Vec::len), Some(2), "{bdevs}");
    let m1 = target.rpc_ok("bdev_get_bdevs", json!({"name": "m1"}));
    assert_eq!(
        (m1[0]["num_blocks"].clone(), m1[0]["block_size"].clone()),
        (json!(64), json!(512))
    );
    target.rpc_err("bdev_get_bdevs", json!({"name": "nope"}), NO_DEVICE);
    target.rpc_err("bdev_get_iostat", json!({"name": "nope"}), NO_DEVICE);
    let stats = target.rpc_ok("bdev_get_iostat", json!({"name": "m1"}));
    assert_eq!(stats["bdevs"][0]["num_write_ops"], json!(0));
    assert_eq!(
        target.rpc_ok("bdev_malloc_delete", json!({"name": "m1"})),
        json!(true)
    );
    target.rpc_err("bdev_malloc_delete", json!({"name": "m1"}), NO_DEVICE);

    // File bdevs.
    let file = dir.join("disk.img");
    sparse_file(&file, 8 << 20);
    let created = target.rpc_ok(
        "bdev_uring_create",
        json!({"filename": file, "name": "f0", "block_size": 4096}),
    );
    assert_eq!(created, json!("f0"));
    let f0 = target.rpc_ok("bdev_get_bdevs", json!({"name": "f0"}));
    assert_eq!(f0[0]["num_blocks"], json!(2048));
    let message = target.rpc_err(
        "bdev_aio_create",
        json!({"filename": dir.join("missing.img"), "name": "f1"}),
        INVALID_PARAMS,
    );
    assert!(message.contains("missing.img"), "{message}");
    let message = target.rpc_err("bdev_malloc_delete", json!({"name": "f0"}), INVALID_PARAMS);
    assert!(message.contains("file bdev"), "{message}");
    // A rescan takes on a grown file; a shrunk one is refused and changes nothing.
    sparse_file(&file, 12 << 20);
    assert_eq!(
        target.rpc_ok("bdev_uring_rescan", json!({"name": "f0"})),
        json!(true)
    );
    let f0 = target.rpc_ok("bdev_get_bdevs", json!({"name": "f0"}));
    assert_eq!(f0[0]["num_blocks"], json!(3072));
    sparse_file(&file, 8 << 20);
    let message = target.rpc_err("bdev_aio_rescan", json!({"name": "f0"}), INVALID_PARAMS);
    assert!(message.contains("only grows"), "{message}");
    // A file gone from under the bdev: the target's trouble, not the caller's.
    std::fs::remove_file(&file).expect("remove");
    let message = target.rpc_err("bdev_uring_rescan", json!({"name": "f0"}), -32603);
    assert!(message.contains("No such file"), "{message}");
    sparse_file(&file, 12 << 20);
    target.rpc_err("bdev_uring_rescan", json!({"name": "nope"}), NO_DEVICE);
    let message = target.rpc_err(
        "bdev_uring_rescan",
        json!({"name": "Malloc0"}),
        INVALID_PARAMS,
    );
    assert!(message.contains("malloc bdev"), "{message}");

    // NBD server and exports.
    let port = target.start_nbd();
    assert!(port > 0);
    target.rpc_err("nbd_server_start", json!({"port": 0}), EXISTS);
    assert_eq!(
        target.rpc_ok("nbd_server_add_export", json!({"bdev_name": "f0"})),
        json!("f0")
    );
    assert_eq!(
        target.rpc_ok(
            "nbd_server_add_export",
            json!({"bdev_name": "Malloc0", "name": "ro", "readonly": true})
        ),
        json!("ro")
    );
    target.rpc_err(
        "nbd_server_add_export",
        json!({"bdev_name": "Malloc0", "name": "ro"}),
        EXISTS,
    );
    target.rpc_err(
        "nbd_server_add_export",
        json!({"bdev_name": "nope"}),
        NO_DEVICE,
    );
    target.rpc_err(
        "nbd_server_add_export",
        json!({"name": "x"}),
        INVALID_PARAMS,
    );
    let exports = target.rpc_ok("nbd_get_exports", Value::Null);
    assert_eq!(exports.as_array().map(Vec::len), Some(2), "{exports}");
    let message = target.rpc_err("bdev_uring_delete", json!({"name": "f0"}), BUSY);
    assert!(message.contains("nbd export"), "{message}");
    let claimed = target.rpc_ok("bdev_get_bdevs", json!({"name": "f0"}));
    assert_eq!(claimed[0]["claimed"], json!(true));
    assert_eq!(
        target.rpc_ok("nbd_server_remove_export", json!({"name": "f0"})),
        json!(true)
    );
    target.rpc_err("nbd_server_remove_export", json!({"name": "f0"}), NO_DEVICE);
    assert_eq!(
        target.rpc_ok("bdev_uring_delete", json!({"name": "f0"})),
        json!(true)
    );
    assert_eq!(target.rpc_ok("nbd_server_stop", Value::Null), json!(true));
    target.rpc_err("nbd_server_stop", Value::Null, INVALID_PARAMS);
    target.stop();
}

#[test]
fn socket_is_private_and_speaks_rpc_py_framing() {
    let dir = ScratchDir::new("rpc-framing");
    let target = TargetProcess::start(&dir.path, &[]);
    let mode = std::fs::metadata(&target.socket)
        .expect("socket")
        .permissions()
        .mode()
        & 0o777;
    assert_eq!(mode, 0o600, "socket mode {mode:o}");

    // Two requests back to back in one write, and a third split across two writes.
    let mut stream = UnixStream::connect(&target.socket).expect("connect");
    let first = json!({"jsonrpc": "2.0", "id": 1, "method": "bdev_malloc_create", "params": {"num_blocks": 8, "block_size": 512, "name": "a"}});
    let second = json!({"jsonrpc": "2.0", "id": 2, "method": "bdev_get_bdevs"});
    stream
        .write_all(format!("{first}{second}").as_bytes())
        .expect("send");
    let third =
        json!({"jsonrpc": "2.0", "id": 3, "method": "bdev_get_bdevs", "params": {"name": "a"}})
            .to_string();
    let (head, tail) = third.split_at(third.len() / 2);
    stream.write_all(head.as_bytes()).expect("send head");
    stream.flush().expect("flush");
    std::thread::sleep(std::time::Duration::from_millis(50));
    stream.write_all(tail.as_bytes()).expect("send tail");
    let responses = read_responses(&mut stream, 3);
    assert_eq!(
        responses[0],
        json!({"jsonrpc": "2.0", "id": 1, "result": "a"})
    );
    assert_eq!(responses[1]["id"], json!(2));
    assert_eq!(responses[2]["result"][0]["name"], json!("a"));

    // A request without "jsonrpc": "2.0" is refused; bad JSON gets a parse error.
    stream
        .write_all(br#"{"id": 4, "method": "bdev_get_bdevs"}"#)
        .expect("send");
    let refused = read_responses(&mut stream, 1).remove(0);
    assert_eq!(refused["error"]["code"], json!(-32600), "{refused}");
    let mut bad = UnixStream::connect(&target.socket).expect("connect");
    bad.write_all(b"{\"jsonrpc\": nope}").expect("send");
    let parse_error = read_responses(&mut bad, 1).remove(0);
    assert_eq!(parse_error["error"]["code"], json!(-32700), "{parse_error}");

    // The target is unharmed.
    assert_eq!(
        target.rpc_ok("bdev_get_bdevs", json!({"name": "a"}))[0]["name"],
        json!("a")
    );
}

#[test]
fn rpc_client_prints_results_and_fails_on_errors() {
    let dir = ScratchDir::new("rpc-client");
    let target = TargetProcess::start(&dir.path, &[]);
    let socket = target.socket.to_str().expect("utf8 path").to_string();
    let out = run_ok(basalt().args([
        "rpc",
        "-s",
        &socket,
        "bdev_malloc_create",
        r#"{"num_blocks": 16, "block_size": 512, "name": "c"}"#,
    ]));
    assert_eq!(
        serde_json::from_str::<Value>(&out).expect("json"),
        json!("c")
    );
    let out = run_ok(basalt().args(["rpc", "-s", &socket, "bdev_get_bdevs"]));
    let listed: Value = serde_json::from_str(&out).expect("json");
    assert_eq!(listed[0]["name"], json!("c"));
    let failed = run(basalt().args([
        "rpc",
        "-s",
        &socket,
        "bdev_malloc_delete",
        r#"{"name": "zz"}"#,
    ]));
    assert!(!failed.status.success());
    assert!(
        String::from_utf8_lossy(&failed.stderr).contains("\"zz\" not found"),
        "{failed:?}"
    );
    let bad_json = run(basalt().args(["rpc", "-s", &socket, "bdev_get_bdevs", "{name"]));
    assert!(!bad_json.status.success());
    let no_target = run(basalt().args(["rpc", "-s", "/nonexistent.sock", "bdev_get_bdevs"]));
    assert!(!no_target.status.success());
    assert!(
        String::from_utf8_lossy(&no_target.stderr).contains("/nonexistent.sock"),
        "{no_target:?}"
    );
}

/// Data written through NBD to a file bdev is there after the target restarts from the
/// configuration `save_config` returned, with the same bdevs, uuids and exports.
#[test]
fn restart_from_saved_config_keeps_bdevs_exports_and_data() {
    require("qemu-io");
    let dir = ScratchDir::new("rpc-restart");
    let file = dir.join("disk.img");
    sparse_file(&file, 16 << 20);
    let target = TargetProcess::start(&dir.path, &[]);
    target.rpc_ok(
        "bdev_uring_create",
        json!({"filename": file, "name": "disk", "block_size": 4096}),
    );
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"num_blocks": 32, "block_size": 512, "name": "ram"}),
    );
    let port = target.start_nbd();
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "disk", "name": "vol"}),
    );
    target.rpc_ok(
        "nbd_server_add_export",
        json!({"bdev_name": "ram", "readonly": true}),
    );
    let uri = format!("nbd://127.0.0.1:{port}/vol");
    qemu_io_ok(&uri, false, &["write -P 0x5a 1M 3M", "flush"]);
    let nqn = "nqn.2016-06.io.basalt:saved";
    target.rpc_ok(
        "nvmf_create_transport",
        json!({"trtype": "TCP", "in_capsule_data_size": 8192}),
    );
    target.rpc_ok(
        "nvmf_create_subsystem",
        json!({"nqn": nqn, "serial_number": "SAVED1"}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_host",
        json!({"nqn": nqn, "host": "nqn.2016-06.io.basalt:host1"}),
    );
    target.rpc_ok(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "namespace": {"bdev_name": "disk", "nsid": 3}}),
    );
    let nvmf_port = free_port().to_string();
    target.rpc_ok(
        "nvmf_subsystem_add_listener",
        json!({"nqn": nqn, "listen_address": {"trtype": "TCP", "traddr": "127.0.0.1", "trsvcid": nvmf_port}}),
    );
    let subsystems = target.rpc_ok("nvmf_get_subsystems", Value::Null);
    let config = target.rpc_ok("save_config", Value::Null);
    let before = target.rpc_ok("bdev_get_bdevs", Value::Null);
    let config_path = dir.join("config.json");
    std::fs::write(
        &config_path,
        serde_json::to_vec_pretty(&config).expect("json"),
    )
    .expect("write config");
    target.stop();

    let target = TargetProcess::start(
        &dir.path,
        &["--config", config_path.to_str().expect("utf8")],
    );
    let after = target.rpc_ok("bdev_get_bdevs", Value::Null);
    for field in ["name", "uuid", "num_blocks", "block_size"] {
        let pick = |list: &Value| {
            list.as_array()
                .expect("list")
                .iter()
                .map(|b| b[field].clone())
                .collect::<Vec<_>>()
        };
        assert_eq!(pick(&before), pick(&after), "{field}");
    }
    let exports = target.rpc_ok("nbd_get_exports", Value::Null);
    let names: Vec<&str> = exports
        .as_array()
        .expect("list")
        .iter()
        .filter_map(|e| e["name"].as_str())
        .collect();
    assert_eq!(names, ["ram", "vol"]);
    assert_eq!(
        target.rpc_ok("nvmf_get_subsystems", Value::Null),
        subsystems,
        "the same subsystems, namespaces (uuids included), hosts and listeners"
    );
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", nvmf_port.parse::<u16>().expect("port")))
            .is_ok(),
        "the listener is back"
    );
    assert_eq!(
        target.rpc_ok("save_config", Value::Null),
        config,
        "a restarted target saves the same config"
    );
    qemu_io_ok(&uri, true, &["read -P 0x5a 1M 3M", "read -P 0 0 1M"]);
    let out = run(Command::new("qemu-io").args(["-f", "raw", &uri, "-c", "read -P 0x5b 1M 4k"]));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("Pattern verification failed"),
        "the check can fail"
    );
}

#[test]
fn bad_config_files_are_refused_with_the_file_named() {
    let dir = ScratchDir::new("rpc-bad-config");
    let cases = [
        ("garbage.json", "{not json".to_string(), "not a target configuration"),
        ("subsystem.json", json!({"subsystems": [{"subsystem": "warp", "config": []}]}).to_string(), "unknown subsystem"),
        (
            "call.json",
            json!({"subsystems": [{"subsystem": "bdev", "config": [{"method": "bdev_malloc_create", "params": {"num_blocks": 0, "block_size": 512}}]}]}).to_string(),
            "num_blocks",
        ),
    ];
    for (name, text, expected) in cases {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write");
        let output = run(basalt()
            .arg("target")
            .arg("-r")
            .arg(dir.join("s.sock"))
            .arg("--config")
            .arg(&path));
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(!output.status.success(), "{name}");
        assert!(
            stderr.contains(name) && stderr.contains(expected),
            "{name}: {stderr}"
        );
    }
}

/// The nvmf_* methods refuse bad parameters with an error naming them.
#[test]
fn nvmf_methods_name_what_is_wrong() {
    let dir = ScratchDir::new("rpc-nvmf");
    let target = TargetProcess::start(&dir.path, &[]);
    let nqn = "nqn.2016-06.io.basalt:rpc";
    let listen = |port: &str| json!({"nqn": nqn, "listen_address": {"trtype": "TCP", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": port}});
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"num_blocks": 64, "block_size": 512, "name": "m0"}),
    );
    target.rpc_ok("nvmf_create_subsystem", json!({"nqn": nqn}));
    let message = target.rpc_err("nvmf_subsystem_add_listener", listen("0"), INVALID_PARAMS);
    assert!(message.contains("nvmf_create_transport"), "{message}");
    let message = target.rpc_err(
        "nvmf_create_transport",
        json!({"trtype": "TCP", "max_io_size": 100000}),
        INVALID_PARAMS,
    );
    assert!(message.contains("max_io_size"), "{message}");
    let message = target.rpc_err(
        "nvmf_create_transport",
        json!({"trtype": "RDMA"}),
        INVALID_PARAMS,
    );
    assert!(message.contains("trtype"), "{message}");
    let message = target.rpc_err(
        "nvmf_create_transport",
        json!({"trtype": "TCP", "max_queue_dept": 64}),
        INVALID_PARAMS,
    );
    assert!(message.contains("max_queue_dept"), "{message}");
    target.rpc_ok(
        "nvmf_create_transport",
        json!({"trtype": "TCP", "max_queue_depth": 64}),
    );
    target.rpc_err("nvmf_create_transport", json!({"trtype": "TCP"}), EXISTS);
    let transports = target.rpc_ok("nvmf_get_transports", Value::Null);
    assert_eq!(transports[0]["max_queue_depth"], json!(64), "{transports}");

    let message = target.rpc_err(
        "nvmf_create_subsystem",
        json!({"nqn": "nqn.2016-6.x:y"}),
        INVALID_PARAMS,
    );
    assert!(message.contains("yyyy-mm"), "{message}");
    let message = target.rpc_err(
        "nvmf_create_subsystem",
        json!({"nqn": "nqn.2016-06.io.basalt:b", "serial_number": "x".repeat(21)}),
        INVALID_PARAMS,
    );
    assert!(message.contains("serial_number"), "{message}");
    target.rpc_err("nvmf_create_subsystem", json!({"nqn": nqn}), EXISTS);
    target.rpc_err(
        "nvmf_create_subsystem",
        json!({"nqn": "nqn.2014-08.org.nvmexpress.discovery"}),
        EXISTS,
    );
    let missing = json!({"nqn": "nqn.2016-06.io.basalt:none", "namespace": {"bdev_name": "m0"}});
    target.rpc_err("nvmf_subsystem_add_ns", missing, NO_DEVICE);
    target.rpc_err(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "namespace": {"bdev_name": "nope"}}),
        NO_DEVICE,
    );
    let message = target.rpc_err(
        "nvmf_subsystem_add_ns",
        json!({"nqn": nqn, "namespace": {"bdev_name": "m0", "nsid": 33}}),
        INVALID_PARAMS,
    );
    assert!(message.contains("nsid"), "{message}");
    assert_eq!(
        target.rpc_ok(
            "nvmf_subsystem_add_ns",
            json!({"nqn": nqn, "namespace": {"bdev_name": "m0"}})
        ),
        json!(1)
    );
    let message = target.rpc_err("bdev_malloc_delete", json!({"name": "m0"}), BUSY);
    assert!(
        message.contains("nvmf"),
        "an exported bdev cannot be deleted: {message}"
    );
    target.rpc_err(
        "nvmf_subsystem_remove_ns",
        json!({"nqn": nqn, "nsid": 9}),
        NO_DEVICE,
    );
    let message = target.rpc_err(
        "nvmf_subsystem_add_listener",
        listen("http"),
        INVALID_PARAMS,
    );
    assert!(message.contains("trsvcid"), "{message}");
    let message = target.rpc_err(
        "nvmf_subsystem_add_host",
        json!({"nqn": nqn, "host": "host1"}),
        INVALID_PARAMS,
    );
    assert!(message.contains("host"), "{message}");
    target.rpc_ok("nvmf_delete_subsystem", json!({"nqn": nqn}));
    target.rpc_ok("bdev_malloc_delete", json!({"name": "m0"}));
    target.rpc_err("nvmf_delete_subsystem", json!({"nqn": nqn}), NO_DEVICE);
}

/// Without `--reactor-placement`, a controller's queue pairs go round robin over the
/// reactors (as the issue and SPDK's target have it), not all to the reactor of the CPU
/// the host's packets arrive on.
#[test]
fn queue_pairs_go_round_robin_over_the_reactors_by_default() {
    let dir = ScratchDir::new("rpc-placement");
    let target = TargetProcess::start(&dir.path, &["-m", "2"]);
    let nqn = "nqn.2016-06.io.basalt:placement";
    target.rpc_ok(
        "bdev_malloc_create",
        json!({"num_blocks": 256, "block_size": 512, "name": "m0"}),
    );
    let port = target.start_nvmf(nqn, "m0");
    let options = basalt_nvmf::host::HostOptions {
        io_queues: 3,
        ..basalt_nvmf::host::HostOptions::default()
    };
    let (_runtime, host) = nvmf_host(port, nqn, options);
    let qpairs = target.rpc_ok("nvmf_subsystem_get_qpairs", json!({"nqn": nqn}));
    let threads: Vec<&str> = qpairs
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|qpair| qpair["thread"].as_str())
        .collect();
    assert_eq!(threads.len(), 4, "admin and 3 I/O queues: {qpairs}");
    assert!(
        threads.windows(2).all(|pair| pair[0] != pair[1]),
        "consecutive queue pairs alternate between the 2 reactors: {qpairs}"
    );
    drop(host);
    target.stop();
}
