//! Provider trouble through the real services (docs/ARCHITECTURE.md "Provider trouble"): runs
//! in flight ride out an outage of every kind the strict mock plays (5xx, 529, 429 with and
//! without `retry-after`, connections reset, streams cut) with none failed and none of their
//! attempts spent; the fleet's one breaker per endpoint, shared by two step processes, keeps
//! the requests to the failing endpoint within its probe bound; the waits survive kill -9 of
//! every Kedge process; a wait that outlasts `provider_wait` fails its run naming the provider.
//!
//! `KEDGE_OUTAGE_SECS` (default 4) sets each outage's length (the outage bench's 60 s,
//! docs/PERFORMANCE.md "Provider outage": set it to 60).

use crate::common;

use std::time::{Duration, Instant};

use common::{API_KEY_VAR, Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::FailureReason;
use kedge_core::ids::RunId;
use kedge_mock_llm::{Trouble, TroubleKind};

const RUNS: usize = 50;
const PROBE_INTERVAL: Duration = Duration::from_millis(500);
const WAIT: Duration = Duration::from_secs(90);

fn outage() -> Duration {
    let secs = std::env::var("KEDGE_OUTAGE_SECS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    Duration::from_secs(secs)
}

/// Three tool steps, then the answer: each run calls the model four times, each call taking
/// a moment, so that runs are in flight when an outage begins.
fn script() -> serde_json::Value {
    let step = serde_json::json!({"tool_calls": [{"name": "list_files", "arguments": {}}], "delay_ms": 100});
    serde_json::json!({"models": {
        "mx": {"steps": [step, step, step, {"text": "done", "delay_ms": 100}]},
    }})
}

fn tune(c: &mut kedge_runtime::Config) {
    c.providers.probe_interval = PROBE_INTERVAL;
    c.providers.max_probe_interval = Duration::from_secs(2);
    c.providers.release_per_second = 50;
}

/// The same settings for a `kedge serve` process.
fn provider_env() -> Vec<(&'static str, String)> {
    vec![
        ("KEDGE_PROVIDER_PROBE_INTERVAL", "500ms".into()),
        ("KEDGE_PROVIDER_MAX_PROBE_INTERVAL", "2s".into()),
        ("KEDGE_PROVIDER_RELEASE_PER_SECOND", "50".into()),
    ]
}

async fn submit_many(h: &Harness, agent: &str, tag: &str, n: usize) -> Vec<RunId> {
    let mut runs = Vec::with_capacity(n);
    for i in 0..n {
        runs.push(h.submit(agent, "go", &format!("{tag}-{i}")).await);
    }
    runs
}

/// How many of `runs` are waiting on their provider now.
async fn waiting(h: &Harness, runs: &[RunId]) -> usize {
    statuses(h, runs)
        .await
        .get(&RunStatus::WaitingProvider)
        .copied()
        .unwrap_or(0)
}

/// How many of `runs` are in each status now.
async fn statuses(h: &Harness, runs: &[RunId]) -> std::collections::BTreeMap<RunStatus, usize> {
    let mut by = std::collections::BTreeMap::new();
    for run in runs {
        *by.entry(h.state(run).await.status).or_default() += 1;
    }
    by
}

/// Submits [`RUNS`] runs of `agent`, half of them before the mock's endpoint goes into
/// `trouble` for [`outage`] and half during it, and checks the fleet's bound: once the breaker
/// is open (after the calls in flight when it began), the requests that reach the failing
/// endpoint are the probes alone, at most one per probe interval. Returns the runs.
async fn ride_out(h: &Harness, agent: &str, tag: &str, trouble: Trouble) -> Vec<RunId> {
    let what = format!("{trouble:?}");
    let mut runs = submit_many(h, agent, &format!("{tag}-before"), RUNS / 2).await;
    tokio::time::sleep(Duration::from_millis(150)).await;
    h.mock.set_trouble(Some(trouble));
    let began = Instant::now();
    runs.extend(submit_many(h, agent, &format!("{tag}-during"), RUNS - RUNS / 2).await);
    // The calls in flight when it began meet it, and open the breaker.
    tokio::time::sleep(Duration::from_millis(1500).saturating_sub(began.elapsed())).await;
    let settled = h.mock.troubled_calls();
    let steady = outage().saturating_sub(began.elapsed());
    tokio::time::sleep(steady).await;
    let during = h.mock.troubled_calls() - settled;
    let by_status = statuses(h, &runs).await;
    let held = by_status
        .get(&RunStatus::WaitingProvider)
        .copied()
        .unwrap_or(0);
    h.mock.set_trouble(None);
    let bound = (steady.as_millis() / PROBE_INTERVAL.as_millis()) as u64 + 2;
    assert!(
        during <= bound,
        "{what}: {during} requests reached the failing endpoint in {steady:?} with the breaker open (probe bound {bound})"
    );
    assert!(
        held > 0,
        "{what}: no run was waiting on its provider during the outage: {by_status:?}"
    );
    eprintln!(
        "{what}: {} troubled calls in {:?}, {during} of them in the last {steady:?}; {held} runs waiting at its end",
        h.mock.troubled_calls(),
        began.elapsed()
    );
    runs
}

async fn all_succeed(h: &Harness, runs: &[RunId], what: &str) {
    for run in runs {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(
            state.status,
            RunStatus::Succeeded,
            "{what}: {run} {:?}",
            state.failure
        );
        assert_eq!(state.step.get(), 4, "{what}: every step answered once");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn runs_in_flight_ride_out_an_outage_of_every_kind_through_one_fleet_breaker() {
    let mut h = Harness::start_with(script(), &[Svc::Intake, Svc::Tool, Svc::Timer], tune).await;
    // Two step processes: one breaker and one wait list between them.
    h.spawn_service(Svc::Step, "w-step-a");
    h.spawn_service(Svc::Step, "w-step-b");
    h.agent("outage", "mx").await;
    h.agent_edited("outage-anthropic", "mx", |d| {
        d.model.provider = kedge_core::event::Provider::Anthropic;
        d.model.base_url = Some(h.mock.base_url());
    })
    .await;
    let kinds: Vec<(&str, Trouble)> = vec![
        ("outage", Trouble::new(TroubleKind::Unavailable)),
        ("outage-anthropic", Trouble::new(TroubleKind::Overloaded)),
        // Without retry-after, the rate-limit headers say when the limit resets: the end of
        // this outage (a limit that resets later is waited for, as the provider asks).
        (
            "outage",
            Trouble::new(TroubleKind::RateLimited)
                .lasting(outage())
                .expect("a length"),
        ),
        (
            "outage",
            Trouble::new(TroubleKind::RateLimited)
                .with_retry_after(Duration::from_millis(1500))
                .expect("a retry-after"),
        ),
        ("outage", Trouble::new(TroubleKind::Reset)),
        ("outage", Trouble::new(TroubleKind::StreamCut)),
        (
            "outage",
            Trouble::new(TroubleKind::Unavailable)
                .with_status(502)
                .expect("a 502"),
        ),
    ];
    for (i, (agent, trouble)) in kinds.into_iter().enumerate() {
        let what = format!("{trouble:?}");
        h.mock.mock().reset();
        let runs = ride_out(&h, agent, &format!("kind{i}"), trouble).await;
        all_succeed(&h, &runs, &what).await;
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waits_on_a_provider_survive_kill_9_of_every_kedge_process() {
    let mut h = Harness::start_with(script(), &[], tune).await;
    h.agent("outage", "mx").await;
    let env = provider_env();
    let first = h.spawn_process_with_env("all", "w-all-1", "", &env);
    let runs = submit_many(&h, "outage", "kill", 20).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.mock
        .set_trouble(Some(Trouble::new(TroubleKind::Unavailable)));
    // Every run comes to wait on its provider (the held ones without a request).
    let deadline = Instant::now() + Duration::from_secs(30);
    while waiting(&h, &runs).await < runs.len() {
        assert!(
            Instant::now() < deadline,
            "the runs did not all come to wait"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    h.kill9(first);
    let before = h.mock.troubled_calls();
    let _second = h.spawn_process_with_env("all", "w-all-2", "", &env);
    // Still failing: the new process resumes the fleet's probing, not every run's retry.
    tokio::time::sleep(Duration::from_secs(3)).await;
    let during = h.mock.troubled_calls() - before;
    assert!(
        during <= 3 * 1000 / PROBE_INTERVAL.as_millis() as u64 + 2,
        "{during} requests in 3 s after the restart"
    );
    // The waits survived: every run waits on its provider again (a run released to probe the
    // endpoint is not waiting for the moment its failed call takes, so a look may catch one
    // out; none ended).
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let by = statuses(&h, &runs).await;
        assert!(
            by.keys().all(|s| !s.is_terminal()),
            "a wait ended with the process: {by:?}"
        );
        if by.get(&RunStatus::WaitingProvider) == Some(&runs.len()) {
            break;
        }
        assert!(Instant::now() < deadline, "the waits survived: {by:?}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    h.mock.set_trouble(None);
    all_succeed(&h, &runs, "after kill -9").await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_wait_that_outlasts_provider_wait_fails_the_run_naming_the_provider() {
    let h = Harness::start_with(
        script(),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Timer],
        |c| {
            tune(c);
            c.providers.wait = Duration::from_secs(3);
        },
    )
    .await;
    h.agent("outage", "mx").await;
    h.mock
        .set_trouble(Some(Trouble::new(TroubleKind::Unavailable)));
    let run = h.submit("outage", "go", "give-up").await;
    let state = h.wait_terminal(&run, Duration::from_secs(30)).await;
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.expect("a failure");
    assert_eq!(failure.reason, FailureReason::ProviderUnavailable);
    assert!(
        failure.message.contains(&h.mock.base_url()) && failure.message.contains(API_KEY_VAR),
        "{}",
        failure.message
    );
    assert!(failure.message.contains("503"), "{}", failure.message);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_waits_on_its_provider_visibly_and_goes_on_when_it_is_back() {
    let h = Harness::start_with(
        script(),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Timer],
        tune,
    )
    .await;
    h.agent("outage", "mx").await;
    h.mock.set_trouble(Some(
        Trouble::new(TroubleKind::RateLimited)
            .with_retry_after(Duration::from_millis(800))
            .expect("a retry-after"),
    ));
    let run = h.submit("outage", "go", "visible").await;
    let state = h
        .wait_for(&run, Duration::from_secs(20), |s| {
            s.status == RunStatus::WaitingProvider
        })
        .await;
    // The run view says on what, since when and until when (the CLI, the console, the gateway
    // and the bridge all show this view).
    let events = h.events(&run).await;
    let view = kedge_app::view::run_view(&state, &events);
    let shown = serde_json::to_value(&view).expect("json");
    assert_eq!(shown["status"], "waiting_provider");
    assert_eq!(shown["provider"]["trouble"], "rate_limited");
    assert!(
        shown["provider"]["endpoint"]
            .as_str()
            .is_some_and(|e| e.contains(&h.mock.base_url())),
        "{shown}"
    );
    assert!(shown["provider"]["since"].is_string() && shown["provider"]["give_up_at"].is_string());
    // A few probes go out (and are refused) before the provider is back.
    tokio::time::sleep(Duration::from_secs(2)).await;
    h.mock.set_trouble(None);
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let events = h.events(&run).await;
    let count = |t: &str| {
        events
            .iter()
            .filter(|r| r.envelope.event_type().as_str() == t)
            .count()
    };
    assert!(count("provider.waiting") >= 1 && count("provider.released") >= 1);
    // The attempts that met the trouble spent nothing: the step went on past the cap of 3.
    assert_eq!(state.step.get(), 4);
    common::assert_schema_valid(&events);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_run_started_while_its_endpoint_is_failing_is_held_without_a_request() {
    let h = Harness::start_with(
        script(),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Timer],
        |c| {
            tune(c);
            // No probe during the test's look: the breaker stays open.
            c.providers.probe_interval = Duration::from_secs(30);
            c.providers.max_probe_interval = Duration::from_secs(30);
        },
    )
    .await;
    h.agent("outage", "mx").await;
    h.mock
        .set_trouble(Some(Trouble::new(TroubleKind::Unavailable)));
    // Three runs meet the outage and open the breaker (open_after 3).
    let mut first = Vec::new();
    for i in 0..3 {
        first.push(h.submit("outage", "go", &format!("opens-{i}")).await);
    }
    for run in &first {
        h.wait_for(run, Duration::from_secs(20), |s| {
            s.status == RunStatus::WaitingProvider
        })
        .await;
    }
    let calls = h.mock.mock().calls().total;
    let late = h.submit("outage", "go", "held").await;
    let state = h
        .wait_for(&late, Duration::from_secs(20), |s| {
            s.status == RunStatus::WaitingProvider
        })
        .await;
    let events = h.events(&late).await;
    assert!(
        events.iter().any(|r| matches!(
            &r.envelope.event,
            kedge_core::event::Event::ModelAttempt(a)
                if matches!(a.outcome, kedge_core::event::AttemptOutcome::Held { .. })
        )),
        "the late run's call was held"
    );
    assert_eq!(h.mock.mock().calls().total, calls, "and not sent");
    assert_eq!(state.open_step.as_ref().map(|o| o.spent()), Some(0));
    h.mock.set_trouble(None);
    // Only the probe (30 s away) or a manual close brings the endpoint back: an operator who
    // knows it is back deletes the breaker (docs/RUNBOOK.md "Provider trouble").
    let kv =
        h.rt.js
            .get_key_value("kedge_providers")
            .await
            .expect("kedge_providers");
    let mut keys = kv.keys().await.expect("keys");
    let mut breaker = None;
    while let Some(Ok(k)) = futures::StreamExt::next(&mut keys).await {
        if k.starts_with("breaker.") {
            breaker = Some(k);
        }
    }
    kv.delete(breaker.expect("the endpoint's breaker"))
        .await
        .expect("deleted");
    for run in first.iter().chain([&late]) {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    }
    h.shutdown().await;
}

/// Four steps answered at once, on a model the mock limits to `rpm` requests a minute.
fn limited_script(rpm: u64) -> serde_json::Value {
    let step = serde_json::json!({"tool_calls": [{"name": "list_files", "arguments": {}}]});
    serde_json::json!({"models": {
        "mx": {"limits": {"requests_per_minute": rpm}, "steps": [step, step, step, {"text": "done"}]},
    }})
}

/// The shortest time `calls` calls can take under a limit of `rpm` a minute, less the second's
/// worth that may go at once.
fn paced_for(calls: u64, rpm: u64) -> Duration {
    Duration::from_secs_f64(calls.saturating_sub(rpm / 60 + 1) as f64 * 60.0 / rpm as f64)
}

const LIMIT_RPM: u64 = 600;
const LIMITED_RUNS: usize = 30;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_step_processes_keep_to_one_configured_rate_limit_and_queue_the_rest() {
    let mut h = Harness::start_with(
        limited_script(LIMIT_RPM),
        &[Svc::Intake, Svc::Tool, Svc::Timer],
        |c| {
            tune(c);
            c.providers.limits = vec![kedge_runtime::config::EndpointLimit {
                provider: None,
                base_url: None,
                key_var: Some(API_KEY_VAR.into()),
                requests_per_minute: Some(LIMIT_RPM),
                tokens_per_minute: None,
            }];
        },
    )
    .await;
    // Two step processes: one pace between them.
    h.spawn_service(Svc::Step, "w-step-a");
    h.spawn_service(Svc::Step, "w-step-b");
    h.agent("limited", "mx").await;
    let began = Instant::now();
    let runs = submit_many(&h, "limited", "rpm", LIMITED_RUNS).await;
    all_succeed(&h, &runs, "under a rate limit").await;
    let took = began.elapsed();
    let calls = h.mock.mock().calls().total;
    assert_eq!(calls, 4 * LIMITED_RUNS as u64, "one call per step");
    // Unpaced, the 120 calls go in a second or two; the fleet's pace spreads them over what the
    // limit allows, and the provider never refuses one.
    let least = paced_for(calls, LIMIT_RPM);
    assert!(
        took >= least,
        "{calls} calls in {took:?}: faster than {LIMIT_RPM} a minute allows ({least:?})"
    );
    assert_eq!(h.mock.mock().calls().limited, 0, "no call over the limit");
    // Runs over the limit waited their turn, visibly, on the provider (not in a worker slot).
    let mut queued = 0;
    for run in &runs {
        queued += h
            .events(run)
            .await
            .iter()
            .filter(|r| {
                matches!(
                    &r.envelope.event,
                    kedge_core::event::Event::ProviderWaiting(w)
                        if w.trouble == kedge_core::event::Trouble::RateLimited
                            && w.message.contains("its turn")
                )
            })
            .count();
    }
    assert!(queued > 0, "no run waited its turn");
    eprintln!("{calls} calls in {took:?} (least {least:?}); {queued} waits for a turn");
    // An operator sees the limit the fleet keeps to (a watch of kedge_providers, which the
    // operator user may make on a secured broker).
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_kedge"))
        .arg("providers")
        .env("KEDGE_NATS_URL", h.nats.url())
        .env_remove("KEDGE_CONFIG")
        .envs(common::kind_env(
            &h.config,
            kedge_runtime::secure::Kind::Operator,
        ))
        .output()
        .expect("kedge providers");
    let shown = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success()
            && shown.contains(&format!("keeps to {LIMIT_RPM} requests per minute")),
        "{shown}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_fleet_keeps_to_the_rate_limit_the_provider_names_in_its_headers() {
    // Nothing configured: the mock's rate-limit headers name its limit.
    let h = Harness::start_with(
        limited_script(LIMIT_RPM),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Timer],
        tune,
    )
    .await;
    h.agent("limited", "mx").await;
    let began = Instant::now();
    let runs = submit_many(&h, "limited", "learned", LIMITED_RUNS).await;
    all_succeed(&h, &runs, "under a learned rate limit").await;
    let took = began.elapsed();
    let calls = h.mock.mock().calls().total;
    // The first calls may all go before the first answer names the limit.
    let least = paced_for(calls - LIMITED_RUNS as u64, LIMIT_RPM);
    assert!(
        took >= least,
        "{calls} calls in {took:?}: the learned limit was not kept to ({least:?})"
    );
    assert_eq!(h.mock.mock().calls().limited, 0);
    h.shutdown().await;
}

/// The same four steps on two models: `mx` (the agent's own, OpenAI wire format) and `fx` (its
/// fallback, Anthropic's wire format at the same mock: another endpoint).
fn fallback_script() -> serde_json::Value {
    let step = serde_json::json!({"tool_calls": [{"name": "list_files", "arguments": {}}], "delay_ms": 50});
    let steps = serde_json::json!([step, step, step, {"text": "done", "delay_ms": 50}]);
    serde_json::json!({"models": {"mx": {"steps": steps}, "fx": {"steps": steps}}})
}

/// The model that answered each step of `run` (`None`: the run's own), from its journal.
async fn answered_by(h: &Harness, run: &RunId) -> Vec<Option<String>> {
    h.events(run)
        .await
        .iter()
        .filter_map(|r| match &r.envelope.event {
            kedge_core::event::Event::StepCompleted(c) => Some(c.model.clone()),
            _ => None,
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_fallback_model_answers_after_fallback_after_and_the_primary_again_once_it_is_back() {
    let h = Harness::start_with(
        fallback_script(),
        &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Timer],
        tune,
    )
    .await;
    let base = h.mock.base_url();
    h.agent_edited("falls-back", "mx", |d| {
        d.model.price = Some(kedge_core::settings::Price {
            input_per_mtok: 1.0,
            output_per_mtok: 1.0,
            currency: "USD".into(),
        });
        d.budget.max_cost = Some(100.0);
        d.fallback_after_secs = Some(1);
        d.fallbacks = vec![
            serde_json::from_value(serde_json::json!({
                "provider": "anthropic", "name": "fx", "base_url": base,
                "api_key_env": API_KEY_VAR,
                "price": {"input_per_mtok": 1000.0, "output_per_mtok": 1000.0}
            }))
            .expect("a fallback"),
        ];
    })
    .await;
    // The agent's own model is down for the whole first half.
    h.mock.set_trouble(Some(
        Trouble::new(TroubleKind::Unavailable)
            .for_models(["mx"])
            .expect("a model"),
    ));
    let during = submit_many(&h, "falls-back", "down", 10).await;
    for run in &during {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
        let by = answered_by(&h, run).await;
        assert_eq!(by.len(), 4, "one answer per step");
        assert!(
            by.iter().all(|m| m.as_deref() == Some("fx")),
            "every step answered by the fallback while the model is down: {by:?}"
        );
        // The cost is the fallback's: 1000 per million tokens, not the run's model's 1.
        let events = h.events(run).await;
        for r in &events {
            if let kedge_core::event::Event::StepCompleted(c) = &r.envelope.event {
                let tokens = (c.usage.input_tokens + c.usage.output_tokens) as f64;
                let cost = c.usage.cost.expect("priced");
                assert!(
                    (cost - tokens * 1000.0 / 1e6).abs() < 1e-9,
                    "cost {cost} for {tokens} tokens"
                );
            }
        }
        h.check_replay(run, "fallback-model-answers").await;
    }
    let counts = h.mock.mock().calls();
    assert_eq!(
        counts.by_model.get("fx").copied(),
        Some(40),
        "no step's answer bought twice: {counts:?}"
    );
    // The agent's own model was tried first: the fallback answers only once it has been
    // failing for `fallback_after_secs`.
    assert!(
        counts.by_model.get("mx").is_some_and(|n| *n >= 3),
        "{counts:?}"
    );
    // The model is back: the fleet's probe (a run's call, since none waits) finds it, and the
    // runs after it are answered by the agent's own model again.
    h.mock.set_trouble(None);
    let deadline = Instant::now() + Duration::from_secs(30);
    for i in 0.. {
        let run = h.submit("falls-back", "go", &format!("back-{i}")).await;
        h.wait_terminal(&run, WAIT).await;
        if answered_by(&h, &run).await.iter().all(Option::is_none) {
            h.check_replay(&run, "fallback-model-back").await;
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the agent's own model was not used again after it came back"
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    h.shutdown().await;
}
