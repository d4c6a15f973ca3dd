//! One drive of one run: lease, fold, decide, act, until idle.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use async_nats::jetstream::{AckKind, Message};
use kedge_core::agent::AgentDefinition;
use kedge_core::answers::{TargetAnswer, TargetQuery};
use kedge_core::child;
use kedge_core::decide::{Idle, Next, StepPlan, TroubleMet, complete_step, decide};
use kedge_core::event::{
    AttemptOutcome, CancelRequested, Draft, Envelope, ErrorClass, Event, FailureReason,
    ModelAttempt, RunFailed, Timestamp, ToolResult, Trouble,
};
use kedge_core::fold::{ChatMessage, FoldError, RunState, ToolOp};
use kedge_core::ids::{InputId, ModelRequestId, OperationId, RunId};
use kedge_core::machine::RunStatus;
use kedge_core::subjects::{self, TOOL_INSPECT};
use kedge_core::tools::Contract;
use kedge_journal::{
    DecisionWriter, Delivered, ErrorKind, JournalError, Lease, LeaseError, Released,
};
use kedge_model::{Delta, ModelCall, ModelClient, ModelError};
use kedge_runtime::Runtime;
use kedge_runtime::agents::AgentError;
use kedge_runtime::failpoint;
use kedge_runtime::idempotency::{IdempotencyError, StoredResponse};
use kedge_runtime::liveness::{Hold, Liveness};
use kedge_runtime::metrics::{self, ModelOutcome, StepRead, Takeover};
use kedge_runtime::provider::{
    Admit, Endpoint, Limits, ProviderError, Providers, Route, TroubleReport, Waiter,
};
use kedge_runtime::seal::{self, SealError};
use tokio::sync::{oneshot, watch};
use tracing::Instrument;

/// How long the step waits for a tool runner's precondition check.
const PRECONDITION_TIMEOUT: Duration = Duration::from_secs(5);

/// How long a worker woken for a run whose lease another live worker holds waits for that
/// worker's answer to "let go of it if you keep it parked" (no answer: busy, as before).
const YIELD_TIMEOUT: Duration = Duration::from_millis(500);

/// A lease with less than this left of its parking window is released at once instead.
const MIN_PARK: Duration = Duration::from_millis(50);

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
            DriveError::Lease(_)
            | DriveError::Fold(_)
            | DriveError::Idempotency(_)
            | DriveError::Agent(_)
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
    cache: Arc<std::sync::Mutex<std::collections::HashMap<RunId, (RunState, Skipped)>>>,
    /// The release markers this process left on runs' leases: the next acquire of such a run
    /// tries to take over its own marker first (one round trip instead of two).
    released: Arc<std::sync::Mutex<std::collections::HashMap<RunId, Released>>>,
    /// The failure detector: a lease held by a process that is gone is taken over at once, and
    /// the runs this process holds are announced in its heartbeats.
    liveness: Liveness,
    /// Runs adopted from a worker found gone, and when that worker was last heard: the
    /// takeover's latency ([`metrics::TAKEOVER_SECONDS`]) once the lease is taken.
    adopted: Arc<std::sync::Mutex<std::collections::HashMap<RunId, std::time::Instant>>>,
    /// Runs this process took over from a worker found gone, and when that worker was last
    /// heard: an attempt it left unfinished may still have its answer stored within
    /// `reconnect_grace` of then ([`Driver::await_interrupted_answer`]).
    taken_from: Arc<std::sync::Mutex<std::collections::HashMap<RunId, std::time::Instant>>>,
    /// Child runs this process made sure exist (their `run.created` is journaled): not written
    /// again on the parent's next drives.
    children: Arc<std::sync::Mutex<std::collections::HashSet<RunId>>>,
    /// Leases kept after drives that left their runs waiting on tools ([`Parked`]).
    parked: Arc<std::sync::Mutex<std::collections::HashMap<RunId, Parked>>>,
    park_ids: Arc<AtomicU64>,
}

impl std::fmt::Debug for Driver {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Driver")
            .field("worker", &self.rt.config.worker_id)
            .finish_non_exhaustive()
    }
}

/// How one drive writes the run's decisions.
struct Writing<'a> {
    writer: &'a DecisionWriter,
    /// Set when an append was not folded in: the state lacks the journal through this
    /// sequence until [`Driver::catch_up`].
    stale_through: Option<u64>,
    /// What the state's appends skipped since it was last read.
    skipped: Skipped,
}

/// Stream sequences a run's state stepped over without reading them: an append checked against
/// the run's last message ([`kedge_journal::Journal::append_decision_current`]) is folded in as
/// it lands, and the sequences between the state's last event and it are other runs' messages
/// as far as the broker's check says. Nothing relies on that alone (a clustered stream's leader
/// does not see a message of the run still in flight): the state's next read
/// ([`Driver::refresh`]) starts at the first of them, and a message of the run found there (the
/// broker accepted an append past it after all) makes the state be folded again from the
/// journal, so a state never stands on a missed input.
type Skipped = Vec<(u64, u64)>;

/// Most skipped ranges a state may carry into a chained read ([`Driver::refresh`]); with more,
/// the run is read the batched way, which checks and clears them. A chained agent-loop step
/// notes about five (its three appends and the two links), so this is about 25 steps.
const CHAINED_SKIPPED_MAX: usize = 128;

/// The wake `msg` as the journal reads it, when it is the message `through` names (a drive
/// that absorbed later wakes reads through the newest of them instead).
fn delivered(msg: &Message, through: Option<u64>) -> Option<Delivered<'_>> {
    let seq = msg.info().ok()?.stream_sequence;
    (Some(seq) == through).then(|| Delivered {
        seq,
        subject: msg.subject.as_str(),
        headers: msg.headers.as_ref(),
        payload: &msg.payload,
    })
}

/// A run's state as read for a drive, with the sequences it stepped over.
struct Read {
    state: RunState,
    skipped: Skipped,
    /// Brought up to date by its chain ([`Driver::refresh`]).
    chained: bool,
}

/// Whether `seq` is one the state stepped over.
fn was_skipped(skipped: &Skipped, seq: u64) -> bool {
    skipped
        .iter()
        .any(|&(first, last)| first <= seq && seq <= last)
}

/// Folds `events` and the messages `set_aside` among them into `state`, in sequence order.
fn fold_merged<'a>(
    state: &mut RunState,
    events: impl Iterator<Item = &'a kedge_journal::Recorded>,
    set_aside: &[kedge_journal::SetAside],
) -> Result<(), FoldError> {
    let mut aside = set_aside.iter().peekable();
    for r in events {
        while let Some(a) = aside.next_if(|a| a.seq < r.seq) {
            state.set_aside(a.seq, a.kind);
        }
        state.apply(r.seq, &r.envelope)?;
    }
    for a in aside {
        state.set_aside(a.seq, a.kind);
    }
    Ok(())
}

/// The refusal of a `run_agent` operation whose child's run id another run holds.
fn taken(id: &RunId) -> String {
    format!("not run: the child's run id {id} is taken by a run this operation did not start")
}

/// Runs whose folded state is kept between drives; beyond it the cache starts over.
const CACHE_RUNS: usize = 10_000;

/// A wake stored longer ago than this is a backlog (a fresh process catching up on the
/// journal, a redelivery): its run is looked at before its lease is taken
/// ([`Driver::backlog_look`]). A live run's wakes are milliseconds old and keep the one round
/// trip of lease and read together.
const BACKLOG_AGE: Duration = Duration::from_secs(2);

/// Whether `msg` was stored more than [`BACKLOG_AGE`] ago.
fn is_backlog(msg: &Message) -> bool {
    msg.info().is_ok_and(|info| {
        time::OffsetDateTime::now_utc() - info.published
            > time::Duration::try_from(BACKLOG_AGE).unwrap_or(time::Duration::MAX)
    })
}

/// A lease held by this process and when it was last written (taken before the write was
/// sent, so on the safe side of the TTL the broker counts from its store).
struct Holding {
    lease: Lease,
    written: Instant,
    /// The run's announcement in the heartbeats, kept from a parked holding.
    hold: Option<Hold>,
    /// Nobody else held the lease since this process last did: taken back from its parking or
    /// over its own release marker.
    continuous: bool,
}

/// What became of an attempt a gone holder left unfinished
/// ([`Driver::await_interrupted_answer`]).
enum Interrupted {
    /// Its answer, stored: reused.
    Answer(StoredResponse),
    /// The run moved on meanwhile (its holder came back and committed): decided again.
    Moved,
    /// No answer within the grace (or no reason to wait): the next attempt calls the model.
    NoAnswer,
}

/// How often the stored answer of an interrupted attempt is looked for
/// ([`Driver::await_interrupted_answer`]).
const INTERRUPTED_POLL: Duration = Duration::from_millis(200);

/// A lease kept after a drive that left its run waiting on its tools (the agent loop's next
/// drive follows in milliseconds): that drive takes it back without a write, instead of a
/// release now and an acquire then. Parked at most until the lease's next renewal was due
/// (`lease_renew_ms` after its last write), so a parked lease is never older than one in use
/// between two renewals; then released. Another step worker woken for the run asks for it on
/// `kedge.live.yield.<worker>` ([`Driver::yield_parked`]).
struct Parked {
    /// With the run's announcement in the heartbeats (`hold` is set).
    held: Holding,
    /// Tells this parking from a later one of the same run: the expiry releases only its own.
    id: u64,
}

/// Keeps a lease alive in the background and marks the wake message in progress.
struct Keeper {
    stop: oneshot::Sender<()>,
    task: tokio::task::JoinHandle<Option<(Lease, Instant)>>,
    lost: watch::Receiver<bool>,
}

impl Keeper {
    /// Renews `lease` every `lease_renew` after its last write at `written`.
    fn start(rt: &Runtime, lease: Lease, written: Instant, msg: Option<Arc<Message>>) -> Keeper {
        let (stop, mut stopped) = oneshot::channel();
        let (lost_tx, lost) = watch::channel(false);
        let leases = rt.leases.clone();
        let every = rt.config.timeouts.lease_renew();
        let task = tokio::spawn(async move {
            let mut lease = lease;
            let mut written = written;
            // The last renewal tried (one that failed is tried again `every` later, not at once).
            let mut tried = written;
            loop {
                tokio::select! {
                    _ = &mut stopped => return Some((lease, written)),
                    _ = tokio::time::sleep_until((tried + every).into()) => {}
                }
                let at = Instant::now();
                tried = at;
                match leases.renew(&lease).await {
                    Ok(renewed) => {
                        lease = renewed;
                        written = at;
                    }
                    // Broker trouble (a leader election, a reconnect): the lease is still ours
                    // until its TTL runs out or someone takes it; try again next time.
                    Err(e @ LeaseError::Unavailable { .. }) => {
                        tracing::warn!(run_id = %lease.run, error = %e, "lease renewal failed; will try again");
                    }
                    Err(e) => {
                        tracing::warn!(run_id = %lease.run, error = %e, "lease lost; giving the run up");
                        metrics::fenced_write(metrics::Fenced::Lease);
                        let _ = lost_tx.send(true);
                        return None;
                    }
                }
                if let Some(msg) = &msg {
                    let _ = msg.ack_with(AckKind::Progress).await;
                }
            }
        });
        Keeper { stop, task, lost }
    }

    /// Stops renewing and returns the lease if it is still held, and when it was last written.
    async fn finish(self) -> Option<(Lease, Instant)> {
        let _ = self.stop.send(());
        self.task.await.ok().flatten()
    }
}

impl Driver {
    pub fn new(
        rt: Runtime,
        model: ModelClient,
        cancels: tokio::sync::broadcast::Sender<RunId>,
        liveness: Liveness,
    ) -> Self {
        Self {
            rt: Arc::new(rt),
            model,
            cancels,
            liveness,
            cache: Arc::default(),
            released: Arc::default(),
            adopted: Arc::default(),
            taken_from: Arc::default(),
            children: Arc::default(),
            parked: Arc::default(),
            park_ids: Arc::default(),
        }
    }

    /// Notes that `run` is adopted from a worker whose last heartbeat was heard at `last_heard`
    /// (for the takeover latency metric; forgotten once the lease is taken, or in bulk).
    pub fn adopting(&self, run: &RunId, last_heard: std::time::Instant) {
        if let Ok(mut adopted) = self.adopted.lock() {
            if adopted.len() >= CACHE_RUNS {
                adopted.clear();
            }
            adopted.insert(run.clone(), last_heard);
        }
    }

    /// Drives `run` until it is idle. `msg` is the wake being handled (marked in progress while
    /// the model runs).
    ///
    /// `through` is the stream sequence of the newest wake being handled (an event of the run
    /// the broker has acknowledged): the run is read up to it without asking the stream leader
    /// where the run ends. `None` (an adopted run) reads with the leader's check. `absorbed`:
    /// that newest wake, when it is not `msg` but one a drive in progress absorbed (its chain
    /// may be read, see [`Driver::refresh`]).
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
                self.acquire(run).await,
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
                futures::join!(self.acquire(run), self.read_state(run, through, wake))
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
        let writer = holding.lease.writer(&cfg.worker_id);
        let mut w = Writing {
            writer: &writer,
            stale_through: None,
            skipped,
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

    /// Releases `lease`; its marker is this process's hint for the run's next acquire.
    async fn release(&self, lease: Lease) {
        let run = lease.run.clone();
        match self.rt.leases.release(lease).await {
            Ok(marker) => {
                if let Ok(mut released) = self.released.lock() {
                    if released.len() >= CACHE_RUNS {
                        released.clear();
                    }
                    released.insert(run, marker);
                }
            }
            Err(e) => {
                tracing::debug!(run_id = %run, error = %e, "lease release failed; it will expire")
            }
        }
    }

    /// Keeps `lease` (last written at `written`) for the run's next drive here until its next
    /// renewal would be due, then releases it ([`Parked`]).
    async fn park(&self, lease: Lease, written: Instant, hold: Hold) {
        let left = self
            .rt
            .config
            .timeouts
            .lease_renew()
            .saturating_sub(written.elapsed());
        if left < MIN_PARK {
            self.release(lease).await;
            return;
        }
        let run = lease.run.clone();
        let id = self.park_ids.fetch_add(1, Ordering::Relaxed);
        let refused = match self.parked.lock() {
            Ok(mut parked) if parked.len() < CACHE_RUNS => {
                let entry = Parked {
                    held: Holding {
                        lease,
                        written,
                        hold: Some(hold),
                        continuous: true,
                    },
                    id,
                };
                parked.insert(run.clone(), entry);
                None
            }
            _ => Some(lease),
        };
        if let Some(lease) = refused {
            self.release(lease).await;
            return;
        }
        let driver = self.clone();
        tokio::spawn(async move {
            tokio::time::sleep(left).await;
            let expired = driver
                .parked
                .lock()
                .ok()
                .and_then(|mut parked| match parked.get(&run) {
                    Some(p) if p.id == id => parked.remove(&run),
                    _ => None,
                });
            if let Some(p) = expired {
                driver.release(p.held.lease).await;
            }
        });
    }

    /// Lets go of `run`'s lease if this process keeps it parked, for another worker woken for
    /// the run (asked on `kedge.live.yield.<worker>`): released at once, and the marker's
    /// sequence is returned for the asker's acquire. `None` when nothing is parked for it (the
    /// run is being driven here, or this process does not hold it).
    pub async fn yield_parked(&self, run: &RunId) -> Option<Released> {
        let p = self.parked.lock().ok().and_then(|mut p| p.remove(run))?;
        tracing::debug!(run_id = %run, "parked lease yielded to another worker");
        self.rt.leases.release(p.held.lease).await.ok()
    }

    /// Releases every parked lease (the service is stopping).
    pub async fn release_parked(&self) {
        let all: Vec<Parked> = self
            .parked
            .lock()
            .map(|mut p| p.drain().map(|(_, p)| p).collect())
            .unwrap_or_default();
        for p in all {
            self.release(p.held.lease).await;
        }
    }

    /// The run's state from its whole journal; `None` for a run with no `run.created` (a wake by
    /// an input published on a run id that does not exist: nothing to drive, and when the run is
    /// created its own wake drives it, the early input ignored).
    async fn load(
        &self,
        run: &RunId,
        through: Option<u64>,
    ) -> Result<Option<RunState>, DriveError> {
        let page = self.read(run, 0, through).await?;
        if !page.set_aside.is_empty() {
            self.record_set_aside(run, &page.set_aside).await;
        }
        // `fold` takes the run up to its first decision (inputs before it are ignored); the rest
        // is folded in order with the messages set aside.
        let Some(created) = page
            .events
            .iter()
            .position(|r| r.envelope.kind() == kedge_core::event::EventKind::Decision)
        else {
            return Ok(None);
        };
        let (head, tail) = page.events.split_at(created + 1);
        let mut state = kedge_core::fold::fold(head.iter().map(|r| (r.seq, &r.envelope)))?;
        fold_merged(&mut state, tail.iter(), &page.set_aside)?;
        Ok(Some(state))
    }

    /// The run's events after `after`: complete through `through` when given (no leader
    /// lookup, see [`kedge_journal::Journal::read_through`]), else everything acknowledged.
    async fn read(
        &self,
        run: &RunId,
        after: u64,
        through: Option<u64>,
    ) -> Result<kedge_journal::ReadPage, DriveError> {
        Ok(match through {
            Some(through) => self.rt.journal.read_through(run, after, through).await?,
            None => self.rt.journal.read_with_set_aside(run, after).await?,
        })
    }

    /// Reads what landed after the state's last event (through `through`, see
    /// [`Driver::read`]) and folds it in. When the state's appends `skipped` sequences, the read
    /// starts at the first of them (the run's own appends since are passed over) and a message
    /// of the run found in one makes the state be folded again from the whole journal; either
    /// way they are checked and cleared.
    ///
    /// With the `wake` being handled (the message `through` names), the run is first read by
    /// its chain ([`kedge_journal::Journal::read_chained`]: a tool's result linked to its
    /// `tool.started`, linked to the state's last event, by the broker's run-wide checks): two
    /// messages by sequence instead of a batched read of the run's subjects from the first
    /// skipped sequence. The sequences the links step over are noted as skipped, like those of
    /// the state's own appends, and checked by the next batched read, which comes at the latest
    /// once [`CHAINED_SKIPPED_MAX`] ranges are noted.
    async fn refresh(
        &self,
        state: &mut RunState,
        skipped: &mut Skipped,
        through: Option<u64>,
        wake: Option<Delivered<'_>>,
    ) -> Result<bool, DriveError> {
        let last = state.last_seq;
        if let Some(wake) = wake.filter(|w| w.seq > last && skipped.len() < CHAINED_SKIPPED_MAX)
            && let Some(page) = self
                .rt
                .journal
                .read_chained(&state.run_id, last, wake)
                .await?
        {
            metrics::step_read(StepRead::Chained);
            let mut before = last;
            for r in &page.events {
                if r.seq > before.saturating_add(1) {
                    skipped.push((before + 1, r.seq - 1));
                }
                before = r.seq;
            }
            fold_merged(state, page.events.iter(), &[])?;
            return Ok(true);
        }
        metrics::step_read(StepRead::Batched);
        let (after, through) = match skipped.first() {
            // Through the state's last event at least: it is an acknowledged event of the run.
            Some(&(first, _)) => (
                first.saturating_sub(1).min(last),
                through.map(|t| t.max(last)),
            ),
            None => (last, through),
        };
        let page = self.read(&state.run_id, after, through).await?;
        let missed = page
            .events
            .iter()
            .map(|r| r.seq)
            .chain(page.set_aside.iter().map(|a| a.seq))
            .find(|&seq| was_skipped(skipped, seq));
        skipped.clear();
        if let Some(seq) = missed {
            // A clustered stream's leader does this when the message was in flight as the
            // append was checked (docs/ARCHITECTURE.md, "skipped"): not an error of anyone's.
            tracing::warn!(
                run_id = %state.run_id,
                seq,
                state_through = last,
                "an append checked against the run's last message landed past a message of the run (in flight on a clustered stream); folding the run again"
            );
            *state = self
                .load(&state.run_id, None)
                .await?
                .ok_or(DriveError::NoRun)?;
            return Ok(false);
        }
        let set_aside: Vec<kedge_journal::SetAside> = page
            .set_aside
            .into_iter()
            .filter(|a| a.seq > last)
            .collect();
        fold_merged(
            state,
            page.events.iter().filter(|r| r.seq > last),
            &set_aside,
        )?;
        if !set_aside.is_empty() {
            self.record_set_aside(&state.run_id, &set_aside).await;
        }
        Ok(false)
    }

    /// Records messages set aside from a run's journal where operators see them, once each:
    /// `agent.rejected.journal.<run>.<seq>` in `KEDGE_REJECTIONS` (looked up first, and
    /// `Nats-Msg-Id` `journal:<run>:<seq>` within the duplicate window). Best effort: a record
    /// that cannot be written is logged; the run goes on.
    async fn record_set_aside(&self, run: &RunId, set_aside: &[kedge_journal::SetAside]) {
        let stream = match self
            .rt
            .js
            .get_stream_no_info(subjects::REJECTIONS_STREAM)
            .await
        {
            Ok(stream) => stream,
            Err(e) => {
                tracing::warn!(run_id = %run, error = %e, "cannot record set-aside journal messages");
                return;
            }
        };
        for a in set_aside {
            let subject = subjects::rejected_journal(run, a.seq);
            if stream.direct_get_last_for_subject(&subject).await.is_ok() {
                continue;
            }
            tracing::warn!(run_id = %run, seq = a.seq, subject = %a.subject, reason = %a.reason, "journal message set aside");
            let body = serde_json::json!({
                "at": Timestamp::now(),
                "run_id": run,
                "seq": a.seq,
                "subject": a.subject,
                "kind": a.kind,
                "reason": a.reason,
            });
            let mut headers = async_nats::HeaderMap::new();
            headers.insert("Nats-Msg-Id", format!("journal:{run}:{}", a.seq).as_str());
            let published = match self
                .rt
                .js
                .publish_with_headers(subject, headers, body.to_string().into())
                .await
            {
                Ok(ack) => ack.await.map(|_| ()).map_err(|e| e.to_string()),
                Err(e) => Err(e.to_string()),
            };
            if let Err(e) = published {
                tracing::warn!(run_id = %run, seq = a.seq, error = %e, "cannot record a set-aside journal message");
            }
        }
    }

    /// Appends decisions one after another, each with the concurrency check against the one
    /// before (a single append costs ~0.05 ms where an atomic batch costs ~2 ms and stalls the
    /// stream; a group cut short by a crash is finished by the next writer, see
    /// `kedge_core::decide::finish_step`), and brings the state up to date. A conflict means
    /// another writer decided: the state is re-read and the caller decides again.
    async fn commit(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        drafts: Vec<Draft>,
    ) -> Result<bool, DriveError> {
        if !self.append(state, w, drafts).await? {
            return Ok(false);
        }
        self.catch_up(state, w).await?;
        Ok(true)
    }

    /// Commits the end of the model call `request` (the decisions `end` makes on the state):
    /// a fact whatever landed during the call. An input the state lacks makes the append read
    /// the run and give up; the end is then made and committed again on that state, while the
    /// call is still the run's open attempt with no end recorded. Whether it was committed.
    async fn commit_attempt_end(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        request: &ModelRequestId,
        end: impl Fn(&RunState) -> Vec<Draft>,
    ) -> Result<bool, DriveError> {
        for _ in 0..3 {
            if self.commit(state, w, end(state)).await? {
                return Ok(true);
            }
            let open = state
                .open_step
                .as_ref()
                .is_some_and(|o| o.request_id == *request && !o.failed);
            if !open {
                break;
            }
        }
        Ok(false)
    }

    /// Folds in what the state lacks after appends that could not be folded in as they landed.
    async fn catch_up(&self, state: &mut RunState, w: &mut Writing<'_>) -> Result<(), DriveError> {
        if let Some(through) = w.stale_through.take() {
            self.refresh(state, &mut w.skipped, Some(through), None)
                .await?;
        }
        Ok(())
    }

    /// The appends of [`Driver::commit`]. While the state holds the whole run (no append left
    /// unfolded), each append is checked against the run's last message of any kind
    /// ([`kedge_journal::Journal::append_decision_current`]) and folded in as it lands, the
    /// sequences between it and the state's last event (other runs' messages) noted as
    /// [`Skipped`] and checked by the state's next read. When the run moved on (an input
    /// landed: a cancel request during a model call, a tool's result), the group's first
    /// decision is not appended: what landed is read (through the stream's leader) and the
    /// caller decides again on it, so nothing is dispatched on a state that misses an input
    /// acknowledged before the append (no read is needed after a model call for it). A later
    /// decision of the group goes on with the plain check (inputs do not conflict with
    /// decisions) and the state stays behind the journal until [`Driver::catch_up`], which the
    /// caller must call before deciding again.
    async fn append(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        drafts: Vec<Draft>,
    ) -> Result<bool, DriveError> {
        let mut drafts = drafts;
        self.observe_targets(&state.run_id, &mut drafts).await?;
        // A step group that journals no `run.waiting` moves the run into its waiting status
        // when its last decision lands: counted then.
        let settles = state.settled_by(&drafts);
        let now = Timestamp::now();
        let mut expected = state.last_decision_seq;
        let count = drafts.len();
        for (index, draft) in drafts.into_iter().enumerate() {
            let event = Envelope::new(state.run_id.clone(), now, draft);
            let journal = &self.rt.journal;
            let mut current = w.stale_through.is_none();
            // A test's stand-in for a broker that accepts an append past an input: the plain
            // check, taken as the run-wide one.
            let past_input =
                current && failpoint::fires("step.append_past_input", state.run_id.as_str());
            let mut result = if current && !past_input {
                journal
                    .append_decision_current(w.writer, expected, state.last_seq, &event)
                    .await
            } else {
                journal
                    .append_decisions(w.writer, expected, std::slice::from_ref(&event))
                    .await
            };
            if let Err(JournalError::Behind { .. }) = result {
                if index == 0 {
                    tracing::debug!(run_id = %state.run_id, "the run moved on; reading it and deciding again");
                    self.refresh(state, &mut w.skipped, None, None).await?;
                    return Ok(false);
                }
                // The same message id: an earlier attempt that landed is recognised.
                current = false;
                result = journal
                    .append_decisions(w.writer, expected, std::slice::from_ref(&event))
                    .await;
            }
            match result {
                // Nothing of the run was stored in between, says the run-wide check: folded as
                // it lands, what it stepped over noted for the next read to check.
                Ok(appended) if current => {
                    metrics::decision(&event.event);
                    let next = state.last_seq.saturating_add(1);
                    if appended.first_seq > next {
                        w.skipped.push((next, appended.first_seq - 1));
                    }
                    state.apply(appended.last_seq, &event)?;
                    expected = appended.last_seq;
                }
                // Appended after an unfolded append or past an input: read back later.
                Ok(appended) => {
                    metrics::decision(&event.event);
                    expected = appended.last_seq;
                    w.stale_through = Some(appended.last_seq);
                }
                // This very append landed before (a retry after a lost ack).
                Err(JournalError::Duplicate { seq }) => {
                    metrics::decision(&event.event);
                    expected = seq;
                    w.stale_through = Some(seq);
                }
                Err(JournalError::Conflict { expected, actual }) => {
                    tracing::warn!(run_id = %state.run_id, expected, actual, "decision conflict; re-reading");
                    metrics::fenced_write(metrics::Fenced::Decision);
                    w.stale_through = None;
                    w.skipped.clear();
                    *state = self
                        .load(&state.run_id, None)
                        .await?
                        .ok_or(DriveError::NoRun)?;
                    return Ok(false);
                }
                Err(e) => return Err(e.into()),
            }
            if index + 1 < count && matches!(event.event, Event::StepCompleted(_)) {
                failpoint::hit("step.after_answer_committed");
            }
        }
        if let Some(on) = settles {
            metrics::waiting(on);
        }
        Ok(true)
    }

    /// Fills in the target version of each approval request from the tool runners' precondition
    /// check (`kedge.tool.inspect`): what the approver is shown, and what the runner checks
    /// again right before running. Without an answer nothing is committed (the wake is retried):
    /// an approval must not be asked for a target nobody looked at.
    async fn observe_targets(&self, run: &RunId, drafts: &mut [Draft]) -> Result<(), DriveError> {
        for draft in drafts {
            let Event::ApprovalRequested(req) = &mut draft.event else {
                continue;
            };
            if req.target_version.is_some() {
                continue;
            }
            let failed = |reason: String| DriveError::Precondition {
                tool: req.tool.clone(),
                reason,
            };
            let query = TargetQuery {
                run_id: run.clone(),
                tool: req.tool.clone(),
                arguments: req.arguments.clone(),
            };
            let body = serde_json::to_vec(&query).map_err(|e| failed(e.to_string()))?;
            let reply = tokio::time::timeout(
                PRECONDITION_TIMEOUT,
                self.rt.client.request(TOOL_INSPECT, body.into()),
            )
            .await
            .map_err(|_| failed("no tool runner answered in time".into()))?
            .map_err(|e| failed(e.to_string()))?;
            let answer: TargetAnswer =
                serde_json::from_slice(&reply.payload).map_err(|e| failed(e.to_string()))?;
            req.target_version = answer.version;
        }
        Ok(())
    }

    /// Takes the run's lease: `None` when another live worker holds it.
    async fn acquire(&self, run: &RunId) -> Result<Option<Holding>, DriveError> {
        let cfg = &self.rt.config;
        // A lease this process parked after the run's last drive: taken back without a write.
        let parked = self.parked.lock().ok().and_then(|mut p| p.remove(run));
        if let Some(p) = parked {
            let held = p.held;
            if held.written.elapsed() < cfg.timeouts.lease_renew() {
                return Ok(Some(held));
            }
            // Its window ran out before its expiry let it go: renewed, as the keeper would.
            let at = Instant::now();
            match self.rt.leases.renew(&held.lease).await {
                Ok(lease) => {
                    return Ok(Some(Holding {
                        lease,
                        written: at,
                        hold: held.hold,
                        continuous: true,
                    }));
                }
                Err(LeaseError::Lost { .. }) => {}
                Err(e) => return Err(e.into()),
            }
        }
        let hint = self.released.lock().ok().and_then(|mut r| r.remove(run));
        let ttl = cfg.timeouts.lease_ttl();
        let at = Instant::now();
        let fresh = |lease| {
            Some(Holding {
                lease,
                written: at,
                hold: None,
                continuous: false,
            })
        };
        // Over this process's own release marker: nobody held it in between.
        if let Some(hint) = hint
            && let Some(lease) = self
                .rt
                .leases
                .retake(run, &cfg.worker_id, ttl, hint)
                .await?
        {
            return Ok(Some(Holding {
                lease,
                written: at,
                hold: None,
                continuous: true,
            }));
        }
        match self.rt.leases.acquire(run, &cfg.worker_id, ttl).await {
            Ok(lease) => Ok(fresh(lease)),
            // Held by a process that is gone (the broker has no connection for it), or by this
            // process itself (one drive per run per process, so such a lease is left over from
            // an earlier holding whose release failed, possibly before a restart under the same
            // worker id; unless another live process heartbeats under that id): take it over now
            // instead of waiting out its TTL.
            Err(LeaseError::Held { owner, revision })
                if (owner == cfg.worker_id && self.liveness.id_is_unique())
                    || self.liveness.is_gone(&owner).await =>
            {
                match self
                    .rt
                    .leases
                    .take_over(run, &cfg.worker_id, ttl, revision)
                    .await
                {
                    Ok(lease) => {
                        tracing::warn!(run_id = %run, previous = %owner, "took over the run from a holder that is gone");
                        let heard = self.adopted.lock().ok().and_then(|mut a| a.remove(run));
                        metrics::takeover(Takeover::Run, heard.map(|at| at.elapsed()));
                        // Its model call in flight may still deliver (a dropped connection is
                        // not a dead process): remembered for `await_interrupted_answer`.
                        if owner != cfg.worker_id {
                            let last = heard
                                .or_else(|| self.liveness.last_heard(&owner))
                                .unwrap_or_else(std::time::Instant::now);
                            if let Ok(mut taken) = self.taken_from.lock() {
                                if taken.len() >= CACHE_RUNS {
                                    taken.clear();
                                }
                                taken.insert(run.clone(), last);
                            }
                        }
                        Ok(fresh(lease))
                    }
                    // Our own parked lease, released by its expiry meanwhile: taken afresh.
                    Err(LeaseError::Lost { .. }) if owner == cfg.worker_id => {
                        match self.rt.leases.acquire(run, &cfg.worker_id, ttl).await {
                            Ok(lease) => Ok(fresh(lease)),
                            Err(LeaseError::Held { .. }) => Ok(None),
                            Err(e) => Err(e.into()),
                        }
                    }
                    Err(LeaseError::Lost { .. } | LeaseError::Held { .. }) => Ok(None),
                    Err(e) => Err(e.into()),
                }
            }
            // A live worker holds it: between two drives it keeps the lease parked, and lets go
            // when asked.
            Err(LeaseError::Held { owner, .. }) if owner != cfg.worker_id => {
                self.ask_to_yield(run, &owner).await
            }
            Err(LeaseError::Held { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks `owner`, a live worker holding `run`'s lease, to let go of it if it keeps it parked
    /// ([`Driver::yield_parked`]), and takes it if so. `None` (busy) when the owner is driving
    /// the run, does not answer in [`YIELD_TIMEOUT`] or runs a build without parking (no
    /// responders), or another worker took the lease first.
    async fn ask_to_yield(&self, run: &RunId, owner: &str) -> Result<Option<Holding>, DriveError> {
        if !subjects::is_token(owner) {
            return Ok(None);
        }
        let request = async_nats::Request::new()
            .payload(run.as_str().to_owned().into())
            .timeout(Some(YIELD_TIMEOUT));
        let Ok(answer) = self
            .rt
            .client
            .send_request(subjects::live_yield(owner), request)
            .await
        else {
            return Ok(None);
        };
        let Some(seq) = std::str::from_utf8(&answer.payload)
            .ok()
            .and_then(|s| s.parse::<u64>().ok())
        else {
            return Ok(None);
        };
        let cfg = &self.rt.config;
        let at = Instant::now();
        match self
            .rt
            .leases
            .acquire_after(
                run,
                &cfg.worker_id,
                cfg.timeouts.lease_ttl(),
                Some(Released { seq }),
            )
            .await
        {
            Ok(lease) => Ok(Some(Holding {
                lease,
                written: at,
                hold: None,
                continuous: false,
            })),
            Err(LeaseError::Held { .. } | LeaseError::Lost { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// A backlog wake's look at its run before any lease: `None` when there is nothing to do
    /// (no such run, or `decide` says idle and no child run needs tending), else the state read,
    /// for the drive to go on with under the lease. Reading through the wake makes this exact for
    /// the wake: `decide` is a function of the journal, an input that lands later wakes the run
    /// again, and a holder that appends meanwhile reads back what landed before its append (the
    /// concurrency check and `Driver::catch_up`). A state found idle this way is not cached: a
    /// backlog of runs that wait for hours is not worth holding in memory.
    async fn backlog_look(
        &self,
        run: &RunId,
        through: Option<u64>,
    ) -> Result<Option<RunState>, DriveError> {
        let Some(Read { state, .. }) = self.read_state(run, through, None).await? else {
            return Ok(None);
        };
        let tending = state.bundle.parent.is_some()
            || state
                .ops
                .values()
                .any(|o| o.call.name == child::RUN_AGENT_TOOL && o.result.is_none());
        if !tending && matches!(decide(&state), Next::Idle(_)) {
            tracing::debug!(run_id = %run, status = %state.status, "backlog wake: idle, no lease taken");
            return Ok(None);
        }
        Ok(Some(state))
    }

    /// The run's state: the one cached from this process's last drive, brought up to date
    /// (by the `wake`'s chain when it holds, see [`Driver::refresh`]), or the whole journal
    /// folded. `None` for a run with no `run.created`.
    async fn read_state(
        &self,
        run: &RunId,
        through: Option<u64>,
        wake: Option<Delivered<'_>>,
    ) -> Result<Option<Read>, DriveError> {
        let cached = self.cache.lock().ok().and_then(|mut c| c.remove(run));
        match cached {
            Some((mut state, mut skipped)) => {
                let chained = self
                    .refresh(&mut state, &mut skipped, through, wake)
                    .await?;
                Ok(Some(Read {
                    state,
                    skipped,
                    chained,
                }))
            }
            None => Ok(self.load(run, through).await?.map(|state| Read {
                state,
                skipped: Skipped::new(),
                chained: false,
            })),
        }
    }

    /// Keeps a run's state, with what its appends `skipped`, for its next drive here (not a
    /// finished run's with nothing pending).
    fn keep(&self, state: RunState, skipped: Skipped) {
        if let Ok(mut cache) = self.cache.lock() {
            if cache.len() >= CACHE_RUNS {
                cache.clear();
            }
            if !state.status.is_terminal() || !state.pending_messages.is_empty() {
                cache.insert(state.run_id.clone(), (state, skipped));
            }
        }
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
                Next::Idle(why) => {
                    tracing::debug!(run_id = %run, ?why, status = %state.status, "idle");
                    self.tend_children(state).await?;
                    self.tend_provider_wait(state, waited).await?;
                    return Ok(why);
                }
                Next::Commit(drafts) => {
                    self.commit(state, w, drafts).await?;
                }
                Next::Step(plan) => {
                    self.step(state, w, *plan, lost).await?;
                }
                Next::Finish(cut) => {
                    tracing::warn!(run_id = %run, step = %cut.step, landed = cut.landed, "finishing a step's decisions cut short");
                    let contract = match self.definition(state).await? {
                        Ok((_, contract)) => contract,
                        Err(reason) => {
                            let fail = Draft::new(Event::RunFailed(RunFailed {
                                reason: FailureReason::Internal,
                                message: reason,
                                effects: Vec::new(),
                            }));
                            self.commit(state, w, vec![fail]).await?;
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

    async fn step(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: StepPlan,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<(), DriveError> {
        let run = state.run_id.clone();
        let span =
            tracing::info_span!("step", run_id = %run, step = %plan.step, attempt = %plan.attempt);
        kedge_runtime::trace::set_parent(&span, state.bundle.traceparent.as_deref());
        async {
            let (def, contract) = match self.definition(state).await? {
                Ok(found) => found,
                Err(reason) => {
                    let fail = Draft::new(Event::RunFailed(RunFailed {
                        reason: FailureReason::Internal,
                        message: reason,
                        effects: Vec::new(),
                    }));
                    self.commit(state, w, vec![fail]).await?;
                    return Ok(());
                }
            };
            // The tool contract of the run's revision: calls it refuses were not dispatched,
            // and the model reads the refusal as their result.
            let mut plan = plan;
            plan.answer_refused(&contract);
            // A worker that died after the model answered left the response behind; one whose
            // connection dropped mid call may still store it, within the reconnect grace.
            let interrupted = match &plan.unfinished {
                Some((request, digest)) => {
                    self.await_interrupted_answer(state, request, digest, lost)
                        .await?
                }
                None => Interrupted::NoAnswer,
            };
            if let Interrupted::Moved = interrupted {
                // Decided again from what the run is now.
                return Ok(());
            }
            if let Some((request, _)) = &plan.unfinished
                && let Interrupted::Answer(stored) = interrupted
            {
                tracing::info!(request_id = %request, "reusing the stored model response");
                let drafts = complete_step(
                    state,
                    request.step(),
                    request.attempt(),
                    request.clone(),
                    stored.response,
                    true,
                    Timestamp::now(),
                    &contract,
                );
                self.commit(state, w, drafts).await?;
                return Ok(());
            }
            // The model's context window (docs/ARCHITECTURE.md "The context window"): a
            // conversation that would not fit is compacted first, a decision of its own; the
            // step is then decided again on the compacted context.
            if let Some(mut compacted) = compaction(state, &def, None) {
                if state.status.is_terminal() {
                    // A revival: its first decisions alone, so that the compaction lands in
                    // the running run they leave (the step is decided again after it).
                    let revival: Vec<Draft> = plan
                        .start
                        .iter()
                        .take_while(|d| !matches!(d.event, Event::StepStarted(_)))
                        .cloned()
                        .collect();
                    self.commit(state, w, revival).await?;
                } else {
                    tracing::info!("compacting the model's context to fit its window");
                    let before = state.compaction.as_ref().map_or(1, |c| c.keep_from);
                    let keep_from = usize::try_from(compacted.keep_from).unwrap_or(usize::MAX);
                    if def.context.strategy == kedge_core::context::ContextStrategy::Summarize
                        && keep_from > before
                    {
                        compacted.summary = self.summarize(state, &def, plan.step, keep_from).await;
                    }
                    let draft = Draft::new(Event::ContextCompacted(compacted));
                    self.commit(state, w, vec![draft]).await?;
                }
                return Ok(());
            }
            // Where the call goes (docs/ARCHITECTURE.md "Provider trouble"): the run's model
            // unless the fleet's breaker of its endpoint holds it (a failing endpoint gets the
            // fleet's probes, not every run's retry); a fallback once that endpoint has been
            // failing for `fallback_after_secs`. A fallback is named in the attempt's
            // `step.started`.
            let providers = self.providers().await?;
            let primary = Called::primary(state, &def);
            let fallbacks: Vec<Called> = def
                .fallbacks
                .iter()
                .map(Called::fallback)
                .collect();
            let fallback_endpoints: Vec<Endpoint> =
                fallbacks.iter().map(|c| c.endpoint.clone()).collect();
            let route = providers
                .route(
                    &primary.endpoint,
                    &fallback_endpoints,
                    def.fallback_after(),
                    plan.released,
                )
                .await;
            let (called, probe) = match &route {
                Route::Fallback(i) => match fallbacks.get(*i) {
                    Some(f) => (f, false),
                    None => (&primary, false),
                },
                Route::Primary { probe } => (&primary, *probe),
                Route::Hold { .. } => (&primary, false),
            };
            if let Route::Fallback(_) = route {
                tracing::info!(model = %called.spec.name, endpoint = %called.endpoint.label, "the run's model is unavailable; calling its fallback");
                for d in &mut plan.start {
                    if let Event::StepStarted(started) = &mut d.event {
                        started.model = Some(called.spec.clone());
                    }
                }
            }
            // The rate limits the fleet keeps to for the called model at its endpoint; a run
            // that waits (its turn, or out trouble) on its own model is released into a slot
            // under that model's.
            let to_fallback = matches!(route, Route::Fallback(_));
            let waits_with = primary.turn(&self.rt.config, &providers, &def, &plan.context);
            let turn = if to_fallback {
                called.turn(&self.rt.config, &providers, &def, &plan.context)
            } else {
                waits_with.clone()
            };
            let queue = WaitList {
                providers: &providers,
                endpoint: &primary.endpoint,
                turn: waits_with,
                fallbacks: &fallback_endpoints,
                fallback_after: (!def.fallbacks.is_empty()).then(|| def.fallback_after()),
            };
            // Not caught up if behind: the call needs only the plan and the bundle, and the
            // journal is read right after it.
            if !self.append(state, w, plan.start.clone()).await? {
                return Ok(());
            }
            failpoint::hit("step.after_step_started");
            if let Route::Hold { reason, trouble, .. } = route {
                tracing::debug!(endpoint = %primary.endpoint.label, "model call held: its endpoint is failing");
                let met = TroubleMet {
                    outcome: AttemptOutcome::Held {
                        endpoint: primary.endpoint.label.clone(),
                        reason: reason.clone(),
                    },
                    trouble,
                    endpoint: primary.endpoint.label.clone(),
                    message: reason,
                };
                let wait = ProviderTrouble {
                    queue,
                    called: &primary.endpoint,
                    met,
                    retry_after: None,
                    why: metrics::ProviderWait::Held,
                };
                return self.wait_on_provider(state, w, &plan, wait).await;
            }
            // A run released to its own model had its slot reserved by its release.
            let reserved = plan.released.is_some() && !to_fallback;
            if let Some(t) = turn.as_ref().filter(|_| !reserved) {
                match providers
                    .admit(&called.endpoint, &called.spec.name, t.configured, t.tokens)
                    .await
                {
                    Admit::After(wait) => tokio::time::sleep(wait).await,
                    Admit::Queue { reason } => {
                        tracing::debug!(endpoint = %called.endpoint.label, %reason, "model call waits its turn");
                        let wait = ProviderTrouble {
                            queue,
                            called: &called.endpoint,
                            met: TroubleMet {
                                outcome: AttemptOutcome::Held {
                                    endpoint: called.endpoint.label.clone(),
                                    reason: reason.clone(),
                                },
                                trouble: Trouble::RateLimited,
                                endpoint: called.endpoint.label.clone(),
                                message: reason,
                            },
                            retry_after: None,
                            why: metrics::ProviderWait::Queued,
                        };
                        return self.wait_on_provider(state, w, &plan, wait).await;
                    }
                }
            }
            let endpoint = &called.endpoint;
            let connects = self.connects();
            let called_at = std::time::Instant::now();
            let mut learned = None;
            let result = self
                .call_model(state, &def, called, &plan, &mut learned)
                .await;
            count_call(&called.spec, &result, called_at.elapsed());
            if let Some(l) = learned {
                let learned = Limits {
                    requests_per_minute: l.requests_per_minute,
                    tokens_per_minute: l.tokens_per_minute,
                };
                providers.learn(endpoint, &called.spec.name, learned).await;
            }
            match &result {
                Ok(_) => providers.report_success(endpoint).await,
                Err(CallError::Model(e)) => {
                    if let Some(report) = trouble_report(e, probe) {
                        providers.report_trouble(endpoint, &report).await;
                    }
                }
                Err(CallError::Cancelled) => {}
            }
            if result.is_err() {
                // Read with the leader's check: what ended the call (a cancel) is in it. (A
                // test's switch skips the read: an input that landed during the call then
                // stands for one stored right after the read, found by the append.)
                w.stale_through = None;
                if !failpoint::fires("step.input_after_failed_call_read", run.as_str()) {
                    self.refresh(state, &mut w.skipped, None, None).await?;
                }
            }
            match result {
                Ok(response) => {
                    let stored = StoredResponse {
                        context_digest: plan.context_digest.clone(),
                        response: response.clone(),
                    };
                    // This process's broker connection dropped during the call (or is down
                    // now): the run may have been taken over meanwhile, and a standby waiting
                    // for this answer appends nothing that would fence a commit. The answer is
                    // stored first (once the broker is back), then the lease read: a lease
                    // taken leaves the answer to its holder and commits nothing.
                    let cut_off = self.connects() != connects
                        || self.rt.client.connection_state()
                            != async_nats::connection::State::Connected;
                    // The answer is kept the moment it returns, where it is cheapest: in the
                    // journal, by `step.completed`, when the commit lands at once (a state that
                    // holds the whole run, the lease still held). Inputs that arrived during the
                    // call (a cancel above all) shape the commit, and such a state needs no read
                    // for them: its appends are checked against the run's last message, so one
                    // that finds an input acknowledged meanwhile is not appended. The answer is
                    // then stored in the idempotency bucket and the step decided again on what
                    // landed, reusing it. Either way it is durable nowhere for one round trip
                    // (docs/ARCHITECTURE.md, "Crash windows").
                    let behind = w.stale_through.is_some();
                    if !behind
                        && !cut_off
                        && !*lost.borrow()
                        && !failpoint::fires("step.answer_not_committed", run.as_str())
                    {
                        let drafts = complete_step(
                            state,
                            plan.step,
                            plan.attempt,
                            plan.request_id.clone(),
                            response,
                            false,
                            Timestamp::now(),
                            &contract,
                        );
                        let committed = self.commit(state, w, drafts).await;
                        if let Ok(true) = committed {
                            return Ok(());
                        }
                        // Not landed (the run moved on, another writer decided) or not known
                        // to have: kept for this step's next attempt, here or elsewhere.
                        let put = self
                            .rt
                            .idempotency
                            .store_response(&plan.request_id, &stored)
                            .await;
                        failpoint::hit("step.after_model_stored");
                        return match (committed, put) {
                            (Err(e), put) => {
                                if let Err(p) = put {
                                    tracing::warn!(error = %p, "the uncommitted model response could not be stored either; this process keeps it");
                                }
                                Err(e)
                            }
                            (Ok(_), put) => put.map_err(DriveError::from),
                        };
                    }
                    // A state left behind by `step.started` is read now, with the leader's
                    // check, while the response is stored; a lost lease stores it for the
                    // run's holder. Nothing is committed before the response is stored: a crash
                    // from here on never pays for it twice.
                    w.stale_through = None;
                    let (put, read) = futures::join!(
                        self.rt
                            .idempotency
                            .store_response(&plan.request_id, &stored),
                        async {
                            if behind {
                                self.refresh(state, &mut w.skipped, None, None).await.map(|_| ())
                            } else {
                                Ok(())
                            }
                        }
                    );
                    put?;
                    failpoint::hit("step.after_model_stored");
                    if *lost.borrow() || (cut_off && !self.still_holds(&run).await) {
                        // Stored: the run's holder now reuses it instead of paying again.
                        tracing::warn!("lease lost during the model call; gave the step up (its response is stored for the next holder, nothing committed)");
                        metrics::fenced_write(metrics::Fenced::Decision);
                        return Err(DriveError::LeaseLost);
                    }
                    read?;
                    let drafts = complete_step(
                        state,
                        plan.step,
                        plan.attempt,
                        plan.request_id.clone(),
                        response,
                        false,
                        Timestamp::now(),
                        &contract,
                    );
                    self.commit(state, w, drafts).await?;
                    Ok(())
                }
                Err(CallError::Cancelled) => {
                    tracing::info!("cancel requested; model call aborted");
                    let attempt = Draft::new(Event::ModelAttempt(ModelAttempt {
                        request_id: plan.request_id.clone(),
                        outcome: kedge_core::event::AttemptOutcome::Cancelled,
                    }))
                    .step(plan.step)
                    .attempt(plan.attempt);
                    // The cancel itself can be stored after the read above (the watcher hears
                    // it on core NATS as it is published): the append then finds it.
                    self.commit_attempt_end(state, w, &plan.request_id, |_| {
                        vec![attempt.clone()]
                    })
                    .await?;
                    Ok(())
                }
                Err(CallError::Model(e)) if e.trouble.is_some() => {
                    tracing::info!(error = %e, endpoint = %endpoint.label, "model provider trouble; the run waits on it");
                    let trouble = e.trouble.unwrap_or(Trouble::Unavailable);
                    let wait = ProviderTrouble {
                        queue,
                        called: endpoint,
                        met: TroubleMet {
                            outcome: e.to_attempt_outcome(),
                            trouble,
                            endpoint: endpoint.label.clone(),
                            message: e.message.clone(),
                        },
                        retry_after: e.retry_after,
                        why: match trouble {
                            Trouble::Unavailable => metrics::ProviderWait::Unavailable,
                            Trouble::RateLimited => metrics::ProviderWait::RateLimited,
                        },
                    };
                    self.wait_on_provider(state, w, &plan, wait).await
                }
                Err(CallError::Model(e)) => {
                    tracing::warn!(error = %e, "model call failed");
                    let attempt = Draft::new(Event::ModelAttempt(ModelAttempt {
                        request_id: plan.request_id.clone(),
                        outcome: e.to_attempt_outcome(),
                    }))
                    .step(plan.step)
                    .attempt(plan.attempt);
                    // An input stored after the read above (a user's message) makes the append
                    // read the run again; unrecorded, the failure's retry delay would not be
                    // waited and a refusal would be called again.
                    let committed = self
                        .commit_attempt_end(state, w, &plan.request_id, |state| {
                            let mut drafts = vec![attempt.clone()];
                            // Too long for the model's window: compacted, and the step tried
                            // again (an attempt spent), while anything is left to take out.
                            let compacted = e
                                .is_too_long()
                                .then(|| compaction(state, &def, Some(&e)))
                                .flatten();
                            if let Some(compacted) = compacted {
                                drafts.push(Draft::new(Event::ContextCompacted(compacted)));
                            } else if e.class == ErrorClass::Fatal {
                                drafts.push(Draft::new(Event::RunFailed(RunFailed {
                                    reason: FailureReason::ModelRejected,
                                    message: e.message.clone(),
                                    effects: Vec::new(),
                                })));
                            }
                            // A fatal refusal ends the run: through its compensation, if its
                            // agent compensates failures.
                            kedge_core::compensation::intercept(state, drafts)
                        })
                        .await?;
                    if committed && e.class == ErrorClass::Retryable {
                        let delay = retry_delay(
                            &e,
                            plan.attempt.get(),
                            self.rt.config.timeouts.max_retry_delay(),
                        );
                        tokio::time::sleep(delay).await;
                    }
                    Ok(())
                }
            }
        }
        .instrument(span)
        .await
    }

    /// The run's model's summary of the turns a compaction keeping the transcript from
    /// `keep_from` leaves out (`context.strategy: summarize`, docs/ARCHITECTURE.md "The context
    /// window"): a call of its own, under a request id fixed by the step and `keep_from`, whose
    /// answer is stored before it is journaled and reused after a crash. `None` (the compaction
    /// then trims) when the call is not made or fails: the run's model's endpoint is failing or
    /// its rate limit has no slot for it soon, the agent marks values sensitive (a summary would
    /// journal them in clear), or the model answers with no text. Never a reason to fail the
    /// run.
    async fn summarize(
        &self,
        state: &RunState,
        def: &AgentDefinition,
        step: kedge_core::StepNo,
        keep_from: usize,
    ) -> Option<kedge_core::event::CompactionSummary> {
        use kedge_core::context;
        if def.marks_sensitive() {
            return None;
        }
        let request_id = context::summary_request_id(&state.run_id, step, keep_from);
        let messages = context::summary_context(state, keep_from);
        let digest = kedge_core::event::Digest::of(&messages);
        let primary = Called::primary(state, def);
        let stored = match self.rt.idempotency.stored_response(&request_id).await {
            Ok(found) => found.filter(|s| s.context_digest == digest),
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for a stored summary; trimming instead");
                return None;
            }
        };
        let response = match stored {
            Some(stored) => {
                tracing::info!(request_id = %request_id, "reusing the stored summary");
                stored.response
            }
            None => {
                let providers = self.providers().await.ok()?;
                if !providers.breaker(&primary.endpoint).lets(None) {
                    return None;
                }
                // The model's rate limits hold for this call too; over them, it trims instead
                // of waiting its turn.
                if let Some(t) = primary.turn(&self.rt.config, &providers, def, &messages) {
                    let admitted = providers
                        .admit(
                            &primary.endpoint,
                            &primary.spec.name,
                            t.configured,
                            t.tokens,
                        )
                        .await;
                    match admitted {
                        Admit::After(wait) => tokio::time::sleep(wait).await,
                        Admit::Queue { .. } => return None,
                    }
                }
                self.rt
                    .config
                    .check_model(&primary.key_var, primary.spec.base_url.as_deref())
                    .ok()?;
                let api_key = self.rt.config.api_key(&primary.key_var);
                let call = ModelCall {
                    spec: &primary.spec,
                    api_key: api_key.as_deref(),
                    system: context::SUMMARY_SYSTEM,
                    // The conversation holds tool calls; a provider wants their tools declared.
                    tools: &def.tools,
                    context: &messages,
                    request_id: &request_id,
                    max_output_tokens: def.max_output_tokens,
                    output_schema: None,
                    timeout: self.rt.config.timeouts.model_timeout(),
                };
                let called_at = std::time::Instant::now();
                let result = self
                    .model
                    .complete(&call, &mut |_| {})
                    .await
                    .map_err(CallError::Model);
                count_call(&primary.spec, &result, called_at.elapsed());
                let response = match result {
                    Ok(r) => {
                        providers.report_success(&primary.endpoint).await;
                        r
                    }
                    Err(CallError::Model(e)) => {
                        if let Some(report) = trouble_report(&e, false) {
                            providers.report_trouble(&primary.endpoint, &report).await;
                        }
                        tracing::warn!(error = %e, "the summary call failed; trimming instead");
                        return None;
                    }
                    Err(CallError::Cancelled) => return None,
                };
                let stored = StoredResponse {
                    context_digest: digest,
                    response: response.clone(),
                };
                // Stored before it is journaled: a crash in between reuses it.
                if let Err(e) = self
                    .rt
                    .idempotency
                    .store_response(&request_id, &stored)
                    .await
                {
                    tracing::warn!(error = %e, "the summary could not be stored; trimming instead");
                    return None;
                }
                response
            }
        };
        let text: String = response
            .message
            .text
            .trim()
            .chars()
            .take(context::MAX_SUMMARY_CHARS)
            .collect();
        if text.is_empty() {
            tracing::warn!("the summary call answered no text; trimming instead");
            return None;
        }
        Some(kedge_core::event::CompactionSummary {
            text,
            request_id,
            usage: response.usage.priced(primary.spec.price.as_ref()),
        })
    }

    /// The stored answer of the attempt `request` (with the context `digest`) that a holder
    /// of the run left unfinished. When this process took the run over from a worker found
    /// gone, that worker may only have lost its broker connection: its call may still answer
    /// and be stored as soon as it reconnects (docs/ARCHITECTURE.md "Takeover"). So until
    /// `reconnect_grace` after the worker was last heard, the answer is waited for (the record
    /// read every [`INTERRUPTED_POLL`]); the wait ends early when the run moves on (the worker
    /// came back and committed it) or this process loses the lease. `None`: no answer to reuse,
    /// the next attempt calls the model.
    async fn await_interrupted_answer(
        &self,
        state: &mut RunState,
        request: &kedge_core::ids::ModelRequestId,
        digest: &kedge_core::event::Digest,
        lost: &mut watch::Receiver<bool>,
    ) -> Result<Interrupted, DriveError> {
        let stored = |s: Option<StoredResponse>| s.filter(|s| s.context_digest == *digest);
        if let Some(found) = stored(self.rt.idempotency.stored_response(request).await?) {
            return Ok(Interrupted::Answer(found));
        }
        let heard = self
            .taken_from
            .lock()
            .ok()
            .and_then(|t| t.get(&state.run_id).copied());
        let Some(until) = heard.map(|h| h + self.rt.config.timeouts.reconnect_grace()) else {
            return Ok(Interrupted::NoAnswer);
        };
        if std::time::Instant::now() >= until {
            return Ok(Interrupted::NoAnswer);
        }
        tracing::info!(request_id = %request, "waiting for the interrupted attempt's answer before calling the model again");
        let started = std::time::Instant::now();
        let seq = state.last_seq;
        let found = loop {
            if *lost.borrow() {
                return Err(DriveError::LeaseLost);
            }
            let wait =
                INTERRUPTED_POLL.min(until.saturating_duration_since(std::time::Instant::now()));
            if wait.is_zero() {
                break Interrupted::NoAnswer;
            }
            tokio::time::sleep(wait).await;
            if let Some(found) = stored(self.rt.idempotency.stored_response(request).await?) {
                break Interrupted::Answer(found);
            }
            // The worker came back and committed its answer itself: the run moved on.
            let mut skipped = Skipped::default();
            self.refresh(state, &mut skipped, None, None).await?;
            if state.last_seq != seq {
                break Interrupted::Moved;
            }
        };
        if let Ok(mut t) = self.taken_from.lock() {
            t.remove(&state.run_id);
        }
        let answered = !matches!(found, Interrupted::NoAnswer);
        metrics::interrupted_answer(answered);
        tracing::info!(request_id = %request, answered, waited_ms = started.elapsed().as_millis() as u64, "done waiting for the interrupted attempt's answer");
        Ok(found)
    }

    /// How many times this process's broker connection was made (it grows on a reconnect).
    fn connects(&self) -> u64 {
        self.rt
            .client
            .statistics()
            .connects
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Whether this process still holds `run`'s lease, as the broker has it (an answer the
    /// lease cannot be read for is not committed: it is stored for whoever holds the run).
    async fn still_holds(&self, run: &RunId) -> bool {
        match self.rt.leases.holder(run).await {
            Ok(Some(h)) => h.owner == self.rt.config.worker_id,
            Ok(None) | Err(_) => false,
        }
    }

    /// This process's view of the fleet's model endpoints.
    async fn providers(&self) -> Result<Providers, DriveError> {
        self.rt
            .providers()
            .await
            .map_err(|e| DriveError::Provider(ProviderError::Unavailable(e.to_string())))
    }

    /// Puts the run to wait on its provider after the plan's attempt met trouble or was held:
    /// the wait is recorded in the fleet's list first (the releaser finds it there), with the
    /// run's own backoff (growing with the step's waits, or the provider's `retry-after`);
    /// then `model.attempt` and `provider.waiting` are journaled
    /// ([`kedge_core::decide::wait_on_provider`]). The lease is let go when the drive ends: the
    /// run holds nothing while it waits.
    async fn wait_on_provider(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: &StepPlan,
        trouble: ProviderTrouble<'_>,
    ) -> Result<(), DriveError> {
        // While the endpoint's breaker is open the fleet decides when the run goes again (its
        // probes, then the release); only a run that meets trouble on an endpoint the fleet
        // finds healthy (a request the provider chokes on) waits out its own growing backoff,
        // and a run waiting its turn under a rate limit waits for its turn alone.
        let queue = &trouble.queue;
        let queued = trouble.why == metrics::ProviderWait::Queued;
        let backoff = if !queued && queue.providers.breaker(trouble.called).lets(None) {
            let waits = state
                .open_step
                .as_ref()
                .map_or(0, |o| o.free)
                .saturating_add(1);
            kedge_core::decide::model_retry_delay(
                waits,
                trouble.retry_after,
                self.rt.config.timeouts.max_retry_delay(),
                kedge_runtime::jitter_draw(),
            )
        } else {
            Duration::ZERO
        };
        let now = Timestamp::now();
        let since = state
            .provider
            .as_ref()
            .filter(|p| p.step == plan.step)
            .map_or(now, |p| p.since);
        let waiter = queue.waiter(state, since, now.saturating_add(backoff));
        queue.providers.wait(queue.endpoint, &waiter).await?;
        let bound = self.rt.config.providers.wait;
        let met = trouble.met;
        let committed = self
            .commit_attempt_end(state, w, &plan.request_id, |state| {
                kedge_core::decide::wait_on_provider(
                    state,
                    &plan.request_id,
                    met.clone(),
                    now,
                    bound,
                )
            })
            .await?;
        if committed && state.status == RunStatus::WaitingProvider {
            metrics::provider_wait(trouble.why);
        } else {
            // Not waiting after all (a cancel came first): the record would only cost a probe.
            queue.providers.forget(queue.endpoint, &state.run_id).await;
        }
        Ok(())
    }

    /// Keeps the fleet's list of runs waiting on a provider true to the journal at the end of
    /// a drive: a run that waits has its record (written again if it was lost), a run that
    /// stopped waiting other than by a release (cancelled, failed, its wait's bound passed)
    /// has it removed. `waited`: the run was waiting, unreleased, when the drive began.
    async fn tend_provider_wait(&self, state: &RunState, waited: bool) -> Result<(), DriveError> {
        let waiting = state.status == RunStatus::WaitingProvider;
        if !waiting && !waited {
            return Ok(());
        }
        let Ok((def, _)) = self.definition(state).await? else {
            return Ok(());
        };
        let providers = self.providers().await?;
        let primary = Called::primary(state, &def);
        match &state.provider {
            Some(wait) if waiting && wait.released.is_none() => {
                let fallbacks: Vec<Endpoint> = def
                    .fallbacks
                    .iter()
                    .map(|f| Called::fallback(f).endpoint)
                    .collect();
                let queue = WaitList {
                    providers: &providers,
                    endpoint: &primary.endpoint,
                    turn: primary.turn(&self.rt.config, &providers, &def, &[]),
                    fallbacks: &fallbacks,
                    fallback_after: (!def.fallbacks.is_empty()).then(|| def.fallback_after()),
                };
                let waiter = queue.waiter(state, wait.since, Timestamp::now());
                providers.ensure_waiting(&primary.endpoint, &waiter).await?;
            }
            _ if !waiting => providers.forget(&primary.endpoint, &state.run_id).await,
            _ => {}
        }
        Ok(())
    }

    /// What an idle run owes its child runs, and a child its parent (docs/ARCHITECTURE.md
    /// "Child runs"). Every step is idempotent and repeated on every idle drive until it shows
    /// in the journal, so a crash anywhere in between only delays it:
    ///
    /// - each open `run_agent` operation without a link gets its refusal as its result;
    /// - each linked child is made to exist (its `run.created`, written like intake's with the
    ///   check that the run has none: a run already there is this operation's child or the
    ///   operation fails), and is asked to cancel while the run is cancelling;
    /// - a child that ended gives its parent's operation its result (`Nats-Msg-Id` the
    ///   operation's result id; the parent's fold keeps the first result).
    async fn tend_children(&self, state: &RunState) -> Result<(), DriveError> {
        if !state.status.is_terminal() {
            let open = state
                .ops
                .values()
                .filter(|o| o.call.name == child::RUN_AGENT_TOOL && o.result.is_none());
            for op in open {
                let refusal = match state.children.get(&op.op) {
                    None => match child::plan(state, &op.op, &op.call) {
                        child::Plan::Refuse(why) => Some(why),
                        // Linked by the rest of its group, which the next decision finishes.
                        child::Plan::Start { .. } => None,
                    },
                    Some(id) => self.ensure_child(state, op, id).await?,
                };
                if let Some(why) = refusal {
                    tracing::info!(run_id = %state.run_id, op = %op.op, reason = %why, "run_agent refused");
                    let result = ToolResult {
                        content: why,
                        is_error: true,
                        stopped: false,
                    };
                    self.give_result(&state.run_id, &op.op, result).await?;
                } else if let Some(id) = state.children.get(&op.op)
                    && state.status == RunStatus::Cancelling
                {
                    self.cancel_child(state, id).await?;
                }
            }
        }
        if let Some(link) = &state.bundle.parent
            && let Some(result) = child::result(state)
        {
            failpoint::hit("step.before_child_result");
            self.give_result(&link.run_id, &link.op, result).await?;
        }
        Ok(())
    }

    /// Makes child run `id` of the `run_agent` operation `op` exist; `Some(refusal)` when it
    /// cannot (no such agent for the run's tenant, no budget left, its id taken by another run).
    async fn ensure_child(
        &self,
        state: &RunState,
        op: &ToolOp,
        id: &RunId,
    ) -> Result<Option<String>, DriveError> {
        if self.children.lock().is_ok_and(|c| c.contains(id)) {
            return Ok(None);
        }
        // The child may exist already (created before a restart, a takeover, by another
        // worker): then it is this operation's child or its id is taken, whatever the registry
        // says now. Only a child that does not exist yet is planned and created.
        match self.child_link(state, op, id).await? {
            Some(true) => {}
            Some(false) => return Ok(Some(taken(id))),
            None => {
                if let Some(refusal) = self.create_child(state, op, id).await? {
                    return Ok(Some(refusal));
                }
                // Created, or created meanwhile by someone else (a duplicate message id proves
                // nothing about whose run it is): the link decides.
                if self.child_link(state, op, id).await? != Some(true) {
                    return Ok(Some(taken(id)));
                }
            }
        }
        failpoint::hit("step.after_child_created");
        if let Ok(mut children) = self.children.lock() {
            if children.len() >= CACHE_RUNS {
                children.clear();
            }
            children.insert(id.clone());
        }
        Ok(None)
    }

    /// Whether run `id` exists and is the child of `op` of `state`'s run: `None` when it has no
    /// `run.created`, `Some(false)` when another run holds the id.
    async fn child_link(
        &self,
        state: &RunState,
        op: &ToolOp,
        id: &RunId,
    ) -> Result<Option<bool>, DriveError> {
        let found = self
            .rt
            .journal
            .read_type(id, kedge_core::event::EventType::RunCreated)
            .await?;
        Ok(found.first().map(|r| {
            matches!(&r.envelope.event,
                Event::RunCreated(c) if child::is_child_of(c, &state.run_id, &op.op))
        }))
    }

    /// Creates child run `id` of `op`; `Some(refusal)` when the call may not start one (no such
    /// agent for the run's tenant, no budget left).
    async fn create_child(
        &self,
        state: &RunState,
        op: &ToolOp,
        id: &RunId,
    ) -> Result<Option<String>, DriveError> {
        let (agent, input) = match child::plan(state, &op.op, &op.call) {
            child::Plan::Start { agent, input, .. } => (agent, input),
            child::Plan::Refuse(why) => return Ok(Some(why)),
        };
        let (revision, def) = match self.rt.agents.latest(&agent).await {
            Ok(found) => found,
            Err(AgentError::NotFound(_)) => {
                return Ok(Some(format!("not run: no agent named `{agent}`")));
            }
            Err(e @ AgentError::Unavailable(_)) => return Err(e.into()),
            Err(e) => return Ok(Some(format!("not run: {e}"))),
        };
        let now = Timestamp::now();
        let mut created = match child::created(state, &op.op, revision, &def, input, now) {
            Ok(created) => created,
            Err(why) => return Ok(Some(why)),
        };
        if let Err(e) = seal_child_input(&self.rt, state, id, &def, &mut created.input) {
            return Ok(Some(format!("not run: {e}")));
        }
        let env = Envelope::new(
            id.clone(),
            now,
            Draft::new(Event::RunCreated(Box::new(created))),
        );
        match self.rt.journal.create_run(&env).await {
            Ok(_) => {
                metrics::run_created();
                tracing::info!(run_id = %state.run_id, op = %op.op, child = %id, agent = %agent, "child run created");
                Ok(None)
            }
            Err(JournalError::Duplicate { .. } | JournalError::Conflict { .. }) => Ok(None),
            Err(e) => Err(e.into()),
        }
    }

    /// Asks child run `id` of the cancelling run `state` to cancel (once: the child's cancel
    /// request has its run's one `Nats-Msg-Id`, and its fold ignores a second).
    async fn cancel_child(&self, state: &RunState, id: &RunId) -> Result<(), DriveError> {
        let reason = format!(
            "its parent run {} is cancelling: {}",
            state.run_id,
            state.cancel_requested.as_deref().unwrap_or_default()
        );
        let env = Envelope::new(
            id.clone(),
            Timestamp::now(),
            Draft::new(Event::CancelRequested(CancelRequested {
                reason,
                by: Some(format!("run:{}", state.run_id)),
            })),
        );
        match self
            .rt
            .journal
            .append_input(&env, InputId::cancel(id).as_str())
            .await
        {
            // Asked before (this drive's earlier self, or another worker's).
            Ok(_) | Err(JournalError::Duplicate { .. }) => Ok(()),
            Err(e) => Err(e.into()),
        }
    }

    /// Appends `result` as the one result of operation `op` of run `run`.
    async fn give_result(
        &self,
        run: &RunId,
        op: &OperationId,
        result: ToolResult,
    ) -> Result<(), DriveError> {
        let env = Envelope::new(
            run.clone(),
            Timestamp::now(),
            Draft::new(Event::ToolResult(result))
                .step(op.step())
                .op(op.clone()),
        );
        match self
            .rt
            .journal
            .append_input(&env, InputId::tool_result(op).as_str())
            .await
        {
            // Given before (a redelivered wake, a nudge, another worker): the one result stands.
            Ok(_) | Err(JournalError::Duplicate { .. }) => Ok(()),
            Err(e) => Err(e.into()),
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

    async fn call_model(
        &self,
        state: &RunState,
        def: &AgentDefinition,
        called: &Called,
        plan: &StepPlan,
        learned: &mut Option<kedge_model::RateLimits>,
    ) -> Result<kedge_core::decide::ModelResponse, CallError> {
        // The operator's model policy, at run time too: a definition stored around
        // `kedge agents put` still cannot send the conversation or a key elsewhere.
        self.rt
            .config
            .check_model(&called.key_var, called.spec.base_url.as_deref())
            .map_err(|reason| CallError::Model(ModelError::refused_by_policy(reason)))?;
        let api_key = self.rt.config.api_key(&called.key_var);
        // Sensitive values are sealed in the journal; the model reads them in clear.
        let context = open_context(&self.rt, state, def, &plan.context)
            .map_err(|e| CallError::Model(ModelError::refused_by_policy(e.to_string())))?;
        let call = ModelCall {
            spec: &called.spec,
            api_key: api_key.as_deref(),
            system: &def.system_prompt,
            tools: &def.tools,
            context: context.as_deref().unwrap_or(&plan.context),
            request_id: &plan.request_id,
            max_output_tokens: def.max_output_tokens,
            output_schema: def.output_schema.as_ref(),
            timeout: self.rt.config.timeouts.model_timeout(),
        };
        // Token deltas go to core NATS, never to the journal.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let client = self.rt.client.clone();
        let subject = kedge_core::subjects::delta(&state.run_id);
        let header = serde_json::json!({"step": plan.step, "attempt": plan.attempt});
        let forward = tokio::spawn(async move {
            while let Some(mut text) = rx.recv().await {
                // Deltas already waiting go out as one (a fast stream, or a provider that sends
                // many small chunks at once): nothing is held back, and the text is the same.
                while let Ok(more) = rx.try_recv() {
                    text.push_str(&more);
                }
                let mut body = header.clone();
                body["text"] = text.into();
                let _ = client
                    .publish(subject.clone(), body.to_string().into())
                    .await;
            }
        });
        let mut on_delta = |d: Delta| match d {
            Delta::Text(t) => {
                let _ = tx.send(t);
            }
            Delta::Limits(l) => *learned = Some(l),
            _ => {}
        };
        let mut cancels = self.cancels.subscribe();
        let run = state.run_id.clone();
        let cancelled = async move {
            loop {
                match cancels.recv().await {
                    Ok(r) if r == run => return,
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        std::future::pending::<()>().await
                    }
                }
            }
        };
        let result = if state.cancel_requested.is_some() {
            Err(CallError::Cancelled)
        } else {
            // A lost lease does not abort the call: the answer is paid for, so it is stored
            // (and reused by whoever holds the run now) even if this worker may not commit it.
            tokio::select! {
                r = self.model.complete(&call, &mut on_delta) => r.map_err(CallError::Model),
                _ = cancelled => Err(CallError::Cancelled),
            }
        };
        drop(tx);
        let _ = forward.await;
        // The sensitive arguments of its tool calls are sealed before the response is stored,
        // decided on or logged.
        result.and_then(|mut response| {
            seal_response(&self.rt, state, def, &mut response)
                .map_err(|e| CallError::Model(ModelError::refused_by_policy(e.to_string())))?;
            Ok(response)
        })
    }
}

/// The context to send the model with the sealed values of the run opened
/// ([`kedge_runtime::seal`]); `None` when nothing in it is sealed (the plan's is sent as is).
/// Refused when the agent marks values sensitive and this process has no seal key.
fn open_context(
    rt: &Runtime,
    state: &RunState,
    def: &AgentDefinition,
    context: &[ChatMessage],
) -> Result<Option<Vec<ChatMessage>>, SealError> {
    if rt.seal.is_none() {
        // Nothing can be sealed for this run; a string that looks sealed is the model's text.
        return if def.marks_sensitive() {
            Err(SealError::NoKey)
        } else {
            Ok(None)
        };
    }
    // Looked for in place first: most contexts hold nothing sealed, and this runs every step.
    let sealed = context.iter().any(|m| match m {
        ChatMessage::User { text } => seal::is_sealed(text),
        ChatMessage::Assistant { message } => {
            seal::is_sealed(&message.text)
                || message
                    .tool_calls
                    .iter()
                    .any(|c| seal::holds_sealed(&c.arguments))
        }
        ChatMessage::Tool { content, .. } => seal::is_sealed(content),
    });
    if !sealed {
        return Ok(None);
    }
    let mut value = serde_json::to_value(context).unwrap_or_default();
    seal::open_all(rt.seal.as_ref(), &state.run_id, &mut value)?;
    serde_json::from_value(value)
        .map(Some)
        .map_err(|_| SealError::Unopenable("a sealed value does not fit where it was"))
}

/// A child's input as its `run.created` keeps it: a value the parent holds sealed
/// (`policy.run_agent.sensitive`) is opened and sealed again for the child (a token opens only
/// in its own run), and one the child's agent marks sensitive is sealed. So it is sealed when
/// either side marks it, never journaled in clear.
fn seal_child_input(
    rt: &Runtime,
    parent: &RunState,
    child: &RunId,
    def: &AgentDefinition,
    input: &mut String,
) -> Result<(), SealError> {
    let held_sealed = seal::is_sealed(input);
    if !held_sealed && !def.sensitive_task_fields.iter().any(|f| f == "input") {
        return Ok(());
    }
    let key = rt.seal.as_ref().ok_or(SealError::NoKey)?;
    let clear = if held_sealed {
        match key.open(&parent.run_id, input)? {
            serde_json::Value::String(s) => s,
            other => other.to_string(),
        }
    } else {
        std::mem::take(input)
    };
    *input = key.seal(child, &serde_json::Value::String(clear));
    Ok(())
}

/// Seals the arguments the agent marks sensitive (`policy.<tool>.sensitive`) in the model's
/// tool calls.
fn seal_response(
    rt: &Runtime,
    state: &RunState,
    def: &AgentDefinition,
    response: &mut kedge_core::decide::ModelResponse,
) -> Result<(), SealError> {
    for call in &mut response.message.tool_calls {
        let names = def.sensitive_params(&call.name);
        if !names.is_empty() {
            seal::seal_fields(rt.seal.as_ref(), &state.run_id, &mut call.arguments, names)?;
        }
    }
    Ok(())
}

enum CallError {
    Model(ModelError),
    Cancelled,
}

/// The `context.compacted` that brings the run's next model request within its model's window
/// ([`kedge_core::context::compaction`]), or `None` when it fits, the window is not known,
/// nothing more may be taken out, or the agent's `context.strategy` is `fail`. `refused`: the
/// provider refused the last request as too long; the conversation is then brought to half its
/// estimate (the estimate undercounted), or within the window the refusal names.
fn compaction(
    state: &RunState,
    def: &AgentDefinition,
    refused: Option<&ModelError>,
) -> Option<kedge_core::event::ContextCompacted> {
    use kedge_core::context::{self, ContextStrategy};
    // A run that has not started has no turn to leave out; a cancelling or compensating one
    // calls no model.
    if def.context.strategy == ContextStrategy::Fail
        || matches!(
            state.status,
            RunStatus::Queued
                | RunStatus::Cancelling
                | RunStatus::Compensating
                | RunStatus::Unknown
                | RunStatus::Cancelled
        )
    {
        return None;
    }
    let window = def
        .context
        .window_tokens
        .or_else(|| kedge_model::context::known_window(&state.bundle.model))
        .map(u64::from);
    // An unknown window is compacted only on the provider's refusal: no estimate per step.
    if window.is_none() && refused.is_none() {
        return None;
    }
    let overhead = kedge_model::context::overhead_tokens(&def.system_prompt, &def.tools)
        .saturating_add(u64::from(def.max_output_tokens));
    let pending = state.consumable(state.last_seq);
    let estimated = context::context_tokens(&state.transcript, &pending, state.compaction.as_ref());
    let budget = match refused {
        None => window?.saturating_sub(overhead),
        Some(e) => {
            let named = e.window_named().or(window).unwrap_or(u64::MAX);
            (estimated / 2).min(named.saturating_sub(overhead))
        }
    };
    let c = context::compaction(state, &pending, budget, def.context.keep_last_turns)?;
    let index = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
    Some(kedge_core::event::ContextCompacted {
        keep_from: index(c.keep_from),
        elided: c.elided.into_iter().map(index).collect(),
        estimated_tokens: estimated,
        budget_tokens: budget,
        cause: match refused {
            None => kedge_core::event::CompactionCause::Estimate,
            Some(_) => kedge_core::event::CompactionCause::TooLong,
        },
        summary: None,
        max_result_chars: c
            .max_result_chars
            .filter(|n| state.compaction.as_ref().and_then(|p| p.max_result_chars) != Some(*n))
            .map(index),
    })
}

/// A step's model call that met provider trouble (or was held, or waits its turn), for
/// [`Driver::wait_on_provider`].
struct ProviderTrouble<'a> {
    /// Where the run waits.
    queue: WaitList<'a>,
    /// The endpoint the call went to (or would have): the run's model's, or a fallback's.
    called: &'a Endpoint,
    met: TroubleMet,
    retry_after: Option<Duration>,
    why: metrics::ProviderWait,
}

/// Where a run waits on its provider: always the wait list of its own model's endpoint (the
/// releaser of that endpoint lets it go: to its own model, or to a fallback), with what its
/// release needs to know.
struct WaitList<'a> {
    providers: &'a Providers,
    endpoint: &'a Endpoint,
    /// The run's place under its own model's rate limits, when it has any.
    turn: Option<Turn>,
    fallbacks: &'a [Endpoint],
    fallback_after: Option<Duration>,
}

impl WaitList<'_> {
    fn waiter(&self, state: &RunState, since: Timestamp, not_before: Timestamp) -> Waiter {
        Waiter {
            run_id: state.run_id.clone(),
            tenant: state.bundle.tenant.clone(),
            since,
            not_before,
            pace: self.turn.as_ref().map(|t| t.pace.clone()),
            tokens: self.turn.as_ref().map_or(0, |t| t.tokens),
            fallbacks: self.fallbacks.iter().map(|e| e.id.clone()).collect(),
            fallback_after_ms: self
                .fallback_after
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        }
    }
}

/// A model a step may call: the run's own (frozen in `run.created`) or one of its agent's
/// fallbacks, with the variable holding its key and its endpoint.
struct Called {
    spec: kedge_core::event::ModelSpec,
    key_var: String,
    endpoint: Endpoint,
}

impl Called {
    fn primary(state: &RunState, def: &AgentDefinition) -> Called {
        let key_var = kedge_model::api_key_env(def);
        Called {
            endpoint: Endpoint::new(&state.bundle.model, &key_var),
            spec: state.bundle.model.clone(),
            key_var,
        }
    }

    fn fallback(f: &kedge_core::agent::FallbackModel) -> Called {
        let key_var = kedge_model::fallback_key_env(f);
        Called {
            endpoint: Endpoint::new(&f.model, &key_var),
            spec: f.model.clone(),
            key_var,
        }
    }

    /// The call's place under the model's rate limits at its endpoint (configured, or named
    /// by the provider), when it has any.
    fn turn(
        &self,
        config: &kedge_runtime::config::Config,
        providers: &Providers,
        def: &AgentDefinition,
        context: &[ChatMessage],
    ) -> Option<Turn> {
        let configured = configured_limits(config, &self.spec, &self.key_var);
        let limits = providers.limits(&self.endpoint, &self.spec.name, configured);
        (!limits.is_none()).then(|| Turn {
            pace: self.endpoint.pace_id(&self.spec.name),
            configured,
            tokens: if limits.tokens_per_minute.is_some() {
                request_tokens(def, context)
            } else {
                0
            },
        })
    }
}

/// A call's place under the rate limits of its model at its endpoint: the pace its slot is
/// reserved on, the limits this process is configured with, and its input tokens as estimated.
#[derive(Debug, Clone)]
struct Turn {
    pace: String,
    configured: Limits,
    tokens: u64,
}

/// What a failed call tells its endpoint's breaker (`probe`: the call was the fleet's probe);
/// `None` for a failure that is not the provider's trouble.
fn trouble_report(e: &ModelError, probe: bool) -> Option<TroubleReport> {
    e.trouble.map(|trouble| TroubleReport {
        trouble,
        message: e.message.clone(),
        retry_after: e.retry_after,
        probe,
    })
}

/// The limits this process's configuration (`providers.limits`) sets for calls to `spec`'s
/// endpoint with the key in `key_var`.
fn configured_limits(
    config: &kedge_runtime::config::Config,
    spec: &kedge_core::event::ModelSpec,
    key_var: &str,
) -> Limits {
    config
        .providers
        .limit_for(spec, key_var)
        .map(|l| Limits {
            requests_per_minute: l.requests_per_minute,
            tokens_per_minute: l.tokens_per_minute,
        })
        .unwrap_or_default()
}

/// A request's input tokens, as estimated before it is sent: the system prompt, the tools and
/// the context ([`kedge_core::context::estimate`]).
fn request_tokens(def: &AgentDefinition, context: &[ChatMessage]) -> u64 {
    kedge_model::context::overhead_tokens(&def.system_prompt, &def.tools).saturating_add(
        context
            .iter()
            .map(kedge_core::context::estimate)
            .sum::<u64>(),
    )
}

/// The wait before the next attempt: the provider's `retry-after` if given, else exponential
/// backoff with jitter ([`kedge_core::decide::model_retry_delay`]: many runs failing at once on
/// one provider do not retry in step); never more than `max`.
fn retry_delay(e: &ModelError, attempt: u32, max: Duration) -> Duration {
    kedge_core::decide::model_retry_delay(attempt, e.retry_after, max, kedge_runtime::jitter_draw())
}

/// Counts a model call attempt: its outcome and duration, an error's class and kind, an
/// answer's tokens and cost at the frozen price of the model that answered.
fn count_call(
    model: &kedge_core::event::ModelSpec,
    result: &Result<kedge_core::decide::ModelResponse, CallError>,
    took: Duration,
) {
    match result {
        Ok(response) => {
            metrics::model_call(ModelOutcome::Ok, took);
            let usage = &response.usage;
            let price = model.price.as_ref();
            let cost = price.map(|p| (p.cost(usage), p.currency.as_str()));
            metrics::model_usage(usage.input_tokens, usage.output_tokens, cost);
        }
        Err(CallError::Cancelled) => metrics::model_call(ModelOutcome::Cancelled, took),
        Err(CallError::Model(e)) => {
            metrics::model_call(ModelOutcome::Error, took);
            metrics::model_error(e.class, e.kind.as_str());
        }
    }
}
