//! The cluster map and the commands that change it.
//!
//! The map is a deterministic state machine: [`ClusterMap::apply`] takes a [`Command`] and
//! either changes the map (one new epoch per change) or refuses it with a [`MapError`]. The
//! monitors replicate commands through Raft and apply them in order, so every monitor holds
//! the same map; OSDs and clients receive it by epoch.
//!
//! PG membership follows [`crate::placement`] over the OSDs that are *in*. An OSD that is
//! *down* stays a member (its PGs keep a majority with the others) until it is marked *out*,
//! which moves its replicas elsewhere.

use std::collections::BTreeMap;
use std::ops::Range;

use basalt_common::{Epoch, ImageId, ObjectKey, OsdId, PgId, PoolId};
use serde::{Deserialize, Serialize};

use crate::placement::{self, Candidate};

/// The most replicas a pool may have.
pub const POOL_SIZE_MAX: u32 = 5;
/// The most PGs a pool may have.
pub const PG_COUNT_MAX: u32 = 32768;
/// PG replicas per OSD in at most, unless the monitors are told otherwise
/// (`basalt mon --max-pgs-per-osd`): each is a raft group with its heartbeats and memory on
/// its OSD, and every PG is in the map sent to every client (Ceph's `mon_max_pg_per_osd`
/// is 250).
pub const PGS_PER_OSD_MAX_DEFAULT: u32 = 1000;
/// The smallest and largest object sizes.
pub const OBJECT_SIZE_MIN: u64 = 4096;
/// The largest object size.
pub const OBJECT_SIZE_MAX: u64 = 64 << 20;
/// The object size of an image created without one.
pub const OBJECT_SIZE_DEFAULT: u64 = 4 << 20;
/// Names of pools and images: this long at most.
pub const NAME_SIZE_MAX: usize = 128;

/// An OSD as the map knows it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct OsdEntry {
    /// Its id.
    pub id: OsdId,
    /// The uuid it registered with (stable across restarts).
    pub uuid: String,
    /// Its host: the failure domain.
    pub host: String,
    /// Where it listens.
    pub address: String,
    /// Share of PGs it takes.
    pub weight: f64,
    /// Alive by its heartbeats.
    pub up: bool,
    /// Holds data (placement uses it).
    pub is_in: bool,
    /// Marked out by the monitors (down too long), not by an operator: it comes back in
    /// when it boots.
    #[serde(default)]
    pub auto_out: bool,
    /// Its log is full of live data: the leaders of its PGs refuse writes (ENOSPC at the
    /// client) rather than go on without it, as a replica that cannot persist would fall
    /// behind for good. Reported by the OSD, set by the monitors.
    #[serde(default)]
    pub full: bool,
}

/// One PG's members and the epoch they were last changed in.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgEntry {
    /// Member OSDs; the first is the preferred leader. When they change, the PG's leader
    /// moves its replicas here (raft configuration changes); until then the replicas may
    /// still be on the previous members.
    pub members: Vec<OsdId>,
    /// When the members last changed.
    pub epoch: Epoch,
    /// The members the PG was first placed on: every replica's raft group starts from
    /// them (see [`PgEntry::initial`]).
    #[serde(default)]
    pub initial: Vec<OsdId>,
}

impl PgEntry {
    /// The members the PG's raft groups start from.
    pub fn initial(&self) -> &[OsdId] {
        if self.initial.is_empty() {
            &self.members
        } else {
            &self.initial
        }
    }
}

/// A pool.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Pool {
    /// Its id.
    pub id: PoolId,
    /// Its name.
    pub name: String,
    /// Number of PGs.
    pub pg_count: u32,
    /// Replicas per PG.
    pub size: u32,
    /// Replicas needed to accept writes.
    pub min_size: u32,
    /// The PG table, by index.
    pub pgs: Vec<PgEntry>,
}

/// An image.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Image {
    /// Its id.
    pub id: ImageId,
    /// Its pool.
    pub pool: PoolId,
    /// Its name, unique in the pool.
    pub name: String,
    /// Size in bytes.
    pub size_bytes: u64,
    /// Bytes per object.
    pub object_size_bytes: u64,
    /// After a shrink, the bytes from `size_bytes` up to here may still hold data, which
    /// `basalt image resize` discards after the map's change (0: nothing is left): OSDs
    /// take discards there, and the image may not grow until they are done
    /// ([`Command::ImageDiscarded`]).
    #[serde(default)]
    pub discard_to: u64,
    /// The epoch of the map change that cut off what is left to discard (the last shrink
    /// or the removal): [`Command::ImageDiscarded`] names it, so that a discard done
    /// before the image grew back over the bytes and a later shrink cut them off again
    /// does not count for that later cut.
    #[serde(default)]
    pub cut_epoch: Epoch,
}

impl Pool {
    /// The PG that holds an object: a hash of the pool, image and object number, modulo
    /// the PG count (a power of two). Part of the data layout: it never changes.
    pub fn pg_of(&self, object: ObjectKey) -> PgId {
        let mut hash = u64::from(self.id.0) ^ 0x6a09_e667_f3bc_c908;
        for word in [object.image.0, object.number] {
            hash = mix(hash ^ mix(word));
        }
        PgId {
            pool: self.id,
            index: (hash % u64::from(self.pg_count.max(1))) as u32,
        }
    }
}

/// splitmix64's finaliser.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The cluster map.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ClusterMap {
    /// Version; every change makes a new one.
    pub epoch: Epoch,
    /// OSDs by id.
    pub osds: BTreeMap<OsdId, OsdEntry>,
    /// Pools by id.
    pub pools: BTreeMap<PoolId, Pool>,
    /// Images by id.
    pub images: BTreeMap<ImageId, Image>,
    next_pool: u32,
    next_image: u64,
    /// OSDs removed from the cluster (`basalt osd rm`), by id, with their uuids: the ids
    /// are never given again (a PG's raft groups may still name one), and an OSD of that
    /// uuid may not boot again (its device holds replicas under the old id).
    #[serde(default)]
    pub removed: BTreeMap<OsdId, String>,
    /// Images removed whose data may still be on the OSDs, by id: `basalt image rm`
    /// discards it after the map's change, then drops the image from here
    /// ([`Command::ImageDiscarded`]). OSDs take discards of their objects, nothing else.
    #[serde(default)]
    pub removing: BTreeMap<ImageId, Image>,
}

/// A change to the map.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum Command {
    /// An OSD starts: gets an id for its uuid (the same id every time) and is marked up
    /// and in.
    OsdBoot {
        /// Its uuid.
        uuid: String,
        /// Its host.
        host: String,
        /// Where it listens.
        address: String,
        /// Its weight.
        weight: f64,
    },
    /// Heartbeats stopped: the OSD is down (still a member of its PGs).
    OsdDown {
        /// The OSD.
        id: OsdId,
    },
    /// The OSD holds no data any more: its PGs move elsewhere.
    OsdOut {
        /// The OSD.
        id: OsdId,
        /// By the monitors (down past the down-out interval), not by an operator.
        #[serde(default)]
        auto: bool,
    },
    /// The OSD holds data again: PGs move to it.
    OsdIn {
        /// The OSD.
        id: OsdId,
    },
    /// The OSD leaves the cluster for good: it must be down and out, and no PG's members
    /// may name it.
    OsdRemove {
        /// The OSD.
        id: OsdId,
    },
    /// The OSD reports its log full, or no longer full.
    OsdFull {
        /// The OSD.
        id: OsdId,
        /// Full.
        full: bool,
    },
    /// Create a pool.
    PoolCreate {
        /// Name.
        name: String,
        /// Number of PGs (a power of two).
        pg_count: u32,
        /// Replicas.
        size: u32,
        /// Replicas needed for writes (default: a majority of `size`).
        min_size: Option<u32>,
    },
    /// Remove an empty pool.
    PoolRemove {
        /// Name.
        name: String,
    },
    /// Create an image.
    ImageCreate {
        /// Pool name.
        pool: String,
        /// Image name.
        name: String,
        /// Size in bytes.
        size_bytes: u64,
        /// Bytes per object (default 4 MiB).
        object_size_bytes: Option<u64>,
    },
    /// Change an image's size.
    ImageResize {
        /// Pool name.
        pool: String,
        /// Image name.
        name: String,
        /// New size.
        size_bytes: u64,
        /// Refuse a smaller size ([`MapError::Shrink`]): `basalt image resize` without
        /// `--allow-shrink`. False in commands from before it existed (a journal
        /// replayed), which apply as they did then.
        #[serde(default)]
        grow_only: bool,
    },
    /// Remove an image: it moves to [`ClusterMap::removing`] until its data is discarded.
    ImageRemove {
        /// Pool name.
        pool: String,
        /// Image name.
        name: String,
        /// The image's id as the command saw it, if it names one: another image of that
        /// name (the one seen removed and the name given again since) stays.
        #[serde(default)]
        id: Option<ImageId>,
    },
    /// Bytes `from..to` of an image were discarded after a shrink (the image no longer
    /// keeps bytes past its end once they cover them, and may grow again) or after its
    /// removal (the image is forgotten once they cover it). Otherwise nothing changes.
    ImageDiscarded {
        /// The image.
        id: ImageId,
        /// The first byte discarded.
        from: u64,
        /// The end of the bytes discarded.
        to: u64,
        /// The image's [`Image::cut_epoch`] when the discard began: after another cut
        /// since, nothing changes. Absent (0) in commands from before cuts were numbered,
        /// which apply as they did then.
        #[serde(default)]
        since: Epoch,
    },
}

/// Why a command was refused. Messages name the object and the value.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum MapError {
    /// No such pool.
    #[error("pool {name:?} does not exist")]
    UnknownPool {
        /// The name given.
        name: String,
    },
    /// No such image.
    #[error("image {pool}/{name} does not exist")]
    UnknownImage {
        /// Pool name.
        pool: String,
        /// Image name.
        name: String,
    },
    /// A resize that would shrink the image, not allowed.
    #[error(
        "image {image} is {size}: a resize to {asked} would discard the data past it, for \
         good (`basalt image resize --allow-shrink` does)"
    )]
    Shrink {
        /// POOL/NAME.
        image: String,
        /// Its size.
        size: basalt_common::ByteSize,
        /// The size asked for.
        asked: basalt_common::ByteSize,
    },
    /// The image of that name is another than the command saw.
    #[error("image {image} is another image now (id {now}, not {seen}): look again")]
    ImageReplaced {
        /// POOL/NAME.
        image: String,
        /// The id the command saw.
        seen: u64,
        /// The id of the image of that name now.
        now: u64,
    },
    /// No such OSD.
    #[error("{id} does not exist")]
    UnknownOsd {
        /// The id given.
        id: OsdId,
    },
    /// The name is taken.
    #[error("{kind} {name:?} already exists")]
    Exists {
        /// "pool" or "image".
        kind: &'static str,
        /// The name.
        name: String,
    },
    /// A parameter out of range.
    #[error("{parameter} {value} is not allowed: {rule}")]
    Invalid {
        /// The parameter.
        parameter: &'static str,
        /// Its value.
        value: String,
        /// What is allowed.
        rule: &'static str,
    },
    /// The OSD may not be removed yet.
    #[error("{id} cannot be removed: {reason}")]
    OsdInUse {
        /// The OSD.
        id: OsdId,
        /// Why not, and what to do first.
        reason: String,
    },
    /// The OSD of that uuid was removed from the cluster.
    #[error(
        "the osd of uuid {uuid} was removed from the cluster (it was {id}); to join again it needs a fresh device (delete its device file)"
    )]
    OsdRemoved {
        /// Its old id.
        id: OsdId,
        /// Its uuid.
        uuid: String,
    },
    /// The image may not grow yet.
    #[error(
        "image {image} cannot grow yet: the data a shrink cut off ({from}..{to}) is still being discarded (`basalt image resize` finishes it first)"
    )]
    Discarding {
        /// POOL/NAME.
        image: String,
        /// The bytes still to discard.
        from: u64,
        /// Their end.
        to: u64,
    },
    /// The pool still holds images.
    #[error("pool {name:?} still holds {images} image(s)")]
    PoolNotEmpty {
        /// The pool.
        name: String,
        /// How many images.
        images: usize,
    },
}

impl ClusterMap {
    /// An empty map at epoch 0.
    pub fn new() -> Self {
        Self::default()
    }

    /// The pool of that name.
    pub fn pool_by_name(&self, name: &str) -> Option<&Pool> {
        self.pools.values().find(|pool| pool.name == name)
    }

    /// The image `id` and the bytes an OSD takes requests for: for writes, reads and a
    /// host's discards (`cut` false) its size; for the discards that `basalt image resize`
    /// and `image rm` make (`cut`), only what the map keeps for them, that no other request
    /// reaches: what a shrink cut off, or all of an image being removed
    /// ([`ClusterMap::removing`]); empty when there is none.
    pub fn image_range(&self, id: ImageId, cut: bool) -> Option<(&Image, Range<u64>)> {
        match self.images.get(&id) {
            Some(image) if cut => {
                let end = image.discard_to.max(image.size_bytes);
                Some((image, image.size_bytes..end))
            }
            Some(image) => Some((image, 0..image.size_bytes)),
            None if cut => self
                .removing
                .get(&id)
                .map(|image| (image, 0..image.size_bytes)),
            None => None,
        }
    }

    /// The image of that name in that pool.
    pub fn image_by_name(&self, pool: &str, name: &str) -> Option<&Image> {
        let pool = self.pool_by_name(pool)?;
        self.images
            .values()
            .find(|image| image.pool == pool.id && image.name == name)
    }

    /// The members of a PG.
    pub fn pg(&self, pg: PgId) -> Option<&PgEntry> {
        self.pools.get(&pg.pool)?.pgs.get(pg.index as usize)
    }

    /// Applies a command: `Ok(true)` if the map changed (and its epoch advanced).
    pub fn apply(&mut self, command: &Command) -> Result<bool, MapError> {
        #[cfg(debug_assertions)]
        let before = self.clone();
        let next = self.epoch.next();
        let changed = match command {
            Command::OsdBoot {
                uuid,
                host,
                address,
                weight,
            } => self.osd_boot(uuid, host, address, *weight)?,
            Command::OsdDown { id } => self.osd_mut(*id)?.set_up(false),
            Command::OsdOut { id, auto } => {
                let osd = self.osd_mut(*id)?;
                let changed = osd.set_in(false);
                if changed {
                    osd.auto_out = *auto;
                }
                changed
            }
            Command::OsdIn { id } => {
                let osd = self.osd_mut(*id)?;
                osd.auto_out = false;
                osd.set_in(true)
            }
            Command::OsdRemove { id } => {
                self.osd_remove(*id)?;
                true
            }
            Command::OsdFull { id, full } => {
                let osd = self.osd_mut(*id)?;
                std::mem::replace(&mut osd.full, *full) != *full
            }
            Command::PoolCreate {
                name,
                pg_count,
                size,
                min_size,
            } => {
                self.pool_create(name, *pg_count, *size, *min_size)?;
                true
            }
            Command::PoolRemove { name } => {
                self.pool_remove(name)?;
                true
            }
            Command::ImageCreate {
                pool,
                name,
                size_bytes,
                object_size_bytes,
            } => {
                self.image_create(
                    pool,
                    name,
                    *size_bytes,
                    object_size_bytes.unwrap_or(OBJECT_SIZE_DEFAULT),
                )?;
                true
            }
            Command::ImageResize {
                pool,
                name,
                size_bytes,
                grow_only,
            } => self.image_resize(pool, name, (*size_bytes, *grow_only), next)?,
            Command::ImageRemove {
                pool,
                name,
                id: seen,
            } => {
                let id = self
                    .image_by_name(pool, name)
                    .map(|image| image.id)
                    .ok_or_else(|| unknown_image(pool, name))?;
                if let Some(seen) = *seen
                    && seen != id
                {
                    return Err(MapError::ImageReplaced {
                        image: format!("{pool}/{name}"),
                        seen: seen.0,
                        now: id.0,
                    });
                }
                let mut image = self.images.remove(&id).expect("found above");
                // Its data, all of it, is discarded from here on.
                image.size_bytes = image.size_bytes.max(image.discard_to);
                image.discard_to = 0;
                image.cut_epoch = next;
                self.removing.insert(id, image);
                true
            }
            Command::ImageDiscarded {
                id,
                from,
                to,
                since,
            } => self.image_discarded(*id, *from..*to, *since),
        };
        if !changed {
            #[cfg(debug_assertions)]
            debug_assert_eq!(&before, self, "an unchanged map is untouched");
            return Ok(false);
        }
        self.place_pgs(next);
        self.epoch = next;
        Ok(true)
    }

    fn osd_mut(&mut self, id: OsdId) -> Result<&mut OsdEntry, MapError> {
        self.osds.get_mut(&id).ok_or(MapError::UnknownOsd { id })
    }

    fn osd_boot(
        &mut self,
        uuid: &str,
        host: &str,
        address: &str,
        weight: f64,
    ) -> Result<bool, MapError> {
        if !(weight.is_finite() && weight >= 0.0) {
            return Err(invalid("weight", weight, "a number of 0 or more"));
        }
        if let Some((id, _)) = self.removed.iter().find(|(_, removed)| *removed == uuid) {
            return Err(MapError::OsdRemoved {
                id: *id,
                uuid: uuid.to_string(),
            });
        }
        // The seed's `fakeapplyid`: the same uuid always gets the same id; a new uuid gets
        // the lowest id never given.
        let id = match self.osds.values().find(|osd| osd.uuid == uuid) {
            Some(osd) => osd.id,
            None => (0..)
                .map(OsdId)
                .find(|id| !self.osds.contains_key(id) && !self.removed.contains_key(id))
                .expect("a free id exists"),
        };
        // An OSD comes back in when it boots, unless an operator took it out.
        let is_in = self
            .osds
            .get(&id)
            .is_none_or(|known| known.is_in || known.auto_out);
        let entry = OsdEntry {
            id,
            uuid: uuid.to_string(),
            host: host.to_string(),
            address: address.to_string(),
            weight,
            up: true,
            is_in,
            auto_out: false,
            // Full until it reports otherwise: it held the same log before it restarted.
            full: self.osds.get(&id).is_some_and(|known| known.full),
        };
        let changed = self.osds.get(&id) != Some(&entry);
        self.osds.insert(id, entry);
        Ok(changed)
    }

    fn osd_remove(&mut self, id: OsdId) -> Result<(), MapError> {
        let osd = self.osds.get(&id).ok_or(MapError::UnknownOsd { id })?;
        let refuse = |reason: String| Err(MapError::OsdInUse { id, reason });
        if osd.up {
            return refuse(
                "it is up; stop it first (or wait for the monitors to mark it down)".into(),
            );
        }
        if osd.is_in {
            return refuse(format!(
                "it is in; mark it out first (`basalt osd out {}`) so that its PGs move",
                id.0
            ));
        }
        let pgs: Vec<PgId> = self
            .pools
            .values()
            .flat_map(|pool| {
                pool.pgs
                    .iter()
                    .enumerate()
                    .filter_map(move |(index, entry)| {
                        entry.members.contains(&id).then_some(PgId {
                            pool: pool.id,
                            index: index as u32,
                        })
                    })
            })
            .collect();
        if let Some(first) = pgs.first() {
            return refuse(format!(
                "{} PG(s) still place replicas on it ({first} first)",
                pgs.len()
            ));
        }
        let osd = self.osds.remove(&id).expect("checked above");
        self.removed.insert(id, osd.uuid);
        Ok(())
    }

    fn pool_create(
        &mut self,
        name: &str,
        pg_count: u32,
        size: u32,
        min_size: Option<u32>,
    ) -> Result<(), MapError> {
        check_name("pool name", name)?;
        if self.pool_by_name(name).is_some() {
            return Err(MapError::Exists {
                kind: "pool",
                name: name.to_string(),
            });
        }
        if !pg_count.is_power_of_two() || pg_count > PG_COUNT_MAX {
            return Err(invalid(
                "pg_count",
                pg_count,
                "a power of two from 1 to 32768",
            ));
        }
        if size == 0 || size > POOL_SIZE_MAX {
            return Err(invalid("size", size, "1 to 5 replicas"));
        }
        // Applied as logged: a min_size below a majority, which the monitors refuse now
        // (`ClusterMap::refusal`), is in the logs of clusters made before.
        let min_size = min_size.unwrap_or(size / 2 + 1);
        if min_size == 0 || min_size > size {
            return Err(invalid("min_size", min_size, "1 to the pool's size"));
        }
        let id = PoolId(self.next_pool);
        self.next_pool += 1;
        let pgs = vec![
            PgEntry {
                members: Vec::new(),
                epoch: Epoch(0),
                initial: Vec::new(),
            };
            pg_count as usize
        ];
        self.pools.insert(
            id,
            Pool {
                id,
                name: name.to_string(),
                pg_count,
                size,
                min_size,
                pgs,
            },
        );
        Ok(())
    }

    fn pool_remove(&mut self, name: &str) -> Result<(), MapError> {
        let pool = self
            .pool_by_name(name)
            .ok_or_else(|| MapError::UnknownPool {
                name: name.to_string(),
            })?
            .id;
        let images = self
            .images
            .values()
            .filter(|image| image.pool == pool)
            .count();
        if images > 0 {
            return Err(MapError::PoolNotEmpty {
                name: name.to_string(),
                images,
            });
        }
        self.pools.remove(&pool);
        // The PGs go, and their data with them.
        self.removing.retain(|_, image| image.pool != pool);
        Ok(())
    }

    fn image_create(
        &mut self,
        pool: &str,
        name: &str,
        size_bytes: u64,
        object_size_bytes: u64,
    ) -> Result<(), MapError> {
        let pool_id = self
            .pool_by_name(pool)
            .ok_or_else(|| MapError::UnknownPool {
                name: pool.to_string(),
            })?
            .id;
        check_name("image name", name)?;
        if self.image_by_name(pool, name).is_some() {
            return Err(MapError::Exists {
                kind: "image",
                name: format!("{pool}/{name}"),
            });
        }
        check_size(size_bytes)?;
        if !object_size_bytes.is_power_of_two()
            || !(OBJECT_SIZE_MIN..=OBJECT_SIZE_MAX).contains(&object_size_bytes)
        {
            return Err(invalid(
                "object size",
                object_size_bytes,
                "a power of two from 4KiB to 64MiB",
            ));
        }
        let id = ImageId(self.next_image);
        self.next_image += 1;
        self.images.insert(
            id,
            Image {
                id,
                pool: pool_id,
                name: name.to_string(),
                size_bytes,
                object_size_bytes,
                discard_to: 0,
                cut_epoch: Epoch(0),
            },
        );
        Ok(())
    }

    fn image_resize(
        &mut self,
        pool: &str,
        name: &str,
        (size_bytes, grow_only): (u64, bool),
        epoch: Epoch,
    ) -> Result<bool, MapError> {
        check_size(size_bytes)?;
        let id = self
            .image_by_name(pool, name)
            .map(|image| image.id)
            .ok_or_else(|| unknown_image(pool, name))?;
        let image = self.images.get_mut(&id).expect("found above");
        if grow_only && size_bytes < image.size_bytes {
            return Err(MapError::Shrink {
                image: format!("{pool}/{name}"),
                size: basalt_common::ByteSize(image.size_bytes),
                asked: basalt_common::ByteSize(size_bytes),
            });
        }
        if size_bytes > image.size_bytes && image.discard_to > image.size_bytes {
            // Growing would bring back what the shrink cut off.
            return Err(MapError::Discarding {
                image: format!("{pool}/{name}"),
                from: image.size_bytes,
                to: image.discard_to,
            });
        }
        let changed = image.size_bytes != size_bytes;
        if size_bytes < image.size_bytes {
            image.discard_to = image.discard_to.max(image.size_bytes);
            image.cut_epoch = epoch;
        }
        image.size_bytes = size_bytes;
        Ok(changed)
    }

    /// [`Command::ImageDiscarded`]: whether the map changed. The bytes discarded must
    /// cover all that is left, since the cut they were discarded for (a later shrink may
    /// have cut off more, or the same bytes again after a grow wrote them).
    fn image_discarded(&mut self, id: ImageId, discarded: Range<u64>, since: Epoch) -> bool {
        let Some((image, left)) = self.image_range(id, true) else {
            return false;
        };
        // Since 0: a command from before cuts were numbered (a journal replayed, an older
        // CLI), applied as it was then; no cut is numbered 0.
        if left.is_empty()
            || (since != Epoch(0) && image.cut_epoch != since)
            || discarded.start > left.start
            || discarded.end < left.end
        {
            return false;
        }
        if self.removing.remove(&id).is_none() {
            self.images.get_mut(&id).expect("found above").discard_to = 0;
        }
        true
    }

    /// Recomputes every PG's members from the OSDs that are in; PGs whose members change
    /// get `epoch`.
    fn place_pgs(&mut self, epoch: Epoch) {
        let candidates: Vec<Candidate> = self
            .osds
            .values()
            .filter(|osd| osd.is_in)
            .map(|osd| Candidate {
                osd: osd.id,
                host: osd.host.clone(),
                weight: osd.weight,
            })
            .collect();
        for pool in self.pools.values_mut() {
            for (index, entry) in pool.pgs.iter_mut().enumerate() {
                let pg = PgId {
                    pool: pool.id,
                    index: index as u32,
                };
                let members = placement::place(pg, pool.size as usize, &candidates);
                if members != entry.members {
                    if entry.initial.is_empty() {
                        // The first placement (or a map from before this field: the members
                        // its groups were started with).
                        entry.initial = if entry.members.is_empty() {
                            members.clone()
                        } else {
                            entry.members.clone()
                        };
                    }
                    entry.members = members;
                    entry.epoch = epoch;
                }
            }
        }
    }
}

impl OsdEntry {
    /// Whether the leaders of its PGs refuse writes for it: full and up. A full OSD that
    /// is down holds nothing back (it is not a copy meanwhile, and it reports again when
    /// it comes back).
    pub fn holds_writes_back(&self) -> bool {
        self.full && self.up
    }

    fn set_up(&mut self, up: bool) -> bool {
        std::mem::replace(&mut self.up, up) != up
    }

    fn set_in(&mut self, is_in: bool) -> bool {
        std::mem::replace(&mut self.is_in, is_in) != is_in
    }
}

fn check_name(parameter: &'static str, name: &str) -> Result<(), MapError> {
    let allowed = |c: char| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.');
    if name.is_empty() || name.len() > NAME_SIZE_MAX || !name.chars().all(allowed) {
        return Err(invalid(parameter, name, "1 to 128 of A-Z a-z 0-9 - _ ."));
    }
    Ok(())
}

/// An image size the map takes: a positive multiple of 512 bytes.
pub fn check_size(size_bytes: u64) -> Result<(), MapError> {
    if size_bytes == 0 || !size_bytes.is_multiple_of(512) {
        return Err(invalid(
            "size",
            size_bytes,
            "a positive multiple of 512 bytes",
        ));
    }
    Ok(())
}

impl ClusterMap {
    /// Why the monitors' leader refuses to propose `command` (checked before the command
    /// goes in the log, never when it applies: a monitor's settings, and rules newer than
    /// commands already logged, must not make monitors apply the log differently), or
    /// `None`. `max_pgs_per_osd`: see [`PGS_PER_OSD_MAX_DEFAULT`].
    pub fn refusal(&self, command: &Command, max_pgs_per_osd: u32) -> Option<String> {
        let Command::PoolCreate {
            name,
            pg_count,
            size,
            min_size,
        } = command
        else {
            return None;
        };
        let majority = size / 2 + 1;
        if let Some(min_size) = min_size.filter(|min_size| *min_size < majority) {
            return Some(format!(
                "min_size {min_size}: at least {majority}, a majority of the pool's size {size} \
                 (raft commits a write only on a majority of the replicas, so fewer cannot \
                 take writes)"
            ));
        }
        let (per_osd, osds) = self.pg_replicas_per_osd_with(*pg_count, *size);
        (per_osd > u64::from(max_pgs_per_osd)).then(|| {
            format!(
                "pool {name}: {pg_count} PGs of {size} replicas would put {per_osd} PG \
                 replicas on each of the {osds} OSDs in, more than {max_pgs_per_osd} (basalt \
                 mon --max-pgs-per-osd); create fewer PGs or add OSDs first"
            )
        })
    }

    /// The PG replicas each OSD in would hold with a new pool of `pg_count` PGs of `size`
    /// replicas besides the pools there are, and the OSDs counted (those in, at least the
    /// pool's size: a pool made before its OSDs boot counts as many as it needs).
    pub fn pg_replicas_per_osd_with(&self, pg_count: u32, size: u32) -> (u64, u64) {
        let osds = self.osds.values().filter(|osd| osd.is_in).count() as u64;
        let osds = osds.max(u64::from(size)).max(1);
        let replicas: u64 = self
            .pools
            .values()
            .map(|pool| u64::from(pool.pg_count) * u64::from(pool.size))
            .sum::<u64>()
            + u64::from(pg_count) * u64::from(size);
        (replicas.div_ceil(osds), osds)
    }
}

fn invalid(parameter: &'static str, value: impl std::fmt::Display, rule: &'static str) -> MapError {
    MapError::Invalid {
        parameter,
        value: value.to_string(),
        rule,
    }
}

fn unknown_image(pool: &str, name: &str) -> MapError {
    MapError::UnknownImage {
        pool: pool.to_string(),
        name: name.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeSet;

    /// The full flag follows the OSD's reports, bumps the epoch only when it changes, and
    /// stays across a reboot until the OSD reports otherwise.
    #[test]
    fn the_full_flag_follows_reports_and_survives_a_boot() {
        let mut map = ClusterMap::new();
        let id = boot(&mut map, "u1", "host0");
        assert!(!map.osds[&id].full);
        let epoch = map.epoch;
        assert_eq!(map.apply(&Command::OsdFull { id, full: true }), Ok(true));
        assert!(map.osds[&id].full);
        assert!(map.epoch > epoch);
        let epoch = map.epoch;
        assert_eq!(map.apply(&Command::OsdFull { id, full: true }), Ok(false));
        assert_eq!(map.epoch, epoch, "no change, no epoch");
        boot(&mut map, "u1", "host0");
        assert!(map.osds[&id].full, "still full after a boot");
        assert_eq!(map.apply(&Command::OsdFull { id, full: false }), Ok(true));
        assert!(!map.osds[&id].full);
        assert!(
            map.apply(&Command::OsdFull {
                id: OsdId(99),
                full: true
            })
            .is_err(),
            "an unknown osd"
        );
    }

    fn boot(map: &mut ClusterMap, uuid: &str, host: &str) -> OsdId {
        let address = format!("127.0.0.1:7000/{uuid}");
        let command = Command::OsdBoot {
            uuid: uuid.into(),
            host: host.into(),
            address,
            weight: 1.0,
        };
        map.apply(&command).expect("boot");
        map.osds
            .values()
            .find(|osd| osd.uuid == uuid)
            .expect("registered")
            .id
    }

    fn three_hosts() -> ClusterMap {
        let mut map = ClusterMap::new();
        for n in 0..6 {
            boot(&mut map, &format!("uuid-{n}"), &format!("host{}", n % 3));
        }
        map.apply(&Command::PoolCreate {
            name: "rbd".into(),
            pg_count: 64,
            size: 3,
            min_size: None,
        })
        .expect("pool");
        map
    }

    #[test]
    fn osd_ids_follow_their_uuid_across_restarts() {
        let mut map = ClusterMap::new();
        assert_eq!(boot(&mut map, "a", "h"), OsdId(0));
        assert_eq!(boot(&mut map, "b", "h"), OsdId(1));
        let epoch = map.epoch;
        assert_eq!(boot(&mut map, "a", "h"), OsdId(0), "same uuid, same id");
        assert_eq!(map.epoch, epoch, "an identical boot changes nothing");
        map.apply(&Command::OsdDown { id: OsdId(0) }).expect("down");
        assert!(!map.osds[&OsdId(0)].up);
        assert_eq!(boot(&mut map, "a", "h"), OsdId(0));
        assert!(map.osds[&OsdId(0)].up, "a reboot brings it up");
        assert_eq!(
            map.apply(&Command::OsdDown { id: OsdId(9) }),
            Err(MapError::UnknownOsd { id: OsdId(9) })
        );
    }

    #[test]
    fn proposals_below_a_majority_or_past_the_pgs_per_osd_are_refused() {
        let mut map = ClusterMap::new();
        let pool = |pg_count, size, min_size| Command::PoolCreate {
            name: "p".into(),
            pg_count,
            size,
            min_size,
        };
        let refused = |map: &ClusterMap, command| map.refusal(&command, 1000);
        let low = refused(&map, pool(64, 3, Some(1))).expect("min_size 1 of 3");
        assert!(low.contains("min_size 1: at least 2"), "{low}");
        assert_eq!(refused(&map, pool(64, 3, Some(2))), None);
        assert_eq!(refused(&map, pool(64, 3, None)), None);
        // No OSD in yet: counted as the pool's size.
        assert_eq!(refused(&map, pool(1000, 3, None)), None);
        let many = refused(&map, pool(2048, 3, None)).expect("2048 per OSD");
        assert!(
            many.contains("would put 2048 PG replicas on each of the 3 OSDs in"),
            "{many}"
        );
        // Applied all the same when logged (a cluster made before the rule).
        map.apply(&pool(64, 3, Some(1))).expect("applied as logged");
        let more = refused(&map, pool(1000, 3, None)).expect("with the pool there");
        assert!(more.contains("1064 PG replicas"), "{more}");
    }

    #[test]
    fn pools_get_pgs_on_distinct_hosts_and_majority_min_size() {
        let map = three_hosts();
        let pool = map.pool_by_name("rbd").expect("pool");
        assert_eq!((pool.pg_count, pool.size, pool.min_size), (64, 3, 2));
        for pg in &pool.pgs {
            let hosts: BTreeSet<&str> = pg
                .members
                .iter()
                .map(|id| map.osds[id].host.as_str())
                .collect();
            assert_eq!(hosts.len(), 3, "{pg:?}");
            assert_eq!(pg.epoch, map.epoch);
        }
    }

    #[test]
    fn bad_pool_parameters_are_refused_by_name() {
        let mut map = three_hosts();
        let cases = [
            (
                Command::PoolCreate {
                    name: "rbd".into(),
                    pg_count: 64,
                    size: 3,
                    min_size: None,
                },
                "already exists",
            ),
            (
                Command::PoolCreate {
                    name: "p".into(),
                    pg_count: 100,
                    size: 3,
                    min_size: None,
                },
                "pg_count 100",
            ),
            (
                Command::PoolCreate {
                    name: "p".into(),
                    pg_count: 64,
                    size: 0,
                    min_size: None,
                },
                "size 0",
            ),
            (
                Command::PoolCreate {
                    name: "p".into(),
                    pg_count: 64,
                    size: 3,
                    min_size: Some(4),
                },
                "min_size 4",
            ),
            (
                Command::PoolCreate {
                    name: "a b".into(),
                    pg_count: 64,
                    size: 3,
                    min_size: None,
                },
                "pool name",
            ),
            (
                Command::PoolRemove {
                    name: "nope".into(),
                },
                "pool \"nope\" does not exist",
            ),
        ];
        let epoch = map.epoch;
        for (command, message) in cases {
            let error = map.apply(&command).expect_err("refused").to_string();
            assert!(error.contains(message), "{command:?}: {error}");
        }
        assert_eq!(map.epoch, epoch, "refused commands change nothing");
    }

    #[test]
    fn images_are_created_resized_and_removed() {
        let mut map = three_hosts();
        map.apply(&Command::ImageCreate {
            pool: "rbd".into(),
            name: "vm1".into(),
            size_bytes: 10 << 30,
            object_size_bytes: None,
        })
        .expect("create");
        let image = map.image_by_name("rbd", "vm1").expect("image").clone();
        assert_eq!(
            (image.size_bytes, image.object_size_bytes),
            (10 << 30, 4 << 20)
        );
        let refusals = [
            (
                Command::ImageCreate {
                    pool: "rbd".into(),
                    name: "vm1".into(),
                    size_bytes: 4096,
                    object_size_bytes: None,
                },
                "already exists",
            ),
            (
                Command::ImageCreate {
                    pool: "nope".into(),
                    name: "x".into(),
                    size_bytes: 4096,
                    object_size_bytes: None,
                },
                "pool \"nope\"",
            ),
            (
                Command::ImageCreate {
                    pool: "rbd".into(),
                    name: "x".into(),
                    size_bytes: 0,
                    object_size_bytes: None,
                },
                "size 0",
            ),
            (
                Command::ImageCreate {
                    pool: "rbd".into(),
                    name: "x".into(),
                    size_bytes: 4096,
                    object_size_bytes: Some(3000),
                },
                "object size",
            ),
            (
                Command::ImageResize {
                    pool: "rbd".into(),
                    name: "vm2".into(),
                    size_bytes: 4096,
                    grow_only: false,
                },
                "rbd/vm2 does not exist",
            ),
            (
                Command::PoolRemove { name: "rbd".into() },
                "still holds 1 image",
            ),
        ];
        for (command, message) in refusals {
            let error = map.apply(&command).expect_err("refused").to_string();
            assert!(error.contains(message), "{command:?}: {error}");
        }
        assert_eq!(
            map.apply(&Command::ImageResize {
                pool: "rbd".into(),
                name: "vm1".into(),
                size_bytes: 20 << 30,
                grow_only: false,
            }),
            Ok(true)
        );
        assert_eq!(
            map.image_by_name("rbd", "vm1").map(|i| i.size_bytes),
            Some(20 << 30)
        );
        assert_eq!(
            map.apply(&Command::ImageRemove {
                pool: "rbd".into(),
                name: "vm1".into(),
                id: None,
            }),
            Ok(true)
        );
        assert_eq!(
            map.apply(&Command::PoolRemove { name: "rbd".into() }),
            Ok(true)
        );
        assert!(map.pools.is_empty());
        assert!(
            map.removing.is_empty(),
            "the pool's removal takes its images' data"
        );
    }

    /// A resize that only may grow refuses a smaller size and leaves the map as it was;
    /// the same size and a larger one go through, and so does a shrink allowed (as every
    /// resize from before the choice existed).
    #[test]
    fn a_shrink_needs_to_be_allowed() {
        const MIB: u64 = 1 << 20;
        let mut map = three_hosts();
        map.apply(&Command::ImageCreate {
            pool: "rbd".into(),
            name: "vm".into(),
            size_bytes: 10 * MIB,
            object_size_bytes: None,
        })
        .expect("create");
        let resize = |size_bytes, grow_only| Command::ImageResize {
            pool: "rbd".into(),
            name: "vm".into(),
            size_bytes,
            grow_only,
        };
        let before = map.clone();
        let error = map.apply(&resize(8 * MIB, true)).expect_err("a shrink");
        assert_eq!(
            error.to_string(),
            "image rbd/vm is 10MiB: a resize to 8MiB would discard the data past it, for good \
             (`basalt image resize --allow-shrink` does)"
        );
        assert_eq!(map, before);
        assert_eq!(map.apply(&resize(10 * MIB, true)), Ok(false));
        assert_eq!(map.apply(&resize(12 * MIB, true)), Ok(true));
        assert_eq!(map.apply(&resize(8 * MIB, false)), Ok(true));
        // A command in a journal from before has no choice recorded: it shrinks.
        let legacy = r#"{"ImageResize":{"pool":"rbd","name":"vm","size_bytes":4194304}}"#;
        let legacy: Command = serde_json::from_str(legacy).expect("decodes");
        assert_eq!(legacy, resize(4 * MIB, false));
    }

    /// What a shrink cuts off and a removed image stay in the map, for discards only,
    /// until `ImageDiscarded` covers them, for that cut; an image may not grow over what
    /// is left.
    #[test]
    fn cut_off_data_is_kept_for_discards_until_it_is_discarded() {
        const MIB: u64 = 1 << 20;
        let mut map = three_hosts();
        let (pool, name) = ("rbd".to_string(), "vm".to_string());
        let resize = |size_bytes| Command::ImageResize {
            pool: pool.clone(),
            name: name.clone(),
            size_bytes,
            grow_only: false,
        };
        map.apply(&Command::ImageCreate {
            pool: pool.clone(),
            name: name.clone(),
            size_bytes: 10 * MIB,
            object_size_bytes: None,
        })
        .expect("create");
        let id = map.image_by_name(&pool, &name).expect("image").id;
        let range = |map: &ClusterMap, cut| map.image_range(id, cut).map(|(_, range)| range);
        let since = |map: &ClusterMap| map.image_range(id, true).expect("image").0.cut_epoch;
        assert_eq!(range(&map, true), Some(10 * MIB..10 * MIB), "nothing cut");
        assert_eq!(map.apply(&resize(8 * MIB)), Ok(true));
        let first_cut = since(&map);
        assert_eq!(map.apply(&resize(6 * MIB)), Ok(true));
        assert_eq!(
            (range(&map, false), range(&map, true)),
            (Some(0..6 * MIB), Some(6 * MIB..10 * MIB))
        );
        let error = map
            .apply(&resize(7 * MIB))
            .expect_err("no growing")
            .to_string();
        assert!(error.contains("still being discarded"), "{error}");
        let discarded = |from, to, since| Command::ImageDiscarded {
            id,
            from,
            to,
            since,
        };
        let discard = |map: &mut ClusterMap, bytes: Range<u64>, since| {
            map.apply(&discarded(bytes.start, bytes.end, since))
        };
        // The first shrink's discard does not cover what the second cut off.
        assert_eq!(discard(&mut map, 8 * MIB..10 * MIB, first_cut), Ok(false));
        assert_eq!(discard(&mut map, 6 * MIB..10 * MIB, first_cut), Ok(false));
        let cut = since(&map);
        assert_eq!(discard(&mut map, 6 * MIB..10 * MIB, cut), Ok(true));
        assert_eq!(range(&map, true), Some(6 * MIB..6 * MIB));
        assert_eq!(map.apply(&resize(7 * MIB)), Ok(true));
        // Cut off again after the grow: a discard begun before it counts for nothing.
        let before_grow = since(&map);
        assert_eq!(map.apply(&resize(6 * MIB)), Ok(true));
        assert_eq!(discard(&mut map, 6 * MIB..7 * MIB, before_grow), Ok(false));
        let cut = since(&map);
        assert_eq!(discard(&mut map, 6 * MIB..7 * MIB, cut), Ok(true));
        // A command from before cuts were numbered (a journal replayed) applies as then.
        assert_eq!(map.apply(&resize(7 * MIB)), Ok(true));
        assert_eq!(map.apply(&resize(6 * MIB)), Ok(true));
        let legacy = format!(
            r#"{{"ImageDiscarded":{{"id":{},"from":{},"to":{}}}}}"#,
            id.0,
            6 * MIB,
            7 * MIB
        );
        let legacy: Command = serde_json::from_str(&legacy).expect("an older command");
        assert_eq!(legacy, discarded(6 * MIB, 7 * MIB, Epoch(0)));
        assert_eq!(map.apply(&legacy), Ok(true));

        // Removed: the whole image, its cut-off part too, is there for discards only.
        assert_eq!(map.apply(&resize(4 * MIB)), Ok(true));
        let shrunk = since(&map);
        let remove = |id| Command::ImageRemove {
            pool: pool.clone(),
            name: name.clone(),
            id: Some(id),
        };
        let error = map
            .apply(&remove(ImageId(id.0 + 1)))
            .expect_err("another image");
        assert!(error.to_string().contains("another image now"), "{error}");
        assert_eq!(map.apply(&remove(id)), Ok(true));
        assert!(map.image_by_name(&pool, &name).is_none());
        assert_eq!(
            (range(&map, false), range(&map, true)),
            (None, Some(0..6 * MIB))
        );
        // The name is free again; the new image is another.
        map.apply(&Command::ImageCreate {
            pool: pool.clone(),
            name: name.clone(),
            size_bytes: MIB,
            object_size_bytes: None,
        })
        .expect("create again");
        assert_ne!(map.image_by_name(&pool, &name).map(|i| i.id), Some(id));
        let removal = since(&map);
        assert_eq!(discard(&mut map, 0..4 * MIB, removal), Ok(false));
        assert_eq!(discard(&mut map, 0..6 * MIB, shrunk), Ok(false));
        assert_eq!(discard(&mut map, 0..6 * MIB, removal), Ok(true));
        assert!(map.removing.is_empty());
        assert_eq!(
            map.apply(&discarded(0, 6 * MIB, removal)),
            Ok(false),
            "once is enough"
        );
    }

    #[test]
    fn down_keeps_membership_and_out_moves_replicas() {
        let mut map = three_hosts();
        let victim = OsdId(0);
        let holding: Vec<usize> = map.pools[&PoolId(0)]
            .pgs
            .iter()
            .enumerate()
            .filter(|(_, pg)| pg.members.contains(&victim))
            .map(|(i, _)| i)
            .collect();
        assert!(!holding.is_empty());
        let before = map.pools[&PoolId(0)].pgs.clone();
        map.apply(&Command::OsdDown { id: victim }).expect("down");
        assert_eq!(
            map.pools[&PoolId(0)]
                .pgs
                .iter()
                .map(|pg| &pg.members)
                .collect::<Vec<_>>(),
            before.iter().map(|pg| &pg.members).collect::<Vec<_>>(),
            "down changes no membership"
        );
        map.apply(&Command::OsdOut {
            id: victim,
            auto: false,
        })
        .expect("out");
        let after = &map.pools[&PoolId(0)].pgs;
        for (index, pg) in after.iter().enumerate() {
            assert!(!pg.members.contains(&victim));
            if holding.contains(&index) {
                assert_eq!(pg.epoch, map.epoch, "a changed PG carries the new epoch");
            }
            let hosts: BTreeSet<&str> = pg
                .members
                .iter()
                .map(|id| map.osds[id].host.as_str())
                .collect();
            assert_eq!(hosts.len(), 3, "still three hosts: host0 has another OSD");
        }
        let untouched = after
            .iter()
            .zip(&before)
            .filter(|(a, b)| a.members == b.members)
            .count();
        assert!(
            untouched >= 64 - holding.len() - 16,
            "few PGs that did not hold the OSD moved"
        );
        for (pg, first) in after.iter().zip(&before) {
            assert_eq!(pg.initial(), &first.members[..], "initial members stay");
        }
        // Taken out by an operator, an OSD stays out when it boots; `in` brings it back.
        let uuid = map.osds[&victim].uuid.clone();
        let host = map.osds[&victim].host.clone();
        boot(&mut map, &uuid, &host);
        assert!(!map.osds[&victim].is_in);
        assert_eq!(map.apply(&Command::OsdIn { id: victim }), Ok(true));
        let back: Vec<&Vec<OsdId>> = map.pools[&PoolId(0)]
            .pgs
            .iter()
            .map(|pg| &pg.members)
            .collect();
        assert_eq!(
            back,
            before.iter().map(|pg| &pg.members).collect::<Vec<_>>(),
            "placement is a function of the OSDs in: the PGs go back"
        );
        // Taken out by the monitors, it comes back in when it boots.
        map.apply(&Command::OsdOut {
            id: victim,
            auto: true,
        })
        .expect("out");
        boot(&mut map, &uuid, &host);
        assert!(map.osds[&victim].is_in);
    }

    #[test]
    fn an_osd_leaves_for_good_only_down_and_out_and_its_id_is_never_given_again() {
        let mut map = three_hosts();
        let victim = OsdId(1);
        let refused = |map: &mut ClusterMap, what: &str| {
            let epoch = map.epoch;
            match map.apply(&Command::OsdRemove { id: victim }) {
                Err(MapError::OsdInUse { id, reason }) => {
                    assert_eq!(id, victim);
                    assert!(reason.contains(what), "{reason}");
                }
                other => panic!("removal of {victim} allowed: {other:?}"),
            }
            assert_eq!(map.epoch, epoch, "a refused removal changes nothing");
        };
        refused(&mut map, "up");
        map.apply(&Command::OsdDown { id: victim }).expect("down");
        refused(&mut map, "mark it out");
        map.apply(&Command::OsdOut {
            id: victim,
            auto: false,
        })
        .expect("out");
        let uuid = map.osds[&victim].uuid.clone();
        let before: Vec<Vec<OsdId>> = map.pools[&PoolId(0)]
            .pgs
            .iter()
            .map(|pg| pg.members.clone())
            .collect();
        assert_eq!(map.apply(&Command::OsdRemove { id: victim }), Ok(true));
        assert!(!map.osds.contains_key(&victim));
        let after: Vec<Vec<OsdId>> = map.pools[&PoolId(0)]
            .pgs
            .iter()
            .map(|pg| pg.members.clone())
            .collect();
        assert_eq!(after, before, "an OSD already out moves no PG when removed");
        assert_eq!(
            map.apply(&Command::OsdRemove { id: victim }),
            Err(MapError::UnknownOsd { id: victim })
        );
        // Its device may not come back under another id; a new OSD gets a new id.
        assert_eq!(
            map.apply(&Command::OsdBoot {
                uuid: uuid.clone(),
                host: "host1".into(),
                address: "127.0.0.1:7001".into(),
                weight: 1.0,
            }),
            Err(MapError::OsdRemoved {
                id: victim,
                uuid: uuid.clone()
            })
        );
        let new = boot(&mut map, "uuid-new", "host1");
        assert_eq!(new, OsdId(6), "the removed id is not given again");
        // The map travels with the removal.
        let copy: ClusterMap =
            serde_json::from_value(serde_json::to_value(&map).expect("encode")).expect("decode");
        assert_eq!(copy.removed.get(&victim), Some(&uuid));
    }
}
