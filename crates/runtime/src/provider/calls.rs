//! This process's calls: where each goes, the reports of how they went to the endpoint's
//! breaker, and their slots under the endpoint's rate limits.

use std::collections::BTreeMap;
use std::time::Duration;

use async_nats::jetstream::kv;
use kedge_core::event::Timestamp;

use super::{
    Breaker, CAS_ATTEMPTS, Endpoint, IN_PLACE, Limits, PACE_ATTEMPTS, Pace, Providers, Route,
    TroubleReport, breaker_key, pace_key, route,
};

/// Where a call stands with its endpoint's rate limits ([`Providers::admit`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Admit {
    /// Its slot is this far away: wait, then call.
    After(Duration),
    /// No slot within [`IN_PLACE`], or runs already wait their turn: the run joins them.
    Queue { reason: String },
}

impl Providers {
    /// The endpoint's breaker as this process sees it (closed when it has none).
    pub fn breaker(&self, endpoint: &Endpoint) -> Breaker {
        self.lock()
            .breakers
            .get(&endpoint.id)
            .map(|(b, _)| b.clone())
            .unwrap_or_else(|| Breaker::closed(endpoint, Timestamp::now()))
    }

    /// Every breaker and how many runs wait on each, as this process sees them (for
    /// `kedge providers` and the metrics).
    pub fn snapshot(&self) -> Vec<(String, Breaker, usize)> {
        let view = self.lock();
        let mut out: Vec<(String, Breaker, usize)> = view
            .breakers
            .iter()
            .map(|(id, (b, _))| {
                let waiting = view.waiters.get(id).map_or(0, BTreeMap::len);
                (id.clone(), b.clone(), waiting)
            })
            .collect();
        out.sort_by(|a, b| a.1.endpoint.cmp(&b.1.endpoint));
        out
    }

    /// Where a call of a run whose model is at `primary` goes now ([`route`]; `released`: the
    /// run's release, `Some(true)` for the probe). A call that would go to a fallback while
    /// `primary`'s probe is due claims the probe and goes to `primary` instead: with every run
    /// on its fallback and none waiting, the calls themselves find out when it is back.
    pub async fn route(
        &self,
        primary: &Endpoint,
        fallbacks: &[Endpoint],
        fallback_after: Duration,
        released: Option<bool>,
    ) -> Route {
        let breakers: Vec<Breaker> = fallbacks.iter().map(|e| self.breaker(e)).collect();
        let now = Timestamp::now();
        let r = route(
            &self.breaker(primary),
            &breakers,
            fallback_after,
            released,
            now,
        );
        if matches!(r, Route::Fallback(_)) && self.claim_probe(&primary.id).await {
            return Route::Primary { probe: true };
        }
        r
    }
    /// Reports a call that succeeded (a write only when the breaker was not closed and clean).
    pub async fn report_success(&self, endpoint: &Endpoint) {
        self.change(endpoint, |b, now| b.on_success(now)).await;
    }

    /// Reports a call that met provider trouble.
    pub async fn report_trouble(&self, endpoint: &Endpoint, report: &TroubleReport) {
        let config = self.inner.config.clone();
        self.change(endpoint, |b, now| Some(b.on_trouble(report, now, &config)))
            .await;
    }

    /// Applies `f` to the endpoint's breaker by compare-and-set (a few tries; a report lost
    /// to contention is made again by the next call). Best effort: never fails the caller.
    async fn change(
        &self,
        endpoint: &Endpoint,
        f: impl Fn(&Breaker, Timestamp) -> Option<Breaker>,
    ) {
        let key = breaker_key(&endpoint.id);
        // The view decides first: most successes change nothing and cost no round trip.
        let cached = self.lock().breakers.get(&endpoint.id).cloned();
        let now = Timestamp::now();
        match &cached {
            Some((b, _)) if f(b, now).is_none() => return,
            None if f(&Breaker::closed(endpoint, now), now).is_none() => return,
            _ => {}
        }
        for _ in 0..CAS_ATTEMPTS {
            let current = match self.inner.kv.entry(key.clone()).await {
                Ok(e) => e.filter(|e| e.operation == kv::Operation::Put),
                Err(e) => {
                    tracing::warn!(endpoint = %endpoint.label, error = %e, "cannot read the endpoint's breaker");
                    return;
                }
            };
            let now = Timestamp::now();
            let (breaker, revision) = match &current {
                Some(e) => match serde_json::from_slice::<Breaker>(&e.value) {
                    Ok(b) => (b, Some(e.revision)),
                    // A record that does not parse is replaced.
                    Err(_) => (Breaker::closed(endpoint, now), Some(e.revision)),
                },
                None => (Breaker::closed(endpoint, now), None),
            };
            let Some(next) = f(&breaker, now) else { return };
            match self.write(&key, &next, revision).await {
                Ok(rev) => {
                    if next.state != breaker.state {
                        tracing::info!(endpoint = %endpoint.label, from = breaker.state.as_str(), to = next.state.as_str(), error = %next.last_error, "model endpoint breaker");
                    }
                    self.lock()
                        .breakers
                        .insert(endpoint.id.clone(), (next, rev));
                    return;
                }
                Err(e) => {
                    tracing::debug!(endpoint = %endpoint.label, error = %e, "breaker changed concurrently; reading it again")
                }
            }
        }
    }

    /// Every pace (a model's rate limits at an endpoint, and the fleet's next slot), as this
    /// process sees them (for `kedge providers`).
    pub fn paces(&self) -> Vec<Pace> {
        let mut out: Vec<Pace> = self.lock().paces.values().map(|(p, _)| p.clone()).collect();
        out.sort_by(|a, b| (&a.endpoint, &a.model).cmp(&(&b.endpoint, &b.model)));
        out
    }

    /// The rate limits `model`'s calls to the endpoint keep to: `configured` (this process's
    /// `providers.limits`) and those the provider named, the lower of each.
    pub fn limits(&self, endpoint: &Endpoint, model: &str, configured: Limits) -> Limits {
        let learned = self
            .lock()
            .paces
            .get(&endpoint.pace_id(model))
            .map(|(p, _)| p.learned)
            .unwrap_or_default();
        configured.lower(learned)
    }

    /// Takes the call's slot under the rate limits of `model` at the endpoint: how long to
    /// wait for it, or that the run waits its turn in the queue (runs already wait there, or
    /// the slot is more than [`IN_PLACE`] away). A call with no limit goes at once, and costs
    /// no round trip.
    pub async fn admit(
        &self,
        endpoint: &Endpoint,
        model: &str,
        configured: Limits,
        tokens: u64,
    ) -> Admit {
        let limits = self.limits(endpoint, model, configured);
        if limits.is_none() {
            return Admit::After(Duration::ZERO);
        }
        let queued = self
            .lock()
            .waiters
            .get(&endpoint.id)
            .map_or(0, BTreeMap::len);
        if queued > 0 {
            return Admit::Queue {
                reason: format!(
                    "waiting its turn behind {queued} run(s) at {} (limit {limits})",
                    endpoint.label
                ),
            };
        }
        let reserved = self
            .change_pace(
                &endpoint.pace_id(model),
                (&endpoint.label, model),
                Some(configured),
                |p, now| match p.reserve(now, tokens, IN_PLACE) {
                    Ok((wait, next)) => (Ok(wait), Some(next)),
                    Err(far) => (Err(far), None),
                },
            )
            .await;
        match reserved {
            Some(Ok(wait)) => Admit::After(wait),
            Some(Err(far)) => Admit::Queue {
                reason: format!(
                    "waiting its turn at {}: the next slot under its limit ({limits}) is {} ms away",
                    endpoint.label,
                    far.as_millis()
                ),
            },
            None => Admit::Queue {
                reason: format!(
                    "waiting its turn at {}: its pace could not be read or changed",
                    endpoint.label
                ),
            },
        }
    }

    /// Records the limits the provider named in a response's headers (a write only when they
    /// changed).
    pub async fn learn(&self, endpoint: &Endpoint, model: &str, learned: Limits) {
        let id = endpoint.pace_id(model);
        let known = self.lock().paces.get(&id).map(|(p, _)| p.learned);
        if known == Some(learned) {
            return;
        }
        self.change_pace(&id, (&endpoint.label, model), None, |p, now| {
            if p.learned == learned {
                return ((), None);
            }
            let mut next = p.clone();
            next.learned = learned;
            next.updated_at = now;
            tracing::info!(endpoint = %endpoint.label, %learned, "the provider names its rate limits");
            ((), Some(next))
        })
        .await;
    }

    /// Applies `f` to a pace by compare-and-set: what `f` says, once its change is written (or
    /// it changes nothing); `None` when the bucket cannot be read or written, or other processes
    /// won every try. `configured`: this process's configured limits, written into the record
    /// (the releaser reads them there).
    async fn change_pace<T>(
        &self,
        id: &str,
        (label, model): (&str, &str),
        configured: Option<Limits>,
        mut f: impl FnMut(&Pace, Timestamp) -> (T, Option<Pace>),
    ) -> Option<T> {
        let key = pace_key(id);
        // The first try trusts the view; a conflict reads the record itself.
        let mut current = self.lock().paces.get(id).cloned().map(Some);
        for _ in 0..PACE_ATTEMPTS {
            let found = match current.take() {
                Some(found) => found,
                None => match self.inner.kv.entry(key.clone()).await {
                    Ok(e) => e.filter(|e| e.operation == kv::Operation::Put).map(|e| {
                        let p = serde_json::from_slice::<Pace>(&e.value)
                            .unwrap_or_else(|_| Pace::new(label, model, Timestamp::now()));
                        (p, e.revision)
                    }),
                    Err(e) => {
                        tracing::warn!(endpoint = %label, error = %e, "cannot read the endpoint's pace");
                        return None;
                    }
                },
            };
            let now = Timestamp::now();
            let (mut pace, revision) = match found {
                Some((p, rev)) => (p, Some(rev)),
                None => (Pace::new(label, model, now), None),
            };
            let reconfigured = configured.is_some_and(|c| c != pace.configured);
            if let Some(c) = configured {
                pace.configured = c;
            }
            let (verdict, next) = f(&pace, now);
            let next = match next {
                Some(next) => next,
                None if reconfigured => pace,
                None => return Some(verdict),
            };
            match self.write(&key, &next, revision).await {
                Ok(rev) => {
                    self.lock().paces.insert(id.to_owned(), (next, rev));
                    return Some(verdict);
                }
                Err(e) => {
                    tracing::debug!(endpoint = %label, error = %e, "pace changed concurrently; reading it again");
                }
            }
        }
        None
    }
}
