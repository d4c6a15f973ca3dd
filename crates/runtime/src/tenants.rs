//! Which tenant a journal delivery's run belongs to, for the fair order of work
//! (docs/ARCHITECTURE.md "Fairness across tenants").
//!
//! A run's subjects (`agent.run.<run>.…`) do not name its tenant; its `run.created` does, and
//! only intake (and a parent's step, for a child run) writes that decision, with the check that
//! the run has no decision yet. So the tenant is read from the `run.created` the journal holds,
//! decoded with the checks every read applies, never from anything else a delivery carries (an
//! input anyone allowed on the run's subjects may publish): a bounded cache, filled from the
//! `run.created` deliveries the step consumer sees and, on a miss, by one direct get of the
//! run's `run.created`. A run whose tenant cannot be resolved (no `run.created`, broker
//! trouble) goes in the shared lane; a miss is not remembered, so a run created a moment later
//! is resolved on its next delivery.
//!
//! The cache is the process's, shared by its services: in `kedge serve all` the tool service
//! finds the runs the step service saw created. (A run id is derived from its tenant,
//! docs/SECURITY.md "Run ids", so two brokers' runs of one id are one tenant's.)

use std::sync::{Arc, Mutex};

use async_nats::jetstream::Message;
use kedge_core::bounded::Bounded;
use kedge_core::event::{Event, EventType};
use kedge_core::fairness::Lane;
use kedge_core::ids::{RunId, TenantId};
use kedge_journal::{Delivered, Delivery, Journal};

/// Runs whose tenant is remembered, at most (two generations of half each: the older is dropped
/// when the newer fills).
pub const CACHED_RUNS: usize = 100_000;

/// The run → tenant cache, shared by clones.
#[derive(Clone)]
pub struct RunTenants {
    journal: Journal,
    cache: Arc<Mutex<Generations>>,
}

impl std::fmt::Debug for RunTenants {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunTenants").finish_non_exhaustive()
    }
}

/// The cache ([`kedge_core::bounded`]: two generations, what is used kept).
type Generations = Bounded<RunId, TenantId>;

impl RunTenants {
    /// Reads misses through `journal`; the cache is the process's.
    pub fn new(journal: Journal) -> Self {
        static CACHE: std::sync::OnceLock<Arc<Mutex<Generations>>> = std::sync::OnceLock::new();
        let cache = CACHE
            .get_or_init(|| Arc::new(Mutex::new(Bounded::new(CACHED_RUNS))))
            .clone();
        Self { journal, cache }
    }

    /// Remembers that `run` is `tenant`'s (from a state folded out of the run's journal).
    pub fn note(&self, run: &RunId, tenant: &TenantId) {
        if let Ok(mut cache) = self.cache.lock() {
            cache.insert(run.clone(), tenant.clone());
        }
    }

    fn cached(&self, run: &RunId) -> Option<TenantId> {
        self.cache.lock().ok()?.get(run).cloned()
    }

    /// The lane of a delivery of the journal stream: its run's tenant, or [`Lane::Shared`].
    pub async fn lane(&self, msg: &Message) -> Lane {
        match self.tenant_of(msg).await {
            Some(t) => Lane::Tenant(t),
            None => Lane::Shared,
        }
    }

    async fn tenant_of(&self, msg: &Message) -> Option<TenantId> {
        let parsed = kedge_core::subjects::parse_event(&msg.subject)?;
        let run = parsed.run_id;
        if let Some(t) = self.cached(&run) {
            return Some(t);
        }
        let created = if parsed.event_type == EventType::RunCreated {
            // The delivery is the run's creation: decoded with the journal's checks.
            let seq = msg.info().map(|i| i.stream_sequence).unwrap_or(0);
            let delivered = Delivered {
                seq,
                subject: &msg.subject,
                headers: msg.headers.as_ref(),
                payload: &msg.payload,
            };
            match self.journal.decode_delivered(delivered).await {
                Ok(Delivery::Event(r)) => Some(r.envelope.event),
                _ => None,
            }
        } else {
            self.journal
                .last_of(&run, &[EventType::RunCreated])
                .await
                .ok()
                .and_then(|mut found| found.pop())
                .map(|r| r.envelope.event)
        };
        match created {
            Some(Event::RunCreated(c)) => {
                self.note(&run, &c.tenant);
                Some(c.tenant)
            }
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(i: usize) -> RunId {
        format!("run_{i:032x}").parse().expect("run id")
    }

    #[test]
    fn the_cache_is_bounded_and_keeps_what_is_used() {
        let mut g = Generations::new(10);
        let acme: TenantId = "acme".parse().expect("tenant");
        for i in 0..5 {
            g.insert(run(i), acme.clone());
        }
        assert_eq!(g.len(), 5);
        // run 0 is used: promoted into the young generation, so it outlives the others.
        for i in 5..10 {
            g.insert(run(i), acme.clone());
        }
        assert_eq!(g.get(&run(0)), Some(&acme));
        for i in 10..14 {
            g.insert(run(i), acme.clone());
        }
        assert!(g.len() <= 10, "{}", g.len());
        assert_eq!(g.get(&run(0)), Some(&acme));
        assert_eq!(g.get(&run(1)), None, "forgotten");
        for i in 0..1000 {
            g.insert(run(i), acme.clone());
            assert!(g.len() <= 10);
        }
    }
}
