//! The `bdev_*` JSON-RPC methods, with SPDK's names and parameters.
//!
//! Basalt additions: `buffered` on the file bdev methods (open through the page cache where
//! O_DIRECT is refused) and `queue_depth`.

use std::path::PathBuf;

use basalt_common::{ConfigCall, RpcError};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::bdev::{BLOCK_SIZE_MAX, BLOCK_SIZE_MIN, BdevInfo};
use crate::file::{FileBdev, FileBdevOptions};
use crate::malloc::MallocBdev;
use crate::registry::{BdevKind, BdevRegistry, no_such_bdev};
use crate::uuid;

/// The largest malloc bdev: its chunk table stays under 32 MiB of RAM.
pub const MALLOC_SIZE_BYTES_MAX: u64 = 64 << 30;
/// Default io_uring depth of a file bdev.
pub const FILE_QUEUE_DEPTH_DEFAULT: u32 = 128;

/// The methods this module answers.
pub const METHODS: &[&str] = &[
    "bdev_malloc_create",
    "bdev_malloc_delete",
    "bdev_uring_create",
    "bdev_uring_delete",
    "bdev_aio_create",
    "bdev_aio_delete",
    "bdev_uring_rescan",
    "bdev_aio_rescan",
    "bdev_get_bdevs",
    "bdev_get_iostat",
    "bdev_basalt_create",
    "bdev_basalt_delete",
];

/// The methods that wait on the network (the image kind), answered by [`call_async`].
const ASYNC_METHODS: &[&str] = &["bdev_basalt_create"];

/// Runs `method` if it is a bdev method; `None` if it is not one of ours.
pub fn call(
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Option<Result<Value, RpcError>> {
    (METHODS.contains(&method) && !ASYNC_METHODS.contains(&method))
        .then(|| dispatch(registry, method, params))
}

/// Runs `method` if it is one of the bdev methods that wait on the network.
pub async fn call_async(
    registry: &BdevRegistry,
    method: &str,
    params: Value,
) -> Option<Result<Value, RpcError>> {
    match method {
        "bdev_basalt_create" => Some(match RpcError::parse_params(method, params) {
            Ok(params) => image_create(registry, params).await,
            Err(error) => Err(error),
        }),
        _ => None,
    }
}

/// Parameters of `bdev_basalt_create` (after fastblock's `bdev_fastblock_create`).
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ImageCreateParams {
    /// Name of the bdev.
    pub name: String,
    /// The pool.
    pub pool: String,
    /// The image in the pool.
    pub image: String,
    /// Monitor addresses, `host:port`.
    pub mons: Vec<String>,
    /// Bytes per block (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// UUID; random when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
}

async fn image_create(
    registry: &BdevRegistry,
    mut params: ImageCreateParams,
) -> Result<Value, RpcError> {
    let block_size = params.block_size.unwrap_or(512);
    check_block_size(block_size)?;
    check_name(registry, &params.name)?;
    let uuid = checked_uuid(params.uuid.as_deref())?;
    if params.mons.is_empty() {
        return Err(RpcError::invalid_params(
            "mons: at least one monitor address",
        ));
    }
    let mut mons = Vec::new();
    for mon in &params.mons {
        let resolved = tokio::net::lookup_host(mon.as_str())
            .await
            .map_err(|error| RpcError::invalid_params(format!("mons: {mon:?}: {error}")))?;
        mons.extend(resolved);
    }
    let cluster = basalt_client::Cluster::connect(mons)
        .await
        .map_err(|error| RpcError::invalid_params(format!("mons: {error}")))?;
    let image = cluster
        .open_image(&params.pool, &params.image)
        .map_err(|error| RpcError::no_device(error.to_string()))?;
    let size_bytes = image
        .size_bytes()
        .map_err(|error| RpcError::no_device(error.to_string()))?;
    if !size_bytes.is_multiple_of(u64::from(block_size)) {
        return Err(RpcError::invalid_params(format!(
            "image {}/{} of {size_bytes} bytes is not a whole number of {block_size}-byte blocks",
            params.pool, params.image
        )));
    }
    let info = BdevInfo {
        name: params.name.clone(),
        uuid: uuid.clone(),
        product_name: crate::image::PRODUCT_NAME,
        block_size,
        block_count: size_bytes / u64::from(block_size),
        optimal_io_boundary_blocks: 0,
    };
    params.uuid = Some(uuid);
    let construct = ConfigCall::new("bdev_basalt_create", &params);
    let bdev = crate::image::ImageBdev::new(info, image);
    // In use from the moment this answers: `basalt image rm` then refuses.
    bdev.watch().await;
    registry.insert(Box::new(bdev), BdevKind::Image, construct)?;
    Ok(json!(params.name))
}

fn dispatch(registry: &BdevRegistry, method: &str, params: Value) -> Result<Value, RpcError> {
    match method {
        "bdev_malloc_create" => malloc_create(registry, RpcError::parse_params(method, params)?),
        "bdev_malloc_delete" => delete(
            registry,
            BdevKind::Malloc,
            RpcError::parse_params(method, params)?,
        ),
        "bdev_uring_create" | "bdev_aio_create" => {
            file_create(registry, method, RpcError::parse_params(method, params)?)
        }
        "bdev_uring_rescan" | "bdev_aio_rescan" => {
            rescan(registry, RpcError::parse_params(method, params)?)
        }
        "bdev_uring_delete" | "bdev_aio_delete" => delete(
            registry,
            BdevKind::File,
            RpcError::parse_params(method, params)?,
        ),
        "bdev_basalt_delete" => delete(
            registry,
            BdevKind::Image,
            RpcError::parse_params(method, params)?,
        ),
        "bdev_get_bdevs" => get_bdevs(registry, RpcError::parse_params(method, params)?),
        "bdev_get_iostat" => get_iostat(registry, RpcError::parse_params(method, params)?),
        _ => Err(RpcError::method_not_found(method)),
    }
}

/// Parameters of `bdev_malloc_create`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MallocCreateParams {
    /// Name; `Malloc<N>` when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// Number of blocks.
    pub num_blocks: u64,
    /// Bytes per block.
    pub block_size: u32,
    /// UUID; random when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Optimal I/O boundary in blocks.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub optimal_io_boundary: Option<u32>,
}

fn malloc_create(
    registry: &BdevRegistry,
    mut params: MallocCreateParams,
) -> Result<Value, RpcError> {
    check_block_size(params.block_size)?;
    if params.num_blocks == 0 {
        return Err(RpcError::invalid_params("num_blocks must be at least 1"));
    }
    let size_bytes = params.num_blocks.checked_mul(u64::from(params.block_size));
    if size_bytes.is_none_or(|size| size > MALLOC_SIZE_BYTES_MAX) {
        return Err(RpcError::invalid_params(format!(
            "num_blocks {} x block_size {} is larger than the malloc maximum of {MALLOC_SIZE_BYTES_MAX} bytes",
            params.num_blocks, params.block_size
        )));
    }
    let name = params
        .name
        .clone()
        .unwrap_or_else(|| registry.free_name("Malloc"));
    check_name(registry, &name)?;
    let uuid = checked_uuid(params.uuid.as_deref())?;
    params.name = Some(name.clone());
    params.uuid = Some(uuid.clone());
    let info = BdevInfo {
        name: name.clone(),
        uuid,
        product_name: crate::malloc::PRODUCT_NAME,
        block_size: params.block_size,
        block_count: params.num_blocks,
        optimal_io_boundary_blocks: params.optimal_io_boundary.unwrap_or(0),
    };
    let construct = ConfigCall::new("bdev_malloc_create", &params);
    registry.insert(Box::new(MallocBdev::new(info)), BdevKind::Malloc, construct)?;
    Ok(json!(name))
}

/// Parameters of `bdev_uring_create` and `bdev_aio_create`.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileCreateParams {
    /// Path of the file or block device.
    pub filename: PathBuf,
    /// Name of the bdev.
    pub name: String,
    /// Bytes per block (default 512).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub block_size: Option<u32>,
    /// UUID; random when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub uuid: Option<String>,
    /// Open through the page cache instead of O_DIRECT (Basalt).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub buffered: bool,
    /// Requests in flight at most (Basalt; default 128).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub queue_depth: Option<u32>,
}

fn file_create(
    registry: &BdevRegistry,
    method: &str,
    mut params: FileCreateParams,
) -> Result<Value, RpcError> {
    let block_size = params.block_size.unwrap_or(512);
    check_block_size(block_size)?;
    check_name(registry, &params.name)?;
    let uuid = checked_uuid(params.uuid.as_deref())?;
    let options = FileBdevOptions {
        block_size,
        buffered: params.buffered,
        queue_depth: params.queue_depth.unwrap_or(FILE_QUEUE_DEPTH_DEFAULT),
    };
    let bdev = FileBdev::open(
        &params.filename,
        params.name.clone(),
        uuid.clone(),
        &options,
    )
    .map_err(|error| RpcError::invalid_params(format!("filename: {error}")))?;
    params.uuid = Some(uuid);
    let construct = ConfigCall::new(method, &params);
    registry.insert(Box::new(bdev), BdevKind::File, construct)?;
    Ok(json!(params.name))
}

/// Parameters of the `*_delete` and `*_rescan` methods.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DeleteParams {
    /// The bdev.
    pub name: String,
}

fn delete(
    registry: &BdevRegistry,
    kind: BdevKind,
    params: DeleteParams,
) -> Result<Value, RpcError> {
    registry.remove(&params.name, kind)?;
    Ok(json!(true))
}

/// `bdev_uring_rescan`: the file bdev takes on its file's size now (it may only grow). A
/// shrunk file is the caller's mistake (invalid parameters); a file that cannot be measured
/// any more, or a bdev that has grown too often, is the target's (internal error).
fn rescan(registry: &BdevRegistry, params: DeleteParams) -> Result<Value, RpcError> {
    let bdev = registry.get(&params.name, BdevKind::File)?;
    bdev.rescan().map_err(|error| match &error {
        crate::BdevError::Io { source, .. }
            if source.kind() != std::io::ErrorKind::InvalidInput =>
        {
            RpcError::internal(error.to_string())
        }
        _ => RpcError::invalid_params(error.to_string()),
    })?;
    Ok(json!(true))
}

/// Parameters of `bdev_get_bdevs` and `bdev_get_iostat`.
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct GetParams {
    /// Only this bdev.
    #[serde(default)]
    pub name: Option<String>,
    /// Accepted for SPDK compatibility; bdevs here appear at once.
    #[serde(default)]
    pub timeout: Option<u64>,
}

fn selected(
    registry: &BdevRegistry,
    name: Option<&str>,
) -> Result<Vec<crate::registry::Listed>, RpcError> {
    let all = registry.list();
    match name {
        None => Ok(all),
        Some(name) => {
            let one: Vec<_> = all
                .into_iter()
                .filter(|listed| listed.bdev.info().name == name)
                .collect();
            if one.is_empty() {
                Err(no_such_bdev(name))
            } else {
                Ok(one)
            }
        }
    }
}

fn get_bdevs(registry: &BdevRegistry, params: GetParams) -> Result<Value, RpcError> {
    let listed = selected(registry, params.name.as_deref())?;
    let bdevs: Vec<Value> = listed
        .iter()
        .map(|listed| {
            let info = listed.bdev.info();
            let driver_specific = match listed.construct.params.get("filename") {
                Some(filename) => json!({"uring": {"filename": filename}}),
                None => json!({}),
            };
            json!({
                "name": info.name,
                "aliases": [],
                "product_name": info.product_name,
                "block_size": info.block_size,
                "num_blocks": info.block_count,
                "uuid": info.uuid,
                "claimed": !listed.claims.is_empty(),
                "claimed_by": listed.claims,
                "zoned": false,
                "optimal_io_boundary": info.optimal_io_boundary_blocks,
                "supported_io_types": {
                    "read": true, "write": true, "unmap": true, "write_zeroes": true,
                    "flush": true, "reset": false, "compare": false, "nvme_admin": false,
                    "nvme_io": false,
                },
                "driver_specific": driver_specific,
            })
        })
        .collect();
    Ok(Value::Array(bdevs))
}

/// Latency ticks are nanoseconds.
const TICK_RATE: u64 = 1_000_000_000;

fn get_iostat(registry: &BdevRegistry, params: GetParams) -> Result<Value, RpcError> {
    let listed = selected(registry, params.name.as_deref())?;
    let bdevs: Vec<Value> = listed
        .iter()
        .map(|listed| {
            let stats = listed.bdev.io_stats().unwrap_or_default();
            json!({
                "name": listed.bdev.info().name,
                "bytes_read": stats.bytes_read,
                "num_read_ops": stats.num_read_ops,
                "bytes_written": stats.bytes_written,
                "num_write_ops": stats.num_write_ops,
                "bytes_unmapped": stats.bytes_unmapped,
                "num_unmap_ops": stats.num_unmap_ops,
                "num_flush_ops": stats.num_flush_ops,
                "num_errors": stats.num_errors,
                "read_latency_ticks": stats.read_latency_ns,
                "write_latency_ticks": stats.write_latency_ns,
                "unmap_latency_ticks": stats.unmap_latency_ns,
            })
        })
        .collect();
    let ticks = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|since| since.as_nanos() as u64)
        .unwrap_or(0);
    Ok(json!({"tick_rate": TICK_RATE, "ticks": ticks, "bdevs": bdevs}))
}

fn check_block_size(block_size: u32) -> Result<(), RpcError> {
    if !block_size.is_power_of_two() || !(BLOCK_SIZE_MIN..=BLOCK_SIZE_MAX).contains(&block_size) {
        return Err(RpcError::invalid_params(format!(
            "block_size {block_size} is not a power of two between {BLOCK_SIZE_MIN} and {BLOCK_SIZE_MAX}"
        )));
    }
    Ok(())
}

fn check_name(registry: &BdevRegistry, name: &str) -> Result<(), RpcError> {
    if name.is_empty() || name.len() > 255 || name.chars().any(|c| c.is_control() || c == '/') {
        return Err(RpcError::invalid_params(format!(
            "name {name:?} must be 1 to 255 characters without '/' or control characters"
        )));
    }
    if registry.contains(name) {
        return Err(RpcError::exists(format!(
            "bdev name {name:?} is already in use"
        )));
    }
    Ok(())
}

fn checked_uuid(given: Option<&str>) -> Result<String, RpcError> {
    match given {
        None => Ok(uuid::random()),
        Some(text) => uuid::parse(text)
            .map(|bytes| uuid::format(&bytes))
            .ok_or_else(|| RpcError::invalid_params(format!("uuid {text:?} is not a UUID"))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(registry: &BdevRegistry, method: &str, params: Value) -> Result<Value, RpcError> {
        call(registry, method, params).expect("a bdev method")
    }

    #[test]
    fn malloc_create_names_lists_and_deletes() {
        let registry = BdevRegistry::new();
        let name = run(
            &registry,
            "bdev_malloc_create",
            json!({"num_blocks": 2048, "block_size": 512}),
        );
        assert_eq!(name, Ok(json!("Malloc0")));
        let name = run(
            &registry,
            "bdev_malloc_create",
            json!({"num_blocks": 8, "block_size": 4096, "name": "m", "uuid": "01234567-89AB-cdef-0123-456789abcdef"}),
        );
        assert_eq!(name, Ok(json!("m")));
        let listed = run(&registry, "bdev_get_bdevs", json!({"name": "m"})).expect("get");
        assert_eq!(listed[0]["num_blocks"], json!(8));
        assert_eq!(listed[0]["block_size"], json!(4096));
        assert_eq!(
            listed[0]["uuid"],
            json!("01234567-89ab-cdef-0123-456789abcdef")
        );
        assert_eq!(listed[0]["product_name"], json!("Malloc disk"));
        let all = run(&registry, "bdev_get_bdevs", Value::Null).expect("get all");
        assert_eq!(all.as_array().map(Vec::len), Some(2));
        assert_eq!(
            run(&registry, "bdev_malloc_delete", json!({"name": "m"})),
            Ok(json!(true))
        );
        let gone = run(&registry, "bdev_get_bdevs", json!({"name": "m"})).expect_err("deleted");
        assert_eq!(gone.code, RpcError::NO_DEVICE);
    }

    #[test]
    fn malloc_create_errors_name_the_parameter() {
        let registry = BdevRegistry::new();
        let cases = [
            (
                json!({"num_blocks": 8, "block_size": 1000}),
                "block_size",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"num_blocks": 0, "block_size": 512}),
                "num_blocks",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"num_blocks": 1u64 << 40, "block_size": 4096}),
                "num_blocks",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"block_size": 512}),
                "num_blocks",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"num_blocks": "8", "block_size": 512}),
                "invalid type",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"num_blocks": 8, "block_size": 512, "uuid": "x"}),
                "uuid",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"num_blocks": 8, "block_size": 512, "colour": 1}),
                "colour",
                RpcError::INVALID_PARAMS,
            ),
            (
                json!({"num_blocks": 8, "block_size": 512, "name": ""}),
                "name",
                RpcError::INVALID_PARAMS,
            ),
        ];
        for (params, word, code) in cases {
            let error = run(&registry, "bdev_malloc_create", params.clone()).expect_err("refused");
            assert_eq!(error.code, code, "{params}: {error}");
            assert!(error.message.contains(word), "{params}: {error}");
        }
        run(
            &registry,
            "bdev_malloc_create",
            json!({"num_blocks": 8, "block_size": 512, "name": "a"}),
        )
        .expect("create");
        let again = run(
            &registry,
            "bdev_malloc_create",
            json!({"num_blocks": 8, "block_size": 512, "name": "a"}),
        );
        assert_eq!(again.expect_err("duplicate").code, RpcError::EXISTS);
        let missing =
            run(&registry, "bdev_malloc_delete", json!({"name": "nope"})).expect_err("missing");
        assert_eq!(missing.code, RpcError::NO_DEVICE);
        let wrong_kind =
            run(&registry, "bdev_uring_delete", json!({"name": "a"})).expect_err("kind");
        assert!(wrong_kind.message.contains("malloc bdev"), "{wrong_kind}");
    }

    #[test]
    fn claimed_bdev_cannot_be_deleted() {
        let registry = BdevRegistry::new();
        run(
            &registry,
            "bdev_malloc_create",
            json!({"num_blocks": 8, "block_size": 512, "name": "a"}),
        )
        .expect("create");
        registry.claim("a", "nbd export x").expect("claim");
        let busy = run(&registry, "bdev_malloc_delete", json!({"name": "a"})).expect_err("busy");
        assert_eq!(busy.code, RpcError::BUSY);
        assert!(busy.message.contains("nbd export x"), "{busy}");
        registry.release("a", "nbd export x");
        assert_eq!(
            run(&registry, "bdev_malloc_delete", json!({"name": "a"})),
            Ok(json!(true))
        );
    }

    #[test]
    fn file_create_reports_bad_files_and_saves_its_call() {
        let registry = BdevRegistry::new();
        let missing = run(
            &registry,
            "bdev_uring_create",
            json!({"filename": "/nonexistent/x", "name": "f"}),
        );
        let missing = missing.expect_err("no file");
        assert!(missing.message.contains("/nonexistent/x"), "{missing}");
        let path = std::env::temp_dir().join(format!("basalt-rpc-file-{}", std::process::id()));
        std::fs::File::create(&path)
            .expect("create")
            .set_len(1 << 20)
            .expect("set_len");
        let created = run(
            &registry,
            "bdev_aio_create",
            json!({"filename": path, "name": "f", "block_size": 4096, "buffered": true}),
        );
        assert_eq!(created, Ok(json!("f")));
        let config = registry.config();
        assert_eq!(config[0].method, "bdev_aio_create");
        assert_eq!(config[0].params["block_size"], json!(4096));
        assert!(
            config[0].params["uuid"].is_string(),
            "uuid saved so a restart keeps it"
        );
        let stats = run(&registry, "bdev_get_iostat", json!({"name": "f"})).expect("iostat");
        assert_eq!(stats["bdevs"][0]["num_read_ops"], json!(0));
        assert_eq!(
            run(&registry, "bdev_aio_delete", json!({"name": "f"})),
            Ok(json!(true))
        );
        std::fs::remove_file(path).expect("remove");
    }

    #[test]
    fn unknown_methods_are_not_ours() {
        assert!(call(&BdevRegistry::new(), "nbd_get_exports", Value::Null).is_none());
    }
}
