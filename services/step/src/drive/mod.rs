//! One drive of one run: lease, fold, decide, act, until idle (docs/ARCHITECTURE.md "The step
//! service").
//!
//! This module holds the drive itself: [`Driver::drive`] takes the run's lease and reads its
//! state at once, then loops on [`kedge_core::decide::decide`] under the lease until the run is
//! idle. What a drive is made of lives beside it:
//!
//! - `holding`: the run's lease: taken, renewed while the drive runs, parked between drives,
//!   yielded to another worker, taken over from a holder that is gone;
//! - `cache`: the run's folded state, kept between drives and brought up to date from the
//!   journal;
//! - `set_aside`: the record of journal messages that are not events of the run;
//! - `commit`: appending the run's decisions under the lease;
//! - `precondition`: the target version an approval request is asked with;
//! - `step`: one step of the run, its model's answer kept, reused or given up;
//! - `model`: the model call itself, what it is counted as, and its retry delay;
//! - `provider`: where the call goes, and how a run waits on its provider;
//! - `context`: compacting the model's context to fit its window;
//! - `children`: the child runs of `run_agent` operations, and a child's result to its parent;
//! - `inline`: built-in tools the drive runs itself (docs/ARCHITECTURE.md "Inline tools");
//! - `listing`: the run's summary in the runs list, written from the fold the drive left.

mod cache;
mod children;
mod commit;
mod context;
mod holding;
mod inline;
mod listing;
mod model;
mod precondition;
mod provider;
mod quota;
mod set_aside;
mod slots;
mod step;

pub use inline::INLINE_PER_DRIVE;

use kedge_core::Decision;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use async_nats::jetstream::Message;
use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{Idle, Next, decide};
use kedge_core::event::{Draft, FailureReason, RunFailed, Timestamp};
use kedge_core::fold::{FoldError, RunState};
use kedge_core::ids::RunId;
use kedge_core::machine::RunStatus;
use kedge_core::tools::Contract;
use kedge_journal::{ErrorKind, JournalError, LeaseError, Released};
use kedge_model::ModelClient;
use kedge_runtime::Runtime;
use kedge_runtime::agents::AgentError;
use kedge_runtime::failpoint;
use kedge_runtime::idempotency::IdempotencyError;
use kedge_runtime::liveness::Liveness;
use kedge_runtime::provider::ProviderError;
use tokio::sync::watch;
use tracing::Instrument;

use cache::{Read, Skipped, delivered, is_backlog, per_run};
use commit::Writing;
use holding::{Keeper, Parked};
use kedge_core::bounded::Bounded;

/// How a drive ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The run has nothing to do until its next input.
    Idle,
    /// Another worker holds the run's lease.
    Busy,
}

/// Why a drive stopped early.
#[derive(Debug, thiserror::Error)]
pub enum DriveError {
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Lease(#[from] LeaseError),
    #[error("the journal does not fold: {0}")]
    Fold(#[from] FoldError),
    #[error(transparent)]
    Idempotency(#[from] IdempotencyError),
    #[error(transparent)]
    Agent(#[from] AgentError),
    #[error(transparent)]
    Provider(#[from] ProviderError),
    #[error("the run has no events")]
    NoRun,
    #[error("lost the lease while the model ran")]
    LeaseLost,
    /// An approval request needs the target's version and no tool runner gave it.
    #[error("precondition query for `{tool}`: {reason}")]
    Precondition { tool: String, reason: String },
    /// `kedge_slots` (the slots of concurrency keys) could not be read or written now.
    #[error(transparent)]
    Slots(#[from] kedge_runtime::slots::SlotError),
    /// An operation run inside the drive did not come to an answer (broker trouble, a request
    /// the journal does not hold).
    #[error(transparent)]
    Inline(kedge_tool::InlineError),
    /// The drive panicked (a bug): contained by the service, retried a bounded number of times.
    #[error("the drive panicked: {0}")]
    Panicked(String),
}

impl DriveError {
    /// Whether trying again later may succeed.
    pub fn is_retryable(&self) -> bool {
        match self {
            DriveError::Journal(e) => {
                matches!(e.kind(), ErrorKind::Unavailable | ErrorKind::Conflict)
            }
            DriveError::Lease(LeaseError::Unavailable { .. }) | DriveError::LeaseLost => true,
            DriveError::Idempotency(IdempotencyError::Unavailable(_)) => true,
            DriveError::Agent(AgentError::Unavailable(_)) => true,
            DriveError::Provider(ProviderError::Unavailable(_)) => true,
            DriveError::NoRun => true,
            DriveError::Precondition { .. } => true,
            DriveError::Slots(kedge_runtime::slots::SlotError::Unavailable(_)) => true,
            DriveError::Inline(e) => e.retryable,
            DriveError::Lease(_)
            | DriveError::Fold(_)
            | DriveError::Idempotency(_)
            | DriveError::Agent(_)
            | DriveError::Slots(_)
            | DriveError::Panicked(_) => false,
        }
    }
}

/// Drives runs. Cheap to clone.
#[derive(Clone)]
pub struct Driver {
    /// Shared: a driver is cloned per drive and per parked lease.
    rt: Arc<Runtime>,
    model: ModelClient,
    /// Runs whose cancellation was just requested (from a core-NATS subscription on
    /// `cancel.requested` inputs); an in-flight model call of such a run is aborted.
    cancels: tokio::sync::broadcast::Sender<RunId>,
    /// Folded states of runs this process drove, so that a drive reads only what was appended
    /// since (the journal is append-only, so a cached state plus the events after it is exact),
    /// each with the sequences its appends skipped ([`Skipped`]).
    cache: Arc<std::sync::Mutex<Bounded<RunId, (RunState, Skipped)>>>,
    /// The release markers this process left on runs' leases: the next acquire of such a run
    /// tries to take over its own marker first (one round trip instead of two).
    released: Arc<std::sync::Mutex<Bounded<RunId, Released>>>,
    /// The failure detector: a lease held by a process that is gone is taken over at once, and
    /// the runs this process holds are announced in its heartbeats.
    liveness: Liveness,
    /// Runs adopted from a worker found gone, and when that worker was last heard: the
    /// takeover's latency ([`kedge_runtime::metrics::TAKEOVER_SECONDS`]) once the lease is taken.
    adopted: Arc<std::sync::Mutex<Bounded<RunId, std::time::Instant>>>,
    /// Runs this process took over from a worker found gone, and when that worker was last
    /// heard: an attempt it left unfinished may still have its answer stored within
    /// `reconnect_grace` of then ([`Driver::await_interrupted_answer`]).
    taken_from: Arc<std::sync::Mutex<Bounded<RunId, std::time::Instant>>>,
    /// Child runs this process made sure exist (their `run.created` is journaled): not written
    /// again on the parent's next drives.
    children: Arc<std::sync::Mutex<std::collections::HashSet<RunId>>>,
    /// Leases kept after drives that left their runs waiting on tools ([`Parked`]).
    parked: Arc<std::sync::Mutex<std::collections::HashMap<RunId, Parked>>>,
    park_ids: Arc<AtomicU64>,
    /// The slots of concurrency keys (`kedge_slots`), opened on first use.
    slots: Arc<tokio::sync::OnceCell<kedge_runtime::slots::Slots>>,
    /// The runs' summaries this process writes to the runs list after its drives.
    listing: listing::Listing,
    /// Built-in tools run inside the drives, when this process runs the tool service too
    /// (docs/ARCHITECTURE.md "Inline tools").
    inline: Option<kedge_tool::Inline>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("worker", &self.rt.config.worker_id)
            .finish_non_exhaustive()
    }
}

impl Driver {
    pub fn new(
        rt: Runtime,
        model: ModelClient,
        cancels: tokio::sync::broadcast::Sender<RunId>,
        liveness: Liveness,
        inline: Option<kedge_tool::Inline>,
    ) -> Self {
        let list_interval = rt.config.bridge.runs_list_interval_ms;
        Self {
            rt: Arc::new(rt),
            model,
            cancels,
            liveness,
            cache: per_run(),
            released: per_run(),
            adopted: per_run(),
            taken_from: per_run(),
            children: Arc::default(),
            parked: Arc::default(),
            park_ids: Arc::default(),
            slots: Arc::default(),
            listing: listing::Listing::new(std::time::Duration::from_millis(list_interval)),
            inline,
        }
    }

    /// This driver over another runtime of the process, its light lane (docs/ARCHITECTURE.md
    /// "Fairness across tenants"): the same states, parked leases and adopted runs, its
    /// broker operations on that runtime's connection, its model calls on `model`'s
    /// connections. A pooled HTTP connection is read by the threads of the runtime that opened
    /// it, so the lane needs a client of its own: over the shared one its calls would mostly
    /// ride connections the backlog's drives opened, read by the shared threads.
    pub fn on(&self, rt: Runtime, model: ModelClient) -> Self {
        Self {
            inline: self.inline.as_ref().map(|i| i.on(rt.clone())),
            rt: Arc::new(rt),
            model,
            ..self.clone()
        }
    }

    /// Writes the runs' summaries still waiting for their turn (the service is stopping).
    pub async fn flush_list(&self) {
        self.listing.flush(&self.rt).await;
    }

    /// Where this driver's drives are spawned ([`Runtime::executor`]: the light lane's threads
    /// for a driver on it).
    pub fn executor(&self) -> Option<tokio::runtime::Handle> {
        self.rt.executor().cloned()
    }

    /// Drives `run` until it is idle. `msg` is the wake being handled (marked in progress while
    /// the model runs).
    ///
    /// `through` is the stream sequence of the newest wake being handled (an event of the run
    /// the broker has acknowledged): the run is read up to it without asking the stream leader
    /// where the run ends. `msg` `None` (an adopted run) reads with the leader's check, and its
    /// lease from the leader (`Driver::acquire`). `absorbed`:
    /// that newest wake, when it is not `msg` but one a drive in progress absorbed (its chain
    /// may be read, see `Driver::refresh`).
    pub async fn drive(
        &self,
        run: &RunId,
        msg: Option<Arc<Message>>,
        through: Option<u64>,
        absorbed: Option<Arc<Message>>,
    ) -> Result<Outcome, DriveError> {
        let cfg = &self.rt.config;
        // A wake from a backlog (a fresh process catching up, a redelivery) is looked at before
        // the lease is taken: a run it finds idle needs no lease (see `backlog_look`).
        let looked = match msg.as_deref() {
            Some(m) if is_backlog(m) => match self.backlog_look(run, through).await? {
                Some(state) => Some(state),
                None => return Ok(Outcome::Idle),
            },
            _ => None,
        };
        // The lease and the run's state are fetched at once (one round trip instead of two on
        // the way to the next decision). Reading without the lease is harmless: a state made
        // stale by another holder's appends meets the concurrency check and is read again.
        let (lease, read) = match looked {
            Some(state) => (
                self.acquire(run, false).await,
                Ok(Some(Read {
                    state,
                    skipped: Skipped::new(),
                    chained: false,
                })),
            ),
            None => {
                let wake = absorbed
                    .as_deref()
                    .or(msg.as_deref())
                    .and_then(|m| delivered(m, through));
                futures::join!(
                    self.acquire(run, msg.is_none()),
                    self.read_state(run, through, wake)
                )
            }
        };
        let holding = match lease {
            Ok(Some(holding)) => holding,
            other => {
                // Not ours to drive now: what was read stays good for the next drive here.
                if let Ok(Some(read)) = read {
                    self.keep(read.state, read.skipped);
                }
                return other.map(|_| Outcome::Busy);
            }
        };
        // A state brought up to date by its chain, under a lease another worker may have held
        // since this process last did: that worker may have been woken by an input a link
        // stepped over (in flight on a clustered stream as it was checked) and left the run as
        // it was. What the links stepped over is read now, as the net would later.
        let (state, skipped) = match read {
            Ok(Some(mut read)) if read.chained && !holding.continuous => {
                match self
                    .refresh(&mut read.state, &mut read.skipped, through, None)
                    .await
                {
                    Ok(_) => (Ok(Some(read.state)), read.skipped),
                    Err(e) => (Err(e), Skipped::new()),
                }
            }
            Ok(Some(read)) => (Ok(Some(read.state)), read.skipped),
            Ok(None) => (Ok(None), Skipped::new()),
            Err(e) => (Err(e), Skipped::new()),
        };
        // Announced in this process's heartbeats while held: if it dies, a standby adopts the
        // run as soon as the broker says it is gone.
        let hold = match holding.hold {
            Some(hold) => hold,
            None => self.liveness.hold_run(run).await,
        };
        // The right to write the run's decisions comes from the lease; its name is stable for
        // this holding, so a retried append is recognised as ours.
        let writer = holding.lease.writer();
        let mut w = Writing {
            writer: &writer,
            stale_through: None,
            skipped,
            inline: Vec::new(),
            inline_budget: inline::INLINE_PER_DRIVE,
        };
        let keeper = Keeper::start(&self.rt, holding.lease, holding.written, msg);
        let mut lost = keeper.lost.clone();
        let span = tracing::info_span!("drive", run_id = %run);
        // The run's trace (from its run.created), when it was read with the lease.
        if let Ok(Some(state)) = &state {
            kedge_runtime::trace::set_parent(&span, state.bundle.traceparent.as_deref());
        }
        let result = self
            .drive_leased(run, &mut w, &mut lost, state)
            .instrument(span)
            .await;
        match keeper.finish().await {
            // The run waits on its tools: their results wake it in a moment, most likely here.
            Some((lease, written))
                if cfg.park_leases && matches!(result, Ok(Some(Idle::WaitingTools { .. }))) =>
            {
                self.park(lease, written, hold).await
            }
            Some((lease, _)) => {
                self.release(lease).await;
                drop(hold);
            }
            None => drop(hold),
        }
        result.map(|_| Outcome::Idle)
    }

    async fn drive_leased(
        &self,
        run: &RunId,
        w: &mut Writing<'_>,
        lost: &mut watch::Receiver<bool>,
        state: Result<Option<RunState>, DriveError>,
    ) -> Result<Option<Idle>, DriveError> {
        // A panic here (a bug; or the test failpoint) is contained by the service: the wake is
        // handed back and the lease expires.
        failpoint::panic_point("step.drive", run.as_str());
        let Some(mut state) = state? else {
            tracing::debug!(run_id = %run, "woken for a run that has no run.created; nothing to drive");
            return Ok(None);
        };
        let result = self.drive_state(&mut state, w, lost).await;
        if result.is_ok() {
            // Before the lease is let go (docs/ARCHITECTURE.md "The bridge and the runs
            // projection").
            self.listing.after_drive(&self.rt, &state).await;
            self.keep(state, std::mem::take(&mut w.skipped));
        }
        result.map(Some)
    }

    async fn drive_state(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<Idle, DriveError> {
        let run = state.run_id.clone();
        // Waiting on its provider, not released: the wait's record is the fleet's to remove
        // when it releases the run, this drive's when the run stops waiting otherwise.
        let waited = state.status == RunStatus::WaitingProvider
            && state
                .provider
                .as_ref()
                .is_some_and(|p| p.released.is_none());
        loop {
            if *lost.borrow() {
                return Err(DriveError::LeaseLost);
            }
            match decide(state) {
                // Built-in tools run here, and the run goes on with their results: while it
                // waits on its tools, and in any other wait an unfinished inline operation
                // would hold up (a cancelling run's, whose result says it was not run).
                Next::Idle(why)
                    if why != Idle::Terminal && self.run_inline(state, w, lost).await? => {}
                Next::Idle(why) => {
                    tracing::debug!(run_id = %run, ?why, status = %state.status, "idle");
                    if why == Idle::Terminal {
                        self.release_slot(state).await;
                    }
                    self.tend_children(state, w.writer).await?;
                    self.tend_provider_wait(state, waited).await?;
                    if state.status.is_terminal() {
                        self.count_active(state, false).await;
                    }
                    return Ok(why);
                }
                Next::Commit(drafts) => {
                    let revived = drafts
                        .iter()
                        .any(|d| matches!(d.event, kedge_core::Decision::RunRevived(_)));
                    if self.commit(state, w, drafts).await? && revived {
                        self.count_active(state, true).await;
                    }
                }
                Next::Step(plan) => match self.admit(state, w, &plan).await? {
                    slots::Admit::Go => self.step(state, w, *plan, lost).await?,
                    slots::Admit::Wait => return Ok(Idle::Queued),
                    slots::Admit::Again => {}
                },
                Next::Finish(cut) => {
                    tracing::warn!(run_id = %run, step = %cut.step, landed = cut.landed, "finishing a step's decisions cut short");
                    let contract = match self.definition(state).await? {
                        Ok((_, contract)) => contract,
                        Err(reason) => {
                            self.commit(state, w, vec![internal_failure(reason)])
                                .await?;
                            continue;
                        }
                    };
                    let rest =
                        kedge_core::decide::finish_step(state, &cut, Timestamp::now(), &contract);
                    self.commit(state, w, rest).await?;
                }
            }
        }
    }

    /// The run's agent revision, checked against the digests its `run.created` froze, and its
    /// tool contract (both computed once per revision by the agent store). `Ok(Err(reason))`
    /// when the run cannot go on with it (gone, corrupt, or no longer what `run.created` froze:
    /// the run fails); `Err` when `kedge_agents` cannot be read now (broker trouble, a stream
    /// leader being elected: the drive is tried again, the run does not fail).
    async fn definition(
        &self,
        state: &RunState,
    ) -> Result<Result<(Arc<AgentDefinition>, Arc<Contract>), String>, DriveError> {
        let b = &state.bundle;
        let revision = match self.rt.agents.revision(&b.agent, b.agent_revision).await {
            Ok(revision) => revision,
            Err(e @ AgentError::Unavailable(_)) => return Err(e.into()),
            Err(e) => return Ok(Err(e.to_string())),
        };
        if *revision.prompt_digest() != b.prompt_digest
            || *revision.tools_digest() != b.tools_digest
        {
            return Ok(Err(format!(
                "agent {} revision {} no longer matches the digests frozen in run.created",
                b.agent, b.agent_revision
            )));
        }
        Ok(Ok((revision.def.clone(), revision.contract())))
    }
}

/// The `run.failed` of a run that cannot go on with its agent revision (`reason`, see
/// [`Driver::definition`]).
fn internal_failure(reason: String) -> Draft<Decision> {
    Draft::new(Decision::RunFailed(RunFailed {
        reason: FailureReason::Internal,
        message: reason,
        effects: Vec::new(),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_failures_that_may_pass_later_are_retryable() {
        let retryable = [
            DriveError::Journal(JournalError::Unavailable {
                op: "read",
                reason: "no leader".into(),
            }),
            DriveError::Journal(JournalError::Conflict {
                expected: 3,
                actual: 4,
            }),
            DriveError::Lease(LeaseError::Unavailable {
                op: "renew",
                reason: "timeout".into(),
            }),
            DriveError::LeaseLost,
            DriveError::Idempotency(IdempotencyError::Unavailable("no leader".into())),
            DriveError::Agent(AgentError::Unavailable("no leader".into())),
            DriveError::Provider(ProviderError::Unavailable("no leader".into())),
            DriveError::NoRun,
            DriveError::Precondition {
                tool: "deploy".into(),
                reason: "no tool runner answered in time".into(),
            },
        ];
        for e in &retryable {
            assert!(e.is_retryable(), "`{e}` should be retried");
        }
        let not_retryable = [
            DriveError::Journal(JournalError::Invalid {
                seq: 7,
                reason: "not an envelope".into(),
            }),
            DriveError::Lease(LeaseError::Held {
                owner: "w2".into(),
                revision: 1,
            }),
            DriveError::Fold(FoldError::Empty),
            DriveError::Idempotency(IdempotencyError::Corrupt {
                key: "k".into(),
                reason: "not JSON".into(),
            }),
            DriveError::Agent(AgentError::NotFound("demo".parse().expect("an agent name"))),
            DriveError::Panicked("index out of bounds".into()),
        ];
        for e in &not_retryable {
            assert!(!e.is_retryable(), "`{e}` should not be retried");
        }
    }

    #[test]
    fn a_revision_the_run_cannot_go_on_with_fails_the_run_as_internal() {
        let draft = internal_failure("agent demo revision 2 no longer matches".into());
        let Decision::RunFailed(failed) = draft.event else {
            panic!("not a run.failed: {:?}", draft.event);
        };
        assert_eq!(failed.reason, FailureReason::Internal);
        assert_eq!(failed.message, "agent demo revision 2 no longer matches");
        assert!(failed.effects.is_empty());
    }
}
