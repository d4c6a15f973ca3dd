//! The runs projection under concurrency: many runs, many decisions each, projected by two
//! projectors at once while the runs are written (and a backlog written before either started).
//! Whatever order the deliveries are handled in, merged or not, by whichever projector, every
//! run's stored summary ends as the fold of its whole journal: an older fold never stays
//! stored, and no delivery is acknowledged before a summary through it is stored.

use crate::common;

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use common::Harness;
use kedge_core::decide::{ModelResponse, Next, complete_step, decide};
use kedge_core::event::{
    AssistantMessage, Draft, Envelope, Event, EventKind, FinishReason, RunCreated, Timestamp,
    Usage, UserMessage,
};
use kedge_core::ids::RunId;
use kedge_core::{RunStatus, fold};
use kedge_projector::summarize;
use kedge_runtime::projection::RunSummary;
use kedge_runtime::secure::Kind;
use kedge_runtime::{Config, Runtime};
use kedge_serve::{Service, TransientKedge};
use serde_json::json;

/// Runs written before the projectors start (a backlog), and while they run.
const BACKLOG_RUNS: usize = 64;
const LIVE_RUNS: usize = 64;
/// Turns per run: 5 events each (about 3 decisions), after `run.created` and `run.started`.
const TURNS: usize = 6;
const WAIT: Duration = Duration::from_secs(90);

fn created() -> RunCreated {
    RunCreated {
        caller: Some("test".into()),
        ..kedge_testkit::fixtures::run_created("chat", "hello")
    }
}

fn answer(turn: usize) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: format!("answer {turn}"),
            tool_calls: Vec::new(),
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 10 + turn as u64,
            output_tokens: 5,
            cost: None,
        },
        finish: FinishReason::Stop,
    }
}

/// A chat written as the services would, one event at a time with its real stream sequence.
struct Chat {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    last_decision: u64,
}

impl Chat {
    fn new() -> Chat {
        Chat {
            run: RunId::generate(),
            events: Vec::new(),
            last_decision: 0,
        }
    }

    async fn publish(
        &mut self,
        js: &async_nats::jetstream::Context,
        draft: Draft<impl Into<Event>>,
    ) {
        let env = Envelope::new(self.run.clone(), Timestamp::now(), draft);
        let id = if env.kind() == EventKind::Decision {
            kedge_journal::decision_msg_id(
                &self.run,
                kedge_core::ids::DecisionSeq::at(self.last_decision),
                0,
                "test",
            )
        } else {
            format!("test:{}:{}", self.run, self.events.len() + 1)
        };
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", id.as_str());
        let seq = js
            .publish_with_headers(env.subject(), headers, env.to_json_bytes().into())
            .await
            .expect("publish")
            .await
            .expect("stored")
            .sequence;
        if env.kind() == EventKind::Decision {
            self.last_decision = seq;
        }
        self.events.push((seq, env));
    }

    /// Writes every turn, deciding after each event as the step service would.
    async fn write(mut self, js: async_nats::jetstream::Context) -> RunId {
        self.turns(&js, 0..TURNS).await;
        self.run
    }

    /// Writes the turns `turns` (turn 0 creates the run; a later one is a user message that
    /// revives it), deciding after each event as the step service would.
    async fn turns(&mut self, js: &async_nats::jetstream::Context, turns: std::ops::Range<usize>) {
        let js = js.clone();
        for turn in turns {
            let input = if turn == 0 {
                Event::RunCreated(Box::new(created()))
            } else {
                Event::UserMessage(UserMessage {
                    text: format!("and then {turn}?"),
                })
            };
            self.publish(&js, Draft::new(input)).await;
            loop {
                let state = fold(self.events.iter().map(|(s, e)| (*s, e))).expect("folds");
                match decide(&state) {
                    Next::Commit(drafts) => {
                        for d in drafts {
                            self.publish(&js, d).await;
                        }
                    }
                    Next::Step(plan) => {
                        for d in plan.start.clone() {
                            self.publish(&js, d).await;
                        }
                        let state = fold(self.events.iter().map(|(s, e)| (*s, e))).expect("folds");
                        let done = complete_step(
                            &state,
                            plan.step,
                            plan.attempt,
                            plan.request_id,
                            answer(turn),
                            false,
                            Timestamp::now(),
                            &Default::default(),
                        );
                        for d in done {
                            self.publish(&js, d).await;
                        }
                    }
                    Next::Finish(_) => panic!("no finish is pending"),
                    Next::Idle(_) => {
                        assert_eq!(state.status, RunStatus::Succeeded);
                        break;
                    }
                }
            }
        }
    }
}

/// Writes `n` chats side by side (each its own writer) and returns their runs.
async fn write_chats(h: &Harness, n: usize) -> Vec<RunId> {
    let writers: Vec<_> = (0..n)
        .map(|_| tokio::spawn(Chat::new().write(h.rt.js.clone())))
        .collect();
    let mut runs = Vec::new();
    for w in writers {
        runs.push(w.await.expect("writer"));
    }
    runs
}

/// A projector in this process (as its own user) until the test ends.
fn spawn_projector(config: &Config) {
    common::spawn_detached(config, Service::Projector);
}

/// Each run's summary as the fold of its whole journal now.
async fn folds(h: &Harness, runs: &[RunId]) -> BTreeMap<RunId, RunSummary> {
    let mut out = BTreeMap::new();
    for run in runs {
        let events = h.rt.journal.read(run, 0).await.expect("read");
        let summary = summarize(&events).expect("folds").expect("has events");
        assert!(summary.seq > 0);
        out.insert(run.clone(), summary);
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn concurrent_deliveries_of_a_run_leave_the_fold_of_its_journal() {
    let h = Harness::start_with(json!({"models": {}}), &[], |_| {}).await;
    // A backlog: runs written side by side before any projector runs.
    let mut runs = write_chats(&h, BACKLOG_RUNS).await;
    // Two projectors share the consumer; more runs are written while they catch up.
    spawn_projector(&h.config);
    spawn_projector(&h.config);
    runs.extend(write_chats(&h, LIVE_RUNS).await);
    let want = folds(&h, &runs).await;
    assert!(
        want.values().all(|s| s.status == RunStatus::Succeeded),
        "every chat is whole"
    );

    let kv = h.rt.js.get_key_value("kedge_runs").await.expect("bucket");
    let started = Instant::now();
    loop {
        let mut stale = Vec::new();
        for (run, summary) in &want {
            let key = kedge_runtime::projection::key(&summary.tenant, run);
            let stored: Option<RunSummary> = kv
                .get(&key)
                .await
                .expect("kv get")
                .and_then(|v| serde_json::from_slice(&v).ok());
            if stored.as_ref() != Some(summary) {
                stale.push((run.clone(), stored.map(|s| s.seq), summary.seq));
            }
        }
        if stale.is_empty() {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "{} runs never got the fold of their journal (run, stored seq, journal seq): {:?}",
            stale.len(),
            &stale[..stale.len().min(5)]
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Every delivery was acknowledged (none left pending or handed back for good).
    let started = Instant::now();
    loop {
        let (pending, unacknowledged) = left(&h).await;
        if pending == 0 && unacknowledged == 0 {
            break;
        }
        assert!(
            started.elapsed() < WAIT,
            "projector left {pending} pending, {unacknowledged} unacknowledged"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // And the summaries are still those folds (nothing older landed late).
    for (run, summary) in &want {
        let key = kedge_runtime::projection::key(&summary.tenant, run);
        let stored: RunSummary =
            serde_json::from_slice(&kv.get(&key).await.expect("kv get").expect("stored summary"))
                .expect("summary");
        assert_eq!(&stored, summary, "run {run}");
    }
}

/// What consumer `projector` has pending and delivered unacknowledged.
async fn left(h: &Harness) -> (u64, usize) {
    let mut consumer: async_nats::jetstream::consumer::PullConsumer =
        h.rt.js
            .get_stream("KEDGE_RUNS")
            .await
            .expect("stream")
            .get_consumer("projector")
            .await
            .expect("consumer");
    let info = consumer.info().await.expect("info");
    (info.num_pending, info.num_ack_pending)
}

/// Consumer `projector` has nothing pending or unacknowledged.
async fn drained(h: &Harness) -> bool {
    left(h).await == (0, 0)
}

/// The projector's one-request write (a compare-and-set on the revision it last stored) meets a
/// summary someone else stored since, newer than its fold: the write fails, the projector reads
/// the key, finds it newer and leaves it. (A plain put there, or a write that trusted its own
/// memory, would put the older fold back.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_from_what_the_projector_remembers_never_overwrites_a_newer_summary() {
    let h = Harness::start_with(json!({"models": {}}), &[], |_| {}).await;
    spawn_projector(&h.config);
    let mut chat = Chat::new();
    let run = chat.run.clone();
    chat.turns(&h.rt.js, 0..1).await;
    let kv = h.rt.js.get_key_value("kedge_runs").await.expect("bucket");
    let stored = |kv: async_nats::jetstream::kv::Store, key: String| async move {
        kv.get(&key)
            .await
            .expect("kv get")
            .map(|v| serde_json::from_slice::<RunSummary>(&v).expect("summary"))
    };
    // The projector stored turn 0's summary (and remembers its revision).
    let first = wait_projected(&h, &run).await;
    let key = kedge_runtime::projection::key(&first.tenant, &run);
    // Someone else (another projector, further ahead) stores a newer summary meanwhile.
    let projection = kedge_projector::Writer::open(&h.rt)
        .await
        .expect("projection");
    let mut ahead = first.clone();
    ahead.seq = u64::MAX / 2;
    ahead.status = RunStatus::Cancelled;
    projection.store(&ahead, false).await.expect("store");
    // The run goes on: the projector folds it through its newest decision, older than that.
    chat.turns(&h.rt.js, 1..2).await;
    let started = Instant::now();
    while !drained(&h).await {
        assert!(started.elapsed() < WAIT, "turn 1 was never acknowledged");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let now = folds(&h, std::slice::from_ref(&run)).await[&run].clone();
    assert!(now.seq > first.seq && now.seq < ahead.seq);
    assert_eq!(
        stored(kv.clone(), key.clone()).await,
        Some(ahead),
        "the newer summary stays"
    );
}

/// Counts the writes of one summary (`$KV.kedge_runs.<key>`) as they happen.
async fn count_writes(h: &Harness, key: &str) -> std::sync::Arc<std::sync::atomic::AtomicUsize> {
    use futures::StreamExt as _;
    let writes = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    let mut sub =
        h.rt.client
            .subscribe(format!("$KV.kedge_runs.{key}"))
            .await
            .expect("subscribe");
    h.rt.client.flush().await.expect("flush");
    let counted = writes.clone();
    tokio::spawn(async move {
        while sub.next().await.is_some() {
            counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        }
    });
    writes
}

/// Waits until the run's stored summary is the fold of its journal and every delivery is
/// acknowledged.
async fn wait_projected(h: &Harness, run: &RunId) -> RunSummary {
    let want = folds(h, std::slice::from_ref(run)).await[run].clone();
    let kv = h.rt.js.get_key_value("kedge_runs").await.expect("bucket");
    let key = kedge_runtime::projection::key(&want.tenant, run);
    let started = Instant::now();
    loop {
        let stored: Option<RunSummary> = kv
            .get(&key)
            .await
            .expect("kv get")
            .and_then(|v| serde_json::from_slice(&v).ok());
        if stored.as_ref() == Some(&want) && drained(h).await {
            return want;
        }
        assert!(
            started.elapsed() < WAIT,
            "the run was never projected through {}: stored {:?}",
            want.seq,
            stored.map(|s| s.seq)
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A run deciding every few milliseconds (a busy agent loop) is written to the runs list at
/// most once per `bridge.runs_list_interval_ms`, not once per decision, and the list still ends
/// on the fold of its whole journal with every decision acknowledged.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_busy_run_is_written_at_most_once_per_interval() {
    const INTERVAL_MS: u64 = 400;
    const TURNS: usize = 30;
    let h = Harness::start_with(json!({"models": {}}), &[], |c| {
        c.bridge.runs_list_interval_ms = INTERVAL_MS;
    })
    .await;
    spawn_projector(&h.config);
    let mut chat = Chat::new();
    let run = chat.run.clone();
    let tenant = created().tenant;
    let writes = count_writes(&h, &kedge_runtime::projection::key(&tenant, &run)).await;
    let started = Instant::now();
    for turn in 0..TURNS {
        // About three decisions per turn, each turn well after the last one's projection
        // would have been stored: without the interval, every turn is at least one write.
        chat.turns(&h.rt.js, turn..turn + 1).await;
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let written_in = started.elapsed();
    let summary = wait_projected(&h, &run).await;
    assert_eq!(summary.turn as usize, TURNS, "every turn is in the summary");
    let writes = writes.load(std::sync::atomic::Ordering::SeqCst);
    // The first decision at once, then one write per interval while decisions come, and the
    // last after them.
    let bound = 2 + (written_in.as_millis() as u64).div_ceil(INTERVAL_MS) as usize;
    assert!(
        (1..=bound).contains(&writes),
        "{writes} writes of the summary for {TURNS} turns over {written_in:?} (at most {bound})"
    );
}

/// A projector stopped while runs rest between projections projects what they gathered at once
/// and returns with every delivery acknowledged: nothing is left for the ack wait, and the stop
/// does not wait out the interval.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_projector_leaves_no_decision_unprojected() {
    let interval_ms = kedge_runtime::config::MAX_RUNS_LIST_INTERVAL_MS;
    let h = Harness::start_with(json!({"models": {}}), &[], |c| {
        c.bridge.runs_list_interval_ms = interval_ms;
    })
    .await;
    let config = common::as_kind(&h.config, Kind::Projector);
    let rt = Runtime::connect(config).await.expect("projector runtime");
    let mut services = TransientKedge::new();
    let projector = services.start_on(rt, &[Service::Projector]);
    let mut chats = Vec::new();
    for _ in 0..4 {
        let mut chat = Chat::new();
        chat.turns(&h.rt.js, 0..1).await;
        chats.push(chat);
    }
    // Each run's first decision is projected at once; the rest of its turn rests.
    let started = Instant::now();
    for chat in &chats {
        let kv = h.rt.js.get_key_value("kedge_runs").await.expect("bucket");
        let key = kedge_runtime::projection::key(&created().tenant, &chat.run);
        while kv.get(&key).await.expect("kv get").is_none() {
            assert!(started.elapsed() < WAIT, "a run was never first projected");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    for chat in &mut chats {
        chat.turns(&h.rt.js, 1..2).await;
    }
    let (pending, unacknowledged) = left(&h).await;
    assert!(
        pending + unacknowledged as u64 > 0,
        "the runs' later decisions are held while they rest"
    );
    let stopping = Instant::now();
    tokio::time::timeout(WAIT, services.stop(projector))
        .await
        .expect("the projector stops")
        .expect("stops cleanly");
    assert!(
        stopping.elapsed() < Duration::from_millis(interval_ms) / 2,
        "the stop waited out the interval ({:?})",
        stopping.elapsed()
    );
    assert_eq!(left(&h).await, (0, 0), "every delivery was acknowledged");
    for chat in &chats {
        wait_projected(&h, &chat.run).await;
    }
}

/// The stored summary of `run` once `pred` holds for it (the runs list as the bridge reads it).
async fn wait_listed(h: &Harness, run: &RunId, pred: impl Fn(&RunSummary) -> bool) -> RunSummary {
    let list = kedge_runtime::projection::Projection::open(&h.rt)
        .await
        .expect("the runs list");
    let tenant = created().tenant;
    let started = Instant::now();
    loop {
        let stored = list.get(&tenant, run).await.expect("kv get");
        if let Some(summary) = stored.as_ref().filter(|s| pred(s)) {
            return summary.clone();
        }
        assert!(
            started.elapsed() < WAIT,
            "the run was never listed as expected: {stored:?}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// With no projector running, the step service keeps the runs list itself from the fold it
/// holds after each drive: a run waiting on a person is listed as such (written at once, before
/// the drive let go of the run), and a run that ended is listed with its end, its steps and its
/// usage, folded through its last event.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_step_service_lists_the_runs_it_drives() {
    let model = "listed";
    let h = Harness::start_with(
        json!({"models": {model: {"steps": [
            {"text": "paying", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay 100"}}]},
            {"text": "finished"}
        ]}}}),
        &[
            common::Svc::Intake,
            common::Svc::Step,
            common::Svc::Tool,
            common::Svc::Approval,
        ],
        |c| {
            c.approvers.insert("tok-alice".into(), "alice".into());
        },
    )
    .await;
    h.agent_with_policy(
        model,
        model,
        json!({"ledger_append": {"approval": "always", "risk": "high"}}),
    )
    .await;
    let run = h.submit(model, "pay the invoice", "listed-1").await;
    let waiting = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let listed = wait_listed(&h, &run, |s| s.status == RunStatus::WaitingApproval).await;
    assert!(listed.seq >= waiting.last_seq, "folded through its wait");
    assert_eq!(listed.step, waiting.step.get());
    assert_eq!(listed.usage, waiting.usage);

    let (id, approval) = waiting.approvals.iter().next().expect("an approval");
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Authorization", "Bearer tok-alice");
    h.rt.client
        .request_with_headers(
            format!("agent.approval.{run}"),
            headers,
            json!({"approval_id": id, "verdict": "approve", "args_digest": approval.request.args_digest})
                .to_string()
                .into(),
        )
        .await
        .expect("approval service answered");
    let end = h.wait_terminal(&run, WAIT).await;
    assert_eq!(end.status, RunStatus::Succeeded);
    let listed = wait_listed(&h, &run, |s| s.finished).await;
    let last = h.events(&run).await.last().map(|r| r.seq);
    assert_eq!(Some(listed.seq), last, "folded through its last event");
    assert_eq!(listed.status, RunStatus::Succeeded);
    assert_eq!(listed.step, end.step.get());
    assert_eq!(listed.usage, end.usage);
    assert!(listed.usage.output_tokens > 0, "its usage is listed");
    // The summary is the fold of the run's whole journal, as a projector's would be.
    assert_eq!(listed, folds(&h, std::slice::from_ref(&run)).await[&run]);
}
