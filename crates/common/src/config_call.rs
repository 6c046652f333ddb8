//! One entry of the target's saved configuration: the RPC call that recreates an object.
//!
//! `save_config` writes `{"subsystems":[{"subsystem":"bdev","config":[ConfigCall, ...]}]}`,
//! the shape SPDK's `save_config` writes and `spdk_tgt --json` reads.

use serde::{Deserialize, Serialize};

/// `{"method": "bdev_malloc_create", "params": {...}}`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ConfigCall {
    /// The RPC method.
    pub method: String,
    /// Its parameters.
    #[serde(default)]
    pub params: serde_json::Value,
}

impl ConfigCall {
    /// A call of `method` with `params` serialised.
    pub fn new(method: &str, params: impl Serialize) -> Self {
        let params = serde_json::to_value(params).expect("parameter structs serialise");
        Self {
            method: method.to_string(),
            params,
        }
    }
}
