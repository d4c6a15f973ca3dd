//! Where a call goes and in what order waiting runs go: pure decisions from the breakers, the
//! waiters and the time.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use kedge_core::event::{Timestamp, Trouble};
use kedge_core::ids::{RunId, TenantId};

use super::{Breaker, BreakerState, Waiter};

impl Waiter {
    /// Whether the run may be released to a fallback now: its endpoint (`primary`) has been
    /// failing for its `fallback_after`, and one of its fallbacks' breakers lets calls go.
    pub(super) fn may_fall_back(
        &self,
        primary: &Breaker,
        breakers: &HashMap<String, (Breaker, u64)>,
        now: Timestamp,
    ) -> bool {
        let Some(after) = self.fallback_after_ms.map(Duration::from_millis) else {
            return false;
        };
        failing_long_enough(primary, after, now)
            && self
                .fallbacks
                .iter()
                .any(|id| breakers.get(id).is_none_or(|(b, _)| b.lets(None)))
    }
}

/// Whether `primary` has been failing (open) for at least `after`.
fn failing_long_enough(primary: &Breaker, after: Duration, now: Timestamp) -> bool {
    primary.state == BreakerState::Open
        && primary
            .opened_at
            .is_some_and(|at| now >= at.saturating_add(after))
}

/// Where a call goes ([`route`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// To the run's own model (`probe`: as the fleet's probe of its failing endpoint).
    Primary { probe: bool },
    /// To the run's fallback model of this index.
    Fallback(usize),
    /// Nowhere yet: the run's model's endpoint is failing and no fallback may answer.
    Hold { reason: String, trouble: Trouble },
}

/// Where a call goes, from the breakers: the run's own model unless its endpoint's breaker
/// holds the call (`released`: the run's release, `Some(true)` for the probe); then, once that
/// endpoint has been failing for `fallback_after`, the first fallback whose breaker lets calls
/// go (none known: closed); else nowhere.
pub fn route(
    primary: &Breaker,
    fallbacks: &[Breaker],
    fallback_after: Duration,
    released: Option<bool>,
    now: Timestamp,
) -> Route {
    if primary.lets(released) {
        return Route::Primary {
            probe: released == Some(true),
        };
    }
    if failing_long_enough(primary, fallback_after, now)
        && let Some(i) = fallbacks.iter().position(|b| b.lets(None))
    {
        return Route::Fallback(i);
    }
    let next = primary
        .next_probe_at
        .map_or_else(String::new, |at| format!("; next probe at {at}"));
    Route::Hold {
        reason: format!(
            "not sent: {} is failing since {}{next}; last error: {}",
            primary.endpoint,
            primary.opened_at.unwrap_or(primary.updated_at),
            primary.last_error
        ),
        trouble: primary.trouble.unwrap_or(Trouble::Unavailable),
    }
}

/// The order runs are released in: oldest first within each tenant, the tenants taking turns
/// (each turn goes to the tenant whose next run waited longest), so one tenant's thousand
/// waiting runs do not starve another's one. Runs whose `not_before` is after `now` wait.
pub fn release_order<'a>(
    waiters: impl IntoIterator<Item = &'a Waiter>,
    now: Timestamp,
) -> Vec<&'a Waiter> {
    let mut by_tenant: BTreeMap<&TenantId, Vec<&Waiter>> = BTreeMap::new();
    for w in waiters.into_iter().filter(|w| w.not_before <= now) {
        by_tenant.entry(&w.tenant).or_default().push(w);
    }
    let mut queues: Vec<std::collections::VecDeque<&Waiter>> = by_tenant
        .into_values()
        .map(|mut q| {
            q.sort_by(|a, b| (a.since, &a.run_id).cmp(&(b.since, &b.run_id)));
            q.into()
        })
        .collect();
    let mut out = Vec::new();
    loop {
        // Each round: one run of every tenant with any left, in the order of their heads.
        let mut round: Vec<&Waiter> = queues.iter_mut().filter_map(|q| q.pop_front()).collect();
        if round.is_empty() {
            return out;
        }
        round.sort_by(|a, b| (a.since, &a.run_id).cmp(&(b.since, &b.run_id)));
        out.extend(round);
    }
}

/// The run an open endpoint's probe goes with, of the runs `order` lets go (`revisions`: the
/// revision of each run's wait).
pub(super) fn probe_run<'w>(
    order: &[&'w Waiter],
    primary: &Breaker,
    breakers: &HashMap<String, (Breaker, u64)>,
    revisions: &HashMap<&RunId, u64>,
    now: Timestamp,
) -> Option<&'w Waiter> {
    // The probe goes to the run that has waited longest since it last
    // began to wait (the lowest revision): a run probed in vain waits again
    // under a new one, so the probes take turns among the waiting runs. A
    // run that may fall back is not probed with: it goes to its fallback,
    // and its call there probes the endpoint when the probe is due
    // ([`Providers::route`]).
    order
        .iter()
        .filter(|w| !w.may_fall_back(primary, breakers, now))
        .min_by_key(|w| revisions.get(&w.run_id).copied().unwrap_or_default())
        .copied()
}

/// The first `most` of `order` that may fall back from the open `primary`, the probe's run
/// aside.
pub(super) fn fallback_runs<'w>(
    order: Vec<&'w Waiter>,
    probe: Option<&Waiter>,
    primary: &Breaker,
    breakers: &HashMap<String, (Breaker, u64)>,
    most: usize,
    now: Timestamp,
) -> Vec<&'w Waiter> {
    // Runs that may fall back go, at the release rate, to their fallback.
    order
        .into_iter()
        .filter(|w| {
            probe.is_none_or(|p| p.run_id != w.run_id) && w.may_fall_back(primary, breakers, now)
        })
        .take(most)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::ProviderConfig;
    use crate::provider::fixtures::{at, endpoint, report, waiter};

    #[test]
    fn runs_are_released_oldest_first_with_the_tenants_taking_turns() {
        let ws = [
            waiter("run_a1", "acme", 1, 0),
            waiter("run_a2", "acme", 2, 0),
            waiter("run_a3", "acme", 3, 0),
            waiter("run_a4", "acme", 4, 0),
            waiter("run_b1", "beta", 10, 0),
            waiter("run_c1", "core", 5, 0),
            waiter("run_c2", "core", 6, 0),
            waiter("run_late", "beta", 0, 100),
        ];
        let order: Vec<&str> = release_order(ws.iter(), at(50))
            .iter()
            .map(|w| w.run_id.as_str())
            .collect();
        assert_eq!(
            order,
            [
                "run_a1", "run_c1", "run_b1", "run_a2", "run_c2", "run_a3", "run_a4"
            ],
            "a run whose own wait is not over stays"
        );
        assert_eq!(release_order(ws.iter(), at(100)).len(), ws.len());
    }

    #[test]
    fn a_call_goes_to_the_runs_model_then_after_fallback_after_to_the_first_fallback_not_failing() {
        let c = ProviderConfig::default();
        let closed = Breaker::closed(&endpoint(), at(0));
        let mut open = closed.clone();
        for i in 0..c.open_after {
            open = open.on_trouble(&report(Trouble::Unavailable, false, None), at(i.into()), &c);
        }
        assert_eq!(open.state, BreakerState::Open);
        let opened = open.opened_at.expect("opened");
        let after = Duration::from_secs(30);
        let falls = [open.clone(), closed.clone()];
        // The run's own model, while it answers.
        assert_eq!(
            route(&closed, &falls, after, None, at(100)),
            Route::Primary { probe: false }
        );
        // Failing, but not for long enough: held.
        let soon = opened.saturating_add(Duration::from_secs(29));
        assert!(matches!(
            route(&open, &falls, after, None, soon),
            Route::Hold {
                trouble: Trouble::Unavailable,
                ..
            }
        ));
        // Long enough: the first fallback whose endpoint is not failing.
        let later = opened.saturating_add(after);
        assert_eq!(route(&open, &falls, after, None, later), Route::Fallback(1));
        // The fleet's probe goes to the run's own model, whatever the fallbacks.
        assert_eq!(
            route(&open, &falls, after, Some(true), later),
            Route::Primary { probe: true }
        );
        // Every fallback failing too, or none: held.
        assert!(matches!(
            route(&open, &[open.clone()], after, None, later),
            Route::Hold { .. }
        ));
        assert!(matches!(
            route(&open, &[], after, None, later),
            Route::Hold { .. }
        ));
        // Back (a probe succeeded): the run's own model again.
        let recovering = open.on_success(later).expect("recovering");
        assert_eq!(
            route(&recovering, &falls, after, None, later),
            Route::Primary { probe: false }
        );
        // A waiting run may be released to its fallback on the same terms.
        let mut w = waiter("run_a", "t", 0, 0);
        w.fallbacks = vec!["f1".into()];
        w.fallback_after_ms = Some(30_000);
        let mut breakers = HashMap::new();
        assert!(
            w.may_fall_back(&open, &breakers, later),
            "no breaker: closed"
        );
        assert!(!w.may_fall_back(&open, &breakers, soon));
        breakers.insert("f1".to_owned(), (open.clone(), 1));
        assert!(
            !w.may_fall_back(&open, &breakers, later),
            "its fallback is failing too"
        );
        assert!(!waiter("run_b", "t", 0, 0).may_fall_back(&open, &HashMap::new(), later));
    }

    #[test]
    fn an_open_endpoints_probe_takes_turns_and_runs_that_may_fall_back_go_to_their_fallback() {
        let c = ProviderConfig::default();
        let open = Breaker::closed(&endpoint(), at(0)).on_trouble(
            &report(Trouble::RateLimited, false, None),
            at(0),
            &c,
        );
        let later = at(100);
        let mut falls = waiter("run_f", "t", 0, 0);
        falls.fallbacks = vec!["f1".into()];
        falls.fallback_after_ms = Some(30_000);
        let ws = [
            waiter("run_a", "t", 1, 0),
            waiter("run_b", "t", 2, 0),
            falls,
        ];
        let order = release_order(ws.iter(), later);
        let breakers = HashMap::new();
        // The lowest revision: the run that has waited longest since it last began to wait.
        let revisions: HashMap<&RunId, u64> = ws
            .iter()
            .zip([9, 4, 1])
            .map(|(w, rev)| (&w.run_id, rev))
            .collect();
        let probe = probe_run(&order, &open, &breakers, &revisions, later);
        assert_eq!(
            probe.map(|w| w.run_id.as_str()),
            Some("run_b"),
            "a run that may fall back is not probed with"
        );
        let fallen: Vec<&str> = fallback_runs(order.clone(), probe, &open, &breakers, 5, later)
            .iter()
            .map(|w| w.run_id.as_str())
            .collect();
        assert_eq!(fallen, ["run_f"]);
        assert!(fallback_runs(order.clone(), probe, &open, &breakers, 0, later).is_empty());
        // Not failing for long enough: it is probed with like any other, and nothing falls back.
        let soon = at(10);
        let probe = probe_run(&order, &open, &breakers, &revisions, soon);
        assert_eq!(probe.map(|w| w.run_id.as_str()), Some("run_f"));
        assert!(fallback_runs(order, probe, &open, &breakers, 5, soon).is_empty());
    }
}
