//! MCP tools through the whole runtime, against the real reference servers (installed by
//! `scripts/mcp-servers.sh`): an agent's `<server>__<tool>` calls reach the server with the
//! operation id in `_meta`, the model reads their results (errors included), and cancelling a
//! run mid-call sends the server `notifications/cancelled` for that very request.

mod common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{CancelRequested, Event};
use kedge_core::fold::OpStatus;
use kedge_mcp::ServerConfig;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn launcher(name: &str) -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../.tools/bin")
        .join(name);
    assert!(
        path.is_file(),
        "{} is missing: run `bash scripts/mcp-servers.sh` from the repo root",
        path.display()
    );
    path.canonicalize().expect("launcher path")
}

/// server-everything over stdio, with every byte Kedge sends it appended to `log` (`tee`).
fn everything_teed(log: &Path) -> ServerConfig {
    ServerConfig::Stdio {
        command: "sh".into(),
        args: vec![
            "-c".into(),
            r#"tee -a "$KEDGE_TEST_LOG" | exec "$KEDGE_TEST_LAUNCHER" stdio"#.into(),
        ],
        env: BTreeMap::from([
            ("KEDGE_TEST_LOG".into(), log.display().to_string()),
            (
                "KEDGE_TEST_LAUNCHER".into(),
                launcher("mcp-server-everything").display().to_string(),
            ),
        ]),
    }
}

/// The JSON-RPC messages Kedge sent to the teed server.
fn sent(log: &Path) -> Vec<Value> {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn tuned(log: &Path) -> impl FnOnce(&mut kedge_runtime::Config) {
    let everything = everything_teed(log);
    move |c| {
        c.mcp_servers.insert("everything".into(), everything);
        c.mcp_servers.insert(
            "time".into(),
            ServerConfig::stdio(
                launcher("mcp-server-time").display().to_string(),
                ["--local-timezone", "UTC"],
            ),
        );
        // Starting a Node server counts against the first call's timeout.
        c.timeouts.tool_timeout_ms = 30_000;
        c.timeouts.tool_grace_ms = 5_000;
        c.timeouts.tool_ack_wait_ms = 40_000;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mcp_tools_run_with_the_operation_id_and_the_model_reads_their_results() {
    let dir = tempfile::tempdir().expect("dir");
    let log = dir.path().join("sent.jsonl");
    let script = json!({"models": {"mc": {"steps": [
        {"text": "asking", "tool_calls": [
            {"name": "everything__echo", "arguments": {"message": "hello from kedge"}},
            {"name": "time__get_current_time", "arguments": {"timezone": "UTC"}},
            {"name": "everything__no-such-tool", "arguments": {}}
        ]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], tuned(&log)).await;
    h.agent_with_tools(
        "mc",
        "mc",
        &[
            "everything__echo",
            "time__get_current_time",
            "everything__no-such-tool",
        ],
    )
    .await;
    let run = h.submit("mc", "go", "mc-1").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let results: Vec<_> = done
        .ops
        .values()
        .map(|o| o.result.clone().expect("a result"))
        .collect();
    assert_eq!(results[0].content, "Echo: hello from kedge");
    assert!(!results[0].is_error);
    assert!(
        results[1].content.contains("UTC") && !results[1].is_error,
        "{:?}",
        results[1]
    );
    assert!(results[2].is_error, "unknown MCP tool: {:?}", results[2]);
    // The model read all three.
    let last = h.mock.requests("mc").pop().expect("request").to_string();
    assert!(last.contains("Echo: hello from kedge"), "{last}");
    // The server got the operation id.
    let echo_op = done.ops.keys().next().expect("op").to_string();
    assert!(
        sent(&log).iter().any(|m| m["method"] == "tools/call"
            && m["params"]["name"] == "echo"
            && m["params"]["_meta"]["kedge/operation_id"] == echo_op.as_str()),
        "tools/call for {echo_op} with its operation id"
    );
    common::assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancel_mid_mcp_call_sends_the_server_a_cancel_for_that_request() {
    let dir = tempfile::tempdir().expect("dir");
    let log = dir.path().join("sent.jsonl");
    let script = json!({"models": {"mx": {"steps": [
        {"text": "working", "tool_calls": [
            {"name": "everything__trigger-long-running-operation", "arguments": {"duration": 30, "steps": 30}}
        ]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], tuned(&log)).await;
    h.agent_with_tools("mx", "mx", &["everything__trigger-long-running-operation"])
        .await;
    let run = h.submit("mx", "go", "mx-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| {
            s.ops
                .values()
                .any(|o| matches!(o.status, OpStatus::Started { .. }))
        })
        .await;
    let op = state.ops.keys().next().expect("op").to_string();
    // Until the call is on the wire.
    let deadline = std::time::Instant::now() + WAIT;
    while !sent(&log).iter().any(|m| {
        m["method"] == "tools/call" && m["params"]["_meta"]["kedge/operation_id"] == op.as_str()
    }) {
        assert!(
            std::time::Instant::now() < deadline,
            "the call never went out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let asked = std::time::Instant::now();
    h.input(
        &run,
        Event::CancelRequested(CancelRequested {
            reason: "changed my mind".into(),
            by: Some("alice".into()),
        }),
        "cancel-mx",
    )
    .await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "cancelled in {:?}, not after the 30 s operation",
        asked.elapsed()
    );
    let result = done
        .ops
        .values()
        .next()
        .and_then(|o| o.result.clone())
        .expect("result");
    assert!(result.stopped && result.is_error, "{result:?}");
    let messages = sent(&log);
    let id = messages
        .iter()
        .find(|m| {
            m["method"] == "tools/call" && m["params"]["_meta"]["kedge/operation_id"] == op.as_str()
        })
        .map(|m| m["id"].clone())
        .expect("the call");
    assert!(
        messages
            .iter()
            .any(|m| m["method"] == "notifications/cancelled" && m["params"]["requestId"] == id),
        "notifications/cancelled for request {id}"
    );
    let Some(Event::RunCancelled(c)) = h
        .events(&run)
        .await
        .into_iter()
        .map(|r| r.envelope.event)
        .find(|e| matches!(e, Event::RunCancelled(_)))
    else {
        panic!("run.cancelled")
    };
    assert_eq!(c.operations.len(), 1);
    assert_eq!(c.operations[0].fate, kedge_core::event::OpFate::Stopped);
    h.shutdown().await;
}
