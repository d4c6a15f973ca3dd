//! The step service: the single decision writer of each run.
//!
//! Driven by the journal's own events through the durable pull consumer `step` (a run's
//! `run.created` and every input wake it; there is no separate wake queue and no polling). For a
//! woken run it takes the run's lease, folds the journal, and loops on
//! [`kedge_core::decide()`] until the run is idle:
//!
//! - `Commit(decisions)`: append them with the optimistic-concurrency check;
//! - `Step(plan)`: journal `step.started` (intent before effect), call the model while renewing
//!   the lease, then commit the step's decisions, `step.completed` carrying the answer. A
//!   commit that does not land (or a state that must be read again first) stores the response
//!   in `kedge_idempotency` for the step's next attempt. A lease lost meanwhile does not abort
//!   the call (the answer is paid for): the response is stored and left to the run's new
//!   holder, which reuses it. A plan that names
//!   an unfinished earlier attempt first looks for that attempt's stored response and reuses it,
//!   so a worker killed after the model answered costs no second call.
//!
//! In a process that runs the tool service too (`Tools::Inline`), built-in tools are run inside
//! the drive that requested them, which goes on with their results: the whole agent loop of a
//! run is one drive (docs/ARCHITECTURE.md "Inline tools").
//!
//! Wakes for a run this process is already driving are folded into the running drive (it reads
//! the journal again before letting go), so a burst of inputs costs one drive, not one each.
//! A drive that leaves its run waiting on its tools keeps the lease parked for the next drive
//! (the tools' results follow in moments) instead of releasing it, until its next renewal would
//! be due; another step worker woken for such a run asks for it on `kedge.live.yield.<worker>`.
//! A wake for a run whose lease another worker holds and does not yield is handed back with a
//! short delay, unless that worker is gone (`kedge_runtime::liveness`: the broker has no
//! connection for it), in which case the lease is taken over at once. The runs this process
//! drives are announced in its heartbeats; when another worker is found gone, the runs its last
//! heartbeat named are adopted and driven here right away (docs/ARCHITECTURE.md "Takeover").
//!
//! Hostile or broken input never stops a run or the service: messages on a run's subjects that
//! are not events of the run are set aside by the journal, recorded once on
//! `agent.rejected.journal.<run>.<seq>` (`KEDGE_REJECTIONS`), counted in the folded state, and
//! the wake they caused is acked once the run is driven. A drive that panics is contained (the
//! wake is handed back with a delay, the lease expires, other drives go on). Every failure is
//! retried with a growing delay a bounded number of times (`max_deliver` of the `step`
//! consumer); the last delivery of a failing wake is a dead letter on
//! `agent.rejected.dead.step`, logged at error.

mod drive;

use std::collections::HashMap;
use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use std::panic::AssertUnwindSafe;

use async_nats::jetstream::{AckKind, Message};
use futures::FutureExt;
use kedge_core::fairness::Pace;
use kedge_core::ids::RunId;
use kedge_core::subjects::Durable;
use kedge_model::ModelClient;
use kedge_runtime::consumer::{Backoff, Verdict};
use kedge_runtime::fair::{self, FairFeed, Tenancy};
use kedge_runtime::responder::{self, Busy, Listen, Responder};
use kedge_runtime::tenants::RunTenants;
use kedge_runtime::{Runtime, RuntimeError, consumer};

pub use drive::{DriveError, Driver, INLINE_PER_DRIVE, Outcome};

/// Redelivery delay of a wake whose run is leased by another worker (doubled per delivery up to
/// [`BUSY_MAX`]).
const BUSY_DELAY: Duration = Duration::from_millis(250);
const BUSY_MAX: Duration = Duration::from_secs(2);
/// Redelivery delays after a retryable failure (doubled per delivery up to the cap).
const RETRY_DELAY: Duration = Duration::from_secs(1);
const RETRY_MAX: Duration = Duration::from_secs(30);
/// Redelivery delays after a failure that may not go away (a panic, a journal that does not
/// fold): retried a bounded number of times in case it was transient, then a dead letter.
const FAIL_DELAY: Duration = Duration::from_secs(2);
const FAIL_MAX: Duration = Duration::from_secs(60);
/// Drives of an adopted run (one without a wake of its own) after the first failed: each after
/// [`RETRY_DELAY`] doubled per try up to [`RETRY_MAX`]; past them the run is left to the
/// reconciler's nudge.
const ADOPT_TRIES: u32 = 8;
/// The durable consumer's name (and the dead letters' subject token).
const CONSUMER: Durable = Durable::Step;

/// Per-run bookkeeping of this process: whether more wakes arrived during the drive, and the
/// newest of them ([`Absorbed`]).
type Active = Arc<Mutex<HashMap<RunId, Option<Absorbed>>>>;

/// The newest wake a drive in progress absorbed: its stream sequence (0: one without a
/// sequence, read with the leader's check) and the message (acknowledged already), whose
/// chain the re-drive may read instead of the run's subjects
/// ([`kedge_journal::Journal::read_chained`]).
struct Absorbed {
    through: u64,
    wake: Option<Arc<Message>>,
}

/// The stream sequence of a wake (an acknowledged event of its run).
fn wake_seq(msg: &Message) -> Option<u64> {
    msg.info().ok().map(|info| info.stream_sequence)
}

/// Yield requests answered at once by one step process: one at a time, in the order they
/// come (each releases at most one parked lease, in moments).
const YIELDS_IN_FLIGHT: usize = 1;

/// Answers other step workers' requests to let go of a lease this process keeps parked
/// ([`drive::Driver::yield_parked`]) on `kedge.live.yield.<worker>`: the payload is a run id, the
/// answer the release marker's sequence, or empty. Anyone allowed on `kedge.live.>` can ask; all
/// an asker gets is a lease released earlier than it would have been. Stops (and unsubscribes)
/// when the returned task is aborted.
async fn answer_yields(
    rt: &Runtime,
    driver: drive::Driver,
) -> Result<tokio::task::JoinHandle<()>, RuntimeError> {
    let requests = Responder::subscribe(
        &rt.client,
        Listen {
            what: "lease yield requests",
            subject: kedge_core::subjects::live_yield(&rt.config.worker_id),
            queue: kedge_core::subjects::YIELD_QUEUE,
            bound: YIELDS_IN_FLIGHT,
            busy: Busy::Wait,
        },
    )
    .await?;
    let client = rt.client.clone();
    Ok(tokio::spawn(async move {
        requests
            .run(std::future::pending(), |msg| {
                let (client, driver) = (client.clone(), driver.clone());
                async move {
                    if msg.reply.is_none() {
                        return;
                    }
                    let run = std::str::from_utf8(&msg.payload)
                        .ok()
                        .and_then(|s| s.parse::<RunId>().ok());
                    let answer = match run {
                        Some(run) => driver.yield_parked(&run).await,
                        None => None,
                    };
                    let body = answer.map(|m| m.seq.to_string()).unwrap_or_default();
                    responder::reply_raw(&client, &msg, body.into()).await;
                }
            })
            .await;
    }))
}

/// Runs the step service until `shutdown` resolves, then lets in-flight drives finish. Every
/// operation goes to the tool service.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    run_with(rt, shutdown, Tools::Service).await
}

/// Where the operations a run's drive requests are run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Tools {
    /// By the tool service, whatever their tool.
    Service,
    /// Built-in tools inside the drive itself, when `inline_tools` is on: for a process that
    /// runs the tool service too, whose sandbox, workspace root and permissions they need
    /// (docs/ARCHITECTURE.md "Inline tools"); the others by the tool service.
    Inline,
}

/// [`run`], with the operations run as `tools` says.
pub async fn run_with(
    rt: Runtime,
    shutdown: impl Future<Output = ()>,
    tools: Tools,
) -> Result<(), RuntimeError> {
    let light = rt.light_lane().await?;
    // Wakes are taken in fair order across tenants (docs/ARCHITECTURE.md "Fairness across
    // tenants"): a run's tenant is read from its run.created. New runs come on one consumer,
    // their inputs on another, each with one filter subject (docs/ARCHITECTURE.md "The
    // broker's cost per run"); a dead letter of either is the step's.
    let feed = FairFeed::open_many(
        &rt,
        &[CONSUMER, Durable::StepCreated],
        passed_over,
        rt.config.timeouts.step_ack_wait(),
        fair::window(
            rt.config.step_concurrency,
            consumer::max_ack_pending(CONSUMER),
        ),
        |feeder| Tenancy::Run(Box::new(RunTenants::new(feeder.journal.clone()))),
    )
    .await?;
    let (cancels, _) = tokio::sync::broadcast::channel(1024);
    // In-flight model calls of a cancelled run are aborted at once (a missed notification only
    // lets the call run to its end; the commit after it still sees the cancel).
    let tx = cancels.clone();
    let watching = rt
        .on_cancel_requests(move |run| {
            let _ = tx.send(run);
        })
        .await?;
    let liveness = rt.liveness().await?;
    let mut deaths = liveness.deaths();
    let (readopt, mut readopts) = tokio::sync::mpsc::unbounded_channel();
    let inline = match tools {
        Tools::Inline if rt.config.inline_tools => Some(kedge_tool::Inline::open(&rt).await?),
        Tools::Inline | Tools::Service => None,
    };
    let driver = drive::Driver::new(rt.clone(), ModelClient::new(), cancels, liveness, inline);
    let light_workers = fair::light_workers(rt.config.step_concurrency);
    let light_on = light.as_ref().and_then(|l| l.executor().cloned());
    let drives = Arc::new(Drives {
        // The light lane, for the runs of tenants without a backlog
        // (docs/ARCHITECTURE.md "Fairness across tenants").
        light: light.map(|light| driver.on(light, ModelClient::new())),
        driver,
        active: Arc::default(),
        workers: consumer::Workers::adaptive(
            rt.config.step_concurrency,
            rt.admission_probe("step", true),
            "step",
        ),
        js: rt.js.clone(),
        readopt,
    });
    if let Some(on) = &light_on {
        let drives = drives.clone();
        feed.take_light(on, light_workers.clone(), move |slot, msg| {
            let drives = drives.clone();
            async move { drives.wake(slot, msg, Pace::Light).await }
        });
    }
    let yields = answer_yields(&rt, drives.driver.clone()).await?;
    // Releases the runs waiting on a model provider when the fleet may call it again
    // (docs/ARCHITECTURE.md "Provider trouble"); one process per endpoint does, by its lead.
    let releaser = tokio::spawn(rt.providers().await?.run_releaser(rt.journal.clone()));
    tracing::info!(worker = %rt.config.worker_id, "step service started");
    tokio::pin!(shutdown);
    loop {
        let msg = tokio::select! {
            _ = &mut shutdown => break,
            death = deaths.recv() => {
                match death {
                    // A process that held runs is gone: drive them now (the lease is taken
                    // over from it), not when their wakes are redelivered.
                    Ok(death) => {
                        let last_heard = std::time::Instant::now()
                            .checked_sub(death.silent_for)
                            .unwrap_or_else(std::time::Instant::now);
                        for run in death.held.runs {
                            drives.driver.adopting(&run, last_heard);
                            tracing::info!(run_id = %run, worker = %death.worker, "adopting a run of a gone worker");
                            drives.start(run, Wake::Adopted { tries: 0 }, None, Pace::Shared).await;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        tracing::warn!(missed = n, "missed worker deaths; their runs wait for redelivery");
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {}
                }
                continue;
            }
            Some((run, tries)) = readopts.recv() => {
                drives.start(run, Wake::Adopted { tries }, None, Pace::Shared).await;
                continue;
            }
            next = feed.next(&drives.workers) => match next {
                Some(next) => next,
                None => break,
            },
        };
        let (slot, msg, pace) = msg;
        drives.wake(slot, msg, pace).await;
    }
    // Drain: hand back the wakes pulled and not started, then wait for every in-flight drive.
    feed.hand_back().await;
    drives.workers.drain().await;
    light_workers.drain().await;
    yields.abort();
    releaser.abort();
    watching.abort();
    drives.driver.release_parked().await;
    drives.driver.flush_list().await;
    tracing::info!("step service stopped");
    Ok(())
}

/// A delivery that does not wake a run: an input that does not change what it does next
/// ([`kedge_core::event::EventType::wakes_step`]). A subject that is not an event's is not
/// passed over: its handler sets it aside.
fn passed_over(msg: &Message) -> bool {
    kedge_core::subjects::parse_event(&msg.subject).is_some_and(|p| !p.event_type.wakes_step())
}

/// Why a run is driven.
enum Wake {
    /// A wake the consumer delivered: settled after the drive, so a failed drive is tried again
    /// on its redelivery.
    Delivered(Box<Message>),
    /// Adopted from a gone worker, after `tries` drives of it failed. Nothing is redelivered for
    /// it (and a wake of the run delivered meanwhile may have been absorbed by this drive and
    /// acknowledged), so a failed drive is tried again from here ([`ADOPT_TRIES`]).
    Adopted { tries: u32 },
}

/// Starts drives: at most one per run in this process (a wake for a run being driven is folded
/// into that drive), at most `step_concurrency` at once, and beside them the light taker's
/// drives on slots of its own ([`fair::light_workers`]).
struct Drives {
    driver: drive::Driver,
    /// The driver over the light lane, when the process has one: drives of a tenant without a
    /// backlog (its wake's [`Pace`]).
    light: Option<drive::Driver>,
    active: Active,
    workers: consumer::Workers,
    js: async_nats::jetstream::Context,
    /// Adopted runs to drive again (after their failed drive's delay).
    readopt: tokio::sync::mpsc::UnboundedSender<(RunId, u32)>,
}

impl Drives {
    /// Drives the run of the delivered wake `msg` on `slot` ([`Drives::start`]).
    async fn wake(&self, slot: consumer::Slot, msg: Message, pace: Pace) {
        let Some(parsed) = kedge_core::subjects::parse_event(&msg.subject) else {
            tracing::warn!(subject = %msg.subject, "not a journal event subject; terminating it");
            let _ = msg.ack_with(AckKind::Term).await;
            return;
        };
        let wake = Wake::Delivered(Box::new(msg));
        self.start(parsed.run_id, wake, Some(slot), pace).await;
    }

    /// Drives `run_id` for `wake`; on `slot` when one is reserved already, else on the next
    /// free one; over the light lane when the wake's `pace` says so.
    async fn start(&self, run_id: RunId, wake: Wake, slot: Option<consumer::Slot>, pace: Pace) {
        let (msg, tries) = match wake {
            Wake::Delivered(msg) => (Some(*msg), 0),
            Wake::Adopted { tries } => (None, tries),
        };
        // Whether a drive of this run is already in progress here (then it absorbs this wake).
        let seq = msg.as_ref().and_then(wake_seq);
        let msg = msg.map(Arc::new);
        let absorbed = match self.active.lock() {
            Ok(mut map) => match map.get_mut(&run_id) {
                Some(dirty) => {
                    // The re-drive must read through the newest absorbed wake (0 when one has
                    // no sequence: then the leader is asked).
                    let newest = match (dirty.as_ref().map(|d| d.through), seq) {
                        (Some(0), _) | (_, None) => 0,
                        (Some(a), Some(b)) => a.max(b),
                        (None, Some(b)) => b,
                    };
                    let wake = if newest > 0 && seq == Some(newest) {
                        msg.clone()
                    } else {
                        dirty.take().and_then(|d| d.wake)
                    };
                    *dirty = Some(Absorbed {
                        through: newest,
                        wake: wake.filter(|_| newest > 0),
                    });
                    true
                }
                None => {
                    map.insert(run_id.clone(), None);
                    false
                }
            },
            Err(_) => return,
        };
        if absorbed {
            // The drive in progress will read this event before it lets go.
            if let Some(msg) = msg {
                let _ = msg.ack().await;
            }
            return;
        }
        let driver = fair::lane(CONSUMER, pace, &self.driver, self.light.as_ref()).clone();
        let active = self.active.clone();
        let js = self.js.clone();
        let readopt = self.readopt.clone();
        let slot = match slot {
            Some(slot) => slot,
            None => self.workers.slot().await,
        };
        let on = driver.executor();
        self.workers.run_on(on.as_ref(), slot, async move {
                let mut through = seq;
                let mut latest = None;
                let (result, owed) = loop {
                    // A panic in a drive (a bug) is contained: this run's wake is handed back
                    // (bounded, like any failure), the process and its other drives go on.
                    let drive = driver.drive(&run_id, msg.clone(), through, latest.take());
                    let result = AssertUnwindSafe(drive)
                        .catch_unwind()
                        .await
                        .unwrap_or_else(|panic| {
                            let reason = kedge_runtime::failpoint::panic_message(panic.as_ref());
                            tracing::error!(run_id = %run_id, panic = %reason, "drive panicked; the wake is handed back");
                            Err(DriveError::Panicked(reason))
                        });
                    let next = match active.lock() {
                        Ok(mut map) => match map.get_mut(&run_id) {
                            Some(dirty) => {
                                let next = after_drive(dirty.take(), result.is_ok());
                                if !matches!(next, AfterDrive::Again(_)) {
                                    map.remove(&run_id);
                                }
                                next
                            }
                            None => AfterDrive::Done { owed: false },
                        },
                        Err(_) => AfterDrive::Done { owed: false },
                    };
                    match next {
                        AfterDrive::Again(absorbed) => {
                            through = Some(absorbed.through).filter(|seq| *seq > 0);
                            latest = absorbed.wake;
                        }
                        AfterDrive::Done { owed } => break (result, owed),
                    }
                };
                match msg {
                    Some(msg) => {
                        // Wakes this failed drive absorbed were acknowledged; the redelivery
                        // of `msg` may read the run only through its own event (a backlog
                        // look), so the run is driven again from here, as an adopted one.
                        if let (true, Err(e)) = (owed, &result) {
                            drive_later(readopt, run_id.clone(), 0, e, "absorbed wakes of a failed drive");
                        }
                        settle(&js, &run_id, &msg, result).await;
                    }
                    None => match result {
                        Err(e) => drive_later(readopt, run_id, tries, &e, "adopted run not driven"),
                        // Its lease, read from the leader, is another live worker's: that worker
                        // drives the run and reads its journal before it lets go.
                        Ok(Outcome::Busy) => {
                            tracing::debug!(run_id = %run_id, "adopted run held by another live worker; left to it");
                        }
                        Ok(Outcome::Idle) => {}
                    },
                }
            });
    }
}

/// What follows a drive of a run, from the wakes it absorbed meanwhile ([`Absorbed`], the
/// newest) and whether it succeeded.
enum AfterDrive {
    /// Drive the run again at once, reading through the newest absorbed wake.
    Again(Absorbed),
    /// The drive is over. `owed`: wakes it absorbed (and acknowledged) were not read by a
    /// drive that succeeded, so the run is owed one.
    Done { owed: bool },
}

/// Decides [`AfterDrive`]: a drive that succeeded with wakes absorbed goes again (to read
/// them); one that failed leaves them owed, for a failed drive is retried by its own wake's
/// redelivery, which need not read past that wake's event (docs/ARCHITECTURE.md "The step
/// service", "Chained wakes").
fn after_drive(absorbed: Option<Absorbed>, succeeded: bool) -> AfterDrive {
    match (absorbed, succeeded) {
        (Some(absorbed), true) => AfterDrive::Again(absorbed),
        (Some(_), false) => AfterDrive::Done { owed: true },
        (None, _) => AfterDrive::Done { owed: false },
    }
}

/// Drives a run again from this process after a drive of it failed (`tries` failed before;
/// `why` says which), with no wake of its own: after a delay growing per try; past
/// [`ADOPT_TRIES`] the reconciler's nudge covers it.
fn drive_later(
    readopt: tokio::sync::mpsc::UnboundedSender<(RunId, u32)>,
    run_id: RunId,
    tries: u32,
    error: &DriveError,
    why: &'static str,
) {
    if tries >= ADOPT_TRIES {
        tracing::warn!(run_id = %run_id, %error, tries, "{why}; left to the reconciler's nudge");
        return;
    }
    let delay = consumer::retry_delay(i64::from(tries) + 1, RETRY_DELAY, RETRY_MAX);
    tracing::warn!(run_id = %run_id, %error, retry_in_ms = delay.as_millis() as u64, "{why}; driving the run again");
    tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        // Closed: the service is stopping (the run's lease lapses for another worker).
        let _ = readopt.send((run_id, tries + 1));
    });
}

/// Settles a wake after its drive ([`consumer::settle`]): acked when the run is idle; handed
/// back with a short delay growing per delivery while another worker drives the run (dropped
/// at its last delivery: not a failure, for the holder reads the journal again before it lets
/// go, and the reconciler nudges a run left with work); a failed drive is retried with a
/// backoff and, at the last delivery, is a dead letter.
async fn settle(
    js: &async_nats::jetstream::Context,
    run_id: &RunId,
    msg: &Message,
    result: Result<Outcome, DriveError>,
) {
    let verdict = match result {
        Ok(Outcome::Idle) => Verdict::Ack,
        Ok(Outcome::Busy) => Verdict::Later(consumer::retry_delay(
            consumer::deliveries(msg),
            BUSY_DELAY,
            BUSY_MAX,
        )),
        Err(e) if e.is_retryable() => Verdict::Retry(
            format!("run {run_id}: {e}"),
            Backoff {
                base: RETRY_DELAY,
                cap: RETRY_MAX,
            },
        ),
        Err(e) => {
            tracing::error!(run_id = %run_id, error = %e, "drive failed");
            Verdict::Retry(
                format!("run {run_id}: {e}"),
                Backoff {
                    base: FAIL_DELAY,
                    cap: FAIL_MAX,
                },
            )
        }
    };
    consumer::settle(js, CONSUMER, msg, verdict).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    fn absorbed(through: u64) -> Option<Absorbed> {
        Some(Absorbed {
            through,
            wake: None,
        })
    }

    #[test]
    fn a_drive_that_succeeded_reads_the_wakes_it_absorbed_at_once() {
        match after_drive(absorbed(42), true) {
            AfterDrive::Again(a) => assert_eq!(a.through, 42),
            AfterDrive::Done { .. } => panic!("the absorbed wakes were not read"),
        }
    }

    #[test]
    fn a_drive_that_failed_leaves_the_run_owed_a_drive_for_the_wakes_it_absorbed() {
        // Those wakes were acknowledged when absorbed, and the failed drive's own wake, when
        // redelivered, may read the run only through its own event.
        assert!(matches!(
            after_drive(absorbed(42), false),
            AfterDrive::Done { owed: true }
        ));
        assert!(matches!(
            after_drive(absorbed(0), false),
            AfterDrive::Done { owed: true }
        ));
    }

    #[test]
    fn a_drive_that_absorbed_nothing_is_over() {
        for succeeded in [true, false] {
            assert!(matches!(
                after_drive(None, succeeded),
                AfterDrive::Done { owed: false }
            ));
        }
    }
}
