//! The target's bdevs by name, with the call that recreates each and who uses it.
//!
//! A frontend that exports a bdev *claims* it; a claimed bdev cannot be deleted, so an
//! export never points at a device that is gone.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex, MutexGuard};

use basalt_common::{ConfigCall, RpcError};

use crate::bdev::Bdev;
use crate::io_stats::Counted;

/// Which family of RPC methods made a bdev (and may delete it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BdevKind {
    /// `bdev_malloc_create`.
    Malloc,
    /// `bdev_uring_create` or `bdev_aio_create`.
    File,
    /// `bdev_basalt_create`.
    Image,
}

impl BdevKind {
    /// The kind's name in messages.
    pub fn name(self) -> &'static str {
        match self {
            BdevKind::Malloc => "malloc",
            BdevKind::File => "file",
            BdevKind::Image => "image",
        }
    }
}

struct Entry {
    bdev: Arc<dyn Bdev>,
    kind: BdevKind,
    construct: ConfigCall,
    claims: Vec<String>,
}

/// A registered bdev as listed by `bdev_get_bdevs`.
pub struct Listed {
    /// The bdev (counted).
    pub bdev: Arc<dyn Bdev>,
    /// The call that made it.
    pub construct: ConfigCall,
    /// Who uses it (`nbd export disk0`).
    pub claims: Vec<String>,
}

/// The target's bdevs.
#[derive(Default)]
pub struct BdevRegistry {
    entries: Mutex<BTreeMap<String, Entry>>,
}

impl BdevRegistry {
    /// An empty registry.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, BTreeMap<String, Entry>> {
        self.entries
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Registers `bdev`, wrapped so its I/O is counted; its name must be free.
    pub fn insert(
        &self,
        bdev: Box<dyn Bdev>,
        kind: BdevKind,
        construct: ConfigCall,
    ) -> Result<(), RpcError> {
        let name = bdev.info().name.clone();
        let mut entries = self.lock();
        if entries.contains_key(&name) {
            return Err(RpcError::exists(format!(
                "bdev name {name:?} is already in use"
            )));
        }
        let bdev: Arc<dyn Bdev> = Arc::new(Counted::new(bdev));
        entries.insert(
            name,
            Entry {
                bdev,
                kind,
                construct,
                claims: Vec::new(),
            },
        );
        Ok(())
    }

    /// Whether a bdev of that name exists.
    pub fn contains(&self, name: &str) -> bool {
        self.lock().contains_key(name)
    }

    /// The first of `prefix0`, `prefix1`, ... that is free.
    pub fn free_name(&self, prefix: &str) -> String {
        let entries = self.lock();
        (0..)
            .map(|index| format!("{prefix}{index}"))
            .find(|name| !entries.contains_key(name))
            .expect("some index is free")
    }

    /// Marks the bdev as used by `owner` and returns it.
    pub fn claim(&self, name: &str, owner: &str) -> Result<Arc<dyn Bdev>, RpcError> {
        let mut entries = self.lock();
        let entry = entries.get_mut(name).ok_or_else(|| no_such_bdev(name))?;
        entry.claims.push(owner.to_string());
        Ok(entry.bdev.clone())
    }

    /// Drops `owner`'s claim on the bdev (no-op if it held none).
    pub fn release(&self, name: &str, owner: &str) {
        if let Some(entry) = self.lock().get_mut(name)
            && let Some(position) = entry.claims.iter().position(|claim| claim == owner)
        {
            entry.claims.remove(position);
        }
    }

    /// The bdev `name`, which must be of `kind` (nothing is claimed).
    pub fn get(&self, name: &str, kind: BdevKind) -> Result<Arc<dyn Bdev>, RpcError> {
        let entries = self.lock();
        let entry = entries.get(name).ok_or_else(|| no_such_bdev(name))?;
        check_kind(name, entry, kind)?;
        Ok(entry.bdev.clone())
    }

    /// Deletes a bdev of `kind`; refused while something uses it.
    pub fn remove(&self, name: &str, kind: BdevKind) -> Result<(), RpcError> {
        let mut entries = self.lock();
        let entry = entries.get(name).ok_or_else(|| no_such_bdev(name))?;
        check_kind(name, entry, kind)?;
        if !entry.claims.is_empty() {
            return Err(RpcError::busy(format!(
                "bdev {name:?} is in use by {}",
                entry.claims.join(", ")
            )));
        }
        entries.remove(name);
        Ok(())
    }

    /// Every bdev, by name.
    pub fn list(&self) -> Vec<Listed> {
        self.lock()
            .values()
            .map(|entry| Listed {
                bdev: entry.bdev.clone(),
                construct: entry.construct.clone(),
                claims: entry.claims.clone(),
            })
            .collect()
    }

    /// The calls that recreate every bdev, for `save_config`.
    pub fn config(&self) -> Vec<ConfigCall> {
        self.lock()
            .values()
            .map(|entry| entry.construct.clone())
            .collect()
    }
}

/// An error unless the entry `name` is of `kind`.
fn check_kind(name: &str, entry: &Entry, kind: BdevKind) -> Result<(), RpcError> {
    if entry.kind == kind {
        return Ok(());
    }
    Err(RpcError::invalid_params(format!(
        "bdev {name:?} is a {} bdev, not a {} bdev",
        entry.kind.name(),
        kind.name()
    )))
}

/// The error for a bdev name that is not registered.
pub fn no_such_bdev(name: &str) -> RpcError {
    RpcError::no_device(format!("bdev {name:?} not found"))
}
