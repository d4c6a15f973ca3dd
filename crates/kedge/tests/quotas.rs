//! Tenant quotas counted once for the fleet (docs/ARCHITECTURE.md "Quotas"): runs started per
//! minute and unfinished runs hold across two bridges, the tenant gateway and a task published
//! to intake directly, all at once (the sum admitted is the quota; the rest get 429 with
//! `Retry-After`, or a rejection naming the quota); a tenant over its tokens of the day has its
//! run wait, holding nothing, until the day window rolls, then go on without a second model
//! call for the same step, while another tenant is not affected.

use crate::bridge_support;
use crate::common;

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use bridge_support::{ACME, GLOBEX, TestBridge, bridge_config};
use common::{Harness, Svc, TENANTS, secured, tenant_password};
use kedge_core::RunStatus;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::quota::QuotaLimits;
use kedge_core::task::TaskSubmission;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

fn tenant(t: &str) -> TenantId {
    t.parse().expect("tenant")
}

/// How one door answered a task.
#[derive(Debug)]
enum Door {
    Admitted,
    /// Refused: the quota named and the seconds to wait.
    Refused(String, u64),
}

/// `POST /v1/runs` on `bridge` with `token`.
async fn http_submit(
    http: &reqwest::Client,
    bridge: &str,
    token: &str,
    agent: &str,
    key: &str,
) -> Door {
    let resp = http
        .post(format!("{bridge}/v1/runs"))
        .bearer_auth(token)
        .header("Idempotency-Key", key)
        .json(&json!({"agent": agent, "input": "go"}))
        .send()
        .await
        .expect("sent");
    let status = resp.status().as_u16();
    let retry = resp
        .headers()
        .get("retry-after")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    let body: Value = resp.json().await.expect("JSON");
    match status {
        202 => Door::Admitted,
        429 => {
            let detail = body["detail"].as_str().unwrap_or_default().to_owned();
            Door::Refused(detail, retry.expect("a 429 has Retry-After"))
        }
        other => panic!("the bridge answered {other}: {body}"),
    }
}

/// A task over the tenant gateway (a JetStream publish from the tenant's account).
async fn gateway_submit(client: &async_nats::Client, agent: &str, key: &str) -> Door {
    let mut headers = HeaderMap::new();
    headers.insert("Nats-Msg-Id", key);
    let reply = client
        .request_with_headers(
            format!("agent.task.{agent}"),
            headers,
            json!({"agent": agent, "input": "go"}).to_string().into(),
        )
        .await
        .expect("the gateway answers");
    let v: Value = serde_json::from_slice(&reply.payload).expect("JSON");
    if v["run_id"].is_string() {
        return Door::Admitted;
    }
    assert_eq!(v["error"]["code"], 429, "{v}");
    let d = v["error"]["description"]
        .as_str()
        .unwrap_or_default()
        .to_owned();
    let secs = d
        .split("retry after ")
        .nth(1)
        .and_then(|r| r.split(' ').next())
        .and_then(|n| n.parse().ok())
        .expect("the description says when");
    Door::Refused(d, secs)
}

/// A task published to intake directly (the harness's operator connection), for tenant `acme`.
async fn intake_submit(h: &Harness, agent: &str, key: &str) -> Door {
    let task = TaskSubmission::new(agent.parse().expect("agent"), "go");
    match h.submit_task(&task, key).await {
        kedge_intake::Answer::Accepted { .. } => Door::Admitted,
        kedge_intake::Answer::Rejected { error } => {
            assert!(error.field.starts_with("quota."), "{error:?}");
            Door::Refused(error.reason, error.retry_after_secs.expect("retry after"))
        }
    }
}

/// Waits until the gateway answers (it subscribes in the background).
async fn gateway_ready(client: &async_nats::Client) {
    let deadline = Instant::now() + WAIT;
    while client
        .request("kedge.runs.run_probe", "{}".into())
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the gateway never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn script() -> Value {
    json!({"models": {
        "quick": {"steps": [{"text": "done"}]},
        "ask": {"steps": [
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "?"}}]},
            {"text": "done"}
        ]},
        "acme-talk": {"steps": [{"text": "hello from acme"}]},
        "globex-talk": {"steps": [{"text": "hello from globex"}]}
    }})
}

/// Counts the answers: admitted, and the refusals (each naming `quota` with a wait of 1..=max).
fn tally(answers: &[Door], quota: &str, max_wait: u64) -> usize {
    let mut admitted = 0;
    for a in answers {
        match a {
            Door::Admitted => admitted += 1,
            Door::Refused(why, secs) => {
                assert!(why.contains(quota), "{why}");
                assert!((1..=max_wait).contains(secs), "{secs} s: {why}");
            }
        }
    }
    admitted
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn run_quotas_hold_for_the_fleet_at_every_door() {
    if !secured() {
        eprintln!("KEDGE_TEST_OPEN is set: the gateway needs the secured server; skipped");
        return;
    }
    let h = Harness::start_with(
        script(),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Gateway],
        |c| {
            // acme: 6 runs a minute (a long minute: the window does not roll in the test);
            // globex: 3 unfinished runs.
            c.quotas.minute_secs = 3_600;
            c.quotas.tenants.insert(
                tenant("acme"),
                QuotaLimits {
                    runs_per_minute: 6,
                    ..QuotaLimits::default()
                },
            );
            c.quotas.tenants.insert(
                tenant("globex"),
                QuotaLimits {
                    max_active_runs: 3,
                    ..QuotaLimits::default()
                },
            );
        },
    )
    .await;
    h.agent("quick", "quick").await;
    h.agent("ask", "ask").await;
    let one = TestBridge::start(bridge_config(&h.config, "127.0.0.1:0"), "127.0.0.1:0").await;
    let two = TestBridge::start(bridge_config(&h.config, "127.0.0.1:0"), "127.0.0.1:0").await;
    let connect = |user: &str| {
        async_nats::ConnectOptions::with_user_and_password(user.to_owned(), tenant_password(user))
            .connect(h.nats.url())
    };
    let acme_nats = connect(TENANTS[0].1).await.expect("acme connects");
    let globex_nats = connect(TENANTS[1].1).await.expect("globex connects");
    gateway_ready(&acme_nats).await;
    let http = reqwest::Client::new();
    let (u1, u2) = (one.url(), two.url());

    // Runs per minute: 16 tasks of acme at once, through both bridges, the gateway and intake.
    let mut tasks = Vec::new();
    for i in 0..4 {
        let (http, u1, u2, acme_nats) = (http.clone(), u1.clone(), u2.clone(), acme_nats.clone());
        tasks.push(tokio::spawn(async move {
            vec![
                http_submit(&http, &u1, ACME, "quick", &format!("b1-{i}")).await,
                http_submit(&http, &u2, ACME, "quick", &format!("b2-{i}")).await,
                gateway_submit(&acme_nats, "quick", &format!("gw-{i}")).await,
            ]
        }));
    }
    let mut answers = Vec::new();
    for i in 0..4 {
        answers.push(intake_submit(&h, "quick", &format!("in-{i}")).await);
    }
    for t in tasks {
        answers.extend(t.await.expect("task"));
    }
    assert_eq!(answers.len(), 16);
    assert_eq!(tally(&answers, "runs_per_minute", 3_600), 6, "{answers:?}");
    // Each door refused something or admitted something: the count is one for all of them.
    let usage =
        h.rt.quotas()
            .await
            .expect("quotas")
            .usage(&tenant("acme"))
            .await
            .expect("usage");
    assert_eq!(usage.runs_this_minute, 6);
    // Another tenant is not affected by acme's minute.
    assert!(matches!(
        http_submit(&http, &u1, GLOBEX, "quick", "g-quick").await,
        Door::Admitted
    ));

    // Unfinished runs: globex has one (the quick run, which ends by itself) and may have 3.
    // Wait for it to end (counted out), then 9 tasks of runs that wait for an answer, at once.
    let deadline = Instant::now() + WAIT;
    while !h
        .rt
        .quotas()
        .await
        .expect("q")
        .active(&tenant("globex"))
        .await
        .expect("a")
        .is_empty()
    {
        assert!(
            Instant::now() < deadline,
            "the quick run was never counted out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let mut tasks = Vec::new();
    for i in 0..3 {
        let (http, u1, u2, globex_nats) =
            (http.clone(), u1.clone(), u2.clone(), globex_nats.clone());
        tasks.push(tokio::spawn(async move {
            vec![
                http_submit(&http, &u1, GLOBEX, "ask", &format!("a1-{i}")).await,
                http_submit(&http, &u2, GLOBEX, "ask", &format!("a2-{i}")).await,
                gateway_submit(&globex_nats, "ask", &format!("ga-{i}")).await,
            ]
        }));
    }
    let mut answers = Vec::new();
    for t in tasks {
        answers.extend(t.await.expect("task"));
    }
    assert_eq!(tally(&answers, "max_active_runs", 10), 3, "{answers:?}");
    let active =
        h.rt.quotas()
            .await
            .expect("q")
            .active(&tenant("globex"))
            .await
            .expect("a");
    assert_eq!(active.len(), 3);
    // One of them ends (cancelled): its slot comes back, at either door.
    let ended: RunId = active[0].clone();
    h.input(
        &ended,
        kedge_core::Event::CancelRequested(kedge_core::event::CancelRequested {
            reason: "make room".into(),
            by: None,
        }),
        "quota-cancel",
    )
    .await;
    h.wait_for(&ended, WAIT, |s| s.status == RunStatus::Cancelled)
        .await;
    let deadline = Instant::now() + WAIT;
    for attempt in 0.. {
        match gateway_submit(&globex_nats, "ask", &format!("again-{attempt}")).await {
            Door::Admitted => break,
            Door::Refused(why, _) => {
                assert!(why.contains("max_active_runs"), "{why}");
                assert!(
                    Instant::now() < deadline,
                    "the ended run's slot never came back"
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        }
    }
    assert!(matches!(
        http_submit(&http, &u2, GLOBEX, "ask", "a-last").await,
        Door::Refused(..)
    ));
    one.stop().await;
    two.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_over_its_tokens_of_the_day_waits_for_the_next_day_and_others_go_on() {
    const DAY: u64 = 12;
    let h = Harness::start_with(script(), &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        // A short "day": the window rolls within the test.
        c.quotas.day_secs = DAY;
        c.quotas.tenants.insert(
            tenant("acme"),
            QuotaLimits {
                tokens_per_day: 1,
                ..QuotaLimits::default()
            },
        );
        c.quotas.tenants.insert(
            tenant("globex"),
            QuotaLimits {
                runs_per_minute: 1_000,
                ..QuotaLimits::default()
            },
        );
    })
    .await;
    h.agent("acme-talk", "acme-talk").await;
    h.agent("globex-talk", "globex-talk").await;
    // Starts at the beginning of a day window, so that it does not roll before the second run
    // asks for the model.
    let day_ms = DAY * 1000;
    loop {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .expect("clock")
            .as_millis() as u64;
        if now % day_ms < 300 {
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // The first call of the day is allowed and spends the day's token (and more).
    let first = h.submit("acme-talk", "one", "t-1").await;
    let s = h.wait_for(&first, WAIT, |s| s.status.is_terminal()).await;
    assert_eq!(s.status, RunStatus::Succeeded);
    let quotas = h.rt.quotas().await.expect("quotas");
    let used = quotas.usage(&tenant("acme")).await.expect("usage");
    assert!(used.today.tokens >= 1 && used.today.calls == 1, "{used:?}");
    let calls_before = h.mock.requests("acme-talk").len();
    // The second run waits for the day to roll, holding nothing, without calling the model.
    let second = h.submit("acme-talk", "two", "t-2").await;
    let s = h
        .wait_for(&second, WAIT, |s| s.status == RunStatus::WaitingProvider)
        .await;
    assert!(s.provider.is_some(), "waits like a run on its provider");
    assert_eq!(
        h.mock.requests("acme-talk").len(),
        calls_before,
        "no call while over"
    );
    // Another tenant goes on meanwhile.
    let task = TaskSubmission::new("globex-talk".parse().expect("agent"), "three");
    let submission = kedge_intake::Submission {
        task: &task,
        key: "t-3",
        tenant: "globex",
        caller: Some("test"),
    };
    let other = kedge_intake::submit(&h.rt.client, &submission, WAIT)
        .await
        .expect("intake answered");
    let kedge_intake::Answer::Accepted { run_id: other } = other else {
        panic!("globex refused: {other:?}");
    };
    let s = h.wait_for(&other, WAIT, |s| s.status.is_terminal()).await;
    assert_eq!(s.status, RunStatus::Succeeded);
    // The day rolls: the waiting run calls the model once and succeeds.
    let s = h.wait_for(&second, WAIT, |s| s.status.is_terminal()).await;
    assert_eq!(s.status, RunStatus::Succeeded);
    assert_eq!(
        h.mock.requests("acme-talk").len(),
        calls_before + 1,
        "one model call for the step that waited"
    );
    let journal = h.events(&second).await;
    let held = journal
        .iter()
        .filter(|r| r.envelope.event_type() == kedge_core::event::EventType::ModelAttempt)
        .count();
    assert!(held >= 1, "the held attempt is journaled");
}

/// A run that ended without being counted out (a step process killed between the run's end and
/// its count-out, simulated by counting it in again) and a task admitted that never became a run
/// hold slots of the tenant's unfinished runs until the reconciler's repair counts them out;
/// `kedge tenants usage` shows the tenant's use against its limits.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_reconciler_repairs_counts_a_crash_left_and_the_cli_shows_usage() {
    let quotas = json!({
        "tenants": {"acme": {"max_active_runs": 2}},
        "repair_secs": 1
    });
    let q = quotas.clone();
    let h = Harness::start_with(script(), &[Svc::Intake, Svc::Step, Svc::Tool], move |c| {
        c.quotas = serde_json::from_value(q).expect("quotas");
    })
    .await;
    h.agent("quick", "quick").await;
    h.agent("ask", "ask").await;
    let acme = tenant("acme");
    let counts = h.rt.quotas().await.expect("quotas");
    let done = h.submit("quick", "go", "r-1").await;
    h.wait_for(&done, WAIT, |s| s.status == RunStatus::Succeeded)
        .await;
    let deadline = Instant::now() + WAIT;
    while !counts.active(&acme).await.expect("active").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the ended run was never counted out"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // What a crash leaves: the ended run still counted, and a run admitted but never created.
    counts.restore(&acme, &done).await.expect("counted in");
    let ghost: RunId = format!("run_{:032x}", 7).parse().expect("run id");
    counts
        .admit(&acme, &ghost)
        .await
        .expect("quotas")
        .expect("admitted");
    assert!(matches!(
        intake_submit(&h, "ask", "r-2").await,
        Door::Refused(why, 10) if why.contains("max_active_runs")
    ));
    // The reconciler's repair counts both out (the ghost after two passes without a journal).
    let _reconciler = common::spawn_detached(&h.config, kedge_serve::Service::Reconciler);
    let deadline = Instant::now() + WAIT;
    while !counts.active(&acme).await.expect("active").is_empty() {
        assert!(
            Instant::now() < deadline,
            "the repair never counted them out"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(matches!(
        intake_submit(&h, "ask", "r-3").await,
        Door::Admitted
    ));

    // `kedge tenants usage`, as the operator.
    let mut cmd = std::process::Command::new(env!("CARGO_BIN_EXE_kedge"));
    cmd.args(["tenants", "usage", "acme", "-o", "json"])
        .env("KEDGE_NATS_URL", h.nats.url())
        .env("KEDGE_QUOTAS", quotas.to_string());
    for (k, v) in common::kind_env(&h.config, kedge_runtime::secure::Kind::Operator) {
        cmd.env(k, v);
    }
    let out = cmd.output().expect("kedge runs");
    assert!(out.status.success(), "{out:?}");
    let rows: Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(rows[0]["tenant"], "acme", "{rows}");
    assert_eq!(rows[0]["active_runs"], 1, "{rows}");
    assert_eq!(rows[0]["limits"]["max_active_runs"], 2, "{rows}");
    assert!(rows[0]["today"]["calls"].as_u64() >= Some(1), "{rows}");
}

/// With `on_exceeded: fail` a run of a tenant over its tokens of the day fails, naming the
/// quota, instead of waiting; the model is not called for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tenant_whose_quota_says_fail_has_its_run_fail_naming_the_quota() {
    let h = Harness::start_with(script(), &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.quotas.tenants.insert(
            tenant("acme"),
            QuotaLimits {
                tokens_per_day: 1,
                on_exceeded: kedge_core::quota::OnExceeded::Fail,
                ..QuotaLimits::default()
            },
        );
    })
    .await;
    h.agent("acme-talk", "acme-talk").await;
    let first = h.submit("acme-talk", "one", "f-1").await;
    let s = h.wait_for(&first, WAIT, |s| s.status.is_terminal()).await;
    assert_eq!(s.status, RunStatus::Succeeded);
    let calls = h.mock.requests("acme-talk").len();
    let second = h.submit("acme-talk", "two", "f-2").await;
    let s = h.wait_for(&second, WAIT, |s| s.status.is_terminal()).await;
    assert_eq!(s.status, RunStatus::Failed);
    let failure = s.failure.as_ref().expect("the failure");
    assert_eq!(
        failure.reason,
        kedge_core::event::FailureReason::QuotaExceeded
    );
    assert!(failure.message.contains("tokens_per_day"), "{failure:?}");
    assert_eq!(h.mock.requests("acme-talk").len(), calls, "no call for it");
}
