//! `fold(journal) -> RunState`: a run's state is a pure function of its journal.
//!
//! Decisions go through the transition table ([`crate::machine::apply`]); a decision the table
//! refuses makes the fold fail, because the single writer never journals one. Inputs never change
//! the status; an input that no longer matters (a result for an unknown operation, a second result
//! for the same operation, a message to a cancelled run) is counted in
//! [`RunState::ignored_inputs`] and otherwise ignored, since anyone may append inputs. That
//! includes inputs stored before the run's `run.created` (anyone may publish on a run id that
//! does not exist yet): [`fold`] counts and skips them.
//!
//! Messages on a run's subjects that are not events of the run at all (the journal sets them
//! aside: not JSON, the wrong shape, a decision without the writer's id …) never reach the fold
//! as events; the decision writer folds them in with [`RunState::set_aside`], which counts them
//! and, for one on a decision subject, moves the last decision sequence past it (the broker's
//! expected-sequence check counts it).
//!
//! Context consumption is explicit: `step.started` records `inputs_through`, the sequence of the
//! last input its model context includes, and the fold moves exactly those inputs into the
//! transcript. An input that lands between the worker's read and its `step.started` stays pending
//! for the next step, never lost.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::event::{
    ApprovalRequested, AssistantMessage, Digest, Envelope, Event, EventType, Gate, OpFate,
    OpSummary, Resolution, RunCreated, RunFailed, SeqDigest, TimerPurpose, Timestamp, ToolCall,
    Usage, Verdict, WaitReason,
};
use crate::ids::{
    ApprovalId, Attempt, CallbackKey, ModelRequestId, OperationId, QuestionId, RunId, StepNo,
    TimerId,
};
use crate::machine::{RunStatus, TransitionError, apply};

/// The name of the built-in tool that asks the user a question; the run waits for the answer.
pub const ASK_USER_TOOL: &str = "ask_user";
/// The name of the built-in tool that waits: `{"seconds": N}` schedules a durable timer and the
/// run waits (holding nothing) until it fires.
pub const WAIT_TOOL: &str = "wait";

/// The name of the built-in tool that waits for an external callback:
/// `{"timeout_seconds": N}`; its result is the first payload delivered for the operation's
/// correlation key (`CallbackKey::for_operation`).
pub const AWAIT_CALLBACK_TOOL: &str = "await_callback";

/// Tools the step service handles itself (no tool worker executes them).
pub fn handled_by_step(tool: &str) -> bool {
    tool == ASK_USER_TOOL
        || tool == WAIT_TOOL
        || tool == AWAIT_CALLBACK_TOOL
        || tool == crate::child::RUN_AGENT_TOOL
}

/// A set of version gates ([`Gate`]): those a run has marked (`run.gated`), or those a decision
/// may take for the first time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Hash)]
pub struct Gates(u32);

impl Gates {
    pub const NONE: Gates = Gates(0);

    fn bit(gate: Gate) -> u32 {
        match gate {
            Gate::WaitFromStepGroup => 1,
        }
    }

    /// Every gate this build knows: what the live writer, deciding at the end of the journal,
    /// may take for the first time.
    pub fn all() -> Gates {
        Gates::of(Gate::ALL.iter().copied())
    }

    pub fn of(gates: impl IntoIterator<Item = Gate>) -> Gates {
        gates.into_iter().fold(Gates::NONE, Gates::with)
    }

    pub fn contains(self, gate: Gate) -> bool {
        self.0 & Gates::bit(gate) != 0
    }

    #[must_use]
    pub fn with(self, gate: Gate) -> Gates {
        Gates(self.0 | Gates::bit(gate))
    }

    #[must_use]
    pub fn without(self, gate: Gate) -> Gates {
        Gates(self.0 & !Gates::bit(gate))
    }

    /// The gates of `self` that are not in `other`.
    #[must_use]
    pub fn minus(self, other: Gates) -> Gates {
        Gates(self.0 & !other.0)
    }

    #[must_use]
    pub fn union(self, other: Gates) -> Gates {
        Gates(self.0 | other.0)
    }

    pub fn iter(self) -> impl Iterator<Item = Gate> {
        Gate::ALL.iter().copied().filter(move |g| self.contains(*g))
    }
}

/// What one decision of a step's group makes the run wait on beyond its tools: a person's
/// approval (`approval.requested`), a person's answer (`question.asked`), a timer or a callback
/// (`timer.scheduled` of a `wait`, `callback.expected`). `None` for everything else.
pub fn waits_on(event: &Event) -> Option<WaitReason> {
    match event {
        Event::ApprovalRequested(_) => Some(WaitReason::Approval),
        Event::QuestionAsked(_) => Some(WaitReason::User),
        Event::CallbackExpected(_) => Some(WaitReason::External),
        Event::TimerScheduled(t) => match t.purpose {
            TimerPurpose::Wait { .. } | TimerPurpose::CallbackExpiry { .. } => {
                Some(WaitReason::External)
            }
            TimerPurpose::RunDeadline
            | TimerPurpose::ApprovalExpiry { .. }
            | TimerPurpose::QuestionTimeout { .. }
            | TimerPurpose::ProviderWait { .. } => None,
        },
        Event::RunCreated(_)
        | Event::RunStarted(_)
        | Event::StepStarted(_)
        | Event::ModelAttempt(_)
        | Event::StepCompleted(_)
        | Event::ToolRequested(_)
        | Event::ChildStarted(_)
        | Event::ApprovalInvalidated(_)
        | Event::ApprovalExpired(_)
        | Event::OutputRejected(_)
        | Event::RunWaiting(_)
        | Event::RunCancelling(_)
        | Event::RunUnknown(_)
        | Event::RunResumed(_)
        | Event::RunRevived(_)
        | Event::RunSucceeded(_)
        | Event::RunFailed(_)
        | Event::RunCancelled(_)
        | Event::RunGated(_)
        | Event::RunCompensating(_)
        | Event::UserMessage(_)
        | Event::ToolStarted(_)
        | Event::ToolResult(_)
        | Event::ToolAttempt(_)
        | Event::QuestionAnswered(_)
        | Event::ApprovalDecided(_)
        | Event::TimerFired(_)
        | Event::CallbackReceived(_)
        | Event::CancelRequested(_)
        | Event::OutcomeConfirmed(_)
        | Event::OutcomeNotFound(_)
        | Event::OutcomeAmbiguous(_)
        | Event::OutcomeResolved(_)
        | Event::TargetMoved(_)
        | Event::Nudge(_)
        | Event::ProviderWaiting(_)
        | Event::ProviderReleased(_)
        | Event::ContextCompacted(_) => None,
    }
}

/// The stronger of two wait reasons: what a run whose step asked for both waits on (an
/// approval before an answer, an answer before a timer or callback, any of them before tools).
pub fn stronger(a: WaitReason, b: WaitReason) -> WaitReason {
    let rank = |w: WaitReason| match w {
        WaitReason::Tool => 0,
        WaitReason::External => 1,
        WaitReason::User => 2,
        WaitReason::Approval => 3,
    };
    if rank(b) > rank(a) { b } else { a }
}

/// What a run waits on after a step whose group (the decisions after its `step.completed`) is
/// `events`: its tools, unless one of them waits on more ([`waits_on`]). `complete_step`'s
/// `run.waiting` and the fold's derivation for a group that journals none are both this.
pub fn group_waits_on<'a>(events: impl IntoIterator<Item = &'a Event>) -> WaitReason {
    events
        .into_iter()
        .filter_map(waits_on)
        .fold(WaitReason::Tool, stronger)
}

/// One message of the provider-neutral conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum ChatMessage {
    User {
        text: String,
    },
    Assistant {
        #[serde(flatten)]
        message: AssistantMessage,
    },
    Tool {
        call_id: String,
        content: String,
        is_error: bool,
    },
}

/// Where one tool operation stands.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpStatus {
    /// Held back until a person approves it (`approval.requested`); not dispatched.
    AwaitingApproval,
    /// Requested; no runner has reported starting it.
    Requested,
    Started {
        runner: String,
    },
    /// Found not to have happened (`outcome.not_found`, or a person chose `retry`): to be
    /// dispatched again under the same operation id.
    ToRetry,
    Done,
    /// A runner died mid-operation and its confirm query could not tell whether it happened.
    Ambiguous {
        detail: String,
    },
}

/// The result the model will see for an operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpResult {
    pub content: String,
    pub is_error: bool,
    pub stopped: bool,
    /// Journal sequence of the input that carried it.
    pub seq: u64,
}

#[derive(Debug, Clone, PartialEq)]
pub struct ToolOp {
    pub op: OperationId,
    pub call: ToolCall,
    pub args_digest: crate::event::Digest,
    pub status: OpStatus,
    pub result: Option<OpResult>,
    /// How many times the operation was dispatched (`tool.requested`), the first included.
    pub dispatches: u32,
    /// When it entered its current status (requested, dispatched, started): how long a
    /// `Started` operation has been running.
    pub since: Timestamp,
    /// The runner found the target moved since the approval was given (`target.moved`); cleared
    /// by the fresh `approval.requested`.
    pub target_moved: Option<crate::event::TargetMoved>,
    /// The policy's time limit for it (from its request), repeated on every dispatch.
    pub timeout_secs: Option<u64>,
    /// The policy's network grant for it (from its request), repeated on every dispatch.
    pub network: bool,
    /// The policy's retry policy for it (from its request), repeated on every dispatch.
    pub retry: Option<crate::tools::RetryPolicy>,
    /// The policy's output limit for it (from its request), repeated on every dispatch.
    pub max_output_bytes: Option<u64>,
    /// Attempts of its current dispatch that failed and were retried (`tool.attempt`).
    pub failed_attempts: u32,
    /// Its tool's declared reversibility (from its request), and a compensable tool's
    /// compensation.
    pub reversibility: Option<crate::event::Reversibility>,
    /// For a compensation: the operation it compensates.
    pub compensates: Option<OperationId>,
}

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
    pub turn: u32,
    /// Sequence of the last event folded.
    pub last_seq: u64,
    /// Sequence of the last decision: the expected-last-sequence of the next decision append.
    pub last_decision_seq: u64,
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
}

/// The hash state of a run's transcript so far ([`RunState::next_context_digested`]): derived
/// from the transcript, so two states are equal whatever it holds, and a clone carries it.
#[derive(Default)]
pub struct TranscriptDigest(std::sync::Mutex<SeqDigest>);

impl TranscriptDigest {
    fn hashed(&self) -> SeqDigest {
        self.0.lock().map(|d| d.clone()).unwrap_or_default()
    }

    fn keep(&self, hashed: &SeqDigest) {
        if let Ok(mut d) = self.0.lock()
            && hashed.items() > d.items()
        {
            *d = hashed.clone();
        }
    }
}

impl Clone for TranscriptDigest {
    fn clone(&self) -> Self {
        Self(std::sync::Mutex::new(self.hashed()))
    }
}

impl PartialEq for TranscriptDigest {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for TranscriptDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TranscriptDigest")
            .field(&self.hashed().items())
            .finish()
    }
}

/// The part of a step's decision group already journaled.
#[derive(Debug, Clone, PartialEq)]
pub struct Completing {
    pub step: StepNo,
    pub attempt: Attempt,
    pub request_id: ModelRequestId,
    pub response: crate::decide::ModelResponse,
    pub reused: bool,
    /// Decisions of the group journaled after `step.completed`.
    pub landed: usize,
    /// `step.completed`'s `follows`: the group settles the status by itself once that many
    /// decisions landed (no `run.waiting`). `None`: it ends with its own settling decision.
    pub follows: Option<u32>,
    /// What the decisions landed so far make the run wait on ([`group_waits_on`]).
    pub on: WaitReason,
    /// The gates the run had marked when `step.completed` landed (the group was decided with
    /// them; a marker it carries is not among them).
    pub gates: Gates,
}

impl Completing {
    /// What the run waits on once `rest` (the decisions of the group still to land) landed,
    /// when the group settles the status by itself; `None` when it journals its own settling
    /// decision.
    pub fn settles_with(&self, rest: &[crate::event::Draft]) -> Option<WaitReason> {
        self.follows?;
        Some(
            rest.iter()
                .filter_map(|d| waits_on(&d.event))
                .fold(self.on, stronger),
        )
    }
}

/// A journal that does not fold.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum FoldError {
    #[error("the journal is empty")]
    Empty,
    #[error("event {seq}: the first event must be `run.created`, found `{found}`")]
    NotCreatedFirst { seq: u64, found: EventType },
    #[error("event {seq} belongs to {found}, not {expected}")]
    WrongRun {
        seq: u64,
        expected: RunId,
        found: RunId,
    },
    #[error("event {seq} is out of order (after {last})")]
    OutOfOrder { seq: u64, last: u64 },
    #[error("event {seq} (`{event}`): {source}")]
    Transition {
        seq: u64,
        event: EventType,
        source: TransitionError,
    },
    #[error("event {seq} (`{event}`): {why}")]
    Inconsistent {
        seq: u64,
        event: EventType,
        why: String,
    },
}

/// The message the model reads after its final answer was rejected (`output.rejected`): the
/// errors and what to do, in the run's wire format's terms (an Anthropic model answers through
/// the [`crate::agent::OUTPUT_TOOL`] tool). A pure function of the event and the frozen bundle,
/// so every fold and replay builds the same context.
pub fn output_feedback(
    provider: crate::event::Provider,
    r: &crate::event::OutputRejected,
) -> String {
    let mut text = format!(
        "Your answer does not match the required JSON Schema (retry {} of {}):\n",
        r.retry, r.max_retries
    );
    for e in &r.errors {
        text.push_str("- ");
        text.push_str(e);
        text.push('\n');
    }
    text.push_str(match provider {
        crate::event::Provider::Openai => {
            "Answer again with the corrected JSON only: it must match the schema, with nothing \
             before or after it."
        }
        crate::event::Provider::Anthropic => {
            "Answer again by calling the `output` tool with the corrected answer: it must match \
             the schema."
        }
    });
    text
}

/// The text a model sees for a callback payload: a JSON string as is, anything else as JSON.
fn payload_text(payload: &serde_json::Value) -> String {
    match payload {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

/// Folds a run's journal, in sequence order, into its state. Inputs before `run.created`
/// (published on the run's subjects before it existed) are counted as ignored.
pub fn fold<'a>(
    events: impl IntoIterator<Item = (u64, &'a Envelope)>,
) -> Result<RunState, FoldError> {
    let mut iter = events.into_iter();
    let mut early_inputs: u32 = 0;
    let (seq, first) = loop {
        let (seq, env) = iter.next().ok_or(FoldError::Empty)?;
        match env.kind() {
            crate::event::EventKind::Input => early_inputs = early_inputs.saturating_add(1),
            crate::event::EventKind::Decision => break (seq, env),
        }
    };
    let mut state = RunState::created(seq, first)?;
    state.ignored_inputs = early_inputs;
    for (seq, env) in iter {
        state.apply(seq, env)?;
    }
    Ok(state)
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
            turn: 1,
            last_seq: seq,
            last_decision_seq: seq,
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
        match event.kind() {
            crate::event::EventKind::Decision => {
                let wait = match &env.event {
                    Event::RunWaiting(w) => Some(w.on),
                    _ => None,
                };
                self.status = apply(Some(self.status), event, wait)
                    .map_err(|source| FoldError::Transition { seq, event, source })?;
                self.apply_decision(seq, env)?;
                // A step group that journals no `run.waiting` settles the status when its last
                // decision lands, through the same row of the table.
                if let Some(on) = self.track_group(env) {
                    self.status = apply(Some(self.status), EventType::RunWaiting, Some(on))
                        .map_err(|source| FoldError::Transition { seq, event, source })?;
                }
                self.last_decision_seq = seq;
            }
            crate::event::EventKind::Input => {
                if !self.apply_input(seq, env) {
                    self.ignored_inputs = self.ignored_inputs.saturating_add(1);
                }
            }
        }
        self.last_seq = seq;
        Ok(())
    }

    /// What the run waits on once `drafts` (a decision group, or the rest of the one cut short)
    /// land, when they end a step group that journals no `run.waiting` (gate
    /// `wait_from_step_group`): the status the fold then derives. `None` otherwise (the group's
    /// own decisions say it, or it does not end there). For status counters.
    pub fn settled_by(&self, drafts: &[crate::event::Draft]) -> Option<WaitReason> {
        match drafts.first().map(|d| &d.event) {
            Some(Event::StepCompleted(done)) => {
                let follows = usize::try_from(done.follows?).ok()?;
                (drafts.len() == follows + 1)
                    .then(|| group_waits_on(drafts[1..].iter().map(|d| &d.event)))
            }
            _ => {
                let c = self.completing.as_ref()?;
                let follows = usize::try_from(c.follows?).ok()?;
                if c.landed + drafts.len() == follows {
                    c.settles_with(drafts)
                } else {
                    None
                }
            }
        }
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
            crate::event::EventKind::Decision => self.last_decision_seq = seq,
            crate::event::EventKind::Input => {}
        }
    }

    fn inconsistent(seq: u64, env: &Envelope, why: impl Into<String>) -> FoldError {
        FoldError::Inconsistent {
            seq,
            event: env.event_type(),
            why: why.into(),
        }
    }

    fn apply_decision(&mut self, seq: u64, env: &Envelope) -> Result<(), FoldError> {
        match &env.event {
            Event::RunCreated(_) => {
                // The table refuses a second `run.created` before we get here.
                return Err(Self::inconsistent(seq, env, "second run.created"));
            }
            Event::RunStarted(_) | Event::RunWaiting(_) | Event::RunResumed(_) => {}
            Event::StepStarted(started) => {
                let (Some(step), Some(attempt)) = (env.step, env.attempt) else {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        "step and attempt are required",
                    ));
                };
                let expected = match &self.open_step {
                    Some(open) => (open.step, open.attempt.next()),
                    None => (self.step.next(), Attempt(1)),
                };
                if (step, attempt) != expected {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        format!(
                            "expected step {} attempt {}, got step {step} attempt {attempt}",
                            expected.0, expected.1
                        ),
                    ));
                }
                if started.request_id != ModelRequestId::new(&self.run_id, step, attempt) {
                    return Err(Self::inconsistent(seq, env, "request id does not match"));
                }
                if started.inputs_through > seq {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        "inputs_through is in the future",
                    ));
                }
                let consumed = self.consumable(started.inputs_through);
                self.transcript.extend(consumed);
                self.pending_messages
                    .retain(|m| m.seq > started.inputs_through);
                self.step = step;
                self.open_step = Some(OpenStep {
                    step,
                    attempt,
                    request_id: started.request_id.clone(),
                    context_digest: started.context_digest.clone(),
                    failed: false,
                    free: self
                        .open_step
                        .as_ref()
                        .filter(|o| o.step == step)
                        .map_or(0, |o| o.free),
                    model: started.model.clone(),
                });
            }
            Event::ModelAttempt(attempt) => match &mut self.open_step {
                Some(open) if open.request_id == attempt.request_id => {
                    open.failed = true;
                    if attempt.outcome.is_free() {
                        open.free = open.free.saturating_add(1);
                    }
                }
                _ => {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        "model.attempt for a request that is not open",
                    ));
                }
            },
            Event::StepCompleted(done) => {
                match &self.open_step {
                    Some(open) if open.step == done.request_id.step() => {}
                    _ => {
                        return Err(Self::inconsistent(
                            seq,
                            env,
                            "step.completed for a step that is not open",
                        ));
                    }
                }
                self.open_step = None;
                self.provider = None;
                self.usage.add(done.usage);
                self.transcript.push(ChatMessage::Assistant {
                    message: done.message.clone(),
                });
            }
            Event::ToolRequested(req) => {
                let Some(op) = env.op.clone() else {
                    return Err(Self::inconsistent(seq, env, "op is required"));
                };
                let call = ToolCall {
                    call_id: req.call_id.clone(),
                    name: req.tool.clone(),
                    arguments: req.arguments.clone(),
                };
                // A compensation is requested only by a compensating run, under the id derived
                // from the operation it compensates, which is in its plan; and only it uses a
                // compensation's id.
                let planned = |c: &OperationId| {
                    self.compensation.as_ref().is_some_and(|k| {
                        k.plan
                            .iter()
                            .any(|p| p.op == *c && p.compensation.as_ref() == Some(&op))
                    })
                };
                let valid = match &req.compensates {
                    Some(c) => {
                        self.status == RunStatus::Compensating
                            && c.compensation_of().as_ref() == Some(&op)
                            && planned(c)
                    }
                    None => !op.is_compensation(),
                };
                if !valid {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        "a compensation must be requested by a compensating run, under the id \
                         derived from an operation of its plan (and only a compensation uses one)",
                    ));
                }
                match self.ops.get_mut(&op) {
                    // A re-dispatch under the same operation id (after `outcome.not_found` or a
                    // person's `retry`).
                    Some(existing) if existing.result.is_none() => {
                        existing.status = OpStatus::Requested;
                        existing.dispatches = existing.dispatches.saturating_add(1);
                        existing.since = env.at;
                        existing.failed_attempts = 0;
                    }
                    Some(_) => {
                        return Err(Self::inconsistent(
                            seq,
                            env,
                            "operation already has a result",
                        ));
                    }
                    None => {
                        self.ops.insert(
                            op.clone(),
                            ToolOp {
                                op,
                                call,
                                args_digest: req.args_digest.clone(),
                                status: OpStatus::Requested,
                                result: None,
                                dispatches: 1,
                                since: env.at,
                                target_moved: None,
                                timeout_secs: req.timeout_secs,
                                network: req.network,
                                max_output_bytes: req.max_output_bytes,
                                retry: req.retry.clone(),
                                failed_attempts: 0,
                                reversibility: req.reversibility.clone(),
                                compensates: req.compensates.clone(),
                            },
                        );
                    }
                }
            }
            Event::QuestionAsked(q) => {
                self.questions.insert(
                    q.question_id.clone(),
                    QuestionState {
                        op: env.op.clone(),
                        prompt: q.prompt.clone(),
                        answer: None,
                        timed_out: false,
                    },
                );
            }
            Event::ApprovalRequested(req) => {
                let Some(op) = env.op.clone() else {
                    return Err(Self::inconsistent(seq, env, "op is required"));
                };
                // The operation exists from now on, held back until approved.
                let tool = self.ops.entry(op.clone()).or_insert_with(|| ToolOp {
                    op: op.clone(),
                    call: ToolCall {
                        call_id: req.call_id.clone(),
                        name: req.tool.clone(),
                        arguments: req.arguments.clone(),
                    },
                    args_digest: req.args_digest.clone(),
                    status: OpStatus::AwaitingApproval,
                    result: None,
                    dispatches: 0,
                    since: env.at,
                    target_moved: None,
                    timeout_secs: req.timeout_secs,
                    network: req.network,
                    max_output_bytes: req.max_output_bytes,
                    retry: req.retry.clone(),
                    failed_attempts: 0,
                    reversibility: req.reversibility.clone(),
                    compensates: None,
                });
                // A fresh request (after an invalidation) is made for where the target is now.
                tool.target_moved = None;
                self.approvals.insert(
                    req.approval_id.clone(),
                    ApprovalState {
                        op: Some(op),
                        request: req.clone(),
                        status: ApprovalStatus::Open,
                        requested_at: env.at,
                    },
                );
            }
            Event::ApprovalInvalidated(a) => {
                self.set_approval(
                    seq,
                    env,
                    &a.approval_id,
                    ApprovalStatus::Invalidated { at: env.at },
                )?;
            }
            Event::ApprovalExpired(a) => {
                self.set_approval(seq, env, &a.approval_id, ApprovalStatus::Expired)?;
                // The model is told; the operation never runs.
                if let Some(op) = self
                    .approvals
                    .get(&a.approval_id)
                    .and_then(|s| s.op.clone())
                {
                    self.set_op_result(
                        &op,
                        seq,
                        format!("not run: approval {} expired", a.approval_id),
                        true,
                    );
                }
            }
            Event::TimerScheduled(t) => {
                self.timers.insert(
                    t.timer_id.clone(),
                    TimerState {
                        fire_at: t.fire_at,
                        purpose: t.purpose.clone(),
                        fired: false,
                    },
                );
            }
            Event::CallbackExpected(c) => {
                let cb = self.callbacks.entry(c.key.clone()).or_default();
                cb.expected = true;
                cb.expires_at = c.expires_at;
                cb.op = env.op.clone();
                // A callback that arrived before the run started waiting is matched now.
                if let Some((at, payload)) = cb.received.first().cloned()
                    && let Some(op) = env.op.clone()
                {
                    self.set_op_result(&op, at, payload_text(&payload), false);
                }
            }
            Event::ChildStarted(c) => {
                // The link of a `run_agent` operation just requested, to the child derived
                // from it: anything else is not what the writer journals.
                let linked = env.op.as_ref().filter(|op| {
                    self.ops
                        .get(*op)
                        .is_some_and(|o| o.call.name == crate::child::RUN_AGENT_TOOL)
                        && c.child == RunId::for_child(op)
                });
                let Some(op) = linked.cloned() else {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        "child.started must name a run_agent operation and the child derived from it",
                    ));
                };
                self.children.insert(op, c.child.clone());
            }
            Event::RunCancelling(_) | Event::RunUnknown(_) => {}
            Event::RunCompensating(k) => {
                if self.compensation.is_some() {
                    return Err(Self::inconsistent(seq, env, "a second run.compensating"));
                }
                self.compensation = Some(k.clone());
            }
            // Idempotent: a second marker of the same gate changes nothing.
            Event::RunGated(g) => self.gates = self.gates.with(g.gate),
            Event::RunRevived(r) => {
                if r.turn != self.turn.saturating_add(1) {
                    return Err(Self::inconsistent(seq, env, "turn must grow by one"));
                }
                self.turn = r.turn;
                // A new turn: its effects are its own to compensate (the last turn's were
                // listed in its end).
                self.turn_first_step = self.step.next();
                self.compensation = None;
                self.output = None;
                self.validation = None;
                self.failure = None;
                self.output_rejections = 0;
            }
            Event::OutputRejected(r) => {
                // It ends the group of the step whose answer it rejects.
                match &self.completing {
                    Some(c) if Some(c.step) == env.step => {}
                    _ => {
                        return Err(Self::inconsistent(
                            seq,
                            env,
                            "output.rejected for a step whose answer was not just completed",
                        ));
                    }
                }
                self.output_rejections = self.output_rejections.saturating_add(1);
                // The rejected answer is the transcript's last turn; the model reads why next.
                self.transcript.push(ChatMessage::User {
                    text: output_feedback(self.bundle.model.provider, r),
                });
            }
            Event::RunSucceeded(s) => {
                self.output = Some(s.output.clone());
                self.validation = Some(s.validation.clone());
            }
            Event::RunFailed(f) => {
                self.failure = Some(f.clone());
                // The run's end closes the step it failed on (a refused model call, a step's
                // attempts used up): a revived turn starts a step of its own.
                self.open_step = None;
                self.provider = None;
                // A turn that ended before its first step (a message revived a run whose
                // budget was spent, and it failed again at once) answered the messages that
                // revived it: they are not pending any more, or every drive would revive and
                // fail the run again, without end.
                if self.step < self.turn_first_step {
                    self.pending_messages.clear();
                }
            }
            Event::RunCancelled(_) => {}
            Event::ProviderWaiting(w) => {
                // Journaled right after the attempt that met the trouble (or was held).
                let Some(open) = self.open_step.as_ref().filter(|o| o.failed) else {
                    return Err(Self::inconsistent(
                        seq,
                        env,
                        "provider.waiting for a step whose attempt did not end",
                    ));
                };
                self.provider = Some(ProviderWait {
                    step: open.step,
                    endpoint: w.endpoint.clone(),
                    trouble: w.trouble,
                    message: w.message.clone(),
                    since: w.since,
                    give_up_at: w.give_up_at,
                    released: None,
                });
            }
            Event::ContextCompacted(c) => {
                let compaction = self.checked_compaction(c).map_err(|why| {
                    Self::inconsistent(seq, env, format!("context.compacted: {why}"))
                })?;
                if let Some(summary) = &c.summary {
                    self.usage.add(summary.usage);
                }
                self.compaction = Some(compaction);
            }
            Event::UserMessage(_)
            | Event::ToolStarted(_)
            | Event::ToolResult(_)
            | Event::ToolAttempt(_)
            | Event::QuestionAnswered(_)
            | Event::ApprovalDecided(_)
            | Event::TimerFired(_)
            | Event::CallbackReceived(_)
            | Event::CancelRequested(_)
            | Event::OutcomeConfirmed(_)
            | Event::OutcomeNotFound(_)
            | Event::OutcomeAmbiguous(_)
            | Event::OutcomeResolved(_)
            | Event::TargetMoved(_)
            | Event::Nudge(_)
            | Event::ProviderReleased(_) => {
                return Err(Self::inconsistent(seq, env, "input on a decision path"));
            }
        }
        Ok(())
    }

    /// Follows a step's decision group: it starts at `step.completed` and ends at the decision
    /// that settles the run's status (`run.waiting`, a terminal or cancelling decision), or,
    /// when `step.completed` counts its group (`follows`), once that many decisions landed:
    /// then what the run waits on, derived from the group, is returned.
    fn track_group(&mut self, env: &Envelope) -> Option<WaitReason> {
        match &env.event {
            Event::StepCompleted(done) => {
                self.completing = Some(Completing {
                    step: done.request_id.step(),
                    attempt: done.request_id.attempt(),
                    request_id: done.request_id.clone(),
                    response: crate::decide::ModelResponse {
                        message: done.message.clone(),
                        usage: done.usage,
                        finish: done.finish,
                    },
                    reused: done.reused,
                    landed: 0,
                    follows: done.follows,
                    on: WaitReason::Tool,
                    gates: self.gates,
                });
            }
            Event::RunWaiting(_)
            | Event::OutputRejected(_)
            | Event::RunSucceeded(_)
            | Event::RunFailed(_)
            | Event::RunCancelling(_)
            | Event::RunCancelled(_)
            | Event::RunCompensating(_)
            | Event::RunUnknown(_) => {
                self.completing = None;
                return None;
            }
            other => {
                if let Some(c) = &mut self.completing {
                    c.landed += 1;
                    if let Some(on) = waits_on(other) {
                        c.on = stronger(c.on, on);
                    }
                }
            }
        }
        match &self.completing {
            Some(c) if c.follows.is_some_and(|n| n as usize == c.landed) => {
                let on = c.on;
                self.completing = None;
                Some(on)
            }
            Some(_) | None => None,
        }
    }

    fn set_approval(
        &mut self,
        seq: u64,
        env: &Envelope,
        id: &ApprovalId,
        status: ApprovalStatus,
    ) -> Result<(), FoldError> {
        match self.approvals.get_mut(id) {
            Some(a) => {
                a.status = status;
                Ok(())
            }
            None => Err(Self::inconsistent(
                seq,
                env,
                format!("unknown approval {id}"),
            )),
        }
    }

    /// Folds an input; `false` if it was ignored.
    fn apply_input(&mut self, seq: u64, env: &Envelope) -> bool {
        if self.status == RunStatus::Cancelled && !matches!(env.event, Event::ToolResult(_)) {
            return false;
        }
        match &env.event {
            Event::UserMessage(m) => {
                self.pending_messages.push(PendingInput {
                    seq,
                    text: m.text.clone(),
                });
                true
            }
            Event::ToolStarted(s) => match self.open_op(env) {
                Some(op) if op.status == OpStatus::Requested => {
                    op.status = OpStatus::Started {
                        runner: s.runner.clone(),
                    };
                    op.since = env.at;
                    true
                }
                _ => false,
            },
            Event::ToolResult(r) => {
                self.set_result(env, seq, r.content.clone(), r.is_error, r.stopped)
            }
            // A failed attempt that will be tried again: not a result. The operation waits for
            // its next attempt as a dispatched one does, from when that attempt is due (so a
            // long backoff is not taken for a stuck operation). What a `tool.attempt` means is
            // `NextAttempt::after`'s to say (the runners read it the same way): a later attempt
            // of the current dispatch, its due time at most the longest backoff away.
            Event::ToolAttempt(a) => match self.open_op(env) {
                Some(op)
                    if matches!(op.status, OpStatus::Requested | OpStatus::Started { .. })
                        && a.dispatch.saturating_add(1) == op.dispatches =>
                {
                    let known = crate::tools::NextAttempt {
                        number: op.failed_attempts.saturating_add(1),
                        due: None,
                    };
                    match known.after(a, env.at) {
                        Some(next) => {
                            op.status = OpStatus::Requested;
                            op.failed_attempts = a.attempt;
                            op.since = next.due.unwrap_or(env.at);
                            true
                        }
                        None => false,
                    }
                }
                _ => false,
            },
            Event::OutcomeConfirmed(c) => {
                self.set_result(env, seq, c.content.clone(), false, false)
            }
            Event::OutcomeNotFound(_) => match self.open_op(env) {
                Some(op) => {
                    op.status = OpStatus::ToRetry;
                    true
                }
                None => false,
            },
            Event::OutcomeAmbiguous(a) => match self.open_op(env) {
                Some(op) => {
                    op.status = OpStatus::Ambiguous {
                        detail: a.detail.clone(),
                    };
                    true
                }
                None => false,
            },
            Event::OutcomeResolved(r) => {
                let is_ambiguous = matches!(
                    self.open_op(env).map(|o| &o.status),
                    Some(OpStatus::Ambiguous { .. })
                );
                if !is_ambiguous {
                    return false;
                }
                match &r.resolution {
                    Resolution::Retry => match self.open_op(env) {
                        Some(op) => {
                            op.status = OpStatus::ToRetry;
                            true
                        }
                        None => false,
                    },
                    Resolution::Completed { content } => {
                        self.set_result(env, seq, content.clone(), false, false)
                    }
                    Resolution::Failed { reason } => {
                        self.set_result(env, seq, reason.clone(), true, false)
                    }
                }
            }
            Event::QuestionAnswered(a) => {
                let Some(q) = self.questions.get_mut(&a.question_id) else {
                    return false;
                };
                if !q.is_open() {
                    return false;
                }
                q.answer = Some(a.answer.clone());
                let op = q.op.clone();
                if let Some(op) = op
                    && let Some(tool) = self.ops.get_mut(&op)
                    && tool.result.is_none()
                {
                    tool.status = OpStatus::Done;
                    tool.result = Some(OpResult {
                        content: a.answer.clone(),
                        is_error: false,
                        stopped: false,
                        seq,
                    });
                }
                true
            }
            Event::ApprovalDecided(d) => match self.approvals.get_mut(&d.approval_id) {
                Some(a) if a.status == ApprovalStatus::Open => {
                    a.status = ApprovalStatus::Decided {
                        verdict: d.verdict,
                        args_digest: d.args_digest.clone(),
                        approver: d.approver.clone(),
                        at: env.at,
                    };
                    // A denial stands whatever was shown: the model is told and continues.
                    if d.verdict == Verdict::Deny
                        && let Some(op) = a.op.clone()
                    {
                        let comment = d
                            .comment
                            .as_deref()
                            .map(|c| format!(": {c}"))
                            .unwrap_or_default();
                        self.set_op_result(
                            &op,
                            seq,
                            format!("not run: denied by {}{comment}", d.approver),
                            true,
                        );
                    }
                    true
                }
                _ => false,
            },
            Event::TimerFired(t) => match self.timers.get_mut(&t.timer_id) {
                Some(timer) if !timer.fired => {
                    timer.fired = true;
                    let fire_at = timer.fire_at;
                    match timer.purpose.clone() {
                        // A `wait` operation's result is its timer firing.
                        TimerPurpose::Wait { op } => {
                            self.set_op_result(&op, seq, format!("waited until {fire_at}"), false);
                        }
                        // No callback in time: the operation fails (a late one is refused).
                        TimerPurpose::CallbackExpiry { key } => {
                            if let Some(op) = self.callbacks.get(&key).and_then(|c| c.op.clone()) {
                                self.set_op_result(
                                    &op,
                                    seq,
                                    format!("no callback for {key} before {fire_at}"),
                                    true,
                                );
                            }
                        }
                        // No answer in time: the question closes and the model is told.
                        TimerPurpose::QuestionTimeout { question_id } => {
                            if let Some(q) = self.questions.get_mut(&question_id)
                                && q.is_open()
                            {
                                q.timed_out = true;
                                if let Some(op) = q.op.clone() {
                                    self.set_op_result(
                                        &op,
                                        seq,
                                        format!("no answer before {fire_at}"),
                                        true,
                                    );
                                }
                            }
                        }
                        // Acted on by the decision (a wait on the provider that outlasted it).
                        TimerPurpose::RunDeadline
                        | TimerPurpose::ApprovalExpiry { .. }
                        | TimerPurpose::ProviderWait { .. } => {}
                    }
                    true
                }
                _ => false,
            },
            Event::CallbackReceived(c) => {
                let cb = self.callbacks.entry(c.key.clone()).or_default();
                if cb.expires_at.is_some_and(|exp| env.at > exp) {
                    return false; // too late: the operation already failed or will
                }
                if !cb.received.is_empty() {
                    return false; // a duplicate: the first one counts
                }
                // Kept even before `callback.expected`: an early callback is matched later.
                cb.received.push((seq, c.payload.clone()));
                if let Some(op) = cb.op.clone() {
                    self.set_op_result(&op, seq, payload_text(&c.payload), false);
                }
                true
            }
            Event::CancelRequested(c) => {
                if self.status.is_terminal() || self.cancel_requested.is_some() {
                    return false;
                }
                self.cancel_requested = Some(c.reason.clone());
                true
            }
            Event::TargetMoved(m) => match self.open_op(env) {
                // Back to waiting for a person: the approval it ran under no longer holds.
                Some(op) if matches!(op.status, OpStatus::Requested | OpStatus::Started { .. }) => {
                    op.status = OpStatus::AwaitingApproval;
                    op.target_moved = Some(m.clone());
                    op.since = env.at;
                    true
                }
                _ => false,
            },
            Event::Nudge(_) => !self.status.is_terminal(),
            // Counts once per wait: a second release (a releaser repeating itself) changes
            // nothing, and one that comes after the run moved on is ignored.
            Event::ProviderReleased(r) => match &mut self.provider {
                Some(wait)
                    if self.status == RunStatus::WaitingProvider && wait.released.is_none() =>
                {
                    wait.released = Some(r.probe);
                    true
                }
                _ => false,
            },
            Event::RunCreated(_)
            | Event::RunStarted(_)
            | Event::StepStarted(_)
            | Event::ModelAttempt(_)
            | Event::StepCompleted(_)
            | Event::ToolRequested(_)
            | Event::QuestionAsked(_)
            | Event::ChildStarted(_)
            | Event::ApprovalRequested(_)
            | Event::ApprovalInvalidated(_)
            | Event::ApprovalExpired(_)
            | Event::TimerScheduled(_)
            | Event::CallbackExpected(_)
            | Event::OutputRejected(_)
            | Event::RunWaiting(_)
            | Event::RunCancelling(_)
            | Event::RunUnknown(_)
            | Event::RunResumed(_)
            | Event::RunRevived(_)
            | Event::RunSucceeded(_)
            | Event::RunFailed(_)
            | Event::RunCancelled(_)
            | Event::RunGated(_)
            | Event::RunCompensating(_)
            | Event::ProviderWaiting(_)
            | Event::ContextCompacted(_) => false,
        }
    }

    /// Sets the result of an operation that has none yet.
    fn set_op_result(&mut self, op: &OperationId, seq: u64, content: String, is_error: bool) {
        if let Some(tool) = self.ops.get_mut(op)
            && tool.result.is_none()
        {
            tool.status = OpStatus::Done;
            tool.result = Some(OpResult {
                content,
                is_error,
                stopped: false,
                seq,
            });
        }
    }

    /// The operation named by the envelope's `op`, if it exists and has no result yet.
    fn open_op(&mut self, env: &Envelope) -> Option<&mut ToolOp> {
        let op = env.op.as_ref()?;
        self.ops.get_mut(op).filter(|o| o.result.is_none())
    }

    fn set_result(
        &mut self,
        env: &Envelope,
        seq: u64,
        content: String,
        is_error: bool,
        stopped: bool,
    ) -> bool {
        match self.open_op(env) {
            Some(op) => {
                op.status = OpStatus::Done;
                op.result = Some(OpResult {
                    content,
                    is_error,
                    stopped,
                    seq,
                });
                true
            }
            None => false,
        }
    }

    /// Operations a tool runner should be working on (dispatched or started, no outcome yet)
    /// that entered that status before `cutoff`: with `cutoff = now - (tool_timeout +
    /// tool_grace)`, the ones whose runner is gone or never got the request. Tools the step
    /// service handles (questions, waits, callbacks) legitimately wait and are never listed.
    pub fn ops_stuck_since(&self, cutoff: Timestamp) -> Vec<&ToolOp> {
        self.ops
            .values()
            .filter(|o| {
                matches!(o.status, OpStatus::Requested | OpStatus::Started { .. })
                    && o.result.is_none()
                    && !handled_by_step(&o.call.name)
                    && o.since.0 < cutoff.0
            })
            .collect()
    }

    /// The operations of the last completed step, in call order.
    pub fn last_step_ops(&self) -> Vec<&ToolOp> {
        let last = match &self.open_step {
            Some(open) => StepNo(open.step.get().saturating_sub(1)),
            None => self.step,
        };
        self.ops
            .values()
            .filter(|o| o.op.step() == last && o.compensates.is_none())
            .collect()
    }

    /// Operations that have no result yet (of any step).
    pub fn unresolved_ops(&self) -> impl Iterator<Item = &ToolOp> {
        self.ops.values().filter(|o| o.result.is_none())
    }

    /// What a step whose context includes inputs up to `through` adds to the transcript: the
    /// results of the previous step's tool calls (in call order), then the user's new messages.
    pub fn consumable(&self, through: u64) -> Vec<ChatMessage> {
        let mut out = Vec::new();
        let answered_in_transcript = |call_id: &str| {
            self.transcript
                .iter()
                .any(|m| matches!(m, ChatMessage::Tool { call_id: c, .. } if c == call_id))
        };
        for op in self.last_step_ops() {
            if let Some(result) = &op.result
                && result.seq <= through
                && !answered_in_transcript(&op.call.call_id)
            {
                out.push(ChatMessage::Tool {
                    call_id: op.call.call_id.clone(),
                    content: result.content.clone(),
                    is_error: result.is_error,
                });
            }
        }
        for m in self.pending_messages.iter().filter(|m| m.seq <= through) {
            out.push(ChatMessage::User {
                text: m.text.clone(),
            });
        }
        out
    }

    /// The model context of a step that starts now: the transcript (as a compaction in force
    /// leaves it, [`crate::context::apply`]) plus everything consumable.
    pub fn next_context(&self) -> Vec<ChatMessage> {
        let mut context = match &self.compaction {
            Some(c) => crate::context::apply(&self.transcript, Some(c)),
            None => self.transcript.clone(),
        };
        context.extend(crate::context::cut_pending(
            self.consumable(self.last_seq),
            self.compaction.as_ref(),
        ));
        context
    }

    /// A `context.compacted` checked against the transcript: it only grows what is left out,
    /// keeps the task, starts what it keeps at a turn (never at a tool result, whose call would
    /// be left out) and elides only tool results.
    fn checked_compaction(
        &self,
        c: &crate::event::ContextCompacted,
    ) -> Result<crate::context::Compaction, String> {
        let len = self.transcript.len();
        let keep_from = usize::try_from(c.keep_from).map_err(|_| "keep_from too large")?;
        if keep_from == 0 || keep_from > len {
            return Err(format!("keep_from {keep_from} is outside 1..={len}"));
        }
        if keep_from > 1 && !matches!(self.transcript[keep_from], ChatMessage::Assistant { .. }) {
            return Err(format!("keep_from {keep_from} is not the start of a turn"));
        }
        let before = self.compaction.as_ref().map_or(1, |c| c.keep_from);
        if keep_from < before {
            return Err(format!(
                "keep_from {keep_from} is before the last one, {before}"
            ));
        }
        let mut elided = Vec::with_capacity(c.elided.len());
        for e in &c.elided {
            let i = usize::try_from(*e).map_err(|_| "an elided index is too large")?;
            let is_result = self
                .transcript
                .get(i)
                .is_some_and(|m| matches!(m, ChatMessage::Tool { .. }));
            if i < keep_from || !is_result || elided.last().is_some_and(|l| *l >= i) {
                return Err(format!(
                    "elided {i} is not a kept tool result in ascending order"
                ));
            }
            elided.push(i);
        }
        let summary = match &c.summary {
            // Only results elided: the summary of the turns left out still stands.
            None if keep_from == before => self.compaction.as_ref().and_then(|c| c.summary.clone()),
            None => None,
            Some(_) if keep_from == 1 => return Err("a summary of nothing left out".into()),
            Some(s) if s.text.trim().is_empty() => return Err("an empty summary".into()),
            Some(s) if s.text.chars().count() > crate::context::MAX_SUMMARY_CHARS => {
                return Err(format!(
                    "a summary longer than {} characters",
                    crate::context::MAX_SUMMARY_CHARS
                ));
            }
            Some(s)
                if s.request_id.run() != &self.run_id
                    || s.request_id.attempt().get() < crate::context::SUMMARY_ATTEMPTS =>
            {
                return Err("a summary's request id is not this run's summary request".into());
            }
            Some(s) => Some(s.text.clone()),
        };
        let previous_cut = self.compaction.as_ref().and_then(|c| c.max_result_chars);
        let max_result_chars = match c.max_result_chars {
            None => previous_cut,
            Some(n) => {
                let n = usize::try_from(n).map_err(|_| "max_result_chars too large")?;
                if n < crate::context::MIN_RESULT_CHARS {
                    return Err(format!(
                        "max_result_chars {n} is under {}",
                        crate::context::MIN_RESULT_CHARS
                    ));
                }
                if previous_cut.is_some_and(|p| n > p) {
                    return Err(format!("max_result_chars {n} raises the cut in force"));
                }
                Some(n)
            }
        };
        Ok(crate::context::Compaction {
            keep_from,
            elided,
            summary,
            max_result_chars,
        })
    }

    /// [`RunState::next_context`] and its digest (`Digest::of` the context, the same value):
    /// the transcript's messages are hashed once over the run's life (kept in
    /// [`RunState::transcript_digest`]), only what follows them at every step.
    pub fn next_context_digested(&self) -> (Vec<ChatMessage>, Digest) {
        let context = self.next_context();
        // A compacted context is not the transcript's prefix: hashed whole.
        if self.compaction.is_some() {
            let digest = Digest::of(&context);
            return (context, digest);
        }
        let mut hashed = self.transcript_digest.hashed();
        // Appended to only; anything else (a state built by hand) is hashed again.
        if hashed.items() > self.transcript.len() {
            hashed = SeqDigest::default();
        }
        for m in &self.transcript[hashed.items()..] {
            hashed.push(m);
        }
        self.transcript_digest.keep(&hashed);
        for m in &context[self.transcript.len()..] {
            hashed.push(m);
        }
        (context, hashed.digest())
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

    /// How every operation of the run ended, for `run.cancelled` (and `run.failed`'s
    /// `effects`): a compensation is listed under the operation it compensates, not apart; each
    /// with its level when the run's agent declares any ([`RunState::declares_levels`]).
    pub fn op_summaries(&self) -> Vec<OpSummary> {
        let levels = self.declares_levels();
        self.ops
            .values()
            .filter(|o| o.compensates.is_none())
            .map(|o| OpSummary {
                level: levels.then(|| crate::compensation::level_of(o)),
                compensation: crate::compensation::outcome_of(self, &o.op),
                op: o.op.clone(),
                fate: match (&o.result, &o.status) {
                    (Some(r), _) if r.stopped => OpFate::Stopped,
                    (Some(r), _) if r.is_error => OpFate::Failed,
                    (Some(_), _) => OpFate::Completed,
                    // Waiting for its next attempt (a retry policy): its attempts failed, and
                    // no more will run.
                    (None, OpStatus::Requested) if o.failed_attempts > 0 => OpFate::Failed,
                    (
                        None,
                        OpStatus::Requested | OpStatus::ToRetry | OpStatus::AwaitingApproval,
                    ) => OpFate::NeverStarted,
                    (None, _) => OpFate::Stopped,
                },
            })
            .collect()
    }

    /// Whether any operation's request carries a declared reversibility: then the run's
    /// terminal event lists each operation's level. Never for runs of agents that declare
    /// none, so their terminal events are what they always were.
    pub fn declares_levels(&self) -> bool {
        self.ops.values().any(|o| o.reversibility.is_some())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Draft, EventKind, RunStarted, UserMessage};

    fn run() -> RunId {
        "run_fold1".parse().expect("valid")
    }

    fn env(event: Event) -> Envelope {
        Envelope::new(run(), Timestamp::now(), Draft::new(event))
    }

    fn created() -> Envelope {
        env(Event::RunCreated(Box::new(crate::fixtures::run_created(
            "demo", "hello",
        ))))
    }

    fn message(text: &str) -> Envelope {
        env(Event::UserMessage(UserMessage { text: text.into() }))
    }

    #[test]
    fn inputs_before_run_created_are_counted_and_skipped() {
        let (early, c, late) = (message("too early"), created(), message("hi"));
        let state = fold([(1, &early), (2, &early), (3, &c), (4, &late)]).expect("folds");
        assert_eq!(state.ignored_inputs, 2);
        assert_eq!(state.pending_messages.len(), 1);
        assert_eq!(state.last_seq, 4);
        assert!(matches!(fold([(1, &early)]), Err(FoldError::Empty)));
        let started = env(Event::RunStarted(RunStarted {}));
        assert!(matches!(
            fold([(1, &early), (2, &started)]),
            Err(FoldError::NotCreatedFirst { seq: 2, .. })
        ));
    }

    #[test]
    fn set_aside_messages_are_counted_and_a_decision_moves_the_expected_sequence() {
        let c = created();
        let mut state = fold([(3, &c)]).expect("folds");
        // One from before the run existed: only counted.
        state.set_aside(1, EventKind::Input);
        assert_eq!((state.set_aside, state.last_seq), (1, 3));
        state.set_aside(4, EventKind::Input);
        assert_eq!((state.last_seq, state.last_decision_seq), (4, 3));
        state.set_aside(5, EventKind::Decision);
        assert_eq!((state.last_seq, state.last_decision_seq), (5, 5));
        assert_eq!(state.set_aside, 3);
        // The run goes on after them.
        let started = env(Event::RunStarted(RunStarted {}));
        state.apply(6, &started).expect("applies");
        assert_eq!(state.last_decision_seq, 6);
        assert_eq!(state.status, RunStatus::Running);
    }
}
