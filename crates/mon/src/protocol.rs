//! What OSDs, clients and the CLI ask the monitor, and what it answers.
//!
//! Requests and replies travel as JSON in the body of a [`Message::Control`] frame: the
//! control plane is small and rare next to the data path, and JSON keeps it readable in a
//! packet capture and easy to extend.

use std::time::Duration;

use basalt_common::{Epoch, ImageId, OsdId, PgId};
use basalt_wire::Message;
use serde::{Deserialize, Serialize};

use crate::map::{ClusterMap, Command};

/// What an OSD reports with each heartbeat.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct OsdReport {
    /// Bytes its log device holds in all.
    pub capacity_bytes: u64,
    /// Bytes of its log device in use.
    pub used_bytes: u64,
    /// Client reads served since it started.
    pub reads: u64,
    /// Client writes acknowledged since it started.
    pub writes: u64,
    /// Bytes read by clients since it started.
    pub read_bytes: u64,
    /// Bytes written by clients since it started.
    pub write_bytes: u64,
    /// The PGs it leads and can serve (a leader that committed an entry of its term).
    pub leading: Vec<PgId>,
    /// The map epoch it runs.
    pub epoch: Epoch,
    /// Its log is full: its live data leaves less than the reserve, headroom and a margin
    /// free even once cleaned (the monitors flag it in the map, and the leaders of its PGs
    /// refuse writes).
    #[serde(default)]
    pub full: bool,
    /// PG replicas it hosts.
    #[serde(default)]
    pub hosted: u32,
    /// The PGs it leads whose raft configuration is not the map's members yet (learners
    /// catching up, a joint configuration, or old members still voting).
    #[serde(default)]
    pub moving: Vec<PgId>,
    /// The live bytes it can hold before it reports itself full (0 from an OSD that does
    /// not say; its capacity counts then).
    #[serde(default)]
    pub writable_bytes: u64,
    /// The latest background scrub of each PG replica it hosts.
    #[serde(default)]
    pub scrubs: Vec<PgScrub>,
    /// Reads of its device that met a block whose bytes fail the checksum they were written
    /// with (client reads, snapshots and entries sent, scrubs), kept through its restarts
    /// in its data directory (up to the last second's, which a crash may lose).
    #[serde(default)]
    pub checksum_errors: u64,
    /// Seconds since the last of them, if any.
    #[serde(default)]
    pub last_checksum_error_age_seconds: Option<u64>,
    /// The PGs that no replica leads as far as this one knows whose raft log here holds,
    /// past the commit index, an entry with a payload it cannot read back (damaged): it may
    /// hold the only copy of entries the others lack (`basalt pg mark-unfound-lost`).
    #[serde(default)]
    pub unsendable: Vec<PgId>,
    /// The PGs of which it is a voter and that no replica leads as far as it knows, with
    /// its raft configuration of each: health names those whose voters removed from the
    /// cluster (lost for good) leave no quorum (`basalt pg force-quorum`).
    #[serde(default)]
    pub leaderless: Vec<LeaderlessPg>,
    /// How near it is to full, in percent of the nearer of its two limits: its live data
    /// counted as the cleaner will pack it against `writable_bytes`, and its object index
    /// against what a checkpoint holds of it. `used_bytes` counts blocks not packed yet
    /// (512-byte writes keep one each), which may pass `writable_bytes` while the OSD is
    /// not full. `None` from an OSD that does not say: `used_bytes` counts then.
    #[serde(default)]
    pub fill_percent: Option<u64>,
    /// The PGs whose records its log holds and that it cannot host (restored at start, no
    /// raft group made of them): their data is kept, so its log is not reused (no
    /// cleaning, no checkpoints) until they are hosted or let go.
    #[serde(default)]
    pub held: Vec<PgId>,
}

/// A PG that no replica leads as far as one of its voters knows ([`OsdReport::leaderless`]).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct LeaderlessPg {
    /// The PG.
    pub pg: PgId,
    /// Its voters, as that replica last applied them (in a joint configuration, the
    /// incoming ones).
    pub voters: Vec<OsdId>,
    /// Voters leaving, in a joint configuration.
    pub voters_outgoing: Vec<OsdId>,
}

/// How long after an OSD last read a block failing its checksum health names it.
pub const CHECKSUM_ERROR_WARN_SECONDS: u64 = 3600;

/// A replica's digest of a PG's data as of a scrub marker in the PG's log: replicas that
/// digested the same marker (the same `index`) hold the same data if their digests agree.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct PgScrub {
    /// The PG.
    pub pg: PgId,
    /// The log index of the marker.
    pub index: u64,
    /// CRC32C of the PG's objects as the replica read them back from its device.
    pub digest: u32,
}

/// The replicas whose digest differs from the majority's, in the order given (every
/// replica when no digest has a majority; none when all agree).
pub fn odd_replicas(digests: &[(OsdId, u32)]) -> Vec<OsdId> {
    let mut counts: std::collections::BTreeMap<u32, usize> = std::collections::BTreeMap::new();
    for (_, digest) in digests {
        *counts.entry(*digest).or_default() += 1;
    }
    if counts.len() <= 1 {
        return Vec::new();
    }
    let majority = counts
        .iter()
        .find(|(_, count)| **count * 2 > digests.len())
        .map(|(digest, _)| *digest);
    digests
        .iter()
        .filter(|(_, digest)| Some(*digest) != majority)
        .map(|(osd, _)| *osd)
        .collect()
}

/// The latest background scrub of `pg` that each of `members` reported (members without
/// a report, or without a scrub of it, are left out).
pub fn member_scrubs(
    reports: &[(OsdId, OsdReport)],
    pg: PgId,
    members: &[OsdId],
) -> Vec<(OsdId, PgScrub)> {
    members
        .iter()
        .filter_map(|osd| {
            let (_, report) = reports.iter().find(|(id, _)| id == osd)?;
            let scrub = report.scrubs.iter().find(|scrub| scrub.pg == pg)?;
            Some((*osd, *scrub))
        })
        .collect()
}

/// The PGs whose replicas' latest background scrubs disagree, each with the replicas
/// outside the majority. For each PG, the replicas compared are the members (of
/// `members`) that reported the highest marker index that two or more of them reported:
/// a member down (its report gone) or still digesting the latest marker does not hold the
/// verdict back. A verdict stands until the next marker.
pub fn inconsistent_pgs(
    reports: &[(OsdId, OsdReport)],
    members: impl IntoIterator<Item = (PgId, Vec<OsdId>)>,
) -> Vec<(PgId, Vec<OsdId>)> {
    let mut found = Vec::new();
    for (pg, members) in members {
        let scrubs = member_scrubs(reports, pg, &members);
        let shared = scrubs
            .iter()
            .map(|(_, scrub)| scrub.index)
            .filter(|index| scrubs.iter().filter(|(_, s)| s.index == *index).count() >= 2)
            .max();
        let Some(index) = shared else {
            continue;
        };
        let digests: Vec<(OsdId, u32)> = scrubs
            .iter()
            .filter(|(_, scrub)| scrub.index == index)
            .map(|(osd, scrub)| (*osd, scrub.digest))
            .collect();
        let odd = odd_replicas(&digests);
        if !odd.is_empty() {
            found.push((pg, odd));
        }
    }
    found
}

/// An OSD whose live data passes this share of what it can hold is nearly full: a health
/// warning before writes to its PGs are refused.
pub const NEARFULL_PERCENT: u64 = 85;

impl OsdReport {
    /// How full it is, in percent of the live bytes it can hold, once that reaches
    /// [`NEARFULL_PERCENT`] and while it is not full yet.
    pub fn nearly_full_percent(&self) -> Option<u64> {
        let limit = if self.writable_bytes > 0 {
            self.writable_bytes
        } else {
            self.capacity_bytes
        };
        if self.full || limit == 0 {
            return None;
        }
        let percent = self.fill_percent.unwrap_or_else(|| {
            u64::try_from(u128::from(self.used_bytes) * 100 / u128::from(limit)).unwrap_or(u64::MAX)
        });
        (percent >= NEARFULL_PERCENT).then_some(percent)
    }
}

/// A request to the monitor.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MonRequest {
    /// An OSD starts: it is given its id (the same for the same uuid) and the map.
    Boot {
        /// Its uuid (from its superblock).
        uuid: String,
        /// Its host (failure domain).
        host: String,
        /// Where it listens for clients and peers.
        address: String,
        /// Its weight.
        weight: f64,
    },
    /// An OSD is alive, with its figures.
    Heartbeat {
        /// The OSD.
        osd: OsdId,
        /// Its figures.
        report: OsdReport,
    },
    /// The map, once its epoch is past `after` (at once if `after` is `None`); waits up to
    /// `wait_ms` for a change (the subscription: callers ask again with the epoch they got).
    GetMap {
        /// The epoch the caller has.
        after: Option<Epoch>,
        /// How long to wait for a newer map.
        wait_ms: u64,
    },
    /// Change the map.
    Command(Command),
    /// The cluster's state for `basalt status`.
    Status,
    /// A client uses an image (a target's image bdev): it says so every [`WATCH_RENEW`],
    /// and with `present` false when it stops. `basalt image rm` refuses to remove an
    /// image with watchers.
    Watch {
        /// The image.
        image: ImageId,
        /// Who watches, for people: `bdev img of pid 123 on host1`.
        watcher: String,
        /// Whether it watches (false: it stopped).
        present: bool,
    },
    /// The image's watchers, heard from within [`WATCH_TTL`] ([`MonReply::Watchers`]).
    Watchers {
        /// The image.
        image: ImageId,
    },
}

/// How often a watcher of an image says so ([`MonRequest::Watch`]).
pub const WATCH_RENEW: Duration = Duration::from_secs(2);
/// A watcher not heard from for this long is gone; a monitor that leads for less than
/// this answers [`MonRequest::Watchers`] only once it has led this long (every watcher has
/// told it by then).
pub const WATCH_TTL: Duration = Duration::from_secs(6);
// A watcher renews three times within the time it is remembered.
const _: () = assert!(3 * WATCH_RENEW.as_secs() <= WATCH_TTL.as_secs());

/// A monitor's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum MonReply {
    /// The OSD's id and the map.
    Booted {
        /// Its id.
        osd: OsdId,
        /// The map.
        map: ClusterMap,
    },
    /// Done, nothing to return.
    Ok,
    /// A map newer than asked for, or `None` if none came within the wait.
    Map(Option<ClusterMap>),
    /// A command was applied (`changed` false if the map already was so).
    Applied {
        /// Whether the map changed.
        changed: bool,
        /// The map's epoch after it.
        epoch: Epoch,
    },
    /// The cluster's state.
    Status(ClusterStatus),
    /// An image's watchers ([`MonRequest::Watchers`]).
    Watchers(Vec<String>),
    /// Refused, with the reason.
    Error(String),
    /// The monitors cannot take the request now (no leader yet, the leader unreachable, a
    /// change of leader): worth asking again. `maybe_done` when the leader may still have
    /// carried it out (it took the request, then did not answer).
    Unavailable {
        /// Why.
        reason: String,
        /// Whether it may have been carried out all the same.
        maybe_done: bool,
    },
}

impl MonReply {
    /// Unavailable, and certainly not carried out.
    pub fn unavailable(reason: impl Into<String>) -> Self {
        Self::Unavailable {
            reason: reason.into(),
            maybe_done: false,
        }
    }
}

/// The cluster at a glance.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ClusterStatus {
    /// The map.
    pub map: ClusterMap,
    /// The monitors configured, by address.
    pub monitors: Vec<String>,
    /// Those the leader heard from lately, itself included: its quorum. Empty from a
    /// monitor of an older version, which did not tell.
    #[serde(default)]
    pub quorum: Vec<String>,
    /// The monitor that answered, which leads.
    pub leader: String,
    /// Each up OSD's latest report.
    pub reports: Vec<(OsdId, OsdReport)>,
    /// Client operations per second over the last reports: reads, writes.
    pub ops_per_second: (f64, f64),
    /// Client bytes per second: read, written.
    pub bytes_per_second: (f64, f64),
}

impl MonRequest {
    /// The message carrying it.
    pub fn to_message(&self) -> Message {
        Message::Control {
            body: serde_json::to_vec(self).expect("requests always encode"),
        }
    }
}

impl MonReply {
    /// The message carrying it; an error in its place when it would not fit a frame (a
    /// map or status of more PGs than a frame holds), rather than a reply that cannot be
    /// sent.
    pub fn to_message(&self) -> Message {
        let body = serde_json::to_vec(self).expect("replies always encode");
        if body.len() > basalt_wire::frame::BODY_SIZE_MAX {
            let error = MonReply::Error(format!(
                "the reply takes {} bytes, more than a message holds ({}): the cluster map \
                 holds too many PGs",
                body.len(),
                basalt_wire::frame::BODY_SIZE_MAX
            ));
            return error.to_message();
        }
        Message::Control { body }
    }
}

/// Decodes a control message's body; the error says what was wrong.
pub fn decode<T: for<'de> Deserialize<'de>>(message: &Message) -> Result<T, String> {
    match message {
        Message::Control { body } => serde_json::from_slice(body)
            .map_err(|error| format!("malformed control message: {error}")),
        other => Err(format!(
            "expected a control message, got kind {}",
            other.kind()
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_osd_is_nearly_full_from_its_own_limit_until_it_is_full() {
        let report = |used_bytes, writable_bytes, full| OsdReport {
            capacity_bytes: 1000,
            used_bytes,
            writable_bytes,
            full,
            ..OsdReport::default()
        };
        assert_eq!(report(500, 600, false).nearly_full_percent(), None);
        assert_eq!(report(509, 600, false).nearly_full_percent(), None);
        assert_eq!(report(510, 600, false).nearly_full_percent(), Some(85));
        assert_eq!(report(599, 600, false).nearly_full_percent(), Some(99));
        // Full is its own warning.
        assert_eq!(report(599, 600, true).nearly_full_percent(), None);
        // Without a limit reported, the capacity counts.
        assert_eq!(report(849, 0, false).nearly_full_percent(), None);
        assert_eq!(report(900, 0, false).nearly_full_percent(), Some(90));
        assert_eq!(
            OsdReport::default().nearly_full_percent(),
            None,
            "an empty report"
        );
        // An old report without the field decodes with the capacity as the limit.
        let old: OsdReport = serde_json::from_str(
            r#"{"capacity_bytes":100,"used_bytes":95,"reads":0,"writes":0,"read_bytes":0,
                "write_bytes":0,"leading":[],"epoch":1}"#,
        )
        .expect("old report");
        assert_eq!(old.nearly_full_percent(), Some(95));
        // An OSD's own figure counts when it gives one: sectors not packed yet keep blocks
        // past its limit while it is not full, and its index may near its limit first.
        let own = |fill_percent| OsdReport {
            fill_percent: Some(fill_percent),
            ..report(640, 600, false)
        };
        assert_eq!(own(60).nearly_full_percent(), None);
        assert_eq!(own(90).nearly_full_percent(), Some(90));
    }

    #[test]
    fn a_reply_too_large_for_a_message_becomes_an_error() {
        let small = MonReply::Watchers(vec!["w".into()]);
        assert_eq!(decode::<MonReply>(&small.to_message()), Ok(small));
        let large = MonReply::Watchers(vec!["w".repeat(basalt_wire::frame::BODY_SIZE_MAX)]);
        match decode::<MonReply>(&large.to_message()) {
            Ok(MonReply::Error(error)) => assert!(error.contains("too many PGs"), "{error}"),
            other => panic!("{other:?}"),
        }
        // It encodes into a frame: no panic.
        let _ = large.to_message().encode(1);
    }

    #[test]
    fn replicas_are_judged_by_the_scrub_of_one_marker() {
        let pg = PgId {
            pool: basalt_common::PoolId(0),
            index: 3,
        };
        let osds = [OsdId(0), OsdId(1), OsdId(2)];
        let reports = |scrubs: [(u64, u32); 3]| -> Vec<(OsdId, OsdReport)> {
            osds.iter()
                .zip(scrubs)
                .map(|(osd, (index, digest))| {
                    let scrubs = vec![PgScrub { pg, index, digest }];
                    (
                        *osd,
                        OsdReport {
                            scrubs,
                            ..OsdReport::default()
                        },
                    )
                })
                .collect()
        };
        let judge =
            |reports: &[(OsdId, OsdReport)]| inconsistent_pgs(reports, [(pg, osds.to_vec())]);
        assert_eq!(judge(&reports([(7, 1), (7, 1), (7, 1)])), vec![]);
        assert_eq!(
            judge(&reports([(7, 1), (7, 2), (7, 1)])),
            vec![(pg, vec![OsdId(1)])]
        );
        // No majority: every replica is named.
        assert_eq!(
            judge(&reports([(7, 1), (7, 2), (7, 3)])),
            vec![(pg, osds.to_vec())]
        );
        // Only digests of one marker are compared: the latest that two replicas or more
        // digested (one has not digested the latest yet).
        assert_eq!(judge(&reports([(7, 1), (9, 2), (7, 1)])), vec![]);
        assert_eq!(
            judge(&reports([(9, 1), (9, 2), (7, 1)])),
            vec![(pg, vec![OsdId(0), OsdId(1)])]
        );
        assert_eq!(
            judge(&reports([(7, 1), (9, 2), (7, 2)])),
            vec![(pg, vec![OsdId(0), OsdId(2)])]
        );
        assert_eq!(
            judge(&reports([(5, 1), (7, 2), (9, 1)])),
            vec![],
            "no marker shared"
        );
        // A member without a report (down) does not hold the others' verdict back.
        let mut partial = reports([(7, 1), (7, 2), (7, 1)]);
        partial[2].1.scrubs.clear();
        assert_eq!(judge(&partial), vec![(pg, vec![OsdId(0), OsdId(1)])]);
        partial.remove(2);
        partial[1].1.scrubs[0].digest = 1;
        assert_eq!(judge(&partial), vec![]);
        assert_eq!(odd_replicas(&[]), Vec::<OsdId>::new());
        assert_eq!(
            odd_replicas(&[(OsdId(4), 5), (OsdId(5), 6)]),
            vec![OsdId(4), OsdId(5)]
        );
    }

    #[test]
    fn a_map_round_trips_through_json() {
        let mut map = ClusterMap::new();
        map.apply(&Command::OsdBoot {
            uuid: "u0".into(),
            host: "h0".into(),
            address: "127.0.0.1:1".into(),
            weight: 1.0,
        })
        .expect("boot");
        map.apply(&Command::PoolCreate {
            name: "p".into(),
            pg_count: 4,
            size: 1,
            min_size: None,
        })
        .expect("pool");
        let reply = MonReply::Map(Some(map.clone()));
        let back: MonReply = decode(&reply.to_message()).expect("decodes");
        assert_eq!(back, reply);
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let error = decode::<MonRequest>(&Message::Control {
            body: b"{\"Boot\":{}}".to_vec(),
        })
        .expect_err("missing fields");
        assert!(error.contains("malformed"), "{error}");
        assert!(
            decode::<MonRequest>(&Message::Raft {
                pg: PgId {
                    pool: basalt_common::PoolId(0),
                    index: 0
                },
                message: vec![]
            })
            .is_err()
        );
    }
}
