//! Retention: removing what a finished run left behind (issue 13, item 3).
//!
//! [`purge_run`] removes one run's data from every place Kedge keeps it, after checking from the
//! journal itself (not the projection, a cache) that the run is finished — ended, with nothing
//! about to revive it ([`crate::view::finished`]) — and, when a cutoff is given, that its last
//! event is older than the cutoff. A run that is not finished is never touched.
//!
//! What goes, in this order (so that an interrupted purge is finished by running it again: the
//! journal, which the check reads, goes last):
//! 1. optionally, the journal is archived first as JSON Lines (`{"seq", "envelope"}` per line)
//!    to the object store `kedge_blobs` under `archive/runs/<run_id>.jsonl`;
//! 2. the idempotency records (`kedge_idempotency`: `model.<request>` of every step started,
//!    `op.<operation>` of every tool operation), the run's lease, its timers' schedules and
//!    fired messages (`KEDGE_TIMERS`), its set-aside records (`KEDGE_REJECTIONS`) and its
//!    summary in `kedge_runs`;
//! 3. the journal subjects `agent.run.<id>.>`.
//!
//! Purging twice is harmless (the second finds no run). Workspaces live on the tool hosts and
//! are not removed here (see docs/RUNBOOK.md "Retention"). Every removal is a stream purge with a
//! subject filter: it needs `$JS.API.STREAM.PURGE`, which only the operator's credentials carry
//! (docs/SECURITY.md).

use kedge_core::event::Event;
use kedge_core::event::Timestamp;
use kedge_core::ids::RunId;
use kedge_core::subjects::{BLOBS_BUCKET, IDEMPOTENCY_BUCKET, LEASES_BUCKET, RUNS_BUCKET};
use kedge_journal::JournalError;
use serde::Serialize;

use crate::Runtime;
use crate::idempotency::IdempotencyStore;

/// The streams behind the buckets a run has keys in.
const IDEMPOTENCY_STREAM: &str = "KV_kedge_idempotency";
const LEASES_STREAM: &str = "KV_kedge_leases";
const RUNS_BUCKET_STREAM: &str = "KV_kedge_runs";
/// The stream of timer schedules and fired timers (the timer service's).
const TIMERS_STREAM: &str = "KEDGE_TIMERS";
/// The stream of set-aside and dead-letter records.
const REJECTIONS_STREAM: &str = "KEDGE_REJECTIONS";

/// What [`purge_run`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Purged {
    /// Removed (or, with `dry_run`, would be): the journal's message count, the other records
    /// removed, and the archive's object name when one was written.
    Purged {
        events: u64,
        records: u64,
        archive: Option<String>,
        dry_run: bool,
    },
    /// Not finished: left alone.
    NotFinished { status: kedge_core::RunStatus },
    /// Finished after the cutoff: left alone.
    TooRecent { ended_at: Timestamp },
    /// No such run in the journal (never existed, or already purged).
    NotFound,
}

/// How [`purge_run`] goes about it.
#[derive(Debug, Clone, Copy, Default)]
pub struct PurgeOptions {
    /// Only runs whose last event is older than this.
    pub finished_before: Option<Timestamp>,
    /// Archive the journal to the object store first.
    pub archive: bool,
    /// Check and count, remove nothing.
    pub dry_run: bool,
}

/// Why a purge failed (the run is left as it was, or partly purged and finished by a retry).
#[derive(Debug, thiserror::Error)]
pub enum RetentionError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error("run {run} does not fold: {reason}")]
    Fold { run: RunId, reason: String },
    #[error("archive of run {run}: {reason}")]
    Archive { run: RunId, reason: String },
    /// An event landed on the run while it was purged (a message reviving it): what was read
    /// is gone, what came after was left in the journal.
    #[error("run {run} got an event while it was purged; the events after the check were left")]
    Revived { run: RunId },
}

/// The object name of a run's archived journal in `kedge_blobs`.
pub fn archive_name(run: &RunId) -> String {
    format!("archive/runs/{run}.jsonl")
}

/// Purges one finished run (see the module docs).
pub async fn purge_run(
    rt: &Runtime,
    run: &RunId,
    opts: PurgeOptions,
) -> Result<Purged, RetentionError> {
    let page = rt.journal.read_with_set_aside(run, 0).await?;
    if page.events.is_empty() {
        return Ok(Purged::NotFound);
    }
    let state =
        kedge_core::fold::fold(page.events.iter().map(|r| (r.seq, &r.envelope))).map_err(|e| {
            RetentionError::Fold {
                run: run.clone(),
                reason: e.to_string(),
            }
        })?;
    if !crate::view::finished(&state) {
        return Ok(Purged::NotFinished {
            status: state.status,
        });
    }
    let ended_at = page
        .events
        .last()
        .map_or(state.created_at, |r| r.envelope.at);
    if let Some(cutoff) = opts.finished_before
        && ended_at >= cutoff
    {
        return Ok(Purged::TooRecent { ended_at });
    }
    let events = (page.events.len() + page.set_aside.len()) as u64;
    let mut filters: Vec<(&str, String)> = Vec::new();
    for r in &page.events {
        if let Event::StepStarted(s) = &r.envelope.event {
            filters.push((
                IDEMPOTENCY_STREAM,
                format!(
                    "{}{}",
                    kv(IDEMPOTENCY_BUCKET),
                    IdempotencyStore::model_key(&s.request_id)
                ),
            ));
        }
    }
    for op in state.ops.keys() {
        filters.push((
            IDEMPOTENCY_STREAM,
            format!("{}{}", kv(IDEMPOTENCY_BUCKET), IdempotencyStore::op_key(op)),
        ));
    }
    filters.push((LEASES_STREAM, format!("{}{run}", kv(LEASES_BUCKET))));
    filters.push((TIMERS_STREAM, format!("kedge.timer.sched.{run}.>")));
    filters.push((TIMERS_STREAM, format!("kedge.timer.fired.{run}.>")));
    filters.push((REJECTIONS_STREAM, format!("agent.rejected.journal.{run}.>")));
    filters.push((
        RUNS_BUCKET_STREAM,
        format!("{}{}.{run}", kv(RUNS_BUCKET), state.bundle.tenant),
    ));
    if opts.dry_run {
        return Ok(Purged::Purged {
            events,
            records: filters.len() as u64,
            archive: opts.archive.then(|| archive_name(run)),
            dry_run: true,
        });
    }
    let archive = if opts.archive {
        Some(archive(rt, run, &page.events).await?)
    } else {
        None
    };
    let timeout = kedge_journal::journal::DEFAULT_TIMEOUT;
    let mut records = 0;
    for (stream, filter) in &filters {
        records += kedge_journal::purge(&rt.client, stream, filter, timeout).await?;
    }
    // Only what was read and found finished: an input that lands meanwhile (reviving the run)
    // stays, and the run is reported as not purged whole.
    let through = page
        .events
        .last()
        .map_or(0, |r| r.seq)
        .max(page.set_aside.last().map_or(0, |a| a.seq));
    let events = rt.journal.purge_run(run, through).await?;
    if rt.journal.last_seq(run).await?.is_some() {
        tracing::warn!(run_id = %run, through, "an event landed on the run while it was purged; it was left in the journal");
        return Err(RetentionError::Revived { run: run.clone() });
    }
    tracing::info!(run_id = %run, events, records, archived = archive.is_some(), "run purged");
    Ok(Purged::Purged {
        events,
        records,
        archive,
        dry_run: false,
    })
}

/// What [`purge_finished`] did over the whole journal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PurgeReport {
    /// Runs in the journal when the pass began.
    pub runs: usize,
    /// Runs purged (or, with `dry_run`, that would be).
    pub purged: usize,
    /// Journal messages removed.
    pub events: u64,
    pub not_finished: usize,
    pub too_recent: usize,
    /// Runs that could not be purged (logged; a later pass tries them again).
    pub failed: usize,
}

/// [`purge_run`] for every run in the journal (the runs that qualify; the others are counted
/// and left alone). Resumable: an interrupted pass is finished by the next one.
pub async fn purge_finished(
    rt: &Runtime,
    opts: PurgeOptions,
) -> Result<PurgeReport, RetentionError> {
    let runs = rt.journal.run_ids().await?;
    let mut report = PurgeReport {
        runs: runs.len(),
        ..PurgeReport::default()
    };
    for run in &runs {
        match purge_run(rt, run, opts).await {
            Ok(Purged::Purged { events, .. }) => {
                report.purged += 1;
                report.events += events;
            }
            Ok(Purged::NotFinished { .. }) => report.not_finished += 1,
            Ok(Purged::TooRecent { .. }) => report.too_recent += 1,
            Ok(Purged::NotFound) => {}
            Err(e) => {
                tracing::error!(run_id = %run, error = %e, "run not purged");
                report.failed += 1;
            }
        }
    }
    Ok(report)
}

/// Writes the run's journal as JSON Lines to the object store; the object's name.
async fn archive(
    rt: &Runtime,
    run: &RunId,
    events: &[kedge_journal::Recorded],
) -> Result<String, RetentionError> {
    let failed = |reason: String| RetentionError::Archive {
        run: run.clone(),
        reason,
    };
    #[derive(Serialize)]
    struct Line<'a> {
        seq: u64,
        envelope: &'a kedge_core::Envelope,
    }
    let mut body = Vec::new();
    for r in events {
        serde_json::to_writer(
            &mut body,
            &Line {
                seq: r.seq,
                envelope: &r.envelope,
            },
        )
        .map_err(|e| failed(e.to_string()))?;
        body.push(b'\n');
    }
    let store = rt
        .js
        .get_object_store(BLOBS_BUCKET)
        .await
        .map_err(|e| failed(e.to_string()))?;
    let name = archive_name(run);
    store
        .put(name.as_str(), &mut body.as_slice())
        .await
        .map_err(|e| failed(e.to_string()))?;
    Ok(name)
}

/// `$KV.<bucket>.`: the subject prefix of a bucket's keys.
fn kv(bucket: &str) -> String {
    format!("$KV.{bucket}.")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bucket_streams_are_the_buckets() {
        assert_eq!(IDEMPOTENCY_STREAM, format!("KV_{IDEMPOTENCY_BUCKET}"));
        assert_eq!(LEASES_STREAM, format!("KV_{LEASES_BUCKET}"));
        assert_eq!(RUNS_BUCKET_STREAM, format!("KV_{RUNS_BUCKET}"));
    }
}
