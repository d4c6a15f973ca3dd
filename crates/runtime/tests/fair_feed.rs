//! The fair feed against a real nats-server (docs/ARCHITECTURE.md "Fairness across tenants"):
//! deliveries handed out by tenant in turn, kept alive while they wait in the window, and on a
//! stop every one not started handed back once, none lost, none doubled.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt as _;
use kedge_core::fairness::Weights;
use kedge_core::subjects::{Durable, TASKS_ALL, parse_task, task_for};
use kedge_runtime::consumer::{Deliveries, Workers};
use kedge_runtime::fair::{FairFeed, Tenancy};
use kedge_testkit::NatsServer;

/// Short, so that a delivery waiting in the window would be redelivered without the feed's
/// in-progress acks (sent after a third of it); long enough that a loaded machine's scheduling
/// delays do not make those late.
const ACK_WAIT: Duration = Duration::from_secs(3);
const NOISY: usize = 30;
const QUIET: usize = 2;

/// A server with an empty stream of tasks.
async fn tasks_stream() -> (NatsServer, jetstream::Context, jetstream::stream::Stream) {
    let server = NatsServer::start().await;
    let client = async_nats::connect(server.url()).await.expect("connects");
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: "FAIRFEED".into(),
            subjects: vec![TASKS_ALL.into()],
            ..Default::default()
        })
        .await
        .expect("stream");
    (server, js, stream)
}

/// Publishes `n` tasks of `agent` for `tenant`, each acknowledged.
async fn publish_tasks(js: &jetstream::Context, agent: &str, tenant: &str, n: usize) {
    let subject = task_for(
        &agent.parse().expect("agent"),
        &tenant.parse().expect("tenant"),
    );
    for _ in 0..n {
        js.publish(subject.clone(), "x".into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
}

/// A server with a stream of `NOISY` tasks of acme, then `QUIET` of globex, its durable
/// consumer and a fair feed of it (a window of 100).
async fn feed_of_tasks() -> (NatsServer, jetstream::consumer::PullConsumer, FairFeed) {
    let (server, js, stream) = tasks_stream().await;
    for (tenant, n) in [("acme", NOISY), ("globex", QUIET)] {
        publish_tasks(&js, "fair", tenant, n).await;
    }
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("work".into()),
            ack_wait: ACK_WAIT,
            max_deliver: 20,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let messages = Deliveries::of(consumer.clone(), Durable::Intake)
        .await
        .expect("messages");
    let feed = FairFeed::start(messages, 100, Weights::default(), Tenancy::Task, ACK_WAIT);
    (server, consumer, feed)
}

#[tokio::test]
async fn the_light_taker_takes_a_quiet_tenants_work_ahead_of_a_backlog_and_stops_with_the_feed() {
    let (_server, _consumer, feed) = feed_of_tasks().await;
    // Started once the whole stream is in the window: a tenant's first deliveries are light
    // until its backlog has been read (fewer than `BACKLOG_FROM` of its own), so a taker
    // started earlier may rightly take the first of acme's.
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while feed.waiting() < NOISY + QUIET {
        assert!(
            std::time::Instant::now() < deadline,
            "the stream read into the window"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let (taken, mut took) = tokio::sync::mpsc::unbounded_channel();
    feed.take_light(
        &tokio::runtime::Handle::current(),
        Workers::new(4),
        move |slot, msg| {
            let _ = taken.send((slot, msg));
            std::future::ready(())
        },
    );
    // Globex's two, behind acme's thirty in the stream, are taken by the light taker; none of
    // acme's.
    let mut quiet = Vec::new();
    for _ in 0..QUIET {
        let (slot, msg) = tokio::time::timeout(Duration::from_secs(30), took.recv())
            .await
            .expect("taken in time")
            .expect("a delivery");
        let tenant = parse_task(&msg.subject).expect("a task").tenant.to_string();
        msg.ack().await.expect("ack");
        quiet.push((tenant, slot));
    }
    assert!(quiet.iter().all(|(t, _)| t == "globex"), "{quiet:?}");
    assert!(
        tokio::time::timeout(Duration::from_millis(500), took.recv())
            .await
            .is_err(),
        "the backlog is not light"
    );
    // The round robin hands out the rest (here: acme's, shared).
    let workers = Workers::new(1);
    let (slot, msg, pace) = feed.next(&workers).await.expect("a delivery");
    assert_eq!(
        parse_task(&msg.subject).expect("a task").tenant.to_string(),
        "acme"
    );
    assert_eq!(pace, kedge_core::fairness::Pace::Shared);
    msg.ack().await.expect("ack");
    drop(slot);
    // The stop ends the taker (its sender is dropped) and hands back the rest.
    assert_eq!(feed.hand_back().await, NOISY - 1);
    assert!(took.recv().await.is_none(), "the taker stopped");
}

#[tokio::test]
async fn tenants_take_turns_and_a_stop_hands_back_what_waits() {
    let (_server, consumer, feed) = feed_of_tasks().await;
    // Everything is in the window, then held there three ack waits.
    tokio::time::sleep(ACK_WAIT * 3).await;
    let workers = Workers::new(1);
    let mut tenants = Vec::new();
    let mut paces = Vec::new();
    for _ in 0..4 {
        let (slot, msg, pace) = feed.next(&workers).await.expect("a delivery");
        paces.push(pace);
        let info = msg.info().expect("info");
        assert_eq!(info.delivered, 1, "kept in progress while it waited");
        tenants.push(parse_task(&msg.subject).expect("a task").tenant.to_string());
        msg.ack().await.expect("ack");
        drop(slot);
    }
    assert_eq!(tenants, ["acme", "globex", "acme", "globex"], "turns");
    // The noisy tenant's backlog goes out on the shared connection, the quiet one's on the
    // light lane.
    use kedge_core::fairness::Pace;
    assert_eq!(
        paces,
        [Pace::Shared, Pace::Light, Pace::Shared, Pace::Light],
        "paces"
    );

    let waiting = NOISY + QUIET - 4;
    let handed = feed.hand_back().await;
    assert_eq!(handed, waiting, "every waiting delivery handed back once");
    // Fetched again until every one is back (a loaded server may answer a fetch in parts).
    let mut got = 0;
    let deadline = std::time::Instant::now() + Duration::from_secs(60);
    while got < waiting && std::time::Instant::now() < deadline {
        let mut again = consumer
            .fetch()
            .max_messages(waiting - got)
            .expires(Duration::from_secs(5))
            .messages()
            .await
            .expect("fetch");
        while let Some(msg) = again.next().await {
            let msg = msg.expect("message");
            let info = msg.info().expect("info");
            assert_eq!(info.delivered, 2, "handed back once, never redelivered");
            msg.ack().await.expect("ack");
            got += 1;
        }
    }
    assert_eq!(got, waiting, "none lost");
}

#[tokio::test]
async fn a_feed_of_two_consumers_hands_out_both_and_acknowledges_what_it_passes_over() {
    let (_server, js, stream) = tasks_stream().await;
    // acme's tasks of agents `wake` and `pass` on one consumer, globex's of `born` on another.
    for (agent, tenant, n) in [
        ("wake", "acme", 3),
        ("pass", "acme", 3),
        ("born", "globex", 2),
    ] {
        publish_tasks(&js, agent, tenant, n).await;
    }
    let mut consumers = Vec::new();
    let mut sources = Vec::new();
    for (name, filter) in [
        ("inputs", "agent.task.*.acme"),
        ("created", "agent.task.*.globex"),
    ] {
        let consumer = stream
            .create_consumer(pull::Config {
                durable_name: Some(name.into()),
                filter_subject: filter.into(),
                ack_wait: ACK_WAIT,
                max_deliver: 20,
                ..Default::default()
            })
            .await
            .expect("consumer");
        sources.push(
            Deliveries::of(consumer.clone(), Durable::Intake)
                .await
                .expect("messages"),
        );
        consumers.push(consumer);
    }
    let passed_over = |msg: &async_nats::jetstream::Message| {
        parse_task(&msg.subject).is_ok_and(|t| t.agent.as_str() == "pass")
    };
    let feed = FairFeed::start_many(
        sources,
        passed_over,
        100,
        Weights::default(),
        Tenancy::Task,
        ACK_WAIT,
    );
    let workers = Workers::new(1);
    let mut got = Vec::new();
    for _ in 0..5 {
        let (slot, msg, _) = tokio::time::timeout(Duration::from_secs(30), feed.next(&workers))
            .await
            .expect("handed out in time")
            .expect("a delivery");
        got.push(parse_task(&msg.subject).expect("a task").agent.to_string());
        msg.ack().await.expect("ack");
        drop(slot);
    }
    got.sort();
    assert_eq!(got, ["born", "born", "wake", "wake", "wake"]);
    // The passed-over ones were acknowledged (nothing pending on either consumer), and nothing
    // is left to hand back.
    for mut consumer in consumers {
        let mut pending = u64::MAX;
        for _ in 0..50 {
            let info = consumer.info().await.expect("info");
            pending = info.num_ack_pending as u64 + info.num_pending;
            if pending == 0 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert_eq!(pending, 0, "every delivery settled");
    }
    assert_eq!(feed.hand_back().await, 0);
}
