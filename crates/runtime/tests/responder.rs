//! The request-reply responder every service answers with, against a real nats-server: at most
//! `bound` requests are handled at once (one more is refused at once, or waits, as the service
//! chose), and a stop drains what is in flight and takes nothing more.

use std::sync::Arc;
use std::time::Duration;

use async_nats::{Client, Message};
use kedge_runtime::responder::{self, Busy, Listen};
use kedge_testkit::NatsServer;
use tokio::sync::{Notify, oneshot};

const SUBJECT: &str = "test.responder";

fn listen(busy: Busy) -> Listen {
    Listen {
        what: "test requests",
        subject: SUBJECT.to_owned(),
        queue: "test-responders",
        bound: 1,
        busy,
    }
}

fn refuse(client: &Client, msg: Message) {
    let client = client.clone();
    tokio::spawn(async move { responder::reply(&client, &msg, &"busy").await });
}

async fn ask(client: &Client) -> Result<String, async_nats::RequestError> {
    let reply = client
        .request(SUBJECT, "?".into())
        .await
        .map(|m| String::from_utf8_lossy(&m.payload).into_owned())?;
    Ok(reply)
}

/// Serves with a handler that answers "done" once `release` is notified; returns the stop
/// switch and the serving task.
fn start(
    client: &Client,
    busy: Busy,
    release: Arc<Notify>,
) -> (oneshot::Sender<()>, tokio::task::JoinHandle<()>) {
    let (stop, stopped) = oneshot::channel::<()>();
    let client = client.clone();
    let task = tokio::spawn(async move {
        let shutdown = async move {
            let _ = stopped.await;
        };
        let answering = client.clone();
        responder::serve(&client, listen(busy), shutdown, move |msg| {
            let (client, release) = (answering.clone(), release.clone());
            async move {
                release.notified().await;
                responder::reply(&client, &msg, &"done").await;
            }
        })
        .await
        .expect("subscribed");
    });
    (stop, task)
}

#[tokio::test]
async fn a_request_beyond_the_bound_is_refused_at_once_and_a_stop_drains_the_one_in_flight() {
    let server = NatsServer::start().await;
    let client = async_nats::connect(server.url()).await.expect("connects");
    let release = Arc::new(Notify::new());
    let (stop, task) = start(&client, Busy::Refuse(refuse), release.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    // The first takes the one slot and waits; the second is refused while it does.
    let first = tokio::spawn({
        let client = client.clone();
        async move { ask(&client).await }
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(ask(&client).await.expect("an answer"), "\"busy\"");
    // Stopping takes no more requests but lets the one in flight answer.
    stop.send(()).expect("serving");
    tokio::time::sleep(Duration::from_millis(200)).await;
    release.notify_one();
    assert_eq!(first.await.expect("joined").expect("an answer"), "\"done\"");
    tokio::time::timeout(Duration::from_secs(5), task)
        .await
        .expect("stopped after the drain")
        .expect("joined");
    let after = ask(&client)
        .await
        .expect_err("nobody answers after the stop");
    assert_eq!(
        after.kind(),
        async_nats::RequestErrorKind::NoResponders,
        "{after}"
    );
}

#[tokio::test]
async fn a_request_beyond_the_bound_waits_for_a_slot_when_the_service_says_so() {
    let server = NatsServer::start().await;
    let client = async_nats::connect(server.url()).await.expect("connects");
    let release = Arc::new(Notify::new());
    let (stop, task) = start(&client, Busy::Wait, release.clone());
    tokio::time::sleep(Duration::from_millis(200)).await;
    let asks: Vec<_> = (0..2)
        .map(|_| {
            let client = client.clone();
            tokio::spawn(async move { ask(&client).await })
        })
        .collect();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // One at a time: each release lets exactly one handler answer.
    release.notify_one();
    tokio::time::sleep(Duration::from_millis(300)).await;
    release.notify_one();
    for a in asks {
        assert_eq!(a.await.expect("joined").expect("an answer"), "\"done\"");
    }
    stop.send(()).expect("serving");
    task.await.expect("joined");
}
