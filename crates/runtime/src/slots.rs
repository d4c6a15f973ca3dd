//! The slots of concurrency keys in `kedge_slots` (docs/ARCHITECTURE.md "Concurrency keys and
//! priorities"): the shell over [`kedge_core::concurrency::SlotRecord`], whose transitions are
//! pure. Every change reads a key's record and writes it back by compare-and-set on its
//! revision, so the limit holds across every step process; a write that lost the race reads
//! again. Whoever frees a slot (the run's writer after its terminal decision, or the reconciler
//! for a run that ended or vanished without giving it back) wakes the runs it promoted with a
//! `slot.granted` input.

use async_nats::jetstream::{self, kv};
use kedge_core::Input;
use kedge_core::InputEnvelope;
use kedge_core::concurrency::{Admission, Claim, RunConcurrency, SlotRecord};
use kedge_core::event::{Draft, SlotGranted, Timestamp};
use kedge_core::ids::{InputId, RunId, TenantId};
use kedge_core::subjects::{SLOTS_BUCKET, slot_key};
use kedge_journal::Journal;

/// Tries of one compare-and-set before giving up (another writer won each time).
const TRIES: u32 = 64;

/// What went wrong with `kedge_slots`.
#[derive(Debug, Clone, thiserror::Error)]
pub enum SlotError {
    #[error("{SLOTS_BUCKET} unavailable: {0}")]
    Unavailable(String),
    #[error("{SLOTS_BUCKET} record {key} is corrupt: {reason}")]
    Corrupt { key: String, reason: String },
}

fn unavailable(e: impl std::fmt::Display) -> SlotError {
    SlotError::Unavailable(e.to_string())
}

/// The `kedge_slots` bucket. Cheap to clone.
#[derive(Clone, Debug)]
pub struct Slots {
    kv: kv::Store,
}

impl Slots {
    pub async fn open(js: &jetstream::Context) -> Result<Slots, SlotError> {
        let kv = js.get_key_value(SLOTS_BUCKET).await.map_err(unavailable)?;
        Ok(Slots { kv })
    }

    /// A key's record and its revision (`None`: no record yet).
    pub async fn read(
        &self,
        tenant: &TenantId,
        key: &str,
    ) -> Result<Option<(SlotRecord, u64)>, SlotError> {
        self.read_at(&slot_key(tenant, key)).await
    }

    async fn read_at(&self, at: &str) -> Result<Option<(SlotRecord, u64)>, SlotError> {
        let Some(entry) = self.kv.entry(at).await.map_err(unavailable)? else {
            return Ok(None);
        };
        if entry.operation != kv::Operation::Put || entry.value.is_empty() {
            return Ok(None);
        }
        let record = serde_json::from_slice(&entry.value).map_err(|e| SlotError::Corrupt {
            key: at.to_owned(),
            reason: e.to_string(),
        })?;
        Ok(Some((record, entry.revision)))
    }

    /// Changes a key's record with `change` by compare-and-set, reading again after a lost
    /// race; returns `change`'s answer and the revision written (`None`: nothing changed, not
    /// written).
    async fn change<T>(
        &self,
        at: &str,
        fresh: impl Fn() -> SlotRecord,
        change: impl Fn(&mut SlotRecord) -> T,
    ) -> Result<(T, Option<u64>), SlotError> {
        for attempt in 0..TRIES {
            let current = self.read_at(at).await?;
            let (mut record, revision) = match current {
                Some((r, rev)) => (r, Some(rev)),
                None => (fresh(), None),
            };
            let before = record.clone();
            let answer = change(&mut record);
            if record == before && revision.is_some() {
                return Ok((answer, None));
            }
            let bytes = bytes::Bytes::from(serde_json::to_vec(&record).map_err(unavailable)?);
            match crate::cas::write(&self.kv, at, bytes, revision).await {
                Ok(Some(rev)) => return Ok((answer, Some(rev))),
                // Another writer changed the record: read it again, after a pause that grows.
                Ok(None) => {
                    let pause = 1 + u64::from(attempt).min(20);
                    tokio::time::sleep(std::time::Duration::from_millis(pause)).await;
                }
                // Broker trouble: the caller's bounded retry decides, not this loop.
                Err(e) => return Err(SlotError::Unavailable(format!("{at}: {e}"))),
            }
        }
        Err(SlotError::Unavailable(format!(
            "{at}: {TRIES} compare-and-set conflicts in a row"
        )))
    }

    /// The run asks for a slot of its key ([`SlotRecord::take`]).
    pub async fn take(
        &self,
        tenant: &TenantId,
        conc: &RunConcurrency,
        claim: &Claim,
    ) -> Result<Admission, SlotError> {
        let at = slot_key(tenant, &conc.key);
        let fresh = || SlotRecord::new(tenant.clone(), conc.key.clone(), conc.limit);
        let (admission, _) = self
            .change(&at, fresh, |r| r.take(claim, conc.limit))
            .await?;
        Ok(admission)
    }

    /// The run gives back its slot (or its place) and the runs promoted into the freed slots
    /// are woken with `slot.granted` ([`SlotRecord::release`]). A run the record does not list
    /// changes nothing.
    pub async fn release(
        &self,
        journal: &Journal,
        tenant: &TenantId,
        key: &str,
        run: &RunId,
    ) -> Result<Vec<RunId>, SlotError> {
        let at = slot_key(tenant, key);
        if self.read_at(&at).await?.is_none() {
            return Ok(Vec::new());
        }
        let fresh = || SlotRecord::new(tenant.clone(), key.to_owned(), 1);
        let (promoted, revision) = self.change(&at, fresh, |r| r.release(run)).await?;
        grant(journal, key, &promoted, revision.unwrap_or_default()).await?;
        Ok(promoted)
    }

    /// Every key's record, with where it is stored and its revision: what the reconciler's
    /// recovery looks through.
    pub async fn list(&self) -> Result<Vec<(String, SlotRecord, u64)>, SlotError> {
        use futures::StreamExt;
        let mut keys = self.kv.keys().await.map_err(unavailable)?;
        let mut all = Vec::new();
        while let Some(k) = keys.next().await {
            all.push(k.map_err(unavailable)?);
        }
        let mut records = Vec::new();
        for at in all {
            if let Some((record, revision)) = self.read_at(&at).await? {
                records.push((at, record, revision));
            }
        }
        Ok(records)
    }

    /// The reconciler's recovery of one record (stored at `at`): the runs in `gone` (finished,
    /// or gone from the journal) are removed ([`SlotRecord::forget`]) and the freed slots handed
    /// on, the runs promoted woken. Returns how many were promoted.
    pub async fn forget(
        &self,
        journal: &Journal,
        at: &str,
        record: &SlotRecord,
        gone: &[RunId],
    ) -> Result<usize, SlotError> {
        let fresh = || record.clone();
        let (promoted, revision) = self
            .change(at, fresh, |r| r.forget(|run| gone.contains(run)))
            .await?;
        grant(
            journal,
            &record.key,
            &promoted,
            revision.unwrap_or_default(),
        )
        .await?;
        Ok(promoted.len())
    }

    /// Wakes a holder again (its `slot.granted` may have been lost with the process that
    /// promoted it); `revision` is the record's, so a repeat for the same one is stored once.
    pub async fn regrant(
        &self,
        journal: &Journal,
        record: &SlotRecord,
        run: &RunId,
        revision: u64,
    ) -> Result<(), SlotError> {
        grant(journal, &record.key, std::slice::from_ref(run), revision).await
    }
}

/// Appends `slot.granted` to each promoted run's journal (a repeat for the same record revision
/// is stored once).
async fn grant(
    journal: &Journal,
    key: &str,
    promoted: &[RunId],
    revision: u64,
) -> Result<(), SlotError> {
    for run in promoted {
        let input = InputEnvelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(Input::SlotGranted(SlotGranted {
                key: key.to_owned(),
            })),
        );
        journal
            .append_input(&InputId::slot_granted(run, revision), &input)
            .await
            .map_err(unavailable)?;
        tracing::debug!(run_id = %run, key, "slot granted");
    }
    Ok(())
}
