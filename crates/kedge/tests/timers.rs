//! Durable timers end to end, driven by the `wait` tool: they fire exactly once into the run's
//! journal, never early, survive kill -9 of every Kedge process and of nats-server, are scheduled
//! once however often `timer.scheduled` is delivered, fire at once when past due, and are a
//! no-op for a run that has moved on.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{CancelRequested, Event, TimerFired, Timestamp};
use kedge_core::ids::{RunId, TimerId};
use kedge_journal::Recorded;
use kedge_runtime::{Config, Runtime};
use kedge_serve::{Service, Started, TransientKedge};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

fn wait_call(seconds: u64) -> serde_json::Value {
    json!({"tool_calls": [{"name": "wait", "arguments": {"seconds": seconds}}]})
}

/// Step 1 waits `seconds`, step 2 answers.
fn waits(model: &str, seconds: u64) -> serde_json::Value {
    json!({"models": {model: {"steps": [wait_call(seconds), {"text": "rested"}]}}})
}

/// The timer service in this process (as `kedge serve timer` runs it), stoppable on its own.
struct TimerService {
    services: TransientKedge,
    timer: Started,
}

impl TimerService {
    async fn start(config: &Config, worker: &str) -> TimerService {
        let mut config = common::as_kind(config, kedge_runtime::secure::Kind::Timer);
        config.worker_id = worker.parse().expect("worker id");
        let rt = Runtime::connect(config).await.expect("timer runtime");
        let mut services = TransientKedge::new();
        let timer = services.start_on(rt, &[Service::Timer]);
        TimerService { services, timer }
    }

    async fn stop(mut self) {
        let stopped = tokio::time::timeout(Duration::from_secs(10), self.services.stop(self.timer));
        if let Ok(Err(e)) = stopped.await {
            panic!("timer service failed: {e:#}");
        }
    }
}

/// What a run's journal says about its timers.
#[derive(Debug, Default)]
struct Timers {
    /// Timer → its `fire_at`.
    scheduled: BTreeMap<TimerId, Timestamp>,
    /// Timer → the journal time (`at`) of each `timer.fired`.
    fired: BTreeMap<TimerId, Vec<Timestamp>>,
}

fn timers(events: &[Recorded]) -> Timers {
    let mut t = Timers::default();
    for r in events {
        match &r.envelope.event {
            Event::TimerScheduled(s) => {
                t.scheduled.insert(s.timer_id.clone(), s.fire_at);
            }
            Event::TimerFired(f) => t
                .fired
                .entry(f.timer_id.clone())
                .or_default()
                .push(r.envelope.at),
            _ => {}
        }
    }
    t
}

/// One timer, fired exactly once, not before its `fire_at`; returns its `fire_at`.
fn assert_fired_once_on_time(run: &RunId, events: &[Recorded]) -> Timestamp {
    let t = timers(events);
    assert_eq!(t.scheduled.len(), 1, "{run}: one timer scheduled");
    let (id, fire_at) = t.scheduled.iter().next().expect("a timer");
    let fired = t.fired.get(id).map(Vec::as_slice).unwrap_or_default();
    assert_eq!(fired.len(), 1, "{run}: {id} fired {} times", fired.len());
    assert!(
        fired[0] >= *fire_at,
        "{run}: {id} fired at {} before its fire_at {fire_at}",
        fired[0]
    );
    *fire_at
}

/// Pending schedules and fired messages in KEDGE_TIMERS.
async fn timer_stream(client: &async_nats::Client) -> (usize, usize) {
    let count = |filter: &'static str| {
        let client = client.clone();
        async move {
            let body = json!({ "subjects_filter": filter }).to_string();
            let reply = client
                .request("$JS.API.STREAM.INFO.KEDGE_TIMERS", body.into())
                .await
                .expect("stream info");
            let info: serde_json::Value = serde_json::from_slice(&reply.payload).expect("json");
            info["state"]["subjects"].as_object().map_or(0, |s| s.len())
        }
    };
    (
        count("kedge.timer.sched.>").await,
        count("kedge.timer.fired.>").await,
    )
}

/// Polls `f` (tolerating broker errors, e.g. while the client reconnects) until it answers `Some`.
async fn eventually<T, F, Fut>(within: Duration, what: &str, mut f: F) -> T
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Option<T>>,
{
    let deadline = Instant::now() + within;
    loop {
        if let Some(v) = f().await {
            return v;
        }
        assert!(Instant::now() < deadline, "{what}: not within {within:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

async fn status(h: &Harness, run: &RunId) -> Option<RunStatus> {
    let events = h.rt.journal.read(run, 0).await.ok()?;
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope))).ok()?;
    Some(state.status)
}

async fn delete_consumer(client: &async_nats::Client, stream: &str, name: &str) {
    let reply = client
        .request(
            format!("$JS.API.CONSUMER.DELETE.{stream}.{name}"),
            "".into(),
        )
        .await
        .expect("consumer delete");
    let v: serde_json::Value = serde_json::from_slice(&reply.payload).expect("json");
    assert_eq!(v["success"], true, "{v}");
}

/// The acceptance experiment: 100 runs wait on timers due 10–15 s later; every Kedge process
/// (intake, step, tool, timer as separate `kedge serve` processes) and nats-server are killed
/// with -9, nats-server restarts on the same store and the services are respawned, all before
/// the first timer is due. Every timer fires exactly once, none early, and every run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hundred_timers_survive_kill_9_of_everything_and_fire_once_never_early() {
    const RUNS: usize = 100;
    let started = Instant::now();
    // Run i asks to wait 10 + i % 6 seconds.
    let rules: Vec<serde_json::Value> = (10..=15)
        .map(|s| json!({"when_last_user_contains": format!("wait-{s}s"), "respond": wait_call(s)}))
        .collect();
    let script =
        json!({"models": {"mt": {"rules": rules, "steps": [wait_call(12), {"text": "rested"}]}}});
    let mut h = Harness::start(script, &[]).await;
    h.agent("timed", "mt").await;
    let first: Vec<usize> = ["intake", "step", "tool", "timer"]
        .iter()
        .map(|svc| h.spawn_process(svc, &format!("w-{svc}-1"), ""))
        .collect();

    let submissions = (0..RUNS).map(|i| {
        let h = &h;
        async move {
            h.submit(
                "timed",
                &format!("please wait-{}s", 10 + i % 6),
                &format!("timer-{i}"),
            )
            .await
        }
    });
    let runs: Vec<RunId> = futures::future::join_all(submissions).await;
    // Every run waits, and the broker holds every schedule.
    for run in &runs {
        h.wait_for(run, WAIT, |s| s.status == RunStatus::WaitingExternal)
            .await;
    }
    eventually(WAIT, "100 schedules stored", || async {
        (timer_stream(&h.rt.client).await == (RUNS, 0)).then_some(())
    })
    .await;
    let mut earliest = None;
    for run in &runs {
        let t = timers(&h.events(run).await);
        let fire_at = *t.scheduled.values().next().expect("scheduled");
        earliest = Some(earliest.map_or(fire_at, |e: Timestamp| e.min(fire_at)));
    }
    let earliest = earliest.expect("timers");
    let scheduled_by = started.elapsed();

    // kill -9 everything.
    for i in first {
        h.kill9(i);
    }
    h.nats.kill9();
    tokio::time::sleep(Duration::from_millis(500)).await;
    h.nats.restart().await;
    for svc in ["intake", "step", "tool", "timer"] {
        h.spawn_process(svc, &format!("w-{svc}-2"), "");
    }
    let restarted = Timestamp::now();
    assert!(
        restarted < earliest,
        "the restart ({restarted}) must come before the first timer is due ({earliest})"
    );
    let restarted_by = started.elapsed();

    for run in &runs {
        let end = eventually(WAIT, "run ended", || async {
            status(&h, run).await.filter(|s| s.is_terminal())
        })
        .await;
        assert_eq!(end, RunStatus::Succeeded, "{run}");
    }
    let done_by = started.elapsed();
    let mut late = Vec::new();
    let mut broker_late = Vec::new();
    let timers_stream = async_nats::jetstream::new(h.rt.client.clone())
        .get_stream("KEDGE_TIMERS")
        .await
        .expect("KEDGE_TIMERS");
    for run in &runs {
        let events = h.events(run).await;
        let fire_at = assert_fired_once_on_time(run, &events);
        let t = timers(&events);
        let (timer_id, fired) = t.fired.iter().next().expect("fired");
        // When the broker stored the firing (its own clock).
        let stored = timers_stream
            .direct_get_last_for_subject(kedge_core::subjects::timer_fired(run, timer_id))
            .await
            .expect("the firing is in KEDGE_TIMERS")
            .time;
        assert!(stored >= fire_at.0, "{run}: the broker fired early");
        broker_late.push((stored - fire_at.0).whole_milliseconds());
        late.push((fired[0].0 - fire_at.0).whole_milliseconds());
        // The step that followed the wait started after the timer was due.
        let second = events
            .iter()
            .find(|r| r.envelope.step.map(|s| s.get()) == Some(2))
            .expect("a second step");
        assert!(second.envelope.at >= fire_at, "{run}: step 2 started early");
    }
    let calls = h.mock.calls();
    assert_eq!(
        calls.total,
        2 * RUNS as u64,
        "two model calls per run: {calls:?}"
    );
    assert_eq!(timer_stream(&h.rt.client).await, (0, RUNS));
    late.sort_unstable();
    broker_late.sort_unstable();
    eprintln!(
        "100 timers: scheduled by {scheduled_by:?}, everything killed and restarted by \
         {restarted_by:?}, all runs succeeded by {done_by:?}; after fire_at the broker stored \
         the firing by p50 {} ms, max {} ms, the journal had timer.fired by p50 {} ms, max {} ms",
        broker_late[RUNS / 2],
        broker_late[RUNS - 1],
        late[RUNS / 2],
        late[RUNS - 1]
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_timer_for_a_cancelled_run_is_a_no_op() {
    let h = Harness::start(waits("mc", 2), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("cw", "mc").await;
    let timer = TimerService::start(&h.config, "w-timer").await;
    let run = h.submit("cw", "go", "cancel-wait").await;
    h.wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingExternal)
        .await;
    h.input(
        &run,
        Event::CancelRequested(CancelRequested {
            reason: "test".into(),
            by: None,
        }),
        "cancel",
    )
    .await;
    h.wait_terminal(&run, WAIT).await;
    // The timer still fires (the broker holds it), into a cancelled run, which ignores it.
    let state = h.wait_for(&run, WAIT, |s| s.ignored_inputs > 0).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    let events = h.events(&run).await;
    assert_fired_once_on_time(&run, &events);
    assert_eq!(state.status, RunStatus::Cancelled);
    assert_eq!(
        h.state(&run).await.ignored_inputs,
        1,
        "the firing is ignored"
    );
    let last_decision = events
        .iter()
        .rev()
        .find(|r| r.envelope.kind() == kedge_core::EventKind::Decision)
        .expect("decisions");
    assert!(
        matches!(last_decision.envelope.event, Event::RunCancelled(_)),
        "nothing was decided after the cancel: {:?}",
        last_decision.envelope.event_type()
    );
    let fired_seq = events
        .iter()
        .find(|r| matches!(r.envelope.event, Event::TimerFired(_)))
        .expect("fired")
        .seq;
    assert!(fired_seq > last_decision.seq, "fired after the run ended");
    assert_eq!(h.state(&run).await.status, RunStatus::Cancelled);
    assert_eq!(h.mock.total_calls(), 1, "the model was not called again");
    timer.stop().await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_late_second_firing_of_a_run_past_its_wait_is_ignored() {
    let h = Harness::start(waits("mp", 1), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("pw", "mp").await;
    let timer = TimerService::start(&h.config, "w-timer").await;
    let run = h.submit("pw", "go", "past-wait").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(state.output.as_deref(), Some("rested"));
    let before = h.events(&run).await;
    assert_fired_once_on_time(&run, &before);
    let timer_id = state.timers.keys().next().expect("a timer").clone();
    // A second firing that escaped every dedup window (another Msg-Id).
    h.input(
        &run,
        Event::TimerFired(TimerFired {
            timer_id: timer_id.clone(),
        }),
        "late-second-firing",
    )
    .await;
    tokio::time::sleep(Duration::from_millis(800)).await;
    let state = h.state(&run).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(state.ignored_inputs, 1, "the fold ignores a second firing");
    let after = h.events(&run).await;
    assert_eq!(
        after.len(),
        before.len() + 1,
        "only the stray input was added"
    );
    assert_eq!(h.mock.total_calls(), 2);
    timer.stop().await;
    h.shutdown().await;
}

/// `timer.scheduled` delivered again (the timer consumer reset, two replicas racing on it) and
/// the firings delivered again (the timer-fired consumer reset): every timer fires once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn scheduling_twice_fires_once() {
    const RUNS: usize = 5;
    let h = Harness::start(waits("md", 3), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("dw", "md").await;
    let timer = TimerService::start(&h.config, "w-timer-a").await;
    let mut runs = Vec::new();
    for i in 0..RUNS {
        runs.push(h.submit("dw", "go", &format!("dup-{i}")).await);
    }
    for run in &runs {
        h.wait_for(run, WAIT, |s| s.status == RunStatus::WaitingExternal)
            .await;
    }
    eventually(WAIT, "schedules stored", || async {
        (timer_stream(&h.rt.client).await == (RUNS, 0)).then_some(())
    })
    .await;
    // Every timer.scheduled is delivered again, to two replicas at once.
    timer.stop().await;
    delete_consumer(&h.rt.client, "KEDGE_RUNS", "timer").await;
    let a = TimerService::start(&h.config, "w-timer-b").await;
    let b = TimerService::start(&h.config, "w-timer-c").await;
    for run in &runs {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded);
    }
    assert_eq!(timer_stream(&h.rt.client).await, (0, RUNS));
    // And once more, both the schedules and the firings.
    a.stop().await;
    b.stop().await;
    delete_consumer(&h.rt.client, "KEDGE_RUNS", "timer").await;
    delete_consumer(&h.rt.client, "KEDGE_TIMERS", "timer-fired").await;
    let again = TimerService::start(&h.config, "w-timer-d").await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    assert_eq!(timer_stream(&h.rt.client).await, (0, RUNS));
    for run in &runs {
        let events = h.events(run).await;
        assert_fired_once_on_time(run, &events);
        let state = h.state(run).await;
        assert_eq!(state.status, RunStatus::Succeeded);
        assert_eq!(state.ignored_inputs, 0);
    }
    assert_eq!(h.mock.total_calls(), 2 * RUNS as u64);
    again.stop().await;
    h.shutdown().await;
}

/// A `timer.scheduled` handled after its `fire_at` (the timer service was down) fires at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_past_due_timer_fires_at_once() {
    let h = Harness::start(waits("ml", 1), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("lw", "ml").await;
    let run = h.submit("lw", "go", "late").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingExternal)
        .await;
    let fire_at = state.timers.values().next().expect("a timer").fire_at;
    // Nobody has scheduled it; let it fall due.
    while Timestamp::now() < fire_at {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.state(&run).await.status, RunStatus::WaitingExternal);
    let started = Timestamp::now();
    let timer = TimerService::start(&h.config, "w-timer").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    let events = h.events(&run).await;
    assert_fired_once_on_time(&run, &events);
    let fired_at = timers(&events).fired.into_values().next().expect("fired")[0];
    let after = fired_at.0 - started.0;
    assert!(
        after < time::Duration::seconds(2),
        "fired {after} after the timer service started"
    );
    timer.stop().await;
    h.shutdown().await;
}

/// The services stay up while nats-server is killed with -9 and restarted: their consumers
/// resume and the timers fire once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_services_ride_out_a_broker_restart() {
    const RUNS: usize = 3;
    let mut h = Harness::start(waits("mb", 4), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("bw", "mb").await;
    let timer = TimerService::start(&h.config, "w-timer").await;
    let mut runs = Vec::new();
    for i in 0..RUNS {
        runs.push(h.submit("bw", "go", &format!("restart-{i}")).await);
    }
    for run in &runs {
        h.wait_for(run, WAIT, |s| s.status == RunStatus::WaitingExternal)
            .await;
    }
    eventually(WAIT, "schedules stored", || async {
        (timer_stream(&h.rt.client).await == (RUNS, 0)).then_some(())
    })
    .await;
    h.nats.kill9();
    h.nats.restart().await;
    for run in &runs {
        let end = eventually(WAIT, "run ended", || async {
            status(&h, run).await.filter(|s| s.is_terminal())
        })
        .await;
        assert_eq!(end, RunStatus::Succeeded, "{run}");
        assert_fired_once_on_time(run, &h.events(run).await);
    }
    timer.stop().await;
    h.shutdown().await;
}
