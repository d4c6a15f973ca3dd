//! Hostile and broken input end to end: garbage on a run's subjects is set
//! aside and recorded while the run goes on; a panic in a drive is contained; intake answers
//! what it cannot do as a rejection instead of retrying it forever.

use crate::common;

use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{Draft, Envelope, Event, Timestamp, UserMessage};
use kedge_core::ids::RunId;
use kedge_core::task::TaskSubmission;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// Publishes `payload` on `subject` through JetStream (as the test's admin) and returns its
/// stream sequence.
async fn publish(h: &Harness, subject: String, payload: Vec<u8>, msg_id: Option<&str>) -> u64 {
    let mut headers = HeaderMap::new();
    if let Some(id) = msg_id {
        headers.insert("Nats-Msg-Id", id);
    }
    h.rt.js
        .publish_with_headers(subject, headers, payload.into())
        .await
        .expect("published")
        .await
        .expect("stored")
        .sequence
}

fn user_message(run: &RunId, text: &str) -> Envelope {
    Envelope::new(
        run.clone(),
        Timestamp::now(),
        Draft::new(Event::UserMessage(UserMessage { text: text.into() })),
    )
}

/// Waits until every sequence in `seqs` has its record on `agent.rejected.journal.<run>.<seq>`;
/// returns the records.
async fn recorded_set_aside(h: &Harness, run: &RunId, seqs: &[u64]) -> Vec<serde_json::Value> {
    let stream =
        h.rt.js
            .get_stream("KEDGE_REJECTIONS")
            .await
            .expect("rejections stream");
    let deadline = Instant::now() + WAIT;
    loop {
        let mut found = Vec::new();
        for seq in seqs {
            if let Ok(m) = stream
                .direct_get_last_for_subject(format!("agent.rejected.journal.{run}.{seq}"))
                .await
            {
                found.push(serde_json::from_slice(&m.payload).expect("a JSON record"));
            }
        }
        if found.len() == seqs.len() {
            return found;
        }
        assert!(
            Instant::now() < deadline,
            "set-aside records of {run}: {} of {seqs:?}",
            found.len()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn garbage_on_a_run_s_subjects_is_set_aside_and_recorded_and_the_run_goes_on() {
    let script = json!({"models": {"mh": {"steps": [{"text": "first"}, {"text": "second"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("hostile", "mh").await;
    let run = h.submit("hostile", "go", "task-hostile").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.output.as_deref(), Some("first"));

    let other: RunId = "run_someone_else".parse().expect("valid");
    let mut bad = Vec::new();
    let on = |t: &str| format!("agent.run.{run}.{t}");
    // Not JSON, on the input subject that wakes the step.
    bad.push(publish(&h, on("i.user.message"), b"not json".to_vec(), None).await);
    // JSON of the wrong shape.
    bad.push(
        publish(
            &h,
            on("i.user.message"),
            json!({"run_id": run, "type": "user.message", "data": 7})
                .to_string()
                .into_bytes(),
            Some("wrong-shape"),
        )
        .await,
    );
    // A well-formed envelope of another run, and one of another type.
    bad.push(
        publish(
            &h,
            on("i.user.message"),
            user_message(&other, "not yours").to_json_bytes(),
            None,
        )
        .await,
    );
    bad.push(
        publish(
            &h,
            on("i.cancel.requested"),
            user_message(&run, "misfiled").to_json_bytes(),
            None,
        )
        .await,
    );
    // A huge payload, on another input subject.
    bad.push(publish(&h, on("i.tool.result"), vec![b'{'; 900 * 1024], None).await);
    // A decision without the writer's Nats-Msg-Id (the test is admin; on a secured broker only
    // the step may publish there): set aside, and the writer's next append goes after it.
    bad.push(
        publish(
            &h,
            on("d.run.succeeded"),
            json!({"garbage": true}).to_string().into_bytes(),
            None,
        )
        .await,
    );

    // The run goes on: a real message revives it and it finishes its second turn.
    h.input(
        &run,
        Event::UserMessage(UserMessage {
            text: "again".into(),
        }),
        "again-1",
    )
    .await;
    let state = h
        .wait_for(&run, WAIT, |s| {
            s.status == RunStatus::Succeeded && s.output.as_deref() == Some("second")
        })
        .await;
    assert_eq!(state.turn, 2);
    // What the readers see: only events, never a failure.
    let events = h.events(&run).await;
    assert!(events.iter().all(|r| !bad.contains(&r.seq)));
    let page =
        h.rt.journal
            .read_with_set_aside(&run, 0)
            .await
            .expect("read");
    let aside: Vec<u64> = page.set_aside.iter().map(|a| a.seq).collect();
    assert_eq!(aside, bad);
    // Recorded once each, where operators look.
    let records = recorded_set_aside(&h, &run, &bad).await;
    for (record, seq) in records.iter().zip(&bad) {
        assert_eq!(record["seq"], *seq);
        assert_eq!(record["run_id"], run.as_str());
        assert!(record["reason"].as_str().is_some_and(|r| !r.is_empty()));
    }
    assert_eq!(records[5]["kind"], "decision");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inputs_published_before_a_run_exists_do_not_stop_it() {
    let script = json!({"models": {"me": {"steps": [{"text": "fine"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("early", "me").await;
    let chosen: RunId = "run_early_bird".parse().expect("valid");
    // The run the task will make (the chosen id within the tenant), known to whoever may
    // publish on the journal.
    let run = h.chosen_run(&chosen);
    publish(
        &h,
        format!("agent.run.{run}.i.user.message"),
        b"\xff\xfe garbage".to_vec(),
        None,
    )
    .await;
    publish(
        &h,
        format!("agent.run.{run}.i.user.message"),
        user_message(&run, "before you were born").to_json_bytes(),
        Some("early-1"),
    )
    .await;
    let task = TaskSubmission {
        agent: "early".parse().expect("agent"),
        input: "go".into(),
        run_id: Some(chosen),
        budget: None,
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    match h.submit_task(&task, "task-early").await {
        kedge_intake::Answer::Accepted { run_id } => assert_eq!(run_id, run),
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    }
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.ignored_inputs, 1, "the early message is ignored");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_in_a_drive_is_contained_and_the_run_is_retried() {
    let script = json!({"models": {
        "mp": {"steps": [{"text": "survived"}]},
        "mq": {"steps": [{"text": "unbothered"}]}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("panicky", "mp").await;
    h.agent("calm", "mq").await;
    let chosen: RunId = "run_panicky".parse().expect("valid");
    let run = h.chosen_run(&chosen);
    kedge_runtime::failpoint::arm_panic("step.drive", run.as_str(), 2);
    let task = TaskSubmission {
        agent: "panicky".parse().expect("agent"),
        input: "go".into(),
        run_id: Some(chosen),
        budget: None,
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    match h.submit_task(&task, "task-panicky").await {
        kedge_intake::Answer::Accepted { run_id } => assert_eq!(run_id, run),
        kedge_intake::Answer::Rejected { error } => panic!("rejected: {error}"),
    }
    // The service survives the panics: another run completes meanwhile.
    let calm = h.submit("calm", "go", "task-calm").await;
    let state = h.wait_terminal(&calm, WAIT).await;
    assert_eq!(state.output.as_deref(), Some("unbothered"));
    // The panicking run's wake was handed back, and its third drive succeeds.
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("survived"));
    assert_eq!(h.mock.calls().total, 2, "one model call per run");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_task_intake_cannot_journal_is_answered_as_a_rejection_not_retried() {
    let script = json!({"models": {"mr": {"steps": [{"text": "never"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("taken", "mr").await;
    // Someone who may publish on the journal put garbage on the decision subject of the run the
    // task will make: the run cannot be created (its first decision must be run.created), and retrying will not help.
    let chosen: RunId = "run_squatted".parse().expect("valid");
    let run = h.chosen_run(&chosen);
    publish(
        &h,
        format!("agent.run.{run}.d.run.created"),
        b"squatter".to_vec(),
        None,
    )
    .await;
    let task = TaskSubmission {
        agent: "taken".parse().expect("agent"),
        input: "go".into(),
        run_id: Some(chosen),
        budget: None,
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    let t = Instant::now();
    match h.submit_task(&task, "task-squatted").await {
        kedge_intake::Answer::Rejected { error } => {
            // Not the tenant's run: refused without saying that a run is there.
            assert_eq!(error.field, "task", "{error:?}");
            assert!(!error.reason.contains("already exists"), "{}", error.reason);
        }
        kedge_intake::Answer::Accepted { run_id } => panic!("accepted {run_id}"),
    }
    assert!(t.elapsed() < Duration::from_secs(5), "{:?}", t.elapsed());
    assert_eq!(h.mock.calls().total, 0);
    h.shutdown().await;
}

/// A small deterministic generator (xorshift64*), so a failure can be replayed from its seed.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
    fn bytes(&mut self, max: u64) -> Vec<u8> {
        let len = self.below(max);
        (0..len).map(|_| (self.next() & 0xff) as u8).collect()
    }
    /// Arbitrary JSON of bounded depth, with the journal's own keys among the object keys.
    fn json(&mut self, depth: u32) -> serde_json::Value {
        const KEYS: &[&str] = &[
            "run_id",
            "type",
            "at",
            "step",
            "attempt",
            "op",
            "data",
            "digest",
            "text",
            "answer",
            "question_id",
            "approval_id",
            "verdict",
            "args_digest",
            "payload",
            "key",
            "x",
        ];
        match self.below(if depth == 0 { 5 } else { 7 }) {
            0 => serde_json::Value::Null,
            1 => json!(self.below(2) == 0),
            2 => match self.below(4) {
                0 => json!(u64::MAX),
                1 => json!(-1),
                2 => json!(1e300),
                _ => json!(self.next()),
            },
            3 => json!(String::from_utf8_lossy(&self.bytes(64))),
            4 => json!(format!("run_{}", self.below(1000))),
            5 => (0..self.below(4))
                .map(|_| self.json(depth - 1))
                .collect::<Vec<_>>()
                .into(),
            _ => {
                let mut m = serde_json::Map::new();
                for _ in 0..self.below(6) {
                    let k = KEYS[self.below(KEYS.len() as u64) as usize].to_owned();
                    m.insert(k, self.json(depth - 1));
                }
                m.into()
            }
        }
    }
}

#[tokio::test]
async fn arbitrary_bytes_on_any_input_subject_of_a_live_run_never_stop_it() {
    let script = json!({"models": {"mr": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Go on?"}}]},
        {"text": "finished"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("random", "mr").await;
    let run = h.submit("random", "go", "task-random").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let question = state.questions.keys().next().expect("a question").clone();
    // Every input type Kedge knows, and tokens it does not.
    let types: Vec<String> = kedge_core::EventType::ALL
        .iter()
        .filter(|t| t.kind() == kedge_core::EventKind::Input)
        .map(|t| t.as_str().to_owned())
        .chain(["bogus".to_owned(), "user.message.extra".to_owned()])
        .collect();
    let seed = 0x5eed_cafe_u64;
    let mut rng = Rng(seed);
    let mut published = 0;
    for i in 0..120 {
        let ty = &types[rng.below(types.len() as u64) as usize];
        let payload = match rng.below(3) {
            0 => rng.bytes(2048),
            1 => rng.json(4).to_string().into_bytes(),
            // An envelope of this run whose `data` is arbitrary (the digest then rarely fits).
            _ => json!({
                "run_id": run, "type": ty, "at": "2026-01-01T00:00:00Z", "step": rng.below(5),
                "attempt": 1, "data": rng.json(3), "digest": "sha256:00"
            })
            .to_string()
            .into_bytes(),
        };
        let id = format!("random-{seed}-{i}");
        publish(&h, format!("agent.run.{run}.i.{ty}"), payload, Some(&id)).await;
        published += 1;
    }
    assert_eq!(published, 120);
    // The run still reads, still waits for its question, and finishes once it is answered.
    let state = h.state(&run).await;
    assert_eq!(
        state.status,
        RunStatus::WaitingUser,
        "seed {seed:#x}: {state:?}"
    );
    h.input(
        &run,
        Event::QuestionAnswered(kedge_core::event::QuestionAnswered {
            question_id: question.clone(),
            answer: "yes".into(),
        }),
        &kedge_core::ids::InputId::answer(&question).to_string(),
    )
    .await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "seed {seed:#x}");
    assert_eq!(done.output.as_deref(), Some("finished"));
}

#[tokio::test]
async fn dead_letters_are_listed_and_a_run_s_wake_is_retried_once() {
    let script = json!({"models": {"md": {"steps": [{"text": "done"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("dead", "md").await;
    let run = h.submit("dead", "go", "task-dead").await;
    h.wait_terminal(&run, WAIT).await;
    // What the step's consumer records when it gives up on a wake, and one of intake's.
    let record = |consumer: &str, subject: String| {
        json!({"at": Timestamp::now(), "consumer": consumer, "stream": "KEDGE_RUNS", "seq": 3,
               "subject": subject, "deliveries": 100, "reason": "panicked every time", "body": ""})
        .to_string()
        .into_bytes()
    };
    let wake = publish(
        &h,
        "agent.rejected.dead.step".into(),
        record("step", format!("agent.run.{run}.i.user.message")),
        None,
    )
    .await;
    let task = publish(
        &h,
        "agent.rejected.dead.intake".into(),
        record("intake", "agent.task.dead".into()),
        None,
    )
    .await;
    let kedge = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(args)
            .env("KEDGE_NATS_URL", h.nats.url())
            .envs(common::kind_env(
                &h.config,
                kedge_runtime::secure::Kind::Admin,
            ))
            .env("KEDGE_LOG", "warn")
            .output()
            .expect("kedge runs")
    };
    let listed = kedge(&["dead", "list"]);
    let text = String::from_utf8_lossy(&listed.stdout);
    assert!(listed.status.success(), "{text}");
    assert!(
        text.contains(&format!("agent.run.{run}.i.user.message")),
        "{text}"
    );
    assert!(
        text.contains("panicked every time") && text.contains("intake"),
        "{text}"
    );
    let retried = kedge(&["dead", "retry", &wake.to_string()]);
    assert!(
        retried.status.success(),
        "{}",
        String::from_utf8_lossy(&retried.stderr)
    );
    let again = kedge(&["dead", "retry", &wake.to_string()]);
    assert!(String::from_utf8_lossy(&again.stdout).contains("already journaled"));
    let nudges = h
        .events(&run)
        .await
        .into_iter()
        .filter(|r| matches!(r.envelope.event, Event::Nudge(_)))
        .count();
    assert_eq!(nudges, 1, "one retry, journaled once");
    let refused = kedge(&["dead", "retry", &task.to_string()]);
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("not a wake of a run"));
}
