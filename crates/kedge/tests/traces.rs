//! One trace from submit to result (issue 14, item 3): a `kedge serve all` process with
//! `KEDGE_OTLP_ENDPOINT` exports its spans over OTLP/HTTP (JSON) to a collector stand-in in this
//! test, and a task submitted with a W3C `traceparent` header yields the intake, step and tool
//! spans of its run, all in the submitter's trace (each parented within it, none a root).

mod common;

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::Harness;
use kedge_core::RunStatus;
use kedge_core::task::TaskSubmission;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpListener;

const TRACE_ID: &str = "4bf92f3577b34da6a3ce929d0e0e4736";
const PARENT_SPAN: &str = "00f067aa0ba902b7";

/// A span as the collector stand-in received it.
#[derive(Debug, Clone)]
struct Span {
    name: String,
    trace_id: String,
    parent: String,
    run_id: Option<String>,
}

/// The collector stand-in: accepts `POST /v1/traces` with OTLP/JSON bodies (HTTP/1.1,
/// keep-alive) and keeps every span.
async fn collector() -> (String, Arc<Mutex<Vec<Span>>>) {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    let spans = Arc::new(Mutex::new(Vec::new()));
    let kept = spans.clone();
    tokio::spawn(async move {
        while let Ok((conn, _)) = listener.accept().await {
            let kept = kept.clone();
            tokio::spawn(async move {
                let (read, mut write) = conn.into_split();
                let mut read = BufReader::new(read);
                loop {
                    let mut request_line = String::new();
                    if read.read_line(&mut request_line).await.unwrap_or(0) == 0 {
                        return;
                    }
                    let mut length = 0usize;
                    loop {
                        let mut line = String::new();
                        if read.read_line(&mut line).await.unwrap_or(0) == 0 {
                            return;
                        }
                        let line = line.trim_end();
                        if line.is_empty() {
                            break;
                        }
                        if let Some((k, v)) = line.split_once(':')
                            && k.eq_ignore_ascii_case("content-length")
                        {
                            length = v.trim().parse().unwrap_or(0);
                        }
                    }
                    let mut body = vec![0; length];
                    if read.read_exact(&mut body).await.is_err() {
                        return;
                    }
                    let status = if request_line.starts_with("POST /v1/traces ") {
                        match serde_json::from_slice::<Value>(&body) {
                            Ok(v) => {
                                kept.lock().expect("spans").extend(spans_of(&v));
                                "200 OK"
                            }
                            Err(_) => "400 Bad Request",
                        }
                    } else {
                        "404 Not Found"
                    };
                    let answer = format!(
                        "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{{}}"
                    );
                    if write.write_all(answer.as_bytes()).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    (url, spans)
}

/// The spans of an OTLP/JSON `ExportTraceServiceRequest`.
fn spans_of(request: &Value) -> Vec<Span> {
    let mut out = Vec::new();
    let list = |v: &Value, k: &str| v[k].as_array().cloned().unwrap_or_default();
    for rs in list(request, "resourceSpans") {
        for ss in list(&rs, "scopeSpans") {
            for s in list(&ss, "spans") {
                let run_id = list(&s, "attributes")
                    .iter()
                    .find(|a| a["key"] == "run_id")
                    .and_then(|a| a["value"]["stringValue"].as_str().map(str::to_owned));
                out.push(Span {
                    name: s["name"].as_str().unwrap_or_default().to_owned(),
                    trace_id: s["traceId"].as_str().unwrap_or_default().to_lowercase(),
                    parent: s["parentSpanId"]
                        .as_str()
                        .unwrap_or_default()
                        .to_lowercase(),
                    run_id,
                });
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_trace_shows_intake_each_step_and_each_tool_of_a_run() {
    // Step 1 calls a tool, step 2 answers: two step spans and one tool span.
    let script = json!({"models": {"m": {"steps": [
        {"text": "recording", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "one"}}]},
        {"text": "done"}
    ]}}});
    let mut h = Harness::start(script, &[]).await;
    h.agent("traced", "m").await;
    let (endpoint, spans) = collector().await;
    h.spawn_process_with_env(
        "all",
        "w-traces",
        "",
        &[
            ("KEDGE_OTLP_ENDPOINT", endpoint),
            // The SDK's batch delay (5 s by default): spans reach the stand-in promptly.
            ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
        ],
    );

    // A task published over NATS with the client's trace context in its `traceparent` header.
    let task = TaskSubmission {
        agent: "traced".parse().expect("agent name"),
        input: "go".into(),
        run_id: None,
        budget: None,
        metadata: Default::default(),
    };
    let submission = kedge_runtime::tasks::Submission {
        task: &task,
        key: "task-traced",
        tenant: "acme",
        caller: Some("test"),
    };
    let traceparent = format!("00-{TRACE_ID}-{PARENT_SPAN}-01");
    let answer = kedge_runtime::tasks::submit_traced(
        &h.rt.client,
        &kedge_core::subjects::task_for(&task.agent, &"acme".parse().expect("tenant")),
        serde_json::to_vec(&task).expect("json").into(),
        &submission,
        Some(&traceparent),
        Duration::from_secs(30),
    )
    .await
    .expect("intake answered");
    let run = match answer {
        kedge_intake::Answer::Accepted { run_id } => run_id,
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    };
    let state = h.wait_terminal(&run, Duration::from_secs(30)).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    // The journal carries the context: run.created records it.
    assert_eq!(
        state.bundle.traceparent.as_deref(),
        Some(traceparent.as_str())
    );

    // The run's spans arrive at the collector: intake's, two steps' and the tool's.
    let run_id = run.to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let of_run = loop {
        let of_run: Vec<Span> = spans
            .lock()
            .expect("spans")
            .iter()
            .filter(|s| s.run_id.as_deref() == Some(run_id.as_str()))
            .cloned()
            .collect();
        let count = |name: &str| of_run.iter().filter(|s| s.name == name).count();
        if count("intake") >= 1 && count("step") >= 2 && count("tool") >= 1 {
            break of_run;
        }
        assert!(
            Instant::now() < deadline,
            "the collector never got the run's intake, step and tool spans: {of_run:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    h.shutdown().await;

    // Every one of them is in the submitter's trace, and none is a root of its own.
    for s in &of_run {
        assert_eq!(s.trace_id, TRACE_ID, "{s:?} is not in the submitted trace");
        assert!(!s.parent.is_empty(), "{s:?} is a root");
    }
    // intake's span is a child of the submitter's span itself.
    let intake = of_run.iter().find(|s| s.name == "intake").expect("intake");
    assert_eq!(intake.parent, PARENT_SPAN);
    let names: BTreeSet<&str> = of_run.iter().map(|s| s.name.as_str()).collect();
    assert!(
        ["intake", "drive", "step", "tool"]
            .iter()
            .all(|n| names.contains(n)),
        "{names:?}"
    );
}
