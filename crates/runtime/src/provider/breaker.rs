//! An endpoint's breaker and its transitions: pure functions of the breaker, what a call met,
//! the time and the configuration (docs/ARCHITECTURE.md, "Provider trouble").

use std::time::Duration;

use kedge_core::event::{Timestamp, Trouble};
use serde::{Deserialize, Serialize};

use super::Endpoint;
use crate::config::ProviderConfig;

/// Where an endpoint's breaker stands.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum BreakerState {
    #[default]
    Closed,
    Open,
    Recovering,
}

impl BreakerState {
    pub fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::Open => "open",
            BreakerState::Recovering => "recovering",
        }
    }
}

/// An endpoint's breaker, as stored at `breaker.<endpoint>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Breaker {
    pub endpoint: String,
    pub state: BreakerState,
    /// Trouble reported in a row with no success between (while closed).
    #[serde(default)]
    pub failures: u32,
    /// When it last opened.
    #[serde(default)]
    pub opened_at: Option<Timestamp>,
    #[serde(default)]
    pub trouble: Option<Trouble>,
    #[serde(default)]
    pub last_error: String,
    /// When the fleet's next probe may go out (while open).
    #[serde(default)]
    pub next_probe_at: Option<Timestamp>,
    /// The wait before the next probe after this one fails.
    #[serde(default)]
    pub probe_interval_ms: u64,
    /// Probes sent since it last opened.
    #[serde(default)]
    pub probes: u64,
    pub updated_at: Timestamp,
}

impl Breaker {
    pub fn closed(endpoint: &Endpoint, now: Timestamp) -> Breaker {
        Breaker {
            endpoint: endpoint.label.clone(),
            state: BreakerState::Closed,
            failures: 0,
            opened_at: None,
            trouble: None,
            last_error: String::new(),
            next_probe_at: None,
            probe_interval_ms: 0,
            probes: 0,
            updated_at: now,
        }
    }

    /// Whether a call may go out: always unless open, and then only the fleet's probe.
    pub fn lets(&self, released: Option<bool>) -> bool {
        match self.state {
            BreakerState::Closed | BreakerState::Recovering => true,
            BreakerState::Open => released == Some(true),
        }
    }

    /// The breaker after a call met `trouble` (`probe`: the call was the fleet's probe);
    /// `None` when it does not change.
    pub fn on_trouble(
        &self,
        report: &TroubleReport,
        now: Timestamp,
        c: &ProviderConfig,
    ) -> Breaker {
        let mut b = self.clone();
        b.trouble = Some(report.trouble);
        b.last_error = report.message.chars().take(500).collect();
        b.updated_at = now;
        let wait_asked = report.retry_after.unwrap_or_default();
        match self.state {
            BreakerState::Closed => {
                b.failures = b.failures.saturating_add(1);
                if report.trouble == Trouble::RateLimited || b.failures >= c.open_after {
                    b.open(now, c.probe_interval.max(wait_asked), false);
                }
            }
            // A released call failed: the endpoint is not back after all.
            BreakerState::Recovering => b.open(now, c.probe_interval.max(wait_asked), false),
            BreakerState::Open if report.probe => {
                let doubled = Duration::from_millis(self.probe_interval_ms.saturating_mul(2))
                    .clamp(c.probe_interval, probe_ceiling(self.opened_at, now, c));
                b.open(now, doubled.max(wait_asked), true);
            }
            // A call that was in flight when it opened: only a longer wait asked counts.
            BreakerState::Open => {
                let asked = now.saturating_add(wait_asked);
                if self.next_probe_at.is_none_or(|at| asked > at) {
                    b.next_probe_at = Some(asked);
                }
            }
        }
        b
    }

    fn open(&mut self, now: Timestamp, wait: Duration, keep_since: bool) {
        if !keep_since || self.opened_at.is_none() {
            self.opened_at = Some(now);
            self.probes = 0;
        }
        self.state = BreakerState::Open;
        self.next_probe_at = Some(now.saturating_add(wait));
        self.probe_interval_ms = u64::try_from(wait.as_millis()).unwrap_or(u64::MAX);
    }

    /// The breaker after a call succeeded; `None` when it does not change.
    pub fn on_success(&self, now: Timestamp) -> Option<Breaker> {
        let mut b = self.clone();
        match self.state {
            BreakerState::Closed if self.failures == 0 => return None,
            BreakerState::Closed => b.failures = 0,
            BreakerState::Open => b.state = BreakerState::Recovering,
            BreakerState::Recovering => return None,
        }
        b.updated_at = now;
        Some(b)
    }

    /// The breaker with its probe due at `now` claimed: the next probe a probe interval on (the
    /// wait its last failed probe set, at least `probe_interval`). `None` when it is not open or
    /// its probe is not due.
    pub(super) fn claim_probe(&self, now: Timestamp, c: &ProviderConfig) -> Option<Breaker> {
        if self.state != BreakerState::Open || self.next_probe_at.is_some_and(|at| at > now) {
            return None;
        }
        let mut next = self.clone();
        let interval = Duration::from_millis(self.probe_interval_ms).max(c.probe_interval);
        next.next_probe_at = Some(now.saturating_add(interval));
        next.probes = next.probes.saturating_add(1);
        next.updated_at = now;
        Some(next)
    }

    /// The breaker closed, once a recovery has released every waiting run; `None` when it is
    /// not recovering.
    pub(super) fn on_recovered(&self, now: Timestamp) -> Option<Breaker> {
        if self.state != BreakerState::Recovering {
            return None;
        }
        let mut next = self.clone();
        next.state = BreakerState::Closed;
        next.failures = 0;
        next.updated_at = now;
        Some(next)
    }
}

/// The longest wait between two probes of an endpoint open since `opened_at`:
/// `max_probe_interval`, or, in a long outage, 1/[`PROBE_SHARE`] of how long it has been open
/// (up to [`LONGEST_PROBE_WAIT`]). Recovery is noticed within a small share of the outage's
/// length, and a run that waits through a day-long outage alone is not probed (and its journal
/// not grown) every few seconds all day.
pub fn probe_ceiling(opened_at: Option<Timestamp>, now: Timestamp, c: &ProviderConfig) -> Duration {
    let open_for = opened_at
        .and_then(|at| Duration::try_from(now.0 - at.0).ok())
        .unwrap_or_default();
    c.max_probe_interval
        .max((open_for / PROBE_SHARE).min(LONGEST_PROBE_WAIT))
}

/// A long outage's probes come at most every 1/PROBE_SHARE of its length so far.
pub const PROBE_SHARE: u32 = 300;
/// The longest wait between two probes, however long the outage.
pub const LONGEST_PROBE_WAIT: Duration = Duration::from_secs(60);

/// What one call's trouble tells the breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TroubleReport {
    pub trouble: Trouble,
    pub message: String,
    /// How long the provider asked to be left alone (`retry-after`).
    pub retry_after: Option<Duration>,
    /// The call was the fleet's probe.
    pub probe: bool,
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fixtures::{at, endpoint, report};

    #[test]
    fn a_closed_breaker_opens_after_open_after_failures_in_a_row_and_a_success_resets_them() {
        let c = ProviderConfig::default();
        let mut b = Breaker::closed(&endpoint(), at(0));
        for i in 1..c.open_after {
            b = b.on_trouble(&report(Trouble::Unavailable, false, None), at(i.into()), &c);
            assert_eq!((b.state, b.failures), (BreakerState::Closed, i));
            assert!(b.lets(None));
        }
        let reset = b.on_success(at(10)).expect("a success clears the failures");
        assert_eq!((reset.state, reset.failures), (BreakerState::Closed, 0));
        assert_eq!(
            reset.on_success(at(11)),
            None,
            "a clean closed breaker is not written"
        );
        b = reset;
        for i in 0..c.open_after {
            b = b.on_trouble(
                &report(Trouble::Unavailable, false, None),
                at(20 + i64::from(i)),
                &c,
            );
        }
        assert_eq!(b.state, BreakerState::Open);
        assert!(
            !b.lets(None) && !b.lets(Some(false)),
            "only the probe goes out"
        );
        assert!(b.lets(Some(true)));
        assert_eq!(
            b.next_probe_at,
            Some(at(22).saturating_add(c.probe_interval))
        );
    }

    #[test]
    fn a_rate_limit_opens_at_once_for_as_long_as_the_provider_asked() {
        let c = ProviderConfig::default();
        let b = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, Some(30)),
            at(0),
            &c,
        );
        assert_eq!(b.state, BreakerState::Open);
        assert_eq!(b.next_probe_at, Some(at(30)));
        let short = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, Some(1)),
            at(0),
            &c,
        );
        assert_eq!(
            short.next_probe_at,
            Some(at(0).saturating_add(c.probe_interval))
        );
    }

    #[test]
    fn failed_probes_double_the_wait_up_to_the_max_and_calls_in_flight_do_not_shorten_it() {
        let c = ProviderConfig::default();
        let mut b = Breaker::closed(&endpoint(), at(0));
        b.failures = c.open_after - 1;
        b = b.on_trouble(&report(Trouble::Unavailable, false, None), at(0), &c);
        let opened = b.opened_at;
        let mut waits = Vec::new();
        let mut now = 0;
        for _ in 0..6 {
            now += 100;
            b = b.on_trouble(&report(Trouble::Unavailable, true, None), at(now), &c);
            waits.push(b.probe_interval_ms / 1000);
        }
        // From 1 s, doubling up to 2 s; the outage is 600 s old by the last probe, so its
        // ceiling is still 2 s.
        assert_eq!(waits, vec![2, 2, 2, 2, 2, 2]);
        assert_eq!(b.opened_at, opened, "still the same outage");
        let before = b.next_probe_at;
        let in_flight = b.on_trouble(&report(Trouble::Unavailable, false, None), at(now), &c);
        assert_eq!(in_flight.next_probe_at, before);
        let asked = b.on_trouble(&report(Trouble::RateLimited, false, Some(600)), at(now), &c);
        assert_eq!(asked.next_probe_at, Some(at(now + 600)));
    }

    #[test]
    fn probes_slow_down_in_proportion_to_a_long_outage_up_to_a_minute() {
        let c = ProviderConfig::default();
        let opened = Some(at(0));
        assert_eq!(probe_ceiling(opened, at(10), &c), c.max_probe_interval);
        assert_eq!(probe_ceiling(opened, at(3000), &c), Duration::from_secs(10));
        assert_eq!(probe_ceiling(opened, at(86_400), &c), LONGEST_PROBE_WAIT);
        // A long outage's failed probes double the wait up to that ceiling.
        let mut b = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, None),
            at(0),
            &c,
        );
        for _ in 0..10 {
            b = b.on_trouble(&report(Trouble::Unavailable, true, None), at(6000), &c);
        }
        assert_eq!(b.probe_interval_ms, 20_000);
        // A probe the provider asked to put off longer waits as asked.
        let asked = b.on_trouble(&report(Trouble::RateLimited, true, Some(300)), at(6000), &c);
        assert_eq!(asked.probe_interval_ms, 300_000);
    }

    #[test]
    fn a_successful_probe_starts_the_recovery_and_a_failure_during_it_opens_again() {
        let c = ProviderConfig::default();
        let open = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, None),
            at(0),
            &c,
        );
        let recovering = open.on_success(at(5)).expect("changes");
        assert_eq!(recovering.state, BreakerState::Recovering);
        assert!(recovering.lets(None));
        assert_eq!(recovering.on_success(at(6)), None);
        let again = recovering.on_trouble(&report(Trouble::Unavailable, false, None), at(7), &c);
        assert_eq!(again.state, BreakerState::Open);
        assert_eq!(again.opened_at, Some(at(7)));
    }

    #[test]
    fn the_fleet_claims_a_due_probe_once_and_pushes_the_next_one_a_probe_interval_on() {
        let c = ProviderConfig::default();
        let closed = Breaker::closed(&endpoint(), at(0));
        assert_eq!(
            closed.claim_probe(at(0), &c),
            None,
            "only an open breaker is probed"
        );
        let open = closed.on_trouble(&report(Trouble::RateLimited, false, Some(30)), at(0), &c);
        assert_eq!(open.claim_probe(at(29), &c), None, "not due yet");
        let claimed = open.claim_probe(at(30), &c).expect("due");
        assert_eq!(claimed.probes, 1);
        assert_eq!(claimed.updated_at, at(30));
        assert_eq!(
            claimed.next_probe_at,
            Some(at(60)),
            "the wait the provider asked"
        );
        assert_eq!(
            claimed.claim_probe(at(30), &c),
            None,
            "a claimed probe is not due again"
        );
        // A short wait is never shorter than `probe_interval`.
        let mut short = open.clone();
        short.probe_interval_ms = 1;
        let claimed = short.claim_probe(at(30), &c).expect("due");
        assert_eq!(
            claimed.next_probe_at,
            Some(at(30).saturating_add(c.probe_interval))
        );
    }

    #[test]
    fn only_a_recovering_breaker_closes_once_its_runs_are_released() {
        let c = ProviderConfig::default();
        let open = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, None),
            at(0),
            &c,
        );
        assert_eq!(open.on_recovered(at(1)), None);
        let recovering = open.on_success(at(2)).expect("recovering");
        let closed = recovering.on_recovered(at(3)).expect("closes");
        assert_eq!(
            (closed.state, closed.failures, closed.updated_at),
            (BreakerState::Closed, 0, at(3))
        );
        assert_eq!(closed.on_recovered(at(4)), None);
        assert_eq!(BreakerState::Recovering.as_str(), "recovering");
    }
}
