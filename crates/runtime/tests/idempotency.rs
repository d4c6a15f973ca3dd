//! Stored model responses survive broker trouble: a response the bucket cannot take right now
//! (its server down or its leader moving) is stored once it answers again, and this process
//! reuses it meanwhile — a paid call is never paid twice for want of a store.

use std::time::Duration;

use kedge_core::decide::ModelResponse;
use kedge_core::event::{AssistantMessage, Digest, FinishReason, Usage};
use kedge_core::ids::{Attempt, ModelRequestId, RunId, StepNo};
use kedge_journal::{LayoutOptions, ensure_layout};
use kedge_runtime::idempotency::{IdempotencyStore, StoredResponse};
use kedge_testkit::NatsServer;

fn response(text: &str) -> StoredResponse {
    StoredResponse {
        context_digest: Digest::of_bytes(b"context"),
        response: ModelResponse {
            message: AssistantMessage {
                text: text.into(),
                tool_calls: vec![],
                thinking: Vec::new(),
            },
            usage: Usage {
                input_tokens: 10,
                output_tokens: 5,
                cost: None,
            },
            finish: FinishReason::Stop,
        },
    }
}

async fn store(client: &async_nats::Client) -> IdempotencyStore {
    let js = async_nats::jetstream::new(client.clone());
    IdempotencyStore::new(js.get_key_value("kedge_idempotency").await.expect("bucket"))
}

#[tokio::test]
async fn a_response_is_stored_once_the_broker_is_back_and_reused_from_memory_meanwhile() {
    let mut server = NatsServer::start().await;
    let client = async_nats::ConnectOptions::new()
        .request_timeout(Some(Duration::from_millis(500)))
        .connect(server.url())
        .await
        .expect("connects");
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .expect("layout");
    let idem = store(&client).await;
    let run = RunId::generate();
    let request = ModelRequestId::new(&run, StepNo(1), Attempt(1));
    let stored = response("paid for");

    // The broker goes away while the model answers; it comes back two seconds later.
    server.kill9();
    let storing = {
        let idem = idem.clone();
        let request = request.clone();
        let stored = stored.clone();
        tokio::spawn(async move { idem.store_response(&request, &stored).await })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile this process reuses it (its next attempt would otherwise call again).
    assert_eq!(
        idem.stored_response(&request).await.expect("from memory"),
        Some(stored.clone())
    );
    tokio::time::sleep(Duration::from_millis(1_700)).await;
    server.restart().await;
    tokio::time::timeout(Duration::from_secs(40), storing)
        .await
        .expect("store_response returns")
        .expect("task")
        .expect("stored once the broker answers");
    // Another process (no memory of it) finds it in the bucket.
    let other = async_nats::connect(server.url()).await.expect("connects");
    assert_eq!(
        store(&other)
            .await
            .stored_response(&request)
            .await
            .expect("read"),
        Some(stored)
    );
}
