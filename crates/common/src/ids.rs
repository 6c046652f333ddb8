//! Identifiers and versions of the cluster: typed, so they never mix across an API.

use std::fmt;

use serde::{Deserialize, Serialize};

/// An OSD's number, allocated by the monitor from the OSD's uuid.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct OsdId(pub u32);

/// A pool's number.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct PoolId(pub u32);

/// An image's number, unique in the cluster and never reused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ImageId(pub u64);

/// An object: an image and the object's number in it (offset in the image / object size).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ObjectKey {
    /// The image.
    pub image: ImageId,
    /// The object's number.
    pub number: u64,
}

/// A placement group: a pool and an index below the pool's `pg_count`.
#[derive(
    Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize,
)]
pub struct PgId {
    /// The pool.
    pub pool: PoolId,
    /// Index within the pool.
    pub index: u32,
}

/// A version of the cluster map; every change makes a new epoch.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Epoch(pub u64);

/// A log sequence number: the position of a batch in an OSD's log, 1 for the first.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default, Serialize, Deserialize,
)]
pub struct Lsn(pub u64);

impl Lsn {
    /// The first batch of a new log.
    pub const FIRST: Lsn = Lsn(1);

    /// The LSN after this one.
    pub fn next(self) -> Self {
        Lsn(self.0 + 1)
    }
}

impl Epoch {
    /// The epoch after this one.
    pub fn next(self) -> Self {
        Epoch(self.0 + 1)
    }
}

impl fmt::Display for OsdId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "osd.{}", self.0)
    }
}

impl fmt::Display for PoolId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for PgId {
    /// `1.3f`, as operators of Ceph know PG names: pool, then index in hex.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:x}", self.pool.0, self.index)
    }
}

impl fmt::Display for Epoch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "e{}", self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_display_as_operators_read_them() {
        assert_eq!(OsdId(3).to_string(), "osd.3");
        assert_eq!(
            PgId {
                pool: PoolId(1),
                index: 63
            }
            .to_string(),
            "1.3f"
        );
        assert_eq!(Epoch(7).next().to_string(), "e8");
    }
}
