//! The reconciler: the last line of recovery, after redelivery by the consumers and takeover by
//! the failure detector (docs/ARCHITECTURE.md, "Takeover: the failure detector").
//!
//! Every `stall_after / 2` it scans the runs that are not settled and nudges each run that
//! should be progressing and is not: its last event is older than `stall_after`, nobody holds its
//! lease, and `decide` on its folded journal says there is work to do (a step or a commit), not a
//! legitimate wait.
//!
//! **Its work follows the unsettled runs, not history** ([`Reconciler`]). A run whose last event
//! settles it (ended, or waiting on a person, a timer or a callback: not on its tools) has
//! nothing that could make it runnable until a new event lands on it, so once a scan finds it so
//! it is dropped from the set of runs to look at, until an event on it is seen. Each scan first
//! reads which runs the journal touched since the previous one (headers only:
//! [`kedge_journal::Journal::runs_touched_after`]), adds them to the set, then checks the set.
//! A process's first scan lists every run (the subjects `agent.run.*.d.run.created`) once. The nudge is a `nudge` input whose
//! `Nats-Msg-Id` is `nudge:<run>:<last seq>`, so any number of reconciler replicas nudging the
//! same stalled state append one message, and the nudge itself is journaled (the run's history
//! says why it woke). The step service treats it like any other wake.
//!
//! A quiet run that waits on child runs (`run_agent`) is watched until each child gives its
//! result: a child that was never created gets the parent nudged (its drive creates it), a child
//! that ended and did not give its result is nudged itself (its drive gives it).
//!
//! It also finds operations stuck in `running`: dispatched or started longer than
//! `tool_timeout + tool_grace` ago with no outcome (a live runner would have finished or killed
//! its tool by then, so the runner is gone, or the request never reached one). For each it
//! journals a `nudge` saying so (`Nats-Msg-Id resolve:<op>:<dispatch>`: once per stuck dispatch
//! across replicas) and sends the operation's journaled `tool.requested` to the tool services
//! (`kedge.tool.resolve`, a queue group). A tool runner resolves it exactly as a redelivered
//! request: it takes the operation's record over (compare-and-set: one taker wins, a replica's
//! second request finds it held and is answered `busy`) and asks the tool's confirm query:
//! confirmed → `outcome.confirmed`; not found → it runs again under the same operation id;
//! ambiguous → `outcome.ambiguous` and the run waits in `unknown` for a person. The request only
//! names the operation: the runner looks its `tool.requested` up in the journal and refuses
//! (`{"handled":"refused"}`, logged here at warn) what the journal does not hold.
//!
//! What makes a run stall although every message is at-least-once: a wake acked by a worker that
//! then failed before it could act (a bug, a lost lease at the wrong moment), or a state the
//! consumers never see again. A stalled scan is not silent: every scan logs what it checked and
//! nudged, and errors are logged per run, never swallowed. A panic while checking one run is
//! contained to that run (logged at error, the scan goes on).
//!
//! The retention service (`kedge serve retention`) is a crate of its own, `kedge_retention`:
//! it runs with its own credentials, and the reconciler's user may not purge.

pub mod quotas;

use kedge_core::Input;
use kedge_core::InputEnvelope;
use std::collections::BTreeSet;
use std::future::Future;
use std::time::Duration;

use kedge_core::answers::{Handled, ResolveReply};
use kedge_core::decide::{Next, decide};
use kedge_core::event::{Draft, Event, EventType, Nudge, RunWaiting, Timestamp, WaitReason};
use kedge_core::ids::{OperationId, RunId};
use kedge_core::subjects;
use kedge_journal::JournalError;
use kedge_runtime::{Runtime, RuntimeError};

pub mod slots;

/// What one scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    /// Runs checked (a [`Reconciler`]'s runs not settled, and those touched since its last scan).
    pub runs: usize,
    /// Runs found settled: the next scan of the same [`Reconciler`] leaves them out unless an
    /// event lands on them meanwhile.
    pub settled: usize,
    /// Runs whose last event is older than the stall threshold.
    pub quiet: usize,
    pub nudged: Vec<RunId>,
    /// Operations stuck in `running` that a tool runner was asked to resolve.
    pub resolving: Vec<OperationId>,
}

/// Why a run could not be checked.
#[derive(Debug, thiserror::Error)]
pub enum ReconcileError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("broker: {0}")]
    Broker(String),
    #[error("the journal does not fold: {0}")]
    Fold(#[from] kedge_core::FoldError),
}

/// Runs the reconciler until `shutdown` resolves.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let every = (rt.config.timeouts.stall_after() / 2).max(Duration::from_secs(1));
    tracing::info!(worker = %rt.config.worker_id, every_ms = every.as_millis() as u64, "reconciler started");
    tokio::pin!(shutdown);
    // The tenants' unfinished-run counts (docs/ARCHITECTURE.md "Quotas"), on their own clock.
    let repair = tokio::spawn(quotas::repair_loop(rt.clone()));
    let mut reconciler = Reconciler::new(rt);
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(every) => {}
        }
        match reconciler.scan().await {
            Ok(report) => tracing::info!(
                runs = report.runs,
                quiet = report.quiet,
                nudged = report.nudged.len(),
                unsettled = reconciler.unsettled(),
                "reconciler scan"
            ),
            Err(e) => tracing::warn!(error = %e, "reconciler scan failed"),
        }
        match slots::recover(&reconciler.rt).await {
            Ok((0, 0)) => {}
            Ok((freed, woken)) => {
                tracing::info!(freed, woken, "slots of concurrency keys recovered")
            }
            Err(e) => tracing::warn!(error = %e, "slots recovery failed"),
        }
    }
    repair.abort();
    tracing::info!("reconciler stopped");
    Ok(())
}

/// Scans every run once and nudges the stalled ones (a [`Reconciler`]'s first scan).
pub async fn scan_once(rt: &Runtime) -> Result<ScanReport, ReconcileError> {
    Reconciler::new(rt.clone()).scan().await
}

/// Runs checked at once in a scan.
const CONCURRENT_CHECKS: usize = 16;

/// A reconciler's state across scans: the runs it still has to look at.
pub struct Reconciler {
    rt: Runtime,
    /// Runs not found settled by the last check, or touched since.
    unsettled: BTreeSet<RunId>,
    /// The journal sequence through which `unsettled` accounts for what was appended (`None`:
    /// not built yet; the first scan lists every run).
    through: Option<u64>,
}

impl std::fmt::Debug for Reconciler {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Reconciler")
            .field("unsettled", &self.unsettled.len())
            .field("through", &self.through)
            .finish_non_exhaustive()
    }
}

impl Reconciler {
    pub fn new(rt: Runtime) -> Self {
        Self {
            rt,
            unsettled: BTreeSet::new(),
            through: None,
        }
    }

    /// How many runs the next scan will look at, before what the journal gets meanwhile.
    pub fn unsettled(&self) -> usize {
        self.unsettled.len()
    }

    /// One scan: brings the set of runs to look at up to date with the journal, checks each
    /// (nudging the stalled ones), and drops those found settled. [`ScanReport::runs`] counts
    /// the runs checked.
    pub async fn scan(&mut self) -> Result<ScanReport, ReconcileError> {
        match self.through {
            None => {
                // Whatever lands from here on is picked up by the next scan.
                let through = self.rt.journal.stream_last_seq().await?;
                self.unsettled.extend(self.rt.journal.run_ids().await?);
                self.through = Some(through);
            }
            Some(after) => {
                let (touched, through) = self.rt.journal.runs_touched_after(after).await?;
                self.unsettled.extend(touched);
                self.through = Some(through);
            }
        }
        let runs: Vec<RunId> = self.unsettled.iter().cloned().collect();
        let mut report = ScanReport {
            runs: runs.len(),
            ..Default::default()
        };
        let stall_after = self.rt.config.timeouts.stall_after();
        let mut pending = runs.into_iter();
        let mut checks = tokio::task::JoinSet::new();
        loop {
            while checks.len() < CONCURRENT_CHECKS {
                let Some(run) = pending.next() else { break };
                // Each run is checked in its own task, so that a panic while checking one (a
                // bug, a journal nobody foresaw) is logged with its run and the scan goes on.
                let rt = self.rt.clone();
                checks.spawn(async move {
                    let checked = {
                        let run = run.clone();
                        tokio::spawn(async move { check(&rt, &run, stall_after).await }).await
                    };
                    (run, checked)
                });
            }
            let Some(done) = checks.join_next().await else {
                break;
            };
            let Ok((run, checked)) = done else {
                // The outer task only awaits the inner one; it does not panic.
                continue;
            };
            let checked = match checked {
                Ok(checked) => checked,
                Err(e) => {
                    tracing::error!(run_id = %run, error = %e, "checking the run panicked; going on with the scan");
                    continue;
                }
            };
            match checked {
                Ok(Verdict::Active) => {}
                Ok(Verdict::Settled { quiet }) => {
                    report.quiet += usize::from(quiet);
                    report.settled += 1;
                    self.unsettled.remove(&run);
                }
                Ok(Verdict::Quiet) => report.quiet += 1,
                Ok(Verdict::Nudged) => {
                    report.quiet += 1;
                    report.nudged.push(run);
                }
                Ok(Verdict::Resolving(ops)) => {
                    report.quiet += 1;
                    report.resolving.extend(ops);
                }
                Err(e) => tracing::warn!(run_id = %run, error = %e, "cannot check run"),
            }
        }
        report.nudged.sort();
        report.resolving.sort();
        Ok(report)
    }
}

enum Verdict {
    Active,
    /// Nothing can make the run runnable until an event lands on it: no need to look again
    /// before then. `quiet`: its last event is older than the stall threshold.
    Settled {
        quiet: bool,
    },
    Quiet,
    Nudged,
    Resolving(Vec<OperationId>),
}

async fn check(
    rt: &Runtime,
    run: &RunId,
    stall_after: Duration,
) -> Result<Verdict, ReconcileError> {
    let Some(last) = rt.journal.last_event(run).await? else {
        return Ok(Verdict::Settled { quiet: true });
    };
    let age = time::OffsetDateTime::now_utc() - last.stored_at;
    let quiet = age >= stall_after;
    let settled = settles(last.event_type, last.envelope.as_ref().map(|e| &e.event));
    if settled {
        return Ok(Verdict::Settled { quiet });
    }
    if !quiet {
        return Ok(Verdict::Active);
    }
    let events = rt.journal.read(run, 0).await?;
    if !events
        .iter()
        .any(|r| r.envelope.event_type() == EventType::RunCreated)
    {
        // Only messages set aside (or inputs) on a run id that was never created.
        return Ok(Verdict::Settled { quiet });
    }
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
    let abandoned_after = rt.config.timeouts.op_abandoned_after();
    let cutoff = Timestamp(
        time::OffsetDateTime::now_utc()
            - time::Duration::try_from(abandoned_after).unwrap_or(time::Duration::MAX),
    );
    let stuck = state.ops_stuck_since(cutoff);
    if !stuck.is_empty() {
        return resolve_stuck(rt, run, &events, stuck, abandoned_after).await;
    }
    if state.queued.is_some() && state.cancel_requested.is_none() {
        // Waits for a slot: nothing to nudge (see `settles`).
        return Ok(Verdict::Settled { quiet });
    }
    let runnable = match decide(&state) {
        Next::Idle(_) => false,
        Next::Commit(_) | Next::Step(_) | Next::Finish(_) => true,
    };
    if !runnable && !state.status.is_terminal() {
        let children: Vec<(OperationId, RunId)> = state
            .children
            .iter()
            .filter(|(op, _)| state.ops.get(*op).is_some_and(|o| o.result.is_none()))
            .map(|(op, child)| (op.clone(), child.clone()))
            .collect();
        if !children.is_empty() {
            return check_children(rt, run, &state, &children, stall_after).await;
        }
    }
    if !runnable {
        // `decide` is a function of the journal alone: it says the same until an event lands.
        // Only an operation in flight can change the verdict meanwhile (it may get stuck).
        let in_flight = state.ops_stuck_since(Timestamp(
            time::OffsetDateTime::now_utc() + time::Duration::days(365 * 100),
        ));
        return Ok(if in_flight.is_empty() {
            Verdict::Settled { quiet }
        } else {
            Verdict::Quiet
        });
    }
    nudge_stalled(rt, run, &state, last.seq, age).await
}

/// Whether a run whose last event is this one is settled: the writer ended it, or parked it
/// waiting on a person, a timer or a callback (not on its tools, one of which may be stuck), so
/// nothing since could have made it runnable and its journal need not be read, nor looked at
/// again before a new event lands on it.
fn settles(event_type: Option<EventType>, event: Option<&Event>) -> bool {
    match event_type {
        // A run waiting for a slot of its concurrency key: `slot.granted` wakes it (a grant
        // lost with its releaser is sent again by the slots' recovery, `slots::recover`).
        Some(
            EventType::RunSucceeded
            | EventType::RunFailed
            | EventType::RunCancelled
            | EventType::RunUnknown
            | EventType::RunQueued,
        ) => true,
        Some(EventType::RunWaiting) => !matches!(
            event,
            Some(Event::RunWaiting(RunWaiting {
                on: WaitReason::Tool
            }))
        ),
        _ => false,
    }
}

/// Operations `stuck` past `abandoned_after` with no outcome: each is nudged once per dispatch
/// in the run's journal (`events`) and sent, as journaled, to `kedge.tool.resolve`.
async fn resolve_stuck(
    rt: &Runtime,
    run: &RunId,
    events: &[kedge_journal::Recorded],
    stuck: Vec<&kedge_core::fold::ToolOp>,
    abandoned_after: Duration,
) -> Result<Verdict, ReconcileError> {
    let mut asked = Vec::new();
    for op in stuck {
        // The operation's latest dispatch, as journaled: what the runner executes.
        let Some(request) = events.iter().rev().find(|r| {
            r.envelope.op.as_ref() == Some(&op.op)
                && matches!(r.envelope.event, Event::ToolRequested(_))
        }) else {
            continue;
        };
        let nudge = InputEnvelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(Input::Nudge(Nudge {
                reason: format!(
                    "operation {} stuck since {} (no outcome after tool_timeout + tool_grace = {} ms); \
                     a tool runner was asked to resolve it",
                    op.op,
                    op.since,
                    abandoned_after.as_millis()
                ),
            })),
        );
        // Journaled once per stuck dispatch, also past the stream's duplicate window: later
        // scans find it in the journal and only ask again.
        let key = kedge_core::ids::InputId::resolve_nudge(&op.op, op.dispatches);
        let journaled = events
            .iter()
            .any(|r| r.msg_id.as_deref() == Some(key.as_str()));
        if !journaled && !rt.journal.append_input(&key, &nudge).await?.duplicate {
            kedge_runtime::metrics::reconciler_nudge(kedge_runtime::metrics::Nudge::Resolve);
        }
        // As journaled: large arguments by reference, so the request fits a message.
        let payload = rt.journal.stored_form(&request.envelope).await?;
        ask_to_resolve(rt, op.op.clone(), payload.to_vec());
        asked.push(op.op.clone());
    }
    Ok(Verdict::Resolving(asked))
}

/// A runnable run nobody holds and nothing happened on for a while: nudged once per last event
/// (`last_seq`, the event the quiet verdict stands on), unless a worker holds its lease.
async fn nudge_stalled(
    rt: &Runtime,
    run: &RunId,
    state: &kedge_core::RunState,
    last_seq: u64,
    age: time::Duration,
) -> Result<Verdict, ReconcileError> {
    match rt.leases.holder(run).await {
        Ok(Some(lease)) => {
            tracing::debug!(run_id = %run, owner = %lease.owner, "quiet but leased; not nudging");
            return Ok(Verdict::Quiet);
        }
        Ok(None) => {}
        Err(e) => return Err(ReconcileError::Broker(e.to_string())),
    }
    let nudge = InputEnvelope::new(
        run.clone(),
        Timestamp::now(),
        Draft::new(Input::Nudge(Nudge {
            reason: format!(
                "stalled: runnable ({}) with no lease and no event for {} s",
                state.status,
                age.whole_seconds()
            ),
        })),
    );
    // Keyed by the last event the quiet verdict stands on, not the state's: a replica whose
    // read came after another's nudge landed (the nudge its last event) would key a second one.
    let key = kedge_core::ids::InputId::nudge(run, last_seq);
    if rt.journal.append_input(&key, &nudge).await?.duplicate {
        // Another replica nudged this same state.
        return Ok(Verdict::Quiet);
    }
    tracing::info!(run_id = %run, status = %state.status, "nudged a stalled run");
    kedge_runtime::metrics::reconciler_nudge(kedge_runtime::metrics::Nudge::Stalled);
    Ok(Verdict::Nudged)
}

/// A quiet run that waits on child runs (`run_agent`): the safety net under the step's own
/// repairs (docs/ARCHITECTURE.md "Child runs"). A child that does not exist is created by the
/// parent's next drive: the parent is nudged. A child that ended longer than `stall_after` ago
/// without its parent holding its result gives it on its next drive: the child is nudged. Either
/// nudge is keyed by the last event seen, so replicas append one. Otherwise the run stays
/// watched (a child may end any time).
async fn check_children(
    rt: &Runtime,
    run: &RunId,
    state: &kedge_core::RunState,
    children: &[(OperationId, RunId)],
    stall_after: Duration,
) -> Result<Verdict, ReconcileError> {
    for (op, child) in children {
        let (target, seq, reason) = match rt.journal.last_event(child).await? {
            None => (
                run,
                state.last_seq,
                format!("child run {child} of operation {op} does not exist yet"),
            ),
            Some(last)
                if matches!(
                    last.event_type,
                    Some(EventType::RunSucceeded | EventType::RunFailed | EventType::RunCancelled)
                ) && time::OffsetDateTime::now_utc() - last.stored_at >= stall_after =>
            {
                (
                    child,
                    last.seq,
                    format!("child run ended without giving run {run} its result for {op}"),
                )
            }
            Some(_) => continue,
        };
        let nudge = InputEnvelope::new(
            target.clone(),
            Timestamp::now(),
            Draft::new(Input::Nudge(Nudge {
                reason: reason.clone(),
            })),
        );
        let key = kedge_core::ids::InputId::nudge(target, seq);
        if !rt.journal.append_input(&key, &nudge).await?.duplicate {
            tracing::info!(run_id = %run, nudged = %target, %reason, "nudged for a child run");
            kedge_runtime::metrics::reconciler_nudge(kedge_runtime::metrics::Nudge::Stalled);
            return Ok(Verdict::Nudged);
        }
    }
    Ok(Verdict::Quiet)
}

/// Sends a stuck operation's request to the tool services without holding up the scan; the
/// answer (what resolving it came to, or that a live runner holds it) is logged. No answer
/// (no tool service up) is retried by the next scan.
fn ask_to_resolve(rt: &Runtime, op: OperationId, payload: Vec<u8>) {
    let client = rt.client.clone();
    // The runner may run the tool again (not found): allow it its whole timeout to answer.
    let within = rt.config.timeouts.op_abandoned_after();
    tokio::spawn(async move {
        let request = async_nats::Request::new()
            .payload(payload.into())
            .timeout(Some(within));
        match client.send_request(subjects::TOOL_RESOLVE, request).await {
            // The runner answers what handling it came to. A refusal means the runner found no
            // such decision in the journal: nothing ran.
            Ok(reply) => match serde_json::from_slice::<ResolveReply>(&reply.payload) {
                Ok(ResolveReply::Handled(Handled::Refused { reason })) => tracing::warn!(
                    run_id = %op.run(),
                    op = %op,
                    %reason,
                    "stuck operation: the tool runner refused it as not journaled"
                ),
                Ok(ResolveReply::Handled(answer)) => tracing::info!(
                    run_id = %op.run(),
                    op = %op,
                    ?answer,
                    "stuck operation: tool runner answered"
                ),
                Ok(ResolveReply::Failed { error }) => tracing::warn!(
                    run_id = %op.run(),
                    op = %op,
                    %error,
                    "stuck operation: the tool runner could not handle it now; the next scan asks again"
                ),
                Err(e) => tracing::warn!(
                    run_id = %op.run(),
                    op = %op,
                    error = %e,
                    "stuck operation: the tool runner's answer does not parse"
                ),
            },
            Err(e) => tracing::warn!(
                run_id = %op.run(),
                op = %op,
                error = %e,
                "stuck operation: no tool runner answered"
            ),
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    fn waiting(on: WaitReason) -> Event {
        Event::RunWaiting(RunWaiting { on })
    }

    #[test]
    fn a_run_is_settled_by_its_end_or_a_wait_on_anything_but_its_tools() {
        for ended in [
            EventType::RunSucceeded,
            EventType::RunFailed,
            EventType::RunCancelled,
            EventType::RunUnknown,
        ] {
            assert!(settles(Some(ended), None), "{ended}");
        }
        for on in [WaitReason::User, WaitReason::Approval, WaitReason::External] {
            let event = waiting(on);
            assert!(settles(Some(EventType::RunWaiting), Some(&event)), "{on:?}");
        }
        // Waiting on its tools: one of them may be stuck, so the journal is read.
        let tools = waiting(WaitReason::Tool);
        assert!(!settles(Some(EventType::RunWaiting), Some(&tools)));
        // Anything else may leave it runnable; a message set aside names no type.
        for other in [
            EventType::StepCompleted,
            EventType::ToolResult,
            EventType::RunCancelling,
        ] {
            assert!(!settles(Some(other), None), "{other}");
        }
        assert!(!settles(None, None));
    }
}
