//! The target's state and JSON-RPC dispatch.

use std::sync::Arc;

use basalt_bdev::BdevRegistry;
use basalt_common::RpcError;
use basalt_io::{Placement, Reactors};
use basalt_nbd::NbdServer;
use basalt_nvmf::NvmfTarget;
use basalt_vhost::VhostServer;
use serde_json::{Value, json};

use crate::config;

/// Methods the target itself answers (the rest belong to subsystems).
const OWN_METHODS: &[&str] = &[
    "rpc_get_methods",
    "save_config",
    "basalt_get_version",
    "spdk_get_version",
];

/// A running target: its bdevs and frontends.
pub struct Target {
    /// Every bdev.
    pub bdevs: BdevRegistry,
    /// The NBD frontend.
    pub nbd: Arc<NbdServer>,
    /// The NVMe/TCP frontend.
    pub nvmf: Arc<NvmfTarget>,
    /// The vhost-user-blk frontend.
    pub vhost: Arc<VhostServer>,
    /// The threads that serve frontend connections.
    pub reactors: Arc<Reactors>,
}

impl Target {
    /// A target with no bdevs and no frontend listening, serving connections on
    /// `reactor_count` reactor threads that new connections reach by `placement`, with
    /// its vhost-user sockets in `vhost_socket_dir`.
    pub fn new(
        reactor_count: usize,
        placement: Placement,
        vhost_socket_dir: std::path::PathBuf,
    ) -> std::io::Result<Arc<Self>> {
        let reactors = Arc::new(Reactors::start_with(reactor_count, "reactor", placement)?);
        let nbd = NbdServer::new(reactors.clone());
        let nvmf = NvmfTarget::new(reactors.clone());
        let vhost = Arc::new(VhostServer::new(reactors.clone(), vhost_socket_dir));
        Ok(Arc::new(Self {
            bdevs: BdevRegistry::new(),
            nbd,
            nvmf,
            vhost,
            reactors,
        }))
    }

    /// Every method name, sorted.
    pub fn methods() -> Vec<&'static str> {
        let mut methods: Vec<&'static str> = OWN_METHODS
            .iter()
            .chain(basalt_bdev::rpc::METHODS)
            .chain(basalt_nbd::rpc::METHODS)
            .chain(basalt_nvmf::rpc::METHODS)
            .chain(basalt_vhost::rpc::METHODS)
            .copied()
            .collect();
        methods.sort_unstable();
        methods
    }

    /// Runs one JSON-RPC method.
    pub async fn call(&self, method: &str, params: Value) -> Result<Value, RpcError> {
        match method {
            "rpc_get_methods" => Ok(json!(Self::methods())),
            "save_config" => {
                Ok(serde_json::to_value(config::save(self)).expect("config serialises"))
            }
            "basalt_get_version" | "spdk_get_version" => Ok(json!({
                "version": format!("basalt {}", env!("CARGO_PKG_VERSION")),
                "fields": {"major": 0, "minor": 1, "patch": 0, "suffix": ""},
            })),
            _ => {
                if let Some(result) = basalt_bdev::rpc::call(&self.bdevs, method, params.clone()) {
                    return result;
                }
                if let Some(result) =
                    basalt_bdev::rpc::call_async(&self.bdevs, method, params.clone()).await
                {
                    return result;
                }
                if let Some(result) =
                    basalt_nbd::rpc::call(&self.nbd, &self.bdevs, method, params.clone()).await
                {
                    return result;
                }
                if let Some(result) =
                    basalt_nvmf::rpc::call(&self.nvmf, &self.bdevs, method, params.clone()).await
                {
                    return result;
                }
                if let Some(result) =
                    basalt_vhost::rpc::call(&self.vhost, &self.bdevs, method, params)
                {
                    return result;
                }
                Err(RpcError::method_not_found(method))
            }
        }
    }
}
