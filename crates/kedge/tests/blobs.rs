//! Large payloads by reference through the real services: a 2 MiB model
//! response (a `write_file` call carrying 2 MiB) and a 10 MiB tool output (`cat` of that file
//! five times, under the agent's `policy.shell.max_output_bytes`) go through a run end to end.
//! The model reads the whole output in its next context, the journal holds every event whole
//! for its readers, no stored message is over 64 KiB, the bridge serves the blobs to the run's
//! tenant, and the default limit still cuts a tool whose policy says nothing.

use crate::common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, STORED_NOT_COMMITTED, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, ToolResult};
use kedge_core::ids::RunId;
use kedge_journal::Recorded;
use kedge_journal::blob::INLINE_MAX;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(120);
const MIB: usize = 1024 * 1024;

/// `size` bytes of text whose lines all differ.
fn text(size: usize) -> String {
    let mut s = String::with_capacity(size + 64);
    let mut i = 0u64;
    while s.len() < size {
        s.push_str(&format!(
            "{i:08} the quick brown fox jumps over the lazy dog\n"
        ));
        i += 1;
    }
    s.truncate(size);
    s
}

/// An agent on `model` with the file tools and `shell`, a budget for megabytes of context, and
/// `policy`.
async fn store_agent(h: &Harness, name: &str, model: &str, policy: Value) {
    let tool = |n: &str| json!({"name": n, "description": n, "parameters": {"type": "object", "properties": {}}});
    let def = json!({
        "name": name,
        "system_prompt": "test agent",
        "model": {"provider": "openai", "name": model, "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": [tool("write_file"), tool("read_file"), tool("shell")],
        "policy": policy,
        "budget": {"max_steps": 10, "max_tokens": 100_000_000, "max_attempts_per_step": 3}
    });
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

fn results(events: &[Recorded]) -> Vec<&ToolResult> {
    events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolResult(t) => Some(t),
            _ => None,
        })
        .collect()
}

/// Every message of the run as stored in the stream (not resolved): none is over `INLINE_MAX`;
/// returns how many hold their data by reference.
async fn stored_by_reference(h: &Harness, run: &RunId, events: &[Recorded]) -> usize {
    let stream =
        h.rt.js
            .get_stream("KEDGE_RUNS")
            .await
            .expect("journal stream");
    let mut by_reference = 0;
    for r in events {
        let m = stream.get_raw_message(r.seq).await.expect("stored message");
        assert!(
            m.payload.len() <= INLINE_MAX,
            "{run}: {} at {} is stored with {} bytes",
            r.envelope.event_type(),
            r.seq,
            m.payload.len()
        );
        let v: Value = serde_json::from_slice(&m.payload).expect("json");
        if v.get("data_ref").is_some() {
            assert!(v.get("data").is_none());
            assert_eq!(v["data_ref"]["digest"], json!(r.envelope.digest));
            by_reference += 1;
        }
    }
    by_reference
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_two_mib_response_and_a_ten_mib_tool_output_go_through_a_run() {
    let content = text(2 * MIB);
    let script = json!({"models": {"big": {"steps": [
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "big.txt", "content": content}}]},
        {"tool_calls": [{"name": "shell", "arguments": {"command": "cat", "args": ["big.txt", "big.txt", "big.txt", "big.txt", "big.txt"]}}]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        // Writing, catting and hashing megabytes on a loaded machine: leases that a busy
        // moment does not lose (the harness's in-process services share one worker id, so a
        // lost lease is not taken back by its own process).
        c.timeouts.lease_ttl_ms = 10_000;
        c.timeouts.lease_renew_ms = 2_000;
        c.timeouts.step_ack_wait_ms = 15_000;
        c.timeouts.stall_after_ms = 30_000;
        c.timeouts.tool_timeout_ms = 20_000;
        c.timeouts.tool_grace_ms = 2_000;
        c.timeouts.tool_ack_wait_ms = 30_000;
        c.timeouts.model_timeout_ms = 60_000;
    })
    .await;
    store_agent(
        &h,
        "big",
        "big",
        json!({"shell": {"max_output_bytes": 16 * MIB}}),
    )
    .await;
    let run = h
        .submit("big", "make a big file and read it", "blobs-1")
        .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{state:?}");

    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let results = results(&events);
    assert_eq!(results.len(), 2);
    assert!(!results[1].is_error, "{}", &results[1].content[..200]);
    assert_eq!(results[1].content.len(), 10 * MIB);
    assert!(
        results[1].content == content.repeat(5),
        "the output read back whole"
    );
    // The 2 MiB response and the arguments it carried.
    let written = events.iter().find_map(|r| match &r.envelope.event {
        Event::ToolRequested(t) if t.tool == "write_file" => Some(t),
        _ => None,
    });
    assert_eq!(
        written.expect("write_file requested").arguments["content"],
        json!(content)
    );

    // The model read the whole output in its next context.
    let requests = h.mock.requests("big");
    assert_eq!(requests.len(), 3);
    let last = requests[2].to_string();
    assert!(
        last.len() > 10 * MIB,
        "the last request has {} bytes",
        last.len()
    );
    let tail_of_output = &content[content.len() - 200..];
    assert!(last.contains(&tail_of_output.replace('\n', "\\n")));

    // Stored: every message small, the large ones by reference (step 1's step.completed and
    // tool.requested, and the 10 MiB result; the write_file result is small).
    let by_reference = stored_by_reference(&h, &run, &events).await;
    assert!(by_reference >= 3, "{by_reference} messages by reference");

    // The idempotency record of the shell operation holds its 10 MiB by reference too.
    let op = events
        .iter()
        .find_map(|r| match &r.envelope.event {
            Event::ToolRequested(t) if t.tool == "shell" => r.envelope.op.clone(),
            _ => None,
        })
        .expect("shell op");
    let kv =
        h.rt.js
            .get_key_value("kedge_idempotency")
            .await
            .expect("bucket");
    let record = kv
        .get(format!("op.{op}"))
        .await
        .expect("record")
        .expect("record exists");
    assert!(
        record.len() <= INLINE_MAX,
        "op record of {} bytes",
        record.len()
    );
    h.check_replay(&run, "blobs-by-reference").await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_without_an_output_policy_is_still_cut_at_the_default() {
    let script = json!({"models": {"cut": {"steps": [
        {"tool_calls": [{"name": "write_file", "arguments": {"path": "f.txt", "content": text(200 * 1024)}}]},
        {"tool_calls": [{"name": "read_file", "arguments": {"path": "f.txt"}}]},
        {"text": "done"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    // A policy for another tool changes nothing for read_file.
    store_agent(
        &h,
        "cut",
        "cut",
        json!({"shell": {"max_output_bytes": 16 * MIB}}),
    )
    .await;
    let run = h.submit("cut", "go", "blobs-2").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{state:?}");
    let events = h.events(&run).await;
    let results = results(&events);
    assert!(
        results[1].content.len() < 70 * 1024,
        "read_file gave {} bytes",
        results[1].content.len()
    );
    h.shutdown().await;
}

/// The stored model response of a 2 MiB answer is held by reference and reused whole by the
/// worker that takes over after the first one died right after storing it: one model call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_killed_after_a_two_mib_answer_costs_no_second_call() {
    let answer = text(2 * MIB);
    let script = json!({"models": {"kill": {"steps": [{"text": answer}]}}});
    let mut h = Harness::start_with(script, &[Svc::Intake], |c| {
        c.timeouts.model_timeout_ms = 60_000;
    })
    .await;
    store_agent(&h, "kill", "kill", json!({})).await;
    let doomed = h.spawn_process("step", "w-doomed", STORED_NOT_COMMITTED);
    let run = h.submit("kill", "answer at length", "blobs-3").await;
    assert!(h.wait_exit(doomed, WAIT).await, "the armed worker aborts");
    assert_eq!(h.mock.total_calls(), 1);
    h.spawn_process("step", "w-fresh", "");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(
        h.mock.total_calls(),
        1,
        "the stored 2 MiB answer was reused"
    );
    let events = h.events(&run).await;
    let completed = events
        .iter()
        .find_map(|r| match &r.envelope.event {
            Event::StepCompleted(c) => Some(c.clone()),
            _ => None,
        })
        .expect("step completed");
    assert!(completed.reused);
    assert!(completed.message.text == answer);
    let output = events.iter().find_map(|r| match &r.envelope.event {
        Event::RunSucceeded(s) => Some(s.output.clone()),
        _ => None,
    });
    assert!(output.expect("succeeded") == answer);
    // The record it was reused from is a reference.
    let kv =
        h.rt.js
            .get_key_value("kedge_idempotency")
            .await
            .expect("bucket");
    let record = kv
        .get(format!("model.{}", completed.request_id))
        .await
        .expect("record")
        .expect("record exists");
    assert!(
        record.len() <= INLINE_MAX,
        "model record of {} bytes",
        record.len()
    );
    // step.completed and run.succeeded each carry the 2 MiB.
    assert_eq!(stored_by_reference(&h, &run, &events).await, 2);
    h.shutdown().await;
}
