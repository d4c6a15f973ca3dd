//! The reconciler: the last line of recovery (seed 004, section 七, layer ③).
//!
//! Every `stall_after / 2` it scans the runs (the subjects `agent.run.*.d.run.created` of the
//! journal stream) and nudges each run that should be progressing and is not: its last event is
//! older than `stall_after`, nobody holds its lease, and `decide` on its folded journal says there
//! is work to do (a step or a commit), not a legitimate wait. The nudge is a `nudge` input whose
//! `Nats-Msg-Id` is `nudge:<run>:<last seq>`, so any number of reconciler replicas nudging the
//! same stalled state append one message, and the nudge itself is journaled (the run's history
//! says why it woke). The step service treats it like any other wake.
//!
//! What makes a run stall although every message is at-least-once: a wake acked by a worker that
//! then failed before it could act (a bug, a lost lease at the wrong moment), or a state the
//! consumers never see again. A stalled scan is not silent: every scan logs what it checked and
//! nudged, and errors are logged per run, never swallowed.

use std::future::Future;
use std::time::Duration;

use kedge_core::decide::{Next, decide};
use kedge_core::event::{Draft, Envelope, Event, EventType, Nudge, Timestamp};
use kedge_core::ids::RunId;
use kedge_core::subjects;
use kedge_journal::JournalError;
use kedge_runtime::{Runtime, RuntimeError};

/// What one scan found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ScanReport {
    pub runs: usize,
    /// Runs whose last event is older than the stall threshold.
    pub quiet: usize,
    pub nudged: Vec<RunId>,
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
    loop {
        tokio::select! {
            _ = &mut shutdown => break,
            _ = tokio::time::sleep(every) => {}
        }
        match scan_once(&rt).await {
            Ok(report) => tracing::info!(
                runs = report.runs,
                quiet = report.quiet,
                nudged = report.nudged.len(),
                "reconciler scan"
            ),
            Err(e) => tracing::warn!(error = %e, "reconciler scan failed"),
        }
    }
    tracing::info!("reconciler stopped");
    Ok(())
}

/// Scans every run once and nudges the stalled ones.
pub async fn scan_once(rt: &Runtime) -> Result<ScanReport, ReconcileError> {
    let stream = rt
        .js
        .get_stream(subjects::RUNS_STREAM)
        .await
        .map_err(|e| ReconcileError::Broker(e.to_string()))?;
    let runs = rt.journal.run_ids().await?;
    let mut report = ScanReport {
        runs: runs.len(),
        ..Default::default()
    };
    let stall_after = rt.config.timeouts.stall_after();
    for run in runs {
        match check(rt, &stream, &run, stall_after).await {
            Ok(Verdict::Active) => {}
            Ok(Verdict::Quiet) => report.quiet += 1,
            Ok(Verdict::Nudged) => {
                report.quiet += 1;
                report.nudged.push(run);
            }
            Err(e) => tracing::warn!(run_id = %run, error = %e, "cannot check run"),
        }
    }
    Ok(report)
}

enum Verdict {
    Active,
    Quiet,
    Nudged,
}

async fn check(
    rt: &Runtime,
    stream: &async_nats::jetstream::stream::Stream,
    run: &RunId,
    stall_after: Duration,
) -> Result<Verdict, ReconcileError> {
    let last = stream
        .direct_get_last_for_subject(subjects::run_all(run))
        .await
        .map_err(|e| ReconcileError::Broker(e.to_string()))?;
    let age = time::OffsetDateTime::now_utc() - last.time;
    if age < stall_after {
        return Ok(Verdict::Active);
    }
    // A run whose last event is the writer settling it (waiting, ended, parked for a person) has
    // had nothing since that could make it runnable: no need to read its journal. This keeps a
    // scan over many waiting runs to one direct get each.
    if let Some(parsed) = subjects::parse_event(&last.subject)
        && matches!(
            parsed.event_type,
            EventType::RunWaiting
                | EventType::RunSucceeded
                | EventType::RunFailed
                | EventType::RunCancelled
                | EventType::RunUnknown
        )
    {
        return Ok(Verdict::Quiet);
    }
    let events = rt.journal.read(run, 0).await?;
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
    let runnable = match decide(&state) {
        Next::Idle(_) => false,
        Next::Commit(_) | Next::Step(_) | Next::Finish(_) => true,
    };
    if !runnable {
        return Ok(Verdict::Quiet);
    }
    match rt.leases.holder(run).await {
        Ok(Some(lease)) => {
            tracing::debug!(run_id = %run, owner = %lease.owner, "quiet but leased; not nudging");
            return Ok(Verdict::Quiet);
        }
        Ok(None) => {}
        Err(e) => return Err(ReconcileError::Broker(e.to_string())),
    }
    let nudge = Envelope::new(
        run.clone(),
        Timestamp::now(),
        Draft::new(Event::Nudge(Nudge {
            reason: format!(
                "stalled: runnable ({}) with no lease and no event for {} s",
                state.status,
                age.whole_seconds()
            ),
        })),
    );
    let key = format!("nudge:{run}:{}", state.last_seq);
    match rt.journal.append_input(&nudge, &key).await {
        Ok(_) => {
            tracing::info!(run_id = %run, status = %state.status, "nudged a stalled run");
            Ok(Verdict::Nudged)
        }
        // Another replica nudged this same state.
        Err(JournalError::Duplicate { .. }) => Ok(Verdict::Quiet),
        Err(e) => Err(e.into()),
    }
}
