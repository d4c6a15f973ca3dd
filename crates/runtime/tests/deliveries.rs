//! A service's deliveries against a real nats-server: a pull request no server could serve
//! (the consumer not there yet, as on a cluster still electing its leaders) is asked again at
//! once, not after the client's own expiry rule (the request's expiry and 5 s more); a fair
//! feed's deliveries ask for its larger batch per pull request.

use std::time::{Duration, Instant};

use async_nats::jetstream::consumer::PullConsumer;
use async_nats::jetstream::{self, consumer::pull, stream};
use kedge_core::subjects::Durable;
use kedge_runtime::consumer::Deliveries;
use kedge_testkit::NatsServer;

/// Beyond this the client's own rule would have asked again (10 s expiry and 5 s): a bound
/// that tells a stream opened again from one left waiting, not a timing goal.
const BOUND: Duration = Duration::from_secs(12);

/// A client of `server` and a stream `name` on `subjects`, made on it.
async fn stream_on(
    server: &NatsServer,
    name: &str,
    subjects: &str,
) -> (jetstream::Context, jetstream::stream::Stream) {
    let client = async_nats::connect(server.url()).await.expect("connects");
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: name.into(),
            subjects: vec![subjects.into()],
            ..Default::default()
        })
        .await
        .expect("stream");
    (js, stream)
}

#[tokio::test]
async fn a_pull_request_no_server_could_serve_is_asked_again_at_once() {
    let server = NatsServer::start().await;
    let (js, stream) = stream_on(&server, "DELIVERIES", "dl.>").await;
    let config = pull::Config {
        durable_name: Some("work".into()),
        ack_wait: Duration::from_secs(60),
        ..Default::default()
    };
    let consumer = stream
        .create_consumer(config.clone())
        .await
        .expect("consumer");
    // The consumer is gone on the server while its handle is held: the first pull request
    // finds no one to serve it.
    stream.delete_consumer("work").await.expect("deleted");
    let mut deliveries = Deliveries::of(consumer, Durable::Step)
        .await
        .expect("deliveries");
    let taking = tokio::spawn(async move {
        let msg = deliveries.next().await;
        (msg.map(|m| m.subject.to_string()), Instant::now())
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    // The consumer comes (back) and a message waits for it.
    stream
        .create_consumer(config)
        .await
        .expect("consumer again");
    js.publish("dl.one", "x".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let published = Instant::now();
    let (subject, at) = tokio::time::timeout(BOUND, taking)
        .await
        .expect("the message was taken within the bound: the pull was asked again")
        .expect("the task ended");
    assert_eq!(subject.as_deref(), Some("dl.one"));
    eprintln!(
        "taken {} ms after it was stored",
        at.saturating_duration_since(published).as_millis()
    );
}

/// A hand-back is confirmed by the server (not sent again, not left to the ack wait) and the
/// message comes back after its delay.
#[tokio::test]
async fn a_hand_back_is_confirmed_and_the_message_comes_back_after_its_delay() {
    use kedge_runtime::consumer::{Verdict, settle};
    let server = NatsServer::start().await;
    let (js, stream) = stream_on(&server, "HANDEDBACK", "hb.>").await;
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("work".into()),
            // Far beyond the test: a message seen again came back by the hand-back.
            ack_wait: Duration::from_secs(120),
            max_deliver: 5,
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut deliveries = Deliveries::of(consumer, Durable::Step)
        .await
        .expect("deliveries");
    js.publish("hb.one", "x".into())
        .await
        .expect("publish")
        .await
        .expect("stored");
    let first = deliveries.next().await.expect("delivered");
    let settling = Instant::now();
    settle(
        &js,
        Durable::Step,
        &first,
        Verdict::Later(Duration::from_millis(300)),
    )
    .await;
    let settled_in = settling.elapsed();
    // Unconfirmed, the hand-back would be sent three times over at least 6 s.
    assert!(
        settled_in < Duration::from_secs(5),
        "the server confirmed the hand-back: settled in {settled_in:?}"
    );
    let again = tokio::time::timeout(Duration::from_secs(30), deliveries.next())
        .await
        .expect("back well before the ack wait")
        .expect("delivered again");
    assert_eq!(again.info().expect("info").delivered, 2);
    eprintln!(
        "settled in {} ms; back {} ms after the hand-back",
        settled_in.as_millis(),
        settling.elapsed().as_millis()
    );
}

/// How many deliveries the server handed the client after it took one message of `stored`,
/// reading with `open` (the consumer's acks pending: pulled, whether taken or not).
async fn pulled_after_one(
    stored: usize,
    open: impl AsyncFnOnce(PullConsumer) -> Deliveries,
) -> u64 {
    let server = NatsServer::start().await;
    let (js, stream) = stream_on(&server, "BATCHES", "bt.>").await;
    let mut acks = Vec::with_capacity(stored);
    for i in 0..stored {
        acks.push(
            js.publish(format!("bt.{i}"), "x".into())
                .await
                .expect("publish"),
        );
    }
    for ack in acks {
        ack.await.expect("stored");
    }
    let consumer = stream
        .create_consumer(pull::Config {
            durable_name: Some("work".into()),
            ack_wait: Duration::from_secs(60),
            ..Default::default()
        })
        .await
        .expect("consumer");
    let mut deliveries = open(consumer.clone()).await;
    deliveries.next().await.expect("a message");
    // The client's first pull request is served whole; the second goes out only once half of
    // it is taken, which this test never does: what the server handed out settles at one batch.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut consumer = consumer;
    let mut last = 0;
    loop {
        tokio::time::sleep(Duration::from_millis(200)).await;
        let pending = consumer
            .info()
            .await
            .expect("consumer info")
            .num_ack_pending as u64;
        if (pending > 0 && pending == last) || Instant::now() > deadline {
            return pending;
        }
        last = pending;
    }
}

#[tokio::test]
async fn a_batched_feed_asks_for_its_batch_per_pull_request() {
    // The default: the client's 200 per request.
    let default = pulled_after_one(2_000, async |c| {
        Deliveries::of(c, Durable::Intake)
            .await
            .expect("deliveries")
    })
    .await;
    assert_eq!(default, kedge_runtime::consumer::PULL_BATCH as u64);
    // A fair feed's batch: a backlog read five times faster per round trip.
    let batched = pulled_after_one(2_000, async |c| {
        Deliveries::batched(c, Durable::Intake, kedge_runtime::fair::PULL_BATCH)
            .await
            .expect("deliveries")
    })
    .await;
    assert_eq!(batched, kedge_runtime::fair::PULL_BATCH as u64);
}
