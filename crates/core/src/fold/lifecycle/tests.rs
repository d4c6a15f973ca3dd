//! The table against the fold: every event applied to an operation in every phase.

use serde_json::json;

use super::*;
use crate::event::{
    ApprovalDecided, ApprovalExpired, ApprovalRequested, CallbackExpected, CallbackReceived,
    Digest, Draft, Envelope, Event, OutcomeAmbiguous, OutcomeConfirmed, OutcomeNotFound,
    OutcomeResolved, QuestionAnswered, QuestionAsked, Resolution, Risk, RunStarted, TargetMoved,
    TimerFired, TimerPurpose, TimerScheduled, Timestamp, ToolAttempt, ToolRequested, ToolResult,
    ToolStarted, Verdict,
};
use crate::fold::{FoldError, OpResult, RunState, fold};
use crate::ids::{ApprovalId, CallbackKey, OperationId, QuestionId, RunId, StepNo, TimerId};

fn run() -> RunId {
    "run_lifecycle1".parse().expect("valid")
}

/// The operation every event acts on.
fn op() -> OperationId {
    OperationId::new(&run(), StepNo(1), 0)
}

/// Ids of things other than the operation (another operation's, so none collides with its own).
fn other(index: u32) -> OperationId {
    OperationId::new(&run(), StepNo(1), index)
}

fn approval() -> ApprovalId {
    ApprovalId::for_operation(&op(), 1)
}

fn question() -> QuestionId {
    QuestionId::for_operation(&op())
}

fn wait_timer() -> TimerId {
    TimerId::for_operation(&op())
}

fn question_timer() -> TimerId {
    TimerId::for_operation(&other(1))
}

fn callback_timer() -> TimerId {
    TimerId::for_operation(&other(2))
}

fn callback() -> CallbackKey {
    CallbackKey::for_operation(&op())
}

/// A key whose callback arrives before the run expects it.
fn early_callback() -> CallbackKey {
    CallbackKey::for_operation(&other(3))
}

fn env(event: Event, op: Option<OperationId>) -> Envelope {
    let draft = Draft::new(event);
    let draft = match op {
        Some(op) => draft.op(op),
        None => draft,
    };
    Envelope::new(run(), Timestamp::now(), draft)
}

fn approval_requested(approval_id: ApprovalId) -> Event {
    Event::ApprovalRequested(ApprovalRequested {
        approval_id,
        tool: "shell".into(),
        call_id: "call_0".into(),
        arguments: json!({}),
        args_digest: Digest::of(&json!({})),
        risk: Risk::High,
        basis: "policy".into(),
        expires_at: Timestamp::now(),
        plan_version: 1,
        target_version: None,
        limits: crate::tools::RunLimits::default(),
        reversibility: None,
    })
}

fn timer(timer_id: TimerId, purpose: TimerPurpose) -> Event {
    Event::TimerScheduled(TimerScheduled {
        timer_id,
        fire_at: Timestamp::now(),
        purpose,
    })
}

/// A running run whose operation waits on everything that may give it its result: a question,
/// an approval, a timer, a callback, each expiry; and a callback that came before it was
/// expected.
fn linked() -> RunState {
    let journal = [
        env(
            Event::RunCreated(Box::new(crate::fixtures::run_created("demo", "go"))),
            None,
        ),
        env(Event::RunStarted(RunStarted {}), None),
        env(approval_requested(approval()), Some(op())),
        env(
            Event::QuestionAsked(QuestionAsked {
                question_id: question(),
                prompt: "which one?".into(),
            }),
            Some(op()),
        ),
        env(timer(wait_timer(), TimerPurpose::Wait { op: op() }), None),
        env(
            timer(
                question_timer(),
                TimerPurpose::QuestionTimeout {
                    question_id: question(),
                },
            ),
            None,
        ),
        env(
            Event::CallbackExpected(CallbackExpected {
                key: callback(),
                expires_at: None,
            }),
            Some(op()),
        ),
        env(
            timer(
                callback_timer(),
                TimerPurpose::CallbackExpiry { key: callback() },
            ),
            None,
        ),
        env(
            Event::CallbackReceived(CallbackReceived {
                key: early_callback(),
                payload: json!("early"),
            }),
            None,
        ),
    ];
    fold((1..).zip(journal.iter())).expect("the journal folds")
}

/// The state of [`linked`] with its operation in `phase`.
fn in_phase(phase: OpPhase) -> RunState {
    let mut state = linked();
    let (status, result) = match phase {
        OpPhase::Absent => {
            state.ops.remove(&op());
            return state;
        }
        OpPhase::AwaitingApproval => (OpStatus::AwaitingApproval, None),
        OpPhase::Requested => (OpStatus::Requested, None),
        OpPhase::Started => (
            OpStatus::Started {
                runner: "runner-1".into(),
            },
            None,
        ),
        OpPhase::ToRetry => (OpStatus::ToRetry, None),
        OpPhase::Ambiguous => (
            OpStatus::Ambiguous {
                detail: "the runner died".into(),
            },
            None,
        ),
        OpPhase::Done => (
            OpStatus::Done,
            Some(OpResult {
                content: "the first result".into(),
                is_error: false,
                stopped: false,
                seq: 9,
            }),
        ),
    };
    let tool = state
        .ops
        .get_mut(&op())
        .expect("approval.requested made it");
    tool.status = status;
    tool.result = result;
    tool.dispatches = 1;
    // So that an event that only makes the approval fresh is seen to apply.
    tool.target_moved = Some(TargetMoved {
        expected: "v1".into(),
        found: "v2".into(),
    });
    state
}

fn tool_requested() -> Event {
    Event::ToolRequested(ToolRequested {
        call_id: "call_0".into(),
        tool: "shell".into(),
        arguments: json!({}),
        args_digest: Digest::of(&json!({})),
        redispatch: 0,
        expect_version: None,
        limits: crate::tools::RunLimits::default(),
        reversibility: None,
        compensates: None,
    })
}

/// The first attempt of the first dispatch failed.
fn tool_attempt() -> Event {
    Event::ToolAttempt(ToolAttempt {
        attempt: 1,
        dispatch: 0,
        class: crate::tools::ToolErrorClass::Transient,
        error: "connection refused".into(),
        delay_ms: 100,
        retry_at: Timestamp::now(),
    })
}

/// The journaled event that acts on the operation as `event`, with the operation it names.
fn journaled(event: OpEvent) -> (Event, Option<OperationId>) {
    let named = Some(op());
    let resolved = |resolution| {
        Event::OutcomeResolved(OutcomeResolved {
            resolution,
            by: "pat".into(),
        })
    };
    let fired = |timer_id| Event::TimerFired(TimerFired { timer_id });
    match event {
        OpEvent::ToolRequested => (tool_requested(), named),
        OpEvent::ApprovalRequested => (
            approval_requested(ApprovalId::for_operation(&op(), 2)),
            named,
        ),
        OpEvent::ToolStarted => (
            Event::ToolStarted(ToolStarted {
                runner: "runner-2".into(),
                attempt: 1,
            }),
            named,
        ),
        OpEvent::ToolAttempt => (tool_attempt(), named),
        OpEvent::ToolResult => (
            Event::ToolResult(ToolResult {
                content: "done".into(),
                is_error: false,
                stopped: false,
            }),
            named,
        ),
        OpEvent::OutcomeConfirmed => (
            Event::OutcomeConfirmed(OutcomeConfirmed {
                content: "it happened".into(),
            }),
            named,
        ),
        OpEvent::OutcomeNotFound => (Event::OutcomeNotFound(OutcomeNotFound {}), named),
        OpEvent::OutcomeAmbiguous => (
            Event::OutcomeAmbiguous(OutcomeAmbiguous {
                detail: "no status query".into(),
            }),
            named,
        ),
        OpEvent::ResolvedRetry => (resolved(Resolution::Retry), named),
        OpEvent::ResolvedCompleted => (
            resolved(Resolution::Completed {
                content: "it happened".into(),
            }),
            named,
        ),
        OpEvent::ResolvedFailed => (
            resolved(Resolution::Failed {
                reason: "it did not".into(),
            }),
            named,
        ),
        OpEvent::TargetMoved => (
            Event::TargetMoved(TargetMoved {
                expected: "v2".into(),
                found: "v3".into(),
            }),
            named,
        ),
        OpEvent::QuestionAnswered => (
            Event::QuestionAnswered(QuestionAnswered {
                question_id: question(),
                answer: "the left one".into(),
            }),
            None,
        ),
        OpEvent::QuestionTimedOut => (fired(question_timer()), None),
        OpEvent::ApprovalDenied => (
            Event::ApprovalDecided(ApprovalDecided {
                approval_id: approval(),
                verdict: Verdict::Deny,
                args_digest: Digest::of(&json!({})),
                approver: "pat".into(),
                comment: None,
            }),
            None,
        ),
        OpEvent::ApprovalExpired => (
            Event::ApprovalExpired(ApprovalExpired {
                approval_id: approval(),
            }),
            None,
        ),
        OpEvent::WaitFired => (fired(wait_timer()), None),
        OpEvent::CallbackReceived => (
            Event::CallbackReceived(CallbackReceived {
                key: callback(),
                payload: json!("called back"),
            }),
            None,
        ),
        OpEvent::CallbackMatched => (
            Event::CallbackExpected(CallbackExpected {
                key: early_callback(),
                expires_at: None,
            }),
            named,
        ),
        OpEvent::CallbackExpired => (fired(callback_timer()), None),
    }
}

/// Whether the event acts on the operation alone, so that the fold counts it as ignored
/// exactly when the operation ignores it. The others act on the run too (a question, an
/// approval, a timer, a callback, or a decision): they apply to the operation when they change
/// it.
fn acts_on_the_operation_alone(event: OpEvent) -> bool {
    match event {
        OpEvent::ToolStarted
        | OpEvent::ToolAttempt
        | OpEvent::ToolResult
        | OpEvent::OutcomeConfirmed
        | OpEvent::OutcomeNotFound
        | OpEvent::OutcomeAmbiguous
        | OpEvent::ResolvedRetry
        | OpEvent::ResolvedCompleted
        | OpEvent::ResolvedFailed
        | OpEvent::TargetMoved => true,
        OpEvent::ToolRequested
        | OpEvent::ApprovalRequested
        | OpEvent::QuestionAnswered
        | OpEvent::QuestionTimedOut
        | OpEvent::ApprovalDenied
        | OpEvent::ApprovalExpired
        | OpEvent::WaitFired
        | OpEvent::CallbackReceived
        | OpEvent::CallbackMatched
        | OpEvent::CallbackExpired => false,
    }
}

/// What an event did to the operation, as the tests see it.
#[derive(Debug, PartialEq, Eq)]
enum Seen {
    To(OpPhase),
    /// The fold does not say why.
    Ignored,
    Rejected(String),
}

impl From<OpTarget> for Seen {
    fn from(target: OpTarget) -> Seen {
        match target {
            To(phase) => Seen::To(phase),
            Ignored(_) => Seen::Ignored,
            Rejected(why) => Seen::Rejected(why.to_owned()),
        }
    }
}

/// What the fold does with `event` on an operation in `phase`.
fn folded(phase: OpPhase, event: OpEvent) -> Result<Seen, String> {
    let mut state = in_phase(phase);
    let before = state.ops.get(&op()).cloned();
    let ignored_before = state.ignored_inputs;
    let (journaled, named) = journaled(event);
    if journaled.event_type() != event.event_type() {
        return Err(format!("journaled as `{}`", journaled.event_type()));
    }
    match state.apply(100, &env(journaled, named)) {
        Err(FoldError::Inconsistent { why, .. }) => return Ok(Seen::Rejected(why)),
        Err(other) => return Err(format!("the fold failed: {other}")),
        Ok(()) => {}
    }
    let after = state.ops.get(&op());
    let changed = after != before.as_ref();
    let applied = if acts_on_the_operation_alone(event) {
        state.ignored_inputs == ignored_before
    } else {
        changed
    };
    match (applied, changed) {
        (true, _) => Ok(Seen::To(OpPhase::of(after))),
        (false, false) => Ok(Seen::Ignored),
        (false, true) => Err("counted as ignored, yet the operation changed".into()),
    }
}

#[test]
fn every_op_event_has_exactly_one_row() {
    for event in OpEvent::ALL {
        let rows = TRANSITIONS.iter().filter(|t| t.event == *event).count();
        assert_eq!(rows, 1, "{event:?}");
    }
    assert_eq!(TRANSITIONS.len(), OpEvent::ALL.len());
}

#[test]
fn the_fold_moves_operations_as_the_table_says() {
    let mut disagreements = Vec::new();
    let mut pairs = 0;
    for event in OpEvent::ALL {
        for phase in OpPhase::ALL {
            pairs += 1;
            let declared = target(*phase, *event).expect("every event has a row");
            match folded(*phase, *event) {
                Ok(seen) if seen == Seen::from(declared) => {}
                Ok(seen) => disagreements.push(format!(
                    "{event:?} on {phase}: the table says {declared:?}, the fold does {seen:?}"
                )),
                Err(why) => disagreements.push(format!("{event:?} on {phase}: {why}")),
            }
        }
    }
    assert_eq!(pairs, OpPhase::ALL.len() * OpEvent::ALL.len());
    assert!(
        disagreements.is_empty(),
        "the fold and the operation lifecycle table disagree:\n{}",
        disagreements.join("\n")
    );
}

#[test]
fn an_operation_with_its_result_keeps_it() {
    for row in TRANSITIONS {
        match row.done {
            To(Done) | Ignored(_) | Rejected(_) => {}
            To(other) => panic!("{:?} takes a done operation to {other}", row.event),
        }
    }
}

#[test]
fn only_a_request_makes_an_operation() {
    for row in TRANSITIONS {
        let makes = matches!(row.absent, To(_));
        let request = matches!(
            row.event,
            OpEvent::ToolRequested | OpEvent::ApprovalRequested
        );
        assert_eq!(makes, request, "{:?}", row.event);
        assert_ne!(row.absent, To(OpPhase::Absent), "{:?}", row.event);
    }
}

#[test]
fn every_phase_but_done_reaches_done() {
    for start in OpPhase::ALL.iter().filter(|p| **p != OpPhase::Absent) {
        let mut seen = vec![*start];
        let mut i = 0;
        while let Some(phase) = seen.get(i).copied() {
            i += 1;
            for row in TRANSITIONS {
                if let To(next) = row.from(phase)
                    && !seen.contains(&next)
                {
                    seen.push(next);
                }
            }
        }
        assert!(seen.contains(&Done), "{start} cannot reach done");
    }
}
