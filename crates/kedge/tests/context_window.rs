//! The model's context window through the real services (docs/ARCHITECTURE.md "The context
//! window"): a run of 300 steps against a model whose window holds only ~20 of them succeeds,
//! its compactions journaled and replayed, no step's answer bought twice; a provider's
//! `context_length_exceeded` makes the step compact and try again; `strategy: fail` keeps the
//! old behaviour. The strict mock refuses a request over its `context_window` with each API's
//! real error.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{CompactionCause, Event};
use kedge_core::ids::RunId;

/// Steps before the run is asked to finish (`KEDGE_CONTEXT_STEPS`: a replay fixture is
/// recorded with fewer).
fn steps() -> u32 {
    std::env::var("KEDGE_CONTEXT_STEPS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(300)
}
/// The mock's window: ~20 of the run's turns (a tool call and its result, ~45 tokens each).
const MOCK_WINDOW: u32 = 1000;

/// Every step calls `list_files`, until the last user message says to finish.
fn script() -> serde_json::Value {
    serde_json::json!({"models": {
        "mw": {
            "context_window": MOCK_WINDOW,
            "rules": [{"when_last_user_contains": "finish now", "respond": {"text": "done"}}],
            "default": {"tool_calls": [{"name": "list_files", "arguments": {}}]}
        }
    }})
}

async fn agent(h: &Harness, name: &str, context: serde_json::Value) {
    h.agent_edited(name, "mw", |d| {
        d.max_output_tokens = 64;
        d.budget.max_steps = 1000;
        d.context = serde_json::from_value(context).expect("context settings");
    })
    .await;
}

/// Drives a run to `steps()` steps, then asks it to finish; returns its final state.
async fn long_run(h: &Harness, run: &RunId) -> kedge_core::RunState {
    h.wait_for(run, Duration::from_secs(240), |s| {
        s.step.get() >= steps() || s.status.is_terminal()
    })
    .await;
    h.input(
        run,
        Event::UserMessage(kedge_core::event::UserMessage {
            text: "finish now".into(),
        }),
        &format!("finish-{run}"),
    )
    .await;
    h.wait_terminal(run, Duration::from_secs(60)).await
}

fn compactions(events: &[kedge_journal::Recorded]) -> Vec<kedge_core::event::ContextCompacted> {
    events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::ContextCompacted(c) => Some(c.clone()),
            _ => None,
        })
        .collect()
}

/// Each request id was sent once, but those the provider refused as too long (each followed by
/// a compaction and a new attempt): no answer was paid for twice.
fn assert_no_answer_bought_twice(h: &Harness, events: &[kedge_journal::Recorded]) {
    let counts = h.mock.mock().calls();
    for r in events {
        if let Event::StepStarted(s) = &r.envelope.event {
            let n = counts
                .by_request_id
                .get(&s.request_id.to_string())
                .copied()
                .unwrap_or(0);
            assert!(n <= 1, "{} was sent {n} times", s.request_id);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_300_step_run_outgrows_its_models_window_and_succeeds_compacted() {
    let h = Harness::start(script(), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    // Kedge knows the window (a little under the provider's): it compacts before sending.
    agent(
        &h,
        "long",
        serde_json::json!({"window_tokens": 900, "keep_last_turns": 4}),
    )
    .await;
    let run = h
        .submit("long", "list the files, again and again", "long-1")
        .await;
    let state = long_run(&h, &run).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert!(state.step.get() > steps());
    let events = h.events(&run).await;
    let compacted = compactions(&events);
    assert!(compacted.len() >= 10, "{} compactions", compacted.len());
    assert!(
        compacted
            .iter()
            .all(|c| c.cause == CompactionCause::Estimate),
        "none refused by the provider: {compacted:?}"
    );
    // The model never saw more than its window: no request was refused.
    let refused = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ModelAttempt(_)))
        .count();
    assert_eq!(refused, 0);
    assert_no_answer_bought_twice(&h, &events);
    // The whole history stays in the journal: every step's call and result.
    let results = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ToolResult(_)))
        .count();
    assert!(results >= steps() as usize);
    // The last request the model read: the task, the note, the latest turns.
    let bodies = h.mock.mock().requests("mw");
    let last = bodies.last().expect("a request");
    let messages = last["messages"].as_array().expect("messages");
    assert!(messages.len() < 60, "{} messages sent", messages.len());
    eprintln!(
        "{} steps, {} compactions, {} model calls; the last request carried {} of the {} messages",
        state.step,
        compacted.len(),
        h.mock.mock().calls().total,
        messages.len(),
        state.transcript.len() + 1
    );
    assert!(
        messages.iter().any(|m| m["content"]
            .as_str()
            .is_some_and(|c| c.contains("left out"))),
        "the note stands for what was left out"
    );
    assert!(
        messages[1]["content"]
            .as_str()
            .is_some_and(|c| c.contains("list the files")),
        "the task is kept: {}",
        messages[1]
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_request_the_provider_refuses_as_too_long_is_compacted_and_sent_again() {
    let h = Harness::start(script(), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    // Kedge believes the window is far larger than it is: the provider's refusal teaches it.
    agent(&h, "refused", serde_json::json!({"window_tokens": 50000})).await;
    let run = h.submit("refused", "list the files", "refused-1").await;
    let state = long_run(&h, &run).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let events = h.events(&run).await;
    let compacted = compactions(&events);
    assert!(
        compacted
            .iter()
            .any(|c| c.cause == CompactionCause::TooLong),
        "{compacted:?}"
    );
    assert_no_answer_bought_twice(&h, &events);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_strategy_fail_a_context_over_the_window_fails_the_run() {
    let h = Harness::start(script(), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    agent(&h, "strict", serde_json::json!({"strategy": "fail"})).await;
    let run = h.submit("strict", "list the files", "strict-1").await;
    let state = h.wait_terminal(&run, Duration::from_secs(120)).await;
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.expect("failure");
    assert!(
        failure.message.contains("context_length_exceeded"),
        "{}",
        failure.message
    );
    assert!(compactions(&h.events(&run).await).is_empty());
    h.shutdown().await;
}

/// A chat: every message revives the run for one more turn. The conversation the model reads
/// stays within its window (the revival's step is compacted like any other), every turn is
/// answered, and nothing is refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_long_chat_stays_within_the_models_window_turn_after_turn() {
    let long_answer = "Kedging moves a ship by its anchor. ".repeat(8);
    let script = serde_json::json!({"models": {
        "mc": {"context_window": 1200, "default": {"text": long_answer}}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent_edited("chat", "mc", |d| {
        d.max_output_tokens = 64;
        d.budget.max_steps = 1000;
        d.tools.clear();
        d.context = serde_json::from_value(
            serde_json::json!({"window_tokens": 1100, "keep_last_turns": 2}),
        )
        .expect("context settings");
    })
    .await;
    let run = h.submit("chat", "tell me about kedging", "chat-1").await;
    h.wait_terminal(&run, Duration::from_secs(30)).await;
    let turns = 30;
    for turn in 2..=turns {
        h.input(
            &run,
            Event::UserMessage(kedge_core::event::UserMessage {
                text: format!("and then? ({turn})"),
            }),
            &format!("chat-{turn}"),
        )
        .await;
        let state = h
            .wait_for(&run, Duration::from_secs(30), |s| {
                s.turn == turn && s.status.is_terminal()
            })
            .await;
        assert_eq!(
            state.status,
            RunStatus::Succeeded,
            "turn {turn}: {:?}",
            state.failure
        );
    }
    let events = h.events(&run).await;
    let compacted = compactions(&events);
    assert!(!compacted.is_empty(), "the chat outgrew the window");
    let refused = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ModelAttempt(_)))
        .count();
    assert_eq!(refused, 0, "no request over the window was sent");
    assert_no_answer_bought_twice(&h, &events);
    h.check_replay(
        &run,
        "a-long-chat-stays-within-the-models-window-turn-after-turn",
    )
    .await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn with_strategy_summarize_the_model_reads_a_summary_of_what_was_left_out() {
    let mut script = script();
    // The summary call's last message asks for the summary.
    script["models"]["mw"]["rules"]
        .as_array_mut()
        .expect("rules")
        .insert(
            0,
            serde_json::json!({
                "when_last_user_contains": "Summarize the conversation above",
                "respond": {"text": "SUMMARY: the agent listed the files many times; nothing changed."}
            }),
        );
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    agent(
        &h,
        "summarizes",
        serde_json::json!({"window_tokens": 900, "keep_last_turns": 4, "strategy": "summarize"}),
    )
    .await;
    let run = h
        .submit(
            "summarizes",
            "list the files, again and again",
            "summarize-1",
        )
        .await;
    h.wait_for(&run, Duration::from_secs(120), |s| {
        s.step.get() >= 60 || s.status.is_terminal()
    })
    .await;
    h.input(
        &run,
        Event::UserMessage(kedge_core::event::UserMessage {
            text: "finish now".into(),
        }),
        "finish-summarize",
    )
    .await;
    let state = h.wait_terminal(&run, Duration::from_secs(60)).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let events = h.events(&run).await;
    let compacted = compactions(&events);
    let summaries: Vec<&kedge_core::event::CompactionSummary> = compacted
        .iter()
        .filter_map(|c| c.summary.as_ref())
        .collect();
    assert!(
        summaries.len() >= 2,
        "{} of {} compactions summarized",
        summaries.len(),
        compacted.len()
    );
    // Each summary was bought once, under its own request id.
    let counts = h.mock.mock().calls();
    for s in &summaries {
        assert_eq!(
            counts.by_request_id.get(&s.request_id.to_string()).copied(),
            Some(1),
            "{}",
            s.request_id
        );
        assert!(s.usage.input_tokens > 0);
    }
    assert_no_answer_bought_twice(&h, &events);
    // The run's usage counts the summaries' tokens too.
    let steps_input: u64 = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::StepCompleted(c) => Some(c.usage.input_tokens),
            _ => None,
        })
        .sum();
    let summaries_input: u64 = summaries.iter().map(|s| s.usage.input_tokens).sum();
    assert_eq!(state.usage.input_tokens, steps_input + summaries_input);
    // The model reads the summary where the left-out turns were.
    let bodies = h.mock.mock().requests("mw");
    let last = bodies.last().expect("a request");
    let messages = last["messages"].as_array().expect("messages");
    assert!(
        messages.iter().any(|m| m["content"]
            .as_str()
            .is_some_and(|c| c.contains("SUMMARY: the agent listed"))),
        "the summary stands for what was left out: {messages:?}"
    );
    h.check_replay(&run, "context-summarized").await;
    h.shutdown().await;
}
