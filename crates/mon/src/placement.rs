//! PG placement: which OSDs hold the replicas of each PG.
//!
//! Rendezvous ("highest random weight") hashing in its straw2 form: for a PG, every
//! candidate draws `ln(u) / weight` with `u` in (0, 1] hashed from the PG and the candidate,
//! and the highest draws win. Two properties follow, and the tests check both:
//!
//! - **Proportional**: a candidate wins in proportion to its weight.
//! - **Minimal movement**: a candidate's draws do not depend on the others, so adding,
//!   removing or reweighting one candidate only moves PGs to or from it.
//!
//! The failure domain is the host: a PG's replicas go to distinct hosts (hosts drawn by their
//! total weight, then one OSD within each host). With fewer hosts than replicas, the
//! remaining replicas go to the best remaining OSDs, so a 1-host development cluster still
//! gets `size` distinct OSDs.
//!
//! The monitor computes placement and records the result in the map, so every change is
//! explicit; nothing else recomputes it, and floating-point results need not agree across
//! machines.

use std::collections::BTreeMap;

use basalt_common::{OsdId, PgId};

/// An OSD that may hold data ("in"), with its host and weight (e.g. its capacity in TiB).
#[derive(Debug, Clone, PartialEq)]
pub struct Candidate {
    /// The OSD.
    pub osd: OsdId,
    /// The host it runs on: the failure domain.
    pub host: String,
    /// Relative share of PGs; 0 takes none.
    pub weight: f64,
}

/// The OSDs of one PG, in order: the first is the preferred leader.
pub fn place(pg: PgId, size: usize, candidates: &[Candidate]) -> Vec<OsdId> {
    let key = mix(u64::from(pg.pool.0) << 32 | u64::from(pg.index));
    let mut hosts: BTreeMap<&str, Vec<&Candidate>> = BTreeMap::new();
    for candidate in candidates.iter().filter(|c| c.weight > 0.0) {
        hosts
            .entry(candidate.host.as_str())
            .or_default()
            .push(candidate);
    }
    let mut ranked_hosts: Vec<(f64, &str)> = hosts
        .iter()
        .map(|(host, members)| {
            let weight: f64 = members.iter().map(|c| c.weight).sum();
            (draw(key, name_hash(host), weight), *host)
        })
        .collect();
    ranked_hosts.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(b.1)));

    // One OSD from each of the best hosts; a different key inside hosts, so that the host
    // choice and the OSD choice are independent.
    let inner_key = mix(key ^ 0x5bd1_e995_0000_0001);
    let mut chosen: Vec<OsdId> = Vec::with_capacity(size);
    for (_, host) in ranked_hosts.iter().take(size) {
        if let Some(best) = best_of(inner_key, &hosts[host], &chosen) {
            chosen.push(best);
        }
    }
    // Fewer hosts than replicas: fill with the best OSDs not yet chosen.
    if chosen.len() < size {
        let everyone: Vec<&Candidate> = hosts.values().flatten().copied().collect();
        while chosen.len() < size {
            let Some(best) = best_of(inner_key, &everyone, &chosen) else {
                break;
            };
            chosen.push(best);
        }
    }
    chosen
}

/// The placement of every PG of a pool.
pub fn place_pool(
    pool: basalt_common::PoolId,
    pg_count: u32,
    size: usize,
    candidates: &[Candidate],
) -> Vec<Vec<OsdId>> {
    (0..pg_count)
        .map(|index| place(PgId { pool, index }, size, candidates))
        .collect()
}

fn best_of(key: u64, members: &[&Candidate], taken: &[OsdId]) -> Option<OsdId> {
    members
        .iter()
        .filter(|c| !taken.contains(&c.osd))
        .map(|c| (draw(key, u64::from(c.osd.0), c.weight), c.osd))
        .max_by(|a, b| a.0.total_cmp(&b.0).then(b.1.cmp(&a.1)))
        .map(|(_, osd)| osd)
}

/// The straw2 draw of `item` for `key`: `ln(u) / weight`, higher wins.
fn draw(key: u64, item: u64, weight: f64) -> f64 {
    let hash = mix(key ^ mix(item));
    // 53 random bits as a float in (0, 1].
    let u = ((hash >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
    u.ln() / weight
}

/// A stable 64-bit mixer (the splitmix64 finaliser); never changes between releases, since
/// placement recorded by one version is compared with placement computed by the next.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// FNV-1a of a host name: stable across processes, unlike the std hasher.
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use basalt_common::PoolId;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    fn cluster(hosts: usize, osds_per_host: usize) -> Vec<Candidate> {
        (0..hosts * osds_per_host)
            .map(|n| Candidate {
                osd: OsdId(n as u32),
                host: format!("host{}", n / osds_per_host),
                weight: 1.0,
            })
            .collect()
    }

    fn host_of(candidates: &[Candidate], osd: OsdId) -> &str {
        &candidates
            .iter()
            .find(|c| c.osd == osd)
            .expect("known osd")
            .host
    }

    fn counts(table: &[Vec<OsdId>]) -> BTreeMap<OsdId, usize> {
        let mut counts = BTreeMap::new();
        for osd in table.iter().flatten() {
            *counts.entry(*osd).or_insert(0) += 1;
        }
        counts
    }

    #[test]
    fn replicas_go_to_distinct_hosts() {
        let candidates = cluster(4, 3);
        for pg in place_pool(PoolId(1), 256, 3, &candidates) {
            assert_eq!(pg.len(), 3);
            let hosts: BTreeSet<&str> = pg.iter().map(|osd| host_of(&candidates, *osd)).collect();
            assert_eq!(hosts.len(), 3, "{pg:?}");
        }
    }

    #[test]
    fn fewer_hosts_than_replicas_falls_back_to_distinct_osds() {
        let candidates = cluster(1, 3);
        for pg in place_pool(PoolId(1), 64, 3, &candidates) {
            let osds: BTreeSet<OsdId> = pg.iter().copied().collect();
            assert_eq!(osds.len(), 3, "{pg:?}");
        }
        let two_hosts = cluster(2, 2);
        for pg in place_pool(PoolId(1), 64, 3, &two_hosts) {
            let hosts: BTreeSet<&str> = pg.iter().map(|osd| host_of(&two_hosts, *osd)).collect();
            assert_eq!(
                (pg.len(), hosts.len()),
                (3, 2),
                "both hosts used first: {pg:?}"
            );
        }
        assert_eq!(
            place(
                PgId {
                    pool: PoolId(1),
                    index: 0
                },
                3,
                &cluster(1, 2)
            )
            .len(),
            2,
            "as many as exist"
        );
        assert!(
            place(
                PgId {
                    pool: PoolId(1),
                    index: 0
                },
                3,
                &[]
            )
            .is_empty()
        );
    }

    #[test]
    fn equal_weights_balance_within_fifteen_percent() {
        let candidates = cluster(3, 4);
        let table = place_pool(PoolId(1), 2048, 3, &candidates);
        let counts = counts(&table);
        let mean = (2048 * 3) as f64 / candidates.len() as f64;
        for (osd, count) in counts {
            let deviation = (count as f64 - mean).abs() / mean;
            assert!(deviation < 0.15, "{osd}: {count} replicas, mean {mean:.0}");
        }
    }

    #[test]
    fn weight_sets_the_share() {
        let mut candidates = cluster(6, 1);
        candidates[0].weight = 2.0;
        candidates[1].weight = 0.0;
        let table = place_pool(PoolId(1), 4096, 1, &candidates);
        let counts = counts(&table);
        assert_eq!(counts.get(&OsdId(1)), None, "weight 0 holds nothing");
        let heavy = counts[&OsdId(0)] as f64;
        let light = counts[&OsdId(2)] as f64;
        assert!(
            (heavy / light - 2.0).abs() < 0.3,
            "double weight, double share: {heavy} vs {light}"
        );
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 32, ..ProptestConfig::default() })]

        /// Adding an OSD moves only a share of replicas close to its share of the weight,
        /// and every moved replica moves onto the new OSD's host.
        #[test]
        fn adding_an_osd_moves_little(hosts in 3usize..7, per_host in 1usize..4, new_host in any::<bool>(), pool in 1u32..100) {
            let before = cluster(hosts, per_host);
            let mut after = before.clone();
            let new_osd = OsdId(1000);
            let host = if new_host { "new-host".to_string() } else { "host0".to_string() };
            after.push(Candidate { osd: new_osd, host: host.clone(), weight: 1.0 });
            let pg_count = 512;
            let old = place_pool(PoolId(pool), pg_count, 3, &before);
            let new = place_pool(PoolId(pool), pg_count, 3, &after);
            let mut moved = 0usize;
            for (a, b) in old.iter().zip(&new) {
                let a: BTreeSet<_> = a.iter().collect();
                for osd in b.iter().filter(|osd| !a.contains(osd)) {
                    moved += 1;
                    prop_assert_eq!(host_of(&after, *osd), host.as_str(), "replica moved elsewhere than the new OSD's host");
                }
            }
            let share = 1.0 / after.len() as f64;
            let expected = share * (pg_count as usize * 3) as f64;
            prop_assert!((moved as f64) <= 2.5 * expected + 16.0, "moved {} replicas, share of weight suggests {:.0}", moved, expected);
        }

        /// Removing an OSD leaves every PG that did not use its host untouched.
        #[test]
        fn removing_an_osd_moves_only_from_its_host(hosts in 3usize..7, per_host in 1usize..4, victim in 0usize..18, pool in 1u32..100) {
            let before = cluster(hosts, per_host);
            let victim = before[victim % before.len()].clone();
            let after: Vec<Candidate> = before.iter().filter(|c| c.osd != victim.osd).cloned().collect();
            let old = place_pool(PoolId(pool), 256, 3, &before);
            let new = place_pool(PoolId(pool), 256, 3, &after);
            for (a, b) in old.iter().zip(&new) {
                let used_host = a.iter().any(|osd| host_of(&before, *osd) == victim.host);
                if !used_host {
                    prop_assert_eq!(a, b);
                }
                prop_assert!(!b.contains(&victim.osd));
            }
        }
    }
}
