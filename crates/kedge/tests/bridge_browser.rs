//! A real browser watches a run over SSE while the bridge is restarted under it.
//!
//! Headless Chromium (Debian's `chromium`, driven by playwright-core; `scripts/browser-test.sh
//! --install-only` installs both, and is fast when they are there) opens a page on the bridge's
//! origin with a plain `EventSource` on a run. Mid-run the test stops the bridge and starts a new
//! one on the same port; the browser reconnects by itself with `Last-Event-ID`. When the run is
//! over the bridge answers the last reconnect with 204, EventSource closes, and the ids the page
//! collected must equal `/history`'s: every public event, once, in order.

use crate::bridge_support;
use crate::common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bridge_support::{ACME, Api, TestBridge, bridge_config};
use common::{Harness, Svc};
use kedge_core::EventType;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, BufReader};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// A question first (the run waits there until the page is watching: a browser can take longer
/// to start than the rest of the run takes), then five steps with a tool call each, streamed in
/// chunks, then a final answer: a few seconds.
fn script(model: &str) -> Value {
    let step = |i: usize| {
        json!({"text": format!("step {i}: reading the charts"), "delay_ms": 300, "chunk_delay_ms": 20,
               "tool_calls": [{"name": "write_file", "arguments": {"path": format!("c{i}.txt"), "content": "x"}}]})
    };
    let mut steps = vec![json!({"text": "ready?", "tool_calls": [
        {"name": "ask_user", "arguments": {"question": "Shall I read the charts?"}}
    ]})];
    steps.extend((1..=5).map(step));
    steps.push(json!({"text": "charts read", "chunk_delay_ms": 20}));
    json!({"models": {model: {"steps": steps}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_browser_eventsource_resumes_across_a_bridge_restart_and_sees_every_event_once() {
    let setup = std::process::Command::new("bash")
        .arg(repo().join("scripts/browser-test.sh"))
        .arg("--install-only")
        .status()
        .expect("run scripts/browser-test.sh");
    assert!(
        setup.success(),
        "scripts/browser-test.sh --install-only failed: chromium and playwright-core are needed"
    );

    let h = Harness::start(script("charts"), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("charts", "charts").await;
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let bridge = TestBridge::start(config.clone(), "127.0.0.1:0").await;
    let addr = bridge.addr.to_string();
    let base = bridge.url();
    let api = Api::new(&base, Some(ACME));
    let (s, sub) = api.submit("charts", "read the charts", "charts-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{sub}");
    let run = sub["run_id"].as_str().expect("run").to_owned();
    let run_id: kedge_core::ids::RunId = run.parse().expect("run id");

    let types: Vec<&str> = EventType::ALL
        .iter()
        .filter(|t| kedge_bridge::view::is_public(**t))
        .map(|t| t.as_str())
        .collect();
    let profile = tempfile::tempdir().expect("profile dir");
    let cfg = json!({
        "base": base, "run": run, "token": ACME, "types": types,
        "timeout_ms": 60_000, "profile": profile.path(),
    });
    let mut node = tokio::process::Command::new("node")
        .arg(repo().join("crates/kedge/tests/browser/sse.mjs"))
        .arg(repo().join(".tools/browser"))
        .arg(cfg.to_string())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn node");
    let mut lines = BufReader::new(node.stdout.take().expect("stdout")).lines();

    // Wait for the page to see events and the run to be a few steps in; then restart the bridge.
    let mut progress = 0usize;
    let t0 = Instant::now();
    while progress == 0 {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the page saw no event")
            .expect("read")
            .expect("driver exited early");
        if let Some(n) = line.strip_prefix("progress ") {
            progress = n.parse().unwrap_or(0);
        }
    }
    // The page is watching: let the run go on, and restart the bridge a few steps in.
    let waiting = h
        .wait_for(&run_id, Duration::from_secs(30), |s| {
            s.status == kedge_core::RunStatus::WaitingUser
        })
        .await;
    let question = waiting
        .questions
        .keys()
        .next()
        .expect("the question")
        .clone();
    let events = h.events(&run_id).await;
    kedge_app::inputs::answer(&h.rt, &run_id, &events, &question, "yes".into())
        .await
        .expect("answered");
    h.wait_for(&run_id, Duration::from_secs(30), |s| s.step.get() >= 4)
        .await;
    bridge.stop().await;
    tokio::time::sleep(Duration::from_millis(400)).await;
    let bridge = TestBridge::start(config, &addr).await;

    // The page reconnects by itself and, when the run is over, EventSource closes.
    let seen: Value = loop {
        let line = tokio::time::timeout(Duration::from_secs(60), lines.next_line())
            .await
            .expect("the driver went silent")
            .expect("read")
            .expect("driver exited without a result");
        if line.starts_with('{') {
            break serde_json::from_str(&line).expect("result JSON");
        }
    };
    let status = node.wait().await.expect("driver exit");
    assert!(status.success(), "driver: {status}; saw {seen}");
    eprintln!(
        "browser: {} events, {} opens, {} deltas in {:?}",
        seen["ids"].as_array().map_or(0, Vec::len),
        seen["opens"],
        seen["deltas"],
        t0.elapsed()
    );

    let ids: Vec<u64> = seen["ids"]
        .as_array()
        .expect("ids")
        .iter()
        .map(|v| v.as_u64().expect("numeric id"))
        .collect();
    let state = h.wait_terminal(&run_id, Duration::from_secs(5)).await;
    assert_eq!(state.status, kedge_core::RunStatus::Succeeded);
    assert_eq!(
        api.history_ids(&run).await,
        ids,
        "the page's ids vs /history"
    );
    assert!(ids.windows(2).all(|w| w[0] < w[1]), "{ids:?}");
    assert_eq!(
        seen["types"].as_array().and_then(|t| t.last()),
        Some(&json!("run.succeeded"))
    );
    assert!(
        seen["opens"].as_u64().unwrap_or(0) >= 2,
        "the browser reconnected by itself: {seen}"
    );
    assert_eq!(seen["closed"], true, "EventSource closed after the 204");
    bridge.stop().await;
    h.shutdown().await;
}
