//! The run's state: [`RunState`], what it is made of, and the folding of one event into it.
//!
//! A decision goes through the transition table first ([`crate::machine::apply`]), then does
//! what `decision` says; an input does what `input` says, or is counted as ignored.

use std::collections::BTreeMap;

use crate::event::{
    ApprovalRequested, ByKind, DecisionRef, Envelope, Event, EventType, RunCreated, RunFailed,
    TimerPurpose, Timestamp, Usage, Verdict, WaitReason,
};
use crate::ids::{
    ApprovalId, Attempt, CallbackKey, DecisionSeq, ModelRequestId, OperationId, QuestionId, RunId,
    StepNo, TimerId,
};
use crate::machine::{RunStatus, apply};

use super::FoldError;
use super::group::{Completing, Gates};
use super::operation::ToolOp;
use super::transcript::{ChatMessage, TranscriptDigest};

/// The step whose `step.started` has no `step.completed` yet.
#[derive(Debug, Clone, PartialEq)]
pub struct OpenStep {
    pub step: StepNo,
    pub attempt: Attempt,
    pub request_id: ModelRequestId,
    pub context_digest: crate::event::Digest,
    /// The attempt ended with a recorded error (so there is no stored response to reuse).
    pub failed: bool,
    /// Attempts of this step that ended in provider trouble or were held by the fleet's
    /// breaker (`model.attempt` with `trouble`, or `held`): they spend nothing of
    /// `max_attempts_per_step`.
    pub free: u32,
    /// The model its latest attempt calls when not the run's own (a fallback).
    pub model: Option<crate::event::ModelSpec>,
}

impl OpenStep {
    /// The model the step's latest attempt calls: a fallback, or the run's own.
    pub fn model<'a>(&'a self, run: &'a crate::event::RunCreated) -> &'a crate::event::ModelSpec {
        self.model.as_ref().unwrap_or(&run.model)
    }

    /// The attempts of this step that count against `max_attempts_per_step`.
    pub fn spent(&self) -> u32 {
        self.attempt.get().saturating_sub(self.free)
    }
}

/// A step's wait on its model provider (`provider.waiting`): kept until the step completes or
/// the run fails, so every wait of one step keeps the first one's `since`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProviderWait {
    pub step: StepNo,
    pub endpoint: String,
    pub trouble: crate::event::Trouble,
    pub message: String,
    pub since: Timestamp,
    pub give_up_at: Timestamp,
    /// The fleet released the run (`provider.released`, `Some(probe)`) since it last began
    /// waiting.
    pub released: Option<bool>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PendingInput {
    pub seq: u64,
    pub text: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuestionState {
    pub op: Option<OperationId>,
    pub prompt: String,
    pub answer: Option<String>,
    /// Its timeout fired before an answer came: closed, a later answer is ignored.
    pub timed_out: bool,
}

impl QuestionState {
    /// Whether an answer would still count.
    pub fn is_open(&self) -> bool {
        self.answer.is_none() && !self.timed_out
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ApprovalStatus {
    Open,
    Decided {
        verdict: Verdict,
        args_digest: crate::event::Digest,
        approver: String,
        /// When the decision was journaled (checked against the request's expiry).
        at: Timestamp,
    },
    /// Superseded (the decision did not match what would run); `at` is when.
    Invalidated {
        at: Timestamp,
    },
    Expired,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApprovalState {
    pub op: Option<OperationId>,
    pub request: ApprovalRequested,
    pub status: ApprovalStatus,
    /// When the request was journaled.
    pub requested_at: Timestamp,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TimerState {
    pub fire_at: Timestamp,
    pub purpose: TimerPurpose,
    pub fired: bool,
}

#[derive(Debug, Clone, PartialEq, Default)]
pub struct CallbackState {
    pub expected: bool,
    /// The operation whose result the callback is.
    pub op: Option<OperationId>,
    pub expires_at: Option<Timestamp>,
    /// Payloads received in time (the first one is the one that counts), with their sequence.
    pub received: Vec<(u64, serde_json::Value)>,
}

/// Everything the services need to know about a run, derived from its journal.
#[derive(Debug, Clone, PartialEq)]
pub struct RunState {
    pub run_id: RunId,
    pub status: RunStatus,
    pub bundle: RunCreated,
    /// When `run.created` was journaled (the run deadline counts from it).
    pub created_at: Timestamp,
    /// When the last event folded was journaled (its envelope's time; what the runs list shows
    /// as the run's last change).
    pub updated_at: Timestamp,
    pub turn: u32,
    /// Sequence of the last event folded.
    pub last_seq: u64,
    /// Sequence of the last decision: the expected-last-sequence of the next decision append.
    pub last_decision_seq: DecisionSeq,
    /// The last step started (0 before the first).
    pub step: StepNo,
    pub open_step: Option<OpenStep>,
    /// The conversation the next model call continues (user input, assistant turns, consumed
    /// tool results and messages). Only ever appended to (the context digest hashes each
    /// message of it once, [`RunState::next_context_digested`]).
    pub transcript: Vec<ChatMessage>,
    /// The transcript's messages hashed so far for the context digest.
    pub transcript_digest: TranscriptDigest,
    pub ops: BTreeMap<OperationId, ToolOp>,
    pub pending_messages: Vec<PendingInput>,
    pub questions: BTreeMap<QuestionId, QuestionState>,
    pub approvals: BTreeMap<ApprovalId, ApprovalState>,
    pub timers: BTreeMap<TimerId, TimerState>,
    pub callbacks: BTreeMap<CallbackKey, CallbackState>,
    pub cancel_requested: Option<String>,
    pub usage: Usage,
    pub output: Option<String>,
    /// The check of `output` against the output schema (`run.succeeded`'s), this turn.
    pub validation: Option<crate::event::OutputValidation>,
    pub failure: Option<RunFailed>,
    /// Child runs started by `run_agent` operations (`child.started`), by operation.
    pub children: BTreeMap<OperationId, RunId>,
    /// Final answers of the current turn sent back for a retry (`output.rejected`).
    pub output_rejections: u32,
    pub ignored_inputs: u32,
    /// Messages on the run's subjects that were not events of the run, set aside (see
    /// [`RunState::set_aside`]); only the folds of the decision writer count them.
    pub set_aside: u32,
    /// A step whose `step.completed` landed but whose decision group did not end yet (its
    /// decisions are appended one after another; a writer that died in between left the rest
    /// for the next one).
    pub completing: Option<Completing>,
    /// Version gates the run has marked (`run.gated`): its decisions take their new branch.
    pub gates: Gates,
    /// The first step of the current turn (1, or the step after `run.revived`): the effects a
    /// compensation undoes are this turn's.
    pub turn_first_step: StepNo,
    /// The compensation the run is in or went through (`run.compensating`).
    pub compensation: Option<crate::event::RunCompensating>,
    /// The current step's wait on its model provider, if it met provider trouble.
    pub provider: Option<ProviderWait>,
    /// What of the transcript the model reads, once the context was compacted
    /// (`context.compacted`, [`crate::context`]).
    pub compaction: Option<crate::context::Compaction>,
    /// The run waits for a slot of its concurrency key (`run.queued`, until `run.started` or
    /// `run.revived`): which key, its limit, its place when it began waiting.
    pub queued: Option<crate::event::RunQueued>,
}

impl RunState {
    /// The state right after `run.created`.
    pub fn created(seq: u64, env: &Envelope) -> Result<RunState, FoldError> {
        let Event::RunCreated(created) = &env.event else {
            return Err(FoldError::NotCreatedFirst {
                seq,
                found: env.event_type(),
            });
        };
        let status =
            apply(None, EventType::RunCreated, None).map_err(|source| FoldError::Transition {
                seq,
                event: EventType::RunCreated,
                source,
            })?;
        Ok(RunState {
            run_id: env.run_id.clone(),
            status,
            bundle: (**created).clone(),
            created_at: env.at,
            updated_at: env.at,
            turn: 1,
            last_seq: seq,
            last_decision_seq: DecisionSeq::at(seq),
            step: StepNo(0),
            open_step: None,
            transcript: vec![ChatMessage::User {
                text: created.input.clone(),
            }],
            transcript_digest: TranscriptDigest::default(),
            ops: BTreeMap::new(),
            pending_messages: Vec::new(),
            questions: BTreeMap::new(),
            approvals: BTreeMap::new(),
            timers: BTreeMap::new(),
            callbacks: BTreeMap::new(),
            cancel_requested: None,
            usage: Usage::default(),
            output: None,
            validation: None,
            failure: None,
            children: BTreeMap::new(),
            output_rejections: 0,
            ignored_inputs: 0,
            set_aside: 0,
            completing: None,
            gates: Gates::NONE,
            turn_first_step: StepNo(1),
            compensation: None,
            provider: None,
            compaction: None,
            queued: None,
        })
    }

    /// Folds one more event.
    pub fn apply(&mut self, seq: u64, env: &Envelope) -> Result<(), FoldError> {
        if env.run_id != self.run_id {
            return Err(FoldError::WrongRun {
                seq,
                expected: self.run_id.clone(),
                found: env.run_id.clone(),
            });
        }
        if seq <= self.last_seq {
            return Err(FoldError::OutOfOrder {
                seq,
                last: self.last_seq,
            });
        }
        let event = env.event_type();
        match env.event.by_kind() {
            ByKind::Decision(decision) => {
                let wait = match decision {
                    DecisionRef::RunWaiting(w) => Some(w.on),
                    _ => None,
                };
                self.status = apply(Some(self.status), event, wait)
                    .map_err(|source| FoldError::Transition { seq, event, source })?;
                self.apply_decision(seq, env, decision)?;
                // A step group that journals no `run.waiting` settles the status when its last
                // decision lands, through the same row of the table.
                if let Some(on) = self.track_group(decision) {
                    self.status = apply(Some(self.status), EventType::RunWaiting, Some(on))
                        .map_err(|source| FoldError::Transition { seq, event, source })?;
                }
                self.last_decision_seq = DecisionSeq::at(seq);
            }
            ByKind::Input(input) => {
                if !self.apply_input(seq, env, input) {
                    self.ignored_inputs = self.ignored_inputs.saturating_add(1);
                }
            }
        }
        self.last_seq = seq;
        self.updated_at = env.at;
        Ok(())
    }

    /// Folds in a message at `seq` that the journal set aside (it is not an event of the run):
    /// counted, and skipped. One on a decision subject still moved the run's last decision (the
    /// broker's expected-sequence check counts every message on `.d.`), so the next decision is
    /// appended after it. A sequence at or before the last one folded is only counted.
    pub fn set_aside(&mut self, seq: u64, kind: crate::event::EventKind) {
        self.set_aside = self.set_aside.saturating_add(1);
        if seq <= self.last_seq {
            return;
        }
        self.last_seq = seq;
        match kind {
            crate::event::EventKind::Decision => self.last_decision_seq = DecisionSeq::at(seq),
            crate::event::EventKind::Input => {}
        }
    }

    pub(super) fn inconsistent(seq: u64, env: &Envelope, why: impl Into<String>) -> FoldError {
        FoldError::Inconsistent {
            seq,
            event: env.event_type(),
            why: why.into(),
        }
    }

    /// What the run waits on, derived from open work (for status reports).
    pub fn waiting_on(&self) -> Option<WaitReason> {
        match self.status {
            RunStatus::WaitingTool => Some(WaitReason::Tool),
            RunStatus::WaitingUser => Some(WaitReason::User),
            RunStatus::WaitingApproval => Some(WaitReason::Approval),
            RunStatus::WaitingExternal => Some(WaitReason::External),
            // Shown apart, with the wait's details ([`RunState::provider`]).
            RunStatus::WaitingProvider
            | RunStatus::Queued
            | RunStatus::Running
            | RunStatus::Cancelling
            | RunStatus::Compensating
            | RunStatus::Unknown
            | RunStatus::Succeeded
            | RunStatus::Failed
            | RunStatus::Cancelled => None,
        }
    }
}
