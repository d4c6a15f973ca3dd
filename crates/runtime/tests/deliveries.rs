//! A service's deliveries against a real nats-server: a pull request no server could serve
//! (the consumer not there yet, as on a cluster still electing its leaders) is asked again at
//! once, not after the client's own expiry rule (the request's expiry and 5 s more).

use std::time::{Duration, Instant};

use async_nats::jetstream::{self, consumer::pull, stream};
use kedge_core::subjects::Durable;
use kedge_runtime::consumer::Deliveries;
use kedge_testkit::NatsServer;

/// Beyond this the client's own rule would have asked again (10 s expiry and 5 s): a bound
/// that tells a stream opened again from one left waiting, not a timing goal.
const BOUND: Duration = Duration::from_secs(12);

#[tokio::test]
async fn a_pull_request_no_server_could_serve_is_asked_again_at_once() {
    let server = NatsServer::start().await;
    let client = async_nats::connect(server.url()).await.expect("connects");
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: "DELIVERIES".into(),
            subjects: vec!["dl.>".into()],
            ..Default::default()
        })
        .await
        .expect("stream");
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
    let client = async_nats::connect(server.url()).await.expect("connects");
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: "HANDEDBACK".into(),
            subjects: vec!["hb.>".into()],
            ..Default::default()
        })
        .await
        .expect("stream");
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
