//! A step's decision group and what it makes the run wait on, and the version gates a run
//! marks.
//!
//! A group starts at `step.completed` and ends at the decision that settles the run's status; a
//! group that counts its decisions (`step.completed.follows`) settles it by itself once they all
//! landed (docs/STATE_MACHINE.md).

use crate::event::{Decision, DecisionRef, Draft, Gate, TimerPurpose, WaitReason};
use crate::ids::{Attempt, ModelRequestId, StepNo};

use super::run::RunState;

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
pub fn waits_on(decision: DecisionRef<'_>) -> Option<WaitReason> {
    match decision {
        DecisionRef::ApprovalRequested(_) => Some(WaitReason::Approval),
        DecisionRef::QuestionAsked(_) => Some(WaitReason::User),
        DecisionRef::CallbackExpected(_) => Some(WaitReason::External),
        DecisionRef::TimerScheduled(t) => match t.purpose {
            TimerPurpose::Wait { .. } | TimerPurpose::CallbackExpiry { .. } => {
                Some(WaitReason::External)
            }
            TimerPurpose::RunDeadline
            | TimerPurpose::ApprovalExpiry { .. }
            | TimerPurpose::QuestionTimeout { .. }
            | TimerPurpose::ProviderWait { .. } => None,
        },
        DecisionRef::RunCreated(_)
        | DecisionRef::RunStarted(_)
        | DecisionRef::RunQueued(_)
        | DecisionRef::StepStarted(_)
        | DecisionRef::ModelAttempt(_)
        | DecisionRef::StepCompleted(_)
        | DecisionRef::ToolRequested(_)
        | DecisionRef::ChildStarted(_)
        | DecisionRef::ApprovalInvalidated(_)
        | DecisionRef::ApprovalExpired(_)
        | DecisionRef::OutputRejected(_)
        | DecisionRef::RunWaiting(_)
        | DecisionRef::RunCancelling(_)
        | DecisionRef::RunUnknown(_)
        | DecisionRef::RunResumed(_)
        | DecisionRef::RunRevived(_)
        | DecisionRef::RunSucceeded(_)
        | DecisionRef::RunFailed(_)
        | DecisionRef::RunCancelled(_)
        | DecisionRef::RunGated(_)
        | DecisionRef::RunCompensating(_)
        | DecisionRef::ProviderWaiting(_)
        | DecisionRef::ContextCompacted(_) => None,
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
pub fn group_waits_on<'a>(decisions: impl IntoIterator<Item = DecisionRef<'a>>) -> WaitReason {
    decisions
        .into_iter()
        .filter_map(waits_on)
        .fold(WaitReason::Tool, stronger)
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
    pub fn settles_with(&self, rest: &[Draft<Decision>]) -> Option<WaitReason> {
        self.follows?;
        Some(
            rest.iter()
                .filter_map(|d| waits_on(d.event.borrowed()))
                .fold(self.on, stronger),
        )
    }
}

impl RunState {
    /// What the run waits on once `drafts` (a decision group, or the rest of the one cut short)
    /// land, when they end a step group that journals no `run.waiting` (gate
    /// `wait_from_step_group`): the status the fold then derives. `None` otherwise (the group's
    /// own decisions say it, or it does not end there). For status counters.
    pub fn settled_by(&self, drafts: &[Draft<Decision>]) -> Option<WaitReason> {
        match drafts.first().map(|d| &d.event) {
            Some(Decision::StepCompleted(done)) => {
                let follows = usize::try_from(done.follows?).ok()?;
                (drafts.len() == follows + 1)
                    .then(|| group_waits_on(drafts[1..].iter().map(|d| d.event.borrowed())))
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

    /// Follows a step's decision group: it starts at `step.completed` and ends at the decision
    /// that settles the run's status (`run.waiting`, a terminal or cancelling decision), or,
    /// when `step.completed` counts its group (`follows`), once that many decisions landed:
    /// then what the run waits on, derived from the group, is returned.
    pub(super) fn track_group(&mut self, decision: DecisionRef<'_>) -> Option<WaitReason> {
        match decision {
            DecisionRef::StepCompleted(done) => {
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
            DecisionRef::RunWaiting(_)
            | DecisionRef::OutputRejected(_)
            | DecisionRef::RunSucceeded(_)
            | DecisionRef::RunFailed(_)
            | DecisionRef::RunCancelling(_)
            | DecisionRef::RunCancelled(_)
            | DecisionRef::RunCompensating(_)
            | DecisionRef::RunUnknown(_) => {
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
}
