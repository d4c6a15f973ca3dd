//! The waits and their release: a run's wait record, and the release loop that lets the
//! waiting runs go as the breakers and the paces allow, one releaser per endpoint (its lead).

use kedge_core::Input;
use kedge_core::InputEnvelope;
use std::collections::{BTreeMap, HashMap};

use async_nats::HeaderMap;
use async_nats::jetstream::kv;
use kedge_core::event::{Draft, ProviderReleased, Timestamp};
use kedge_core::ids::{InputId, RunId};
use kedge_core::subjects::PROVIDERS_BUCKET;
use kedge_journal::Journal;

use super::records::LeadStep;
use super::routing::{fallback_runs, probe_run};
use super::{
    Breaker, BreakerState, Endpoint, LEAD_FOR, Lead, MARKER_TTL_SECS, Pace, ProviderError,
    Providers, TICK, Waiter, breaker_key, lead_key, pace_key, release_order, unavailable, wait_key,
};
use crate::metrics;

impl Providers {
    /// Records `waiter` as waiting on `endpoint` (before its `provider.waiting` is journaled):
    /// a new revision, so a release of an earlier wait cannot remove it.
    pub async fn wait(&self, endpoint: &Endpoint, waiter: &Waiter) -> Result<(), ProviderError> {
        let bytes = serde_json::to_vec(waiter).map_err(unavailable)?;
        let rev = self
            .inner
            .kv
            .put(wait_key(&endpoint.id, &waiter.run_id), bytes.into())
            .await
            .map_err(unavailable)?;
        self.lock()
            .waiters
            .entry(endpoint.id.clone())
            .or_default()
            .insert(waiter.run_id.clone(), (waiter.clone(), rev));
        Ok(())
    }

    /// Makes sure a run the journal says is waiting has its record (a drive of a waiting run:
    /// the record may have been lost with a broker's store, or never written before a crash).
    pub async fn ensure_waiting(
        &self,
        endpoint: &Endpoint,
        waiter: &Waiter,
    ) -> Result<(), ProviderError> {
        let known = self
            .lock()
            .waiters
            .get(&endpoint.id)
            .is_some_and(|w| w.contains_key(&waiter.run_id));
        if known {
            return Ok(());
        }
        let bytes = serde_json::to_vec(waiter).map_err(unavailable)?;
        match self
            .inner
            .kv
            .create(wait_key(&endpoint.id, &waiter.run_id), bytes.into())
            .await
        {
            Ok(_) => Ok(()),
            Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => Ok(()),
            Err(e) => Err(unavailable(e)),
        }
    }

    /// Removes a run's wait (it left the wait other than by a release: cancelled, failed).
    pub async fn forget(&self, endpoint: &Endpoint, run: &RunId) {
        if let Err(e) = self.remove(&endpoint.id, run, None).await {
            tracing::debug!(run_id = %run, error = %e, "could not remove the run's wait on its provider");
        }
    }

    /// A delete marker on the wait's key (checked on `revision` when given) that expires.
    async fn remove(
        &self,
        id: &str,
        run: &RunId,
        revision: Option<u64>,
    ) -> Result<(), ProviderError> {
        let mut headers = HeaderMap::new();
        headers.insert("KV-Operation", "DEL");
        headers.insert("Nats-TTL", format!("{MARKER_TTL_SECS}s").as_str());
        if let Some(r) = revision {
            headers.insert(
                "Nats-Expected-Last-Subject-Sequence",
                r.to_string().as_str(),
            );
        }
        let subject = kedge_core::subjects::kv_key(PROVIDERS_BUCKET, &wait_key(id, run));
        self.inner
            .js
            .publish_with_headers(subject, headers, bytes::Bytes::new())
            .await
            .map_err(unavailable)?
            .await
            .map_err(unavailable)?;
        if let Some(w) = self.lock().waiters.get_mut(id) {
            w.retain(|r, (_, rev)| r != run || revision.is_some_and(|mine| *rev > mine));
        }
        Ok(())
    }

    /// Whether this process releases the endpoint's runs now (taking or renewing its lead).
    async fn lead(&self, id: &str) -> bool {
        let now = Timestamp::now();
        let held = self.lock().leads.get(id).cloned();
        let revision = match Lead::step(held.as_ref(), &self.inner.worker, now) {
            LeadStep::Keep => return true,
            LeadStep::Leave => return false,
            LeadStep::Write(revision) => revision,
        };
        let lead = Lead {
            worker: self.inner.worker.to_string(),
            until: now.saturating_add(LEAD_FOR),
        };
        match self.write(&lead_key(id), &lead, revision).await {
            Ok(rev) => {
                self.lock().leads.insert(id.to_owned(), (lead, rev));
                true
            }
            Err(_) => false,
        }
    }

    /// Claims the endpoint's probe due now: moves `next_probe_at` on by the probe interval
    /// (compare-and-set, so two releasers never both send one). `false` when it is not due or
    /// another process claimed it.
    pub(super) async fn claim_probe(&self, id: &str) -> bool {
        let Some((b, rev)) = self.lock().breakers.get(id).cloned() else {
            return false;
        };
        let Some(next) = b.claim_probe(Timestamp::now(), &self.inner.config) else {
            return false;
        };
        match self.write(&breaker_key(id), &next, Some(rev)).await {
            Ok(rev) => {
                self.lock().breakers.insert(id.to_owned(), (next, rev));
                true
            }
            Err(_) => false,
        }
    }

    /// Closes a recovering breaker whose runs have all been released.
    async fn close_recovered(&self, id: &str) {
        let Some((b, rev)) = self.lock().breakers.get(id).cloned() else {
            return;
        };
        let Some(next) = b.on_recovered(Timestamp::now()) else {
            return;
        };
        if let Ok(rev) = self.write(&breaker_key(id), &next, Some(rev)).await {
            tracing::info!(endpoint = %next.endpoint, "model endpoint recovered; breaker closed");
            self.lock().breakers.insert(id.to_owned(), (next, rev));
        }
    }

    /// Journals `provider.released` for the wait (deduplicated by its revision), then removes
    /// the wait (checked on that revision: a newer wait of the run stays).
    async fn release(
        &self,
        journal: &Journal,
        id: &str,
        waiter: &Waiter,
        revision: u64,
        probe: bool,
    ) -> Result<(), ProviderError> {
        let input = InputEnvelope::new(
            waiter.run_id.clone(),
            Timestamp::now(),
            Draft::new(Input::ProviderReleased(ProviderReleased { probe })),
        );
        let input_id = InputId::provider_released(&waiter.run_id, revision);
        // A repeat (this releaser's earlier self after a crash) released nothing twice.
        journal
            .append_input(&input_id, &input)
            .await
            .map_err(unavailable)?;
        metrics::provider_released(probe);
        tracing::debug!(run_id = %waiter.run_id, probe, "released from its wait on the provider");
        self.remove(id, &waiter.run_id, Some(revision)).await
    }

    /// The first `most` of `order` whose calls have a slot within the next tick under their
    /// pace, which is reserved for them (one compare-and-set per pace; a pace that another
    /// process changed meanwhile lets none of its runs go this tick). Runs waiting with no pace
    /// (trouble, not a rate limit) need no slot.
    async fn reserve_turns<'w>(&self, order: Vec<&'w Waiter>, most: usize) -> Vec<&'w Waiter> {
        let now = Timestamp::now();
        let mut paces: HashMap<String, Option<(Pace, u64)>> = HashMap::new();
        let mut chosen: Vec<(&Waiter, Option<&str>)> = Vec::new();
        for w in order {
            if chosen.len() >= most {
                break;
            }
            let Some(pid) = w.pace.as_deref() else {
                chosen.push((w, None));
                continue;
            };
            let entry = paces
                .entry(pid.to_owned())
                .or_insert_with(|| self.lock().paces.get(pid).cloned());
            match entry {
                // No pace recorded: nothing to keep to.
                None => chosen.push((w, None)),
                Some((pace, _)) => {
                    if let Ok((_, next)) = pace.reserve(now, w.tokens, TICK) {
                        *pace = next;
                        chosen.push((w, Some(pid)));
                    }
                }
            }
        }
        let mut refused: Vec<String> = Vec::new();
        for (pid, found) in paces {
            let Some((pace, rev)) = found else { continue };
            let unchanged = self
                .lock()
                .paces
                .get(&pid)
                .is_some_and(|(p, r)| *r == rev && *p == pace);
            if unchanged {
                continue;
            }
            match self.write(&pace_key(&pid), &pace, Some(rev)).await {
                Ok(rev) => {
                    self.lock().paces.insert(pid, (pace, rev));
                }
                Err(_) => refused.push(pid),
            }
        }
        chosen
            .into_iter()
            .filter(|(_, pid)| pid.is_none_or(|p| !refused.iter().any(|r| r == p)))
            .map(|(w, _)| w)
            .collect()
    }

    /// Releases waiting runs, until its task is aborted: every `TICK`, for each endpoint with runs
    /// waiting whose lead this process holds, the probe due (open) or the next runs at
    /// `release_per_second` (closed, recovering). Runs in every step process; the leads keep
    /// it to one releaser per endpoint.
    pub async fn run_releaser(self, journal: Journal) {
        let mut ticker = tokio::time::interval(TICK);
        ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // Release credit per endpoint, refilled at `release_per_second` (burst: one tick's
        // worth, at least one run).
        let mut credit: HashMap<String, f64> = HashMap::new();
        let rate = f64::from(self.inner.config.release_per_second);
        let burst = (rate * TICK.as_secs_f64()).max(1.0);
        loop {
            ticker.tick().await;
            let (endpoints, recovering_idle, waiting, open) = self.releaser_view();
            metrics::provider_view(waiting, open);
            for id in recovering_idle {
                if self.lead(&id).await {
                    self.close_recovered(&id).await;
                }
            }
            for id in endpoints {
                if !self.lead(&id).await {
                    continue;
                }
                let c = credit.entry(id.clone()).or_insert(burst);
                self.release_endpoint(&journal, &id, c, (rate, burst)).await;
            }
        }
    }

    /// What the releaser looks at each tick, from the view: the endpoints with runs waiting, the
    /// recovering ones with none left, how many runs wait and how many breakers are open.
    fn releaser_view(&self) -> (Vec<String>, Vec<String>, usize, usize) {
        let view = self.lock();
        let endpoints: Vec<String> = view
            .waiters
            .iter()
            .filter(|(_, w)| !w.is_empty())
            .map(|(id, _)| id.clone())
            .collect();
        let recovering_idle: Vec<String> = view
            .breakers
            .iter()
            .filter(|(id, (b, _))| {
                b.state == BreakerState::Recovering
                    && view.waiters.get(*id).is_none_or(BTreeMap::is_empty)
            })
            .map(|(id, _)| id.clone())
            .collect();
        let waiting = view.waiters.values().map(BTreeMap::len).sum::<usize>();
        let open = view
            .breakers
            .values()
            .filter(|(b, _)| b.state == BreakerState::Open)
            .count();
        (endpoints, recovering_idle, waiting, open)
    }

    /// The endpoint's breaker and waiting runs, from the view.
    fn endpoint_view(&self, id: &str) -> EndpointView {
        let view = self.lock();
        let breaker = view.breakers.get(id).map(|(b, _)| b.clone());
        let waiters: Vec<(Waiter, u64)> = view
            .waiters
            .get(id)
            .map(|w| w.values().cloned().collect())
            .unwrap_or_default();
        // The fallbacks' breakers, for the runs that may fall back.
        let breakers = if breaker
            .as_ref()
            .is_some_and(|b| b.state == BreakerState::Open)
            && waiters.iter().any(|(w, _)| !w.fallbacks.is_empty())
        {
            view.breakers.clone()
        } else {
            HashMap::new()
        };
        EndpointView {
            breaker,
            waiters,
            breakers,
        }
    }

    /// One tick's releases at an endpoint whose lead this process holds, as far as its release
    /// credit `c` goes (refilled first at `rate`, up to `burst`): the probe due and the runs that
    /// may fall back (open), or the next runs under their pace (closed, recovering).
    async fn release_endpoint(
        &self,
        journal: &Journal,
        id: &str,
        c: &mut f64,
        (rate, burst): (f64, f64),
    ) {
        let now = Timestamp::now();
        let EndpointView {
            breaker,
            waiters,
            breakers,
        } = self.endpoint_view(id);
        let revisions: HashMap<&RunId, u64> =
            waiters.iter().map(|(w, rev)| (&w.run_id, *rev)).collect();
        let order = release_order(waiters.iter().map(|(w, _)| w), now);
        let most = refill(c, rate, burst);
        let released: Vec<&Waiter> = match &breaker {
            Some(b) if b.state == BreakerState::Open => {
                let probe = probe_run(&order, b, &breakers, &revisions, now);
                if let Some(probe) = probe
                    && self.claim_probe(id).await
                {
                    let rev = revisions.get(&probe.run_id).copied().unwrap_or_default();
                    if let Err(e) = self.release(journal, id, probe, rev, true).await {
                        tracing::warn!(error = %e, "could not release the probe run");
                    }
                }
                fallback_runs(order, probe, b, &breakers, most, now)
            }
            _ => self.reserve_turns(order, most).await,
        };
        for w in released {
            if *c < 1.0 {
                break;
            }
            let rev = revisions.get(&w.run_id).copied().unwrap_or_default();
            match self.release(journal, id, w, rev, false).await {
                Ok(()) => *c -= 1.0,
                Err(e) => {
                    tracing::warn!(error = %e, "could not release a run waiting on its provider");
                    break;
                }
            }
        }
    }
}

/// An endpoint as the releaser sees it in one tick ([`Providers::endpoint_view`]).
struct EndpointView {
    breaker: Option<Breaker>,
    /// Its waiting runs, each with its wait's revision.
    waiters: Vec<(Waiter, u64)>,
    /// Every breaker when the endpoint is open and some of its runs have fallbacks; else none.
    breakers: HashMap<String, (Breaker, u64)>,
}

/// Refills an endpoint's release credit for one tick at `rate` runs a second, up to `burst` (at
/// least one run); how many runs it lets go now.
#[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
fn refill(credit: &mut f64, rate: f64, burst: f64) -> usize {
    *credit = (*credit + rate * TICK.as_secs_f64()).min(burst.max(1.0));
    credit.max(0.0).floor() as usize
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_release_credit_refills_at_the_rate_up_to_one_ticks_burst() {
        // 5 runs a second: half a run a tick, a burst of one run.
        let (rate, burst) = (5.0, 1.0);
        let mut credit = 0.0;
        assert_eq!(refill(&mut credit, rate, burst), 0);
        assert_eq!(refill(&mut credit, rate, burst), 1);
        assert_eq!(refill(&mut credit, rate, burst), 1, "never above the burst");
        assert!((credit - 1.0).abs() < f64::EPSILON);
        // 100 runs a second: ten a tick, and never more than ten at once.
        let (rate, burst) = (100.0, 10.0);
        let mut credit = 3.0;
        assert_eq!(refill(&mut credit, rate, burst), 10);
        // Credit spent below zero is paid back before any run goes.
        let mut credit = -20.0;
        assert_eq!(refill(&mut credit, rate, burst), 0);
        assert_eq!(refill(&mut credit, rate, burst), 0);
        assert_eq!(refill(&mut credit, rate, burst), 10);
    }
}
