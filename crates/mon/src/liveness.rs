//! Failure detection from heartbeats, without a clock: time comes in as `now`.
//!
//! An OSD that sent no heartbeat for `grace` is to be marked *down*; one that stayed down
//! for `down_out_interval` is to be marked *out*, which moves its replicas elsewhere. The
//! monitor turns what [`Liveness::check`] returns into map commands.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use basalt_common::OsdId;

/// What the monitor should do about an OSD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// No heartbeat for longer than the grace: mark it down.
    Down(OsdId),
    /// Down for longer than the down-out interval: mark it out.
    Out(OsdId),
}

/// Heartbeat bookkeeping of the monitor.
#[derive(Debug, Clone)]
pub struct Liveness {
    grace: Duration,
    down_out_interval: Duration,
    last_heartbeat: BTreeMap<OsdId, Instant>,
    down_since: BTreeMap<OsdId, Instant>,
}

impl Liveness {
    /// Down after `grace` without heartbeats, out after `down_out_interval` down.
    pub fn new(grace: Duration, down_out_interval: Duration) -> Self {
        Self {
            grace,
            down_out_interval,
            last_heartbeat: BTreeMap::new(),
            down_since: BTreeMap::new(),
        }
    }

    /// An OSD is alive at `now` (a heartbeat or a boot).
    pub fn heartbeat(&mut self, osd: OsdId, now: Instant) {
        self.last_heartbeat.insert(osd, now);
        self.down_since.remove(&osd);
    }

    /// Forgets an OSD (it was marked out, or removed).
    pub fn forget(&mut self, osd: OsdId) {
        self.last_heartbeat.remove(&osd);
        self.down_since.remove(&osd);
    }

    /// What to do at `now`: each OSD is reported down once, then out once.
    pub fn check(&mut self, now: Instant) -> Vec<Verdict> {
        let mut verdicts = Vec::new();
        for (&osd, &seen) in &self.last_heartbeat {
            if self.down_since.contains_key(&osd) {
                continue;
            }
            if now.saturating_duration_since(seen) > self.grace {
                verdicts.push(Verdict::Down(osd));
            }
        }
        for verdict in &verdicts {
            if let Verdict::Down(osd) = verdict {
                self.down_since.insert(*osd, now);
            }
        }
        let outs: Vec<OsdId> = self
            .down_since
            .iter()
            .filter(|(_, since)| now.saturating_duration_since(**since) > self.down_out_interval)
            .map(|(osd, _)| *osd)
            .collect();
        for osd in outs {
            self.forget(osd);
            verdicts.push(Verdict::Out(osd));
        }
        verdicts
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn silence_means_down_then_out_and_a_heartbeat_heals() {
        let start = Instant::now();
        let at = |seconds: u64| start + Duration::from_secs(seconds);
        let mut liveness = Liveness::new(Duration::from_secs(5), Duration::from_secs(60));
        liveness.heartbeat(OsdId(1), at(0));
        liveness.heartbeat(OsdId(2), at(0));
        assert_eq!(liveness.check(at(4)), vec![]);
        liveness.heartbeat(OsdId(2), at(4));
        assert_eq!(liveness.check(at(6)), vec![Verdict::Down(OsdId(1))]);
        assert_eq!(liveness.check(at(7)), vec![], "reported down once");
        liveness.heartbeat(OsdId(2), at(8));
        assert_eq!(liveness.check(at(60)), vec![Verdict::Down(OsdId(2))]);
        assert_eq!(liveness.check(at(67)), vec![Verdict::Out(OsdId(1))]);
        liveness.heartbeat(OsdId(2), at(68));
        assert_eq!(
            liveness.check(at(200)),
            vec![Verdict::Down(OsdId(2))],
            "back up, then silent again"
        );
        assert_eq!(liveness.check(at(201)), vec![]);
    }
}
