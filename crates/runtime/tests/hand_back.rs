//! A graceful stop hands back what the consumer pulled and nothing started, against a real
//! nats-server: another process gets those messages now, not after the ack wait, and a
//! handed-back message does not bounce through the stopping process's own pull request.

use std::time::Duration;

use async_nats::jetstream::{self, consumer::pull, stream};
use futures::StreamExt as _;
use kedge_core::subjects::Durable;
use kedge_runtime::consumer::{Deliveries, Workers};
use kedge_testkit::NatsServer;

/// Far longer than the test may take: a message seen again before it comes from a hand-back.
const ACK_WAIT: Duration = Duration::from_secs(120);
const MESSAGES: usize = 20;

async fn setup(server: &NatsServer) -> (jetstream::Context, Deliveries) {
    let client = async_nats::connect(server.url()).await.expect("connects");
    let js = jetstream::new(client);
    let stream = js
        .create_stream(stream::Config {
            name: "HANDBACK".into(),
            subjects: vec!["hb.>".into()],
            ..Default::default()
        })
        .await
        .expect("stream");
    for i in 0..MESSAGES {
        js.publish(format!("hb.{i}"), "x".into())
            .await
            .expect("publish")
            .await
            .expect("ack");
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
    let messages = Deliveries::of(consumer, Durable::Step)
        .await
        .expect("messages");
    (js, messages)
}

#[tokio::test]
async fn what_was_pulled_and_not_started_goes_back_at_once() {
    let server = NatsServer::start().await;
    let (js, mut messages) = setup(&server).await;
    // The stopping process took one message (a handler started on it) and its client has
    // pulled the rest in the same batch.
    let workers = Workers::new(1);
    let (slot, started) = workers.next(&mut messages).await.expect("a message");
    let started_seq = started.info().expect("info").stream_sequence;
    tokio::time::sleep(Duration::from_millis(200)).await;
    let handed = messages.hand_back().await;
    assert_eq!(
        handed,
        MESSAGES - 1,
        "every pulled, unstarted message is handed back once"
    );

    // Another process gets every one of them now: without the hand-back they would be held
    // for the two-minute ack wait.
    let other = js
        .get_stream("HANDBACK")
        .await
        .expect("stream")
        .get_consumer::<pull::Config>("work")
        .await
        .expect("consumer");
    let mut got = Vec::new();
    let mut batch = other
        .fetch()
        .max_messages(MESSAGES)
        .expires(Duration::from_secs(5))
        .messages()
        .await
        .expect("fetch");
    while let Some(msg) = batch.next().await {
        let msg = msg.expect("message");
        let info = msg.info().expect("info");
        got.push(info.stream_sequence);
        assert_eq!(
            info.delivered, 2,
            "handed back once, then delivered here: {} deliveries",
            info.delivered
        );
        msg.ack().await.expect("ack");
        if got.len() == MESSAGES - 1 {
            break;
        }
    }
    got.sort_unstable();
    let expected: Vec<u64> = (1..=MESSAGES as u64)
        .filter(|s| *s != started_seq)
        .collect();
    assert_eq!(
        got, expected,
        "the other process got every handed-back message"
    );
    // The started one stays with its handler.
    started.ack().await.expect("ack");
    drop(slot);
}
