//! The timer service: durable timers that fire exactly once into a run's journal and survive
//! kill -9 of every Kedge process and of nats-server.
//!
//! A timer is decided by the step service (`timer.scheduled`, e.g. for a `wait` tool call) and
//! kept by the broker, not by this process: the service turns each `timer.scheduled` into a
//! JetStream *message schedule* in the stream `KEDGE_TIMERS`, and turns each firing into a
//! `timer.fired` input of the run. Between the two, nothing Kedge runs holds the timer (no task,
//! no tokio timer, no connection): ten thousand waiting runs are ten thousand small messages.
//!
//! ```text
//! KEDGE_RUNS  agent.run.<run>.d.timer.scheduled ──(consumer `timer`)──▶ schedule
//! KEDGE_TIMERS kedge.timer.sched.<run>.<timer>    Nats-Schedule: @at <fire_at>
//!                       │ the broker, at fire_at
//!                       ▼
//! KEDGE_TIMERS kedge.timer.fired.<run>.<timer> ──(consumer `timer-fired`)──▶ append input
//! KEDGE_RUNS  agent.run.<run>.i.timer.fired       Nats-Msg-Id: timer.fired:<timer>
//! ```
//!
//! Why a stream of its own: a stream with `allow_msg_schedules` has `allow_rollup_hdrs` forced on
//! (schedules are stored as rollups), and a journal that accepts `Nats-Rollup` could be purged by
//! any publisher under `agent.run.>`. The journal stays without rollups; the layout check refuses
//! a `KEDGE_RUNS` that accepts them.
//!
//! # What message schedules do on the wire (measured, nats-server 2.15.1)
//!
//! Pinned by `tests/schedules.rs`, so a server upgrade that changes any of it fails a test.
//!
//! - A schedule is a message on its own subject (one pending schedule per subject) with
//!   `Nats-Schedule: @at <RFC 3339>` and `Nats-Schedule-Target: <subject in the same stream>`.
//!   The server stores it with an added `Nats-Rollup: sub` header (so a second schedule on the
//!   same subject replaces the first). A target outside the stream is refused (10190), so is an
//!   unreadable pattern (10189); a time zone other than UTC is accepted and converted.
//! - Fractional seconds are kept: the firing is stored at or after the instant to the
//!   nanosecond, never before it: 0.2–5 ms late for a lone timer on loopback; with a hundred
//!   timers falling due within seconds of each other after a restart, p50 ~30–150 ms, max 250 ms
//!   (the scheduler's tick). A `@at` in the past fires at the next tick (~0.25 s after it is
//!   stored).
//! - At the due time the server stores a **new** message on the target subject, with the
//!   schedule's body copied (and application headers: an `X-…` header was, in the probe), plus
//!   `Nats-Scheduler: <schedule subject>`, `Nats-Schedule-Next: purge` and, if the schedule had
//!   `Nats-Schedule-TTL: <d>`, `Nats-TTL: <d>`. Neither `Nats-Msg-Id` (so the firing is not
//!   deduplicated against its own schedule) nor the `Nats-Schedule*` headers are copied. It is
//!   stored, not published: a core-NATS subscriber on the target does not see it; a JetStream
//!   consumer does.
//! - Then the schedule message is deleted from the stream: a fired timer leaves only its firing.
//! - A schedule's `Nats-Msg-Id` deduplicates like any publish (duplicate ack within the
//!   stream's duplicate window, even after the schedule fired and was deleted).
//! - kill -9 of the server: a schedule acknowledged just before the kill survives; one that fell
//!   due while the server was down fires ~0.2 s after the restart (late, never early, once); one
//!   due after the restart fires on time.
//!
//! # Invariants
//!
//! - **Scheduled once.** The schedule carries `Nats-Msg-Id: timer:<timer_id>`, so a
//!   redelivered `timer.scheduled` stores nothing new; and the schedule subject is the timer's
//!   own, so even beyond the duplicate window a repeat replaces the pending schedule (rollup)
//!   instead of adding one.
//! - **Fired once into the journal.** The firing is journaled with
//!   `Nats-Msg-Id: timer.fired:<timer_id>`, and the fold ignores a second `timer.fired` of a
//!   timer (beyond the journal's duplicate window, and if the broker ever fired twice after a
//!   crash between storing the firing and deleting the schedule).
//! - **Never early.** The broker fires at or after `fire_at`; in case its clock runs ahead of
//!   ours, a firing this service sees before `fire_at` (by its own clock) is handed back with a
//!   delay until `fire_at`, so the journaled `timer.fired` is always stamped at or after it.
//! - **Past due fires at once.** A `timer.scheduled` handled late (redelivered after a crash,
//!   service down) is scheduled with its recorded `fire_at`; the broker fires it immediately.
//! - **A run that moved on ignores it.** `timer.fired` is an input: it wakes the step service,
//!   and the fold only acts on it for a timer that is pending; a cancelled or finished run
//!   records it and does nothing.
//! - Ack after effect: a `timer.scheduled` is acked only after the broker stored the schedule,
//!   a firing only after the journal stored the input; a crash in between redelivers, and the
//!   message ids make the repeat a no-op.
//! - **Never a silent loop.** A message that fails is handed back with a delay doubling per
//!   delivery up to `max_retry_delay`; both consumers' `max_deliver` is bounded (100), and on the
//!   last delivery the message is given up on as a dead letter (`agent.rejected.dead.timer` or
//!   `…timer-fired`, `kedge dead list`), as is a poison message at once. A panic while handling a
//!   message is contained and counts as a failed delivery.

pub mod scheduler;
pub mod wire;

use kedge_core::Input;
use kedge_core::InputEnvelope;
use kedge_core::ids::InputId;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::time::Duration;

use async_nats::jetstream::Message;
use futures::FutureExt as _;
use kedge_core::event::{Draft, Event, TimerFired, Timestamp};
use kedge_core::subjects::Durable;
use kedge_journal::{Delivered, Delivery};
use kedge_runtime::consumer::{Backoff, Verdict};
use kedge_runtime::{Runtime, RuntimeError, consumer, failpoint};
use tracing::Instrument;

use crate::wire::{Due, ScheduleError};

/// Ack wait of both timer consumers (as in their files): handling a message takes one broker
/// round trip.
pub const ACK_WAIT: Duration = Duration::from_secs(30);
/// The consumer of `timer.scheduled` decisions (`nats/consumers/KEDGE_RUNS/timer.json`).
pub const SCHEDULED_CONSUMER: Durable = Durable::Timer;
/// The consumer of firings (`nats/consumers/KEDGE_TIMERS/timer-fired.json`).
pub const FIRED_CONSUMER: Durable = Durable::TimerFired;
/// Messages handled at once (both consumers together).
const CONCURRENCY: usize = 64;
/// Timeout of one broker request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Redelivery delays after a failure: 1 s, doubled per delivery up to the configured
/// `max_retry_delay`; the consumer's `max_deliver` bounds the tries.
fn backoff(rt: &Runtime) -> Backoff {
    Backoff::within(rt.config.timeouts.max_retry_delay())
}

/// Runs the timer service until `shutdown` resolves, then lets in-flight messages finish.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    let mut scheduled = consumer::Deliveries::open(&rt.js, SCHEDULED_CONSUMER, ACK_WAIT).await?;
    let mut fired = consumer::Deliveries::open(&rt.js, FIRED_CONSUMER, ACK_WAIT).await?;
    let workers = consumer::Workers::new(CONCURRENCY);
    // The scheduler fires schedules beside the timers (docs/ARCHITECTURE.md, "Schedules").
    let (stop_scheduler, scheduler_stop) = tokio::sync::watch::channel(false);
    let mut scheduler = scheduler::Guard(tokio::spawn(scheduler::run(rt.clone(), scheduler_stop)));
    tracing::info!(worker = %rt.config.worker_id, "timer service started");
    tokio::pin!(shutdown);
    let ended = loop {
        // A slot first, so no message is held waiting for one (see `Workers::next`).
        let slot = tokio::select! {
            _ = &mut shutdown => break None,
            slot = workers.slot() => slot,
        };
        let (msg, kind) = tokio::select! {
            _ = &mut shutdown => break None,
            next = scheduled.next() => match next {
                Some(msg) => (msg, Kind::Scheduled),
                None => break Some(SCHEDULED_CONSUMER),
            },
            next = fired.next() => match next {
                Some(msg) => (msg, Kind::Fired),
                None => break Some(FIRED_CONSUMER),
            },
        };
        let rt = rt.clone();
        workers.run(slot, async move {
                // A panic while handling one message (a bug) is contained: it counts as a
                // failed delivery (handed back, and dead-lettered at the last one).
                let handled = AssertUnwindSafe(async {
                    match kind {
                        Kind::Scheduled => on_scheduled(&rt, &msg).await,
                        Kind::Fired => on_fired(&rt, &msg).await,
                    }
                })
                .catch_unwind()
                .await;
                let verdict = handled.unwrap_or_else(|panic| {
                    let reason = kedge_runtime::failpoint::panic_message(panic.as_ref());
                    tracing::error!(subject = %msg.subject, panic = %reason, "handling a timer message panicked");
                    Verdict::Retry(format!("panicked: {reason}"), backoff(&rt))
                });
                consumer::settle(&rt.js, kind.consumer(), &msg, verdict).await;
            });
    };
    scheduled.hand_back().await;
    fired.hand_back().await;
    workers.drain().await;
    let _ = stop_scheduler.send(true);
    if let Err(e) = (&mut scheduler.0).await {
        tracing::error!(error = %e, "the scheduler ended abnormally");
    }
    match ended {
        None => {
            tracing::info!("timer service stopped");
            Ok(())
        }
        Some(name) => Err(RuntimeError::broker(
            format!("{name} consumer"),
            "the message stream ended",
        )),
    }
}

#[derive(Debug, Clone, Copy)]
enum Kind {
    Scheduled,
    Fired,
}

impl Kind {
    fn consumer(self) -> Durable {
        match self {
            Kind::Scheduled => SCHEDULED_CONSUMER,
            Kind::Fired => FIRED_CONSUMER,
        }
    }
}

/// A `timer.scheduled` decision: store its schedule in `KEDGE_TIMERS`.
async fn on_scheduled(rt: &Runtime, msg: &Message) -> Verdict {
    // Decoded as every consumer of the journal decodes it: a message that is not the run
    // writer's decision is never scheduled.
    let Ok(info) = msg.info() else {
        return Verdict::Poison("not a journal message: no JetStream metadata".into());
    };
    let delivered = Delivered {
        seq: info.stream_sequence,
        subject: msg.subject.as_str(),
        headers: msg.headers.as_ref(),
        payload: &msg.payload,
    };
    let envelope = match rt.journal.decode_delivered(delivered).await {
        Ok(Delivery::Event(recorded)) => recorded.envelope,
        Ok(Delivery::SetAside(set_aside)) => {
            return Verdict::Poison(format!("set aside: {}", set_aside.reason));
        }
        Ok(Delivery::NotAnEvent) => return Verdict::Poison("not an event subject".into()),
        Err(e) => return Verdict::Retry(format!("cannot decode it yet: {e}"), backoff(rt)),
    };
    let Event::TimerScheduled(t) = &envelope.event else {
        return Verdict::Poison("not a timer.scheduled event".into());
    };
    let due = Due {
        run_id: envelope.run_id.clone(),
        timer_id: t.timer_id.clone(),
        fire_at: t.fire_at,
        step: envelope.step,
        op: envelope.op.clone(),
    };
    let span = tracing::info_span!("schedule", run_id = %due.run_id, timer_id = %due.timer_id, fire_at = %due.fire_at);
    async {
        failpoint::panic_point("timer.schedule", due.run_id.as_str());
        match wire::schedule(&rt.client, &due, REQUEST_TIMEOUT).await {
            Ok(stored) => {
                tracing::debug!(
                    seq = stored.seq,
                    duplicate = stored.duplicate,
                    "timer scheduled"
                );
                if !stored.duplicate {
                    kedge_runtime::metrics::timer_scheduled();
                }
                Verdict::Ack
            }
            Err(e @ ScheduleError::Unavailable(_)) => {
                Verdict::Retry(format!("cannot schedule the timer yet: {e}"), backoff(rt))
            }
            Err(e @ ScheduleError::Refused(_)) => {
                tracing::error!(error = %e, "the broker refused the timer's schedule");
                Verdict::Retry(e.to_string(), backoff(rt))
            }
        }
    }
    .instrument(span)
    .await
}

/// A fired timer: journal `timer.fired` in its run.
async fn on_fired(rt: &Runtime, msg: &Message) -> Verdict {
    let named = kedge_core::subjects::parse_timer_fired(&msg.subject);
    let due: Option<Due> = serde_json::from_slice(&msg.payload).ok();
    let due = match (named, due) {
        (Some((run, timer)), Some(due)) if due.run_id == run && due.timer_id == timer => due,
        _ => return Verdict::Poison("not a timer firing Kedge scheduled".into()),
    };
    let span = tracing::info_span!("fire", run_id = %due.run_id, timer_id = %due.timer_id, fire_at = %due.fire_at);
    let last = consumer::is_last_delivery(FIRED_CONSUMER, msg);
    fire(rt, &due, last).instrument(span).await
}

/// Journals the firing of `due`. `last`: the consumer's last delivery of it (then an early
/// firing is journaled now rather than handed back into nothing).
async fn fire(rt: &Runtime, due: &Due, last: bool) -> Verdict {
    failpoint::panic_point("timer.fire", due.run_id.as_str());
    let now = Timestamp::now();
    if now < due.fire_at && !last {
        // The broker's clock is ahead of ours: wait until the timer is due here too.
        let early = (due.fire_at.0 - now.0).unsigned_abs();
        tracing::warn!(
            early_ms = early.as_millis() as u64,
            "timer fired before it was due by this clock; waiting"
        );
        return Verdict::Later(early + Duration::from_millis(1));
    }
    let mut draft = Draft::new(Input::TimerFired(TimerFired {
        timer_id: due.timer_id.clone(),
    }));
    draft.step = due.step;
    draft.op = due.op.clone();
    let input = InputEnvelope::new(due.run_id.clone(), now, draft);
    match rt
        .journal
        .append_input(&InputId::timer_fired(&due.timer_id), &input)
        .await
    {
        Ok(fired) if fired.duplicate => {
            tracing::debug!(seq = fired.seq, "timer already fired");
            Verdict::Ack
        }
        Ok(fired) => {
            let late = (now.0 - due.fire_at.0).whole_milliseconds();
            tracing::info!(seq = fired.seq, late_ms = late as i64, "timer fired");
            kedge_runtime::metrics::timer_fired();
            Verdict::Ack
        }
        Err(e) if e.is_retryable() => {
            Verdict::Retry(format!("cannot journal the firing yet: {e}"), backoff(rt))
        }
        Err(e) => {
            tracing::error!(error = %e, "the journal refused the firing");
            Verdict::Retry(format!("the journal refused the firing: {e}"), backoff(rt))
        }
    }
}
