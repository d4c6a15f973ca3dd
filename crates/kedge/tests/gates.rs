//! Version gates through the real services: a run of this build takes gate
//! `wait_from_step_group` (docs/ARCHITECTURE.md, "Upgrades"): it journals the marker once, no
//! `run.waiting` after a step that waits on its tools alone (a step that asks the user keeps
//! it), and waits in the same statuses, as the journal, the run view and the decision replay
//! see it. Recorded as the replay fixture
//! `a-gated-run-waits-without-run-waiting` (`KEDGE_BLESS=a-gated-run-waits-without-run-waiting`),
//! so later builds are checked against it.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::event::{Event, EventType, Gate, QuestionAnswered, WaitReason};
use kedge_core::ids::InputId;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_run_waits_without_run_waiting() {
    let script = json!({"models": {"mg": {"steps": [
        {"text": "writing", "tool_calls": [
            {"name": "write_file", "arguments": {"path": "a.txt", "content": "alpha"}},
            {"name": "read_file", "arguments": {"path": "a.txt"}}]},
        {"text": "asking", "tool_calls": [
            {"name": "ask_user", "arguments": {"question": "Which harbour?"}}]},
        {"text": "sailing to the north harbour"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("gated", "mg").await;
    let run = h.submit("gated", "Plan the voyage.", "task-gated").await;

    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    assert!(state.gates.contains(Gate::WaitFromStepGroup));
    assert_eq!(state.waiting_on(), Some(WaitReason::User));
    let events = h.events(&run).await;
    // What clients see: the run view, folded like every reader.
    let view = kedge_app::view::run_view(&state, &events);
    assert_eq!(view.status, RunStatus::WaitingUser);
    assert_eq!(view.waiting.as_ref().map(|w| w.on), Some(WaitReason::User));
    let question = state.questions.keys().next().expect("a question").clone();
    h.input(
        &run,
        Event::QuestionAnswered(QuestionAnswered {
            question_id: question.clone(),
            answer: "north".into(),
        }),
        InputId::answer(&question).as_str(),
    )
    .await;

    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    let count = |t: EventType| {
        events
            .iter()
            .filter(|r| r.envelope.event_type() == t)
            .count()
    };
    assert_eq!(count(EventType::RunGated), 1, "the marker, once");
    // Only the question's: a run waiting on a person keeps its explicit `run.waiting`.
    assert_eq!(count(EventType::RunWaiting), 1);
    // The tool step's `step.completed` counts its group (the marker and two tool requests); the
    // question's group and the final answer's end with their own settling decision.
    let follows: Vec<Option<u32>> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::StepCompleted(c) => Some(c.follows),
            _ => None,
        })
        .collect();
    assert_eq!(follows, [Some(3), None, None]);
    // The status after each step group (from its `step.completed` to its last decision before
    // the next `step.started`), as a fold of the journal up to there says it. The group's
    // decisions are chained appends: a tool's `tool.started` may land between two of them.
    let mut statuses = Vec::new();
    for (i, r) in events.iter().enumerate() {
        if !matches!(r.envelope.event, Event::StepCompleted(_)) {
            continue;
        }
        let next_step = events[i..]
            .iter()
            .position(|r| matches!(r.envelope.event, Event::StepStarted(_)))
            .map_or(events.len(), |j| i + j);
        let last = (i..next_step)
            .rev()
            .find(|&k| events[k].envelope.kind() == kedge_core::event::EventKind::Decision)
            .unwrap_or(i);
        let s =
            kedge_core::fold(events[..=last].iter().map(|r| (r.seq, &r.envelope))).expect("folds");
        statuses.push(s.status);
    }
    assert_eq!(
        statuses,
        [
            RunStatus::WaitingTool,
            RunStatus::WaitingUser,
            RunStatus::Succeeded
        ],
        "{statuses:?}"
    );
    h.shutdown().await;
}
