//! The web console in a real browser: the bridge serves it at `/`, headless Chromium (driven by
//! playwright-core, `crates/kedge/tests/browser/console.mjs`; `scripts/browser-test.sh
//! --install-only` installs both) uses it as a person would.
//!
//! One scenario, in order: a read-only token sees a run and no action (and, told it may write,
//! is refused with a 403 the page shows); a write+approve token
//! signs in; a run submitted meanwhile appears in the list without a reload, and the filters
//! work; the person answers the run's question; the next step streams its tokens into the
//! timeline while the bridge is restarted underneath (the page reconnects by itself); the person
//! approves the first operation in a dialog showing exactly the arguments and target the digest
//! covers (and the digest the console sends is the one shown), and sees a second approval,
//! decided elsewhere while the dialog was open, refused with 409; the run ends, a message revives
//! it into a second turn (the page opens a new stream), and the page's timeline equals
//! `/history`, each event once, in order. Then a second run (waiting on a timer) is cancelled; a
//! third, cancelled while its command runs, goes `cancelling` until the command's fate is known;
//! a fourth run's ambiguous operation is resolved; a fifth, cancelled while its operation's fate
//! is unknown, stays there (the request shown) until the person resolves the operation, then is
//! cancelled. Screenshots of the run page and the approval dialog are written to a folder the
//! test prints.
//!
//! Also here, without a browser: the console's assets and headers, and the SSE ticket that
//! replaces `?access_token=` (bound to its run and tenant, expiring).

use crate::bridge_support;
use crate::common;

use std::path::PathBuf;
use std::process::Stdio;
use std::time::{Duration, Instant};

use bridge_support::{ACME, ACME_READ, Api, GLOBEX, TestBridge, bridge_config, spawn_projector};
use common::{Harness, STORED_NOT_COMMITTED, Svc};
use kedge_core::RunStatus;
use kedge_core::ids::RunId;
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

const WAIT: Duration = Duration::from_secs(60);

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn install_browser() {
    let setup = std::process::Command::new("bash")
        .arg(repo().join("scripts/browser-test.sh"))
        .arg("--install-only")
        .status()
        .expect("run scripts/browser-test.sh");
    assert!(
        setup.success(),
        "scripts/browser-test.sh --install-only failed: chromium and playwright-core are needed"
    );
}

/// `live`: a question, then a slowly streamed step with a tool call (it starts when the person
/// answers, so the page is there to see it stream), two operations that need approval, a final
/// answer. `slow`: waits on a ten-minute timer. `amb`: a shell command whose
/// runner dies mid-effect.
fn script() -> Value {
    let long: String = (1..=60).map(|i| format!("token{i} ")).collect();
    json!({"models": {
        "live": {"steps": [
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Which colour? <script>alert(1)</script>"}}]},
            {"text": format!("Looking around: {long}"), "delay_ms": 300, "chunk_delay_ms": 150,
             "tool_calls": [{"name": "write_file", "arguments": {"path": "notes.txt", "content": "<b>not markup</b>"}}]},
            {"text": "paying", "fault": {"status": 503, "times": 1},
             "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay 100 to <img src=x>"}}]},
            {"text": "paying again", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay 200"}}]},
            {"text": "trip planned"}
        ]},
        "slow": {"steps": [
            {"text": "waiting", "tool_calls": [{"name": "wait", "arguments": {"seconds": 600}}]},
            {"text": "woke"}
        ]},
        "sleepy": {"steps": [
            {"text": "sleeping", "tool_calls": [{"name": "shell", "arguments": {"command": "sleep", "args": ["6"]}}]},
            {"text": "woke"}
        ]},
        "amb": {"steps": [
            {"text": "running", "tool_calls": [{"name": "shell", "arguments": {"command": "echo", "args": ["once"]}}]},
            {"text": "done"}
        ]}
    }})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_person_runs_the_human_side_of_runs_in_the_console_across_a_bridge_restart() {
    install_browser();
    let t0 = Instant::now();
    // Tools may run 8 s (the command cancelled mid-run must still be running when it is).
    let mut h = Harness::start_with(script(), &[Svc::Intake, Svc::Step], |c| {
        c.timeouts.tool_timeout_ms = 8_000;
        c.timeouts.tool_ack_wait_ms = 10_000;
    })
    .await;
    h.agent_with_policy(
        "live",
        "live",
        json!({"ledger_append": {"approval": "always", "risk": "high", "approval_ttl_secs": 3600}}),
    )
    .await;
    // The live agent's model has a price, so the run page shows what the run cost.
    let (_, def) =
        h.rt.agents
            .latest(&"live".parse().expect("name"))
            .await
            .expect("the live agent");
    let mut def = (*def).clone();
    def.model.price = Some(
        serde_json::from_value(json!({"input_per_mtok": 3.0, "output_per_mtok": 15.0}))
            .expect("price"),
    );
    h.rt.agents.put(&def).await.expect("priced agent stored");
    h.agent("slow", "slow").await;
    h.agent("sleepy", "sleepy").await;
    h.agent("amb", "amb").await;

    // The ambiguous runs first, while the only tool runner is one that dies after the effect:
    // one to resolve, one to cancel (it stays `cancelling` until its operation is resolved).
    let doomed = h.spawn_process("tool", "w-doomed", "tool.after_effect");
    let amb = h.submit("amb", "go", "console-amb-1").await;
    assert!(h.wait_exit(doomed, WAIT).await, "the doomed runner died");
    let doomed = h.spawn_process("tool", "w-doomed-2", "tool.after_effect");
    let amb2 = h.submit("amb", "go again", "console-amb-2").await;
    assert!(
        h.wait_exit(doomed, WAIT).await,
        "the second doomed runner died"
    );
    h.spawn_service(Svc::Tool, "w-fresh");
    h.wait_for(&amb, WAIT, |s| s.status == RunStatus::Unknown)
        .await;
    h.wait_for(&amb2, WAIT, |s| s.status == RunStatus::Unknown)
        .await;

    let projector = spawn_projector(&h.config);
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let mut bridge = TestBridge::start(config.clone(), "127.0.0.1:0").await;
    let addr = bridge.addr.to_string();
    let base = bridge.url();
    let api = Api::new(&base, Some(ACME));
    let (s, b) = api.submit("slow", "wait a while", "console-slow-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let slow: RunId = b["run_id"].as_str().expect("run").parse().expect("id");
    h.wait_for(&slow, WAIT, |s| s.status == RunStatus::WaitingExternal)
        .await;

    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&shots).expect("screenshot dir");
    let _ = std::fs::remove_file(shots.join("failure.png"));
    let profile = tempfile::tempdir().expect("profile dir");
    let cfg = json!({
        "base": base, "token": ACME, "read_token": ACME_READ, "agent": "live",
        "runs": {"cancel": slow, "amb": amb, "amb_cancel": amb2},
        "shots": shots, "profile": profile.path(), "timeout_ms": 60_000,
    });
    let mut node = tokio::process::Command::new("node")
        .arg(repo().join("crates/kedge/tests/browser/console.mjs"))
        .arg(repo().join(".tools/browser"))
        .arg(cfg.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn()
        .expect("spawn node");
    let mut stdin = node.stdin.take().expect("stdin");
    let mut lines = BufReader::new(node.stdout.take().expect("stdout")).lines();
    let seen: Value = loop {
        let line = tokio::time::timeout(Duration::from_secs(120), lines.next_line())
            .await
            .expect("the driver went silent")
            .expect("read")
            .expect("driver exited without a result");
        if line.starts_with('{') {
            break serde_json::from_str(&line).expect("result JSON");
        }
        eprintln!("console: {line} ({:?})", t0.elapsed());
        if line == "sync restart" {
            bridge.stop().await;
            tokio::time::sleep(Duration::from_millis(300)).await;
            bridge = TestBridge::start(config.clone(), &addr).await;
            stdin.write_all(b"ok\n").await.expect("reply");
            stdin.flush().await.expect("flush");
        }
    };
    let status = node.wait().await.expect("driver exit");
    eprintln!("console: screenshots in {}", shots.display());
    eprintln!(
        "console: stream opens {}, connection states {}, deltas {}, read from /history at the end {}",
        seen["opens"], seen["conn_log"], seen["deltas"], seen["caught_up"]
    );
    assert!(status.success(), "driver: {status}; saw {seen:#}");
    assert_eq!(seen["ok"], true, "{seen:#}");

    // Read-only: no action at all; the token left the tab on sign-out.
    assert_eq!(seen["read_scope"], "read");
    assert_eq!(seen["read_only_buttons"], 0, "{seen:#}");
    assert!(seen["read_only_timer_due"].as_str().is_some(), "{seen:#}");
    assert_eq!(seen["token_after_signout"], 0);
    assert!(
        seen["forbidden_error"]
            .as_str()
            .is_some_and(|e| e.starts_with("403 Forbidden")),
        "a refusal is shown: {seen:#}"
    );
    assert_eq!(seen["storage_has_token"], true);
    assert_eq!(
        seen["local_storage_len"], 0,
        "the token is not kept beyond the tab"
    );
    assert_eq!(seen["token_in_url"], false, "no token in any URL");
    assert_eq!(seen["filtered_rows"], 1, "{seen:#}");

    // Live: deltas streamed into the step, and the page reconnected by itself.
    assert_eq!(seen["saw_live_text"], true);
    assert!(seen["deltas"].as_u64().unwrap_or(0) > 0, "{seen:#}");
    assert!(seen["opens"].as_u64().unwrap_or(0) >= 2, "{seen:#}");

    // The approval dialog showed exactly what the digest covers, and the console sent it.
    let run: RunId = seen["run"].as_str().expect("run").parse().expect("id");
    assert_eq!(
        seen["dialog_args"],
        json!({"text": "pay 100 to <img src=x>"})
    );
    assert_eq!(seen["first_decision"]["verdict"], "approve", "{seen:#}");
    assert_eq!(
        seen["first_decision"]["digest"], seen["first_decision"]["shown"],
        "the console sent the digest it showed"
    );
    assert_eq!(seen["dialog_digest"], seen["first_decision"]["shown"]);
    assert_eq!(seen["dialog_focused"], "approve");
    assert_eq!(seen["other_decision"], 202);
    let stale = seen["stale_error"].as_str().unwrap_or("");
    assert!(
        stale.starts_with("409"),
        "the stale approval is refused: {stale}"
    );

    // The run: one payment (the approved one), the answer reached it, the timeline equals
    // /history: every public event once, in order.
    let done = h.wait_terminal(&run, Duration::from_secs(5)).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert_eq!(h.ledger().len(), 1, "{:?}", h.ledger());
    let history = api.history_ids(run.as_str()).await;
    let page: Vec<u64> = seq_list(&seen["page_seqs"]);
    assert_eq!(page, history, "the page's events vs /history");
    let mut dom = seq_list(&seen["dom_seqs"]);
    dom.sort_unstable();
    assert_eq!(dom, history, "the timeline's rendered events vs /history");
    assert!(
        seen["revived_turn"]
            .as_str()
            .is_some_and(|t| t.starts_with("turn 2")),
        "the message revived the run into turn 2: {seen:#}"
    );
    assert_eq!(done.turn, 2);
    assert!(
        seen["result_text"].as_str().is_some_and(|t| !t.is_empty()),
        "{seen:#}"
    );
    assert!(
        seen["usage_text"]
            .as_str()
            .is_some_and(|t| t.contains(" tokens; cost 0.0") && t.ends_with(" USD")),
        "usage and cost: {seen:#}"
    );
    // The model's failed attempt is shown with its error.
    assert!(
        seen["attempt_errors"].as_array().is_some_and(|a| a
            .iter()
            .any(|e| e.as_str().is_some_and(|e| e.contains("503")))),
        "{seen:#}"
    );
    assert!(
        seen["durations"].as_array().is_some_and(|d| d
            .iter()
            .any(|t| t.as_str().is_some_and(|t| t.ends_with(" ms")))),
        "tool results show their duration: {seen:#}"
    );
    assert!(
        seen["phone_overflow"].as_i64().unwrap_or(1) <= 0,
        "nothing is wider than a phone: {seen:#}"
    );
    assert!(
        seen["console_errors"].as_array().is_some_and(|e| e
            .iter()
            .all(|m| !m.as_str().unwrap_or("").contains("Content Security Policy"))),
        "no CSP violation: {seen:#}"
    );

    // The cancelled and the resolved runs.
    let cancelled = h.wait_terminal(&slow, Duration::from_secs(5)).await;
    assert_eq!(cancelled.status, RunStatus::Cancelled);
    assert_eq!(seen["cancel_buttons_after"], 0);
    assert!(
        seen["cancel_timer_words"]
            .as_str()
            .is_some_and(|w| w.contains("timer is due")),
        "{seen:#}"
    );
    // Cancelled while a command ran: `cancelling`, the command stopped (its result may land
    // before or after `run.cancelling`), then `cancelled`.
    let mut evs: Vec<&str> = seen["sleepy_events"]
        .as_array()
        .map(|a| a.iter().filter_map(Value::as_str).collect())
        .unwrap_or_default();
    assert_eq!(evs.first(), Some(&"cancel.requested"), "{seen:#}");
    assert_eq!(evs.last(), Some(&"run.cancelled"), "{seen:#}");
    evs.sort_unstable();
    assert_eq!(
        evs,
        [
            "cancel.requested",
            "run.cancelled",
            "run.cancelling",
            "tool.result"
        ],
        "{seen:#}"
    );
    let sleepy: RunId = seen["sleepy"].as_str().expect("run").parse().expect("id");
    let sleepy = h.wait_terminal(&sleepy, Duration::from_secs(5)).await;
    assert_eq!(sleepy.status, RunStatus::Cancelled);
    // Cancelled while an operation's fate was unknown: it stays there (the cancel request
    // shown) until a person resolves the operation; then it is cancelled.
    assert_eq!(
        seen["amb_cancel_statuses"],
        json!(["unknown", "cancelled"]),
        "{seen:#}"
    );
    assert_eq!(seen["amb_cancel_still"], "unknown");
    assert!(
        seen["amb_cancel_words"]
            .as_str()
            .is_some_and(|w| w.contains("Cancellation requested")),
        "{seen:#}"
    );
    let cancelled = h.wait_terminal(&amb2, Duration::from_secs(5)).await;
    assert_eq!(cancelled.status, RunStatus::Cancelled);
    let resolved = h.wait_terminal(&amb, Duration::from_secs(5)).await;
    assert_eq!(resolved.status, RunStatus::Succeeded);
    let op = resolved.ops.values().next().expect("the op");
    assert_eq!(
        op.result.as_ref().map(|r| r.content.as_str()),
        Some("it did run")
    );
    // Paging: ten newest first, then the older ones, no run on both pages, and back.
    let strs = |v: &Value| -> Vec<String> {
        v.as_array()
            .map(|a| {
                a.iter()
                    .filter_map(Value::as_str)
                    .map(str::to_owned)
                    .collect()
            })
            .unwrap_or_default()
    };
    let page1 = strs(&seen["paging"]["page1"]);
    let page2 = strs(&seen["paging"]["page2"]);
    assert_eq!(page1.len(), 10, "{seen:#}");
    assert!(!page2.is_empty(), "{seen:#}");
    assert!(page2.iter().all(|r| !page1.contains(r)), "{seen:#}");
    assert_eq!(seen["paging"]["back"], seen["paging"]["page1"]);
    assert_eq!(seen["newer_enabled"], true);
    let created = strs(&seen["page1_created"]);
    assert!(
        created.windows(2).all(|w| w[0] >= w[1]),
        "newest first: {created:?}"
    );
    for f in [
        "run-page.png",
        "approval-dialog.png",
        "approval-stale-409.png",
    ] {
        assert!(shots.join(f).is_file(), "{f} written");
    }
    eprintln!("console scenario: {:?}", t0.elapsed());
    projector.abort();
    bridge.stop().await;
    h.shutdown().await;
}

fn seq_list(v: &Value) -> Vec<u64> {
    v.as_array()
        .map(|a| a.iter().filter_map(Value::as_u64).collect())
        .unwrap_or_default()
}

fn cookie_of(resp: &reqwest::Response) -> Option<String> {
    resp.headers()
        .get_all("set-cookie")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .find(|v| v.starts_with("kedge_sse="))
        .map(str::to_owned)
}

/// The console's assets and their headers; the SSE ticket: a cookie scoped to one run's stream,
/// acting for its token's tenant, refused on another run, on another tenant's run, when
/// tampered with and once expired; the resolve endpoint's refusals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_console_is_served_with_a_strict_policy_and_sse_tickets_are_bound_and_expire() {
    let script = json!({"models": {"q": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "?"}}]},
        {"text": "ok"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("q", "q").await;
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let base = bridge.url();
    let http = reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client");

    for (path, ct) in [
        ("/", "text/html; charset=utf-8"),
        ("/console/app.js", "text/javascript; charset=utf-8"),
        ("/console/app.css", "text/css; charset=utf-8"),
    ] {
        let r = http.get(format!("{base}{path}")).send().await.expect("get");
        assert_eq!(r.status(), StatusCode::OK, "{path}");
        let hd = r.headers();
        assert_eq!(hd["content-type"], ct, "{path}");
        let csp = hd["content-security-policy"].to_str().expect("csp");
        assert!(
            csp.contains("script-src 'self'") && !csp.contains("unsafe"),
            "{csp}"
        );
        assert_eq!(hd["x-content-type-options"], "nosniff");
        assert_eq!(hd["x-frame-options"], "DENY");
    }

    let acme = Api::new(&base, Some(ACME));
    let (s, b) = acme.submit("q", "ask", "ticket-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let run: RunId = b["run_id"].as_str().expect("run").parse().expect("id");
    let (s, b) = acme.submit("q", "ask", "ticket-2").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let other: RunId = b["run_id"].as_str().expect("run").parse().expect("id");
    let globex = Api::new(&base, Some(GLOBEX));
    let (s, b) = globex.submit("q", "ask", "ticket-3").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let theirs: RunId = b["run_id"].as_str().expect("run").parse().expect("id");
    h.wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;

    let (s, who) = Api::new(&base, Some(ACME_READ)).get("/v1/whoami").await;
    assert_eq!(s, StatusCode::OK);
    assert_eq!(who["tenant"], "acme");
    assert_eq!(who["scope"], "read");
    assert_eq!(who["can_write"], false);

    // A read-only token may ask for a ticket (it only reads).
    let r = http
        .post(format!("{base}/v1/runs/{run}/sse-ticket"))
        .bearer_auth(ACME_READ)
        .send()
        .await
        .expect("ticket");
    assert_eq!(r.status(), StatusCode::OK);
    let cookie = cookie_of(&r).expect("a kedge_sse cookie");
    assert!(
        cookie.contains(&format!("Path=/v1/runs/{run}/events")),
        "{cookie}"
    );
    assert!(
        cookie.contains("HttpOnly") && cookie.contains("SameSite=Strict"),
        "{cookie}"
    );
    assert!(!cookie.contains(ACME_READ), "{cookie}");
    let ticket = cookie
        .split(';')
        .next()
        .and_then(|c| c.strip_prefix("kedge_sse="))
        .expect("value")
        .to_owned();
    let events = |run: &RunId, ticket: &str| {
        let req = http
            .get(format!("{base}/v1/runs/{run}/events"))
            .header("cookie", format!("kedge_sse={ticket}"));
        async move {
            let r = req.send().await.expect("events");
            let status = r.status();
            let ct = r
                .headers()
                .get("content-type")
                .and_then(|v| v.to_str().ok())
                .unwrap_or("")
                .to_owned();
            drop(r);
            (status, ct)
        }
    };
    assert_eq!(
        events(&run, &ticket).await,
        (StatusCode::OK, "text/event-stream".to_owned()),
        "the ticket opens its run's stream"
    );
    assert_eq!(
        events(&other, &ticket).await.0,
        StatusCode::UNAUTHORIZED,
        "not another run's"
    );
    assert_eq!(
        events(&theirs, &ticket).await.0,
        StatusCode::UNAUTHORIZED,
        "not another tenant's"
    );
    let tampered = format!("{}0", &ticket[..ticket.len() - 1]);
    let tampered = if tampered == ticket {
        format!("{}1", &ticket[..ticket.len() - 1])
    } else {
        tampered
    };
    assert_eq!(events(&run, &tampered).await.0, StatusCode::UNAUTHORIZED);
    // Another tenant's run: no ticket either (404, like a run that does not exist).
    let r = http
        .post(format!("{base}/v1/runs/{theirs}/sse-ticket"))
        .bearer_auth(ACME)
        .send()
        .await
        .expect("ticket");
    assert_eq!(r.status(), StatusCode::NOT_FOUND);
    assert!(cookie_of(&r).is_none());
    // Expired: a ticket issued longer ago than its lifetime.
    let caller = bridge.bridge.auth.caller_of_token(ACME).expect("caller");
    let long_ago = kedge_bridge::ticket::now_unix() - bridge.bridge.auth.ticket_ttl().as_secs() - 1;
    let (expired, _) = bridge
        .bridge
        .auth
        .issue_ticket(&caller, &run, long_ago)
        .expect("ticket");
    let r = http
        .get(format!("{base}/v1/runs/{run}/events"))
        .header("cookie", format!("kedge_sse={expired}"))
        .send()
        .await
        .expect("events");
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
    let body: Value = r.json().await.expect("problem");
    assert!(
        body["detail"]
            .as_str()
            .is_some_and(|d| d.contains("expired")),
        "{body}"
    );
    // The ticket authenticates the stream only: not the run view, not a write.
    let r = http
        .get(format!("{base}/v1/runs/{run}"))
        .header("cookie", format!("kedge_sse={ticket}"))
        .send()
        .await
        .expect("view");
    assert_eq!(r.status(), StatusCode::UNAUTHORIZED);

    // Resolve: refused for a read-only token, an unknown operation, one that is not ambiguous.
    let state = h.state(&run).await;
    let op = state.ops.keys().next().expect("the ask_user op").clone();
    let body = json!({"resolution": "completed", "content": "x"});
    let (s, _) = Api::new(&base, Some(ACME_READ))
        .post(&format!("/v1/runs/{run}/operations/{op}/resolve"), &body)
        .await;
    assert_eq!(s, StatusCode::FORBIDDEN);
    let (s, b) = acme
        .post(&format!("/v1/runs/{run}/operations/{op}/resolve"), &body)
        .await;
    assert_eq!(s, StatusCode::CONFLICT, "{b}");
    assert_eq!(b["type"], "urn:kedge:problem:operation-not-ambiguous");
    let theirs_state = h
        .wait_for(&other, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let stranger = theirs_state.ops.keys().next().expect("an op").clone();
    let (s, _) = acme
        .post(
            &format!("/v1/runs/{run}/operations/{stranger}/resolve"),
            &body,
        )
        .await;
    assert_eq!(s, StatusCode::NOT_FOUND);
    let (s, b) = acme
        .post(
            &format!("/v1/runs/{run}/operations/{op}/resolve"),
            &json!({"resolution": "maybe"}),
        )
        .await;
    assert_eq!(s, StatusCode::UNPROCESSABLE_ENTITY, "{b}");
    bridge.stop().await;
    h.shutdown().await;
}

/// About 2,000 events: 19 steps of 35 tool calls each, then an answer.
fn big_script() -> Value {
    let mut steps: Vec<Value> = (0..19)
        .map(|i| {
            let calls: Vec<Value> = (0..35)
                .map(|j| json!({"name": "write_file", "arguments": {"path": format!("f{i}_{j}.txt"), "content": "x"}}))
                .collect();
            json!({"text": format!("batch {i}"), "delay_ms": 200, "tool_calls": calls})
        })
        .collect();
    steps.push(json!({"text": "all written"}));
    json!({"models": {"big": {"steps": steps}}})
}

/// A run of about 2,000 events stays usable: rendered in bounded batches while it executes and
/// when it is replayed at once (reloaded after it ended), every event once, with no long block
/// of the page.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_of_two_thousand_events_renders_incrementally_and_the_page_stays_responsive() {
    install_browser();
    let h = Harness::start(big_script(), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("big", "big").await;
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let base = bridge.url();
    let api = Api::new(&base, Some(ACME));
    let (s, b) = api.submit("big", "write them all", "console-big-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let run: RunId = b["run_id"].as_str().expect("run").parse().expect("id");

    let seen = watch_run(&base, &run, "long-run.png").await;
    let done = h.wait_terminal(&run, Duration::from_secs(5)).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    let history = api.history_ids(run.as_str()).await;
    assert!(history.len() >= 2_000, "{} events", history.len());
    for phase in ["live", "replay"] {
        let p = &seen[phase];
        let long: Vec<u64> = seq_list(&p["long_tasks"]);
        eprintln!(
            "console, {} events {phase}: all shown in {} ms, slowest answer to a script {} ms, long tasks (ms) {:?}",
            history.len(),
            p["ms"],
            p["slowest_answer_ms"],
            long
        );
        assert_eq!(
            seq_list(&p["seqs"]),
            history,
            "{phase}: every event once, in order"
        );
        assert_eq!(
            p["rendered"].as_u64(),
            Some(history.len() as u64),
            "{phase}"
        );
        // Generous bounds (a debug build on two shared cores): no single task blocks the page
        // for long, and the page answers while it renders.
        assert!(
            long.iter().all(|d| *d < 1_000),
            "{phase}: a task blocked the page: {long:?}"
        );
        assert!(
            p["slowest_answer_ms"].as_u64().unwrap_or(u64::MAX) < 2_000,
            "{phase}: {p}"
        );
    }
    assert!(seen["replay"]["type_ms"].as_u64().unwrap_or(u64::MAX) < 2_000);
    bridge.stop().await;
    h.shutdown().await;
}

/// Runs `console_big.mjs` on `run`: the run page live until the run ended, then reloaded.
async fn watch_run(base: &str, run: &RunId, shot: &str) -> Value {
    let shots = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("console-screenshots");
    std::fs::create_dir_all(&shots).expect("screenshot dir");
    let profile = tempfile::tempdir().expect("profile dir");
    let cfg = json!({
        "base": base, "token": ACME, "run": run, "shots": shots, "shot": shot,
        "profile": profile.path(), "timeout_ms": 120_000,
    });
    let out = tokio::time::timeout(
        Duration::from_secs(300),
        tokio::process::Command::new("node")
            .arg(repo().join("crates/kedge/tests/browser/console_big.mjs"))
            .arg(repo().join(".tools/browser"))
            .arg(cfg.to_string())
            .stderr(Stdio::inherit())
            .kill_on_drop(true)
            .output(),
    )
    .await
    .expect("the driver finished")
    .expect("node ran");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let seen: Value = stdout
        .lines()
        .rev()
        .find(|l| l.starts_with('{'))
        .and_then(|l| serde_json::from_str(l).ok())
        .unwrap_or(Value::Null);
    assert!(out.status.success(), "driver: {}; {stdout}", out.status);
    assert_eq!(seen["ok"], true);
    seen
}

/// A step worker dies right after the model's answer was stored; the next one reuses it (no
/// second bill), and the timeline marks that step's answer as reused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reused_model_response_is_marked_in_the_timeline() {
    install_browser();
    let script = json!({"models": {"r": {"steps": [{"text": "the answer", "delay_ms": 200}]}}});
    let mut h = Harness::start(script, &[Svc::Intake]).await;
    h.agent("r", "r").await;
    let crashing = h.spawn_process("step", "w-step-1", STORED_NOT_COMMITTED);
    let config = bridge_config(&h.config, "127.0.0.1:0");
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let base = bridge.url();
    let api = Api::new(&base, Some(ACME));
    let (s, b) = api.submit("r", "answer once", "console-reused-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{b}");
    let run: RunId = b["run_id"].as_str().expect("run").parse().expect("id");
    assert!(
        h.wait_exit(crashing, WAIT).await,
        "the step worker did not reach its failpoint"
    );
    h.spawn_service(Svc::Step, "w-step-2");
    let seen = watch_run(&base, &run, "reused-response.png").await;
    let done = h.wait_terminal(&run, Duration::from_secs(5)).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert_eq!(h.mock.total_calls(), 1, "the model was called once");
    assert_eq!(
        seq_list(&seen["replay"]["seqs"]),
        api.history_ids(run.as_str()).await
    );
    assert_eq!(
        seen["reused"].as_array().map(Vec::len),
        Some(1),
        "the reused answer is marked: {seen}"
    );
    bridge.stop().await;
    h.shutdown().await;
}
