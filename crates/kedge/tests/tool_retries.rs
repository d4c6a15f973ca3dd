//! Per-tool retry policy through the services: an MCP tool that fails
//! transiently is tried again within one operation, every attempt journaled under the same
//! operation id, and the model reads one result; an error without a retryable class goes to the
//! model at once; the per-attempt time limit stops an attempt and the next one runs; when the
//! attempts run out the model reads the last error; a connection lost mid-call is retried only
//! for a tool declared idempotent (otherwise it is an ambiguous outcome for a person), and so is
//! an attempt whose runner was killed mid-call; a cancelled
//! run does not wait out a backoff; the wait survives the runner that started it (kill -9), also
//! one killed before giving its failed attempt's record back. The
//! tool is `fixtures/flaky-mcp-server.js` (plain Node), which fails on purpose and records every
//! start and call in files.

use crate::common;

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, ToolAttempt, ToolStarted};
use kedge_core::ids::{OperationId, RunId};
use kedge_core::tools::ToolErrorClass;
use kedge_journal::Recorded;
use kedge_mcp::ServerConfig;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(60);

fn node() -> PathBuf {
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .map(|dir| dir.join("node"))
        .find(|p| p.is_file())
        .unwrap_or_else(|| panic!("node is missing: install it (the MCP tests need it too)"))
}

/// The flaky server over stdio, keeping its state in `state`, with `env` added.
fn flaky(state: &Path, env: &[(&str, &str)]) -> ServerConfig {
    let script = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/flaky-mcp-server.js")
        .canonicalize()
        .expect("flaky script");
    let mut vars: BTreeMap<String, String> =
        BTreeMap::from([("FLAKY_DIR".into(), state.display().to_string())]);
    for (k, v) in env {
        vars.insert((*k).into(), (*v).into());
    }
    ServerConfig::Stdio {
        command: node().display().to_string(),
        args: vec![script.display().to_string()],
        env: vars,
        sandbox: None,
    }
}

/// A harness whose tool service knows the flaky server as `flaky`. The service's own tool limit
/// is generous (starting Node counts against it); each test's policy sets the per-attempt one.
async fn start(model: &str, steps: Value, state: &Path, env: &[(&str, &str)]) -> Harness {
    start_models(json!({model: {"steps": steps}}), state, env).await
}

/// [`start`] with several scripted models.
async fn start_models(models: Value, state: &Path, env: &[(&str, &str)]) -> Harness {
    let server = flaky(state, env);
    Harness::start_with(
        json!({"models": models}),
        &[Svc::Intake, Svc::Step, Svc::Tool],
        move |c| {
            c.mcp_servers.insert("flaky".into(), server);
            c.timeouts.tool_timeout_ms = 10_000;
            c.timeouts.tool_grace_ms = 2_000;
            c.timeouts.tool_ack_wait_ms = 15_000;
        },
    )
    .await
}

/// Stores agent `name` on `model` with the flaky server's tools and `policy`.
async fn store_agent(h: &Harness, name: &str, model: &str, policy: Value) {
    let def = json!({
        "name": name,
        "system_prompt": "retry test",
        "model": {"provider": "openai", "name": model, "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": [{"name": "flaky__fetch"}, {"name": "flaky__slow"}, {"name": "flaky__broken"},
                  {"name": "flaky__crash"}],
        "policy": policy,
        "budget": {"max_steps": 5, "max_tokens": 1000000, "max_attempts_per_step": 3}
    });
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

/// Stores agent `name` on model `mp` with the one flaky tool `tool` and no policy.
async fn store_one_tool_agent(h: &Harness, name: &str, tool: &str) {
    let def = json!({
        "name": name,
        "system_prompt": "status test",
        "model": {"provider": "openai", "name": "mp", "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": [{"name": tool}],
    });
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

/// The flaky server (with `env`) and a harness (intake, step) whose agent `agent` makes one
/// call of `call` = (tool, key), then answers; the tool timeouts are `(timeout, grace, ack
/// wait)` in ms. Returns the server's state directory, the `KEDGE_MCP_SERVERS` value for tool
/// processes, and the harness.
async fn payer(
    env: &[(&str, &str)],
    agent: &str,
    call_of: (&str, &str),
    (timeout, grace, ack_wait): (u64, u64, u64),
) -> (tempfile::TempDir, String, Harness) {
    let state = tempfile::tempdir().expect("dir");
    let server = flaky(state.path(), env);
    let servers = serde_json::to_string(&json!({ "flaky": server })).expect("JSON");
    let h = Harness::start_with(
        json!({"models": {"mp": {"steps": [
            {"text": "paying", "tool_calls": [call(call_of.0, call_of.1)]},
            {"text": "paid"}
        ]}}}),
        &[Svc::Intake, Svc::Step],
        |c| {
            c.timeouts.tool_timeout_ms = timeout;
            c.timeouts.tool_grace_ms = grace;
            c.timeouts.tool_ack_wait_ms = ack_wait;
        },
    )
    .await;
    store_one_tool_agent(&h, agent, call_of.0).await;
    (state, servers, h)
}

/// How many times the flaky server's effect (`pay`, `pay_slowly`) of `op` happened.
fn effects_of(state: &Path, op: &OperationId) -> usize {
    lines(state, "done")
        .into_iter()
        .filter(|l| l.starts_with(&format!("{op}\t")))
        .count()
}

/// Waits until the flaky server has received a call of `tool`.
async fn call_arrived(state: &Path, tool: &str) {
    let deadline = std::time::Instant::now() + WAIT;
    while !lines(state, "calls")
        .iter()
        .any(|l| l.starts_with(&format!("{tool}\t")))
    {
        assert!(
            std::time::Instant::now() < deadline,
            "the call never arrived"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn call(name: &str, key: &str) -> Value {
    json!({"name": name, "arguments": {"key": key}})
}

/// Lines of one of the server's state files.
fn lines(state: &Path, file: &str) -> Vec<String> {
    std::fs::read_to_string(state.join(file))
        .unwrap_or_default()
        .lines()
        .map(str::to_owned)
        .collect()
}

/// The journal's events about `op`, in order.
fn about<'a>(events: &'a [Recorded], op: &OperationId) -> Vec<&'a Recorded> {
    events
        .iter()
        .filter(|r| r.envelope.op.as_ref() == Some(op))
        .collect()
}

fn starts(events: &[&Recorded]) -> Vec<(u32, kedge_core::event::Timestamp)> {
    events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolStarted(ToolStarted { attempt, .. }) => Some((*attempt, r.envelope.at)),
            _ => None,
        })
        .collect()
}

fn failed_attempts<'a>(
    events: &[&'a Recorded],
) -> Vec<(&'a ToolAttempt, kedge_core::event::Timestamp)> {
    events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolAttempt(a) => Some((a, r.envelope.at)),
            _ => None,
        })
        .collect()
}

/// The tool results the model read in its `n`-th request (0-based), by call id.
fn tool_messages(h: &Harness, model: &str, n: usize) -> Vec<(String, String)> {
    let requests = h.mock.requests(model);
    let request = requests
        .get(n)
        .unwrap_or_else(|| panic!("no request {n} of {model}"));
    request["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .map(|m| {
            (
                m["tool_call_id"].as_str().unwrap_or_default().to_owned(),
                m["content"].as_str().unwrap_or_default().to_owned(),
            )
        })
        .collect()
}

fn only_op(run: &RunId, events: &[Recorded]) -> OperationId {
    let ops: Vec<OperationId> = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ToolRequested(_)))
        .filter_map(|r| r.envelope.op.clone())
        .collect();
    assert_eq!(
        ops.len(),
        1,
        "one operation dispatched once in {run}: {ops:?}"
    );
    ops[0].clone()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_failing_transiently_twice_is_retried_within_one_operation_and_the_model_sees_one_result()
 {
    let state = tempfile::tempdir().expect("dir");
    let steps = json!([
        {"text": "fetching", "tool_calls": [call("flaky__fetch", "a")]},
        {"text": "done"}
    ]);
    // The first two starts of the server die before the handshake: the call is never sent.
    let h = start("mr", steps, state.path(), &[("FLAKY_FAIL_LAUNCHES", "2")]).await;
    store_agent(
        &h,
        "retrier",
        "mr",
        json!({"flaky__fetch": {"retry": {"attempts": 4, "initial_backoff_ms": 300,
            "max_backoff_ms": 600, "jitter": 0.5, "on": ["transient"]}}}),
    )
    .await;
    // The request is kept by its runner through each backoff, not handed back: a NAK (even a
    // delayed one) counts against the consumer's max_deliver.
    let mut naks =
        h.rt.client
            .subscribe("$JS.EVENT.ADVISORY.CONSUMER.MSG_NAKED.KEDGE_RUNS.tool")
            .await
            .expect("subscribe");
    let run = h.submit("retrier", "go", "retry-transient").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let nak = tokio::time::timeout(
        Duration::from_millis(300),
        futures::StreamExt::next(&mut naks),
    )
    .await;
    assert!(nak.is_err(), "a request was handed back: {nak:?}");

    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let op = only_op(&run, &events);
    let mine = about(&events, &op);
    // Three attempts, each started under the operation's id; the first two failed as transient
    // and were journaled as such, the third succeeded.
    let started = starts(&mine);
    assert_eq!(
        started.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        [1, 2, 3],
        "{started:?}"
    );
    let failed = failed_attempts(&mine);
    assert_eq!(
        failed
            .iter()
            .map(|(a, _)| (a.attempt, a.class, a.dispatch))
            .collect::<Vec<_>>(),
        [
            (1, ToolErrorClass::Transient, 0),
            (2, ToolErrorClass::Transient, 0)
        ]
    );
    for (a, at) in &failed {
        assert!(a.error.contains("not run"), "{}", a.error);
        // Backoff with jitter: 300 ms then 600 ms ceilings, at least half of each.
        let ceiling = if a.attempt == 1 { 300 } else { 600 };
        assert!(
            (ceiling / 2..=ceiling).contains(&a.delay_ms),
            "attempt {}: {} ms",
            a.attempt,
            a.delay_ms
        );
        // The next attempt did not start before it was due.
        let (_, next_start) = started[a.attempt as usize];
        assert!(
            next_start >= a.retry_at,
            "attempt {} started at {next_start}, due {}",
            a.attempt + 1,
            a.retry_at
        );
        assert!(a.retry_at >= *at);
    }
    let results: Vec<_> = mine
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ToolResult(_)))
        .collect();
    assert_eq!(results.len(), 1, "one result for the operation");
    let result = done.ops[&op].result.clone().expect("a result");
    assert_eq!(
        (result.content.as_str(), result.is_error),
        ("fetched a", false)
    );

    // The effect happened once, under the operation id; the server was started three times.
    let calls = lines(state.path(), "calls");
    assert_eq!(calls, [format!("fetch\t{op}\ta")], "{calls:?}");
    assert_eq!(lines(state.path(), "launches").len(), 3);

    // The model was called twice and read one result for its one call: the success.
    assert_eq!(h.mock.requests("mr").len(), 2);
    let read = tool_messages(&h, "mr", 1);
    assert_eq!(read.len(), 1, "{read:?}");
    assert_eq!(read[0].1, "fetched a");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_error_the_policy_does_not_retry_goes_straight_to_the_model() {
    let state = tempfile::tempdir().expect("dir");
    let steps = json!([
        {"text": "trying", "tool_calls": [call("flaky__broken", "b"), call("flaky__slow", "s")]},
        {"text": "understood"}
    ]);
    let h = start("mn", steps, state.path(), &[("FLAKY_SLOW_CALLS", "9")]).await;
    // `broken` answers with the tool's own error (no retryable class) under a policy that
    // retries everything it may; `slow` times out under a policy that retries only transient
    // failures.
    store_agent(
        &h,
        "straight",
        "mn",
        json!({
            "flaky__broken": {"retry": {"attempts": 5, "initial_backoff_ms": 50,
                "on": ["timeout", "transient", "rate_limited"], "idempotent": true}},
            "flaky__slow": {"timeout_secs": 1, "retry": {"attempts": 5, "initial_backoff_ms": 50,
                "on": ["transient"]}}
        }),
    )
    .await;
    let run = h.submit("straight", "go", "retry-none").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    assert!(
        !events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::ToolAttempt(_))),
        "nothing was retried"
    );
    for op in done.ops.keys() {
        assert_eq!(
            starts(&about(&events, op)).len(),
            1,
            "{op}: one attempt only"
        );
    }
    let calls = lines(state.path(), "calls");
    assert_eq!(calls.len(), 2, "each tool was called once: {calls:?}");
    let read = tool_messages(&h, "mn", 1);
    assert_eq!(read.len(), 2, "{read:?}");
    let text = |needle: &str| {
        read.iter()
            .map(|(_, t)| t.as_str())
            .find(|t| t.contains(needle))
            .unwrap_or_else(|| panic!("no result with {needle:?}: {read:?}"))
            .to_owned()
    };
    // The tool's own error, word for word (the adapter marks an error result `ERROR: `).
    assert_eq!(
        text("permission denied"),
        "ERROR: permission denied: this tool refuses everyone"
    );
    // The timeout, with why it was not retried.
    let slow = text("timed out");
    assert!(
        slow.contains("does not list timeout"),
        "the model is told why: {slow}"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_per_attempt_time_limit_stops_an_attempt_and_the_next_one_runs() {
    let state = tempfile::tempdir().expect("dir");
    let steps = json!([
        {"text": "slow one", "tool_calls": [call("flaky__slow", "s")]},
        {"text": "done"}
    ]);
    // The first call of `slow` takes 5 s; the policy gives each attempt 1 s. The tool honours
    // the operation id, so a timed-out attempt may be run again.
    let h = start("mt", steps, state.path(), &[("FLAKY_SLOW_CALLS", "1")]).await;
    store_agent(
        &h,
        "timely",
        "mt",
        json!({"flaky__slow": {"timeout_secs": 1, "retry": {"attempts": 3,
            "initial_backoff_ms": 100, "max_backoff_ms": 100, "on": ["timeout"], "idempotent": true}}}),
    )
    .await;
    let run = h.submit("timely", "go", "retry-timeout").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let op = only_op(&run, &events);
    let mine = about(&events, &op);
    let started = starts(&mine);
    let failed = failed_attempts(&mine);
    assert_eq!(failed.len(), 1, "{failed:?}");
    let (first, failed_at) = failed[0];
    assert_eq!((first.attempt, first.class), (1, ToolErrorClass::Timeout));
    assert!(
        first.error.contains("timed out after 1000 ms"),
        "{}",
        first.error
    );
    // The limit fired: the attempt ended about a second after it started, not after the
    // tool's five.
    let took = failed_at.0 - started[0].1.0;
    assert!(
        took < time::Duration::milliseconds(3_500),
        "attempt 1 took {took}"
    );
    assert_eq!(started.iter().map(|(a, _)| *a).collect::<Vec<_>>(), [1, 2]);
    let result = done.ops[&op].result.clone().expect("a result");
    assert_eq!(
        (result.content.as_str(), result.is_error),
        ("slow s done on call 2", false)
    );
    // Both attempts reached the server under the same operation id.
    let calls = lines(state.path(), "calls");
    assert_eq!(
        calls,
        [format!("slow\t{op}\ts"), format!("slow\t{op}\ts")],
        "{calls:?}"
    );
    let read = tool_messages(&h, "mt", 1);
    assert_eq!(
        read.iter().map(|(_, t)| t.as_str()).collect::<Vec<_>>(),
        ["slow s done on call 2"]
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_the_attempts_run_out_the_model_reads_the_last_error() {
    let state = tempfile::tempdir().expect("dir");
    let steps = json!([
        {"text": "fetching", "tool_calls": [call("flaky__fetch", "x")]},
        {"text": "the server is down"}
    ]);
    // The server never comes up.
    let h = start(
        "mx",
        steps,
        state.path(),
        &[("FLAKY_FAIL_LAUNCHES", "1000")],
    )
    .await;
    store_agent(
        &h,
        "doomed",
        "mx",
        json!({"flaky__fetch": {"retry": {"attempts": 3, "initial_backoff_ms": 100,
            "max_backoff_ms": 200}}}),
    )
    .await;
    let run = h.submit("doomed", "go", "retry-exhausted").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    assert_eq!(done.output.as_deref(), Some("the server is down"));
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let op = only_op(&run, &events);
    let mine = about(&events, &op);
    assert_eq!(
        starts(&mine).iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        [1, 2, 3]
    );
    assert_eq!(
        failed_attempts(&mine)
            .iter()
            .map(|(a, _)| a.attempt)
            .collect::<Vec<_>>(),
        [1, 2],
        "the last failure is the result, not an attempt"
    );
    let result = done.ops[&op].result.clone().expect("a result");
    assert!(result.is_error);
    assert!(
        result.content.contains("not run") && result.content.contains("gave up after 3 attempts"),
        "{}",
        result.content
    );
    assert_eq!(
        lines(state.path(), "launches").len(),
        3,
        "one start per attempt"
    );
    assert!(lines(state.path(), "calls").is_empty(), "never reached");
    let read = tool_messages(&h, "mx", 1);
    assert_eq!(read.len(), 1);
    assert_eq!(
        read[0].1,
        format!("ERROR: {}", result.content),
        "the model read that error"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_lost_mid_call_is_retried_only_for_a_tool_declared_idempotent() {
    let state = tempfile::tempdir().expect("dir");
    // `crash` kills its server mid-call the first time for a key: the call may have taken
    // effect, and only the tool's own idempotency can make a second one harmless.
    let steps = |key: &str| json!({"steps": [{"text": "go", "tool_calls": [call("flaky__crash", key)]}, {"text": "after"}]});
    let h = start_models(
        json!({"mu": steps("u"), "mi": steps("i")}),
        state.path(),
        &[],
    )
    .await;
    let retry = |idempotent: bool| {
        json!({"flaky__crash": {"retry": {"attempts": 3, "initial_backoff_ms": 50,
            "on": ["transient"], "idempotent": idempotent}}})
    };
    store_agent(&h, "unsure", "mu", retry(false)).await;
    store_agent(&h, "sure", "mi", retry(true)).await;

    // Not declared idempotent: an ambiguous outcome for a person, never retried.
    let run = h.submit("unsure", "go", "retry-cut-unsure").await;
    let state_u = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::Unknown)
        .await;
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let op = only_op(&run, &events);
    let mine = about(&events, &op);
    assert!(
        mine.iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeAmbiguous(_))),
        "outcome.ambiguous journaled"
    );
    assert!(failed_attempts(&mine).is_empty(), "not retried");
    assert_eq!(starts(&mine).len(), 1);
    assert!(state_u.ops[&op].result.is_none());
    assert_eq!(
        h.mock.requests("mu").len(),
        1,
        "the model is not asked until a person resolves it"
    );

    // Declared idempotent: the lost connection is a transient failure, tried again under the
    // same operation id, and the model reads the second attempt's result.
    let run = h.submit("sure", "go", "retry-cut-sure").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let op = only_op(&run, &events);
    let mine = about(&events, &op);
    let failed = failed_attempts(&mine);
    assert_eq!(failed.len(), 1, "{failed:?}");
    assert_eq!(
        (failed[0].0.attempt, failed[0].0.class),
        (1, ToolErrorClass::Transient)
    );
    assert!(
        !mine
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeAmbiguous(_))),
        "not ambiguous"
    );
    let result = done.ops[&op].result.clone().expect("a result");
    assert_eq!(result.content, "crash i survived call 2");
    let calls: Vec<String> = lines(state.path(), "calls")
        .into_iter()
        .filter(|l| l.ends_with("\ti"))
        .collect();
    assert_eq!(
        calls,
        [format!("crash\t{op}\ti"), format!("crash\t{op}\ti")],
        "both attempts under the same operation id"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cancelled_run_does_not_wait_for_an_operation_between_attempts() {
    let state = tempfile::tempdir().expect("dir");
    let steps = json!([
        {"text": "fetching", "tool_calls": [call("flaky__fetch", "c")]},
        {"text": "never"}
    ]);
    let h = start(
        "mc",
        steps,
        state.path(),
        &[("FLAKY_FAIL_LAUNCHES", "1000")],
    )
    .await;
    // Twenty seconds between attempts, no jitter.
    store_agent(
        &h,
        "patient",
        "mc",
        json!({"flaky__fetch": {"retry": {"attempts": 5, "initial_backoff_ms": 20_000,
            "max_backoff_ms": 20_000, "jitter": 0}}}),
    )
    .await;
    let run = h.submit("patient", "go", "retry-cancel").await;
    h.wait_for(&run, WAIT, |s| {
        s.ops.values().any(|o| o.failed_attempts == 1)
    })
    .await;
    let asked = std::time::Instant::now();
    h.cancel(&run).await;
    let done = h.wait_terminal(&run, Duration::from_secs(10)).await;
    assert_eq!(done.status, RunStatus::Cancelled);
    assert!(
        asked.elapsed() < Duration::from_secs(10),
        "cancelled in {:?}, not after the backoff",
        asked.elapsed()
    );
    let events = h.events(&run).await;
    let op = only_op(&run, &events);
    let fates: Vec<_> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::RunCancelled(c) => Some(c.operations.clone()),
            _ => None,
        })
        .flatten()
        .map(|s| (s.op, s.fate))
        .collect();
    assert_eq!(
        fates,
        [(op.clone(), kedge_core::event::OpFate::Failed)],
        "its attempts failed; none is running"
    );
    assert_eq!(
        starts(&about(&events, &op)).len(),
        1,
        "no second attempt ran"
    );
    assert_eq!(lines(state.path(), "launches").len(), 1);
    assert_eq!(
        h.mock.requests("mc").len(),
        1,
        "the model is not asked again"
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_wait_between_attempts_survives_its_runner() {
    next_attempt_after_its_runner_is_killed(false).await;
}

/// The runner killed after journaling its failed attempt and before giving the operation's
/// record back: the record still says `running` under the first attempt, and the next attempt
/// supersedes it when due (the journal says the first one ended), without waiting out its
/// deadline or asking anyone.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_killed_before_giving_back_its_failed_attempt_does_not_hold_the_next() {
    next_attempt_after_its_runner_is_killed(true).await;
}

/// A flaky call failing its first attempt on runner `w-first`, killed -9 before the second is
/// due; with `record_left_running`, the record is put back to `running` as a runner killed
/// between journaling the failure and releasing the record leaves it. The second attempt runs
/// on `w-second` when due, and the run succeeds with one effect.
async fn next_attempt_after_its_runner_is_killed(record_left_running: bool) {
    let state = tempfile::tempdir().expect("dir");
    let steps = json!([
        {"text": "fetching", "tool_calls": [call("flaky__fetch", "k")]},
        {"text": "done"}
    ]);
    // No tool service in this process: runners are `kedge serve tool` processes.
    let server = flaky(state.path(), &[("FLAKY_FAIL_LAUNCHES", "1")]);
    let mut h = Harness::start_with(
        json!({"models": {"mk": {"steps": steps}}}),
        &[Svc::Intake, Svc::Step],
        |c| {
            c.timeouts.tool_timeout_ms = 10_000;
            c.timeouts.tool_grace_ms = 2_000;
            c.timeouts.tool_ack_wait_ms = 15_000;
        },
    )
    .await;
    store_agent(
        &h,
        "durable",
        "mk",
        json!({"flaky__fetch": {"retry": {"attempts": 3, "initial_backoff_ms": 1_500,
            "max_backoff_ms": 1_500, "jitter": 0}}}),
    )
    .await;
    let servers = serde_json::to_string(&json!({ "flaky": server })).expect("JSON");
    let first = h.spawn_process_with_env(
        "tool",
        "w-first",
        "",
        &[("KEDGE_MCP_SERVERS", servers.clone())],
    );
    let run = h.submit("durable", "go", "retry-durable").await;
    h.wait_for(&run, WAIT, |s| {
        s.ops.values().any(|o| o.failed_attempts == 1)
    })
    .await;
    // The runner that failed the first attempt is gone before the second is due.
    h.kill9(first);
    if record_left_running {
        let kv =
            h.rt.js
                .get_key_value("kedge_idempotency")
                .await
                .expect("bucket");
        let op = only_op(&run, &h.events(&run).await);
        let key = kedge_runtime::idempotency::IdempotencyStore::op_key(&op);
        let entry = kv.get(&key).await.expect("read").expect("a record");
        let mut record: Value = serde_json::from_slice(&entry).expect("JSON record");
        assert_eq!(record["runner"], "w-first");
        record["state"] = json!("running");
        kv.put(&key, serde_json::to_vec(&record).expect("JSON").into())
            .await
            .expect("record written");
    }
    h.spawn_process_with_env("tool", "w-second", "", &[("KEDGE_MCP_SERVERS", servers)]);
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    let op = only_op(&run, &events);
    let mine = about(&events, &op);
    let runners: Vec<(u32, String)> = mine
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ToolStarted(t) => Some((t.attempt, t.runner.clone())),
            _ => None,
        })
        .collect();
    assert_eq!(
        runners,
        [(1, "w-first".to_owned()), (2, "w-second".to_owned())],
        "the next attempt ran on the runner that was there when it was due"
    );
    let (failed, _) = failed_attempts(&mine)[0];
    let second = starts(&mine)[1].1;
    assert!(second >= failed.retry_at, "not before it was due");
    assert_eq!(
        done.ops[&op].result.clone().expect("a result").content,
        "fetched k"
    );
    assert_eq!(lines(state.path(), "calls"), [format!("fetch\t{op}\tk")]);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_attempt_cut_off_with_its_runner_is_run_again_for_an_idempotent_tool_only() {
    let state = tempfile::tempdir().expect("dir");
    let steps = |key: &str| json!({"steps": [{"text": "go", "tool_calls": [call("flaky__slow", key)]}, {"text": "after"}]});
    // The first call of `slow` for a key takes 5 s: the runner is killed during it.
    let server = flaky(state.path(), &[("FLAKY_SLOW_CALLS", "1")]);
    let mut h = Harness::start_with(
        json!({"models": {"ms": steps("sure"), "mu": steps("unsure")}}),
        &[Svc::Intake, Svc::Step],
        |c| {
            c.timeouts.tool_timeout_ms = 10_000;
            c.timeouts.tool_grace_ms = 2_000;
            c.timeouts.tool_ack_wait_ms = 15_000;
        },
    )
    .await;
    let retry = |idempotent: bool| {
        json!({"flaky__slow": {"retry": {"attempts": 2, "initial_backoff_ms": 100,
            "on": ["transient"], "idempotent": idempotent}}})
    };
    store_agent(&h, "sure", "ms", retry(true)).await;
    store_agent(&h, "unsure", "mu", retry(false)).await;
    let servers = serde_json::to_string(&json!({ "flaky": server })).expect("JSON");
    let mut outcomes = Vec::new();
    let mut standby = None;
    for (agent, key) in [("sure", "sure"), ("unsure", "unsure")] {
        // One runner at a time: the previous case's standby goes first.
        if let Some(previous) = standby.take() {
            h.kill9(previous);
        }
        let doomed = h.spawn_process_with_env(
            "tool",
            &format!("w-doomed-{agent}"),
            "",
            &[("KEDGE_MCP_SERVERS", servers.clone())],
        );
        let run = h.submit(agent, "go", &format!("retry-cut-{agent}")).await;
        h.wait_for(&run, WAIT, |s| {
            s.ops
                .values()
                .any(|o| matches!(o.status, kedge_core::fold::OpStatus::Started { .. }))
        })
        .await;
        let calls = |state: &Path| {
            lines(state, "calls")
                .into_iter()
                .filter(|l| l.ends_with(&format!("\t{key}")))
                .count()
        };
        // The call reached the server; then its runner dies.
        for _ in 0..100 {
            if calls(state.path()) == 1 {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // A standby that hears the doomed runner's heartbeats takes its operation over as soon
        // as it is gone (rather than when the request is redelivered, after the ack wait).
        standby = Some(h.spawn_process_with_env(
            "tool",
            &format!("w-standby-{agent}"),
            "",
            &[("KEDGE_MCP_SERVERS", servers.clone())],
        ));
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        h.kill9(doomed);
        let settled = h
            .wait_for(&run, WAIT, |s| {
                s.status.is_terminal() || s.status == RunStatus::Unknown
            })
            .await;
        outcomes.push((agent, run, settled, calls(state.path())));
    }
    let (_, run, sure, calls) = &outcomes[0];
    assert_eq!(sure.status, RunStatus::Succeeded, "{:?}", sure.failure);
    let op = only_op(run, &h.events(run).await);
    assert_eq!(
        sure.ops[&op].result.clone().expect("a result").content,
        "slow sure done on call 2"
    );
    assert_eq!(
        *calls, 2,
        "run again under the same id: the tool dedups by it"
    );
    let (_, run, unsure, calls) = &outcomes[1];
    assert_eq!(unsure.status, RunStatus::Unknown, "a person decides");
    let events = h.events(run).await;
    assert!(
        events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeAmbiguous(_))),
        "outcome.ambiguous"
    );
    assert_eq!(*calls, 1, "not run again");
    h.shutdown().await;
}

/// docs/CONFIG.md's table of `retry` fields, `schemas/agent.schema.json` and the Rust defaults
/// and limits say the same: the same fields, the same defaults, the same ranges.
#[test]
fn the_documented_retry_fields_defaults_and_ranges_match_the_schema_and_the_code() {
    use kedge_core::tools::{MAX_BACKOFF_MS, MAX_MULTIPLIER, MAX_TOOL_ATTEMPTS, RetryPolicy};
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(repo.join("docs/CONFIG.md")).expect("CONFIG.md");
    let section = doc
        .split("### Tool retries (`policy.<tool>.retry`)")
        .nth(1)
        .expect("a tool retries section");
    // The first table of the section: | `field` | default | rule | meaning |
    let rows: BTreeMap<String, (String, String)> = section
        .lines()
        .skip_while(|l| !l.starts_with("| field |"))
        .skip(2)
        .take_while(|l| l.starts_with('|'))
        .map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            (
                cells[1].trim_matches('`').to_owned(),
                (cells[2].trim_matches('`').to_owned(), cells[3].to_owned()),
            )
        })
        .collect();
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(repo.join("schemas/agent.schema.json")).expect("schema"),
    )
    .expect("JSON");
    let properties = schema["$defs"]["RetryPolicy"]["properties"]
        .as_object()
        .expect("RetryPolicy in the agent schema");
    assert_eq!(
        rows.keys().collect::<Vec<_>>(),
        properties.keys().collect::<Vec<_>>(),
        "documented fields vs the schema's"
    );
    let defaults = serde_json::to_value(RetryPolicy {
        idempotent: false,
        ..RetryPolicy::default()
    })
    .expect("JSON");
    for (field, (documented, rule)) in &rows {
        let documented: Value = serde_json::from_str(documented)
            .unwrap_or_else(|e| panic!("{field}: default {documented:?} is not JSON: {e}"));
        let code = defaults.get(field).cloned().unwrap_or(Value::Bool(false));
        assert_eq!(
            documented
                .as_f64()
                .map(Value::from)
                .unwrap_or(documented.clone()),
            code.as_f64().map(Value::from).unwrap_or(code.clone()),
            "{field}: documented default vs RetryPolicy::default()"
        );
        if let Some(in_schema) = properties[field].get("default") {
            assert_eq!(
                in_schema
                    .as_f64()
                    .map(Value::from)
                    .unwrap_or(in_schema.clone()),
                code.as_f64().map(Value::from).unwrap_or(code.clone()),
                "{field}: schema default"
            );
        }
        if let Some(max) = properties[field].get("maximum").and_then(Value::as_f64) {
            let expected = match field.as_str() {
                "attempts" => f64::from(MAX_TOOL_ATTEMPTS),
                "initial_backoff_ms" | "max_backoff_ms" => MAX_BACKOFF_MS as f64,
                "multiplier" => MAX_MULTIPLIER,
                "jitter" => 1.0,
                other => panic!("a maximum for {other} the test does not know"),
            };
            assert_eq!(max, expected, "{field}: schema maximum");
            assert!(
                rule.contains(&format!("–{expected}")),
                "{field}: the documented rule {rule:?} names the maximum {expected}"
            );
        }
    }
}

/// An MCP tool whose server answers Kedge's status query (`kedge_status`, docs/ARCHITECTURE.md
/// "Status queries for MCP tools"): its runner dies right after the effect, before journaling
/// the result, and the runner that takes the operation over asks the server instead of leaving
/// the run to a person. The result is the server's, the effect happened once, and the run goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_mcp_operation_cut_off_after_its_effect_is_confirmed_by_the_servers_status_tool() {
    let (state, servers, mut h) = payer(
        &[("FLAKY_STATUS", "1")],
        "payer",
        ("flaky__pay", "invoice-7"),
        (10_000, 2_000, 15_000),
    )
    .await;
    let env = [("KEDGE_MCP_SERVERS", servers)];
    // Dies after the tool answered, before its result is journaled.
    let doomed = h.spawn_process_with_env("tool", "w-doomed", "tool.after_effect", &env);
    let run = h.submit("payer", "go", "status-pay").await;
    assert!(
        h.wait_exit(doomed, WAIT).await,
        "the runner died at the failpoint"
    );
    h.spawn_process_with_env("tool", "w-fresh", "", &env);
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    let op = only_op(&run, &events);
    assert_eq!(
        done.ops[&op].result.clone().expect("a result").content,
        "paid invoice-7",
        "the server's record of the effect"
    );
    assert!(
        events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeConfirmed(_))),
        "outcome.confirmed"
    );
    assert!(
        !events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeAmbiguous(_))),
        "nobody had to decide"
    );
    let pays = lines(state.path(), "calls")
        .into_iter()
        .filter(|l| l.starts_with("pay\t"))
        .count();
    assert_eq!(pays, 1, "the effect happened once");
    h.shutdown().await;
}

/// A runner killed in the middle of a remote call whose server goes on with it (the effect
/// lands two seconds after the call arrived, after the runner is gone): the standby does not
/// run the operation again while that first attempt may still take effect. It waits for the
/// attempt's deadline (`tool_timeout + tool_grace` from the claim), then asks the server, which
/// by then has the effect: confirmed, once. Taken over at once, the standby would have found
/// nothing yet ("not found") and paid a second time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_call_cut_off_with_its_runner_is_not_run_again_while_it_may_still_land() {
    let (state, servers, mut h) = payer(
        &[("FLAKY_STATUS", "1")],
        "slow-payer",
        ("flaky__pay_slowly", "invoice-9"),
        (4_000, 1_000, 8_000),
    )
    .await;
    let env = [("KEDGE_MCP_SERVERS", servers)];
    let doomed = h.spawn_process_with_env("tool", "w-doomed", "", &env);
    let run = h.submit("slow-payer", "go", "slow-pay").await;
    // The call reached the server …
    call_arrived(state.path(), "pay_slowly").await;
    // … a standby hears the runner's heartbeats, and the runner is killed before the effect.
    h.spawn_process_with_env("tool", "w-standby", "", &env);
    tokio::time::sleep(Duration::from_millis(700)).await;
    h.kill9(doomed);
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    let op = only_op(&run, &events);
    assert_eq!(
        done.ops[&op].result.clone().expect("a result").content,
        "paid invoice-9"
    );
    assert_eq!(effects_of(state.path(), &op), 1, "the effect happened once");
    assert!(
        events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeConfirmed(_))),
        "the server's record answered"
    );
    h.shutdown().await;
}

/// A runner whose broker connection drops for 8 s in the middle of a remote call,
/// on a server with no status query: the call finishes meanwhile, and the runner journals its
/// result once it is back. The standby that found it gone waits for the call's deadline
/// instead of asking the server (which could only say "ambiguous": a person), and finds the
/// result: no person, one effect.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_runner_back_from_a_dropped_connection_journals_its_result_and_nobody_is_asked() {
    let (state, servers, mut h) = payer(
        &[],
        "cut-payer",
        ("flaky__pay_slowly", "invoice-11"),
        (15_000, 2_000, 20_000),
    )
    .await;
    let proxy = kedge_testkit::proxy::TcpProxy::start(std::net::SocketAddr::from((
        [127, 0, 0, 1],
        h.nats.port(),
    )))
    .await
    .expect("proxy");
    let env = [("KEDGE_MCP_SERVERS", servers.clone())];
    let via_proxy = [
        ("KEDGE_MCP_SERVERS", servers),
        ("KEDGE_NATS_URL", proxy.url()),
    ];
    h.spawn_process_with_env("tool", "w-cut", "", &via_proxy);
    let run = h.submit("cut-payer", "go", "cut-pay").await;
    call_arrived(state.path(), "pay_slowly").await;
    h.spawn_process_with_env("tool", "w-standby", "", &env);
    tokio::time::sleep(Duration::from_millis(700)).await;
    // Longer than a publish waits for its acknowledgement: the runner's first try to journal
    // the result fails, and it keeps trying.
    proxy.reset_for(Duration::from_secs(8));
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let events = h.events(&run).await;
    let op = only_op(&run, &events);
    assert_eq!(
        done.ops[&op].result.clone().expect("a result").content,
        "paid invoice-11"
    );
    assert!(
        !events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::OutcomeAmbiguous(_))),
        "nobody had to decide"
    );
    assert_eq!(effects_of(state.path(), &op), 1, "the effect happened once");
    h.shutdown().await;
}
