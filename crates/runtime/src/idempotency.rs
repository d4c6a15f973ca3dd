//! Records in `kedge_idempotency` that keep a crash from paying or acting twice.
//!
//! - `model.<request_id>`: the model's response, stored the moment it returns, with the digest
//!   of the context it answered. A worker that takes over an unfinished step reuses it instead of
//!   calling the model again (principle 4).
//! - `op.<operation_id>`: a tool operation's record: argument digest, runner, and result once
//!   done. Same id + same digest returns the stored result; same id + different digest is a
//!   conflict (principle 5). Claims and completions are compare-and-set on the KV revision.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::jetstream::kv::{Operation, Store, UpdateErrorKind};
use bytes::Bytes;
use kedge_core::decide::ModelResponse;
use kedge_core::event::Digest;
use kedge_core::ids::{ModelRequestId, OperationId, RunId, WorkerId};
use kedge_core::tools::supersedes;
use kedge_journal::blob::INLINE_MAX;
use kedge_journal::{BlobError, BlobRef, Blobs};
use serde::{Deserialize, Serialize};

/// A stored model response.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StoredResponse {
    pub context_digest: Digest,
    pub response: ModelResponse,
}

/// Where a tool operation stands in its record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", rename_all = "snake_case")]
pub enum OpState {
    Running,
    Done {
        content: String,
        is_error: bool,
        /// How the result came about (records written before this field: ran).
        #[serde(default)]
        how: Finished,
    },
    /// Given back without running (its approved target moved): a later dispatch claims it
    /// afresh; the released dispatch itself never runs.
    Released,
}

/// How a finished operation's result came about, which says which event journals it: a taker
/// that finds the record done journals what its finisher would have (the finisher may have
/// died, or may still be on its way to the journal; both write under the same msg id, so the
/// first one lands and the history says how the result was learned either way).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Finished {
    /// The tool ran (`tool.result`).
    #[default]
    Ran,
    /// Stopped by the run's cancel, or not run because of it (`tool.result`, `stopped`).
    Stopped,
    /// A confirm query found that an abandoned attempt happened (`outcome.confirmed`).
    Confirmed,
}

/// A tool operation's record.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OpRecord {
    pub args_digest: Digest,
    pub runner: String,
    /// Which dispatch of the operation (`tool.requested`'s `redispatch`) the runner ran.
    #[serde(default)]
    pub dispatch: u32,
    #[serde(flatten)]
    pub state: OpState,
}

/// The outcome of claiming an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Claim {
    /// No record existed (or the last dispatch was given back): this runner now owns the
    /// operation (record revision given).
    Fresh { revision: u64 },
    /// A record was left `running` by a runner that is gone: older than the abandonment age, or
    /// the journal ordered a later dispatch (`redispatched`). This runner now holds it; unless
    /// `redispatched`, whether it happened is for the tool's confirm query to say.
    TakenOver {
        revision: u64,
        previous: String,
        redispatched: bool,
    },
    /// A live runner holds it (its record is younger than the abandonment age): ask again after
    /// `retry_in`. `dispatch` is the number the holder claimed it under (under a retry policy,
    /// its attempt's: `kedge_core::tools::claim_dispatch`).
    Held {
        runner: String,
        retry_in: Duration,
        dispatch: u32,
    },
    /// The operation already ran to completion: use this result, do not run it again.
    Done {
        content: String,
        is_error: bool,
        how: Finished,
    },
    /// The same operation id was claimed with different arguments.
    Conflict { stored: Digest },
    /// This dispatch was given back without running (see [`OpState::Released`]).
    Released,
}

#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    #[error("{bucket} unavailable: {0}", bucket = kedge_core::subjects::IDEMPOTENCY_BUCKET)]
    Unavailable(String),
    #[error("record {key} does not parse: {reason}")]
    Corrupt { key: String, reason: String },
    #[error("record {key} changed concurrently")]
    Raced { key: String },
}

/// Handle on `kedge_idempotency`.
#[derive(Clone)]
pub struct IdempotencyStore {
    kv: Store,
    /// The model responses this process stored or failed to store lately, by request id: a
    /// response the bucket could not take (its leader moving during a broker failover) is still
    /// reused by this process's next attempt instead of paying for the call again.
    recent: Arc<Mutex<HashMap<ModelRequestId, StoredResponse>>>,
    /// Where a record larger than [`INLINE_MAX`] (a long model response, a long tool result)
    /// keeps its bytes; the bucket holds `{"kedge_blob": <reference>}` instead. `None`: inline
    /// whatever its size (the bucket refuses what its broker's `max_payload` does not take).
    blobs: Option<Blobs>,
}

/// A record stored by reference.
#[derive(Serialize, Deserialize)]
struct ByReference {
    kedge_blob: BlobRef,
}

/// Model responses kept in memory per process (beyond it the map starts over: the bucket has
/// them).
const RECENT_RESPONSES: usize = 1024;

/// How long [`IdempotencyStore::store_response`] keeps trying a bucket that does not answer
/// (a broker failover elects a new leader within seconds), and its first and longest wait.
const STORE_PATIENCE: Duration = Duration::from_secs(30);
const STORE_BACKOFF: Duration = Duration::from_millis(50);
const STORE_BACKOFF_MAX: Duration = Duration::from_secs(1);

impl std::fmt::Debug for IdempotencyStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdempotencyStore").finish_non_exhaustive()
    }
}

fn unavailable(e: impl ToString) -> IdempotencyError {
    IdempotencyError::Unavailable(e.to_string())
}

impl IdempotencyStore {
    pub fn new(kv: Store) -> Self {
        Self {
            kv,
            recent: Arc::default(),
            blobs: None,
        }
    }

    /// Keeps records larger than [`INLINE_MAX`] in `blobs`.
    pub fn with_blobs(mut self, blobs: Blobs) -> Self {
        self.blobs = Some(blobs);
        self
    }

    /// The bytes a record of run `run` is stored as: its JSON, or a reference to it in
    /// `kedge_blobs`.
    async fn stored_form(
        &self,
        run: &RunId,
        value: &impl Serialize,
    ) -> Result<Bytes, IdempotencyError> {
        let bytes = serde_json::to_vec(value).map_err(unavailable)?;
        match &self.blobs {
            Some(blobs) if bytes.len() > INLINE_MAX => {
                let kedge_blob = blobs
                    .put(run, &bytes, kedge_journal::blob::EVENT_DATA)
                    .await
                    .map_err(unavailable)?;
                serde_json::to_vec(&ByReference { kedge_blob })
                    .map(Bytes::from)
                    .map_err(unavailable)
            }
            _ => Ok(Bytes::from(bytes)),
        }
    }

    /// A stored record of run `run`, read back from `kedge_blobs` when it is held by reference.
    async fn parse<T: serde::de::DeserializeOwned>(
        &self,
        run: &RunId,
        key: &str,
        value: &[u8],
    ) -> Result<T, IdempotencyError> {
        let corrupt = |reason: String| IdempotencyError::Corrupt {
            key: key.to_owned(),
            reason,
        };
        if let (Some(blobs), Ok(r)) = (&self.blobs, serde_json::from_slice::<ByReference>(value)) {
            let bytes = blobs.get(run, &r.kedge_blob).await.map_err(|e| match e {
                BlobError::Unavailable(_) => unavailable(e),
                other => corrupt(other.to_string()),
            })?;
            return serde_json::from_slice(&bytes).map_err(|e| corrupt(e.to_string()));
        }
        serde_json::from_slice(value).map_err(|e| corrupt(e.to_string()))
    }

    fn remember(&self, request: &ModelRequestId, stored: &StoredResponse) {
        if let Ok(mut recent) = self.recent.lock() {
            if recent.len() >= RECENT_RESPONSES {
                recent.clear();
            }
            recent.insert(request.clone(), stored.clone());
        }
    }

    /// The blob a record holds its bytes in, if it is held by reference (`key` as
    /// [`IdempotencyStore::model_key`] or [`IdempotencyStore::op_key`] make it).
    pub async fn blob_of(&self, key: &str) -> Result<Option<BlobRef>, IdempotencyError> {
        match self.kv.entry(key).await.map_err(unavailable)? {
            Some(e) if e.operation == Operation::Put => {
                Ok(serde_json::from_slice::<ByReference>(&e.value)
                    .ok()
                    .map(|r| r.kedge_blob))
            }
            _ => Ok(None),
        }
    }

    /// The bucket key of a request's stored model response.
    pub fn model_key(request: &ModelRequestId) -> String {
        format!("model.{request}")
    }

    /// The bucket key of an operation's record.
    pub fn op_key(op: &OperationId) -> String {
        format!("op.{op}")
    }

    /// Stores a model response under its request id (last write wins: the same request id
    /// always answers the same context). A bucket that does not take it is tried again for up
    /// to 30 s (a failover moves its leader within seconds): the call is paid for, and a
    /// response lost here is a second bill. Whatever happens, this process remembers it
    /// ([`IdempotencyStore::stored_response`] answers from memory first).
    pub async fn store_response(
        &self,
        request: &ModelRequestId,
        stored: &StoredResponse,
    ) -> Result<(), IdempotencyError> {
        self.remember(request, stored);
        let bytes = self.stored_form(request.run(), stored).await?;
        let started = Instant::now();
        let mut wait = STORE_BACKOFF;
        loop {
            match self.kv.put(Self::model_key(request), bytes.clone()).await {
                Ok(_) => return Ok(()),
                Err(e) if started.elapsed() + wait < STORE_PATIENCE => {
                    tracing::warn!(request_id = %request, error = %e, "model response not stored yet; trying again");
                    tokio::time::sleep(wait).await;
                    wait = (wait * 2).min(STORE_BACKOFF_MAX);
                }
                Err(e) => return Err(unavailable(e)),
            }
        }
    }

    /// The stored response of a request: this process's memory first, then the bucket.
    pub async fn stored_response(
        &self,
        request: &ModelRequestId,
    ) -> Result<Option<StoredResponse>, IdempotencyError> {
        if let Some(stored) = self
            .recent
            .lock()
            .ok()
            .and_then(|recent| recent.get(request).cloned())
        {
            return Ok(Some(stored));
        }
        let key = Self::model_key(request);
        match self.kv.entry(key.clone()).await.map_err(unavailable)? {
            Some(e) if e.operation == Operation::Put => {
                self.parse(request.run(), &key, &e.value).await.map(Some)
            }
            _ => Ok(None),
        }
    }

    async fn op_entry(
        &self,
        op: &OperationId,
    ) -> Result<Option<(u64, OpRecord, time::OffsetDateTime)>, IdempotencyError> {
        let key = Self::op_key(op);
        match self.kv.entry(key.clone()).await.map_err(unavailable)? {
            Some(e) if e.operation == Operation::Put => {
                let rec: OpRecord = self.parse(op.run(), &key, &e.value).await?;
                Ok(Some((e.revision, rec, e.created)))
            }
            _ => Ok(None),
        }
    }

    /// Claims an operation for `runner`, or reports why it must not run (again).
    ///
    /// The abandonment rule lives here, so that every taker applies it: a `running` record
    /// older than `abandoned_after` (`tool_timeout + tool_grace`: a live runner would have
    /// finished or killed its tool by then) is taken over by compare-and-set, as is one whose
    /// dispatch the journal has since superseded (`dispatch` greater than the record's); a
    /// younger one is [`Claim::Held`]. Of concurrent takers exactly one wins; the others see the
    /// winner's fresh record as held.
    pub async fn claim(
        &self,
        op: &OperationId,
        args_digest: &Digest,
        runner: &WorkerId,
        dispatch: u32,
        abandoned_after: Duration,
    ) -> Result<Claim, IdempotencyError> {
        self.claim_from(
            op,
            args_digest,
            runner,
            dispatch,
            dispatch,
            abandoned_after,
            None,
        )
        .await
    }

    /// [`IdempotencyStore::claim`] for one attempt of a dispatch under a retry policy: claimed
    /// under `code` (the attempt's number, `kedge_core::tools::claim_dispatch`), where the
    /// dispatch's own numbers start at `dispatch_from`. An attempt supersedes an earlier
    /// attempt's record only once that one was given back (its failure journaled and its record
    /// released) or its runner is gone, never while it still runs: a `tool.attempt` in the
    /// journal (anyone with the tool user's rights can publish one) does not start a second
    /// attempt beside a live one. A later *dispatch* supersedes as before.
    pub async fn claim_attempt(
        &self,
        op: &OperationId,
        args_digest: &Digest,
        runner: &WorkerId,
        code: u32,
        dispatch_from: u32,
        abandoned_after: Duration,
    ) -> Result<Claim, IdempotencyError> {
        self.claim_from(
            op,
            args_digest,
            runner,
            code,
            dispatch_from,
            abandoned_after,
            None,
        )
        .await
    }

    /// [`IdempotencyStore::claim`], where the caller knows that runner `gone` is gone (the
    /// broker has no connection for it: `crate::liveness`): a `running` record of `gone` is
    /// abandoned whatever its age. Taking it over is the same compare-and-set, so of several
    /// takers one wins; whether the operation happened is for the confirm query to say.
    ///
    /// A `running` record is superseded without being abandoned only when its number is below
    /// `supersedes_below` (an earlier dispatch; [`IdempotencyStore::claim`] passes `dispatch`);
    /// an abandoned one below `dispatch` (an earlier attempt whose failure the journal holds) is
    /// superseded too. Either is taken without a confirm query (`redispatched`).
    #[allow(clippy::too_many_arguments)]
    pub async fn claim_from(
        &self,
        op: &OperationId,
        args_digest: &Digest,
        runner: &WorkerId,
        dispatch: u32,
        supersedes_below: u32,
        abandoned_after: Duration,
        gone: Option<&str>,
    ) -> Result<Claim, IdempotencyError> {
        let mine = |state| OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_string(),
            dispatch,
            state,
        };
        // Create first: the common case (a first dispatch) is one round trip. A record that
        // exists makes the create fail, and then it is read and classified.
        let bytes = serde_json::to_vec(&mine(OpState::Running)).map_err(unavailable)?;
        let create_error = match self.kv.create(Self::op_key(op), bytes.into()).await {
            Ok(revision) => return Ok(Claim::Fresh { revision }),
            Err(e) => e,
        };
        // Two rounds at most: a lost take-over race is classified again (and then held).
        for _ in 0..2 {
            let Some((rev, rec, since)) = self.op_entry(op).await? else {
                // No record, yet the create failed: the bucket is unreachable.
                return Err(unavailable(&create_error));
            };
            if rec.args_digest != *args_digest {
                return Ok(Claim::Conflict {
                    stored: rec.args_digest,
                });
            }
            let redispatched = dispatch > rec.dispatch;
            match rec.state {
                OpState::Done {
                    content,
                    is_error,
                    how,
                } => {
                    return Ok(Claim::Done {
                        content,
                        is_error,
                        how,
                    });
                }
                OpState::Released if !redispatched => return Ok(Claim::Released),
                OpState::Released => {
                    // A later dispatch of an operation given back: claim it like a fresh one.
                    match self.replace(op, rev, &mine(OpState::Running)).await {
                        Ok(revision) => return Ok(Claim::Fresh { revision }),
                        Err(IdempotencyError::Raced { .. }) => continue,
                        Err(e) => return Err(e),
                    }
                }
                OpState::Running => {
                    let age = Duration::try_from(time::OffsetDateTime::now_utc() - since)
                        .unwrap_or_default();
                    let holder_gone = gone.is_some_and(|g| g == rec.runner);
                    let abandoned = holder_gone || age >= abandoned_after;
                    // Only an earlier dispatch is superseded while it runs; an earlier attempt
                    // of this one once abandoned (`kedge_core::tools::supersedes`).
                    let redispatched =
                        supersedes(rec.dispatch, dispatch, supersedes_below, abandoned);
                    if !redispatched && !abandoned {
                        return Ok(Claim::Held {
                            runner: rec.runner,
                            retry_in: abandoned_after - age,
                            dispatch: rec.dispatch,
                        });
                    }
                    match self.replace(op, rev, &mine(OpState::Running)).await {
                        Ok(revision) => {
                            return Ok(Claim::TakenOver {
                                revision,
                                previous: rec.runner,
                                redispatched,
                            });
                        }
                        Err(IdempotencyError::Raced { .. }) => continue,
                        Err(e) => return Err(e),
                    }
                }
            }
        }
        Err(IdempotencyError::Raced {
            key: Self::op_key(op),
        })
    }

    /// Writes `rec` over the record at `revision` (compare-and-set); the new revision.
    async fn replace(
        &self,
        op: &OperationId,
        revision: u64,
        rec: &OpRecord,
    ) -> Result<u64, IdempotencyError> {
        let bytes = self.stored_form(op.run(), rec).await?;
        self.kv
            .update(Self::op_key(op), bytes, revision)
            .await
            .map_err(|e| match e.kind() {
                // Someone else wrote the record since `revision` (took it over, finished it).
                UpdateErrorKind::WrongLastRevision => IdempotencyError::Raced {
                    key: Self::op_key(op),
                },
                _ => unavailable(&e),
            })
    }

    /// Gives an operation this runner holds back without running it (revision from the claim).
    pub async fn release(
        &self,
        op: &OperationId,
        revision: u64,
        args_digest: &Digest,
        runner: &WorkerId,
        dispatch: u32,
    ) -> Result<(), IdempotencyError> {
        let rec = OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_string(),
            dispatch,
            state: OpState::Released,
        };
        self.replace(op, revision, &rec).await.map(|_| ())
    }

    /// Records the result of an operation this runner holds (revision from the claim), and how
    /// it came about.
    #[allow(clippy::too_many_arguments)]
    pub async fn finish(
        &self,
        op: &OperationId,
        revision: u64,
        args_digest: &Digest,
        runner: &WorkerId,
        content: &str,
        is_error: bool,
        how: Finished,
    ) -> Result<(), IdempotencyError> {
        let rec = OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_string(),
            dispatch: 0,
            state: OpState::Done {
                content: content.to_owned(),
                is_error,
                how,
            },
        };
        self.replace(op, revision, &rec).await.map(|_| ())
    }
}
