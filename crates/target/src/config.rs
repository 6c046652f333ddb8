//! The target's configuration document: what `save_config` writes and `--config` reads.
//!
//! ```json
//! {"subsystems": [
//!   {"subsystem": "bdev", "config": [{"method": "bdev_malloc_create", "params": {...}}]},
//!   {"subsystem": "nbd",  "config": [{"method": "nbd_server_start",   "params": {...}}]},
//!   {"subsystem": "nvmf", "config": [{"method": "nvmf_create_transport", "params": {...}}]}
//! ]}
//! ```
//!
//! Subsystems load in dependency order (bdevs before the frontends that export them),
//! whatever order the file lists them in. Malloc bdevs come back empty, as in SPDK.

use std::path::Path;

use basalt_common::{ConfigCall, RpcError};
use serde::{Deserialize, Serialize};

use crate::Target;

/// The whole document.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetConfig {
    /// One entry per subsystem.
    pub subsystems: Vec<SubsystemConfig>,
}

/// One subsystem's calls.
#[derive(Debug, Clone, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SubsystemConfig {
    /// `bdev`, `nbd`, ...
    pub subsystem: String,
    /// Calls in order; `null` is read as none (SPDK writes that for empty subsystems).
    #[serde(default, deserialize_with = "null_as_empty")]
    pub config: Vec<ConfigCall>,
}

fn null_as_empty<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> Result<Vec<ConfigCall>, D::Error> {
    Ok(Option::<Vec<ConfigCall>>::deserialize(deserializer)?.unwrap_or_default())
}

/// Subsystems in load order.
pub const SUBSYSTEMS: &[&str] = &["bdev", "nbd", "nvmf", "vhost_blk"];

/// The configuration of a running target.
pub fn save(target: &Target) -> TargetConfig {
    let subsystems = SUBSYSTEMS
        .iter()
        .map(|&name| SubsystemConfig {
            subsystem: name.to_string(),
            config: match name {
                "bdev" => target.bdevs.config(),
                "nbd" => basalt_nbd::rpc::config(&target.nbd),
                "nvmf" => basalt_nvmf::rpc::config(&target.nvmf),
                "vhost_blk" => basalt_vhost::rpc::config(&target.vhost),
                _ => Vec::new(),
            },
        })
        .collect();
    TargetConfig { subsystems }
}

/// Why a configuration could not be loaded.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum LoadError {
    /// The file could not be read.
    #[error("{path}: {source}")]
    Read {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The file is not a configuration document.
    #[error("{path}: not a target configuration: {source}")]
    Parse {
        /// The file.
        path: String,
        /// The error.
        source: serde_json::Error,
    },
    /// A subsystem this target does not have.
    #[error("{path}: unknown subsystem {subsystem:?} (known: {known})", known = SUBSYSTEMS.join(", "))]
    UnknownSubsystem {
        /// The file.
        path: String,
        /// The subsystem.
        subsystem: String,
    },
    /// A call failed.
    #[error("{path}: {method} failed: {error}")]
    Call {
        /// The file.
        path: String,
        /// The method.
        method: String,
        /// Its error.
        error: RpcError,
    },
}

/// Applies the configuration in `path` to `target`.
pub async fn load(target: &Target, path: &Path) -> Result<(), LoadError> {
    let shown = path.display().to_string();
    let text = std::fs::read_to_string(path).map_err(|source| LoadError::Read {
        path: shown.clone(),
        source,
    })?;
    let config: TargetConfig = serde_json::from_str(&text).map_err(|source| LoadError::Parse {
        path: shown.clone(),
        source,
    })?;
    if let Some(unknown) = config
        .subsystems
        .iter()
        .find(|s| !SUBSYSTEMS.contains(&s.subsystem.as_str()))
    {
        return Err(LoadError::UnknownSubsystem {
            path: shown,
            subsystem: unknown.subsystem.clone(),
        });
    }
    for &name in SUBSYSTEMS {
        for subsystem in config.subsystems.iter().filter(|s| s.subsystem == name) {
            for call in &subsystem.config {
                target
                    .call(&call.method, call.params.clone())
                    .await
                    .map_err(|error| LoadError::Call {
                        path: shown.clone(),
                        method: call.method.clone(),
                        error,
                    })?;
            }
        }
    }
    Ok(())
}
