//! Shared helpers of the journal's integration tests: a broker with Kedge's layout, and
//! envelopes built from kedge-core's types.

#![allow(dead_code, clippy::unwrap_used)]

use kedge_core::event::{
    AssistantMessage, Decision, Digest, FinishReason, Input, RunCreated, RunStarted, StepCompleted,
    Timestamp, ToolRequested, ToolResult, ToolStarted, Usage, UserMessage,
};
use kedge_core::ids::ModelRequestId;
use kedge_core::{Attempt, DecisionEnvelope, Draft, InputEnvelope, OperationId, RunId, StepNo};
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

/// The worker id `name` (a test's own, always valid).
pub fn worker(name: &str) -> kedge_core::ids::WorkerId {
    name.parse().expect("worker id")
}

pub fn new_run() -> RunId {
    RunId::generate()
}

fn decision(run: &RunId, draft: Draft<Decision>) -> DecisionEnvelope {
    DecisionEnvelope::new(run.clone(), Timestamp::now(), draft)
}

fn input(run: &RunId, draft: Draft<Input>) -> InputEnvelope {
    InputEnvelope::new(run.clone(), Timestamp::now(), draft)
}

pub fn run_created(run: &RunId) -> DecisionEnvelope {
    decision(
        run,
        Draft::new(Decision::RunCreated(
            RunCreated {
                tenant: "t1".parse().unwrap(),
                ..kedge_testkit::fixtures::run_created("test-agent", "hello")
            }
            .into(),
        )),
    )
}

pub fn run_started(run: &RunId) -> DecisionEnvelope {
    decision(run, Draft::new(Decision::RunStarted(RunStarted {})))
}

pub fn step_completed(run: &RunId, step: u32) -> DecisionEnvelope {
    decision(
        run,
        Draft::new(Decision::StepCompleted(StepCompleted {
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
            model: None,
        }))
        .step(StepNo(step)),
    )
}

pub fn tool_requested(run: &RunId, step: u32, index: u32) -> DecisionEnvelope {
    let arguments = serde_json::json!({ "q": index });
    decision(
        run,
        Draft::new(Decision::ToolRequested(ToolRequested {
            call_id: format!("call_{index}"),
            tool: "search".into(),
            args_digest: Digest::of_json(&arguments),
            arguments,
            redispatch: 0,
            expect_version: None,
            limits: Default::default(),
            reversibility: None,
            compensates: None,
        }))
        .step(StepNo(step))
        .op(OperationId::new(run, StepNo(step), index)),
    )
}

/// One step.completed and three tool.requested: a typical group.
pub fn step_group(run: &RunId, step: u32) -> Vec<DecisionEnvelope> {
    let mut g = vec![step_completed(run, step)];
    g.extend((0..3).map(|i| tool_requested(run, step, i)));
    g
}

pub fn user_message(run: &RunId, text: &str) -> InputEnvelope {
    input(
        run,
        Draft::new(Input::UserMessage(UserMessage { text: text.into() })),
    )
}

pub fn tool_started(run: &RunId, step: u32, index: u32) -> InputEnvelope {
    input(
        run,
        Draft::new(Input::ToolStarted(ToolStarted {
            runner: "runner-1".into(),
            attempt: 1,
        }))
        .step(StepNo(step))
        .op(OperationId::new(run, StepNo(step), index)),
    )
}

pub fn tool_result(run: &RunId, step: u32, index: u32) -> InputEnvelope {
    tool_result_of(run, step, index, format!("result {index}"))
}

fn tool_result_of(run: &RunId, step: u32, index: u32, content: String) -> InputEnvelope {
    input(
        run,
        Draft::new(Input::ToolResult(ToolResult {
            content,
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

/// A tool result of `size` bytes for operation `op` of step `step` (not compressible to a
/// repeat: each line differs), large enough to go by reference when `size` > `INLINE_MAX`.
pub fn long_tool_result(run: &RunId, step: u32, op: u32, size: usize) -> InputEnvelope {
    let mut content = String::with_capacity(size + 32);
    let mut i = 0u64;
    while content.len() < size {
        content.push_str(&format!("line {i} of a long tool output\n"));
        i += 1;
    }
    content.truncate(size);
    tool_result_of(run, step, op, content)
}

/// The message at `seq` as a consumer of the stream delivers it: its stored headers with it.
pub async fn stored(
    js: &async_nats::jetstream::Context,
    seq: u64,
) -> async_nats::jetstream::message::StreamMessage {
    let stream = js.get_stream("KEDGE_RUNS").await.unwrap();
    stream.direct_get(seq).await.unwrap()
}

/// `m` as the journal reads a delivered message.
pub fn delivered(
    m: &async_nats::jetstream::message::StreamMessage,
) -> kedge_journal::Delivered<'_> {
    kedge_journal::Delivered {
        seq: m.sequence,
        subject: m.subject.as_str(),
        headers: Some(&m.headers),
        payload: &m.payload,
    }
}
