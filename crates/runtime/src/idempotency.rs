//! Records in `kedge_idempotency` that keep a crash from paying or acting twice.
//!
//! - `model.<request_id>`: the model's response, stored the moment it returns, with the digest
//!   of the context it answered. A worker that takes over an unfinished step reuses it instead of
//!   calling the model again (DESIGN principle 4).
//! - `op.<operation_id>`: a tool operation's record: argument digest, runner, and result once
//!   done. Same id + same digest returns the stored result; same id + different digest is a
//!   conflict (DESIGN principle 5). Claims and completions are compare-and-set on the KV revision.

use async_nats::jetstream::kv::{Operation, Store};
use kedge_core::decide::ModelResponse;
use kedge_core::event::Digest;
use kedge_core::ids::{ModelRequestId, OperationId};
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
    },
    /// Given back without running (its approved target moved): a later dispatch claims it
    /// afresh; the released dispatch itself never runs.
    Released,
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
    /// No record existed: this runner now owns the operation (record revision given).
    Fresh { revision: u64 },
    /// The operation already ran to completion: use this result, do not run it again.
    Done { content: String, is_error: bool },
    /// A record says another (or an earlier) runner started it and has not finished (yet).
    Running {
        runner: String,
        revision: u64,
        dispatch: u32,
        /// When the runner claimed it (the broker's time of the record). A record older than
        /// `tool_timeout + tool_grace` is abandoned: a live runner would have finished by then.
        since: time::OffsetDateTime,
    },
    /// The same operation id was claimed with different arguments.
    Conflict { stored: Digest },
    /// This dispatch was given back without running (see [`OpState::Released`]).
    Released,
}

#[derive(Debug, thiserror::Error)]
pub enum IdempotencyError {
    #[error("kedge_idempotency unavailable: {0}")]
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
}

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
        Self { kv }
    }

    fn model_key(request: &ModelRequestId) -> String {
        format!("model.{request}")
    }

    fn op_key(op: &OperationId) -> String {
        format!("op.{op}")
    }

    /// Stores a model response under its request id (last write wins: the same request id
    /// always answers the same context).
    pub async fn store_response(
        &self,
        request: &ModelRequestId,
        stored: &StoredResponse,
    ) -> Result<(), IdempotencyError> {
        let bytes = serde_json::to_vec(stored).map_err(unavailable)?;
        self.kv
            .put(Self::model_key(request), bytes.into())
            .await
            .map_err(unavailable)?;
        Ok(())
    }

    pub async fn stored_response(
        &self,
        request: &ModelRequestId,
    ) -> Result<Option<StoredResponse>, IdempotencyError> {
        let key = Self::model_key(request);
        match self.kv.entry(key.clone()).await.map_err(unavailable)? {
            Some(e) if e.operation == Operation::Put => serde_json::from_slice(&e.value)
                .map(Some)
                .map_err(|err| IdempotencyError::Corrupt {
                    key,
                    reason: err.to_string(),
                }),
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
                let rec: OpRecord =
                    serde_json::from_slice(&e.value).map_err(|err| IdempotencyError::Corrupt {
                        key,
                        reason: err.to_string(),
                    })?;
                Ok(Some((e.revision, rec, e.created)))
            }
            _ => Ok(None),
        }
    }

    /// Claims an operation for `runner`, or reports why it must not run (again).
    pub async fn claim(
        &self,
        op: &OperationId,
        args_digest: &Digest,
        runner: &str,
        dispatch: u32,
    ) -> Result<Claim, IdempotencyError> {
        let classify = |rev: u64, rec: OpRecord, since: time::OffsetDateTime| {
            if rec.args_digest != *args_digest {
                return Claim::Conflict {
                    stored: rec.args_digest,
                };
            }
            match rec.state {
                OpState::Done { content, is_error } => Claim::Done { content, is_error },
                OpState::Running => Claim::Running {
                    runner: rec.runner,
                    revision: rev,
                    dispatch: rec.dispatch,
                    since,
                },
                OpState::Released => Claim::Released,
            }
        };
        // Create first: the common case (a first dispatch) is one round trip. A record that
        // exists makes the create fail, and then it is read and classified.
        let rec = OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_owned(),
            dispatch,
            state: OpState::Running,
        };
        let bytes = serde_json::to_vec(&rec).map_err(unavailable)?;
        let create_error = match self.kv.create(Self::op_key(op), bytes.into()).await {
            Ok(revision) => return Ok(Claim::Fresh { revision }),
            Err(e) => e,
        };
        if let Some((rev, rec, since)) = self.op_entry(op).await? {
            if rec.state == OpState::Released
                && rec.args_digest == *args_digest
                && dispatch > rec.dispatch
            {
                // A later dispatch of a released operation: claim it like a fresh one.
                return match self.take_over(op, rev, args_digest, runner, dispatch).await {
                    Ok(revision) => Ok(Claim::Fresh { revision }),
                    Err(IdempotencyError::Raced { .. }) => match self.op_entry(op).await? {
                        Some((rev, rec, since)) => Ok(classify(rev, rec, since)),
                        None => Err(unavailable("record vanished")),
                    },
                    Err(e) => Err(e),
                };
            }
            return Ok(classify(rev, rec, since));
        }
        // No record, yet the create failed: the bucket is unreachable.
        Err(unavailable(create_error))
    }

    /// Takes over a `Running` record left by a runner that is gone (compare-and-set on its
    /// revision, so two takers cannot both win).
    pub async fn take_over(
        &self,
        op: &OperationId,
        revision: u64,
        args_digest: &Digest,
        runner: &str,
        dispatch: u32,
    ) -> Result<u64, IdempotencyError> {
        let rec = OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_owned(),
            dispatch,
            state: OpState::Running,
        };
        self.replace(op, revision, &rec).await
    }

    /// Writes `rec` over the record at `revision` (compare-and-set); the new revision.
    async fn replace(
        &self,
        op: &OperationId,
        revision: u64,
        rec: &OpRecord,
    ) -> Result<u64, IdempotencyError> {
        let bytes = serde_json::to_vec(rec).map_err(unavailable)?;
        self.kv
            .update(Self::op_key(op), bytes.into(), revision)
            .await
            .map_err(|_| IdempotencyError::Raced {
                key: Self::op_key(op),
            })
    }

    /// Gives an operation this runner holds back without running it (revision from the claim).
    pub async fn release(
        &self,
        op: &OperationId,
        revision: u64,
        args_digest: &Digest,
        runner: &str,
        dispatch: u32,
    ) -> Result<(), IdempotencyError> {
        let rec = OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_owned(),
            dispatch,
            state: OpState::Released,
        };
        self.replace(op, revision, &rec).await.map(|_| ())
    }

    /// Records the result of an operation this runner holds (revision from the claim).
    pub async fn finish(
        &self,
        op: &OperationId,
        revision: u64,
        args_digest: &Digest,
        runner: &str,
        content: &str,
        is_error: bool,
    ) -> Result<(), IdempotencyError> {
        let rec = OpRecord {
            args_digest: args_digest.clone(),
            runner: runner.to_owned(),
            dispatch: 0,
            state: OpState::Done {
                content: content.to_owned(),
                is_error,
            },
        };
        self.replace(op, revision, &rec).await.map(|_| ())
    }
}
