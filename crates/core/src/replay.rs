//! Decision replay: does the code of this build still make the decisions a recorded journal
//! holds?
//!
//! Folding an old journal (what every reader does) only proves the new code can *read* it. A
//! long-lived run is also *continued* by the new code, from wherever it stopped, and the run is
//! only correct if the new code would have decided what the old code decided up to there (else a
//! group cut short by a crash is finished differently from how it began, an operation is
//! dispatched twice or never, a step is numbered again). [`check`] re-runs [`decide`] at every
//! point of the journal where a decision group begins, from the state folded up to that point,
//! and compares what it decides with the decisions actually recorded next, field by field.
//!
//! What the code does not decide is taken from the journal as a fact: the model's response (in
//! `step.completed`) and a failed model call's outcome (`model.attempt`), a compaction of the
//! model's context (`context.compacted`, which may cut a group short), a wait for a slot of the
//! run's concurrency key (`run.queued`, which the key's record decided), inputs of any kind, and
//! the target version a tool runner reported for an approval request. Instants the code computes
//! from the clock (`fire_at`, `expires_at`) are compared with a tolerance ([`CLOCK_SLACK_SECS`]),
//! since the recorded group was decided a moment before its envelopes were stamped.
//!
//! Version gates ([`crate::event::Gate`]): a group is decided taking anew only the gates whose
//! marker (`run.gated`) it carries, right after its first decision (`markers_after`), besides
//! those the run marked before; a journal without markers is decided on every gate's old
//! branch, as the build that wrote it did.
//!
//! The replay fixtures (`crates/core/tests/fixtures`, recorded by earlier builds) are checked
//! with it in `crates/core/tests/agent_loop.rs`; a change to `decide` or `complete_step` that
//! fails them must keep the old branch for runs that took it (docs/ARCHITECTURE.md, "Upgrades:
//! decision replay").

use std::collections::VecDeque;

use serde_json::Value;

use crate::decide::{Next, complete_step_gated, decide, finish_step};
use crate::event::{
    AttemptOutcome, Decision, Draft, Envelope, ErrorClass, Event, EventKind, FailureReason,
    RunFailed, Timestamp,
};
use crate::fold::{FoldError, Gates, RunState, fold};
use crate::tools::Contract;

/// How far an instant the code computes from the clock may be from the recorded one.
pub const CLOCK_SLACK_SECS: i64 = 5;

/// What a replay checked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Checked {
    /// Decision groups whose start was decided again.
    pub groups: usize,
    /// Recorded decisions compared with the ones decided again.
    pub decisions: usize,
}

/// Where the code decides differently from the journal.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum Divergence {
    #[error("the journal does not fold: {0}")]
    Fold(#[from] FoldError),
    #[error("the journal has no run.created")]
    NoRun,
    #[error("at seq {seq}: the journal has `{found}` where the code decides nothing ({why})")]
    Unexpected {
        seq: u64,
        found: String,
        why: String,
    },
    #[error("at seq {seq}: the code decides {expected} where the journal has {found}")]
    Differs {
        seq: u64,
        expected: Value,
        found: Value,
    },
}

/// Checks that `decide` (with the run's tool `contract`) makes every decision of `events` (a
/// run's whole journal in sequence order) that the journal records.
pub fn check(events: &[(u64, Envelope)], contract: &Contract) -> Result<Checked, Divergence> {
    let created = events
        .iter()
        .position(|(_, e)| e.kind() == EventKind::Decision)
        .ok_or(Divergence::NoRun)?;
    let mut state = fold(events[..=created].iter().map(|(s, e)| (*s, e)))?;
    // The state right after the last decision, and the inputs stored since: the writer of the
    // next group decided from the state folded through some prefix of those inputs (it reads
    // the journal in order, but may not yet have read the latest), so each is tried.
    let mut base = state.clone();
    let mut since: Vec<(u64, &Envelope)> = Vec::new();
    let mut expected: VecDeque<Draft<Decision>> = VecDeque::new();
    let mut checked = Checked::default();
    let rest = &events[created + 1..];
    for (i, (seq, env)) in rest.iter().enumerate() {
        if env.kind() == EventKind::Input {
            state.apply(*seq, env)?;
            since.push((*seq, env));
            continue;
        }
        // A compaction of the model's context is the step service's (its estimate of the
        // window, or the provider's refusal of a request as too long): a fact, like a model's
        // answer. It may cut a group short (a revival's, a refused attempt's failure), and
        // what follows it is decided again from the state it leaves. So is a run's wait for a
        // slot of its concurrency key (`run.queued`): the key's record said so, not the journal
        // (docs/ARCHITECTURE.md "Concurrency keys and priorities"); it is a group of its own.
        if let Event::ContextCompacted(_) | Event::RunQueued(_) = &env.event {
            expected.clear();
            state.apply(*seq, env)?;
            base = state.clone();
            since.clear();
            continue;
        }
        if expected.is_empty() {
            let take = markers_after(&rest[i + 1..]);
            expected =
                group_decided(&base, &since, (*seq, env), &rest[i + 1..], contract, take)?.into();
            checked.groups += 1;
        }
        let Some(want) = expected.pop_front() else {
            return Err(Divergence::Unexpected {
                seq: *seq,
                found: env.event_type().to_string(),
                why: "an empty group".into(),
            });
        };
        compare(*seq, want, env)?;
        checked.decisions += 1;
        state.apply(*seq, env)?;
        base = state.clone();
        since.clear();
    }
    Ok(checked)
}

/// The version gates a recorded group takes for the first time: the markers (`run.gated`) right
/// after its first decision (`after` is what follows that decision in the journal), where the
/// writer puts them. A group without them was decided on the old branch of every gate the run
/// had not marked, so the code is asked to decide it so.
fn markers_after(after: &[(u64, Envelope)]) -> Gates {
    let mut take = Gates::NONE;
    for (_, env) in after
        .iter()
        .filter(|(_, e)| e.kind() == EventKind::Decision)
    {
        match &env.event {
            Event::RunGated(g) => take = take.with(g.gate),
            _ => break,
        }
    }
    take
}

/// The group the code decides, where the journal's next decision is `next` at `seq`: from
/// `base` with all of the inputs `since` folded in, or with fewer of them (the writer had not
/// read the latest). The first whose first decision is `next` is taken; none matching is the
/// divergence of the state with all of them.
fn group_decided(
    base: &RunState,
    since: &[(u64, &Envelope)],
    (seq, next): (u64, &Envelope),
    after: &[(u64, Envelope)],
    contract: &Contract,
    take: Gates,
) -> Result<Vec<Draft<Decision>>, Divergence> {
    let mut states = Vec::with_capacity(since.len() + 1);
    let mut state = base.clone();
    states.push(state.clone());
    for (s, env) in since {
        state.apply(*s, env)?;
        states.push(state.clone());
    }
    let mut first_error = None;
    for state in states.iter().rev() {
        match group_at(state, (seq, next), after, contract, take) {
            Ok(group) => match group.first() {
                Some(first) => match compare(seq, first.clone(), next) {
                    Ok(()) => return Ok(group),
                    Err(e) => {
                        first_error.get_or_insert(e);
                    }
                },
                None => {
                    first_error.get_or_insert(Divergence::Unexpected {
                        seq,
                        found: next.event_type().to_string(),
                        why: "an empty group".into(),
                    });
                }
            },
            Err(e) => {
                first_error.get_or_insert(e);
            }
        }
    }
    Err(first_error.unwrap_or(Divergence::NoRun))
}

/// The decision group the code makes at `state`, where the journal's next decision is `next`,
/// taking the gates in `take` for the first time (and those the run marked before).
fn group_at(
    state: &RunState,
    (seq, next): (u64, &Envelope),
    after: &[(u64, Envelope)],
    contract: &Contract,
    take: Gates,
) -> Result<Vec<Draft<Decision>>, Divergence> {
    // A step whose model call is out: its outcome is the model's (a fact), what follows from it
    // is the code's.
    if let Some(open) = &state.open_step
        && next.step == Some(open.step)
    {
        match &next.event {
            Event::StepCompleted(done) if next.attempt == Some(open.attempt) => {
                return Ok(complete_step_gated(
                    state,
                    open.step,
                    open.attempt,
                    done.request_id.clone(),
                    crate::decide::ModelResponse {
                        message: done.message.clone(),
                        usage: done.usage,
                        finish: done.finish,
                    },
                    done.reused,
                    next.at,
                    contract,
                    take,
                ));
            }
            // Provider trouble (or a call held by the fleet's breaker): the wait that follows
            // is the code's, its endpoint, error and bound (`provider_wait`, configuration)
            // are facts of the `provider.waiting` recorded with it.
            Event::ModelAttempt(attempt)
                if next.attempt == Some(open.attempt)
                    && let Some(w) = recorded_wait(after) =>
            {
                let met = crate::decide::TroubleMet {
                    outcome: attempt.outcome.clone(),
                    trouble: w.trouble,
                    endpoint: w.endpoint.clone(),
                    message: w.message.clone(),
                };
                let bound =
                    std::time::Duration::try_from(w.give_up_at.0 - w.since.0).unwrap_or_default();
                return Ok(crate::decide::wait_on_provider(
                    state,
                    &attempt.request_id,
                    met,
                    next.at,
                    bound,
                ));
            }
            Event::ModelAttempt(attempt) if next.attempt == Some(open.attempt) => {
                let mut group = vec![
                    Draft::new(Decision::ModelAttempt(attempt.clone()))
                        .step(open.step)
                        .attempt(open.attempt),
                ];
                if let AttemptOutcome::Error {
                    class: ErrorClass::Fatal,
                    message,
                    ..
                } = &attempt.outcome
                {
                    group.push(Draft::new(Decision::RunFailed(RunFailed {
                        reason: FailureReason::ModelRejected,
                        message: message.clone(),
                        effects: Vec::new(),
                    })));
                }
                return Ok(crate::compensation::intercept(state, group));
            }
            _ => {}
        }
    }
    match decide(state) {
        Next::Commit(drafts) => Ok(drafts),
        Next::Finish(cut) => Ok(finish_step(state, &cut, next.at, contract)),
        Next::Step(plan) => {
            let mut plan = *plan;
            plan.answer_refused(contract);
            // A later attempt may reuse the response an earlier one stored: then the group is
            // that attempt's completion (handled above when its step is the open one).
            Ok(plan.start)
        }
        Next::Idle(why) => Err(Divergence::Unexpected {
            seq,
            found: next.event_type().to_string(),
            why: format!("idle: {why:?}"),
        }),
    }
}

/// The `provider.waiting` of the group a `model.attempt` begins (`after`: what follows the
/// attempt in the journal; the group is the attempt, the wait's bound timer the first time a
/// step waits, and the wait).
fn recorded_wait(after: &[(u64, Envelope)]) -> Option<&crate::event::ProviderWaiting> {
    after
        .iter()
        .filter(|(_, e)| e.kind() == EventKind::Decision)
        .take(2)
        .find_map(|(_, e)| match &e.event {
            Event::ProviderWaiting(w) => Some(w),
            _ => None,
        })
}

/// Compares one decision the code makes with the recorded one.
fn compare(seq: u64, want: Draft<Decision>, found: &Envelope) -> Result<(), Divergence> {
    let mut want = Envelope::new(found.run_id.clone(), found.at, want);
    // What a tool runner reported (an external fact the step asks for before committing).
    if let (Event::ApprovalRequested(w), Event::ApprovalRequested(f)) =
        (&mut want.event, &found.event)
        && w.target_version.is_none()
    {
        w.target_version = f.target_version.clone();
    }
    // Which model an attempt calls (the run's, or a fallback while the run's is unavailable)
    // is the step service's reading of the fleet's breakers: a fact.
    if let (Event::StepStarted(w), Event::StepStarted(f)) = (&mut want.event, &found.event) {
        w.model = f.model.clone();
    }
    // Whether an operation is run inside the drive or by the tool service is where the
    // writer's process runs it (docs/ARCHITECTURE.md "Inline tools"), not a decision.
    want.inline = found.inline;
    let mut expected = comparable(&want);
    let mut recorded = comparable(found);
    align_instants(&mut expected, &mut recorded);
    if expected == recorded {
        Ok(())
    } else {
        Err(Divergence::Differs {
            seq,
            expected,
            found: recorded,
        })
    }
}

/// The envelope as JSON without its stamp and digest (the digest follows the data).
fn comparable(env: &Envelope) -> Value {
    let mut v = serde_json::to_value(env).unwrap_or(Value::Null);
    if let Value::Object(map) = &mut v {
        map.remove("at");
        map.remove("digest");
    }
    v
}

/// Makes instants computed from the clock (`*_at` fields, and a wait's `since`) equal when
/// they are within [`CLOCK_SLACK_SECS`] of each other.
fn align_instants(expected: &mut Value, recorded: &mut Value) {
    match (expected, recorded) {
        (Value::Object(e), Value::Object(r)) => {
            for (key, ev) in e.iter_mut() {
                let Some(rv) = r.get_mut(key) else { continue };
                if (key.ends_with("_at") || key == "since")
                    && let (Some(a), Some(b)) = (instant(ev), instant(rv))
                    && (a.0 - b.0).whole_seconds().abs() <= CLOCK_SLACK_SECS
                {
                    *ev = rv.clone();
                } else {
                    align_instants(ev, rv);
                }
            }
        }
        (Value::Array(e), Value::Array(r)) => {
            for (ev, rv) in e.iter_mut().zip(r.iter_mut()) {
                align_instants(ev, rv);
            }
        }
        _ => {}
    }
}

/// What a replay fixture's `<name>.expect.json` holds: the summary of the state its journal
/// folds into.
pub fn summary(state: &RunState) -> Value {
    serde_json::json!({
        "status": state.status,
        "turn": state.turn,
        "step": state.step,
        "ops": state.ops.len(),
        "usage": state.usage,
        "output": state.output,
        "transcript_len": state.transcript.len(),
        "last_decision_seq": state.last_decision_seq,
    })
}

fn instant(v: &Value) -> Option<Timestamp> {
    serde_json::from_value(v.clone()).ok()
}
