//! Background scrubs and the digest of a PG's data.
//!
//! Every scrub interval, the leader of a PG proposes a marker entry in the PG's log. Each
//! replica, applying it, plans the reads of the PG's objects as they stand at that entry
//! (pinning their places in the log against reuse) and digests what its device gives back;
//! the OSD reports each PG's latest digest with its heartbeat, and `basalt status` names the
//! PGs whose replicas' digests of the same marker disagree
//! (`basalt_mon::protocol::inconsistent_pgs`). The marker fixes the point in the log, so
//! PGs taking writes are compared too. `basalt pg query` and `pg scrub` use the same digest
//! of the PG as it stands when asked.

use std::collections::{BTreeMap, HashMap};
use std::time::{Duration, Instant};

use basalt_common::{ObjectKey, PgId};
use basalt_io::FileEngine;
use basalt_store::block_sums::{BlockSums, Mismatch};
use basalt_store::extent_map::Piece;
use basalt_store::object_op::{PgObjects, kind};

use crate::log_device::ReadPin;

/// The raft entry data of a scrub marker (a log entry of kind `RAFT_OTHER` once stored:
/// it is no object operation).
pub const MARKER: &[u8] = &[kind::SCRUB];

/// Whether raft entry data is a scrub marker.
pub fn is_marker(data: &[u8]) -> bool {
    data == MARKER
}

/// The reads that digest a PG: each object's pieces, with a pin that keeps their places in
/// the log from reuse until the object is read.
pub struct DigestPlan {
    objects: Vec<(ObjectKey, Vec<Piece>, Option<ReadPin>)>,
}

impl DigestPlan {
    /// Plans the digest of `objects` as they stand now; `pin` pins an object's pieces.
    pub fn new(objects: Option<&PgObjects>, pin: impl Fn(&[Piece]) -> Option<ReadPin>) -> Self {
        let mut planned = Vec::new();
        if let Some(objects) = objects {
            for key in objects.keys() {
                // Offsets in an object fit a u32: this spans any object, as metadata only.
                let pieces = objects.plan_read(key, 0, u64::from(u32::MAX));
                let pinned = pin(&pieces);
                planned.push((key, pieces, pinned));
            }
        }
        // Read in the order of the pins' ring positions: the pin nearest the tail, the one
        // that holds the log's reuse back, goes first, and the tail follows the reads.
        planned.sort_by_key(|(_, _, pin)| pin.as_ref().map_or(u64::MAX, ReadPin::position));
        Self { objects: planned }
    }
}

/// Reads a plan's objects back from the device and digests them: per object, CRC32C over
/// where each mapped stretch starts and its bytes (replicas with the same bytes agree
/// however their writes fell: a snapshot copies an object in long runs), then over each
/// object's key and digest in key order. Blocks that fail their checksum are digested as
/// read (so the replica differs from the others) and the first is returned too.
pub async fn digest(
    engine: &FileEngine,
    sums: &BlockSums,
    plan: DigestPlan,
) -> std::io::Result<(u32, Option<Mismatch>)> {
    let mut by_key = BTreeMap::new();
    let mut damaged = None;
    for (key, pieces, pin) in plan.objects {
        let mut digest = 0u32;
        let mut mapped_to = None;
        for piece in pieces {
            let Piece::Mapped {
                offset_bytes,
                len_bytes,
                ..
            } = piece
            else {
                continue;
            };
            let read =
                crate::daemon::read_pieces(engine, sums, offset_bytes, len_bytes, &[piece]).await?;
            damaged = damaged.or(read.damaged);
            let data = read.data;
            if mapped_to != Some(offset_bytes) {
                digest = crc32c::crc32c_append(digest, &offset_bytes.to_le_bytes());
            }
            mapped_to = Some(offset_bytes + len_bytes);
            digest = crc32c::crc32c_append(digest, &data);
        }
        drop(pin);
        by_key.insert(key, digest);
    }
    let mut digest = 0u32;
    for (key, object_digest) in by_key {
        digest = crc32c::crc32c_append(digest, &key.image.0.to_le_bytes());
        digest = crc32c::crc32c_append(digest, &key.number.to_le_bytes());
        digest = crc32c::crc32c_append(digest, &object_digest.to_le_bytes());
    }
    Ok((digest, damaged))
}

/// When each PG led here gets its next marker.
pub struct Schedule {
    interval: Option<Duration>,
    next: HashMap<PgId, Instant>,
}

impl Schedule {
    /// Markers every `interval` (never if `None`).
    pub fn new(interval: Option<Duration>) -> Self {
        Self {
            interval,
            next: HashMap::new(),
        }
    }

    /// The PGs of `leading` whose marker is due at `now`. A PG newly led gets its first at
    /// a point of the interval its id picks, so that the PGs of an OSD do not all read
    /// their data at once; PGs no longer led are forgotten.
    pub fn due(&mut self, leading: impl IntoIterator<Item = PgId>, now: Instant) -> Vec<PgId> {
        let Some(interval) = self.interval else {
            return Vec::new();
        };
        let mut next = HashMap::with_capacity(self.next.len());
        let mut due = Vec::new();
        for pg in leading {
            let at = self
                .next
                .get(&pg)
                .copied()
                .unwrap_or_else(|| now + interval.mul_f64(spread(pg)));
            if at <= now {
                due.push(pg);
                next.insert(pg, now + interval);
            } else {
                next.insert(pg, at);
            }
        }
        self.next = next;
        due
    }

    /// `pg`'s marker was due but could not be proposed: it is due again at `now`.
    pub fn retry(&mut self, pg: PgId, now: Instant) {
        self.next.insert(pg, now);
    }
}

/// A fraction of the interval in [0, 1), fixed per PG.
fn spread(pg: PgId) -> f64 {
    let mixed =
        (u64::from(pg.pool.0) << 32 | u64::from(pg.index)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (mixed >> 11) as f64 / (1u64 << 53) as f64
}

#[cfg(test)]
mod tests {
    use super::*;
    use basalt_common::PoolId;

    fn pg(index: u32) -> PgId {
        PgId {
            pool: PoolId(1),
            index,
        }
    }

    #[test]
    fn markers_come_once_per_interval_spread_over_it() {
        let interval = Duration::from_secs(100);
        let mut schedule = Schedule::new(Some(interval));
        let start = Instant::now();
        let pgs: Vec<PgId> = (0..64).map(pg).collect();
        assert_eq!(schedule.due(pgs.clone(), start), Vec::<PgId>::new());
        // Over one interval each PG comes due once, not all at the same moment.
        let mut seen: HashMap<PgId, usize> = HashMap::new();
        let mut moments = 0;
        for second in 1..=100 {
            let due = schedule.due(pgs.clone(), start + Duration::from_secs(second));
            moments += usize::from(!due.is_empty());
            for pg in due {
                *seen.entry(pg).or_default() += 1;
            }
        }
        assert_eq!(seen.len(), 64);
        assert!(seen.values().all(|count| *count == 1), "{seen:?}");
        assert!(moments > 20, "spread over {moments} seconds only");
        // Then again an interval after each one's first.
        let mut again = 0;
        for second in 101..=200 {
            again += schedule
                .due(pgs.clone(), start + Duration::from_secs(second))
                .len();
        }
        assert_eq!(again, 64);
        // A marker that could not be proposed is due again at once.
        let at = start + Duration::from_secs(300);
        schedule.retry(pg(5), at);
        assert!(schedule.due(pgs.clone(), at).contains(&pg(5)));
        assert!(!schedule.due(pgs.clone(), at).contains(&pg(5)));
        // A PG no longer led is forgotten; led again, it starts over.
        assert_eq!(schedule.due([], start), Vec::<PgId>::new());
        assert!(schedule.next.is_empty());
        let mut never = Schedule::new(None);
        assert_eq!(
            never.due(pgs, start + Duration::from_secs(1 << 20)),
            Vec::<PgId>::new()
        );
    }

    #[test]
    fn a_marker_is_no_object_operation() {
        assert!(is_marker(MARKER));
        assert!(basalt_store::object_op::ObjectOp::decode(MARKER).is_err());
        assert!(!is_marker(&[]));
    }
}
