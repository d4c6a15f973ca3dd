//! Model settings and cost, through the services: an agent's
//! `model.settings` reach the wire in the provider's form (the strict mock checks each one and
//! records the bodies), Anthropic thinking blocks go back unchanged in the next request, a run
//! keeps the settings it started with when the agent is edited, and `budget.max_cost` stops a
//! run at its model's price.

use crate::common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, FailureReason, ThinkingBlock, UserMessage};
use kedge_core::task::{BudgetOverride, TaskSubmission};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

async fn store(h: &Harness, def: Value) {
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

fn thinker(h: &Harness, stop: &str) -> Value {
    json!({
        "name": "thinker",
        "system_prompt": "You think before you act.",
        "model": {
            "provider": "anthropic", "name": "claude-mock",
            "base_url": h.mock.base_url(),
            "settings": {
                "thinking": {"budget_tokens": 1024}, "cache": true, "stop": [stop],
                "tool_choice": "auto", "parallel_tool_calls": false
            }
        },
        "api_key_env": API_KEY_VAR,
        "tools": ["read_file", "list_files"],
        "max_output_tokens": 2048
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn settings_reach_the_wire_thinking_goes_back_unchanged_and_a_run_keeps_its_settings() {
    let script = json!({"models": {"claude-mock": {
        "rules": [{"when_last_user_contains": "again", "respond": {"text": "Again: done."}}],
        "steps": [
            {"tool_calls": [{"name": "list_files", "arguments": {}}]},
            {"text": "Done."}
        ]
    }}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    store(&h, thinker(&h, "STOP-1")).await;
    let run = h
        .submit("thinker", "What is in the workspace?", "task-think")
        .await;
    let state = h.wait_terminal(&run, WAIT).await;
    // The strict mock refuses a request that breaks a rule (a settings error, a thinking block
    // not sent back): the run would have failed.
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("Done."));

    let bodies = h.mock.requests("claude-mock");
    assert_eq!(bodies.len(), 2, "{bodies:#?}");
    let ephemeral = json!({"type": "ephemeral"});
    for b in &bodies {
        assert_eq!(
            b["thinking"],
            json!({"type": "enabled", "budget_tokens": 1024})
        );
        assert_eq!(b["max_tokens"], 2048);
        assert_eq!(b["stop_sequences"], json!(["STOP-1"]));
        assert_eq!(
            b["tool_choice"],
            json!({"type": "auto", "disable_parallel_tool_use": true})
        );
        assert_eq!(b["system"][0]["cache_control"], ephemeral);
        assert_eq!(b["tools"][1]["cache_control"], ephemeral, "the last tool");
        let last = b["messages"]
            .as_array()
            .and_then(|m| m.last())
            .expect("a message");
        let last_block = last["content"]
            .as_array()
            .and_then(|c| c.last())
            .expect("a block");
        assert_eq!(
            last_block["cache_control"], ephemeral,
            "the conversation so far"
        );
    }
    // The first answer's thinking block is journaled with its signature...
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let thinking = events
        .iter()
        .find_map(|r| match &r.envelope.event {
            Event::StepCompleted(done) if !done.message.tool_calls.is_empty() => {
                Some(done.message.thinking.clone())
            }
            _ => None,
        })
        .expect("the tool-calling step");
    let [
        ThinkingBlock::Thinking {
            thinking: text,
            signature,
        },
    ] = thinking.as_slice()
    else {
        panic!("one thinking block: {thinking:?}")
    };
    // ... and goes back first in that assistant turn, unchanged.
    let turn = &bodies[1]["messages"][1];
    assert_eq!(turn["role"], "assistant");
    assert_eq!(
        turn["content"][0],
        json!({"type": "thinking", "thinking": text, "signature": signature})
    );
    assert_eq!(turn["content"][1]["type"], "tool_use");

    // A later edit of the agent does not change the run: a new turn of it still sends the
    // settings it was created with, while a new run gets the new ones.
    store(&h, thinker(&h, "STOP-2")).await;
    h.input(
        &run,
        Event::UserMessage(UserMessage {
            text: "Once again, please.".into(),
        }),
        "msg-again",
    )
    .await;
    let state = h
        .wait_for(&run, WAIT, |s| s.turn == 2 && s.status.is_terminal())
        .await;
    assert_eq!(
        state.output.as_deref(),
        Some("Again: done."),
        "{:?}",
        state.failure
    );
    let run2 = h.submit("thinker", "And now, again?", "task-think-2").await;
    let state2 = h.wait_terminal(&run2, WAIT).await;
    assert_eq!(state2.status, RunStatus::Succeeded, "{:?}", state2.failure);
    let bodies = h.mock.requests("claude-mock");
    assert_eq!(bodies.len(), 4, "{bodies:#?}");
    assert_eq!(
        bodies[2]["stop_sequences"],
        json!(["STOP-1"]),
        "frozen in run.created"
    );
    assert_eq!(
        bodies[3]["stop_sequences"],
        json!(["STOP-2"]),
        "the new revision"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn max_cost_stops_a_run_at_its_models_price() {
    // A model that never stops calling tools: only a budget ends the run.
    let script = json!({"models": {"gpt-mock": {
        "default": {"tool_calls": [{"name": "list_files", "arguments": {}}]}
    }}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    let priced = |name: &str, max_cost: Option<f64>| {
        let mut def = json!({
            "name": name,
            "system_prompt": "Keep looking.",
            "model": {
                "provider": "openai", "name": "gpt-mock",
                "base_url": format!("{}/v1", h.mock.base_url()),
                "settings": {"temperature": 0.2, "seed": 7, "tool_choice": "required"},
                // 0.001 EUR a token: the mock's usage is a few dozen tokens a step.
                "price": {"input_per_mtok": 1000, "output_per_mtok": 1000, "currency": "EUR"}
            },
            "api_key_env": API_KEY_VAR,
            "tools": ["list_files"],
            "budget": {"max_steps": 30, "max_tokens": 1000000, "max_attempts_per_step": 2}
        });
        if let Some(c) = max_cost {
            def["budget"]["max_cost"] = c.into();
        }
        def
    };
    store(&h, priced("spender", Some(0.2))).await;
    let run = h.submit("spender", "Find it.", "task-spend").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.clone().expect("failed");
    assert_eq!(failure.reason, FailureReason::MaxCost, "{failure:?}");
    assert!(failure.message.contains("EUR"), "{}", failure.message);

    // Each step recorded what it cost at the frozen price; the run stopped at the first step
    // that reached the limit, well before max_steps.
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let costs: Vec<f64> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::StepCompleted(done) => {
                let u = done.usage;
                let expected = (u.input_tokens + u.output_tokens) as f64 * 0.001;
                let cost = u.cost.expect("priced");
                assert!((cost - expected).abs() < 1e-9, "{u:?}");
                Some(cost)
            }
            _ => None,
        })
        .collect();
    let total: f64 = costs.iter().sum();
    assert!(costs.len() >= 2 && costs.len() < 30, "{costs:?}");
    assert!(
        total >= 0.2 && total - costs[costs.len() - 1] < 0.2,
        "{costs:?}"
    );
    assert!((state.usage.cost.expect("summed") - total).abs() < 1e-9);

    // The settings went out in OpenAI's form; the forced tool choice only after the user's
    // message.
    let bodies = h.mock.requests("gpt-mock");
    assert_eq!(bodies.len(), costs.len());
    assert_eq!(bodies[0]["temperature"], 0.2);
    assert_eq!(bodies[0]["seed"], 7);
    assert_eq!(bodies[0]["tool_choice"], "required");
    assert_eq!(bodies[1]["tool_choice"], "auto");

    // A task may tighten the limit; it cannot set one for an agent with no price.
    store(&h, priced("priced-no-limit", None)).await;
    let mut unpriced = priced("unpriced", None);
    unpriced["model"]
        .as_object_mut()
        .expect("model")
        .remove("price");
    store(&h, unpriced).await;
    let task = |agent: &str, max_cost: f64| TaskSubmission {
        agent: agent.parse().expect("agent"),
        input: "Find it.".into(),
        run_id: None,
        budget: Some(BudgetOverride {
            max_cost: Some(max_cost),
            ..Default::default()
        }),
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    match h.submit_task(&task("unpriced", 1.0), "task-unpriced").await {
        kedge_intake::Answer::Rejected { error } => {
            assert_eq!(error.field, "budget.max_cost", "{error}")
        }
        other => panic!("accepted: {other:?}"),
    }
    let run = match h
        .submit_task(&task("priced-no-limit", 0.05), "task-tight")
        .await
    {
        kedge_intake::Answer::Accepted { run_id } => run_id,
        other => panic!("rejected: {other:?}"),
    };
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(
        state.failure.map(|f| f.reason),
        Some(FailureReason::MaxCost)
    );
    assert_eq!(state.bundle.budget.max_cost, Some(0.05));
    h.shutdown().await;
}
