//! Which tenant a run belongs to: the `tenant` of its `run.created`, which never changes, so it is
//! cached per process (bounded: the runs it stopped using make room, `kedge_core::bounded`). A miss reads the run's
//! `run.created` alone ([`Journal::read_type`], with the journal's leader-checked consistency).

use std::sync::{Arc, Mutex};

use kedge_core::EventType;
use kedge_core::bounded::Bounded;
use kedge_core::event::Event;
use kedge_core::ids::{RunId, TenantId};
use kedge_journal::{Journal, JournalError};
use kedge_runtime::Runtime;

const MAX_ENTRIES: usize = 100_000;

#[derive(Debug, Clone)]
pub struct TenantCache {
    journal: Journal,
    map: Arc<Mutex<Bounded<RunId, TenantId>>>,
}

impl TenantCache {
    pub fn new(rt: &Runtime) -> Self {
        Self {
            journal: rt.journal.clone(),
            map: Arc::new(Mutex::new(Bounded::new(MAX_ENTRIES))),
        }
    }

    /// Remembers a run's tenant learned elsewhere (from a full journal read).
    pub fn remember(&self, run: &RunId, tenant: &TenantId) {
        if let Ok(mut map) = self.map.lock() {
            map.insert(run.clone(), tenant.clone());
        }
    }

    /// The run's tenant; `None` when the run does not exist.
    pub async fn get(&self, run: &RunId) -> Result<Option<TenantId>, JournalError> {
        if let Ok(mut map) = self.map.lock()
            && let Some(t) = map.get(run)
        {
            return Ok(Some(t.clone()));
        }
        // The run's `run.created` alone (one subject), not its whole journal.
        let created = self.journal.read_type(run, EventType::RunCreated).await?;
        let tenant = created.first().and_then(|r| match &r.envelope.event {
            Event::RunCreated(c) if &r.envelope.run_id == run => Some(c.tenant.clone()),
            _ => None,
        });
        if let Some(t) = &tenant {
            self.remember(run, t);
        }
        Ok(tenant)
    }
}
