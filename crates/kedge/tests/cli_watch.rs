//! `kedge watch` as an operator runs it: every line carries the time since
//! the run was created, and the model's text streams in while the step thinks.

use crate::common;

use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use common::{Harness, Svc};
use kedge_runtime::secure::Kind;
use serde_json::json;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn watch_shows_elapsed_time_and_the_streamed_text() {
    let script = json!({"models": {"slow": {"steps": [
        {"text": "a streamed answer arrives", "delay_ms": 1500}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("slow", "slow").await;
    let run = h.submit("slow", "go", "watch-1").await;
    let mut child = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["watch", run.as_str()])
        .env("KEDGE_NATS_URL", h.nats.url())
        .env_remove("KEDGE_CONFIG")
        .envs(common::kind_env(&h.config, Kind::Operator))
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("kedge watch");
    let deadline = Instant::now() + Duration::from_secs(30);
    while child.try_wait().expect("wait").is_none() {
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("kedge watch did not return when the run ended");
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let out = child.wait_with_output().expect("output");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // The text streamed in before the step's completion was journaled.
    let streamed = stdout
        .lines()
        .position(|l| l.trim_start().starts_with('…') && l.contains("a streamed answer arrives"))
        .unwrap_or_else(|| panic!("no streamed text: {stdout}"));
    let completed = stdout
        .lines()
        .position(|l| l.contains("step.completed"))
        .unwrap_or_else(|| panic!("no step.completed: {stdout}"));
    assert!(streamed < completed, "{stdout}");
    // Event lines start with the seconds since run.created; the model's delay shows.
    let succeeded = stdout
        .lines()
        .find(|l| l.contains("run.succeeded"))
        .unwrap_or_else(|| panic!("no run.succeeded: {stdout}"));
    let secs: f64 = succeeded
        .split_whitespace()
        .next()
        .and_then(|t| t.strip_suffix('s'))
        .and_then(|t| t.parse().ok())
        .unwrap_or_else(|| panic!("no elapsed time on {succeeded:?}"));
    assert!(secs >= 1.4, "{succeeded}");
    // `kedge watch -o jsonl` on the ended run: its events as JSON lines, ending in run.succeeded.
    let jsonl = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["watch", run.as_str(), "-o", "jsonl"])
        .env("KEDGE_NATS_URL", h.nats.url())
        .env_remove("KEDGE_CONFIG")
        .envs(common::kind_env(&h.config, Kind::Operator))
        .output()
        .expect("kedge watch -o jsonl");
    let lines: Vec<serde_json::Value> = String::from_utf8_lossy(&jsonl.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).expect("a JSON line"))
        .collect();
    assert_eq!(lines.len(), h.events(&run).await.len());
    assert_eq!(
        lines.last().map(|l| l["event"]["type"].clone()),
        Some(json!("run.succeeded"))
    );
    // `kedge status -o json` is the run view.
    let status = Command::new(env!("CARGO_BIN_EXE_kedge"))
        .args(["status", run.as_str(), "-o", "json"])
        .env("KEDGE_NATS_URL", h.nats.url())
        .env_remove("KEDGE_CONFIG")
        .envs(common::kind_env(&h.config, Kind::Operator))
        .output()
        .expect("kedge status");
    let view: serde_json::Value = serde_json::from_slice(&status.stdout).expect("json");
    assert_eq!(view["status"], "succeeded", "{view}");
    assert_eq!(
        view["result"]["output"], "a streamed answer arrives",
        "{view}"
    );
    h.shutdown().await;
}
