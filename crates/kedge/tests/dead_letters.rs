//! Every consumer gives up on a message that always fails after a bounded number of deliveries
//! with backoff, and what it gave up on is a dead letter on `agent.rejected.dead.<consumer>`
//! (never a silent loop): here the timer service's two consumers and the projector
//! (the step's and intake's are in `hostile.rs`). A failure is injected as a panic at the
//! handler's failpoint, so each test also shows the panic is contained.

use crate::common;

use std::time::{Duration, Instant};

use common::Harness;
use kedge_core::event::Timestamp;
use kedge_core::ids::{RunId, TimerId};
use kedge_core::subjects::Durable;
use kedge_runtime::{Config, consumer, failpoint};
use kedge_serve::Service;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(60);

/// A broker and no services, with retry delays short enough to reach `max_deliver` quickly.
async fn harness() -> Harness {
    Harness::start_with(json!({"models": {}}), &[], |c| {
        c.timeouts.max_retry_delay_ms = 20;
    })
    .await
}

/// The timer service in this process (as its own user) until the test ends.
fn spawn_timer(config: &Config) {
    common::spawn_detached(config, Service::Timer);
}

/// The projector in this process (as its own user) until the test ends.
fn spawn_projector(config: &Config) {
    common::spawn_detached(config, Service::Projector);
}

/// Publishes `payload` on `subject` as the test's admin.
async fn publish(h: &Harness, subject: String, payload: Vec<u8>) {
    h.rt.js
        .publish(subject, payload.into())
        .await
        .expect("published")
        .await
        .expect("stored");
}

/// Publishes a decision of `run` as its writer appends one (with the writer's `Nats-Msg-Id`).
async fn publish_decision(h: &Harness, run: &RunId, subject: String, payload: Vec<u8>) {
    let mut headers = async_nats::HeaderMap::new();
    let id = kedge_journal::decision_msg_id(run, kedge_core::ids::DecisionSeq::NONE, 0, "w-test");
    headers.insert(async_nats::header::NATS_MESSAGE_ID, id.as_str());
    h.rt.js
        .publish_with_headers(subject, headers, payload.into())
        .await
        .expect("published")
        .await
        .expect("stored");
}

/// The dead letters of `consumer` whose subject is `subject`, once there is one (or panics).
async fn dead_letter(h: &Harness, consumer: Durable, subject: &str) -> serde_json::Value {
    let stream =
        h.rt.js
            .get_stream("KEDGE_REJECTIONS")
            .await
            .expect("rejections stream");
    let deadline = Instant::now() + WAIT;
    loop {
        if let Ok(m) = stream
            .direct_get_last_for_subject(kedge_core::subjects::dead_letter(consumer))
            .await
        {
            let record: serde_json::Value = serde_json::from_slice(&m.payload).expect("json");
            if record["subject"] == subject {
                return record;
            }
        }
        assert!(
            Instant::now() < deadline,
            "no dead letter of {consumer} for {subject} within {WAIT:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// How many messages the durable `name` of `stream` still holds (pending or unacked).
async fn outstanding(h: &Harness, stream: &str, name: &str) -> (u64, usize) {
    let mut c: async_nats::jetstream::consumer::PullConsumer =
        h.rt.js
            .get_consumer_from_stream(name, stream)
            .await
            .expect("consumer");
    let info = c.info().await.expect("consumer info");
    (info.num_pending, info.num_ack_pending)
}

#[tokio::test]
async fn a_timer_firing_that_always_fails_is_a_dead_letter_after_max_deliver() {
    let h = harness().await;
    spawn_timer(&h.config);
    let run = RunId::generate();
    let timer = TimerId::for_deadline(&run);
    failpoint::arm_panic("timer.fire", run.as_str(), u32::MAX);
    let due = kedge_timer::wire::Due {
        run_id: run.clone(),
        timer_id: timer.clone(),
        fire_at: Timestamp::now(),
        step: None,
        op: None,
    };
    let subject = kedge_core::subjects::timer_fired(&run, &timer);
    publish(&h, subject.clone(), serde_json::to_vec(&due).expect("json")).await;
    let record = dead_letter(&h, Durable::TimerFired, &subject).await;
    let max = consumer::max_deliver(Durable::TimerFired).expect("bounded");
    assert_eq!(record["deliveries"], max, "{record}");
    assert_eq!(record["stream"], "KEDGE_TIMERS", "{record}");
    assert!(
        record["reason"]
            .as_str()
            .is_some_and(|r| r.contains("panicked")),
        "{record}"
    );
    // Given up on: the consumer holds nothing more, and nothing was journaled.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(outstanding(&h, "KEDGE_TIMERS", "timer-fired").await, (0, 0));
    assert!(h.events(&run).await.is_empty());
}

/// A `timer.scheduled` of `run`'s deadline, due now.
fn deadline_timer(run: &RunId) -> kedge_core::event::Envelope {
    kedge_core::event::Envelope::new(
        run.clone(),
        Timestamp::now(),
        kedge_core::event::Draft::new(kedge_core::event::Event::TimerScheduled(
            kedge_core::event::TimerScheduled {
                timer_id: TimerId::for_deadline(run),
                fire_at: Timestamp::now(),
                purpose: kedge_core::event::TimerPurpose::RunDeadline,
            },
        )),
    )
}

#[tokio::test]
async fn a_timer_decision_that_always_fails_or_is_poison_is_a_dead_letter() {
    let h = harness().await;
    spawn_timer(&h.config);
    // Poison: not an envelope. Given up on at its first delivery.
    let poison = RunId::generate();
    let subject = format!("agent.run.{poison}.d.timer.scheduled");
    publish(&h, subject.clone(), b"{not json".to_vec()).await;
    let record = dead_letter(&h, Durable::Timer, &subject).await;
    assert_eq!(record["deliveries"], 1, "{record}");
    assert!(
        record["reason"]
            .as_str()
            .is_some_and(|r| r.contains("not an event envelope")),
        "{record}"
    );
    // Poison too: a well-formed timer decision its run's writer did not append (no writer's
    // `Nats-Msg-Id`): decoded as every journal consumer decodes it, and never scheduled.
    let forged = RunId::generate();
    let subject = format!("agent.run.{forged}.d.timer.scheduled");
    publish(&h, subject.clone(), deadline_timer(&forged).to_json_bytes()).await;
    let record = dead_letter(&h, Durable::Timer, &subject).await;
    assert_eq!(record["deliveries"], 1, "{record}");
    assert!(
        record["reason"]
            .as_str()
            .is_some_and(|r| r.contains("without the writer's Nats-Msg-Id")),
        "{record}"
    );
    // A well-formed decision whose handling always fails: after `max_deliver` deliveries.
    let run = RunId::generate();
    failpoint::arm_panic("timer.schedule", run.as_str(), u32::MAX);
    let subject = format!("agent.run.{run}.d.timer.scheduled");
    publish_decision(
        &h,
        &run,
        subject.clone(),
        deadline_timer(&run).to_json_bytes(),
    )
    .await;
    let record = dead_letter(&h, Durable::Timer, &subject).await;
    let max = consumer::max_deliver(Durable::Timer).expect("bounded");
    assert_eq!(record["deliveries"], max, "{record}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(outstanding(&h, "KEDGE_RUNS", "timer").await, (0, 0));
}

#[tokio::test]
async fn the_projector_gives_up_on_a_decision_that_always_fails() {
    let h = harness().await;
    spawn_projector(&h.config);
    // Always fails (a panic every time): given up on after `max_deliver` deliveries.
    let run = RunId::generate();
    failpoint::arm_panic("projector.project", run.as_str(), u32::MAX);
    let subject = format!("agent.run.{run}.d.run.created");
    publish(&h, subject.clone(), b"{}".to_vec()).await;
    let record = dead_letter(&h, Durable::Projector, &subject).await;
    let max = consumer::max_deliver(Durable::Projector).expect("bounded");
    assert_eq!(record["deliveries"], max, "{record}");
    // Not a journal event's subject (a malformed body on a run's subject is set aside by the
    // journal read instead, and the run projects without it): given up on at once.
    let subject = "agent.run.not-a-run.d.run.created".to_owned();
    publish(&h, subject.clone(), b"{}".to_vec()).await;
    let record = dead_letter(&h, Durable::Projector, &subject).await;
    assert_eq!(record["deliveries"], 1, "{record}");
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(outstanding(&h, "KEDGE_RUNS", "projector").await, (0, 0));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_operation_that_always_fails_is_a_dead_letter_after_max_deliver() {
    use common::Svc;
    let script = json!({"models": {"m": {"steps": [
        {"text": "paying", "delay_ms": 300,
         "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay 5"}}]},
        {"text": "paid"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.timeouts.max_retry_delay_ms = 20;
    })
    .await;
    h.agent("payer", "m").await;
    let run = h.submit("payer", "go", "task-tool-dead").await;
    failpoint::arm_panic("tool.execute", run.as_str(), u32::MAX);
    let subject = format!("agent.run.{run}.d.tool.requested");
    let record = dead_letter(&h, Durable::Tool, &subject).await;
    let max = consumer::max_deliver(Durable::Tool).expect("bounded");
    assert_eq!(record["deliveries"], max, "{record}");
    assert!(
        record["reason"]
            .as_str()
            .is_some_and(|r| r.contains("panicked")),
        "{record}"
    );
    // Given up on, nothing ran, and the service goes on.
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(outstanding(&h, "KEDGE_RUNS", "tool").await, (0, 0));
    assert!(h.ledger().is_empty(), "the operation never ran");
    h.shutdown().await;
}
