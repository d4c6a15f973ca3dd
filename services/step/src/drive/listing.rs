//! The runs list kept by the decision writer (docs/ARCHITECTURE.md "The bridge and the runs
//! projection"): after a drive, this process holds the run's fold, read the way its decisions
//! were checked, and writes the run's summary to `kedge_runs` from it, so the projector reads
//! nothing for the run's progress.
//!
//! - A summary that is not busy ([`kedge_core::RunStatus::is_busy`]: the run waits on a
//!   person, a timer, a slot or its provider, or ended) is written at once, and the drive waits
//!   for the write before it lets go of the run's lease: a process killed before the write held
//!   the lease, and the process that adopts the run drives it and writes its summary.
//! - A busy one (running, waiting on its tools) is written at most once per `interval`
//!   (`bridge.runs_list_interval_ms`) per run: the newest one, by a ticker, the interval after
//!   the run's last write (at once for the run's first here). A busy run is driven again in a
//!   moment, or adopted with its kept lease if this process dies, so nothing stays stale.
//!
//! Every write is the projection's compare-and-set ([`Store::store`]): a summary folded
//! through an older sequence than the stored one is never written, so two workers, a worker
//! and the projector, converge on the newest fold. A write that fails is counted
//! ([`kedge_runtime::metrics::ListWrite::Failed`]) and left: the next drive writes the run, and
//! the projector writes it on its next run-level decision.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, Instant};

use futures::StreamExt as _;
use kedge_core::RunState;
use kedge_core::ids::RunId;
use kedge_runtime::Runtime;
use kedge_runtime::metrics::{self, ListWrite};
use kedge_runtime::projection::{Hint, Known, RunSummary, Store};
use tokio::sync::OnceCell;

/// Coalesced writes made at once by the ticker.
const WRITING: usize = 32;
/// The longest a stopping service spends on the writes still pending.
const FLUSH_WITHIN: Duration = Duration::from_secs(2);
/// How long a run written and not driven since is remembered (its revision: the next write is
/// one compare-and-set, no read of the key).
const REMEMBERED: Duration = Duration::from_secs(60);
/// How often the runs written are swept of those remembered long enough: the ticker's other
/// work looks only at the pending summaries, so a process that wrote 100k waiting runs does not
/// walk them every tick.
const SWEEP_EVERY: Duration = Duration::from_secs(15);

/// The step service's writes to the runs list. Cheap to clone; shared by a process's drivers.
#[derive(Clone)]
pub(super) struct Listing(Arc<Inner>);

struct Inner {
    interval: Duration,
    store: OnceCell<Store>,
    runs: Mutex<Runs>,
    ticker: std::sync::Once,
    /// Whether a failure was logged (the next are only counted).
    warned: std::sync::atomic::AtomicBool,
}

/// What this process knows of the runs it lists.
#[derive(Debug)]
struct Runs {
    /// What it stored of each run it wrote lately, and when.
    written: HashMap<RunId, Written>,
    /// The newest busy summary of each run, not written yet.
    pending: HashMap<RunId, RunSummary>,
    /// When `written` was last swept ([`SWEEP_EVERY`]).
    swept: Instant,
}

/// What this process stored of a run, and when.
#[derive(Debug)]
struct Written {
    known: Known,
    at: Instant,
}

/// What to do with a run's summary after a drive.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Plan {
    /// Stored through its sequence already (by this process): nothing.
    Nothing,
    /// Written now, before the drive lets go of the run.
    AtOnce,
    /// Left to the ticker.
    Coalesce,
}

/// What to do with `summary`, given what this process `known`s stored of its run.
fn plan(known: Option<&Known>, summary: &RunSummary) -> Plan {
    if known.is_some_and(|k| k.seq >= summary.seq) {
        Plan::Nothing
    } else if summary.status.is_busy() {
        Plan::Coalesce
    } else {
        Plan::AtOnce
    }
}

/// Whether a run's pending write is due: the interval passed since its last write here (or it
/// had none).
fn due(written: Option<&Written>, now: Instant, interval: Duration) -> bool {
    written.is_none_or(|w| now.saturating_duration_since(w.at) >= interval)
}

impl Listing {
    pub(super) fn new(interval: Duration) -> Listing {
        Listing(Arc::new(Inner {
            interval,
            store: OnceCell::new(),
            runs: Mutex::new(Runs {
                written: HashMap::new(),
                pending: HashMap::new(),
                swept: Instant::now(),
            }),
            ticker: std::sync::Once::new(),
            warned: Default::default(),
        }))
    }

    /// Writes (or plans the write of) the summary of `state`, a run's fold after a drive.
    pub(super) async fn after_drive(&self, rt: &Runtime, state: &RunState) {
        // The ticker also forgets the runs written here a while ago, busy or not.
        self.start_ticker(rt);
        let summary = RunSummary::of(state);
        let known = {
            let mut runs = self.0.lock();
            let known = runs.written.get(&summary.run_id).map(|w| &w.known);
            match plan(known, &summary) {
                Plan::Nothing => return,
                Plan::Coalesce => {
                    runs.pending.insert(summary.run_id.clone(), summary);
                    return;
                }
                Plan::AtOnce => {
                    let known = known.cloned();
                    // Written now; an older busy summary waiting is superseded.
                    runs.pending.remove(&summary.run_id);
                    known
                }
            }
        };
        self.0.write(rt, &summary, known, ListWrite::AtOnce).await;
    }

    /// Writes every pending summary now (the service is stopping), for at most
    /// [`FLUSH_WITHIN`]: a broker that does not answer does not hold up the stop (what is left
    /// is written by the run's next drive, here or elsewhere).
    pub(super) async fn flush(&self, rt: &Runtime) {
        let pending = self.0.take(|_| true);
        let count = pending.len();
        if tokio::time::timeout(FLUSH_WITHIN, self.0.write_all(rt, pending))
            .await
            .is_err()
        {
            tracing::warn!(
                pending = count,
                "the runs list's last writes did not all finish before the stop"
            );
        }
    }

    fn start_ticker(&self, rt: &Runtime) {
        self.0.ticker.call_once(|| {
            let inner = Arc::downgrade(&self.0);
            let rt = rt.clone();
            tokio::spawn(tick(inner, rt));
        });
    }
}

/// Writes the due summaries every quarter interval, until the listing is dropped.
async fn tick(inner: Weak<Inner>, rt: Runtime) {
    let period = match inner.upgrade() {
        Some(inner) => (inner.interval / 4).max(Duration::from_millis(5)),
        None => return,
    };
    let mut ticks = tokio::time::interval(period);
    ticks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ticks.tick().await;
        let Some(inner) = inner.upgrade() else {
            return;
        };
        let now = Instant::now();
        let interval = inner.interval;
        inner.sweep(now);
        let due = inner.take(|written| due(written, now, interval));
        inner.write_all(&rt, due).await;
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, Runs> {
        // Nothing panics holding it; a poisoned map is still whole.
        self.runs
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Takes the pending summaries of the runs `pick` chooses by what was written of them,
    /// with what is known of each.
    fn take(&self, pick: impl Fn(Option<&Written>) -> bool) -> Vec<(RunSummary, Option<Known>)> {
        let mut runs = self.lock();
        let Runs {
            written, pending, ..
        } = &mut *runs;
        pending
            .extract_if(|run, _| pick(written.get(run)))
            .map(|(run, summary)| (summary, written.get(&run).map(|w| w.known.clone())))
            .collect()
    }

    /// Forgets, every [`SWEEP_EVERY`], the runs not written here for [`REMEMBERED`].
    fn sweep(&self, now: Instant) {
        let mut runs = self.lock();
        if now.saturating_duration_since(runs.swept) < SWEEP_EVERY {
            return;
        }
        runs.swept = now;
        runs.written
            .retain(|_, w| now.saturating_duration_since(w.at) < REMEMBERED);
    }

    async fn write_all(&self, rt: &Runtime, summaries: Vec<(RunSummary, Option<Known>)>) {
        futures::stream::iter(summaries)
            .for_each_concurrent(WRITING, |(summary, known)| async move {
                self.write(rt, &summary, known, ListWrite::Coalesced).await;
            })
            .await;
    }

    /// Writes `summary` from what is `known` of it, and notes what is stored afterwards.
    async fn write(
        &self,
        rt: &Runtime,
        summary: &RunSummary,
        known: Option<Known>,
        when: ListWrite,
    ) {
        let hint = known.map_or(Hint::Unknown, Hint::Stored);
        let stored = match self.store.get_or_try_init(|| Store::open(rt)).await {
            Ok(store) => store
                .store(summary, false, hint)
                .await
                .map_err(|e| e.to_string()),
            Err(e) => Err(e.to_string()),
        };
        let run = &summary.run_id;
        match stored {
            Ok((_, stored)) => {
                metrics::list_write(when);
                let mut runs = self.lock();
                if summary.finished {
                    // Ended: nothing more to write unless it is revived (then read again).
                    runs.written.remove(run);
                    if runs.pending.get(run).is_some_and(|p| p.seq <= summary.seq) {
                        runs.pending.remove(run);
                    }
                    return;
                }
                let now = Instant::now();
                runs.written
                    .entry(run.clone())
                    .and_modify(|w| {
                        if (w.known.seq, w.known.revision) < (stored.seq, stored.revision) {
                            w.known = stored.clone();
                        }
                        w.at = now;
                    })
                    .or_insert(Written {
                        known: stored,
                        at: now,
                    });
            }
            Err(e) => {
                metrics::list_write(ListWrite::Failed);
                if self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                    tracing::debug!(run_id = %run, error = %e, "could not write the run's summary to the runs list");
                } else {
                    tracing::warn!(run_id = %run, error = %e, "could not write the run's summary to the runs list (further failures are counted in kedge_step_list_writes_total{{when=\"failed\"}})");
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::RunStatus;
    use kedge_core::event::{Timestamp, Usage, WaitReason};

    fn summary(status: RunStatus, seq: u64) -> RunSummary {
        RunSummary {
            run_id: RunId::generate(),
            tenant: "acme".parse().expect("a tenant"),
            agent: "demo".parse().expect("an agent"),
            status,
            finished: status.is_terminal(),
            turn: 1,
            step: 2,
            waiting_on: match status {
                RunStatus::WaitingTool => Some(WaitReason::Tool),
                RunStatus::WaitingApproval => Some(WaitReason::Approval),
                _ => None,
            },
            queued: None,
            usage: Usage::default(),
            validation: None,
            created_at: Timestamp::now(),
            updated_at: Timestamp::now(),
            seq,
        }
    }

    fn known(seq: u64) -> Known {
        Known {
            seq,
            revision: 4,
            tenant: "acme".parse().expect("a tenant"),
        }
    }

    #[test]
    fn a_busy_run_is_coalesced_and_any_other_written_at_once() {
        for &status in RunStatus::ALL {
            let expected = match status {
                RunStatus::Running | RunStatus::WaitingTool => Plan::Coalesce,
                _ => Plan::AtOnce,
            };
            assert_eq!(plan(None, &summary(status, 9)), expected, "{status}");
            assert_eq!(
                plan(Some(&known(8)), &summary(status, 9)),
                expected,
                "{status}"
            );
        }
    }

    #[test]
    fn a_summary_stored_through_its_sequence_is_not_written_again() {
        for seq in [9, 10] {
            assert_eq!(
                plan(Some(&known(seq)), &summary(RunStatus::Succeeded, 9)),
                Plan::Nothing
            );
            assert_eq!(
                plan(Some(&known(seq)), &summary(RunStatus::Running, 9)),
                Plan::Nothing
            );
        }
    }

    #[test]
    fn a_pending_write_is_due_an_interval_after_the_last() {
        let interval = Duration::from_millis(250);
        let now = Instant::now();
        assert!(due(None, now, interval), "never written here: at once");
        let written = Written {
            known: known(3),
            at: now,
        };
        assert!(!due(
            Some(&written),
            now + Duration::from_millis(100),
            interval
        ));
        assert!(due(Some(&written), now + interval, interval));
    }

    #[test]
    fn the_ticker_takes_only_due_pending_summaries_and_sweeps_on_its_own_clock() {
        let interval = Duration::from_millis(250);
        let listing = Listing::new(interval);
        let inner = &listing.0;
        let now = Instant::now();
        let (fresh, stale, idle) = (
            summary(RunStatus::Running, 5),
            summary(RunStatus::Running, 6),
            summary(RunStatus::WaitingApproval, 7),
        );
        {
            let mut runs = inner.lock();
            // `fresh` was written just now, `stale` an interval ago, `idle` long ago (nothing
            // pending for it).
            for (s, at) in [
                (&fresh, now),
                (&stale, now - interval),
                (&idle, now - REMEMBERED),
            ] {
                runs.written.insert(
                    s.run_id.clone(),
                    Written {
                        known: known(s.seq - 1),
                        at,
                    },
                );
            }
            runs.pending.insert(fresh.run_id.clone(), fresh.clone());
            runs.pending.insert(stale.run_id.clone(), stale.clone());
        }
        let taken = inner.take(|w| due(w, now, interval));
        assert_eq!(taken.len(), 1);
        assert_eq!(taken[0].0.run_id, stale.run_id);
        assert_eq!(taken[0].1.as_ref().map(|k| k.seq), Some(5));
        assert_eq!(inner.lock().pending.len(), 1, "the fresh one waits");
        // Not swept before its clock: every run written is still known.
        inner.sweep(now);
        assert_eq!(inner.lock().written.len(), 3);
        inner.sweep(now + SWEEP_EVERY);
        let runs = inner.lock();
        assert!(!runs.written.contains_key(&idle.run_id), "forgotten");
        assert!(runs.written.contains_key(&fresh.run_id));
        assert!(runs.written.contains_key(&stale.run_id));
    }
}
