//! The `vhost_*` JSON-RPC methods, SPDK's names: `vhost_create_blk_controller` `{"ctrlr",
//! "dev_name", "readonly", "packed_ring", "max_queues", "cpumask"}`, `vhost_delete_controller`
//! `{"ctrlr"}`, `vhost_get_controllers` `{"name"}`.

use basalt_bdev::BdevRegistry;
use basalt_common::{ConfigCall, RpcError};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::backend::BlkOptions;
use crate::controller::{ControllerError, VhostServer};

/// The methods this module answers.
pub const METHODS: &[&str] = &[
    "vhost_create_blk_controller",
    "vhost_delete_controller",
    "vhost_get_controllers",
];

/// Request queues a controller offers unless told otherwise.
pub const DEFAULT_MAX_QUEUES: u16 = 4;
/// Most request queues a controller offers.
pub const MAX_QUEUES_MAX: u16 = 64;

/// Parameters of `vhost_create_blk_controller`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateParams {
    /// Controller name: the socket's file name.
    pub ctrlr: String,
    /// The bdev.
    pub dev_name: String,
    /// Refuse writes.
    #[serde(default)]
    pub readonly: bool,
    /// Packed virtqueues (not supported: must be false).
    #[serde(default)]
    pub packed_ring: bool,
    /// Request queues offered; QEMU's `num-queues` must not exceed it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queues: Option<u16>,
    /// The CPUs whose reactors run its requests (SPDK's forms: `0x3`, `[0,2-3]`); every
    /// reactor when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub cpumask: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct DeleteParams {
    ctrlr: String,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct GetParams {
    #[serde(default)]
    name: Option<String>,
}

fn claim_owner(name: &str) -> String {
    format!("vhost controller {name}")
}

fn rpc_error(error: ControllerError) -> RpcError {
    match &error {
        ControllerError::Exists(_) => RpcError::exists(error.to_string()),
        ControllerError::NotFound(_) => RpcError::no_device(error.to_string()),
        ControllerError::Busy(_) => RpcError::busy(error.to_string()),
        ControllerError::Invalid(_) => RpcError::invalid_params(error.to_string()),
        ControllerError::Io { .. } => RpcError::internal(error.to_string()),
    }
}

/// Runs `method` if it is a vhost method; `None` if it is not one of ours.
pub fn call(
    server: &VhostServer,
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Option<Result<Value, RpcError>> {
    if !METHODS.contains(&method) {
        return None;
    }
    Some(dispatch(server, registry, method, params))
}

fn dispatch(
    server: &VhostServer,
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Result<Value, RpcError> {
    match method {
        "vhost_create_blk_controller" => {
            let params: CreateParams = RpcError::parse_params(method, params)?;
            if params.packed_ring {
                return Err(RpcError::invalid_params(
                    "packed_ring: packed virtqueues are not supported",
                ));
            }
            let queues = params.max_queues.unwrap_or(DEFAULT_MAX_QUEUES);
            if !(1..=MAX_QUEUES_MAX).contains(&queues) {
                return Err(RpcError::invalid_params(format!(
                    "max_queues {queues} must be from 1 to {MAX_QUEUES_MAX}"
                )));
            }
            let reactors = match &params.cpumask {
                Some(mask) => server.reactors_for_cpumask(mask).map_err(rpc_error)?,
                None => Vec::new(),
            };
            let owner = claim_owner(&params.ctrlr);
            let bdev = registry.claim(&params.dev_name, &owner)?;
            let serial = bdev.info().uuid.replace('-', "");
            let options = BlkOptions {
                bdev,
                readonly: params.readonly,
                queues,
                serial,
                reactors,
            };
            match server.create(
                &params.ctrlr,
                &params.dev_name,
                params.cpumask.clone(),
                options,
            ) {
                Ok(_) => Ok(json!(true)),
                Err(error) => {
                    registry.release(&params.dev_name, &owner);
                    Err(rpc_error(error))
                }
            }
        }
        "vhost_delete_controller" => {
            let params: DeleteParams = RpcError::parse_params(method, params)?;
            let bdev_name = server.delete(&params.ctrlr).map_err(rpc_error)?;
            registry.release(&bdev_name, &claim_owner(&params.ctrlr));
            Ok(json!(true))
        }
        "vhost_get_controllers" => {
            let params: GetParams = if params.is_null() {
                GetParams::default()
            } else {
                RpcError::parse_params(method, params)?
            };
            let list: Vec<Value> = server
                .list()
                .into_iter()
                .filter(|c| params.name.as_ref().is_none_or(|wanted| *wanted == c.name))
                .map(|c| {
                    json!({
                        "ctrlr": c.name,
                        "cpumask": c.cpumask,
                        "socket": c.socket.display().to_string(),
                        "max_queues": c.queues,
                        "attached": c.attached,
                        "in_place_requests": c.in_place_requests,
                        "backend_specific": {"block": {"readonly": c.readonly, "bdev": c.bdev_name, "transport": "vhost_user_blk"}},
                    })
                })
                .collect();
            if let Some(name) = &params.name
                && list.is_empty()
            {
                return Err(RpcError::no_device(format!(
                    "vhost controller {name} not found"
                )));
            }
            Ok(Value::Array(list))
        }
        _ => Err(RpcError::method_not_found(method)),
    }
}

/// The calls that recreate the controllers, for `save_config`.
pub fn config(server: &VhostServer) -> Vec<ConfigCall> {
    server
        .list()
        .into_iter()
        .map(|c| {
            ConfigCall::new(
                "vhost_create_blk_controller",
                CreateParams {
                    ctrlr: c.name,
                    dev_name: c.bdev_name,
                    readonly: c.readonly,
                    packed_ring: false,
                    max_queues: Some(c.queues),
                    cpumask: c.cpumask,
                },
            )
        })
        .collect()
}
