//! The `nbd_*` JSON-RPC methods.
//!
//! `nbd_server_start` `{"listen_address": "127.0.0.1", "port": 10809, "max_connections":
//! 1024, "stall_timeout_s": 60}` (all optional),
//! `nbd_server_stop`, `nbd_server_add_export` `{"bdev_name", "name", "readonly",
//! "description"}`, `nbd_server_remove_export` `{"name"}`, `nbd_get_exports`.

use std::sync::Arc;

use basalt_bdev::BdevRegistry;
use basalt_common::{ConfigCall, RpcError};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::client::DEFAULT_PORT;
use crate::protocol::EXPORT_NAME_SIZE_MAX;
use crate::server::{Export, Limits, NbdServer};

/// The methods this module answers.
pub const METHODS: &[&str] = &[
    "nbd_server_start",
    "nbd_server_stop",
    "nbd_server_add_export",
    "nbd_server_remove_export",
    "nbd_get_exports",
];

/// Runs `method` if it is an NBD method; `None` if it is not one of ours.
pub async fn call(
    server: &Arc<NbdServer>,
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Option<Result<Value, RpcError>> {
    if !METHODS.contains(&method) {
        return None;
    }
    Some(dispatch(server, registry, method, params).await)
}

async fn dispatch(
    server: &Arc<NbdServer>,
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Result<Value, RpcError> {
    match method {
        "nbd_server_start" => start(server, RpcError::parse_params(method, params)?).await,
        "nbd_server_stop" => {
            RpcError::parse_params::<Empty>(method, params)?;
            if server.stop() {
                Ok(json!(true))
            } else {
                Err(RpcError::invalid_params("the nbd server is not running"))
            }
        }
        "nbd_server_add_export" => {
            add_export(server, registry, RpcError::parse_params(method, params)?)
        }
        "nbd_server_remove_export" => {
            remove_export(server, registry, RpcError::parse_params(method, params)?)
        }
        "nbd_get_exports" => {
            RpcError::parse_params::<Empty>(method, params)?;
            Ok(get_exports(server))
        }
        _ => Err(RpcError::method_not_found(method)),
    }
}

/// No parameters.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

/// Parameters of `nbd_server_start`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StartParams {
    /// Address to listen on.
    #[serde(default = "default_listen_address")]
    pub listen_address: String,
    /// Port (0: any free port).
    #[serde(default = "default_port")]
    pub port: u16,
    /// Connections open at once at most (1,024 by default).
    #[serde(default = "default_max_connections")]
    pub max_connections: usize,
    /// Seconds a client may leave every reply waiting for it unread before its connection
    /// is closed (60 by default; 0: never).
    #[serde(default = "default_stall_timeout_s")]
    pub stall_timeout_s: u64,
}

fn default_max_connections() -> usize {
    Limits::DEFAULT.max_connections
}

fn default_stall_timeout_s() -> u64 {
    Limits::DEFAULT.stall_timeout_s()
}

fn default_listen_address() -> String {
    "127.0.0.1".to_string()
}

fn default_port() -> u16 {
    DEFAULT_PORT
}

async fn start(server: &Arc<NbdServer>, params: StartParams) -> Result<Value, RpcError> {
    if let Some(address) = server.address() {
        return Err(RpcError::exists(format!(
            "the nbd server is already listening on {address}"
        )));
    }
    if params.max_connections == 0 {
        return Err(RpcError::invalid_params(
            "max_connections 0 is not allowed: at least 1",
        ));
    }
    let limits = Limits {
        max_connections: params.max_connections,
        stall_timeout: (params.stall_timeout_s > 0)
            .then(|| std::time::Duration::from_secs(params.stall_timeout_s)),
    };
    let address = server
        .start_with(&params.listen_address, params.port, limits)
        .await
        .map_err(|error| {
            RpcError::invalid_params(format!(
                "listen_address {}, port {}: {error}",
                params.listen_address, params.port
            ))
        })?;
    Ok(json!({"listen_address": address.ip().to_string(), "port": address.port()}))
}

/// Parameters of `nbd_server_add_export`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddExportParams {
    /// The bdev to export.
    pub bdev_name: String,
    /// Export name (default: the bdev's name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Refuse writes.
    #[serde(default)]
    pub readonly: bool,
    /// Text sent with NBD_INFO_DESCRIPTION.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub description: Option<String>,
}

fn claim_owner(export: &str) -> String {
    format!("nbd export {export:?}")
}

fn add_export(
    server: &NbdServer,
    registry: &BdevRegistry,
    params: AddExportParams,
) -> Result<Value, RpcError> {
    let name = params
        .name
        .clone()
        .unwrap_or_else(|| params.bdev_name.clone());
    if name.is_empty() || name.len() > EXPORT_NAME_SIZE_MAX {
        return Err(RpcError::invalid_params(format!(
            "name must be 1 to {EXPORT_NAME_SIZE_MAX} bytes"
        )));
    }
    if server
        .exports()
        .find(&name)
        .is_some_and(|export| export.name == name)
    {
        return Err(RpcError::exists(format!(
            "nbd export name {name:?} is already in use"
        )));
    }
    let bdev = registry.claim(&params.bdev_name, &claim_owner(&name))?;
    let export = Export::new(
        name.clone(),
        params.bdev_name.clone(),
        bdev,
        params.readonly,
        params.description,
    );
    if !server.exports().insert(Arc::new(export)) {
        registry.release(&params.bdev_name, &claim_owner(&name));
        return Err(RpcError::exists(format!(
            "nbd export name {name:?} is already in use"
        )));
    }
    Ok(json!(name))
}

/// Parameters of `nbd_server_remove_export`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RemoveExportParams {
    /// Export name.
    pub name: String,
}

fn remove_export(
    server: &NbdServer,
    registry: &BdevRegistry,
    params: RemoveExportParams,
) -> Result<Value, RpcError> {
    let export = server
        .exports()
        .remove(&params.name)
        .ok_or_else(|| RpcError::no_device(format!("nbd export {:?} not found", params.name)))?;
    registry.release(&export.bdev_name, &claim_owner(&export.name));
    Ok(json!(true))
}

fn get_exports(server: &NbdServer) -> Value {
    let exports: Vec<Value> = server
        .exports()
        .list()
        .iter()
        .map(|export| {
            json!({
                "name": export.name,
                "bdev_name": export.bdev_name,
                "readonly": export.readonly,
                "size_bytes": export.size_bytes(),
                "connections": export.connection_count(),
            })
        })
        .collect();
    Value::Array(exports)
}

/// The calls that recreate the server and its exports, for `save_config`.
pub fn config(server: &NbdServer) -> Vec<ConfigCall> {
    let mut calls = Vec::new();
    if let Some(address) = server.address() {
        let limits = server.limits();
        let params = StartParams {
            listen_address: address.ip().to_string(),
            port: address.port(),
            max_connections: limits.max_connections,
            stall_timeout_s: limits.stall_timeout_s(),
        };
        calls.push(ConfigCall::new("nbd_server_start", params));
    }
    for export in server.exports().list() {
        let params = AddExportParams {
            bdev_name: export.bdev_name.clone(),
            name: Some(export.name.clone()),
            readonly: export.readonly,
            description: export.configured_description().map(str::to_string),
        };
        calls.push(ConfigCall::new("nbd_server_add_export", params));
    }
    calls
}
