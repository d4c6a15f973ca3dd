//! The workload: the bench agent, the mock model's script (K model calls each asking for one
//! `ledger_append`, then a final answer) and the services' configuration.

use std::path::Path;

use kedge_core::agent::AgentDefinition;
use kedge_runtime::Config;

use crate::{AGENT, API_KEY_VAR, K, MODEL};

pub fn agent_definition(base_url: &str) -> AgentDefinition {
    let tool = |n: &str| {
        serde_json::json!({"name": n, "description": n,
                           "parameters": {"type": "object", "properties": {}}})
    };
    let tools: Vec<serde_json::Value> = [
        "read_file",
        "write_file",
        "list_files",
        "shell",
        "ask_user",
        "ledger_append",
    ]
    .iter()
    .map(|n| tool(n))
    .collect();
    let v = serde_json::json!({
        "name": AGENT,
        "system_prompt": "bench agent",
        "model": {"provider": "openai", "name": MODEL, "base_url": format!("{base_url}/v1")},
        "api_key_env": API_KEY_VAR,
        "tools": tools,
        "budget": {"max_steps": 25, "max_tokens": 10000000, "max_attempts_per_step": 3}
    });
    AgentDefinition::parse(v.to_string().as_bytes()).expect("valid bench agent")
}

pub fn script() -> serde_json::Value {
    let mut steps: Vec<serde_json::Value> = (1..=K)
        .map(|i| {
            serde_json::json!({"text": format!("step {i}"), "tool_calls": [
                {"name": "ledger_append", "arguments": {"text": format!("{i}")}}]})
        })
        .collect();
    steps.push(serde_json::json!({"text": "done"}));
    serde_json::json!({"models": {MODEL: {"steps": steps}}})
}
/// Like the test harness's `fast_config` (short timeouts), concurrency at the defaults.
pub fn bench_config(nats_url: &str, workspace: &Path, worker: &str) -> Config {
    let mut config = Config {
        nats_urls: vec![nats_url.to_owned()],
        workspace_root: workspace.to_owned(),
        worker_id: worker.parse().expect("worker id"),
        ..Config::default()
    };
    config
        .api_keys
        .insert(API_KEY_VAR.into(), "bench-key".into());
    config.ledger_tool = true;
    let t = &mut config.timeouts;
    t.lease_ttl_ms = 2_000;
    t.lease_renew_ms = 500;
    t.step_ack_wait_ms = 3_000;
    t.model_timeout_ms = 10_000;
    t.tool_timeout_ms = 1_000;
    t.tool_grace_ms = 500;
    t.tool_ack_wait_ms = 2_000;
    t.stall_after_ms = 10_000;
    t.max_retry_delay_ms = 500;
    config.check().expect("valid bench config");
    config
}
