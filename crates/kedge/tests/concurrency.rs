//! Concurrency keys and priorities through the real services (docs/ARCHITECTURE.md
//! "Concurrency keys and priorities"): a key of limit 1 runs one ticket's runs strictly one after
//! another while other tickets go on; a limit of 3 never has more than 3 running across two step
//! workers; a slot held by a step process killed -9 is handed on; a slot a vanished run kept is
//! recovered by the reconciler's pass; priorities reorder the waiting runs; the queued reason is
//! in the run view; keys are tenant-scoped.
//!
//! The mock model's `delay_ms` keeps each run open for a while, so that runs of one key meet.
//! A run's busy interval is read from its journal: from its `run.started` to its terminal
//! decision (the slot is taken before `run.started` and given back after the end).

use crate::common;

use std::time::{Duration, Instant};

use common::{Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::concurrency::{ConcurrencySpec, SlotRecord};
use kedge_core::event::{Event, Timestamp};
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(90);

fn task(
    agent: &str,
    meta: serde_json::Value,
    key: Option<(&str, u32)>,
    priority: Option<i32>,
) -> TaskSubmission {
    TaskSubmission {
        agent: agent.parse().expect("agent name"),
        input: "go".into(),
        run_id: None,
        budget: None,
        metadata: meta.as_object().cloned().unwrap_or_default(),
        concurrency: key.map(|(key, limit)| ConcurrencySpec {
            key: key.into(),
            limit,
        }),
        priority,
    }
}

async fn submit_as(h: &Harness, tenant: &str, task: &TaskSubmission, key: &str) -> RunId {
    let submission = kedge_intake::Submission {
        task,
        key,
        tenant,
        caller: Some("test"),
    };
    match kedge_intake::submit(&h.rt.client, &submission, Duration::from_secs(20))
        .await
        .expect("intake answered")
    {
        kedge_intake::Answer::Accepted { run_id } => run_id,
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    }
}

/// When the run started (its `run.started`) and ended (its terminal decision).
async fn busy(h: &Harness, run: &RunId) -> (Timestamp, Timestamp) {
    let events = h.events(run).await;
    let at = |f: &dyn Fn(&Event) -> bool| {
        events
            .iter()
            .find(|r| f(&r.envelope.event))
            .map(|r| r.envelope.at)
            .unwrap_or_else(|| panic!("{run}: no such event"))
    };
    (
        at(&|e| matches!(e, Event::RunStarted(_))),
        at(&|e| {
            matches!(
                e,
                Event::RunSucceeded(_) | Event::RunFailed(_) | Event::RunCancelled(_)
            )
        }),
    )
}

fn queued_in_journal(events: &[kedge_journal::Recorded]) -> bool {
    events
        .iter()
        .any(|r| matches!(r.envelope.event, Event::RunQueued(_)))
}

/// The most intervals open at once.
fn most_at_once(intervals: &[(Timestamp, Timestamp)]) -> usize {
    let mut edges: Vec<(Timestamp, i32)> = Vec::new();
    for (start, end) in intervals {
        edges.push((*start, 1));
        edges.push((*end, -1));
    }
    // An end at the same instant as a start closes first.
    edges.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.cmp(&b.1)));
    let (mut open, mut most) = (0i32, 0i32);
    for (_, d) in edges {
        open += d;
        most = most.max(open);
    }
    usize::try_from(most).unwrap_or(0)
}

async fn harness(script: serde_json::Value) -> Harness {
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    // Two step workers, each its own connection and worker id, as two processes would be.
    h.spawn_service(Svc::Step, "w-step-1");
    h.spawn_service(Svc::Step, "w-step-2");
    h
}

async fn record(h: &Harness, tenant: &str, key: &str) -> Option<SlotRecord> {
    let slots = kedge_runtime::slots::Slots::open(&h.rt.js)
        .await
        .expect("slots bucket");
    slots
        .read(&tenant.parse().expect("tenant"), key)
        .await
        .expect("record read")
        .map(|(r, _)| r)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_of_limit_one_runs_one_ticket_at_a_time_while_other_tickets_go_on() {
    let script = json!({"models": {"slow": {"steps": [{"text": "done", "delay_ms": 300}]}}});
    let h = harness(script).await;
    h.agent("conc", "slow").await;
    let per_ticket = |ticket: &str| {
        task(
            "conc",
            json!({"ticket": ticket}),
            Some(("ticket-{metadata.ticket}", 1)),
            None,
        )
    };
    let mut a = Vec::new();
    let mut others = Vec::new();
    for i in 0..10 {
        a.push(submit_as(&h, "acme", &per_ticket("A"), &format!("a-{i}")).await);
        if i < 3 {
            others.push(submit_as(&h, "acme", &per_ticket("B"), &format!("b-{i}")).await);
            others.push(
                submit_as(&h, "acme", &per_ticket(&format!("C{i}")), &format!("c-{i}")).await,
            );
        }
    }
    let mut a_busy = Vec::new();
    let mut queued = 0;
    for run in &a {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
        a_busy.push(busy(&h, run).await);
        let events = h.events(run).await;
        queued += usize::from(queued_in_journal(&events));
        assert_schema_valid(&events);
    }
    let mut other_busy = Vec::new();
    for run in &others {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
        other_busy.push(busy(&h, run).await);
    }
    // Ticket A: strictly one after another, none overlapping another.
    a_busy.sort();
    for pair in a_busy.windows(2) {
        assert!(
            pair[0].1 <= pair[1].0,
            "two runs of ticket A overlapped: {pair:?}"
        );
    }
    assert_eq!(most_at_once(&a_busy), 1);
    assert!(queued >= 5, "only {queued} of ticket A's runs waited");
    // The other tickets went on meanwhile: some ran while ticket A's runs did.
    let mut all = a_busy.clone();
    all.extend(other_busy.iter().copied());
    assert!(
        most_at_once(&all) >= 2,
        "other tickets did not run beside ticket A: {all:?}"
    );
    // Every slot was given back.
    let rec = record(&h, "acme", "ticket-A").await.expect("a record");
    assert!(rec.is_idle(), "{rec:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_limit_of_three_never_has_more_than_three_running() {
    let script = json!({"models": {"slow": {"steps": [{"text": "done", "delay_ms": 400}]}}});
    let h = harness(script).await;
    // The key is the agent's default, over the task's metadata.
    h.agent_edited("conc", "slow", |d| {
        d.concurrency = Some(ConcurrencySpec {
            key: "{metadata.customer}".into(),
            limit: 3,
        });
    })
    .await;
    let mut runs = Vec::new();
    for i in 0..12 {
        let t = task("conc", json!({"customer": "c-1"}), None, None);
        runs.push(submit_as(&h, "acme", &t, &format!("l3-{i}")).await);
    }
    let mut intervals = Vec::new();
    for run in &runs {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
        assert_eq!(
            state
                .bundle
                .concurrency
                .as_ref()
                .map(|c| (c.key.as_str(), c.limit)),
            Some(("c-1", 3))
        );
        intervals.push(busy(&h, run).await);
    }
    let most = most_at_once(&intervals);
    assert!(most <= 3, "{most} runs of a key of limit 3 ran at once");
    assert!(
        most >= 2,
        "the key's runs never ran side by side: {intervals:?}"
    );
    let rec = record(&h, "acme", "c-1").await.expect("a record");
    assert!(rec.is_idle(), "{rec:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn priorities_reorder_waiting_runs_and_the_queued_reason_is_visible() {
    let script = json!({"models": {
        "long": {"steps": [{"text": "held", "delay_ms": 3000}]},
        "short": {"steps": [{"text": "done", "delay_ms": 100}]},
    }});
    let h = harness(script).await;
    h.agent("holder", "long").await;
    h.agent("worker", "short").await;
    let key = Some(("shared-{metadata.queue}", 1));
    let meta = json!({"queue": "q"});
    let holder = submit_as(&h, "acme", &task("holder", meta.clone(), key, None), "hold").await;
    h.wait_for(&holder, WAIT, |s| s.status == RunStatus::Running)
        .await;
    let mut low = Vec::new();
    for i in 0..3 {
        let t = task("worker", meta.clone(), key, Some(-1 + i));
        let run = submit_as(&h, "acme", &t, &format!("low-{i}")).await;
        h.wait_for(&run, WAIT, |s| s.queued.is_some()).await;
        low.push(run);
    }
    let high = submit_as(
        &h,
        "acme",
        &task("worker", meta.clone(), key, Some(10)),
        "high",
    )
    .await;
    let state = h.wait_for(&high, WAIT, |s| s.queued.is_some()).await;
    // The reason, as the run view (`kedge runs get`, `GET /v1/runs/{id}`) shows it.
    let view = kedge_app::view::run_view(&state, &h.events(&high).await);
    assert_eq!(view.status, RunStatus::Queued);
    let q = view.queued.expect("the queued reason");
    assert_eq!(
        (q.key.as_str(), q.limit, q.place, q.priority),
        ("shared-q", 1, 1, 10)
    );
    let json = serde_json::to_value(kedge_app::view::run_view(&state, &h.events(&high).await))
        .expect("json");
    assert_eq!(json["queued"]["key"], "shared-q", "{json}");
    // Another tenant's same key is another key: it does not wait.
    let other = submit_as(
        &h,
        "globex",
        &task("worker", meta.clone(), key, None),
        "other",
    )
    .await;
    let state = h.wait_terminal(&other, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    assert!(
        !queued_in_journal(&h.events(&other).await),
        "tenant globex waited on acme's key"
    );
    assert!(
        !h.state(&holder).await.status.is_terminal(),
        "the holder ended before the other tenant's run: the test proves nothing"
    );
    // The high-priority run starts next, then the low ones by priority (2, 1, 0 here: -1+i).
    let named = [
        ("holder", &holder),
        ("high", &high),
        ("low-0", &low[0]),
        ("low-1", &low[1]),
        ("low-2", &low[2]),
    ];
    let mut order = Vec::new();
    for (name, run) in named {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
        order.push((busy(&h, run).await.0, name.to_owned()));
    }
    order.sort();
    let names: Vec<&str> = order.iter().map(|(_, n)| n.as_str()).collect();
    assert_eq!(names, ["holder", "high", "low-2", "low-1", "low-0"]);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_held_by_a_step_process_killed_9_is_handed_on() {
    let script = json!({"models": {
        "long": {"steps": [{"text": "held", "delay_ms": 3000}]},
        "short": {"steps": [{"text": "done", "delay_ms": 50}]},
    }});
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    h.agent("holder", "long").await;
    h.agent("worker", "short").await;
    let workers = [
        ("w-a", h.spawn_process("step", "w-a", "")),
        ("w-b", h.spawn_process("step", "w-b", "")),
    ];
    for (w, _) in workers {
        h.heartbeat_of(w).await;
    }
    let key = Some(("ticket-{metadata.ticket}", 1));
    let meta = json!({"ticket": 42});
    let holder = submit_as(
        &h,
        "acme",
        &task("holder", meta.clone(), key, None),
        "k-hold",
    )
    .await;
    h.wait_for(&holder, WAIT, |s| s.open_step.is_some()).await;
    let waiting = submit_as(
        &h,
        "acme",
        &task("worker", meta.clone(), key, None),
        "k-wait",
    )
    .await;
    h.wait_for(&waiting, WAIT, |s| s.queued.is_some()).await;
    let owner =
        h.rt.leases
            .holder(&holder)
            .await
            .expect("lease read")
            .expect("the holder is driven")
            .owner;
    let (_, doomed) = workers
        .into_iter()
        .find(|(w, _)| *w == owner)
        .expect("one of ours drives it");
    // The process holding the slot (and the run's lease) dies mid model call.
    h.kill9(doomed);
    let killed = Instant::now();
    let state = h.wait_terminal(&holder, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let state = h.wait_terminal(&waiting, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let (h_busy, w_busy) = (busy(&h, &holder).await, busy(&h, &waiting).await);
    assert!(
        h_busy.1 <= w_busy.0,
        "the waiting run started while the slot was held"
    );
    assert!(killed.elapsed() < WAIT);
    assert!(
        h.events(&waiting)
            .await
            .iter()
            .any(|r| matches!(r.envelope.event, Event::SlotGranted(_))),
        "the waiting run was not handed the slot"
    );
    let rec = record(&h, "acme", "ticket-42").await.expect("a record");
    assert!(rec.is_idle(), "{rec:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_slot_a_vanished_run_kept_is_recovered_by_the_reconciler() {
    let script = json!({"models": {"short": {"steps": [{"text": "done", "delay_ms": 50}]}}});
    let h = harness(script).await;
    h.agent("worker", "short").await;
    // A record whose only slot is held by a run that does not exist (purged, or its process
    // died between taking the slot and ... nothing the journal knows of).
    let tenant: kedge_core::ids::TenantId = "acme".parse().expect("tenant");
    let ghost: RunId = "run_0000000000000000000000000000dead"
        .parse()
        .expect("a run id");
    let mut rec = SlotRecord::new(tenant.clone(), "lonely".into(), 1);
    rec.holders.push(ghost.clone());
    let kv =
        h.rt.js
            .get_key_value(kedge_core::subjects::SLOTS_BUCKET)
            .await
            .expect("bucket");
    kv.put(
        kedge_core::subjects::slot_key(&tenant, "lonely"),
        serde_json::to_vec(&rec).expect("json").into(),
    )
    .await
    .expect("record written");
    let run = submit_as(
        &h,
        "acme",
        &task("worker", json!({}), Some(("lonely", 1)), None),
        "after-ghost",
    )
    .await;
    let state = h.wait_for(&run, WAIT, |s| s.queued.is_some()).await;
    assert_eq!(state.status, RunStatus::Queued);
    // Nothing frees it but the recovery: still queued a while later.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(h.state(&run).await.status, RunStatus::Queued);
    // One pass of the reconciler's recovery, as its user (on the secured layout, its rights).
    let rec = h.runtime_as(kedge_runtime::secure::Kind::Reconciler).await;
    let (freed, woken) = kedge_reconciler::slots::recover(&rec)
        .await
        .expect("a recovery pass");
    assert_eq!((freed, woken), (1, 1));
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let rec = record(&h, "acme", "lonely").await.expect("a record");
    assert!(rec.is_idle(), "{rec:?}");
    // A task whose key cannot be expanded is refused naming the field.
    let bad = task("worker", json!({}), Some(("{metadata.missing}", 1)), None);
    let answer = kedge_intake::submit(
        &h.rt.client,
        &kedge_intake::Submission {
            task: &bad,
            key: "bad-key",
            tenant: "acme",
            caller: None,
        },
        Duration::from_secs(20),
    )
    .await
    .expect("answered");
    match answer {
        kedge_intake::Answer::Rejected { error } => {
            assert_eq!(error.field, "concurrency.key", "{error}");
        }
        other => panic!("accepted a key over missing metadata: {other:?}"),
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_to_a_finished_run_waits_for_a_slot_like_a_new_run() {
    let script = json!({"models": {
        "long": {"steps": [{"text": "held", "delay_ms": 3000}]},
        "short": {"steps": [{"text": "first", "delay_ms": 50}, {"text": "second", "delay_ms": 50}]},
    }});
    let h = harness(script).await;
    h.agent("holder", "long").await;
    h.agent("chat", "short").await;
    let key = Some(("desk-{metadata.desk}", 1));
    let meta = json!({"desk": 3});
    let chat = submit_as(&h, "acme", &task("chat", meta.clone(), key, None), "chat").await;
    let state = h.wait_terminal(&chat, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    // Its slot was given back at its end: another run of the key takes it and holds it.
    let holder = submit_as(&h, "acme", &task("holder", meta.clone(), key, None), "hold").await;
    h.wait_for(&holder, WAIT, |s| s.status == RunStatus::Running)
        .await;
    // A message continues the chat: its next turn waits for the key like a new run would.
    h.input(
        &chat,
        Event::UserMessage(kedge_core::event::UserMessage {
            text: "and then?".into(),
        }),
        "msg-again",
    )
    .await;
    let state = h.wait_for(&chat, WAIT, |s| s.queued.is_some()).await;
    assert_eq!(state.status, RunStatus::Succeeded, "it waits to be revived");
    assert_eq!(state.turn, 1);
    assert!(
        !h.state(&holder).await.status.is_terminal(),
        "the holder ended before the chat queued: the test proves nothing"
    );
    // Once the holder ends, the chat is revived and answers its second turn.
    let held = {
        let s = h.wait_terminal(&holder, WAIT).await;
        assert_eq!(s.status, RunStatus::Succeeded);
        busy(&h, &holder).await
    };
    let state = h
        .wait_for(&chat, WAIT, |s| {
            s.turn == 2 && s.status == RunStatus::Succeeded
        })
        .await;
    assert_eq!(state.output.as_deref(), Some("second"));
    let revived_at = h
        .events(&chat)
        .await
        .iter()
        .find(|r| matches!(r.envelope.event, Event::RunRevived(_)))
        .map(|r| r.envelope.at)
        .expect("revived");
    assert!(
        held.1 <= revived_at,
        "the chat's second turn ran while the key was full"
    );
    h.check_replay(&chat, "concurrency-revived").await;
    let rec = record(&h, "acme", "desk-3").await.expect("a record");
    assert!(rec.is_idle(), "{rec:?}");
    h.shutdown().await;
}
