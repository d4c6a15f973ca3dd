//! Which tenant a run belongs to: the `tenant` of its `run.created`, which never changes, so it is
//! cached per process (bounded; the cache is cleared when full). A miss costs one direct get of
//! the run's `run.created`; a run that direct get does not find (a replica that trails the leader)
//! is looked up in the journal itself before it is called missing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use async_nats::jetstream::Context;
use kedge_core::event::Event;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_core::{Envelope, EventType};
use kedge_journal::{Journal, JournalError};
use kedge_runtime::Runtime;

const MAX_ENTRIES: usize = 100_000;

#[derive(Debug, Clone)]
pub struct TenantCache {
    js: Context,
    journal: Journal,
    map: Arc<Mutex<HashMap<RunId, TenantId>>>,
}

impl TenantCache {
    pub fn new(rt: &Runtime) -> Self {
        Self {
            js: rt.js.clone(),
            journal: rt.journal.clone(),
            map: Arc::default(),
        }
    }

    /// Remembers a run's tenant learned elsewhere (from a full journal read).
    pub fn remember(&self, run: &RunId, tenant: &TenantId) {
        if let Ok(mut map) = self.map.lock() {
            if map.len() >= MAX_ENTRIES {
                map.clear();
            }
            map.insert(run.clone(), tenant.clone());
        }
    }

    /// The run's tenant; `None` when the run does not exist.
    pub async fn get(&self, run: &RunId) -> Result<Option<TenantId>, JournalError> {
        if let Ok(map) = self.map.lock()
            && let Some(t) = map.get(run)
        {
            return Ok(Some(t.clone()));
        }
        let direct = async {
            let stream = self.js.get_stream_no_info(RUNS_STREAM).await.ok()?;
            let msg = stream
                .direct_get_first_for_subject(subjects::event(run, EventType::RunCreated))
                .await
                .ok()?;
            let env: Envelope = serde_json::from_slice(&msg.payload).ok()?;
            match env.event {
                Event::RunCreated(c) if &env.run_id == run => Some(c.tenant),
                _ => None,
            }
        };
        let tenant = match direct.await {
            Some(t) => Some(t),
            None => {
                let events = self.journal.read(run, 0).await?;
                events.first().and_then(|r| match &r.envelope.event {
                    Event::RunCreated(c) => Some(c.tenant.clone()),
                    _ => None,
                })
            }
        };
        if let Some(t) = &tenant {
            self.remember(run, t);
        }
        Ok(tenant)
    }
}
