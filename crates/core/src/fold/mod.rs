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
//!
//! The fold is split by what it follows:
//! - `run`: the run's state ([`RunState`]) and the folding of one event into it;
//! - `decision` and `input`: what each decision and each input does to the run;
//! - `group`: a step's decision group and what it makes the run wait on, and version gates;
//! - `transcript`: the conversation the model reads and its digest;
//! - `operation`: the tool operations ([`ToolOp`]) and how each operation event moves one;
//! - [`lifecycle`]: the operation lifecycle declared as one table, which the fold is tested
//!   against.

mod decision;
mod group;
mod input;
pub mod lifecycle;
mod operation;
mod run;
mod transcript;

pub use group::{Completing, Gates, group_waits_on, stronger, waits_on};
pub use operation::{
    ASK_USER_TOOL, AWAIT_CALLBACK_TOOL, OpResult, OpStatus, ToolOp, WAIT_TOOL, handled_by_step,
};
pub use run::{
    ApprovalState, ApprovalStatus, CallbackState, OpenStep, PendingInput, ProviderWait,
    QuestionState, RunState, TimerState,
};
pub use transcript::{ChatMessage, TranscriptDigest, output_feedback};

use crate::event::{Envelope, EventType};
use crate::ids::RunId;
use crate::machine::TransitionError;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{Draft, Event, EventKind, RunStarted, Timestamp, UserMessage};
    use crate::machine::RunStatus;

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
        assert_eq!((state.last_seq, state.last_decision_seq.get()), (4, 3));
        state.set_aside(5, EventKind::Decision);
        assert_eq!((state.last_seq, state.last_decision_seq.get()), (5, 5));
        assert_eq!(state.set_aside, 3);
        // The run goes on after them.
        let started = env(Event::RunStarted(RunStarted {}));
        state.apply(6, &started).expect("applies");
        assert_eq!(state.last_decision_seq.get(), 6);
        assert_eq!(state.status, RunStatus::Running);
    }
}
