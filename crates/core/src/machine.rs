//! The run state machine: one declared transition table.
//!
//! Only **decisions** change a run's status; inputs never do (they are appended by anyone and are
//! acted on by the next decision). Every decision type has exactly one row in [`TRANSITIONS`]
//! naming the statuses it may be applied in and the status it leads to. There is no code path that
//! sets a status unconditionally: [`apply`] is the only function that computes a new status, and it
//! refuses anything the table does not list.
//!
//! Invariants, each tested below:
//! - terminal statuses (`succeeded`, `failed`, `cancelled`) are never overwritten, except that a
//!   `succeeded` or `failed` run may be revived by `run.revived` (a new user message starts a new
//!   turn); `cancelled` is final;
//! - every non-terminal status can reach a terminal one;
//! - every row is exercised.

use serde::{Deserialize, Serialize};

use crate::event::{EventKind, EventType, WaitReason};

/// A run's lifecycle status.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Hash,
    PartialOrd,
    Ord,
    Serialize,
    Deserialize,
    schemars::JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum RunStatus {
    Queued,
    Running,
    WaitingTool,
    WaitingUser,
    WaitingApproval,
    WaitingExternal,
    /// The step's model call met provider trouble (an outage, a rate limit): the run waits,
    /// holding nothing, until the fleet releases it (`provider.released`) or the wait's bound
    /// passes (docs/ARCHITECTURE.md, "Provider trouble").
    WaitingProvider,
    Cancelling,
    /// The run is ending (cancelled or failed) and its agent compensates: the compensations of
    /// its effects run one at a time, newest first; then `run.cancelled` or `run.failed`.
    Compensating,
    /// An operation's outcome is ambiguous; a person must decide.
    Unknown,
    Succeeded,
    Failed,
    Cancelled,
}

impl RunStatus {
    pub const ALL: &'static [RunStatus] = &[
        RunStatus::Queued,
        RunStatus::Running,
        RunStatus::WaitingTool,
        RunStatus::WaitingUser,
        RunStatus::WaitingApproval,
        RunStatus::WaitingExternal,
        RunStatus::WaitingProvider,
        RunStatus::Cancelling,
        RunStatus::Compensating,
        RunStatus::Unknown,
        RunStatus::Succeeded,
        RunStatus::Failed,
        RunStatus::Cancelled,
    ];

    pub fn is_terminal(self) -> bool {
        match self {
            RunStatus::Succeeded | RunStatus::Failed | RunStatus::Cancelled => true,
            RunStatus::Queued
            | RunStatus::Running
            | RunStatus::WaitingTool
            | RunStatus::WaitingUser
            | RunStatus::WaitingApproval
            | RunStatus::WaitingExternal
            | RunStatus::WaitingProvider
            | RunStatus::Cancelling
            | RunStatus::Compensating
            | RunStatus::Unknown => false,
        }
    }

    /// Whether a run in this status is busy: running, or waiting on its tools (which answer in
    /// a moment, its lease kept), so a newer state follows soon anyway. Every other status (a
    /// run waiting on a person, a timer, a slot, its provider, or ended) may stay as it is for
    /// long: what lists runs writes such a state as soon as it is folded, a busy one at most
    /// once per interval (docs/ARCHITECTURE.md "The bridge and the runs projection").
    pub fn is_busy(self) -> bool {
        match self {
            RunStatus::Running | RunStatus::WaitingTool => true,
            RunStatus::Queued
            | RunStatus::WaitingUser
            | RunStatus::WaitingApproval
            | RunStatus::WaitingExternal
            | RunStatus::WaitingProvider
            | RunStatus::Cancelling
            | RunStatus::Compensating
            | RunStatus::Unknown
            | RunStatus::Succeeded
            | RunStatus::Failed
            | RunStatus::Cancelled => false,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            RunStatus::Queued => "queued",
            RunStatus::Running => "running",
            RunStatus::WaitingTool => "waiting_tool",
            RunStatus::WaitingUser => "waiting_user",
            RunStatus::WaitingApproval => "waiting_approval",
            RunStatus::WaitingExternal => "waiting_external",
            RunStatus::WaitingProvider => "waiting_provider",
            RunStatus::Cancelling => "cancelling",
            RunStatus::Compensating => "compensating",
            RunStatus::Unknown => "unknown",
            RunStatus::Succeeded => "succeeded",
            RunStatus::Failed => "failed",
            RunStatus::Cancelled => "cancelled",
        }
    }

    fn waiting(reason: WaitReason) -> RunStatus {
        match reason {
            WaitReason::Tool => RunStatus::WaitingTool,
            WaitReason::User => RunStatus::WaitingUser,
            WaitReason::Approval => RunStatus::WaitingApproval,
            WaitReason::External => RunStatus::WaitingExternal,
        }
    }
}

impl std::fmt::Display for RunStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// What applying a decision does to the status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// The status stays as it was (bookkeeping decisions such as `tool.requested`).
    Stay,
    /// The status becomes this one.
    To(RunStatus),
    /// `run.waiting`: the status becomes the waiting status its data names. The fold also
    /// applies this row when a step group that journals no `run.waiting` (it counts its
    /// decisions, `step.completed.follows`) ends, with the reason derived from the group.
    Wait,
}

/// One row of the table.
#[derive(Debug, Clone, Copy)]
pub struct Transition {
    pub event: EventType,
    /// Statuses the decision may be applied in. Empty only for `run.created`, which is applied to
    /// a run that does not exist yet.
    pub from: &'static [RunStatus],
    pub to: Target,
}

use RunStatus::{
    Cancelled as X, Cancelling as C, Compensating as K, Failed as F, Queued as Q, Running as R,
    Succeeded as S, Unknown as U, WaitingApproval as WA, WaitingExternal as WE,
    WaitingProvider as WP, WaitingTool as WT, WaitingUser as WU,
};

const WAITING_OR_RUNNING: &[RunStatus] = &[R, WT, WU, WA, WE];
const LIVE: &[RunStatus] = &[Q, R, WT, WU, WA, WE, WP, U];

/// The transition table. One row per decision type; inputs have no rows (they never change
/// status).
pub const TRANSITIONS: &[Transition] = &[
    Transition {
        event: EventType::RunCreated,
        from: &[],
        to: Target::To(Q),
    },
    Transition {
        event: EventType::RunStarted,
        from: &[Q],
        to: Target::To(R),
    },
    // A step starts when the run is running (a new attempt) or was waiting and is woken (a
    // run waiting on its provider: released by the fleet).
    Transition {
        event: EventType::StepStarted,
        from: &[R, WT, WU, WA, WE, WP],
        to: Target::To(R),
    },
    Transition {
        event: EventType::ModelAttempt,
        from: &[R],
        to: Target::Stay,
    },
    Transition {
        event: EventType::StepCompleted,
        from: &[R],
        to: Target::Stay,
    },
    // Also while waiting: an operation found not to have happened is dispatched again; and
    // while compensating: the compensations.
    Transition {
        event: EventType::ToolRequested,
        from: &[R, WT, WU, WA, WE, K],
        to: Target::Stay,
    },
    Transition {
        event: EventType::QuestionAsked,
        from: &[R],
        to: Target::Stay,
    },
    // The link to a child run, journaled with its `run_agent` operation's request.
    Transition {
        event: EventType::ChildStarted,
        from: &[R],
        to: Target::Stay,
    },
    Transition {
        event: EventType::ApprovalRequested,
        from: WAITING_OR_RUNNING,
        to: Target::Stay,
    },
    Transition {
        event: EventType::ApprovalInvalidated,
        from: WAITING_OR_RUNNING,
        to: Target::Stay,
    },
    Transition {
        event: EventType::ApprovalExpired,
        from: &[R, WT, WU, WA, WE, C],
        to: Target::Stay,
    },
    Transition {
        event: EventType::TimerScheduled,
        from: WAITING_OR_RUNNING,
        to: Target::Stay,
    },
    Transition {
        event: EventType::CallbackExpected,
        from: &[R],
        to: Target::Stay,
    },
    // An invalid final answer sent back for a retry: the run goes on with its next step.
    Transition {
        event: EventType::OutputRejected,
        from: &[R],
        to: Target::Stay,
    },
    Transition {
        event: EventType::RunWaiting,
        from: WAITING_OR_RUNNING,
        to: Target::Wait,
    },
    Transition {
        event: EventType::RunCancelling,
        from: LIVE,
        to: Target::To(C),
    },
    Transition {
        event: EventType::RunUnknown,
        from: &[R, WT, WU, WA, WE, WP, C],
        to: Target::To(U),
    },
    Transition {
        event: EventType::RunResumed,
        from: &[U],
        to: Target::To(R),
    },
    // The documented way out of a terminal status: a new user message starts a new turn.
    Transition {
        event: EventType::RunRevived,
        from: &[S, F],
        to: Target::To(R),
    },
    Transition {
        event: EventType::RunSucceeded,
        from: &[R],
        to: Target::To(S),
    },
    // Also from `compensating`: a failed run whose agent compensates ends once its
    // compensations are settled.
    Transition {
        event: EventType::RunFailed,
        from: &[Q, R, WT, WU, WA, WE, WP, U, K],
        to: Target::To(F),
    },
    // `unknown` reaches `cancelled` when a person resolves the last ambiguous operation of a
    // cancelling run; `compensating` once a cancelled run's compensations are settled.
    Transition {
        event: EventType::RunCancelled,
        from: &[C, U, K],
        to: Target::To(X),
    },
    // A run that ends (cancel, failure) with effects its agent compensates.
    Transition {
        event: EventType::RunCompensating,
        from: &[Q, R, WT, WU, WA, WE, WP, C, U],
        to: Target::To(K),
    },
    // A version gate's marker: bookkeeping, journaled in a decision group of a live run (right
    // after the group's first decision, which has left any terminal status).
    Transition {
        event: EventType::RunGated,
        from: &[Q, R, WT, WU, WA, WE, WP, C, K, U],
        to: Target::Stay,
    },
    // A model call met provider trouble (or was held by the fleet's breaker): the run waits on
    // the provider; a release or the wait's bound starts the next step's attempt, or ends it.
    Transition {
        event: EventType::ProviderWaiting,
        from: &[R],
        to: Target::To(WP),
    },
    // Bookkeeping before a step (or after an attempt the provider refused as too long): what
    // the model reads of the conversation from now on.
    Transition {
        event: EventType::ContextCompacted,
        from: &[R, WT, WU, WA, WE, WP],
        to: Target::Stay,
    },
    // The run's concurrency key is at its limit (docs/ARCHITECTURE.md "Concurrency keys and
    // priorities"): a queued run waits to start, a finished one with a message waits to be
    // revived; bookkeeping, the status stays.
    Transition {
        event: EventType::RunQueued,
        from: &[Q, S, F],
        to: Target::Stay,
    },
];

/// The row for a decision type; `None` for inputs.
pub fn transition(event: EventType) -> Option<&'static Transition> {
    TRANSITIONS.iter().find(|t| t.event == event)
}

/// A decision the table does not allow.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransitionError {
    #[error("`{event}` is not allowed in status `{from}`")]
    NotAllowed { event: EventType, from: RunStatus },
    #[error("`{event}` is not allowed before the run exists (`run.created` must come first)")]
    NoRun { event: EventType },
    #[error("`run.created` for a run that already exists (status `{from}`)")]
    AlreadyCreated { from: RunStatus },
    #[error("`{event}` is an input; inputs do not change a run's status")]
    NotADecision { event: EventType },
    #[error("`run.waiting` without a wait reason")]
    MissingWaitReason,
}

/// Applies a decision to a status. `current` is `None` before `run.created`. `wait` is the reason
/// carried by `run.waiting` (ignored for other types).
pub fn apply(
    current: Option<RunStatus>,
    event: EventType,
    wait: Option<WaitReason>,
) -> Result<RunStatus, TransitionError> {
    if event.kind() == EventKind::Input {
        return Err(TransitionError::NotADecision { event });
    }
    let row = transition(event).ok_or(TransitionError::NotADecision { event })?;
    let from = match (current, row.from.is_empty()) {
        (None, true) => return target(row, None, wait),
        (Some(from), true) => return Err(TransitionError::AlreadyCreated { from }),
        (None, false) => return Err(TransitionError::NoRun { event }),
        (Some(from), false) => from,
    };
    if !row.from.contains(&from) {
        return Err(TransitionError::NotAllowed { event, from });
    }
    target(row, Some(from), wait)
}

fn target(
    row: &Transition,
    from: Option<RunStatus>,
    wait: Option<WaitReason>,
) -> Result<RunStatus, TransitionError> {
    match row.to {
        Target::To(s) => Ok(s),
        // `Stay` rows always have a from-set, so `from` is known.
        Target::Stay => from.ok_or(TransitionError::NoRun { event: row.event }),
        Target::Wait => wait
            .map(RunStatus::waiting)
            .ok_or(TransitionError::MissingWaitReason),
    }
}

/// Every status a row can lead to from `from` (several for `run.waiting`).
pub fn successors(from: RunStatus) -> Vec<(EventType, RunStatus)> {
    let mut out = Vec::new();
    for row in TRANSITIONS.iter().filter(|r| r.from.contains(&from)) {
        match row.to {
            Target::Stay => out.push((row.event, from)),
            Target::To(s) => out.push((row.event, s)),
            Target::Wait => {
                for reason in [
                    WaitReason::Tool,
                    WaitReason::User,
                    WaitReason::Approval,
                    WaitReason::External,
                ] {
                    out.push((row.event, RunStatus::waiting(reason)));
                }
            }
        }
    }
    out
}

/// The table as a Mermaid state diagram (docs/STATE_MACHINE.md is checked against this).
pub fn mermaid() -> String {
    let mut out = String::from("stateDiagram-v2\n    [*] --> queued: run.created\n");
    for from in RunStatus::ALL {
        for (event, to) in successors(*from) {
            if to != *from {
                out.push_str(&format!("    {from} --> {to}: {event}\n"));
            }
        }
    }
    for s in RunStatus::ALL.iter().filter(|s| s.is_terminal()) {
        out.push_str(&format!("    {s} --> [*]\n"));
    }
    out
}

#[cfg(test)]
mod tests {
    use std::collections::{BTreeSet, VecDeque};

    use super::*;

    #[test]
    fn every_decision_has_exactly_one_row_and_inputs_have_none() {
        for t in EventType::ALL {
            let rows = TRANSITIONS.iter().filter(|r| r.event == *t).count();
            match t.kind() {
                EventKind::Decision => assert_eq!(rows, 1, "{t}"),
                EventKind::Input => assert_eq!(rows, 0, "{t}"),
            }
        }
    }

    #[test]
    fn every_row_is_exercised_from_each_allowed_status() {
        let mut exercised = 0;
        for row in TRANSITIONS {
            if row.from.is_empty() {
                assert_eq!(apply(None, row.event, None), Ok(RunStatus::Queued));
                exercised += 1;
                continue;
            }
            for from in row.from {
                let wait = Some(WaitReason::User);
                let got = apply(Some(*from), row.event, wait).expect("allowed row applies");
                let expected = match row.to {
                    Target::Stay => *from,
                    Target::To(s) => s,
                    Target::Wait => RunStatus::WaitingUser,
                };
                assert_eq!(got, expected, "{} from {from}", row.event);
                exercised += 1;
            }
        }
        assert!(exercised > TRANSITIONS.len());
    }

    #[test]
    fn statuses_outside_a_rows_from_set_are_refused() {
        for row in TRANSITIONS.iter().filter(|r| !r.from.is_empty()) {
            for from in RunStatus::ALL.iter().filter(|s| !row.from.contains(s)) {
                assert_eq!(
                    apply(Some(*from), row.event, Some(WaitReason::Tool)),
                    Err(TransitionError::NotAllowed {
                        event: row.event,
                        from: *from
                    }),
                    "{} from {from}",
                    row.event
                );
            }
            assert_eq!(
                apply(None, row.event, None),
                Err(TransitionError::NoRun { event: row.event })
            );
        }
        assert!(matches!(
            apply(Some(RunStatus::Running), EventType::RunCreated, None),
            Err(TransitionError::AlreadyCreated { .. })
        ));
    }

    #[test]
    fn a_busy_status_is_never_terminal_nor_waiting_on_anything_slow() {
        for &status in RunStatus::ALL {
            let busy = matches!(status, RunStatus::Running | RunStatus::WaitingTool);
            assert_eq!(status.is_busy(), busy, "{status}");
            assert!(!(status.is_busy() && status.is_terminal()), "{status}");
        }
    }

    #[test]
    fn terminal_statuses_are_never_left_except_by_revive() {
        for terminal in RunStatus::ALL.iter().filter(|s| s.is_terminal()) {
            // `run.queued` is bookkeeping there (a message waits for a slot): it stays.
            for (event, to) in successors(*terminal)
                .into_iter()
                .filter(|(_, to)| to != terminal)
            {
                assert_eq!(event, EventType::RunRevived, "{terminal} left by {event}");
                assert_eq!(to, RunStatus::Running);
                assert_ne!(*terminal, RunStatus::Cancelled, "cancelled is final");
            }
        }
        assert!(successors(RunStatus::Cancelled).is_empty());
        assert_eq!(
            apply(Some(RunStatus::Succeeded), EventType::RunQueued, None),
            Ok(RunStatus::Succeeded)
        );
        assert!(apply(Some(RunStatus::Cancelled), EventType::RunQueued, None).is_err());
        assert!(apply(Some(RunStatus::Running), EventType::RunQueued, None).is_err());
        assert_eq!(
            apply(Some(RunStatus::Succeeded), EventType::RunRevived, None),
            Ok(RunStatus::Running)
        );
        assert_eq!(
            apply(Some(RunStatus::Failed), EventType::RunRevived, None),
            Ok(RunStatus::Running)
        );
    }

    #[test]
    fn every_non_terminal_status_reaches_a_terminal_one() {
        for start in RunStatus::ALL.iter().filter(|s| !s.is_terminal()) {
            let mut seen = BTreeSet::from([*start]);
            let mut queue = VecDeque::from([*start]);
            let mut reached = false;
            while let Some(s) = queue.pop_front() {
                if s.is_terminal() {
                    reached = true;
                    break;
                }
                for (_, next) in successors(s) {
                    if seen.insert(next) {
                        queue.push_back(next);
                    }
                }
            }
            assert!(reached, "{start} cannot reach a terminal status");
        }
    }

    #[test]
    fn cancel_is_reachable_from_every_non_terminal_status() {
        // Seed 004, 8.3: a predicate that made cancel unreachable while running.
        for start in RunStatus::ALL.iter().filter(|s| !s.is_terminal()) {
            let via_cancelling = apply(Some(*start), EventType::RunCancelling, None)
                .and_then(|c| apply(Some(c), EventType::RunCancelled, None));
            let direct = apply(Some(*start), EventType::RunCancelled, None);
            assert!(
                via_cancelling == Ok(RunStatus::Cancelled) || direct == Ok(RunStatus::Cancelled),
                "{start}"
            );
        }
    }

    #[test]
    fn inputs_are_not_transitions() {
        assert_eq!(
            apply(Some(RunStatus::Running), EventType::UserMessage, None),
            Err(TransitionError::NotADecision {
                event: EventType::UserMessage
            })
        );
        assert_eq!(
            apply(Some(RunStatus::Running), EventType::RunWaiting, None),
            Err(TransitionError::MissingWaitReason)
        );
    }

    #[test]
    fn the_state_diagram_in_the_docs_matches_the_table() {
        let doc = include_str!("../../../docs/STATE_MACHINE.md");
        let diagram = mermaid();
        assert!(
            doc.contains(&diagram),
            "docs/STATE_MACHINE.md is stale; paste this diagram into it:\n{diagram}"
        );
    }
}
