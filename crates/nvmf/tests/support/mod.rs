//! The fixture shared by the NVMe/TCP target's tests: a target with one subsystem over a
//! malloc bdev on a free loopback port, its RPCs, and a write-then-read check.
#![allow(dead_code)]

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use basalt_bdev::BdevRegistry;
use basalt_io::Reactors;
use basalt_nvmf::NvmfTarget;
use basalt_nvmf::host::Host;
use serde_json::{Value, json};

pub const NQN: &str = "nqn.2016-06.io.basalt:test";
pub const BLOCK: u32 = 512;
pub const BLOCKS: u64 = 16384; // 8 MiB

pub struct Fixture {
    pub target: Arc<NvmfTarget>,
    pub registry: BdevRegistry,
    pub address: SocketAddr,
    pub reactors: Arc<Reactors>,
}

pub async fn rpc(
    fixture: &Fixture,
    method: &str,
    params: Value,
) -> Result<Value, basalt_common::RpcError> {
    basalt_nvmf::rpc::call(&fixture.target, &fixture.registry, method, params)
        .await
        .expect("an nvmf method")
}

pub fn add_malloc(registry: &BdevRegistry, name: &str) {
    let params = json!({"name": name, "num_blocks": BLOCKS, "block_size": BLOCK});
    basalt_bdev::rpc::call(registry, "bdev_malloc_create", params)
        .expect("a bdev method")
        .expect("malloc bdev");
}

/// A target with one subsystem (allow any host) exporting an 8 MiB malloc bdev on a free
/// loopback port.
pub async fn fixture(transport: Value) -> Fixture {
    fixture_on(
        Reactors::start(1, "test-reactor").expect("reactors"),
        transport,
    )
    .await
}

pub async fn fixture_on(reactors: Reactors, transport: Value) -> Fixture {
    let reactors = Arc::new(reactors);
    let target = NvmfTarget::new(reactors.clone());
    let registry = BdevRegistry::new();
    add_malloc(&registry, "Malloc0");
    let mut fixture = Fixture {
        target,
        registry,
        address: "127.0.0.1:0".parse().expect("address"),
        reactors,
    };
    rpc(&fixture, "nvmf_create_transport", transport)
        .await
        .expect("transport");
    rpc(
        &fixture,
        "nvmf_create_subsystem",
        json!({"nqn": NQN, "allow_any_host": true, "serial_number": "BASALT0001"}),
    )
    .await
    .expect("subsystem");
    assert_eq!(add_namespace(&fixture, "Malloc0").await, json!(1));
    rpc(
        &fixture,
        "nvmf_subsystem_add_listener",
        json!({"nqn": NQN, "listen_address": {"trtype": "tcp", "adrfam": "IPv4", "traddr": "127.0.0.1", "trsvcid": "0"}}),
    )
    .await
    .expect("listener");
    let subsystems = rpc(&fixture, "nvmf_get_subsystems", json!({"nqn": NQN}))
        .await
        .expect("get");
    let port: u16 = subsystems[0]["listen_addresses"][0]["trsvcid"]
        .as_str()
        .expect("trsvcid")
        .parse()
        .expect("port");
    fixture.address = SocketAddr::from(([127, 0, 0, 1], port));
    fixture
}

pub fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

pub async fn read_write_cycle(host: &Host, queue: usize, lba: u64, len: usize, seed: u8) {
    let data = pattern(seed, len);
    host.write(queue, 1, lba, data.clone(), BLOCK, false)
        .await
        .expect("write");
    let back = host
        .read(queue, 1, lba, (len / BLOCK as usize) as u32, BLOCK)
        .await
        .expect("read");
    assert_eq!(back, data, "lba {lba}, {len} bytes");
}

/// Puts `bdev` (one a test built) in the fixture's registry.
pub fn register_bdev(fixture: &Fixture, bdev: Box<dyn basalt_bdev::Bdev>) {
    let construct = basalt_common::ConfigCall {
        method: "test".to_string(),
        params: json!({}),
    };
    fixture
        .registry
        .insert(bdev, basalt_bdev::registry::BdevKind::Malloc, construct)
        .expect("insert");
}

/// A malloc bdev `Gated0` whose `held` operations wait behind a gate, exported as
/// namespace 2 of [`NQN`]; the gate.
pub async fn gated_namespace(
    fixture: &Fixture,
    held: basalt_bdev::gated::Held,
) -> basalt_bdev::gated::GateHandle {
    let malloc = basalt_bdev::malloc::MallocBdev::new_named("Gated0", BLOCK, BLOCKS);
    let gated = basalt_bdev::gated::Gated::new(Box::new(malloc), held);
    let gate = gated.handle();
    register_bdev(fixture, Box::new(gated));
    assert_eq!(add_namespace(fixture, "Gated0").await, json!(2));
    gate
}

/// The controllers of [`NQN`], as `nvmf_subsystem_get_controllers` lists them.
pub async fn controllers(fixture: &Fixture) -> Value {
    rpc(
        fixture,
        "nvmf_subsystem_get_controllers",
        json!({"nqn": NQN}),
    )
    .await
    .expect("controllers")
}

/// Exports bdev `name` as the next namespace of [`NQN`]; its nsid.
pub async fn add_namespace(fixture: &Fixture, name: &str) -> Value {
    rpc(
        fixture,
        "nvmf_subsystem_add_ns",
        json!({"nqn": NQN, "namespace": {"bdev_name": name}}),
    )
    .await
    .expect("namespace")
}

/// Waits until `ready` holds, checking every 5 ms; fails after `timeout`, saying `what`.
pub async fn wait_until(what: &str, timeout: Duration, mut ready: impl FnMut() -> bool) {
    let started = std::time::Instant::now();
    while !ready() {
        assert!(started.elapsed() < timeout, "{what}");
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}
