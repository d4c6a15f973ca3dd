//! The pool against the real reference servers over stdio: `@modelcontextprotocol/server-everything`
//! (Node) and `mcp-server-time` (Python), installed by `scripts/mcp-servers.sh`.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use common::{PATIENT, Recorder, echo_args, kill, launcher, never, obj};
use kedge_mcp::{McpError, Outcome, Pool, ServerConfig};
use serde_json::json;

/// The long-running tool of server-everything 2026.x (formerly `longRunningOperation`).
const LONG_RUNNING: &str = "trigger-long-running-operation";

fn pool_of(name: &str, config: ServerConfig) -> Pool {
    Pool::new(BTreeMap::from([(name.to_owned(), config)]))
}

fn completed(outcome: Outcome) -> (String, bool) {
    match outcome {
        Outcome::Completed { content, is_error } => (content, is_error),
        other => panic!("expected Completed, got {other:?}"),
    }
}

#[tokio::test]
async fn everything_lists_tools_and_echoes() {
    let pool = pool_of(
        "everything",
        ServerConfig::stdio(
            launcher("mcp-server-everything").display().to_string(),
            ["stdio"],
        ),
    );

    // server-everything sends notifications/tools/list_changed before this answer.
    let tools = pool.tools("everything").await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    for expected in ["echo", "get-sum", LONG_RUNNING] {
        assert!(names.contains(&expected), "{expected} not in {names:?}");
    }
    let echo = tools.iter().find(|t| t.name == "echo").unwrap();
    assert_eq!(echo.input_schema["properties"]["message"]["type"], "string");
    assert!(echo.description.as_deref().is_some_and(|d| !d.is_empty()));

    let outcome = pool
        .call(
            "everything",
            "echo",
            echo_args("hello kedge"),
            "op-echo",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(completed(outcome), ("Echo: hello kedge".to_owned(), false));

    let sum = pool
        .call(
            "everything",
            "get-sum",
            obj(json!({"a": 2, "b": 3})),
            "op-sum",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    let (text, is_error) = completed(sum);
    assert!(!is_error && text.contains('5'), "{text}");

    // Node servers answer an unknown tool with a normal result flagged isError.
    let unknown = pool
        .call(
            "everything",
            "no-such-tool",
            obj(json!({})),
            "op-unknown",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    let (text, is_error) = completed(unknown);
    assert!(is_error, "{text}");
    assert!(text.contains("no-such-tool"), "{text}");

    pool.close().await;
}

#[tokio::test]
async fn everything_non_text_content_is_described() {
    let pool = pool_of(
        "everything",
        ServerConfig::stdio(
            launcher("mcp-server-everything").display().to_string(),
            ["stdio"],
        ),
    );
    let outcome = pool
        .call(
            "everything",
            "get-tiny-image",
            obj(json!({})),
            "op-image",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    let (text, is_error) = completed(outcome);
    assert!(!is_error, "{text}");
    assert!(
        text.contains(r#""type":"image""#) && text.contains(r#""mimeType":"image/png""#),
        "{text}"
    );
    assert!(text.contains(r#""bytes":"#), "{text}");
    pool.close().await;
}

#[tokio::test]
async fn time_server_answers_and_maps_json_rpc_errors() {
    let pool = pool_of(
        "time",
        ServerConfig::stdio(
            launcher("mcp-server-time").display().to_string(),
            ["--local-timezone", "UTC"],
        ),
    );

    let tools = pool.tools("time").await.unwrap();
    let names: Vec<&str> = tools.iter().map(|t| t.name.as_str()).collect();
    assert!(
        names.contains(&"get_current_time") && names.contains(&"convert_time"),
        "{names:?}"
    );

    let outcome = pool
        .call(
            "time",
            "get_current_time",
            obj(json!({"timezone": "UTC"})),
            "op-time",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    let (text, is_error) = completed(outcome);
    assert!(!is_error, "{text}");
    assert!(text.contains("\"timezone\": \"UTC\""), "{text}");

    // Python servers answer an unknown tool with JSON-RPC error -32602: the model is told.
    let unknown = pool
        .call(
            "time",
            "no_such_tool",
            obj(json!({})),
            "op-unknown",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    let (text, is_error) = completed(unknown);
    assert!(is_error, "{text}");
    assert!(text.starts_with("MCP error -32602: "), "{text}");

    pool.close().await;
}

#[tokio::test]
async fn stop_sends_cancel_for_the_right_request() {
    let recorder = Recorder::new();
    let pool = pool_of("everything", recorder.everything_teed());
    // Connect first, so that the stop lands while the tool runs (not while the server starts).
    pool.tools("everything").await.unwrap();

    let started = Instant::now();
    let outcome = pool
        .call(
            "everything",
            LONG_RUNNING,
            obj(json!({"duration": 15, "steps": 15})),
            "op-stop-me",
            PATIENT,
            tokio::time::sleep(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Stopped);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );

    let cancel = recorder.wait_for_cancel_of("op-stop-me").await;
    assert!(
        cancel["reason"].as_str().is_some_and(|r| !r.is_empty()),
        "{cancel}"
    );

    // The session is still good.
    let outcome = pool
        .call(
            "everything",
            "echo",
            echo_args("after stop"),
            "op-after",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(completed(outcome).0, "Echo: after stop");
    assert_eq!(recorder.with_method("initialize").len(), 1);

    pool.close().await;
}

#[tokio::test]
async fn timeout_sends_cancel() {
    let recorder = Recorder::new();
    let pool = pool_of("everything", recorder.everything_teed());
    // Connect first, so the 300 ms are the call's alone.
    pool.tools("everything").await.unwrap();

    let started = Instant::now();
    let outcome = pool
        .call(
            "everything",
            LONG_RUNNING,
            obj(json!({"duration": 15, "steps": 15})),
            "op-too-slow",
            Duration::from_millis(300),
            never(),
        )
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::TimedOut);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );
    recorder.wait_for_cancel_of("op-too-slow").await;

    let outcome = pool
        .call(
            "everything",
            "echo",
            echo_args("still here"),
            "op-after",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(completed(outcome).0, "Echo: still here");
    pool.close().await;
}

#[tokio::test]
async fn concurrent_calls_share_one_session() {
    let recorder = Recorder::new();
    let pool = pool_of("everything", recorder.everything_teed());

    // All 20 are first calls: they must wait for one connect, not start 20 children.
    let calls = (0..20).map(|i| {
        let pool = pool.clone();
        async move {
            let outcome = pool
                .call(
                    "everything",
                    "echo",
                    echo_args(&format!("m{i}")),
                    &format!("op-{i}"),
                    PATIENT,
                    never(),
                )
                .await
                .unwrap();
            (i, outcome)
        }
    });
    let outcomes = futures::future::join_all(calls).await;
    for (i, outcome) in outcomes {
        assert_eq!(completed(outcome), (format!("Echo: m{i}"), false));
    }

    assert_eq!(
        recorder.with_method("initialize").len(),
        1,
        "exactly one handshake"
    );
    assert_eq!(recorder.pids().len(), 1, "exactly one server process");
    let mut ids: Vec<String> = recorder
        .with_method("tools/call")
        .iter()
        .map(|m| m["id"].to_string())
        .collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 20, "20 distinct request ids on one session");

    pool.close().await;
}

#[tokio::test]
async fn reconnects_after_the_child_dies() {
    let recorder = Recorder::new();
    let pool = pool_of("everything", recorder.everything_direct());

    let first = pool
        .call(
            "everything",
            "echo",
            echo_args("one"),
            "op-1",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(completed(first).0, "Echo: one");
    let pids = recorder.pids();
    assert_eq!(pids.len(), 1);
    kill(pids[0]);

    // Either the pool already noticed (and reconnects), or this call finds out.
    match pool
        .call(
            "everything",
            "echo",
            echo_args("two"),
            "op-2",
            PATIENT,
            never(),
        )
        .await
    {
        Ok(outcome) => assert_eq!(completed(outcome).0, "Echo: two"),
        Err(McpError::Disconnected { .. }) => {}
        Err(other) => panic!("expected success or Disconnected, got {other:?}"),
    }
    let third = pool
        .call(
            "everything",
            "echo",
            echo_args("three"),
            "op-3",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(completed(third).0, "Echo: three");
    assert_eq!(recorder.pids().len(), 2, "one new server process");
    pool.close().await;
}

#[tokio::test]
async fn child_dying_mid_call_is_disconnected_and_ambiguous() {
    let recorder = Recorder::new();
    let pool = pool_of("everything", recorder.everything_direct());
    pool.tools("everything").await.unwrap();
    let pid = recorder.pids()[0];

    let call = pool.call(
        "everything",
        LONG_RUNNING,
        obj(json!({"duration": 15, "steps": 15})),
        "op-lost",
        PATIENT,
        never(),
    );
    let killer = async {
        tokio::time::sleep(Duration::from_millis(400)).await;
        kill(pid);
    };
    let started = Instant::now();
    let (result, ()) = tokio::join!(call, killer);
    match result {
        Err(error @ McpError::Disconnected { .. }) => assert!(error.may_have_run()),
        other => panic!("expected Disconnected, got {other:?}"),
    }
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "took {:?}",
        started.elapsed()
    );

    let outcome = pool
        .call(
            "everything",
            "echo",
            echo_args("back"),
            "op-back",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(completed(outcome).0, "Echo: back");
    pool.close().await;
}

#[tokio::test]
async fn close_ends_the_child() {
    let recorder = Recorder::new();
    let pool = pool_of("everything", recorder.everything_direct());
    pool.tools("everything").await.unwrap();
    let pid = recorder.pids()[0];
    pool.close().await;
    let proc_dir = std::path::PathBuf::from(format!("/proc/{pid}"));
    assert!(
        !proc_dir.exists(),
        "server process {pid} still there after close"
    );
}

#[tokio::test]
async fn unknown_server_and_failed_start() {
    let pool = Pool::new(BTreeMap::from([
        (
            "missing".to_owned(),
            ServerConfig::stdio("/nonexistent/kedge-mcp-test-server", Vec::<String>::new()),
        ),
        (
            "crashes".to_owned(),
            ServerConfig::stdio("sh", ["-c", "echo boom-on-stderr >&2; exit 3"]),
        ),
    ]));
    assert!(pool.has_server("crashes") && !pool.has_server("nope"));

    let error = pool
        .call("nope", "x", obj(json!({})), "op", PATIENT, never())
        .await
        .unwrap_err();
    assert_eq!(error, McpError::UnknownServer("nope".into()));
    assert!(!error.may_have_run());

    let error = pool.tools("missing").await.unwrap_err();
    assert!(
        matches!(&error, McpError::Connect { reason, .. } if reason.contains("cannot start")),
        "{error}"
    );

    let error = pool
        .call("crashes", "x", obj(json!({})), "op", PATIENT, never())
        .await
        .unwrap_err();
    match &error {
        McpError::Connect { server, reason } => {
            assert_eq!(server, "crashes");
            assert!(reason.contains("boom-on-stderr"), "{reason}");
        }
        other => panic!("expected Connect, got {other:?}"),
    }
    assert!(!error.may_have_run());
}

#[tokio::test]
async fn a_stdio_server_sees_path_and_its_own_env_and_nothing_else_of_ours() {
    let pool = pool_of(
        "everything",
        ServerConfig::Stdio {
            command: launcher("mcp-server-everything").display().to_string(),
            args: vec!["stdio".into()],
            env: BTreeMap::from([("SERVER_ONLY".to_owned(), "given".to_owned())]),
            sandbox: None,
        },
    );
    let outcome = pool
        .call(
            "everything",
            "get-env",
            obj(json!({})),
            "op-env",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    let (text, is_error) = completed(outcome);
    assert!(!is_error, "{text}");
    let env: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(env["SERVER_ONLY"], "given", "{env}");
    assert!(env.get("PATH").is_some(), "{env}");
    // Cargo sets these for every test process: the server must not inherit them.
    for ours in ["CARGO_PKG_NAME", "CARGO_MANIFEST_DIR"] {
        assert!(
            std::env::var_os(ours).is_some(),
            "{ours} is set in the test process"
        );
        assert!(env.get(ours).is_none(), "{ours} leaked: {env}");
    }
    pool.close().await;
}
