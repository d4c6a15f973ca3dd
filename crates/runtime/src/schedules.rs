//! The `kedge_schedules` bucket (docs/ARCHITECTURE.md, "Schedules"): one
//! [`ScheduleRecord`] per key `<tenant>.<name>`, every write a compare-and-set on the key's
//! revision, so the edges that change a spec (bridge, gateway, CLI) and the schedulers that move
//! its state forward never lose each other's writes. Shared here because services never import
//! each other: the edges write specs, the timer service's scheduler writes state.

use async_nats::jetstream::kv::{self, Operation};
use kedge_core::event::Timestamp;
use kedge_core::ids::TenantId;
use kedge_core::schedule::{
    self, MAX_SCHEDULES_PER_TENANT, ScheduleRecord, ScheduleRejection, ScheduleSpec, ScheduleState,
};
use kedge_core::subjects::{self, SCHEDULES_BUCKET, SCHEDULES_STREAM};
use kedge_journal::Journal;

use crate::{Runtime, RuntimeError};

/// Tries of one compare-and-set before giving up as a conflict.
const CAS_TRIES: usize = 16;

/// Why a schedule operation failed.
#[derive(Debug, thiserror::Error)]
pub enum ScheduleError {
    #[error("{0}")]
    Invalid(#[from] ScheduleRejection),
    #[error("no schedule {0}")]
    NotFound(String),
    #[error("tenant {tenant} already has {MAX_SCHEDULES_PER_TENANT} schedules, the limit")]
    TooMany { tenant: TenantId },
    #[error("schedule {0} changed {CAS_TRIES} times while being written; try again")]
    Conflict(String),
    #[error("{bucket} unavailable: {0}", bucket = SCHEDULES_BUCKET)]
    Unavailable(String),
}

impl ScheduleError {
    /// The HTTP status an edge answers with.
    pub fn status(&self) -> u16 {
        match self {
            ScheduleError::Invalid(_) => 400,
            ScheduleError::NotFound(_) => 404,
            ScheduleError::TooMany { .. } => 429,
            ScheduleError::Conflict(_) => 409,
            ScheduleError::Unavailable(_) => 503,
        }
    }
}

fn unavailable(e: impl ToString) -> ScheduleError {
    ScheduleError::Unavailable(e.to_string())
}

/// One stored record and the revision a compare-and-set starts from.
#[derive(Debug, Clone, PartialEq)]
pub struct Stored {
    pub key: String,
    pub revision: u64,
    pub record: ScheduleRecord,
}

/// Handle on `kedge_schedules`.
#[derive(Debug, Clone)]
pub struct Schedules {
    kv: kv::Store,
    journal: Journal,
}

impl Schedules {
    pub async fn open(rt: &Runtime) -> Result<Schedules, RuntimeError> {
        let kv = rt
            .js
            .get_key_value(SCHEDULES_BUCKET)
            .await
            .map_err(|e| RuntimeError::broker(format!("open bucket {SCHEDULES_BUCKET}"), e))?;
        Ok(Schedules {
            kv,
            journal: rt.journal.clone(),
        })
    }

    /// One schedule of `tenant`.
    pub async fn get(&self, tenant: &TenantId, name: &str) -> Result<Stored, ScheduleError> {
        schedule::check_name(name)?;
        let key = schedule::record_key(tenant, name);
        self.entry(&key)
            .await?
            .ok_or_else(|| ScheduleError::NotFound(name.to_owned()))
    }

    async fn entry(&self, key: &str) -> Result<Option<Stored>, ScheduleError> {
        let entry = self.kv.entry(key).await.map_err(unavailable)?;
        Ok(entry
            .filter(|e| e.operation == Operation::Put)
            .and_then(|e| {
                let record = serde_json::from_slice(&e.value).ok()?;
                Some(Stored {
                    key: key.to_owned(),
                    revision: e.revision,
                    record,
                })
            }))
    }

    /// Every schedule of `tenant`, by name (batched direct gets of `<tenant>.*`).
    pub async fn list(&self, tenant: &TenantId) -> Result<Vec<Stored>, ScheduleError> {
        self.scan(&subjects::schedules_of(tenant)).await
    }

    /// Every schedule of every tenant (what a scheduler reads each pass).
    pub async fn all(&self) -> Result<Vec<Stored>, ScheduleError> {
        self.scan(subjects::ANY_TAIL).await
    }

    async fn scan(&self, keys: &str) -> Result<Vec<Stored>, ScheduleError> {
        let filter = subjects::kv_key(SCHEDULES_BUCKET, keys);
        let prefix = subjects::kv_key(SCHEDULES_BUCKET, "");
        let entries = self
            .journal
            .latest_per_subject(SCHEDULES_STREAM, &filter)
            .await
            .map_err(unavailable)?;
        let mut out: Vec<Stored> = entries
            .into_iter()
            .filter(|e| !e.deleted)
            .filter_map(|e| {
                let key = e.subject.strip_prefix(&prefix)?.to_owned();
                let record: ScheduleRecord = serde_json::from_slice(&e.payload).ok()?;
                Some(Stored {
                    key,
                    revision: e.seq,
                    record,
                })
            })
            .collect();
        out.sort_by(|a, b| a.key.cmp(&b.key));
        Ok(out)
    }

    /// Creates schedule `spec.name` of `tenant`, or replaces its spec (its state is kept, so a
    /// changed schedule neither refires nor forgets its last run). Refused past
    /// [`MAX_SCHEDULES_PER_TENANT`].
    pub async fn put(
        &self,
        tenant: &TenantId,
        spec: ScheduleSpec,
        now: Timestamp,
    ) -> Result<(Stored, bool), ScheduleError> {
        let key = schedule::record_key(tenant, &spec.name);
        for _ in 0..CAS_TRIES {
            match self.entry(&key).await? {
                Some(mut stored) => {
                    stored.record.spec = spec.clone();
                    if let Some(s) = self.write(stored).await? {
                        return Ok((s, false));
                    }
                }
                None => {
                    if self.list(tenant).await?.len() >= MAX_SCHEDULES_PER_TENANT {
                        return Err(ScheduleError::TooMany {
                            tenant: tenant.clone(),
                        });
                    }
                    let record = ScheduleRecord {
                        tenant: tenant.clone(),
                        spec: spec.clone(),
                        paused: false,
                        state: ScheduleState::new(schedule::floor_secs(now)),
                    };
                    let body = serde_json::to_vec(&record).map_err(unavailable)?;
                    match self.kv.create(&key, body.into()).await {
                        Ok(revision) => {
                            return Ok((
                                Stored {
                                    key,
                                    revision,
                                    record,
                                },
                                true,
                            ));
                        }
                        Err(e) if e.kind() == kv::CreateErrorKind::AlreadyExists => continue,
                        Err(e) => return Err(unavailable(e)),
                    }
                }
            }
        }
        Err(ScheduleError::Conflict(spec.name))
    }

    /// Applies `change` to schedule `name` of `tenant` by compare-and-set, reading again on a
    /// conflict.
    pub async fn change(
        &self,
        tenant: &TenantId,
        name: &str,
        mut change: impl FnMut(&mut ScheduleRecord),
    ) -> Result<Stored, ScheduleError> {
        for _ in 0..CAS_TRIES {
            let mut stored = self.get(tenant, name).await?;
            change(&mut stored.record);
            if let Some(s) = self.write(stored).await? {
                return Ok(s);
            }
        }
        Err(ScheduleError::Conflict(name.to_owned()))
    }

    /// Pauses (no instant fires) or resumes (instants after `now` fire; none missed while paused).
    pub async fn set_paused(
        &self,
        tenant: &TenantId,
        name: &str,
        paused: bool,
        now: Timestamp,
    ) -> Result<Stored, ScheduleError> {
        self.change(tenant, name, |r| {
            if r.paused && !paused {
                r.state.since = schedule::floor_secs(now);
            }
            r.paused = paused;
        })
        .await
    }

    /// Asks the schedulers to fire schedule `name` now, once (an instant of its own, `now`).
    pub async fn trigger(
        &self,
        tenant: &TenantId,
        name: &str,
        now: Timestamp,
    ) -> Result<Stored, ScheduleError> {
        self.change(tenant, name, |r| {
            r.state.triggered = Some(schedule::floor_secs(now))
        })
        .await
    }

    /// Deletes schedule `name` of `tenant` (its runs go on).
    pub async fn delete(&self, tenant: &TenantId, name: &str) -> Result<(), ScheduleError> {
        let stored = self.get(tenant, name).await?;
        self.kv.delete(&stored.key).await.map_err(unavailable)?;
        Ok(())
    }

    /// Writes `stored.record` if the key is still at `stored.revision`: the new revision, or
    /// `None` when someone wrote in between.
    pub async fn write(&self, stored: Stored) -> Result<Option<Stored>, ScheduleError> {
        let body = serde_json::to_vec(&stored.record).map_err(unavailable)?;
        match self
            .kv
            .update(&stored.key, body.into(), stored.revision)
            .await
        {
            Ok(revision) => Ok(Some(Stored { revision, ..stored })),
            Err(e) if e.kind() == kv::UpdateErrorKind::WrongLastRevision => Ok(None),
            Err(e) => Err(unavailable(e)),
        }
    }
}
