//! Retention: removing what a finished run left behind.
//!
//! [`purge_run`] removes one run's data from every place Kedge keeps it, after checking from the
//! journal itself (not the projection, a cache) that the run is finished — ended, with nothing
//! about to revive it ([`kedge_core::decide::finished`]) — and, when a cutoff is given, that it ended
//! (its last `run.succeeded|failed|cancelled`) before the cutoff. A run that is not finished is
//! never touched.
//!
//! What goes, in this order (so that an interrupted purge is finished by running it again: the
//! journal, which the check reads, goes last):
//! 1. optionally, the journal is archived first as JSON Lines (`{"seq", "envelope"}` per line)
//!    to the object store `kedge_blobs` under `archive/runs/<run_id>.jsonl`;
//! 2. the idempotency records (`kedge_idempotency`: `model.<request>` of every step started,
//!    `op.<operation>` of every tool operation), the run's lease, its timers' schedules and
//!    fired messages (`KEDGE_TIMERS`), its set-aside records (`KEDGE_REJECTIONS`) and its
//!    summary in `kedge_runs`;
//! 3. the journal subjects `agent.run.<id>.>`;
//! 4. the run's blobs in `kedge_blobs` (the data of its events and records held by reference,
//!    named `<run_id>/sha256:<hex>`: blobs are not shared across runs), found from the journal
//!    and the records before anything is removed. Last, so that a purge cut short leaves
//!    unreferenced blobs (logged), never a journal whose events cannot be read.
//!
//! Purging twice is harmless (the second finds no run). Workspaces live on the tool hosts and
//! are not removed here: each tool service sweeps its workspace root and removes the directory
//! of every run whose journal is gone (`kedge_tool::workspaces`). Every removal is a stream
//! purge with a subject filter: it needs `$JS.API.STREAM.PURGE`, which only the admin's and the
//! `retention` user's credentials carry (docs/SECURITY.md).
//!
//! # The retention policy
//!
//! [`apply_policy`] is one pass of the retention service (`kedge serve retention`, configured by
//! [`kedge_runtime::config::RetentionConfig`]). It does not list runs: it reads the journal's terminal
//! events (`agent.run.*.d.run.succeeded|failed|cancelled`, headers only, in stream order) from a
//! cursor kept in `kedge_leases` under [`CURSOR_KEY`], purges the run of each one stored before
//! the horizon (`now - finished_after`), and moves the cursor past them. It stops at the first
//! terminal event not yet past the horizon (later ones are younger). So a pass costs the runs
//! that crossed the horizon since the last pass (plus at most one batch of headers), whatever the
//! number of runs ever created.
//!
//! Each run still goes through [`purge_run`], which decides from the run's own journal: a run
//! revived since that terminal event is left alone (its next ending journals a new terminal
//! event, which the cursor meets later), and a run whose last ending is younger than the horizon
//! is left to that later event. Replicas: the cursor is saved with compare-and-set after each
//! batch; two replicas reading the same batch both purge its runs (harmless: purging is
//! idempotent) and the slower one's save fails, so it re-reads the cursor on its next pass. A pass
//! interrupted mid-batch leaves the cursor before that batch: the next pass does it again.

use std::time::Duration;

use futures::StreamExt;
use kedge_core::event::EventType;
use kedge_core::event::Timestamp;
use kedge_core::event::{Digest, Event};
use kedge_core::ids::RunId;
use kedge_core::subjects::{
    self, BLOBS_BUCKET, IDEMPOTENCY_BUCKET, IDEMPOTENCY_STREAM, LEASES_BUCKET, LEASES_STREAM,
    REJECTIONS_STREAM, RUNS_BUCKET, RUNS_BUCKET_STREAM, TIMERS_STREAM, kv_key,
};
use kedge_journal::JournalError;
use serde::{Deserialize, Serialize};

use kedge_runtime::Runtime;
use kedge_runtime::idempotency::IdempotencyStore;
use kedge_runtime::projection;

/// What [`purge_run`] did.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(tag = "outcome", rename_all = "snake_case")]
pub enum Purged {
    /// Removed (or, with `dry_run`, would be): the journal's message count, the other records
    /// removed, the blobs removed (the run's data held by reference in `kedge_blobs`), and the
    /// archive's object name when one was written.
    Purged {
        events: u64,
        records: u64,
        blobs: u64,
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
    /// Only runs that ended (their last terminal event) before this.
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
    #[error(transparent)]
    Idempotency(#[from] kedge_runtime::idempotency::IdempotencyError),
    #[error("run {run} does not fold: {reason}")]
    Fold { run: RunId, reason: String },
    #[error("archive of run {run}: {reason}")]
    Archive { run: RunId, reason: String },
    /// An event landed on the run while it was purged (a message reviving it): what was read
    /// is gone, what came after was left in the journal.
    #[error("run {run} got an event while it was purged; the events after the check were left")]
    Revived { run: RunId },
    /// The retention cursor or the terminal events could not be read or saved.
    #[error("retention cursor: {0}")]
    Cursor(String),
}

/// The object name of a run's archived journal in `kedge_blobs`.
pub fn archive_name(run: &RunId) -> String {
    format!("archive/runs/{run}.jsonl")
}

/// Purges one finished run (see the module docs). The cutoff applies to when the run ended
/// (its last `run.succeeded|failed|cancelled`), not to inputs that landed on it since without
/// reviving it.
pub async fn purge_run(
    rt: &Runtime,
    run: &RunId,
    opts: PurgeOptions,
) -> Result<Purged, RetentionError> {
    Ok(purge_run_ended(rt, run, opts).await?.0)
}

/// [`purge_run`], and the sequence of the run's last terminal event when it read one.
async fn purge_run_ended(
    rt: &Runtime,
    run: &RunId,
    opts: PurgeOptions,
) -> Result<(Purged, Option<u64>), RetentionError> {
    let page = rt.journal.read_with_set_aside(run, 0).await?;
    if page.events.is_empty() {
        return Ok((Purged::NotFound, None));
    }
    let ended = page.events.iter().rev().find(|r| {
        matches!(
            r.envelope.event,
            Event::RunSucceeded(_) | Event::RunFailed(_) | Event::RunCancelled(_)
        )
    });
    let ended_seq = ended.map(|r| r.seq);
    let state =
        kedge_core::fold::fold(page.events.iter().map(|r| (r.seq, &r.envelope))).map_err(|e| {
            RetentionError::Fold {
                run: run.clone(),
                reason: e.to_string(),
            }
        })?;
    if !kedge_core::decide::finished(&state) {
        return Ok((
            Purged::NotFinished {
                status: state.status,
            },
            ended_seq,
        ));
    }
    let ended_at = ended
        .or(page.events.last())
        .map_or(state.created_at, |r| r.envelope.at);
    if let Some(cutoff) = opts.finished_before
        && ended_at >= cutoff
    {
        return Ok((Purged::TooRecent { ended_at }, ended_seq));
    }
    let events = (page.events.len() + page.set_aside.len()) as u64;
    let (record_keys, filters) = records_of(run, page.events.iter().map(|r| &r.envelope), &state);
    let blobs = blobs_of(rt, run, &record_keys).await?;
    if opts.dry_run {
        return Ok((
            Purged::Purged {
                events,
                records: filters.len() as u64,
                blobs: blobs.len() as u64,
                archive: opts.archive.then(|| archive_name(run)),
                dry_run: true,
            },
            ended_seq,
        ));
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
    // Last: a pass cut short before this leaves unreferenced blobs (logged), never a journal
    // whose events cannot be read.
    for digest in &blobs {
        if let Err(e) = rt.journal.blobs().delete(run, digest).await {
            tracing::warn!(run_id = %run, blob = %digest, error = %e, "blob of a purged run not removed");
        }
    }
    tracing::info!(run_id = %run, events, records, blobs = blobs.len(), archived = archive.is_some(), "run purged");
    Ok((
        Purged::Purged {
            events,
            records,
            blobs: blobs.len() as u64,
            archive,
            dry_run: false,
        },
        ended_seq,
    ))
}

/// What a finished run left outside its journal, as (stream, subject filter) pairs to purge:
/// its idempotency records (`model.<request>` of every step started, `op.<operation>` of every
/// operation; their keys are returned too), its lease, its timers' schedules and firings, its
/// set-aside records and its summary in `kedge_runs`.
fn records_of<'a>(
    run: &RunId,
    events: impl Iterator<Item = &'a kedge_core::Envelope>,
    state: &kedge_core::RunState,
) -> (Vec<String>, Vec<(String, String)>) {
    let mut record_keys: Vec<String> = events
        .filter_map(|e| match &e.event {
            Event::StepStarted(s) => Some(IdempotencyStore::model_key(&s.request_id)),
            _ => None,
        })
        .collect();
    record_keys.extend(state.ops.keys().map(IdempotencyStore::op_key));
    let mut filters: Vec<(String, String)> = record_keys
        .iter()
        .map(|key| (IDEMPOTENCY_STREAM.into(), kv_key(IDEMPOTENCY_BUCKET, key)))
        .collect();
    filters.push((LEASES_STREAM.into(), kv_key(LEASES_BUCKET, run.as_str())));
    filters.push((TIMERS_STREAM.into(), subjects::timers_scheduled_of(run)));
    filters.push((TIMERS_STREAM.into(), subjects::timers_fired_of(run)));
    filters.push((REJECTIONS_STREAM.into(), subjects::rejected_journal_of(run)));
    filters.push((
        RUNS_BUCKET_STREAM.into(),
        kv_key(RUNS_BUCKET, &projection::key(&state.bundle.tenant, run)),
    ));
    (record_keys, filters)
}

/// The run's blobs: what its journal and its idempotency records (`record_keys`) hold by
/// reference. Found before anything is removed (the references go with the journal).
async fn blobs_of(
    rt: &Runtime,
    run: &RunId,
    record_keys: &[String],
) -> Result<Vec<Digest>, RetentionError> {
    let mut blobs: Vec<Digest> = rt
        .journal
        .blob_references(run)
        .await?
        .into_iter()
        .map(|(_, r)| r.digest)
        .collect();
    for key in record_keys {
        if let Some(r) = rt.idempotency.blob_of(key).await? {
            blobs.push(r.digest);
        }
    }
    blobs.sort();
    blobs.dedup();
    Ok(blobs)
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

/// The key of the retention service's cursor in `kedge_leases`: the journal sequence through
/// which terminal events were handled (JSON [`Cursor`]); the layout registry names it.
pub const CURSOR_KEY: &str = kedge_core::subjects::RETENTION_CURSOR_KEY;

/// The terminal events the retention service reads.
const TERMINAL: [EventType; 3] = [
    EventType::RunSucceeded,
    EventType::RunFailed,
    EventType::RunCancelled,
];

/// Runs purged at once within a batch.
const CONCURRENT_PURGES: usize = 8;

/// What [`CURSOR_KEY`] holds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Cursor {
    /// Terminal events up to this journal sequence are handled.
    pub through: u64,
    /// Who saved it, when (for people reading the bucket).
    #[serde(default)]
    pub by: String,
    #[serde(default)]
    pub at: Option<Timestamp>,
}

/// The retention policy one pass applies ([`kedge_runtime::config::RetentionConfig`]).
#[derive(Debug, Clone, Copy)]
pub struct Policy {
    /// Runs finished longer ago than this are purged.
    pub finished_after: Duration,
    /// Archive each journal to `kedge_blobs` first.
    pub archive: bool,
    /// Run-level decisions scanned (the terminal ones among them handled) between two saves
    /// of the cursor.
    pub batch: usize,
}

impl From<&kedge_runtime::config::RetentionConfig> for Policy {
    fn from(c: &kedge_runtime::config::RetentionConfig) -> Self {
        Policy {
            finished_after: c.finished_after,
            archive: c.archive,
            batch: c.batch.max(1),
        }
    }
}

/// What one [`apply_policy`] pass did.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct PassReport {
    /// Terminal events read (the pass's work: it never lists runs).
    pub read: usize,
    /// Runs purged.
    pub purged: usize,
    /// Journal messages removed.
    pub events: u64,
    /// Terminal events whose run was already gone, revived since, or ended again later.
    pub skipped: usize,
    /// Runs that could not be purged (logged): the cursor stopped before the first (a later
    /// pass tries again), unless its journal does not fold (left for a person, passed over).
    pub failed: usize,
    /// The cursor after the pass.
    pub through: u64,
    /// Another replica saved the cursor first: this pass's last batch overlapped its work.
    pub overtaken: bool,
}

/// One pass of the retention policy (see the module docs): purges the runs whose terminal
/// event is older than `now - finished_after`, from the saved cursor on, in batches.
pub async fn apply_policy(rt: &Runtime, policy: Policy) -> Result<PassReport, RetentionError> {
    let cursor_err = |e: &dyn std::fmt::Display| RetentionError::Cursor(e.to_string());
    let kv = rt
        .js
        .get_key_value(LEASES_BUCKET)
        .await
        .map_err(|e| cursor_err(&e))?;
    let horizon = time::OffsetDateTime::now_utc()
        - time::Duration::try_from(policy.finished_after).unwrap_or(time::Duration::MAX);
    let cutoff = Timestamp(horizon);
    let opts = PurgeOptions {
        finished_before: Some(cutoff),
        archive: policy.archive,
        dry_run: false,
    };
    let mut report = PassReport::default();
    loop {
        let (through, revision) = match kv.entry(CURSOR_KEY).await.map_err(|e| cursor_err(&e))? {
            Some(e) if e.operation == async_nats::jetstream::kv::Operation::Put => {
                let c: Cursor = serde_json::from_slice(&e.value).unwrap_or_default();
                (c.through, Some(e.revision))
            }
            Some(e) => (0, Some(e.revision)),
            None => (0, None),
        };
        report.through = through;
        let kedge_journal::Scanned {
            events: batch,
            through: scanned,
            more,
        } = terminal_events(rt, through, policy.batch, horizon).await?;
        report.read += batch.len();
        if scanned <= through {
            return Ok(report);
        }
        let results: Vec<_> = futures::stream::iter(batch)
            .map(|(seq, run)| async move {
                let r = purge_run_ended(rt, &run, opts).await;
                (seq, run, r)
            })
            .buffered(CONCURRENT_PURGES)
            .collect()
            .await;
        let mut advanced = through;
        let mut stopped = false;
        for (seq, run, result) in results {
            if stopped {
                continue;
            }
            let handled = match result {
                Ok((Purged::Purged { events, .. }, _)) => {
                    report.purged += 1;
                    report.events += events;
                    true
                }
                Ok((Purged::NotFound | Purged::NotFinished { .. }, _))
                | Err(RetentionError::Revived { .. }) => {
                    report.skipped += 1;
                    true
                }
                // Ended again after this event: the later terminal event is met later.
                Ok((Purged::TooRecent { .. }, Some(ended))) if ended > seq => {
                    report.skipped += 1;
                    true
                }
                // Past the horizon by the broker's clock, not yet by the writer's: next pass.
                Ok((Purged::TooRecent { .. }, _)) => false,
                // A journal that does not fold will not fold next time either: left for a
                // person (logged), and the cursor goes on.
                Err(e @ RetentionError::Fold { .. }) => {
                    tracing::error!(run_id = %run, error = %e, "run not purged: its journal does not fold; left as it is");
                    report.failed += 1;
                    true
                }
                Err(e) => {
                    tracing::warn!(run_id = %run, error = %e, "run not purged; retried by a later pass");
                    report.failed += 1;
                    false
                }
            };
            if handled {
                advanced = seq;
            } else {
                stopped = true;
            }
        }
        // Every terminal event scanned was handled: what lay between them and after the last
        // (other decisions of the runs) is passed too.
        if !stopped {
            advanced = scanned;
        }
        if advanced > through {
            let value = serde_json::to_vec(&Cursor {
                through: advanced,
                by: rt.config.worker_id.to_string(),
                at: Some(Timestamp::now()),
            })
            .map_err(|e| cursor_err(&e))?;
            let saved = match revision {
                Some(r) => kv
                    .update(CURSOR_KEY, value.into(), r)
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
                None => kv
                    .create(CURSOR_KEY, value.into())
                    .await
                    .map(|_| ())
                    .map_err(|e| e.to_string()),
            };
            if let Err(e) = saved {
                tracing::debug!(error = %e, "retention cursor moved by another replica");
                report.overtaken = true;
                return Ok(report);
            }
            report.through = advanced;
        }
        if stopped || !more {
            return Ok(report);
        }
    }
}

/// The terminal events among the next `max` run-level decisions after journal sequence
/// `after` stored before `horizon`, as (sequence, run) in stream order, with the last
/// sequence scanned and whether more may follow ([`kedge_journal::Scanned`]).
async fn terminal_events(
    rt: &Runtime,
    after: u64,
    max: usize,
    horizon: time::OffsetDateTime,
) -> Result<kedge_journal::Scanned, RetentionError> {
    rt.journal
        .runs_with_events(&TERMINAL, after, max, horizon)
        .await
        .map_err(|e| RetentionError::Cursor(e.to_string()))
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_terminal_subjects_are_the_terminal_decisions() {
        let subjects: Vec<String> = TERMINAL.into_iter().map(subjects::event_all_runs).collect();
        assert_eq!(
            subjects,
            [
                "agent.run.*.d.run.succeeded",
                "agent.run.*.d.run.failed",
                "agent.run.*.d.run.cancelled"
            ]
        );
    }

    #[test]
    fn a_runs_records_are_named_from_its_journal() {
        for (path, journal) in kedge_core::fixtures::recorded_journals() {
            let state = kedge_core::fold::fold(journal.iter().map(|(seq, e)| (*seq, e)))
                .expect("a recorded journal folds");
            let run = &state.run_id;
            let (keys, filters) = records_of(run, journal.iter().map(|(_, e)| e), &state);
            let steps = journal
                .iter()
                .filter(|(_, e)| matches!(e.event, Event::StepStarted(_)))
                .count();
            assert_eq!(keys.len(), steps + state.ops.len(), "{}", path.display());
            for key in &keys {
                let idem = (
                    IDEMPOTENCY_STREAM.to_owned(),
                    kv_key(IDEMPOTENCY_BUCKET, key),
                );
                assert!(filters.contains(&idem), "{key}");
            }
            for (stream, filter) in [
                (LEASES_STREAM, kv_key(LEASES_BUCKET, run.as_str())),
                (TIMERS_STREAM, subjects::timers_scheduled_of(run)),
                (TIMERS_STREAM, subjects::timers_fired_of(run)),
                (REJECTIONS_STREAM, subjects::rejected_journal_of(run)),
            ] {
                assert!(filters.contains(&(stream.to_owned(), filter)), "{stream}");
            }
            assert_eq!(filters.len(), keys.len() + 5, "{}", path.display());
            // Each purge is of a stream the retention user may purge (its permissions are built
            // from the same list).
            for (stream, _) in &filters {
                assert!(
                    subjects::PURGED_STREAMS.contains(&stream.as_str()),
                    "{stream}"
                );
            }
            // Every filter names this run alone (or a record of it): nothing of another run.
            assert!(
                filters.iter().all(|(_, f)| !f.contains('*') && !f.ends_with('>')
                    || f.contains(run.as_str())),
                "{filters:?}"
            );
        }
    }
}
