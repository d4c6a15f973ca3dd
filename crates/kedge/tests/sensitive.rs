//! Sensitive values through the real services: an agent marks its task's
//! `input` and `metadata.account` and `write_file`'s `content` sensitive. The model reads the
//! input and its own tool call in clear, the tool writes the clear content, and no stream of the
//! broker (journal, idempotency records, blobs, projection, rejections, tasks, timers) holds
//! any of the three planted secrets: only sealed tokens. Without a seal key such a run is
//! refused before anything is journaled.

use crate::common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc};
use kedge_core::agent::AgentDefinition;
use kedge_core::event::Event;
use kedge_core::task::TaskSubmission;
use kedge_core::{EventType, RunStatus};
use kedge_runtime::config::Secret;
use kedge_runtime::seal;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);
const KEY: &str = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08";
const IN_INPUT: &str = "TOKEN-INPUT-7f3a19";
const IN_METADATA: &str = "ACCT-SECRET-91b2e4";
const IN_ARGUMENT: &str = "TOOL-SECRET-c0ffee";

fn script() -> Value {
    json!({"models": {"sens": {"steps": [
        {"text": "storing it", "tool_calls": [{"name": "write_file",
            "arguments": {"path": "token.txt", "content": IN_ARGUMENT}}]},
        {"text": "stored"}
    ]}}})
}

async fn store_agent(h: &Harness) {
    let def = json!({
        "name": "sens",
        "system_prompt": "test agent",
        "model": {"provider": "openai", "name": "sens", "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": ["write_file", "read_file"],
        "policy": {"write_file": {"sensitive": ["content"]}},
        "sensitive_task_fields": ["input", "metadata.account"],
        "budget": {"max_steps": 10, "max_tokens": 1_000_000, "max_attempts_per_step": 3}
    });
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

fn task() -> TaskSubmission {
    TaskSubmission {
        agent: "sens".parse().expect("name"),
        input: format!("Please keep my token {IN_INPUT} safe."),
        run_id: None,
        budget: None,
        metadata: json!({"account": IN_METADATA, "plain": "visible"})
            .as_object()
            .cloned()
            .unwrap_or_default(),
        concurrency: None,
        priority: None,
    }
}

/// Every message of every stream of the account, as stored (payload and headers).
async fn everything_stored(h: &Harness) -> Vec<(String, Vec<u8>)> {
    use futures::TryStreamExt;
    let names: Vec<String> =
        h.rt.js
            .stream_names()
            .try_collect()
            .await
            .expect("stream names");
    let mut out = Vec::new();
    for name in names {
        let mut stream = h.rt.js.get_stream(&name).await.expect("stream");
        let state = stream.info().await.expect("info").state.clone();
        if state.messages == 0 {
            continue;
        }
        for seq in state.first_sequence..=state.last_sequence {
            if let Ok(m) = stream.get_raw_message(seq).await {
                let mut bytes = m.payload.to_vec();
                bytes.extend_from_slice(format!("{:?}", m.headers).as_bytes());
                out.push((format!("{name}#{seq} {}", m.subject), bytes));
            }
        }
    }
    out
}

fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sensitive_values_are_sealed_everywhere_and_clear_where_used() {
    let h = Harness::start_with(script(), &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.seal_key = Some(Secret::new(KEY));
    })
    .await;
    store_agent(&h).await;
    let run = match h.submit_task(&task(), "sens-1").await {
        kedge_intake::Answer::Accepted { run_id } => run_id,
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    };
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);

    // Clear where used: the model read the input and, in its next context, its own call; the
    // tool wrote the content.
    let requests = h.mock.requests("sens");
    assert_eq!(requests.len(), 2);
    assert!(requests[0].to_string().contains(IN_INPUT));
    assert!(!requests[0].to_string().contains(seal::PREFIX));
    assert!(requests[1].to_string().contains(IN_ARGUMENT));
    let written =
        std::fs::read_to_string(h.config.workspace_root.join(run.as_str()).join("token.txt"))
            .expect("the tool wrote the file");
    assert_eq!(written, IN_ARGUMENT);

    // Sealed in the journal as every reader sees it (/history, SSE, kedge journal).
    let events = h.events(&run).await;
    let Event::RunCreated(created) = &events[0].envelope.event else {
        panic!("no run.created");
    };
    assert!(seal::is_sealed(&created.input), "{}", created.input);
    assert!(seal::is_sealed(
        created.metadata["account"].as_str().unwrap_or("")
    ));
    assert_eq!(created.metadata["plain"], "visible", "only what is marked");
    let requested = events
        .iter()
        .find_map(|r| match &r.envelope.event {
            Event::ToolRequested(t) => Some(t.clone()),
            _ => None,
        })
        .expect("tool requested");
    assert_eq!(requested.arguments["path"], "token.txt");
    assert!(seal::is_sealed(
        requested.arguments["content"].as_str().unwrap_or("")
    ));
    assert!(
        events
            .iter()
            .any(|r| r.envelope.event_type() == EventType::StepCompleted)
    );

    // Nowhere on the broker in clear.
    let stored = everything_stored(&h).await;
    assert!(stored.len() > 10, "{} messages", stored.len());
    for (what, bytes) in &stored {
        for secret in [IN_INPUT, IN_METADATA, IN_ARGUMENT] {
            assert!(!contains(bytes, secret), "{secret} in clear in {what}");
        }
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_seal_key_such_a_run_is_refused_and_nothing_is_kept() {
    let h = Harness::start(script(), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    store_agent(&h).await;
    match h.submit_task(&task(), "sens-2").await {
        kedge_intake::Answer::Rejected { error } => {
            assert_eq!(error.field, "agent");
            assert!(error.reason.contains("KEDGE_SEAL_KEY"), "{}", error.reason);
        }
        kedge_intake::Answer::Accepted { run_id } => panic!("accepted as {run_id}"),
    }
    assert_eq!(h.mock.total_calls(), 0);
    // The rejection record keeps no part of the task.
    for (what, bytes) in everything_stored(&h).await {
        for secret in [IN_INPUT, IN_METADATA, IN_ARGUMENT] {
            assert!(!contains(&bytes, secret), "{secret} in clear in {what}");
        }
    }
    h.shutdown().await;
}
