//! The agent definition is the tool contract, end to end: a model that calls
//! a tool its agent does not declare, or a declared one with arguments its schema refuses, gets
//! a readable error result for that call and nothing runs; a task whose numbers are out of range
//! is rejected naming the field (item 4).

use crate::common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::Event;
use kedge_core::task::{BudgetOverride, TaskSubmission};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

/// An agent that lists the built-ins `shell` and `read_file` by name: Kedge supplies their
/// schemas.
async fn store_agent(h: &Harness, name: &str, model: &str) {
    let def = json!({
        "name": name,
        "system_prompt": "contract test",
        "model": {"provider": "openai", "name": model, "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": ["shell", "read_file"],
        "budget": {"max_steps": 5, "max_tokens": 1000000, "max_attempts_per_step": 3}
    });
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn undeclared_tools_and_invalid_arguments_get_error_results_and_nothing_runs() {
    let script = json!({"models": {"mc": {"steps": [
        {"text": "trying", "tool_calls": [
            call("write_file", json!({"path": "pwned.txt", "content": "gotcha"})),
            call("read_file", json!({"path": 42})),
            call("shell", json!({"command": "echo", "args": ["fine"]}))]},
        {"text": "sorry, giving up on that"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    store_agent(&h, "contract", "mc").await;
    let run = h.submit("contract", "go", "task-contract").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("sorry, giving up on that"));

    // Nothing ran but the declared call with valid arguments.
    let written = h.config.workspace_root.join(run.as_str()).join("pwned.txt");
    assert!(
        !written.exists(),
        "an undeclared write_file ran: {written:?}"
    );
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let requested: Vec<String> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolRequested(t) => Some(t.tool.clone()),
            _ => None,
        })
        .collect();
    assert_eq!(requested, ["shell"], "only the valid call was dispatched");
    assert!(
        !events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::ApprovalRequested(_))),
        "an undeclared tool is not held for approval either: it is refused"
    );

    // The model read an error result for each refused call (the strict mock rejects an
    // unanswered call) and the real result of the valid one.
    let requests = h.mock.requests("mc");
    assert_eq!(requests.len(), 2);
    let tool_msgs: Vec<&serde_json::Value> = requests[1]["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .collect();
    assert_eq!(tool_msgs.len(), 3, "{tool_msgs:#?}");
    let text = |m: &serde_json::Value| m["content"].as_str().unwrap_or_default().to_owned();
    let all: Vec<String> = tool_msgs.iter().map(|m| text(m)).collect();
    assert!(
        all.iter()
            .any(|t| t.contains("tool not offered") && t.contains("write_file")),
        "{all:#?}"
    );
    assert!(
        all.iter()
            .any(|t| t.contains("invalid arguments for `read_file`") && t.contains("at /path")),
        "{all:#?}"
    );
    assert!(all.iter().any(|t| t.contains("fine")), "{all:#?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_with_an_absurd_deadline_is_rejected_naming_the_field() {
    let script = json!({"models": {"md": {"steps": [{"text": "hi"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    store_agent(&h, "deadline", "md").await;
    let task = TaskSubmission {
        agent: "deadline".parse().expect("valid"),
        input: "go".into(),
        run_id: None,
        budget: Some(BudgetOverride {
            deadline_secs: Some(u64::MAX),
            ..Default::default()
        }),
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    match h.submit_task(&task, "task-deadline").await {
        kedge_intake::Answer::Rejected { error } => {
            assert_eq!(error.field, "budget.deadline_secs", "{error}")
        }
        other => panic!("accepted: {other:?}"),
    }
    // The step worker is alive and well: a sane deadline runs.
    let task = TaskSubmission {
        budget: Some(BudgetOverride {
            deadline_secs: Some(3600),
            ..Default::default()
        }),
        ..task
    };
    let run = match h.submit_task(&task, "task-deadline-ok").await {
        kedge_intake::Answer::Accepted { run_id } => run_id,
        other => panic!("rejected: {other:?}"),
    };
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    h.shutdown().await;
}
