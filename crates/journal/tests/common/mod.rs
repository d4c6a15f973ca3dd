//! Shared helpers of the journal's integration tests: a broker with Kedge's layout, and
//! envelopes built from kedge-core's types.

#![allow(dead_code, clippy::unwrap_used)]

use kedge_core::event::{
    AssistantMessage, Budget, Digest, FinishReason, ModelSpec, Provider, RunCreated, RunStarted,
    StepCompleted, Timestamp, ToolRequested, ToolResult, Usage, UserMessage,
};
use kedge_core::ids::ModelRequestId;
use kedge_core::{Attempt, Draft, Envelope, Event, OperationId, RunId, StepNo};
use kedge_journal::{Journal, LayoutOptions, ensure_layout};
use kedge_testkit::NatsServer;

/// A fresh server with Kedge's layout, and a journal over it.
pub async fn setup() -> (NatsServer, Journal) {
    let server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .expect("layout");
    (server, Journal::new(client))
}

pub fn new_run() -> RunId {
    RunId::generate()
}

fn env(run: &RunId, draft: Draft) -> Envelope {
    Envelope::new(run.clone(), Timestamp::now(), draft)
}

pub fn run_created(run: &RunId) -> Envelope {
    env(
        run,
        Draft::new(Event::RunCreated(
            RunCreated {
                agent: "test-agent".parse().unwrap(),
                agent_revision: 1,
                agent_digest: Digest::of_bytes(b"agent"),
                model: ModelSpec {
                    provider: Provider::Openai,
                    name: "mock".into(),
                    base_url: None,
                    settings: Default::default(),
                    price: None,
                },
                prompt_digest: Digest::of_bytes(b"prompt"),
                tools_digest: Digest::of_bytes(b"tools"),
                policy_digest: Digest::of_bytes(b"policy"),
                budget: Budget::default(),
                tenant: "t1".parse().unwrap(),
                caller: None,
                idempotency_key: None,
                input: "hello".into(),
                runtime_version: "test".into(),
                metadata: Default::default(),
                traceparent: None,
                parent: None,
            }
            .into(),
        )),
    )
}

pub fn run_started(run: &RunId) -> Envelope {
    env(run, Draft::new(Event::RunStarted(RunStarted {})))
}

pub fn step_completed(run: &RunId, step: u32) -> Envelope {
    env(
        run,
        Draft::new(Event::StepCompleted(StepCompleted {
            request_id: ModelRequestId::new(run, StepNo(step), Attempt(1)),
            message: AssistantMessage {
                text: format!("step {step}"),
                tool_calls: vec![],
                thinking: Vec::new(),
            },
            usage: Usage {
                input_tokens: 10,
                output_tokens: 5,
                cost: None,
            },
            finish: FinishReason::ToolCalls,
            reused: false,
            follows: None,
        }))
        .step(StepNo(step)),
    )
}

pub fn tool_requested(run: &RunId, step: u32, index: u32) -> Envelope {
    let arguments = serde_json::json!({ "q": index });
    env(
        run,
        Draft::new(Event::ToolRequested(ToolRequested {
            call_id: format!("call_{index}"),
            tool: "search".into(),
            args_digest: Digest::of_json(&arguments),
            arguments,
            redispatch: 0,
            expect_version: None,
            timeout_secs: None,
            network: false,
            max_output_bytes: None,
            retry: None,
            reversibility: None,
            compensates: None,
        }))
        .step(StepNo(step))
        .op(OperationId::new(run, StepNo(step), index)),
    )
}

/// One step.completed and three tool.requested: a typical group.
pub fn step_group(run: &RunId, step: u32) -> Vec<Envelope> {
    let mut g = vec![step_completed(run, step)];
    g.extend((0..3).map(|i| tool_requested(run, step, i)));
    g
}

pub fn user_message(run: &RunId, text: &str) -> Envelope {
    env(
        run,
        Draft::new(Event::UserMessage(UserMessage { text: text.into() })),
    )
}

pub fn tool_result(run: &RunId, step: u32, index: u32) -> Envelope {
    env(
        run,
        Draft::new(Event::ToolResult(ToolResult {
            content: format!("result {index}"),
            is_error: false,
            stopped: false,
        }))
        .step(StepNo(step))
        .op(OperationId::new(run, StepNo(step), index)),
    )
}

/// Publishes raw bytes on `subject` (anyone may, on an input subject) and returns the sequence.
pub async fn publish_raw(
    js: &async_nats::jetstream::Context,
    subject: String,
    payload: Vec<u8>,
    msg_id: Option<&str>,
) -> u64 {
    let mut headers = async_nats::HeaderMap::new();
    if let Some(id) = msg_id {
        headers.insert("Nats-Msg-Id", id);
    }
    js.publish_with_headers(subject, headers, payload.into())
        .await
        .unwrap()
        .await
        .unwrap()
        .sequence
}
