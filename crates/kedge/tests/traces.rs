//! One trace from submit to result: `kedge serve all` (and `kedge serve
//! bridge`) processes with `KEDGE_OTLP_ENDPOINT` export their spans over OTLP/HTTP (JSON) to a
//! collector stand-in in this test. A task submitted with a W3C `traceparent`, over NATS or to the
//! bridge, yields the intake, drive, step and tool spans of its run (and the bridge's submit span)
//! all in the submitter's trace, none of them a root; intake under the submitter's span, or under
//! the bridge's.

use crate::common;

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
    span_id: String,
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
                    span_id: s["spanId"].as_str().unwrap_or_default().to_lowercase(),
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

/// How the task reaches intake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Via {
    /// Published over NATS with the `traceparent` header.
    Nats,
    /// `POST /v1/runs` on a bridge process (also exporting) with the `traceparent` header.
    Bridge,
}

const BRIDGE_TOKEN: &str = "traces-write-token-0123456789";

/// Runs one task (a tool call, then an answer) with a `traceparent` through `via`, and returns
/// every span the collector got in the submitted trace, once the run's intake, drive, two step
/// and tool spans (and the bridge's submit span, through the bridge) are there.
async fn traced_run(via: Via, key: &str) -> Vec<Span> {
    // Step 1 calls a tool, step 2 answers: two step spans and one tool span.
    let script = json!({"models": {"m": {"steps": [
        {"text": "recording", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "one"}}]},
        {"text": "done"}
    ]}}});
    let mut h = Harness::start(script, &[]).await;
    h.agent("traced", "m").await;
    let (endpoint, spans) = collector().await;
    let export = [
        ("KEDGE_OTLP_ENDPOINT", endpoint),
        // The SDK's batch delay (5 s by default): spans reach the stand-in promptly.
        ("OTEL_BSP_SCHEDULE_DELAY", "100".into()),
    ];
    h.spawn_process_with_env("all", "w-traces", "", &export);
    let traceparent = format!("00-{TRACE_ID}-{PARENT_SPAN}-01");
    let run = match via {
        Via::Nats => {
            // A task published over NATS with the client's trace context in its header.
            let task = TaskSubmission::new("traced".parse().expect("agent name"), "go");
            let submission = kedge_app::tasks::Submission {
                task: &task,
                key,
                tenant: "acme",
                caller: Some("test"),
            };
            let answer = kedge_app::tasks::submit_traced(
                &h.rt.client,
                &kedge_core::subjects::task_for(&task.agent, &"acme".parse().expect("tenant")),
                serde_json::to_vec(&task).expect("json").into(),
                &submission,
                Some(&traceparent),
                Duration::from_secs(30),
            )
            .await
            .expect("intake answered");
            match answer {
                kedge_intake::Answer::Accepted { run_id } => run_id,
                kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
            }
        }
        Via::Bridge => {
            let listen = format!("127.0.0.1:{}", kedge_testkit::free_port());
            let mut env = export.to_vec();
            env.push(("KEDGE_BRIDGE_LISTEN", listen.clone()));
            env.push(("KEDGE_BRIDGE_TOKENS", format!("{BRIDGE_TOKEN}=acme")));
            h.spawn_process_with_env("bridge", "w-traces-bridge", "", &env);
            let http = reqwest::Client::new();
            let base = format!("http://{listen}");
            let t0 = Instant::now();
            while http.get(format!("{base}/readyz")).send().await.is_err() {
                assert!(
                    t0.elapsed() < Duration::from_secs(20),
                    "bridge never came up"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            let r = http
                .post(format!("{base}/v1/runs"))
                .bearer_auth(BRIDGE_TOKEN)
                .header("traceparent", &traceparent)
                .header("idempotency-key", key)
                .header("content-type", "application/json")
                .body(json!({"agent": "traced", "input": "go"}).to_string())
                .send()
                .await
                .expect("POST /v1/runs");
            assert_eq!(r.status().as_u16(), 202);
            let body: Value = r.json().await.expect("json");
            body["run_id"]
                .as_str()
                .expect("run_id")
                .parse()
                .expect("run id")
        }
    };
    let state = h.wait_terminal(&run, Duration::from_secs(30)).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    // The journal carries the context: run.created records it (the bridge's own span's context,
    // in the same trace, when it came through the bridge).
    let recorded = state
        .bundle
        .traceparent
        .clone()
        .expect("run.created has a traceparent");
    assert!(
        recorded.starts_with(&format!("00-{TRACE_ID}-")),
        "{recorded}"
    );

    // The run's spans arrive at the collector: intake's, two steps' and the tool's.
    let run_id = run.to_string();
    let deadline = Instant::now() + Duration::from_secs(20);
    let in_trace = loop {
        let in_trace: Vec<Span> = spans
            .lock()
            .expect("spans")
            .iter()
            .filter(|s| s.trace_id == TRACE_ID)
            .cloned()
            .collect();
        let count = |name: &str| {
            in_trace
                .iter()
                .filter(|s| s.name == name && s.run_id.as_deref() == Some(run_id.as_str()))
                .count()
        };
        let submitted = via == Via::Nats || in_trace.iter().any(|s| s.name == "submit");
        if submitted
            && count("intake") >= 1
            && count("drive") >= 1
            && count("step") >= 2
            && count("tool") >= 1
        {
            break in_trace;
        }
        let all = spans.lock().expect("spans").clone();
        assert!(
            Instant::now() < deadline,
            "the collector never got the run's submit, intake, step and tool spans in the \
             submitted trace; it got: {all:#?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    // None of the run's spans is a trace of its own.
    let run_spans = spans
        .lock()
        .expect("spans")
        .iter()
        .filter(|s| s.run_id.as_deref() == Some(run_id.as_str()))
        .cloned()
        .collect::<Vec<_>>();
    for s in &run_spans {
        assert_eq!(s.trace_id, TRACE_ID, "{s:?} is not in the submitted trace");
        assert!(!s.parent.is_empty(), "{s:?} is a root");
    }
    h.shutdown().await;
    in_trace
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_over_nats_puts_intake_each_step_and_each_tool_in_its_trace() {
    let spans = traced_run(Via::Nats, "task-traced-nats").await;
    // Intake's span is a child of the submitter's span itself.
    let intake = spans.iter().find(|s| s.name == "intake").expect("intake");
    assert_eq!(intake.parent, PARENT_SPAN);
    // The tool's span is under the step that requested it (the `traceparent` header of its
    // tool.requested), not only in the run's trace.
    let tool = spans.iter().find(|s| s.name == "tool").expect("tool");
    let mut at = tool;
    let mut chain = vec![at.name.clone()];
    while at.name != "step" {
        at = spans
            .iter()
            .find(|s| s.span_id == at.parent)
            .unwrap_or_else(|| panic!("the tool span's ancestry {chain:?} reaches no step"));
        chain.push(at.name.clone());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_submitted_to_the_bridge_is_one_trace_across_the_processes() {
    let spans = traced_run(Via::Bridge, "task-traced-bridge").await;
    // client span → the bridge's submit (another process) → intake → the run's steps and tools.
    let submit = spans.iter().find(|s| s.name == "submit").expect("submit");
    assert_eq!(submit.parent, PARENT_SPAN);
    let intake = spans.iter().find(|s| s.name == "intake").expect("intake");
    assert_eq!(
        intake.parent, submit.span_id,
        "intake is not under the bridge's submit"
    );
    let names: BTreeSet<&str> = spans.iter().map(|s| s.name.as_str()).collect();
    assert!(
        ["submit", "intake", "drive", "step", "tool"]
            .iter()
            .all(|n| names.contains(n)),
        "{names:?}"
    );
}
