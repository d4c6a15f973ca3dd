//! What JetStream message schedules do on the wire, pinned against a real nats-server: the
//! timer service's design (crate docs) relies on every assertion here.

#![allow(clippy::unwrap_used)]

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream::DirectGetErrorKind};
use futures::StreamExt;
use kedge_core::event::Timestamp;
use kedge_core::ids::{OperationId, RunId, StepNo, TimerId};
use kedge_core::subjects::{
    TIMERS_FIRED_ALL as FIRED_FILTER, TIMERS_STREAM, timer_fired, timer_scheduled,
};
use kedge_journal::{LayoutOptions, ensure_layout};
use kedge_testkit::NatsServer;
use kedge_timer::wire::{self, Due};

fn due(run: &str, in_ms: i64) -> Due {
    let run: RunId = run.parse().unwrap();
    let op = OperationId::new(&run, StepNo(1), 0);
    Due {
        timer_id: TimerId::for_operation(&op),
        run_id: run,
        fire_at: Timestamp(time::OffsetDateTime::now_utc() + time::Duration::milliseconds(in_ms)),
        step: Some(StepNo(1)),
        op: Some(op),
    }
}

async fn fired_consumer(js: &jetstream::Context) -> jetstream::consumer::PullConsumer {
    js.get_stream(TIMERS_STREAM)
        .await
        .unwrap()
        .create_consumer(pull::Config {
            filter_subject: FIRED_FILTER.into(),
            ..Default::default()
        })
        .await
        .unwrap()
}

/// The fired messages that arrive within `within` (acked).
async fn fired(
    consumer: &jetstream::consumer::PullConsumer,
    want: usize,
    within: Duration,
) -> Vec<jetstream::Message> {
    let mut out = Vec::new();
    let deadline = tokio::time::Instant::now() + within;
    while out.len() < want && tokio::time::Instant::now() < deadline {
        let left = deadline - tokio::time::Instant::now();
        let mut batch = consumer
            .fetch()
            .max_messages(want - out.len())
            .expires(
                left.min(Duration::from_secs(1))
                    .max(Duration::from_millis(100)),
            )
            .messages()
            .await
            .unwrap();
        while let Some(m) = batch.next().await {
            let m = m.unwrap();
            m.ack().await.unwrap();
            out.push(m);
        }
    }
    out
}

fn header<'a>(m: &'a jetstream::Message, name: &str) -> Option<&'a str> {
    m.headers.as_ref()?.get(name).map(|v| v.as_str())
}

fn stored_at(m: &jetstream::Message) -> time::OffsetDateTime {
    m.info().unwrap().published
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_schedule_fires_once_at_or_after_its_instant_carrying_its_body() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let js = jetstream::new(client.clone());
    let consumer = fired_consumer(&js).await;
    let mut core_sub = client.subscribe(FIRED_FILTER).await.unwrap();

    // Fractional seconds, on purpose.
    let d = due("run_w1", 1_500);
    let first = wire::schedule(&client, &d, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(!first.duplicate);
    let again = wire::schedule(&client, &d, Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(
        (again.seq, again.duplicate),
        (first.seq, true),
        "Msg-Id dedup"
    );

    // The schedule as stored: the server added a rollup header.
    let stream = js.get_stream(TIMERS_STREAM).await.unwrap();
    let sched_subject = timer_scheduled(&d.run_id, &d.timer_id);
    let stored = stream
        .direct_get_last_for_subject(&sched_subject)
        .await
        .unwrap();
    assert_eq!(
        stored.headers.get("Nats-Rollup").map(|v| v.as_str()),
        Some("sub")
    );

    let got = fired(&consumer, 2, Duration::from_secs(4)).await;
    assert_eq!(got.len(), 1, "fires once");
    let m = &got[0];
    assert_eq!(m.subject.as_str(), timer_fired(&d.run_id, &d.timer_id));
    let body: Due = serde_json::from_slice(&m.payload).unwrap();
    assert_eq!(body, d, "the body is copied");
    assert_eq!(header(m, "Nats-Scheduler"), Some(sched_subject.as_str()));
    assert_eq!(header(m, "Nats-Schedule-Next"), Some("purge"));
    assert_eq!(header(m, "Nats-TTL"), Some(wire::FIRED_TTL));
    assert_eq!(header(m, "Nats-Msg-Id"), None, "the Msg-Id is not copied");
    let late = stored_at(m) - d.fire_at.0;
    assert!(late >= time::Duration::ZERO, "fired {late} early");
    assert!(late < time::Duration::seconds(1), "fired {late} late");

    // The schedule is gone; its Msg-Id still deduplicates (no second firing).
    let gone = stream.direct_get_last_for_subject(&sched_subject).await;
    assert!(
        matches!(&gone, Err(e) if e.kind() == DirectGetErrorKind::NotFound),
        "{gone:?}"
    );
    let after = wire::schedule(&client, &d, Duration::from_secs(5))
        .await
        .unwrap();
    assert!(after.duplicate);
    assert!(
        fired(&consumer, 1, Duration::from_millis(1_500))
            .await
            .is_empty()
    );

    // Stored, not published: core subscribers never saw the firing.
    let core = tokio::time::timeout(Duration::from_millis(100), core_sub.next()).await;
    assert!(core.is_err(), "a core subscriber saw {core:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_past_due_schedule_fires_at_once() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let js = jetstream::new(client.clone());
    let consumer = fired_consumer(&js).await;
    let d = due("run_p1", -3_600_000);
    let sent = time::OffsetDateTime::now_utc();
    wire::schedule(&client, &d, Duration::from_secs(5))
        .await
        .unwrap();
    let got = fired(&consumer, 1, Duration::from_secs(3)).await;
    assert_eq!(got.len(), 1);
    let after = stored_at(&got[0]) - sent;
    assert!(
        after < time::Duration::seconds(1),
        "fired {after} after scheduling"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_targets_and_patterns_are_refused() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let publish = |target: &'static str, pattern: &'static str| {
        let client = client.clone();
        async move {
            let mut h = async_nats::HeaderMap::new();
            h.insert("Nats-Schedule", pattern);
            h.insert("Nats-Schedule-Target", target);
            let reply = client
                .request_with_headers("kedge.timer.sched.run_b.tmr_b", h, "x".into())
                .await
                .unwrap();
            let v: serde_json::Value = serde_json::from_slice(&reply.payload).unwrap();
            v["error"]["err_code"].as_u64()
        }
    };
    assert_eq!(
        publish("agent.run.run_b.i.timer.fired", "@at 2030-01-01T00:00:00Z").await,
        Some(10190),
        "a target outside the stream"
    );
    assert_eq!(
        publish("kedge.timer.fired.run_b.tmr_b", "@at tomorrow").await,
        Some(10189),
        "an unreadable time"
    );
    assert_eq!(
        publish(
            "kedge.timer.fired.run_b.tmr_b",
            "@at 2030-01-01T02:00:00+02:00"
        )
        .await,
        None,
        "another time zone is accepted"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn schedules_survive_kill_9_of_the_server_and_fire_once_never_early() {
    let mut server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    // Falls due while the server is down, and after it is back.
    let during = due("run_k1", 2_000);
    let after = due("run_k2", 7_000);
    for d in [&during, &after] {
        wire::schedule(&client, d, Duration::from_secs(5))
            .await
            .unwrap();
    }
    // Killed right after the acks.
    server.kill9();
    drop(client);
    tokio::time::sleep(Duration::from_secs(4)).await;
    server.restart().await;
    let restarted = time::OffsetDateTime::now_utc();
    let client = server.client().await;
    let js = jetstream::new(client.clone());
    let consumer = fired_consumer(&js).await;
    let got = fired(&consumer, 3, Duration::from_secs(8)).await;
    assert_eq!(got.len(), 2, "each fires once");
    for m in &got {
        let body: Due = serde_json::from_slice(&m.payload).unwrap();
        let at = stored_at(m);
        assert!(at >= body.fire_at.0, "{} fired early", body.run_id);
        if body.run_id == during.run_id {
            let after_restart = at - restarted;
            assert!(
                after_restart < time::Duration::seconds(2),
                "fired {after_restart} after the restart"
            );
        } else {
            assert_eq!(body, after);
            assert!(at - body.fire_at.0 < time::Duration::seconds(1));
        }
    }
}
