//! The `nvmf_*` JSON-RPC methods, with SPDK's names, parameters and result shapes:
//! `nvmf_create_transport`, `nvmf_get_transports`, `nvmf_create_subsystem`,
//! `nvmf_delete_subsystem`, `nvmf_get_subsystems`, `nvmf_subsystem_add_ns`,
//! `nvmf_subsystem_remove_ns`, `nvmf_subsystem_add_listener`,
//! `nvmf_subsystem_remove_listener`, `nvmf_subsystem_add_host`,
//! `nvmf_subsystem_remove_host`, `nvmf_subsystem_allow_any_host`,
//! `nvmf_subsystem_get_controllers`, `nvmf_subsystem_get_qpairs`, `nvmf_get_stats`.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use basalt_bdev::BdevRegistry;
use basalt_common::{ConfigCall, RpcError};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::subsystem::*;
use crate::target::NvmfTarget;

/// The methods this module answers.
pub const METHODS: &[&str] = &[
    "nvmf_create_transport",
    "nvmf_get_transports",
    "nvmf_create_subsystem",
    "nvmf_delete_subsystem",
    "nvmf_get_subsystems",
    "nvmf_subsystem_add_ns",
    "nvmf_subsystem_remove_ns",
    "nvmf_subsystem_add_listener",
    "nvmf_subsystem_remove_listener",
    "nvmf_subsystem_add_host",
    "nvmf_subsystem_remove_host",
    "nvmf_subsystem_allow_any_host",
    "nvmf_subsystem_get_controllers",
    "nvmf_subsystem_get_qpairs",
    "nvmf_get_stats",
];

/// Runs `method` if it is an NVMe-oF method; `None` if it is not one of ours.
pub async fn call(
    target: &Arc<NvmfTarget>,
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Option<Result<Value, RpcError>> {
    if !METHODS.contains(&method) {
        return None;
    }
    Some(dispatch(target, registry, method, params).await)
}

async fn dispatch(
    target: &Arc<NvmfTarget>,
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Result<Value, RpcError> {
    match method {
        "nvmf_create_transport" => create_transport(target, parse_transport(method, params)?),
        "nvmf_get_transports" => {
            let params: GetTransportsParams = parse_or_empty(method, params)?;
            get_transports(target, params)
        }
        "nvmf_create_subsystem" => {
            create_subsystem(target, RpcError::parse_params(method, params)?)
        }
        "nvmf_delete_subsystem" => {
            let params: NqnParams = RpcError::parse_params(method, params)?;
            let subsystem = target
                .remove_subsystem(&params.nqn)
                .ok_or_else(|| no_subsystem(&params.nqn))?;
            for namespace in subsystem.lock().namespaces.values() {
                registry.release(&namespace.bdev_name, &claim_owner(&subsystem.nqn));
            }
            Ok(json!(true))
        }
        "nvmf_get_subsystems" => {
            let params: GetSubsystemsParams = parse_or_empty(method, params)?;
            get_subsystems(target, params)
        }
        "nvmf_subsystem_add_ns" => {
            add_ns(target, registry, RpcError::parse_params(method, params)?)
        }
        "nvmf_subsystem_remove_ns" => {
            let params: RemoveNsParams = RpcError::parse_params(method, params)?;
            let subsystem = nvm_subsystem(target, &params.nqn)?;
            let namespace = target
                .remove_namespace(&subsystem, params.nsid)
                .ok_or_else(|| {
                    RpcError::no_device(format!(
                        "subsystem {} has no namespace {}",
                        params.nqn, params.nsid
                    ))
                })?;
            registry.release(&namespace.bdev_name, &claim_owner(&subsystem.nqn));
            Ok(json!(true))
        }
        "nvmf_subsystem_add_listener" => {
            let params: ListenerParams = RpcError::parse_params(method, params)?;
            let subsystem = nvm_subsystem(target, &params.nqn)?;
            let address = params.listen_address.parse()?;
            target
                .add_listener(&subsystem, address)
                .await
                .map_err(RpcError::invalid_params)?;
            Ok(json!(true))
        }
        "nvmf_subsystem_remove_listener" => {
            let params: ListenerParams = RpcError::parse_params(method, params)?;
            let subsystem = nvm_subsystem(target, &params.nqn)?;
            let address = params.listen_address.parse()?;
            target
                .remove_listener(&subsystem, address)
                .map_err(RpcError::invalid_params)?;
            Ok(json!(true))
        }
        "nvmf_subsystem_add_host" => {
            let params: HostParams = RpcError::parse_params(method, params)?;
            validate_nqn(&params.host)
                .map_err(|e| RpcError::invalid_params(format!("host: {e}")))?;
            let subsystem = nvm_subsystem(target, &params.nqn)?;
            if !subsystem.lock().hosts.insert(params.host.clone()) {
                return Err(RpcError::exists(format!(
                    "host {} is already allowed on {}",
                    params.host, params.nqn
                )));
            }
            target.discovery_changed();
            Ok(json!(true))
        }
        "nvmf_subsystem_remove_host" => {
            let params: HostParams = RpcError::parse_params(method, params)?;
            let subsystem = nvm_subsystem(target, &params.nqn)?;
            if !subsystem.lock().hosts.remove(&params.host) {
                return Err(RpcError::no_device(format!(
                    "host {} is not allowed on {}",
                    params.host, params.nqn
                )));
            }
            subsystem.disconnect_hosts_not_allowed();
            target.discovery_changed();
            Ok(json!(true))
        }
        "nvmf_subsystem_allow_any_host" => {
            let params: AllowAnyHostParams = RpcError::parse_params(method, params)?;
            let subsystem = nvm_subsystem(target, &params.nqn)?;
            subsystem.lock().allow_any_host = params.allow_any_host;
            subsystem.disconnect_hosts_not_allowed();
            target.discovery_changed();
            Ok(json!(true))
        }
        "nvmf_subsystem_get_controllers" => {
            let params: NqnParams = RpcError::parse_params(method, params)?;
            let subsystem = target
                .subsystem(&params.nqn)
                .ok_or_else(|| no_subsystem(&params.nqn))?;
            let controllers: Vec<Value> = subsystem
                .lock()
                .controllers
                .values()
                .map(|controller| {
                    json!({
                        "cntlid": controller.id,
                        "hostnqn": controller.host_nqn,
                        "hostid": basalt_bdev::uuid::format(&controller.host_id),
                        "num_io_qpairs": controller.io_queues().len(),
                    })
                })
                .collect();
            Ok(Value::Array(controllers))
        }
        "nvmf_subsystem_get_qpairs" => {
            let params: NqnParams = RpcError::parse_params(method, params)?;
            let subsystem = target
                .subsystem(&params.nqn)
                .ok_or_else(|| no_subsystem(&params.nqn))?;
            let mut qpairs = Vec::new();
            for controller in subsystem.lock().controllers.values() {
                for (qid, thread) in controller.queue_threads() {
                    qpairs.push(json!({
                        "cntlid": controller.id,
                        "qid": qid,
                        "state": "active",
                        "thread": thread,
                    }));
                }
            }
            Ok(Value::Array(qpairs))
        }
        "nvmf_get_stats" => {
            let _: Empty = parse_or_empty(method, params)?;
            let counters = &target.counters;
            Ok(json!({
                "tick_rate": 1_000_000_000u64,
                "poll_groups": [{
                    "name": "nvmf_tgt_poll_group_000",
                    "admin_qpairs": counters.admin_qpairs.load(Ordering::Relaxed),
                    "io_qpairs": counters.io_qpairs.load(Ordering::Relaxed),
                    "current_admin_qpairs": counters.current_admin_qpairs.load(Ordering::Relaxed),
                    "current_io_qpairs": counters.current_io_qpairs.load(Ordering::Relaxed),
                    "pending_bdev_io": 0,
                    "transports": [{
                        "trtype": "TCP",
                        // Commands waiting for the transport's data budget.
                        "pending_data_buffer": target.data_budget().map_or(0, |budget| budget.parked()),
                    }],
                }],
            }))
        }
        _ => Err(RpcError::method_not_found(method)),
    }
}

fn parse_or_empty<T: serde::de::DeserializeOwned>(
    method: &str,
    params: Value,
) -> Result<T, RpcError> {
    let params = if params.is_null() { json!({}) } else { params };
    RpcError::parse_params(method, params)
}

fn no_subsystem(nqn: &str) -> RpcError {
    RpcError::no_device(format!("subsystem {nqn} not found"))
}

/// An NVM subsystem (not the discovery subsystem, which is not configurable).
fn nvm_subsystem(target: &NvmfTarget, nqn: &str) -> Result<Arc<Subsystem>, RpcError> {
    if nqn == crate::fabrics::DISCOVERY_NQN {
        return Err(RpcError::invalid_params(format!(
            "{nqn} is the discovery subsystem: it cannot be changed"
        )));
    }
    target.subsystem(nqn).ok_or_else(|| no_subsystem(nqn))
}

fn claim_owner(nqn: &str) -> String {
    format!("nvmf subsystem {nqn}")
}

/// No parameters.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct Empty {}

/// Parameters of `nvmf_create_transport`, SPDK's names. `buf_cache_size` sizes SPDK's
/// per-thread buffer caches; it is accepted so that SPDK scripts run, and ignored.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TransportParams {
    /// `TCP` (any case).
    pub trtype: String,
    /// Deepest I/O queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_queue_depth: Option<u16>,
    /// I/O queues per controller.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_io_qpairs_per_ctrlr: Option<u16>,
    /// Queues per controller, admin queue included (SPDK's newer name).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_qpairs_per_ctrlr: Option<u16>,
    /// In-capsule data bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub in_capsule_data_size: Option<u32>,
    /// Largest I/O in bytes.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_io_size: Option<u32>,
    /// Most bytes per H2CData PDU.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub io_unit_size: Option<u32>,
    /// Deepest admin queue.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_aq_depth: Option<u16>,
    /// Reads end with C2HData SUCCESS when the host allows it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub c2h_success: Option<bool>,
    /// With `io_unit_size`, the data bytes I/O commands on all connections hold at most
    /// (`num_shared_buffers` × `io_unit_size`, counted in bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub num_shared_buffers: Option<u32>,
    /// Accepted and ignored (SPDK's buffer cache).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub buf_cache_size: Option<u32>,
}

fn parse_transport(method: &str, params: Value) -> Result<TransportOptions, RpcError> {
    let params: TransportParams = RpcError::parse_params(method, params)?;
    if !params.trtype.eq_ignore_ascii_case("tcp") {
        return Err(RpcError::invalid_params(format!(
            "trtype {:?} is not supported (only TCP)",
            params.trtype
        )));
    }
    let defaults = TransportOptions::default();
    let io_qpairs = match (params.max_io_qpairs_per_ctrlr, params.max_qpairs_per_ctrlr) {
        (Some(io), _) => io,
        (None, Some(0)) => 0,
        (None, Some(all)) => all - 1,
        (None, None) => defaults.max_io_qpairs_per_ctrlr,
    };
    let options = TransportOptions {
        max_queue_depth: params.max_queue_depth.unwrap_or(defaults.max_queue_depth),
        max_io_qpairs_per_ctrlr: io_qpairs,
        in_capsule_data_size: params
            .in_capsule_data_size
            .unwrap_or(defaults.in_capsule_data_size),
        max_io_size: params.max_io_size.unwrap_or(defaults.max_io_size),
        io_unit_size: params.io_unit_size.unwrap_or(defaults.io_unit_size),
        max_aq_depth: params.max_aq_depth.unwrap_or(defaults.max_aq_depth),
        c2h_success: params.c2h_success.unwrap_or(defaults.c2h_success),
        num_shared_buffers: params
            .num_shared_buffers
            .unwrap_or(defaults.num_shared_buffers),
    };
    options.validate().map_err(RpcError::invalid_params)?;
    Ok(options)
}

fn create_transport(target: &NvmfTarget, options: TransportOptions) -> Result<Value, RpcError> {
    target.create_transport(options).map_err(RpcError::exists)?;
    Ok(json!(true))
}

fn transport_params(options: &TransportOptions) -> TransportParams {
    TransportParams {
        trtype: "TCP".into(),
        max_queue_depth: Some(options.max_queue_depth),
        max_io_qpairs_per_ctrlr: Some(options.max_io_qpairs_per_ctrlr),
        max_qpairs_per_ctrlr: None,
        in_capsule_data_size: Some(options.in_capsule_data_size),
        max_io_size: Some(options.max_io_size),
        io_unit_size: Some(options.io_unit_size),
        max_aq_depth: Some(options.max_aq_depth),
        c2h_success: Some(options.c2h_success),
        num_shared_buffers: Some(options.num_shared_buffers),
        buf_cache_size: None,
    }
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GetTransportsParams {
    #[serde(default)]
    trtype: Option<String>,
}

fn get_transports(target: &NvmfTarget, params: GetTransportsParams) -> Result<Value, RpcError> {
    if let Some(trtype) = &params.trtype
        && !trtype.eq_ignore_ascii_case("tcp")
    {
        return Err(RpcError::no_device(format!("transport {trtype} not found")));
    }
    Ok(match target.transport() {
        Some(options) => json!([transport_params(&options)]),
        None if params.trtype.is_some() => {
            return Err(RpcError::no_device("transport TCP not found"));
        }
        None => json!([]),
    })
}

/// Parameters of `nvmf_create_subsystem`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CreateSubsystemParams {
    /// The subsystem NQN.
    pub nqn: String,
    /// Serial number (20 ASCII characters at most).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub serial_number: Option<String>,
    /// Model number (40 ASCII characters at most).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub model_number: Option<String>,
    /// Any host may connect.
    #[serde(default)]
    pub allow_any_host: bool,
    /// Namespaces at most (0: the default, 32).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_namespaces: Option<u32>,
    /// Lowest controller id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_cntlid: Option<u16>,
    /// Highest controller id.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cntlid: Option<u16>,
}

fn create_subsystem(target: &NvmfTarget, params: CreateSubsystemParams) -> Result<Value, RpcError> {
    let invalid = RpcError::invalid_params;
    validate_nqn(&params.nqn).map_err(invalid)?;
    let serial = params
        .serial_number
        .unwrap_or_else(|| DEFAULT_SERIAL_NUMBER.to_string());
    validate_ascii_field("serial_number", &serial, SERIAL_NUMBER_SIZE_MAX).map_err(invalid)?;
    let model = params
        .model_number
        .unwrap_or_else(|| DEFAULT_MODEL_NUMBER.to_string());
    validate_ascii_field("model_number", &model, MODEL_NUMBER_SIZE_MAX).map_err(invalid)?;
    let max_namespaces = match params.max_namespaces {
        None | Some(0) => DEFAULT_MAX_NAMESPACES,
        Some(count) if count <= NAMESPACE_COUNT_MAX => count,
        Some(count) => {
            return Err(invalid(format!(
                "max_namespaces {count} is above {NAMESPACE_COUNT_MAX}"
            )));
        }
    };
    let min = params.min_cntlid.unwrap_or(1);
    let max = params.max_cntlid.unwrap_or(CONTROLLER_ID_MAX);
    if min == 0 || max > CONTROLLER_ID_MAX || min > max {
        return Err(invalid(format!(
            "min_cntlid {min} and max_cntlid {max} must satisfy 1 <= min_cntlid <= max_cntlid <= {CONTROLLER_ID_MAX}"
        )));
    }
    let subsystem = Subsystem::new(
        params.nqn,
        serial,
        model,
        max_namespaces,
        params.allow_any_host,
        (min, max),
    );
    target
        .add_subsystem(Arc::new(subsystem))
        .map_err(RpcError::exists)?;
    Ok(json!(true))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct NqnParams {
    nqn: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct GetSubsystemsParams {
    #[serde(default)]
    nqn: Option<String>,
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02X}")).collect()
}

fn subsystem_json(subsystem: &Subsystem) -> Value {
    let state = subsystem.lock();
    let listen_addresses: Vec<Value> = state.listeners.iter().map(ListenAddress::to_json).collect();
    if subsystem.is_discovery() {
        return json!({
            "nqn": subsystem.nqn,
            "subtype": "Discovery",
            "listen_addresses": listen_addresses,
            "allow_any_host": true,
            "hosts": [],
        });
    }
    let hosts: Vec<Value> = state
        .hosts
        .iter()
        .map(|host| json!({"nqn": host}))
        .collect();
    let namespaces: Vec<Value> = state
        .namespaces
        .values()
        .map(|namespace| {
            json!({
                "nsid": namespace.nsid,
                "bdev_name": namespace.bdev_name,
                "name": namespace.bdev_name,
                "uuid": basalt_bdev::uuid::format(&namespace.uuid),
                "nguid": hex(&namespace.nguid),
            })
        })
        .collect();
    json!({
        "nqn": subsystem.nqn,
        "subtype": "NVMe",
        "listen_addresses": listen_addresses,
        "allow_any_host": state.allow_any_host,
        "hosts": hosts,
        "serial_number": subsystem.serial_number,
        "model_number": subsystem.model_number,
        "max_namespaces": subsystem.max_namespaces,
        "min_cntlid": subsystem.min_cntlid,
        "max_cntlid": subsystem.max_cntlid,
        "namespaces": namespaces,
    })
}

fn get_subsystems(target: &NvmfTarget, params: GetSubsystemsParams) -> Result<Value, RpcError> {
    if let Some(nqn) = &params.nqn {
        let subsystem = target.subsystem(nqn).ok_or_else(|| no_subsystem(nqn))?;
        return Ok(json!([subsystem_json(&subsystem)]));
    }
    let all: Vec<Value> = std::iter::once(target.discovery().clone())
        .chain(target.subsystems())
        .map(|subsystem| subsystem_json(&subsystem))
        .collect();
    Ok(Value::Array(all))
}

/// The `namespace` object of `nvmf_subsystem_add_ns`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceParams {
    /// The bdev to export.
    pub bdev_name: String,
    /// Namespace id (default: the lowest free).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nsid: Option<u32>,
    /// UUID (default: the bdev's).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// NGUID, 32 hexadecimal digits (default: the UUID's bytes).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub nguid: Option<String>,
}

/// Parameters of `nvmf_subsystem_add_ns`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AddNsParams {
    /// The subsystem.
    pub nqn: String,
    /// The namespace.
    pub namespace: NamespaceParams,
}

fn parse_nguid(text: &str) -> Option<[u8; 16]> {
    let digits: String = text.chars().filter(|c| *c != '-').collect();
    if digits.len() != 32 || !digits.is_ascii() {
        return None;
    }
    let mut bytes = [0u8; 16];
    for (index, byte) in bytes.iter_mut().enumerate() {
        *byte = u8::from_str_radix(&digits[index * 2..index * 2 + 2], 16).ok()?;
    }
    Some(bytes)
}

fn add_ns(
    target: &NvmfTarget,
    registry: &BdevRegistry,
    params: AddNsParams,
) -> Result<Value, RpcError> {
    let invalid = RpcError::invalid_params;
    let subsystem = nvm_subsystem(target, &params.nqn)?;
    let requested = &params.namespace;
    if requested.nsid == Some(0)
        || requested
            .nsid
            .is_some_and(|nsid| nsid > subsystem.max_namespaces)
    {
        return Err(invalid(format!(
            "nsid must be from 1 to {} (max_namespaces)",
            subsystem.max_namespaces
        )));
    }
    let uuid = match &requested.uuid {
        Some(text) => Some(
            basalt_bdev::uuid::parse(text)
                .ok_or_else(|| invalid(format!("uuid {text:?} is not a UUID")))?,
        ),
        None => None,
    };
    let nguid = match &requested.nguid {
        Some(text) => Some(
            parse_nguid(text)
                .ok_or_else(|| invalid(format!("nguid {text:?} is not 32 hexadecimal digits")))?,
        ),
        None => None,
    };
    let owner = claim_owner(&subsystem.nqn);
    let bdev = registry.claim(&requested.bdev_name, &owner)?;
    let uuid = uuid
        .or_else(|| basalt_bdev::uuid::parse(&bdev.info().uuid))
        .unwrap_or_else(|| {
            basalt_bdev::uuid::parse(&basalt_bdev::uuid::random()).expect("a random uuid parses")
        });
    let nsid = {
        let state = subsystem.lock();
        let nsid = match requested.nsid {
            Some(nsid) if state.namespaces.contains_key(&nsid) => {
                drop(state);
                registry.release(&requested.bdev_name, &owner);
                return Err(RpcError::exists(format!(
                    "subsystem {} already has namespace {nsid}",
                    subsystem.nqn
                )));
            }
            Some(nsid) => Some(nsid),
            None => free_nsid(&state.namespaces, subsystem.max_namespaces),
        };
        let duplicate_bdev = state
            .namespaces
            .values()
            .any(|namespace| namespace.bdev_name == requested.bdev_name);
        drop(state);
        if duplicate_bdev {
            registry.release(&requested.bdev_name, &owner);
            return Err(RpcError::exists(format!(
                "bdev {} is already a namespace of {}",
                requested.bdev_name, subsystem.nqn
            )));
        }
        let Some(nsid) = nsid else {
            registry.release(&requested.bdev_name, &owner);
            return Err(invalid(format!(
                "subsystem {} has no free namespace id (max_namespaces {})",
                subsystem.nqn, subsystem.max_namespaces
            )));
        };
        nsid
    };
    let namespace = Namespace {
        nsid,
        bdev_name: requested.bdev_name.clone(),
        announced_blocks: bdev.info().block_count.into(),
        bdev,
        uuid,
        nguid: nguid.unwrap_or(uuid),
    };
    target.add_namespace(&subsystem, Arc::new(namespace));
    Ok(json!(nsid))
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RemoveNsParams {
    nqn: String,
    nsid: u32,
}

/// SPDK's `listen_address` object.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenAddressParams {
    /// `TCP`.
    pub trtype: String,
    /// `IPv4` or `IPv6` (default: from `traddr`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub adrfam: Option<String>,
    /// The IP address.
    pub traddr: String,
    /// The port.
    pub trsvcid: String,
}

impl ListenAddressParams {
    fn parse(&self) -> Result<ListenAddress, RpcError> {
        if !self.trtype.eq_ignore_ascii_case("tcp") {
            return Err(RpcError::invalid_params(format!(
                "trtype {:?} is not supported (only TCP)",
                self.trtype
            )));
        }
        ListenAddress::parse(self.adrfam.as_deref(), &self.traddr, &self.trsvcid)
            .map_err(RpcError::invalid_params)
    }

    fn of(address: &ListenAddress) -> Self {
        Self {
            trtype: "TCP".into(),
            adrfam: Some(address.family().name().into()),
            traddr: address.traddr(),
            trsvcid: address.trsvcid(),
        }
    }
}

/// Parameters of `nvmf_subsystem_add_listener` and `nvmf_subsystem_remove_listener`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerParams {
    /// The subsystem.
    pub nqn: String,
    /// Where.
    pub listen_address: ListenAddressParams,
}

/// Parameters of `nvmf_subsystem_add_host` and `nvmf_subsystem_remove_host`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct HostParams {
    /// The subsystem.
    pub nqn: String,
    /// The host NQN.
    pub host: String,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AllowAnyHostParams {
    nqn: String,
    allow_any_host: bool,
}

/// The calls that recreate the transport and the subsystems, for `save_config`.
pub fn config(target: &NvmfTarget) -> Vec<ConfigCall> {
    let mut calls = Vec::new();
    let Some(options) = target.transport() else {
        return calls;
    };
    calls.push(ConfigCall::new(
        "nvmf_create_transport",
        transport_params(&options),
    ));
    for subsystem in target.subsystems() {
        let state = subsystem.lock();
        calls.push(ConfigCall::new(
            "nvmf_create_subsystem",
            CreateSubsystemParams {
                nqn: subsystem.nqn.clone(),
                serial_number: Some(subsystem.serial_number.clone()),
                model_number: Some(subsystem.model_number.clone()),
                allow_any_host: state.allow_any_host,
                max_namespaces: Some(subsystem.max_namespaces),
                min_cntlid: Some(subsystem.min_cntlid),
                max_cntlid: Some(subsystem.max_cntlid),
            },
        ));
        for host in &state.hosts {
            calls.push(ConfigCall::new(
                "nvmf_subsystem_add_host",
                HostParams {
                    nqn: subsystem.nqn.clone(),
                    host: host.clone(),
                },
            ));
        }
        for namespace in state.namespaces.values() {
            calls.push(ConfigCall::new(
                "nvmf_subsystem_add_ns",
                AddNsParams {
                    nqn: subsystem.nqn.clone(),
                    namespace: NamespaceParams {
                        bdev_name: namespace.bdev_name.clone(),
                        nsid: Some(namespace.nsid),
                        uuid: Some(basalt_bdev::uuid::format(&namespace.uuid)),
                        nguid: Some(hex(&namespace.nguid)),
                    },
                },
            ));
        }
        for address in &state.listeners {
            calls.push(ConfigCall::new(
                "nvmf_subsystem_add_listener",
                ListenerParams {
                    nqn: subsystem.nqn.clone(),
                    listen_address: ListenAddressParams::of(address),
                },
            ));
        }
    }
    calls
}
