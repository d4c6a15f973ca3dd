//! The scheduler: fires schedules (docs/ARCHITECTURE.md, "Schedules"). Runs inside every timer
//! service; any number of them may run at once.
//!
//! Each pass reads every record of `kedge_schedules` (batched direct gets), handles the ones
//! due, and sleeps until the earliest next instant or [`REFRESH`], whichever comes first (so a
//! new or changed schedule is seen within a second). Handling a record is pure planning
//! (`kedge_core::schedule`: catch-up, overlap) around three effects, in this order:
//!
//! 1. cancel the previous run (`cancel_previous`), through `kedge_app::inputs` as the CLI does;
//! 2. publish each firing's task to `agent.task.<agent>.<tenant>` with
//!    `Nats-Msg-Id: schedule:<tenant>.<name>@<unix seconds>`;
//! 3. compare-and-set the record's state forward.
//!
//! Intake makes the run id from the tenant and that key (`kedge_runtime::run_ids`), so the same
//! instant fired by two schedulers, or again after a crash between 2 and 3, is the same run: a
//! firing is never doubled, and never lost (the state moves past an instant only after its task
//! was stored). A scheduler whose compare-and-set fails reads the record again and plans anew.

use std::collections::HashMap;
use std::time::Duration;

use async_nats::HeaderMap;
use kedge_app::inputs;
use kedge_app::tasks::CALLER_HEADER;
use kedge_core::event::Timestamp;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::schedule::{self, OnDue, ScheduleRecord};
use kedge_runtime::Runtime;
use kedge_runtime::schedules::{ScheduleError, Schedules, Stored};
use tokio::sync::watch;

/// Longest sleep between two passes.
pub const REFRESH: Duration = Duration::from_secs(1);
/// How long a fired run that is not in the journal yet counts as running (intake may be slow or
/// down); after that, a task intake refused does not hold the schedule back forever.
const NOT_CREATED_GRACE_SECS: i64 = 120;

/// The scheduler's task, aborted when dropped: a timer service dropped mid-flight (a crash in
/// a test) leaves no scheduler behind.
#[derive(Debug)]
pub struct Guard(pub tokio::task::JoinHandle<()>);

impl Drop for Guard {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Runs the scheduler until `stop` turns true.
pub async fn run(rt: Runtime, mut stop: watch::Receiver<bool>) {
    let schedules = loop {
        match Schedules::open(&rt).await {
            Ok(s) => break s,
            Err(e) => {
                tracing::warn!(error = %e, "scheduler cannot open its bucket; trying again");
                tokio::select! {
                    _ = stop.changed() => return,
                    _ = tokio::time::sleep(REFRESH) => {}
                }
            }
        }
    };
    // Instants due before this scheduler started were missed unless another one fired them
    // (docs/ARCHITECTURE.md, "Schedules": catch-up).
    let started = Timestamp::now();
    tracing::info!(worker = %rt.config.worker_id, "scheduler started");
    let mut failures: HashMap<String, u32> = HashMap::new();
    loop {
        if *stop.borrow() {
            break;
        }
        let wake_at = pass(&rt, &schedules, started, &mut failures).await;
        // Until the earliest next instant (measured after the pass, however long it took).
        let sleep = u64::try_from((wake_at.0 - Timestamp::now().0).whole_milliseconds())
            .map_or(Duration::ZERO, Duration::from_millis);
        tokio::select! {
            _ = stop.changed() => break,
            _ = tokio::time::sleep(sleep) => {}
        }
    }
    tracing::info!("scheduler stopped");
}

/// One pass: handles every due record; when to wake for the next (at most [`REFRESH`] on).
async fn pass(
    rt: &Runtime,
    schedules: &Schedules,
    started: Timestamp,
    failures: &mut HashMap<String, u32>,
) -> Timestamp {
    let now = Timestamp::now();
    let mut wake_at = now.saturating_add(REFRESH);
    let records = match schedules.all().await {
        Ok(r) => r,
        Err(e) => {
            tracing::warn!(error = %e, "scheduler cannot read the schedules");
            return wake_at;
        }
    };
    for stored in records {
        // Its next instant after now and after what it handled (a due one's too, so that the
        // sleep does not pass it).
        let next = stored.record.next_fire(now);
        if let Some(next) = next.filter(|n| *n < wake_at) {
            wake_at = next;
        }
        if is_due(&stored.record, now) {
            let key = stored.key.clone();
            match handle(rt, schedules, stored, started).await {
                Ok(()) => {
                    failures.remove(&key);
                }
                Err(e) => {
                    let n = failures.entry(key.clone()).or_default();
                    *n += 1;
                    tracing::warn!(schedule = %key, error = %e, failures = *n, "cannot fire the schedule yet");
                }
            }
        }
    }
    wake_at
}

/// Whether `record` has anything to do at `now`: an instant due, a trigger, a waiting firing.
fn is_due(record: &ScheduleRecord, now: Timestamp) -> bool {
    if record.paused {
        // Paused: only a trigger fires.
        return record.state.triggered.is_some();
    }
    record.state.triggered.is_some()
        || record.state.queued.is_some()
        || record
            .spec
            .latest_at_or_before(now)
            .is_some_and(|l| l > record.state.handled_through())
}

/// Fires what is due of one record, then moves its state forward by compare-and-set.
async fn handle(
    rt: &Runtime,
    schedules: &Schedules,
    stored: Stored,
    started: Timestamp,
) -> Result<(), ScheduleError> {
    let mut stored = stored;
    for _ in 0..4 {
        let now = Timestamp::now();
        let record = &stored.record;
        let mut state = record.state.clone();
        let mut running = match &state.last_run {
            Some(run) => is_running(rt, &record.tenant, run, state.last_fired, now).await?,
            None => false,
        };
        let mut fire: Vec<Timestamp> = Vec::new();
        if let Some(q) = state.queued
            && !running
            && !record.paused
        {
            fire.push(q);
            state.queued = None;
            running = true;
        }
        if let Some(t) = state.triggered.take() {
            // A manual trigger fires now, whatever runs (the operator asked).
            fire.push(t);
            running = true;
        }
        let handled = state.handled_through();
        let grace =
            schedule::from_unix(now.0.unix_timestamp() - schedule::ON_TIME_GRACE_SECS as i64);
        let on_time_from = if grace > started { grace } else { started };
        let plan = if record.paused {
            schedule::Plan::default()
        } else {
            record.spec.plan(handled, now, on_time_from)
        };
        if plan.missed {
            state.missed += 1;
        }
        for instant in plan.fire {
            match schedule::on_due(record.spec.overlap, running) {
                OnDue::Fire => fire.push(instant),
                OnDue::Skip => state.skipped += 1,
                OnDue::Queue => state.queued = Some(instant),
                OnDue::CancelThenFire => {
                    if let Some(previous) = &state.last_run {
                        cancel(rt, &record.tenant, previous, &record.spec.name).await?;
                    }
                    fire.push(instant);
                }
            }
            running = true;
        }
        if let Some(latest) = record
            .spec
            .latest_at_or_before(now)
            .filter(|l| *l > handled && !record.paused)
        {
            state.last_instant = Some(latest);
        }
        for instant in &fire {
            let run = publish(rt, record, *instant).await?;
            state.fired += 1;
            if state.last_fired.is_none_or(|l| l <= *instant) {
                state.last_fired = Some(*instant);
                state.last_run = Some(run);
            }
        }
        if state == record.state {
            return Ok(());
        }
        let mut next = stored.clone();
        next.record.state = state;
        match schedules.write(next).await? {
            Some(_) => return Ok(()),
            // Another scheduler moved it meanwhile: read it again and plan anew (an instant
            // both fired is one run: the key is the same).
            None => {
                let (tenant, name) = (
                    stored.record.tenant.clone(),
                    stored.record.spec.name.clone(),
                );
                stored = schedules.get(&tenant, &name).await?;
            }
        }
    }
    Err(ScheduleError::Conflict(stored.key))
}

/// Publishes the task of `record`'s firing at `instant`; the run it makes.
async fn publish(
    rt: &Runtime,
    record: &ScheduleRecord,
    instant: Timestamp,
) -> Result<RunId, ScheduleError> {
    let tenant = &record.tenant;
    let name = &record.spec.name;
    let key = schedule::firing_key(tenant, name, instant);
    let body = serde_json::to_vec(&record.spec.task)
        .map_err(|e| ScheduleError::Unavailable(e.to_string()))?;
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", key.as_str());
    headers.insert(CALLER_HEADER, firing_caller(name, instant).as_str());
    let subject = kedge_core::subjects::task_for(&record.spec.task.agent, tenant);
    let ack = rt
        .js
        .publish_with_headers(subject, headers, body.into())
        .await
        .map_err(|e| ScheduleError::Unavailable(e.to_string()))?
        .await
        .map_err(|e| ScheduleError::Unavailable(e.to_string()))?;
    let ids = rt
        .run_ids()
        .await
        .map_err(|e| ScheduleError::Unavailable(e.to_string()))?;
    let run = ids.keyed(tenant, &key);
    tracing::info!(schedule = %name, tenant = %tenant, run_id = %run, instant = %instant.0, duplicate = ack.duplicate, "schedule fired");
    Ok(run)
}

/// The caller a firing's run records (`run.created`'s `caller`): `schedule:<name>@<instant>`.
pub fn firing_caller(name: &str, instant: Timestamp) -> String {
    format!("schedule:{name}@{}", instant.0.unix_timestamp())
}

/// Whether `run` (fired at `fired`) is unfinished. A run not in the journal yet counts as
/// running for [`NOT_CREATED_GRACE_SECS`] after its firing.
async fn is_running(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
    fired: Option<Timestamp>,
    now: Timestamp,
) -> Result<bool, ScheduleError> {
    match inputs::owned_run(rt, tenant, run).await {
        Ok(events) => {
            let state = inputs::state_of(run, &events)
                .map_err(|e| ScheduleError::Unavailable(e.to_string()))?;
            Ok(!kedge_core::decide::finished(&state))
        }
        Err(inputs::Refusal::NotFound { .. }) => Ok(fired.is_some_and(|f| {
            now.0.unix_timestamp() - f.0.unix_timestamp() < NOT_CREATED_GRACE_SECS
        })),
        Err(e) => Err(ScheduleError::Unavailable(e.to_string())),
    }
}

/// Asks `run` to cancel (`cancel_previous`); a run that already ended is left alone.
async fn cancel(
    rt: &Runtime,
    tenant: &TenantId,
    run: &RunId,
    name: &str,
) -> Result<(), ScheduleError> {
    let events = match inputs::owned_run(rt, tenant, run).await {
        Ok(events) => events,
        Err(inputs::Refusal::NotFound { .. }) => return Ok(()),
        Err(e) => return Err(ScheduleError::Unavailable(e.to_string())),
    };
    let reason = format!("schedule {name}: cancel_previous");
    match inputs::cancel(rt, run, &events, reason, Some(format!("schedule:{name}"))).await {
        Ok(_) | Err(inputs::Refusal::Conflict { .. }) => Ok(()),
        Err(e) => Err(ScheduleError::Unavailable(e.to_string())),
    }
}
