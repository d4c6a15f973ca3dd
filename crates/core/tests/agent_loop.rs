//! The agent loop driven through `fold` and `decide` alone, with an in-memory journal: the pure
//! half of every scenario the services will run against a real broker.

use kedge_core::decide::{Idle, ModelResponse, Next, StepPlan, complete_step, decide};
use kedge_core::event::{
    AssistantMessage, Budget, CancelRequested, Decision, Digest, Draft, Envelope, Event,
    FailureReason, FinishReason, ModelAttempt, Provider, QuestionAnswered, RunCreated, Timestamp,
    ToolCall, ToolResult, ToolStarted, Usage, UserMessage,
};
use kedge_core::fold::{ChatMessage, RunState, fold};
use kedge_core::ids::{OperationId, QuestionId, RunId, StepNo};
use kedge_core::machine::RunStatus;
use kedge_core::tools::{Contract, builtin};

/// Every envelope the simulated runs journal must validate against `schemas/envelope.schema.json`.
fn assert_valid(env: &Envelope) {
    static VALIDATOR: std::sync::OnceLock<jsonschema::Validator> = std::sync::OnceLock::new();
    let validator = VALIDATOR.get_or_init(|| {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../schemas/envelope.schema.json"
        );
        let text = std::fs::read_to_string(path).expect("schemas/envelope.schema.json");
        let schema: serde_json::Value = serde_json::from_str(&text).expect("json");
        jsonschema::validator_for(&schema).expect("valid schema")
    });
    let value: serde_json::Value = serde_json::from_slice(&env.to_json_bytes()).expect("json");
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| e.to_string())
        .collect();
    assert!(
        errors.is_empty(),
        "{} does not validate: {errors:?}",
        env.event_type()
    );
}

/// An in-memory journal: sequence numbers grow across all of a run's events as in the stream.
/// A clone is a fork of the run.
#[derive(Clone)]
struct Sim {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    seq: u64,
}

impl Sim {
    fn new(budget: Budget) -> Sim {
        let run: RunId = "run_sim".parse().expect("valid");
        let mut created = RunCreated {
            budget,
            idempotency_key: Some("task-1".into()),
            ..kedge_core::fixtures::run_created("demo", "research kedging")
        };
        // Priced whenever the budget limits cost.
        created.model.price = created.budget.max_cost.map(|_| kedge_core::event::Price {
            input_per_mtok: 1000.0,
            output_per_mtok: 4000.0,
            currency: "EUR".into(),
        });
        let mut sim = Sim {
            run,
            events: Vec::new(),
            seq: 0,
        };
        sim.push(Draft::new(Event::RunCreated(Box::new(created))));
        sim
    }

    fn push(&mut self, draft: Draft<impl Into<Event>>) -> u64 {
        // Other subjects of the stream (other runs) interleave: sequences have gaps.
        self.seq += 3;
        let env = Envelope::new(self.run.clone(), Timestamp::now(), draft);
        assert_valid(&env);
        self.events.push((self.seq, env));
        self.seq
    }

    fn commit(&mut self, drafts: Vec<Draft<impl Into<Event>>>) {
        for d in drafts {
            self.push(d);
        }
        // Every commit must fold: the table accepts what decide produced.
        self.state();
    }

    fn state(&self) -> RunState {
        fold(self.events.iter().map(|(s, e)| (*s, e))).expect("journal folds")
    }

    fn input(&mut self, event: Event, op: Option<OperationId>) -> u64 {
        let mut d = Draft::new(event);
        d.op = op;
        self.push(d)
    }

    fn result(&mut self, op: &OperationId, content: &str) {
        self.input(
            Event::ToolResult(ToolResult {
                content: content.into(),
                is_error: false,
                stopped: false,
            }),
            Some(op.clone()),
        );
    }

    fn expect_step(&self) -> StepPlan {
        match decide(&self.state()) {
            Next::Step(plan) => *plan,
            other => panic!("expected a step, got {other:?}"),
        }
    }

    /// Starts the next step and answers it with `response`; returns the plan.
    fn run_step(&mut self, response: ModelResponse) -> StepPlan {
        let plan = self.expect_step();
        self.commit(plan.start.clone());
        let state = self.state();
        let drafts = complete_step(
            &state,
            plan.step,
            plan.attempt,
            plan.request_id.clone(),
            response,
            false,
            Timestamp::now(),
            &Default::default(),
        );
        self.commit(drafts);
        plan
    }

    fn ops_of(&self, step: u32) -> Vec<OperationId> {
        self.state()
            .ops
            .keys()
            .filter(|o| o.step() == StepNo(step))
            .cloned()
            .collect()
    }
}

fn tools(calls: &[(&str, &str)]) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: String::new(),
            tool_calls: calls
                .iter()
                .map(|(id, name)| ToolCall {
                    call_id: (*id).into(),
                    name: (*name).into(),
                    arguments: serde_json::json!({"path": id}),
                })
                .collect(),
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 10,
            output_tokens: 5,
            cost: None,
        },
        finish: FinishReason::ToolCalls,
    }
}

fn text(t: &str) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: t.into(),
            tool_calls: vec![],
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 10,
            output_tokens: 5,
            cost: None,
        },
        finish: FinishReason::Stop,
    }
}

/// Checks the provider rule both APIs enforce: every assistant tool call is answered by a tool
/// message before the next user or assistant message.
fn assert_well_formed(context: &[ChatMessage]) {
    let mut open: Vec<String> = Vec::new();
    for m in context {
        match m {
            ChatMessage::Tool { call_id, .. } => {
                let pos = open.iter().position(|c| c == call_id);
                assert!(pos.is_some(), "tool result {call_id} answers nothing open");
                open.retain(|c| c != call_id);
            }
            ChatMessage::User { .. } | ChatMessage::Assistant { .. } => {
                assert!(
                    open.is_empty(),
                    "unanswered tool calls {open:?} before {m:?}"
                );
                if let ChatMessage::Assistant { message } = m {
                    open = message
                        .tool_calls
                        .iter()
                        .map(|c| c.call_id.clone())
                        .collect();
                }
            }
        }
    }
}

#[test]
fn three_steps_with_parallel_tools_succeed() {
    let mut sim = Sim::new(Budget::default());
    assert_eq!(sim.state().status, RunStatus::Queued);
    for step in 1..=3u32 {
        let a = format!("call_{step}a");
        let b = format!("call_{step}b");
        let plan = sim.run_step(tools(&[(&a, "read_file"), (&b, "read_file")]));
        assert_eq!(plan.step, StepNo(step));
        assert_well_formed(&plan.context);
        assert_eq!(sim.state().status, RunStatus::WaitingTool);
        let ops = sim.ops_of(step);
        assert_eq!(ops.len(), 2);
        // Results arrive in reverse order; the context still answers in call order.
        sim.result(&ops[1], "B");
        assert_eq!(
            decide(&sim.state()),
            Next::Idle(Idle::WaitingTools { missing: 1 }),
            "an early wake must not call the model"
        );
        sim.result(&ops[0], "A");
    }
    let plan = sim.run_step(text("done"));
    assert_well_formed(&plan.context);
    // 1 user input + 3 x (assistant + 2 results) in the final context.
    assert_eq!(plan.context.len(), 1 + 3 * 3);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(state.output.as_deref(), Some("done"));
    assert_eq!(state.usage.total(), 4 * 15);
    assert_eq!(decide(&state), Next::Idle(Idle::Terminal));
    record_fixture("three-steps-parallel-tools", &sim);
}

/// The context digest a long-lived state gives (its transcript hashed once, only the new
/// messages at each step: `RunState::next_context_digested`) is `Digest::of` the whole context,
/// step after step, with messages consumed mid-run, for a clone taken mid-way, and for a state
/// whose transcript is not the one it hashed.
#[test]
fn the_context_digest_of_a_state_kept_across_steps_is_the_digest_of_its_context() {
    let mut sim = Sim::new(Budget::default());
    let mut live = sim.state();
    let mut folded = sim.events.len();
    let catch_up = |live: &mut RunState, folded: &mut usize, sim: &Sim| {
        for (seq, env) in &sim.events[*folded..] {
            live.apply(*seq, env).expect("applies");
        }
        *folded = sim.events.len();
    };
    let check = |state: &RunState| {
        let (context, digest) = state.next_context_digested();
        assert_eq!(context, state.next_context());
        assert_eq!(
            digest,
            Digest::of(&context),
            "at {} messages",
            context.len()
        );
        digest
    };
    let mut digests = Vec::new();
    for step in 1..=4u32 {
        catch_up(&mut live, &mut folded, &sim);
        let digest = check(&live);
        // A fresh fold (nothing hashed yet) plans the same digest.
        assert_eq!(sim.expect_step().context_digest, digest);
        digests.push(digest);
        if step == 2 {
            // A clone carries what was hashed, and each goes on by itself.
            let clone = live.clone();
            assert_eq!(check(&clone), check(&live));
        }
        sim.run_step(tools(&[(&format!("call_{step}"), "read_file")]));
        let op = sim.ops_of(step).remove(0);
        sim.result(&op, &format!("result {step}"));
        if step % 2 == 1 {
            // Consumed by the next step: in its context, then in the transcript.
            sim.input(
                Event::UserMessage(UserMessage {
                    text: format!("and then {step}"),
                }),
                None,
            );
        }
    }
    catch_up(&mut live, &mut folded, &sim);
    check(&live);
    digests.dedup();
    assert_eq!(digests.len(), 4, "every step's context differs");
    // A transcript shorter than what was hashed (a state built or changed by hand) is hashed
    // again from its start.
    let mut cut = live.clone();
    cut.transcript.truncate(2);
    check(&cut);
}

/// With `KEDGE_BLESS=1`, writes a scenario's journal as a replay fixture (JSON lines of
/// `{"seq": …, "event": <envelope>}`) with a summary of the state it must fold into. Fixtures are
/// never rewritten silently: a changed fixture shows in review.
fn record_fixture(name: &str, sim: &Sim) {
    if std::env::var_os("KEDGE_BLESS").is_none() {
        return;
    }
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    std::fs::create_dir_all(&dir).expect("mkdir");
    let mut lines = String::new();
    for (seq, env) in &sim.events {
        let line = serde_json::json!({ "seq": seq, "event": env });
        lines.push_str(&line.to_string());
        lines.push('\n');
    }
    std::fs::write(dir.join(format!("{name}.jsonl")), lines).expect("write");
    let summary = summary(&sim.state());
    let text = serde_json::to_string_pretty(&summary).expect("json") + "\n";
    std::fs::write(dir.join(format!("{name}.expect.json")), text).expect("write");
}

fn summary(state: &RunState) -> serde_json::Value {
    kedge_core::replay::summary(state)
}

/// A replay fixture's journal: `(seq, envelope)` in order, each checked against the schema.
fn load_fixture(path: &std::path::Path) -> Vec<(u64, Envelope)> {
    let events = kedge_core::fixtures::load_journal(path);
    for (_, env) in &events {
        assert_valid(env);
    }
    events
}

#[test]
fn a_decision_this_build_would_not_make_is_found() {
    use kedge_core::replay::{Divergence, check};
    let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/three-steps-parallel-tools.jsonl");
    let events = load_fixture(&path);
    let contract = Contract::default();
    assert!(check(&events, &contract).is_ok());
    let differs_at = |journal: &[(u64, Envelope)]| match check(journal, &contract) {
        Err(Divergence::Differs { seq, .. }) => seq,
        other => panic!("not found: {other:?}"),
    };
    // An operation dispatched with other arguments than the model's call.
    let mut altered = events.clone();
    let i = altered
        .iter()
        .position(|(_, e)| matches!(e.event, Event::ToolRequested(_)))
        .expect("a tool.requested");
    if let Event::ToolRequested(t) = &mut altered[i].1.event {
        t.arguments = serde_json::json!({"path": "elsewhere"});
    }
    assert_eq!(differs_at(&altered), altered[i].0);
    // A group without its run.waiting: the next decision is not the one the code makes there.
    let mut dropped = events.clone();
    let i = dropped
        .iter()
        .position(|(_, e)| matches!(e.event, Event::RunWaiting(_)))
        .expect("a run.waiting");
    dropped.remove(i);
    let next_decision = dropped[i..]
        .iter()
        .find(|(_, e)| e.kind() == kedge_core::event::EventKind::Decision)
        .expect("a later decision")
        .0;
    assert_eq!(differs_at(&dropped), next_decision);
    // A decision after the run ended, where the code decides nothing.
    let mut extra = events.clone();
    let (last_seq, last) = extra.last().cloned().expect("events");
    extra.push((last_seq + 1, last));
    assert!(matches!(
        check(&extra, &contract),
        Err(Divergence::Unexpected { seq, .. }) if seq == last_seq + 1
    ));
}

/// The tool contract a fixture's run was decided under: the agent definition recorded beside
/// it (`<name>.agent.json`), else the default contract (the simulator's runs without one).
fn fixture_contract(journal: &std::path::Path) -> std::sync::Arc<Contract> {
    let agent = journal.with_extension("agent.json");
    match std::fs::read_to_string(&agent) {
        Ok(text) => {
            let def: kedge_core::agent::AgentDefinition =
                serde_json::from_str(&text).expect("an agent definition");
            Contract::of(&def)
        }
        Err(_) => std::sync::Arc::new(Contract::default()),
    }
}

#[test]
fn recorded_journals_replay_through_the_current_machine() {
    // Canned histories: journals recorded by earlier versions must fold to the same state.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut replayed = 0;
    for entry in std::fs::read_dir(&dir).expect("tests/fixtures exists") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let events = load_fixture(&path);
        let state = fold(events.iter().map(|(s, e)| (*s, e))).expect("old journal folds");
        let expect_path = path.with_extension("expect.json");
        let expected: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&expect_path).expect("expect file"))
                .expect("json");
        assert_eq!(summary(&state), expected, "{}", path.display());
        // The run's last change is its last event's time, its creation its first's.
        assert_eq!(
            (state.created_at, state.updated_at),
            (events[0].1.at, events[events.len() - 1].1.at),
            "{}",
            path.display()
        );
        assert_eq!(
            decide(&state),
            Next::Idle(Idle::Terminal),
            "{}",
            path.display()
        );
        // And the code still makes the decisions the journal records, at every point.
        let contract = fixture_contract(&path);
        let checked = kedge_core::replay::check(&events, &contract)
            .unwrap_or_else(|d| panic!("{}: {d}", path.display()));
        assert!(checked.groups > 0, "{}", path.display());
        replayed += 1;
    }
    assert!(replayed > 0, "no fixtures in {}", dir.display());
}

#[test]
fn a_duplicate_result_is_ignored_and_does_not_wake_twice() {
    let mut sim = Sim::new(Budget::default());
    sim.run_step(tools(&[("call_1", "write_file")]));
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "first");
    sim.result(&op, "second");
    let state = sim.state();
    assert_eq!(state.ignored_inputs, 1);
    assert_eq!(
        state.ops[&op].result.as_ref().map(|r| r.content.as_str()),
        Some("first")
    );
    let plan = sim.run_step(text("ok"));
    assert!(
        plan.context
            .iter()
            .any(|m| matches!(m, ChatMessage::Tool { content, .. } if content == "first"))
    );
}

#[test]
fn a_user_message_during_an_in_flight_step_reaches_the_next_step() {
    let mut sim = Sim::new(Budget::default());
    // The worker reads and plans...
    let plan = sim.expect_step();
    // ...a user message lands before the worker's step.started...
    sim.input(
        Event::UserMessage(UserMessage {
            text: "also check the tides".into(),
        }),
        None,
    );
    sim.commit(plan.start.clone());
    let state = sim.state();
    assert_eq!(
        state.pending_messages.len(),
        1,
        "not consumed: not in this step's context"
    );
    let drafts = complete_step(
        &state,
        plan.step,
        plan.attempt,
        plan.request_id,
        tools(&[("call_1", "read_file")]),
        false,
        Timestamp::now(),
        &Default::default(),
    );
    sim.commit(drafts);
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "tide table");
    let next = sim.expect_step();
    assert_well_formed(&next.context);
    let last = next.context.last().expect("context");
    assert_eq!(
        last,
        &ChatMessage::User {
            text: "also check the tides".into()
        },
        "the message follows the tool results"
    );
    sim.commit(next.start);
    assert!(sim.state().pending_messages.is_empty());
}

#[test]
fn a_crash_after_step_started_resumes_with_the_stored_request_then_a_new_attempt() {
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    // The worker died here. The next one is told which request may have a stored response.
    let retry = sim.expect_step();
    assert_eq!(retry.step, plan.step);
    assert_eq!(retry.attempt.get(), 2);
    let (req, digest) = retry.unfinished.clone().expect("unfinished attempt");
    assert_eq!(req, plan.request_id);
    assert_eq!(digest, plan.context_digest);
    assert_eq!(
        retry.context, plan.context,
        "same context for the same step"
    );
    // Found the stored response: complete with the first attempt, no new step.started.
    let state = sim.state();
    let drafts = complete_step(
        &state,
        plan.step,
        plan.attempt,
        req,
        text("hi"),
        true,
        Timestamp::now(),
        &Default::default(),
    );
    sim.commit(drafts);
    assert_eq!(sim.state().status, RunStatus::Succeeded);
}

#[test]
fn attempts_are_capped_and_errors_are_not_reused() {
    let budget = Budget {
        max_attempts_per_step: 2,
        ..Budget::default()
    };
    let mut sim = Sim::new(budget);
    let first = sim.expect_step();
    sim.commit(first.start.clone());
    sim.commit(vec![
        Draft::new(Event::ModelAttempt(ModelAttempt {
            request_id: first.request_id.clone(),
            outcome: kedge_core::event::AttemptOutcome::Error {
                class: kedge_core::event::ErrorClass::Retryable,
                message: "529 overloaded".into(),
                status: Some(529),
                retry_after_ms: None,
                trouble: None,
            },
        }))
        .step(first.step)
        .attempt(first.attempt),
    ]);
    let second = sim.expect_step();
    assert_eq!(second.unfinished, None, "a failed attempt stored nothing");
    sim.commit(second.start);
    match decide(&sim.state()) {
        Next::Commit(drafts) => {
            assert!(matches!(
                &drafts[0].event,
                Decision::RunFailed(f) if f.reason == FailureReason::AttemptsExhausted
            ));
            sim.commit(drafts);
        }
        other => panic!("expected failure, got {other:?}"),
    }
    assert_eq!(sim.state().status, RunStatus::Failed);
}

#[test]
fn max_steps_and_max_tokens_are_enforced() {
    let mut sim = Sim::new(Budget {
        max_steps: 1,
        ..Budget::default()
    });
    sim.run_step(tools(&[("call_1", "read_file")]));
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "x");
    assert!(matches!(
        decide(&sim.state()),
        Next::Commit(d) if matches!(&d[0].event, Decision::RunFailed(f) if f.reason == FailureReason::MaxSteps)
    ));

    let mut sim = Sim::new(Budget {
        max_tokens: 15,
        ..Budget::default()
    });
    sim.run_step(tools(&[("call_1", "read_file")]));
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "x");
    assert!(matches!(
        decide(&sim.state()),
        Next::Commit(d) if matches!(&d[0].event, Decision::RunFailed(f) if f.reason == FailureReason::MaxTokens)
    ));
}

#[test]
fn max_cost_is_enforced_like_tokens_at_the_frozen_price() {
    // 10 input and 5 output tokens a step at 1000 and 4000 EUR per million: 0.03 EUR a step.
    let mut sim = Sim::new(Budget {
        max_cost: Some(0.05),
        ..Budget::default()
    });
    sim.run_step(tools(&[("call_1", "read_file")]));
    let cost = sim.state().usage.cost.expect("priced");
    assert!((cost - 0.03).abs() < 1e-12, "{cost}");
    let completed = sim
        .events
        .iter()
        .find_map(|(_, e)| match &e.event {
            Event::StepCompleted(done) => Some(done.usage),
            _ => None,
        })
        .expect("step.completed");
    assert_eq!(completed.cost, Some(cost), "each step records what it cost");
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "x");
    // Under the limit: a second step.
    sim.run_step(tools(&[("call_2", "read_file")]));
    let op = sim.ops_of(2).remove(0);
    sim.result(&op, "y");
    let state = sim.state();
    assert!(state.usage.cost.expect("priced") >= 0.05);
    assert!(matches!(
        decide(&state),
        Next::Commit(d) if matches!(&d[0].event, Decision::RunFailed(f)
            if f.reason == FailureReason::MaxCost && f.message.contains("EUR"))
    ));
}

#[test]
fn a_step_a_fallback_answered_is_priced_and_named_as_that_models_and_replays() {
    let mut sim = Sim::new(Budget {
        max_cost: Some(10.0),
        ..Budget::default()
    });
    // The shell names the fallback in the attempt's `step.started`.
    let mut fallback = sim.state().bundle.model.clone();
    fallback.name = "the-fallback".into();
    fallback.price = Some(kedge_core::event::Price {
        input_per_mtok: 2000.0,
        output_per_mtok: 8000.0,
        currency: "EUR".into(),
    });
    let mut plan = sim.expect_step();
    for d in &mut plan.start {
        if let Decision::StepStarted(started) = &mut d.event {
            started.model = Some(fallback.clone());
        }
    }
    sim.commit(plan.start.clone());
    let state = sim.state();
    assert_eq!(
        state
            .open_step
            .as_ref()
            .map(|o| o.model(&state.bundle).name.as_str()),
        Some("the-fallback")
    );
    let drafts = complete_step(
        &state,
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        tools(&[("call_1", "read_file")]),
        false,
        Timestamp::now(),
        &Default::default(),
    );
    sim.commit(drafts);
    // 10 input and 5 output tokens at the fallback's 2000 and 8000 EUR per million (the run's
    // own model would have cost half).
    let cost = sim.state().usage.cost.expect("priced");
    assert!((cost - 0.06).abs() < 1e-12, "{cost}");
    let named = sim.events.iter().find_map(|(_, e)| match &e.event {
        Event::StepCompleted(done) => Some(done.model.clone()),
        _ => None,
    });
    assert_eq!(named, Some(Some("the-fallback".to_owned())));
    // The next step is the run's own model's again unless the shell says otherwise.
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "x");
    let next = sim.run_step(text("done"));
    assert!(next.start.iter().all(|d| !matches!(
        &d.event,
        Decision::StepStarted(s) if s.model.is_some()
    )));
    let done = sim.events.iter().rev().find_map(|(_, e)| match &e.event {
        Event::StepCompleted(c) => Some(c.clone()),
        _ => None,
    });
    assert_eq!(done.and_then(|c| c.model), None);
    // Replay takes the fallback named in `step.started` as a fact.
    kedge_core::replay::check(&sim.events, &Default::default()).expect("replays");
}

#[test]
fn ask_user_waits_for_the_answer_which_becomes_the_tool_result() {
    let mut sim = Sim::new(Budget::default());
    sim.run_step(tools(&[("call_q", "ask_user"), ("call_r", "read_file")]));
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingUser);
    let ops = sim.ops_of(1);
    let q = QuestionId::for_operation(&ops[0]);
    assert!(state.questions.contains_key(&q));
    sim.result(&ops[1], "file");
    assert_eq!(decide(&sim.state()), Next::Idle(Idle::WaitingUser));
    sim.input(
        Event::QuestionAnswered(QuestionAnswered {
            question_id: q,
            answer: "yes, go on".into(),
        }),
        None,
    );
    let plan = sim.run_step(text("thanks"));
    assert_well_formed(&plan.context);
    assert!(plan.context.iter().any(
        |m| matches!(m, ChatMessage::Tool { call_id, content, .. } if call_id == "call_q" && content == "yes, go on")
    ));
}

#[test]
fn a_new_message_revives_a_succeeded_run_but_not_a_cancelled_one() {
    let mut sim = Sim::new(Budget::default());
    sim.run_step(text("first answer"));
    assert_eq!(sim.state().status, RunStatus::Succeeded);
    sim.input(
        Event::UserMessage(UserMessage {
            text: "and then?".into(),
        }),
        None,
    );
    let plan = sim.expect_step();
    assert!(matches!(plan.start[0].event, Decision::RunRevived(_)));
    sim.run_step(text("second answer"));
    let state = sim.state();
    assert_eq!(state.turn, 2);
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(state.output.as_deref(), Some("second answer"));

    let mut sim = Sim::new(Budget::default());
    sim.input(
        Event::CancelRequested(CancelRequested {
            reason: "user".into(),
            by: None,
        }),
        None,
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancel expected")
    };
    sim.commit(d);
    assert_eq!(sim.state().status, RunStatus::Cancelled);
    sim.input(
        Event::UserMessage(UserMessage {
            text: "wake up".into(),
        }),
        None,
    );
    let state = sim.state();
    assert_eq!(state.ignored_inputs, 1);
    assert_eq!(decide(&state), Next::Idle(Idle::Terminal));
}

#[test]
fn cancel_waits_for_running_operations_and_names_every_outcome() {
    let mut sim = Sim::new(Budget::default());
    sim.run_step(tools(&[("call_1", "shell"), ("call_2", "write_file")]));
    let ops = sim.ops_of(1);
    sim.input(
        Event::ToolStarted(ToolStarted {
            runner: "tool-1".into(),
            attempt: 1,
        }),
        Some(ops[0].clone()),
    );
    sim.input(
        Event::CancelRequested(CancelRequested {
            reason: "stop".into(),
            by: Some("alice".into()),
        }),
        None,
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancelling expected")
    };
    assert_eq!(d.len(), 1, "an operation is running: only cancelling");
    sim.commit(d);
    assert_eq!(sim.state().status, RunStatus::Cancelling);
    assert_eq!(
        decide(&sim.state()),
        Next::Idle(Idle::Stopping { running: 1 })
    );
    sim.input(
        Event::ToolResult(ToolResult {
            content: "killed".into(),
            is_error: true,
            stopped: true,
        }),
        Some(ops[0].clone()),
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancelled expected")
    };
    let Decision::RunCancelled(c) = &d[0].event else {
        panic!("cancelled expected")
    };
    let fates: Vec<_> = c.operations.iter().map(|o| o.fate).collect();
    use kedge_core::event::OpFate;
    assert_eq!(fates, vec![OpFate::Stopped, OpFate::NeverStarted]);
    sim.commit(d);
    assert_eq!(sim.state().status, RunStatus::Cancelled);
    record_fixture("cancel-with-running-tool", &sim);
}

#[test]
fn cancel_mid_step_is_reachable() {
    // Seed 004 8.3: a cancel while a step is in flight must still end the run.
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start);
    sim.input(
        Event::CancelRequested(CancelRequested {
            reason: "stop".into(),
            by: None,
        }),
        None,
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancel expected")
    };
    sim.commit(d);
    assert_eq!(sim.state().status, RunStatus::Cancelled);
}

#[test]
fn a_refused_decision_does_not_fold() {
    let mut sim = Sim::new(Budget::default());
    sim.run_step(text("done"));
    sim.push(Draft::new(Event::RunSucceeded(
        kedge_core::event::RunSucceeded {
            output: "again".into(),
            validation: Default::default(),
        },
    )));
    let err = fold(sim.events.iter().map(|(s, e)| (*s, e))).expect_err("terminal overwritten");
    assert!(
        err.to_string()
            .contains("not allowed in status `succeeded`"),
        "{err}"
    );
}

#[test]
fn wait_schedules_a_timer_whose_firing_is_the_result() {
    use kedge_core::event::{TimerFired, TimerPurpose};
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    let now = Timestamp::now();
    let mut wait = tools(&[("call_w", "wait")]);
    wait.message.tool_calls[0].arguments = serde_json::json!({"seconds": 90});
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id,
        wait,
        false,
        now,
        &Default::default(),
    );
    sim.commit(drafts);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingExternal);
    let (timer_id, timer) = state.timers.iter().next().expect("a timer");
    assert_eq!(timer.fire_at.0 - now.0, time::Duration::seconds(90));
    let op = sim.ops_of(1).remove(0);
    assert_eq!(timer.purpose, TimerPurpose::Wait { op: op.clone() });
    assert_eq!(decide(&state), Next::Idle(Idle::WaitingExternal));
    let fired = Event::TimerFired(TimerFired {
        timer_id: timer_id.clone(),
    });
    sim.input(fired.clone(), None);
    sim.input(fired, None);
    let state = sim.state();
    assert_eq!(state.ignored_inputs, 1, "a timer fires once");
    assert!(state.ops[&op].result.is_some());
    let next = sim.run_step(text("rested"));
    assert_well_formed(&next.context);
    assert_eq!(sim.state().status, RunStatus::Succeeded);
}

#[test]
fn a_run_deadline_is_a_durable_timer_that_fails_the_run() {
    use kedge_core::event::{TimerFired, TimerPurpose};
    let mut sim = Sim::new(Budget {
        deadline_secs: Some(60),
        ..Budget::default()
    });
    sim.run_step(tools(&[("call_1", "read_file")]));
    let state = sim.state();
    let (id, timer) = state
        .timers
        .iter()
        .find(|(_, t)| t.purpose == TimerPurpose::RunDeadline)
        .expect("a deadline timer");
    assert_eq!(
        timer.fire_at.0 - state.created_at.0,
        time::Duration::seconds(60)
    );
    sim.input(
        Event::TimerFired(TimerFired {
            timer_id: id.clone(),
        }),
        None,
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("the deadline fails the run")
    };
    assert!(matches!(&d[0].event, Decision::RunFailed(f) if f.reason == FailureReason::Deadline));
    sim.commit(d);
    assert_eq!(sim.state().status, RunStatus::Failed);
}

#[test]
fn a_decision_group_cut_short_at_any_point_is_finished_by_the_next_writer() {
    use kedge_core::decide::finish_step;
    let response = tools(&[
        ("call_a", "read_file"),
        ("call_b", "ask_user"),
        ("call_c", "wait"),
    ]);
    // The reference: the whole group journaled.
    let mut whole = Sim::new(Budget::default());
    let plan = whole.expect_step();
    whole.commit(plan.start.clone());
    let now = Timestamp::now();
    let group = complete_step(
        &whole.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        response.clone(),
        false,
        now,
        &Default::default(),
    );
    assert!(group.len() > 4);
    whole.commit(group.clone());
    let reference = whole.state();
    // The writer died after each possible prefix (step.completed always landed).
    for cut in 1..group.len() {
        let mut sim = Sim::new(Budget::default());
        let plan = sim.expect_step();
        sim.commit(plan.start.clone());
        for d in &group[..cut] {
            sim.push(d.clone());
        }
        let state = sim.state();
        let Next::Finish(c) = decide(&state) else {
            panic!("cut at {cut}: the group must be finished first")
        };
        assert_eq!(c.landed, cut - 1);
        let rest = finish_step(&state, &c, now, &Default::default());
        assert_eq!(rest, group[cut..].to_vec(), "cut at {cut}");
        sim.commit(rest);
        let state = sim.state();
        assert_eq!(state.status, reference.status, "cut at {cut}");
        assert_eq!(state.ops.len(), reference.ops.len());
        assert_eq!(state.timers, reference.timers);
        assert_eq!(state.questions, reference.questions);
        assert!(state.completing.is_none());
    }
}

#[test]
fn a_question_that_times_out_closes_and_the_model_is_told() {
    use kedge_core::event::{TimerFired, TimerPurpose};
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    let mut ask = tools(&[("call_q", "ask_user")]);
    ask.message.tool_calls[0].arguments =
        serde_json::json!({"question": "ok?", "timeout_seconds": 30});
    let now = Timestamp::now();
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id,
        ask,
        false,
        now,
        &Default::default(),
    );
    sim.commit(drafts);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingUser);
    let (timer_id, timer) = state.timers.iter().next().expect("a timeout timer");
    assert!(matches!(
        timer.purpose,
        TimerPurpose::QuestionTimeout { .. }
    ));
    assert_eq!(timer.fire_at.0 - now.0, time::Duration::seconds(30));
    sim.input(
        Event::TimerFired(TimerFired {
            timer_id: timer_id.clone(),
        }),
        None,
    );
    let q = sim.state().questions.keys().next().expect("q").clone();
    sim.input(
        Event::QuestionAnswered(QuestionAnswered {
            question_id: q.clone(),
            answer: "too late".into(),
        }),
        None,
    );
    let state = sim.state();
    assert!(!state.questions[&q].is_open());
    assert_eq!(state.ignored_inputs, 1, "the late answer is ignored");
    let next = sim.run_step(text("no answer then"));
    assert!(next.context.iter().any(
        |m| matches!(m, ChatMessage::Tool { content, is_error: true, .. } if content.starts_with("no answer before"))
    ));
}

/// Fills in the target version the step service observes before committing an approval request.
fn observed(drafts: Vec<Draft<Decision>>, version: &str) -> Vec<Draft<Decision>> {
    drafts
        .into_iter()
        .map(|mut d| {
            if let Decision::ApprovalRequested(r) = &mut d.event {
                r.target_version = Some(version.into());
            }
            d
        })
        .collect()
}

fn approve(sim: &mut Sim, version: u32) {
    let state = sim.state();
    let (id, a) = state
        .approvals
        .iter()
        .find(|(_, a)| a.request.plan_version == version)
        .expect("the approval");
    sim.input(
        Event::ApprovalDecided(kedge_core::event::ApprovalDecided {
            approval_id: id.clone(),
            verdict: kedge_core::event::Verdict::Approve,
            args_digest: a.request.args_digest.clone(),
            approver: "alice".into(),
            comment: None,
        }),
        a.op.clone(),
    );
}

fn commit_next(sim: &mut Sim) -> Vec<Draft<Decision>> {
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("a commit expected, got {:?}", decide(&sim.state()))
    };
    sim.commit(d.clone());
    d
}

#[test]
fn an_approved_operation_whose_target_moved_is_asked_again_and_runs_under_the_new_approval() {
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    let policy: std::collections::BTreeMap<String, kedge_core::agent::ToolPolicy> = [(
        "write_file".to_owned(),
        kedge_core::agent::ToolPolicy {
            approval: kedge_core::agent::ApprovalRule::Always,
            timeout_secs: Some(7),
            // Plumbing only (a stored definition grants the network to `shell` alone).
            network: true,
            ..Default::default()
        },
    )]
    .into();
    let declared = [kedge_core::agent::ToolSpec {
        name: "write_file".into(),
        description: String::new(),
        parameters: serde_json::json!({"type": "object"}),
    }];
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        tools(&[("call_1", "write_file")]),
        false,
        Timestamp::now(),
        &Contract::new(&declared, &policy),
    );
    sim.commit(observed(drafts, "v1"));
    assert_eq!(sim.state().status, RunStatus::WaitingApproval);
    approve(&mut sim, 1);
    let d = commit_next(&mut sim);
    let Decision::ToolRequested(req) = &d[0].event else {
        panic!("dispatch expected: {d:?}")
    };
    assert_eq!(req.expect_version.as_deref(), Some("v1"));
    assert_eq!(req.redispatch, 0);
    assert_eq!(
        req.limits.timeout_secs,
        Some(7),
        "the policy's limit reaches the dispatch"
    );
    assert!(req.limits.network, "so does its network grant");
    assert_eq!(sim.state().status, RunStatus::WaitingTool);
    let op = sim.ops_of(1)[0].clone();
    // The runner finds the target elsewhere and does not run it.
    sim.input(
        Event::TargetMoved(kedge_core::event::TargetMoved {
            expected: "v1".into(),
            found: "v2".into(),
        }),
        Some(op.clone()),
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("invalidation expected")
    };
    let types: Vec<_> = d.iter().map(|d| d.event.event_type().as_str()).collect();
    assert_eq!(
        types,
        [
            "approval.invalidated",
            "approval.requested",
            "timer.scheduled",
            "run.waiting"
        ]
    );
    sim.commit(observed(d, "v2"));
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingApproval);
    assert_eq!(
        state.ops[&op].target_moved, None,
        "cleared by the fresh request"
    );
    // The old approval authorises nothing: deciding it again changes nothing.
    assert!(matches!(decide(&state), Next::Idle(_)));
    approve(&mut sim, 2);
    let d = commit_next(&mut sim);
    let Decision::ToolRequested(req) = &d[0].event else {
        panic!("dispatch expected: {d:?}")
    };
    assert_eq!(req.expect_version.as_deref(), Some("v2"));
    assert_eq!(req.redispatch, 1, "the next dispatch of the same operation");
    assert_eq!(req.limits.timeout_secs, Some(7), "and every later one");
    assert!(req.limits.network, "and every later one");
    sim.result(&op, "written");
    assert!(matches!(decide(&sim.state()), Next::Step(_)));
}

#[test]
fn operations_without_an_outcome_past_the_cutoff_are_stuck_but_questions_never_are() {
    let mut sim = Sim::new(Budget::default());
    sim.run_step(tools(&[("call_1", "shell"), ("call_2", "ask_user")]));
    let ops = sim.ops_of(1);
    let later = Timestamp(Timestamp::now().0 + time::Duration::hours(1));
    let earlier = Timestamp(Timestamp::now().0 - time::Duration::hours(1));
    let state = sim.state();
    let stuck: Vec<_> = state
        .ops_stuck_since(later)
        .iter()
        .map(|o| o.op.clone())
        .collect();
    assert_eq!(
        stuck,
        vec![ops[0].clone()],
        "the question waits legitimately"
    );
    assert!(
        state.ops_stuck_since(earlier).is_empty(),
        "young: not stuck"
    );
    sim.input(
        Event::ToolStarted(ToolStarted {
            runner: "tool-1".into(),
            attempt: 1,
        }),
        Some(ops[0].clone()),
    );
    assert_eq!(
        sim.state().ops_stuck_since(later).len(),
        1,
        "started, no outcome"
    );
    sim.result(&ops[0], "done");
    assert!(
        sim.state().ops_stuck_since(later).is_empty(),
        "it has its outcome"
    );
}

// ---------------------------------------------------------------------------------------------
// The tool contract: only declared tools run, with arguments their schema
// accepts; any other call is answered with the refusal and nothing is dispatched.
// ---------------------------------------------------------------------------------------------

/// The contract of an agent that declares the built-ins `read_file` and `shell` (Kedge's schemas).
fn read_and_shell() -> Contract {
    let tools: Vec<_> = ["read_file", "shell"]
        .iter()
        .map(|n| builtin(n).expect("built-in").spec())
        .collect();
    // A policy for the undeclared tool must not matter: it never gets that far.
    Contract::new(&tools, &Default::default())
}

fn calls(calls: &[(&str, &str, serde_json::Value)]) -> ModelResponse {
    let mut r = tools(&[]);
    r.message.tool_calls = calls
        .iter()
        .map(|(id, name, arguments)| ToolCall {
            call_id: (*id).into(),
            name: (*name).into(),
            arguments: arguments.clone(),
        })
        .collect();
    r
}

/// Completes the open step with `response` under `contract`; returns the group.
fn complete_under(
    sim: &mut Sim,
    contract: &Contract,
    response: ModelResponse,
) -> Vec<Draft<Decision>> {
    let mut plan = sim.expect_step();
    plan.answer_refused(contract);
    sim.commit(plan.start.clone());
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        response,
        false,
        Timestamp::now(),
        contract,
    );
    sim.commit(drafts.clone());
    drafts
}

fn types(drafts: &[Draft<Decision>]) -> Vec<&'static str> {
    drafts
        .iter()
        .map(|d| d.event.event_type().as_str())
        .collect()
}

#[test]
fn undeclared_tools_and_invalid_arguments_are_refused_and_never_dispatched() {
    let contract = read_and_shell();
    let mut sim = Sim::new(Budget::default());
    let group = complete_under(
        &mut sim,
        &contract,
        calls(&[
            (
                "c_write",
                "write_file",
                serde_json::json!({"path": "x", "content": "pwned"}),
            ),
            ("c_bad", "read_file", serde_json::json!({"path": 5})),
            (
                "c_ok",
                "read_file",
                serde_json::json!({"path": "notes.txt"}),
            ),
        ]),
    );
    // A fresh run's first step group marks the gate it takes (`run.gated`) and settles the
    // status without `run.waiting`.
    assert_eq!(
        types(&group),
        ["step.completed", "run.gated", "tool.requested"],
        "only the valid call is dispatched"
    );
    assert_eq!(sim.state().status, RunStatus::WaitingTool);
    let Decision::ToolRequested(req) = &group[2].event else {
        unreachable!()
    };
    assert_eq!(
        (req.tool.as_str(), req.call_id.as_str()),
        ("read_file", "c_ok")
    );
    assert_eq!(group[2].op, Some(OperationId::new(&sim.run, StepNo(1), 2)));
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingTool);
    assert_eq!(state.ops.len(), 1, "no operation exists for a refused call");
    assert!(state.approvals.is_empty());
    assert_eq!(
        decide(&state),
        Next::Idle(Idle::WaitingTools { missing: 1 }),
        "the dispatched call is still out"
    );
    sim.result(&sim.ops_of(1)[0], "the notes");
    // The next step's context answers every call: the refusals are readable error results.
    let mut plan = sim.expect_step();
    let before = plan.context_digest.clone();
    plan.answer_refused(&contract);
    assert_ne!(plan.context_digest, before);
    assert_eq!(plan.context_digest, Digest::of(&plan.context));
    let Some(Decision::StepStarted(started)) = plan.start.last().map(|d| &d.event) else {
        panic!("step.started last")
    };
    assert_eq!(
        started.context_digest, plan.context_digest,
        "journaled digest follows"
    );
    assert_well_formed(&plan.context);
    let result = |id: &str| {
        plan.context
            .iter()
            .find_map(|m| match m {
                ChatMessage::Tool {
                    call_id,
                    content,
                    is_error,
                } if call_id == id => Some((content.clone(), *is_error)),
                _ => None,
            })
            .unwrap_or_else(|| panic!("no result for {id}"))
    };
    let (write, is_error) = result("c_write");
    assert!(
        is_error && write.contains("tool not offered") && write.contains("write_file"),
        "{write}"
    );
    let (bad, is_error) = result("c_bad");
    assert!(is_error && bad.contains("at /path:"), "{bad}");
    assert_eq!(result("c_ok"), ("the notes".to_owned(), false));
    // The refusals right after the turn, in call order, then the results journaled.
    let answers: Vec<&str> = plan
        .context
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { call_id, .. } => Some(call_id.as_str()),
            ChatMessage::User { .. } | ChatMessage::Assistant { .. } => None,
        })
        .collect();
    assert_eq!(answers, ["c_write", "c_bad", "c_ok"]);
    // Answering again changes nothing (every worker and attempt builds the same context).
    let once = plan.clone();
    plan.answer_refused(&contract);
    assert_eq!(plan, once);
    sim.commit(plan.start.clone());
    let done = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        text("done"),
        false,
        Timestamp::now(),
        &contract,
    );
    sim.commit(done);
    assert_eq!(sim.state().status, RunStatus::Succeeded);
}

#[test]
fn a_step_whose_calls_are_all_refused_goes_on_to_the_next_step() {
    let contract = read_and_shell();
    let mut sim = Sim::new(Budget::default());
    let group = complete_under(
        &mut sim,
        &contract,
        calls(&[
            ("c1", "ask_user", serde_json::json!({"question": "?"})),
            ("c2", "shell", serde_json::json!({"command": ["ls"]})),
        ]),
    );
    assert_eq!(
        types(&group),
        ["step.completed", "run.gated"],
        "nothing dispatched, no question"
    );
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingTool);
    assert!(state.questions.is_empty() && state.ops.is_empty());
    let mut plan = sim.expect_step();
    plan.answer_refused(&contract);
    assert_well_formed(&plan.context);
    assert_eq!(
        plan.context
            .iter()
            .filter(|m| matches!(m, ChatMessage::Tool { is_error: true, .. }))
            .count(),
        2
    );
    // The model tries again, correctly this time.
    let group = complete_under(
        &mut sim,
        &contract,
        calls(&[("c3", "shell", serde_json::json!({"command": "ls"}))]),
    );
    assert_eq!(types(&group), ["step.completed", "tool.requested"]);
    assert_eq!(sim.state().status, RunStatus::WaitingTool);
}

#[test]
fn a_cut_short_group_with_refusals_is_finished_the_same_way() {
    let contract = read_and_shell();
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    let response = calls(&[
        ("c1", "write_file", serde_json::json!({})),
        ("c2", "read_file", serde_json::json!({"path": "a"})),
    ]);
    let now = Timestamp::now();
    let group = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        response,
        false,
        now,
        &contract,
    );
    // The writer died after `step.completed`.
    sim.commit(group[..1].to_vec());
    let Next::Finish(c) = decide(&sim.state()) else {
        panic!("finish expected")
    };
    let rest = kedge_core::decide::finish_step(&sim.state(), &c, now, &contract);
    assert_eq!(rest, group[1..].to_vec());
}

#[test]
fn huge_durations_never_panic_they_saturate() {
    // A run created before budgets were range-checked (or any bundle) with an absurd deadline.
    let mut sim = Sim::new(Budget {
        deadline_secs: Some(u64::MAX),
        ..Budget::default()
    });
    let plan = sim.expect_step();
    let fire_at = plan
        .start
        .iter()
        .find_map(|d| match &d.event {
            Decision::TimerScheduled(t) => Some(t.fire_at),
            _ => None,
        })
        .expect("deadline timer");
    assert_eq!(fire_at, Timestamp::MAX);
    sim.commit(plan.start.clone());
    // Approval validity, waits and question timeouts from policy and model output.
    let policy: std::collections::BTreeMap<String, kedge_core::agent::ToolPolicy> = [(
        "shell".to_owned(),
        kedge_core::agent::ToolPolicy {
            approval: kedge_core::agent::ApprovalRule::Always,
            approval_ttl_secs: Some(u64::MAX),
            ..Default::default()
        },
    )]
    .into();
    let declared: Vec<_> = ["shell", "wait", "ask_user", "await_callback"]
        .iter()
        .map(|n| builtin(n).expect("built-in").spec())
        .collect();
    let contract = Contract::new(&declared, &policy);
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        calls(&[
            ("c1", "shell", serde_json::json!({"command": "ls"})),
            ("c2", "wait", serde_json::json!({"seconds": 1e308})),
            (
                "c3",
                "ask_user",
                serde_json::json!({"question": "?", "timeout_seconds": 1e308}),
            ),
            (
                "c4",
                "await_callback",
                serde_json::json!({"timeout_seconds": 1e308}),
            ),
        ]),
        false,
        Timestamp::now(),
        &contract,
    );
    let expiry = drafts
        .iter()
        .find_map(|d| match &d.event {
            Decision::ApprovalRequested(a) => Some(a.expires_at),
            _ => None,
        })
        .expect("approval requested");
    assert_eq!(expiry, Timestamp::MAX);
    sim.commit(observed(drafts, "v1"));
    assert_eq!(sim.state().status, RunStatus::WaitingApproval);
    assert!(Timestamp::MAX.saturating_add(std::time::Duration::MAX) == Timestamp::MAX);
    assert_eq!(
        Timestamp::MIN.saturating_add_signed(time::Duration::MIN),
        Timestamp::MIN
    );
}

fn structured(on_invalid: kedge_core::agent::OnInvalidOutput) -> Contract {
    let schema = serde_json::json!({
        "type": "object",
        "required": ["answer", "sources"],
        "properties": {
            "answer": {"type": "string"},
            "sources": {"type": "array", "items": {"type": "string"}}
        }
    });
    read_and_shell().with_output(Some(&schema), on_invalid)
}

/// The group that ends the run, and the same group recomputed the way a replay after a crash
/// would (the writer died after `step.completed`; the next one finishes it).
fn final_group(contract: &Contract, answer: &str) -> (Vec<Draft<Decision>>, Sim) {
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    let now = Timestamp::now();
    let group = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        text(answer),
        false,
        now,
        contract,
    );
    let mut replay = Sim::new(Budget::default());
    replay.commit(plan.start.clone());
    replay.commit(group[..1].to_vec());
    let Next::Finish(c) = decide(&replay.state()) else {
        panic!("finish expected")
    };
    let rest = kedge_core::decide::finish_step(&replay.state(), &c, now, contract);
    assert_eq!(rest, group[1..].to_vec(), "a replay decides the same");
    sim.commit(group.clone());
    (group, sim)
}

#[test]
fn a_final_answer_is_validated_against_the_output_schema() {
    use kedge_core::agent::OnInvalidOutput;
    use kedge_core::event::OutputValidation;
    // No schema: not checked, free text succeeds.
    let (group, _) = final_group(&read_and_shell(), "plain words");
    assert!(matches!(
        &group.last().expect("event").event,
        Decision::RunSucceeded(s) if s.validation == OutputValidation::NotChecked
    ));
    // Valid.
    for on_invalid in [OnInvalidOutput::Fail, OnInvalidOutput::Accept] {
        let (group, sim) = final_group(
            &structured(on_invalid),
            r#"{"answer": "42", "sources": ["a", "b"]}"#,
        );
        assert!(
            matches!(&group.last().expect("event").event,
                Decision::RunSucceeded(s) if s.validation == OutputValidation::Valid),
            "{group:?}"
        );
        assert_eq!(
            sim.state().status,
            kedge_core::machine::RunStatus::Succeeded
        );
    }
    // Invalid, fail: the run fails naming the JSON paths.
    let bad = r#"{"answer": 42, "sources": ["a", 7]}"#;
    let (group, sim) = final_group(&structured(OnInvalidOutput::Fail), bad);
    let Decision::RunFailed(f) = &group.last().expect("event").event else {
        panic!("run.failed expected: {group:?}")
    };
    assert_eq!(f.reason, FailureReason::InvalidOutput);
    assert!(f.message.contains("at /answer:"), "{}", f.message);
    assert!(f.message.contains("at /sources/1:"), "{}", f.message);
    assert_eq!(sim.state().status, kedge_core::machine::RunStatus::Failed);
    // Invalid, accept: the run succeeds with the errors.
    let (group, sim) = final_group(&structured(OnInvalidOutput::Accept), bad);
    let Decision::RunSucceeded(s) = &group.last().expect("event").event else {
        panic!("run.succeeded expected: {group:?}")
    };
    let OutputValidation::Invalid { errors } = &s.validation else {
        panic!("invalid expected: {s:?}")
    };
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert!(errors[0].starts_with("at /answer:"), "{errors:?}");
    assert_eq!(s.output, bad);
    assert_eq!(
        sim.state().status,
        kedge_core::machine::RunStatus::Succeeded
    );
    // Not JSON at all.
    let (group, _) = final_group(&structured(OnInvalidOutput::Accept), "Sure! Here it is.");
    assert!(
        matches!(&group.last().expect("event").event,
            Decision::RunSucceeded(s) if matches!(&s.validation,
                OutputValidation::Invalid { errors } if errors[0].contains("not JSON"))),
        "{group:?}"
    );
    // A step that calls tools is not a final answer: nothing is validated.
    let mut sim = Sim::new(Budget::default());
    let group = complete_under(
        &mut sim,
        &structured(OnInvalidOutput::Fail),
        calls(&[("c1", "read_file", serde_json::json!({"path": "a"}))]),
    );
    assert_eq!(types(&group).last(), Some(&"tool.requested"));
    assert_eq!(sim.state().status, RunStatus::WaitingTool);
}

// ---------------------------------------------------------------------------------------------
// Per-tool retry policy: the policy rides on every dispatch, a failed attempt
// (`tool.attempt`) is not a result, and the model reads the one result of the last attempt.
// ---------------------------------------------------------------------------------------------

fn shell_with_retry(approval: bool) -> (Contract, kedge_core::tools::RetryPolicy) {
    let retry = kedge_core::tools::RetryPolicy {
        attempts: 3,
        ..Default::default()
    };
    let policy: std::collections::BTreeMap<String, kedge_core::agent::ToolPolicy> = [(
        "shell".to_owned(),
        kedge_core::agent::ToolPolicy {
            approval: if approval {
                kedge_core::agent::ApprovalRule::Always
            } else {
                kedge_core::agent::ApprovalRule::Never
            },
            timeout_secs: Some(2),
            retry: Some(retry.clone()),
            ..Default::default()
        },
    )]
    .into();
    let declared = vec![builtin("shell").expect("built-in").spec()];
    (Contract::new(&declared, &policy), retry)
}

fn attempt_failed(sim: &mut Sim, op: &OperationId, attempt: u32, retry_at: Timestamp) {
    sim.input(
        Event::ToolAttempt(kedge_core::event::ToolAttempt {
            attempt,
            dispatch: 0,
            class: kedge_core::tools::ToolErrorClass::Transient,
            error: format!("cannot connect ({attempt})"),
            delay_ms: 1_000,
            retry_at,
        }),
        Some(op.clone()),
    );
}

fn started(sim: &mut Sim, op: &OperationId, attempt: u32) {
    sim.input(
        Event::ToolStarted(ToolStarted {
            runner: "tool-1".into(),
            attempt,
        }),
        Some(op.clone()),
    );
}

#[test]
fn failed_attempts_are_not_results_and_the_model_reads_the_last_attempts_result() {
    let mut sim = Sim::new(Budget::default());
    let (contract, retry) = shell_with_retry(false);
    let drafts = complete_under(
        &mut sim,
        &contract,
        calls(&[("call_1", "shell", serde_json::json!({"command": "ls"}))]),
    );
    let request = drafts
        .iter()
        .find_map(|d| match &d.event {
            Decision::ToolRequested(t) => Some(t.clone()),
            _ => None,
        })
        .expect("dispatched");
    assert_eq!(
        request.limits.retry,
        Some(retry),
        "the frozen policy rides on the dispatch"
    );
    assert_eq!(
        request.limits.timeout_secs,
        Some(2),
        "the per-attempt limit too"
    );
    let op = sim.ops_of(1)[0].clone();

    started(&mut sim, &op, 1);
    let far = Timestamp(Timestamp::now().0 + time::Duration::minutes(8));
    attempt_failed(&mut sim, &op, 1, far);
    let state = sim.state();
    let o = &state.ops[&op];
    assert_eq!(
        o.status,
        kedge_core::fold::OpStatus::Requested,
        "waits for attempt 2"
    );
    assert_eq!((o.result.as_ref(), o.failed_attempts), (None, 1));
    assert_eq!(o.since, far, "counted from when the next attempt is due");
    assert_eq!(state.status, RunStatus::WaitingTool);
    assert!(
        matches!(decide(&state), Next::Idle(_)),
        "a failed attempt wakes no step: the model does not see it"
    );
    assert!(
        state
            .ops_stuck_since(Timestamp(Timestamp::now().0 + time::Duration::minutes(7)))
            .is_empty(),
        "a long backoff is not a stuck operation"
    );
    assert_eq!(
        state
            .ops_stuck_since(Timestamp(far.0 + time::Duration::seconds(1)))
            .len(),
        1,
        "an attempt overdue past the cutoff is"
    );
    // A repeat of the same attempt, or an older one, changes nothing.
    attempt_failed(&mut sim, &op, 1, Timestamp::now());
    assert_eq!(sim.state().ops[&op].since, far);

    started(&mut sim, &op, 2);
    attempt_failed(&mut sim, &op, 2, Timestamp::now());
    started(&mut sim, &op, 3);
    assert!(matches!(
        sim.state().ops[&op].status,
        kedge_core::fold::OpStatus::Started { .. }
    ));
    sim.result(&op, "third time lucky");
    // Late news of an attempt after the result is ignored.
    attempt_failed(&mut sim, &op, 3, Timestamp::now());
    let state = sim.state();
    assert_eq!(state.ops[&op].status, kedge_core::fold::OpStatus::Done);
    let plan = sim.expect_step();
    let results: Vec<&str> = plan
        .context
        .iter()
        .filter_map(|m| match m {
            ChatMessage::Tool { content, .. } => Some(content.as_str()),
            _ => None,
        })
        .collect();
    assert_eq!(results, ["third time lucky"], "one result for one call");
}

#[test]
fn a_forged_tool_attempt_parks_nothing_for_long_and_counts_no_impossible_attempt() {
    let mut sim = Sim::new(Budget::default());
    let (contract, _) = shell_with_retry(false);
    complete_under(
        &mut sim,
        &contract,
        calls(&[("call_1", "shell", serde_json::json!({"command": "ls"}))]),
    );
    let op = sim.ops_of(1)[0].clone();
    started(&mut sim, &op, 1);
    // An attempt no policy makes is set aside: the operation is still running attempt 1.
    for n in [0, kedge_core::tools::MAX_TOOL_ATTEMPTS + 1, u32::MAX] {
        attempt_failed(&mut sim, &op, n, Timestamp::now());
        let o = &sim.state().ops[&op];
        assert_eq!(o.failed_attempts, 0, "attempt {n}");
        assert!(matches!(
            o.status,
            kedge_core::fold::OpStatus::Started { .. }
        ));
    }
    // Due in years (or never): due the longest backoff after the event at most, so the
    // operation is overdue (the reconciler resumes it) soon after that.
    let before = Timestamp::now();
    attempt_failed(&mut sim, &op, 1, Timestamp::MAX);
    let state = sim.state();
    let o = &state.ops[&op];
    assert_eq!(o.failed_attempts, 1);
    let latest = Timestamp(
        Timestamp::now().0 + time::Duration::milliseconds(kedge_core::tools::MAX_BACKOFF_MS),
    );
    assert!(
        o.since
            >= Timestamp(
                before.0 + time::Duration::milliseconds(kedge_core::tools::MAX_BACKOFF_MS)
            )
            && o.since <= latest,
        "{:?}",
        o.since
    );
    assert_eq!(
        state
            .ops_stuck_since(Timestamp(latest.0 + time::Duration::seconds(1)))
            .len(),
        1
    );
}

#[test]
fn an_approved_or_redispatched_operation_keeps_its_retry_policy() {
    let mut sim = Sim::new(Budget::default());
    let (contract, retry) = shell_with_retry(true);
    let drafts = complete_under(
        &mut sim,
        &contract,
        calls(&[("call_1", "shell", serde_json::json!({"command": "ls"}))]),
    );
    let asked = drafts
        .iter()
        .find_map(|d| match &d.event {
            Decision::ApprovalRequested(a) => Some(a.clone()),
            _ => None,
        })
        .expect("held for approval");
    assert_eq!(asked.limits.retry, Some(retry.clone()));
    approve(&mut sim, 1);
    let dispatched = commit_next(&mut sim);
    let request = dispatched
        .iter()
        .find_map(|d| match &d.event {
            Decision::ToolRequested(t) => Some(t.clone()),
            _ => None,
        })
        .expect("dispatched once approved");
    assert_eq!(request.limits.retry, Some(retry.clone()));
    // Found not to have happened: the next dispatch carries it too, and its attempts count
    // afresh.
    let op = sim.ops_of(1)[0].clone();
    started(&mut sim, &op, 1);
    attempt_failed(&mut sim, &op, 1, Timestamp::now());
    sim.input(
        Event::OutcomeNotFound(kedge_core::event::OutcomeNotFound {}),
        Some(op.clone()),
    );
    let again = commit_next(&mut sim);
    let request = again
        .iter()
        .find_map(|d| match &d.event {
            Decision::ToolRequested(t) => Some(t.clone()),
            _ => None,
        })
        .expect("re-dispatched");
    assert_eq!((request.redispatch, request.limits.retry), (1, Some(retry)));
    assert_eq!(sim.state().ops[&op].failed_attempts, 0);
    // An attempt of the earlier dispatch is not one of this dispatch.
    attempt_failed(&mut sim, &op, 2, Timestamp::now());
    assert_eq!(sim.state().ops[&op].failed_attempts, 0);
}

#[test]
fn model_call_retries_wait_with_jitter_within_the_cap() {
    use kedge_core::decide::model_retry_delay;
    use std::time::Duration;
    let max = Duration::from_secs(30);
    // The ceiling of the wait is what the step used before jitter: 400 ms doubling.
    assert_eq!(
        model_retry_delay(1, None, max, 0),
        Duration::from_millis(400)
    );
    assert_eq!(
        model_retry_delay(3, None, max, 0),
        Duration::from_millis(1_600)
    );
    assert_eq!(
        model_retry_delay(20, None, max, 0),
        max,
        "capped by max_retry_delay"
    );
    for attempt in 1..=8 {
        let ceiling = model_retry_delay(attempt, None, max, 0);
        let waits: std::collections::BTreeSet<Duration> = [1, u64::MAX / 5, u64::MAX / 2, u64::MAX]
            .iter()
            .map(|draw| model_retry_delay(attempt, None, max, *draw))
            .collect();
        assert!(waits.len() > 1, "attempt {attempt}: no jitter: {waits:?}");
        assert!(
            waits.iter().all(|w| *w <= ceiling && *w >= ceiling / 2),
            "attempt {attempt}: {waits:?} vs {ceiling:?}"
        );
    }
    // The provider's retry-after is honoured as given (within the cap), with no jitter.
    let after = Some(Duration::from_secs(7));
    assert_eq!(
        model_retry_delay(1, after, max, u64::MAX),
        Duration::from_secs(7)
    );
    assert_eq!(
        model_retry_delay(1, Some(Duration::from_secs(90)), max, 0),
        max
    );
}

#[test]
fn a_run_cancelled_between_attempts_is_cancelled_at_once_listing_the_operation_failed() {
    let mut sim = Sim::new(Budget::default());
    let (contract, _) = shell_with_retry(false);
    complete_under(
        &mut sim,
        &contract,
        calls(&[("call_1", "shell", serde_json::json!({"command": "ls"}))]),
    );
    let op = sim.ops_of(1)[0].clone();
    started(&mut sim, &op, 1);
    let far = Timestamp(Timestamp::now().0 + time::Duration::minutes(8));
    attempt_failed(&mut sim, &op, 1, far);
    sim.input(
        Event::CancelRequested(CancelRequested {
            reason: "enough".into(),
            by: None,
        }),
        None,
    );
    // run.cancelling, then (nothing running) run.cancelled.
    let mut cancelled = None;
    for _ in 0..3 {
        let drafts = commit_next(&mut sim);
        if let Some(c) = drafts.iter().find_map(|d| match &d.event {
            Decision::RunCancelled(c) => Some(c.clone()),
            _ => None,
        }) {
            cancelled = Some(c);
            break;
        }
    }
    let cancelled = cancelled.expect("cancelled without waiting for the next attempt");
    assert_eq!(cancelled.operations.len(), 1);
    assert_eq!(
        (&cancelled.operations[0].op, cancelled.operations[0].fate),
        (&op, kedge_core::event::OpFate::Failed)
    );
    assert_eq!(sim.state().status, RunStatus::Cancelled);
}

// ---------------------------------------------------------------------------------------------
// Structured output, `on_invalid_output: retry`: an invalid final answer is
// sent back with its errors (`output.rejected`), a bounded number of times per turn.
// ---------------------------------------------------------------------------------------------

const GOOD: &str = r#"{"answer": "42", "sources": ["a"]}"#;
const BAD: &str = r#"{"answer": 42, "sources": ["a", 7]}"#;

fn retrying(max: u32) -> Contract {
    structured(kedge_core::agent::OnInvalidOutput::Retry).with_output_retries(max)
}

fn rejected(group: &[Draft<Decision>]) -> &kedge_core::event::OutputRejected {
    match &group.last().expect("a group").event {
        Decision::OutputRejected(r) => r,
        other => panic!("output.rejected expected, got {other:?}"),
    }
}

#[test]
fn an_invalid_answer_is_sent_back_with_its_errors_and_a_valid_one_then_succeeds() {
    use kedge_core::event::OutputValidation;
    let contract = retrying(2);
    let mut sim = Sim::new(Budget::default());
    let group = complete_under(&mut sim, &contract, text(BAD));
    assert_eq!(types(&group), ["step.completed", "output.rejected"]);
    let r = rejected(&group);
    assert_eq!((r.retry, r.max_retries), (1, 2));
    assert_eq!(r.errors.len(), 2, "{:?}", r.errors);
    assert!(r.errors[0].starts_with("at /answer:"), "{:?}", r.errors);
    assert!(r.errors[1].starts_with("at /sources/1:"), "{:?}", r.errors);
    assert_eq!(
        group[1].step,
        Some(StepNo(1)),
        "journaled under the step it rejects"
    );
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Running, "the run does not end");
    assert_eq!(state.output_rejections, 1);
    assert!(state.completing.is_none(), "output.rejected ends the group");

    // The next step's context: the rejected answer, then the errors and what to do.
    let plan = sim.expect_step();
    assert_eq!(plan.step, StepNo(2));
    assert_well_formed(&plan.context);
    let n = plan.context.len();
    assert!(
        matches!(&plan.context[n - 2], ChatMessage::Assistant { message } if message.text == BAD),
        "{:?}",
        plan.context
    );
    let ChatMessage::User { text: feedback } = &plan.context[n - 1] else {
        panic!("a feedback message expected: {:?}", plan.context)
    };
    assert!(feedback.contains("retry 1 of 2"), "{feedback}");
    assert!(feedback.contains("at /answer:"), "{feedback}");
    assert!(feedback.contains("at /sources/1:"), "{feedback}");
    assert!(feedback.contains("corrected JSON"), "{feedback}");
    assert_eq!(
        feedback,
        &kedge_core::fold::output_feedback(Provider::Openai, r),
        "the fold builds it from the event alone"
    );

    // The corrected answer: succeeded, valid.
    let group = complete_under(&mut sim, &contract, text(GOOD));
    assert!(
        matches!(&group.last().expect("event").event,
            Decision::RunSucceeded(s) if s.validation == OutputValidation::Valid && s.output == GOOD),
        "{group:?}"
    );
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(state.step, StepNo(2));
    assert_eq!(decide(&state), Next::Idle(Idle::Terminal));
    record_fixture("output-rejected-then-valid", &sim);
}

#[test]
fn retries_run_out_and_the_run_fails_as_fail_would() {
    for max in [1u32, 2, 5] {
        let contract = retrying(max);
        let mut sim = Sim::new(Budget::default());
        for n in 1..=max {
            let group = complete_under(&mut sim, &contract, text(BAD));
            let r = rejected(&group);
            assert_eq!((r.retry, r.max_retries), (n, max));
            assert_eq!(sim.state().output_rejections, n);
        }
        // One more invalid answer than retries: failed, `invalid_output`, errors named.
        let group = complete_under(&mut sim, &contract, text("not JSON, sorry"));
        let Decision::RunFailed(f) = &group.last().expect("event").event else {
            panic!("run.failed expected: {group:?}")
        };
        assert_eq!(f.reason, FailureReason::InvalidOutput);
        assert!(f.message.contains("not JSON"), "{}", f.message);
        assert!(
            f.message.contains(&format!(
                "after {max} retr{}",
                if max == 1 { "y" } else { "ies" }
            )),
            "{}",
            f.message
        );
        let state = sim.state();
        assert_eq!(state.status, RunStatus::Failed);
        assert_eq!(state.step.get(), max + 1, "each retry is one step");
        assert_eq!(decide(&state), Next::Idle(Idle::Terminal));
        // The rejected answers and their feedback stay in the transcript, in order.
        let feedbacks = state
            .transcript
            .iter()
            .filter(|m| matches!(m, ChatMessage::User { text } if text.contains("JSON Schema")))
            .count();
        assert_eq!(feedbacks as u32, max);
    }
}

#[test]
fn no_retries_under_fail_or_accept_and_tool_steps_are_never_rejected() {
    use kedge_core::agent::OnInvalidOutput;
    // `output_retries` on a contract that does not retry changes nothing.
    for (on_invalid, last) in [
        (OnInvalidOutput::Fail, "run.failed"),
        (OnInvalidOutput::Accept, "run.succeeded"),
    ] {
        let contract = structured(on_invalid).with_output_retries(3);
        let mut sim = Sim::new(Budget::default());
        let group = complete_under(&mut sim, &contract, text(BAD));
        assert_eq!(types(&group).last(), Some(&last), "{on_invalid:?}");
    }
    // Retry with zero retries (a contract built without them) fails at once.
    let contract = structured(OnInvalidOutput::Retry);
    let mut sim = Sim::new(Budget::default());
    let group = complete_under(&mut sim, &contract, text(BAD));
    assert_eq!(types(&group).last(), Some(&"run.failed"));
    // A valid first answer is never rejected; a step calling tools is not a final answer.
    let contract = retrying(2);
    let mut sim = Sim::new(Budget::default());
    let group = complete_under(
        &mut sim,
        &contract,
        calls(&[("c1", "read_file", serde_json::json!({"path": "a"}))]),
    );
    assert_eq!(types(&group).last(), Some(&"tool.requested"));
    assert_eq!(sim.state().status, RunStatus::WaitingTool);
    let op = sim.ops_of(1).remove(0);
    sim.result(&op, "contents");
    let group = complete_under(&mut sim, &contract, text(GOOD));
    assert_eq!(types(&group).last(), Some(&"run.succeeded"));
    assert_eq!(sim.state().output_rejections, 0);
}

#[test]
fn the_retry_count_is_per_turn_and_a_revived_run_starts_again() {
    let contract = retrying(1);
    let mut sim = Sim::new(Budget::default());
    rejected(&complete_under(&mut sim, &contract, text(BAD)));
    let group = complete_under(&mut sim, &contract, text(GOOD));
    assert_eq!(types(&group).last(), Some(&"run.succeeded"));
    sim.input(
        Event::UserMessage(UserMessage {
            text: "and another?".into(),
        }),
        None,
    );
    // Turn 2: the one retry is available again.
    let plan = sim.expect_step();
    assert!(matches!(plan.start[0].event, Decision::RunRevived(_)));
    sim.commit(plan.start.clone());
    assert_eq!(sim.state().output_rejections, 0);
    let group = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        text(BAD),
        false,
        Timestamp::now(),
        &contract,
    );
    sim.commit(group.clone());
    assert_eq!(rejected(&group).retry, 1);
    let group = complete_under(&mut sim, &contract, text(BAD));
    assert_eq!(types(&group).last(), Some(&"run.failed"));
}

#[test]
fn a_rejection_cut_short_is_finished_the_same_way_and_replays_deterministically() {
    let contract = retrying(2);
    // The first answer's group is recomputed identically by the next writer (final_group
    // checks it) ...
    let (group, mut sim) = final_group(&contract, BAD);
    assert_eq!(types(&group), ["step.completed", "output.rejected"]);
    // ... and so is the second, with the count from the journal.
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    let now = Timestamp::now();
    let group = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        text(BAD),
        false,
        now,
        &contract,
    );
    assert_eq!(rejected(&group).retry, 2);
    let mut cut = sim.clone();
    cut.commit(group[..1].to_vec());
    let Next::Finish(c) = decide(&cut.state()) else {
        panic!("finish expected")
    };
    assert_eq!(
        kedge_core::decide::finish_step(&cut.state(), &c, now, &contract),
        group[1..].to_vec()
    );
    sim.commit(group);
    // Replay: the journal read back from its bytes folds to the same state, twice.
    let bytes: Vec<(u64, Vec<u8>)> = sim
        .events
        .iter()
        .map(|(s, e)| (*s, e.to_json_bytes()))
        .collect();
    let read: Vec<(u64, Envelope)> = bytes
        .iter()
        .map(|(s, b)| (*s, Envelope::from_json_bytes(b).expect("envelope")))
        .collect();
    let replayed = fold(read.iter().map(|(s, e)| (*s, e))).expect("folds");
    assert_eq!(replayed, sim.state());
    assert_eq!(replayed.output_rejections, 2);
    assert_eq!(decide(&replayed), decide(&sim.state()));
}

#[test]
fn an_output_rejected_that_follows_no_completed_answer_does_not_fold() {
    let mut sim = Sim::new(Budget::default());
    let plan = sim.expect_step();
    sim.commit(plan.start.clone());
    sim.push(
        Draft::new(Event::OutputRejected(kedge_core::event::OutputRejected {
            errors: vec!["at (root): nope".into()],
            retry: 1,
            max_retries: 2,
        }))
        .step(StepNo(1)),
    );
    let err = fold(sim.events.iter().map(|(s, e)| (*s, e))).expect_err("refused");
    assert!(
        matches!(err, kedge_core::FoldError::Inconsistent { .. }),
        "{err}"
    );
}

#[test]
fn an_anthropic_run_is_asked_to_answer_through_the_output_tool() {
    let r = kedge_core::event::OutputRejected {
        errors: vec!["at /answer: 42 is not of type \"string\"".into()],
        retry: 2,
        max_retries: 3,
    };
    let text = kedge_core::fold::output_feedback(Provider::Anthropic, &r);
    assert!(text.contains("`output` tool"), "{text}");
    assert!(text.contains("retry 2 of 3"), "{text}");
    assert!(text.contains("at /answer:"), "{text}");
    let text = kedge_core::fold::output_feedback(Provider::Openai, &r);
    assert!(!text.contains("`output` tool"), "{text}");
}

/// A run that ended failed with a model attempt open (a refused call, or a step's attempts
/// exhausted) is revived by a new message into the first step of a new turn. The run's end
/// closes the step it failed on; before, the fold kept it open and refused the revived turn's
/// `step.started` (it expected another attempt of the failed step), and the run could not go on.
#[test]
fn a_run_that_failed_on_a_model_error_is_revived_into_a_new_step() {
    let fatal = kedge_core::event::AttemptOutcome::Error {
        class: kedge_core::event::ErrorClass::Fatal,
        message: "400 invalid request".into(),
        status: Some(400),
        retry_after_ms: None,
        trouble: None,
    };
    let overloaded = kedge_core::event::AttemptOutcome::Error {
        class: kedge_core::event::ErrorClass::Retryable,
        message: "529 overloaded".into(),
        status: Some(529),
        retry_after_ms: None,
        // A journal from before provider trouble was told apart: the attempt counts.
        trouble: None,
    };
    for (outcome, budget) in [
        (fatal, Budget::default()),
        (
            overloaded,
            Budget {
                max_attempts_per_step: 1,
                ..Budget::default()
            },
        ),
    ] {
        let mut sim = Sim::new(budget);
        let first = sim.expect_step();
        sim.commit(first.start.clone());
        let attempt = Draft::new(Decision::ModelAttempt(ModelAttempt {
            request_id: first.request_id.clone(),
            outcome: outcome.clone(),
        }))
        .step(first.step)
        .attempt(first.attempt);
        let mut drafts = vec![attempt];
        if matches!(
            outcome,
            kedge_core::event::AttemptOutcome::Error {
                class: kedge_core::event::ErrorClass::Fatal,
                ..
            }
        ) {
            // What the step service commits for a refused call.
            drafts.push(Draft::new(Decision::RunFailed(
                kedge_core::event::RunFailed {
                    reason: FailureReason::ModelRejected,
                    message: "400 invalid request".into(),
                    effects: Vec::new(),
                },
            )));
        } else {
            // The attempts are used up: decide ends the run.
            sim.commit(drafts);
            let Next::Commit(end) = decide(&sim.state()) else {
                panic!("the run fails")
            };
            drafts = end;
        }
        sim.commit(drafts);
        let state = sim.state();
        assert_eq!(state.status, RunStatus::Failed);
        assert_eq!(state.open_step, None, "the run's end closed its step");
        sim.input(
            Event::UserMessage(UserMessage {
                text: "try again".into(),
            }),
            None,
        );
        let plan = sim.expect_step();
        assert!(matches!(plan.start[0].event, Decision::RunRevived(_)));
        assert_eq!(plan.step, StepNo(2));
        assert_eq!(plan.attempt.get(), 1);
        sim.run_step(text("done this time"));
        let state = sim.state();
        assert_eq!(state.status, RunStatus::Succeeded, "{outcome:?}");
        assert_eq!(state.turn, 2);
    }
}

/// What the step service journals when the plan's attempt meets provider trouble.
fn meet_trouble(sim: &mut Sim, plan: &StepPlan, trouble: kedge_core::event::Trouble) {
    let state = sim.state();
    let met = kedge_core::decide::TroubleMet {
        outcome: kedge_core::event::AttemptOutcome::Error {
            class: kedge_core::event::ErrorClass::Retryable,
            message: "HTTP 503 server_error".into(),
            status: Some(503),
            retry_after_ms: None,
            trouble: Some(trouble),
        },
        trouble,
        endpoint: "openai http://127.0.0.1:1/v1 (OPENAI_API_KEY)".into(),
        message: "HTTP 503 server_error".into(),
    };
    let drafts = kedge_core::decide::wait_on_provider(
        &state,
        &plan.request_id,
        met,
        Timestamp::now(),
        std::time::Duration::from_secs(3600),
    );
    sim.commit(drafts);
}

fn released(sim: &mut Sim, probe: bool) -> u64 {
    sim.input(
        Event::ProviderReleased(kedge_core::event::ProviderReleased { probe }),
        None,
    )
}

/// An outage of any length spends none of a step's attempts: each try that meets the trouble
/// (or is held by the fleet's breaker) leaves the run waiting on its provider, idle, until the
/// fleet releases it; the step's first wait's `since` and its one bound timer hold for every
/// later wait of the step.
#[test]
fn provider_trouble_spends_no_attempt_and_the_run_waits_until_the_fleet_releases_it() {
    let budget = Budget {
        max_attempts_per_step: 2,
        ..Budget::default()
    };
    let mut sim = Sim::new(budget);
    let first = sim.expect_step();
    assert_eq!(first.released, None);
    sim.commit(first.start.clone());
    meet_trouble(&mut sim, &first, kedge_core::event::Trouble::Unavailable);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingProvider);
    let wait = state.provider.clone().expect("the wait is folded");
    assert_eq!(wait.released, None);
    assert!(matches!(decide(&state), Next::Idle(Idle::WaitingProvider)));
    // A nudge or a user message does not release it.
    sim.input(
        Event::UserMessage(UserMessage {
            text: "still there?".into(),
        }),
        None,
    );
    assert!(matches!(
        decide(&sim.state()),
        Next::Idle(Idle::WaitingProvider)
    ));
    let mut attempts = vec![first.attempt.get()];
    for i in 0..10 {
        let probe = i % 2 == 0;
        released(&mut sim, probe);
        // A second release of the same wait (a releaser repeating itself) changes nothing.
        released(&mut sim, !probe);
        let plan = sim.expect_step();
        assert_eq!(plan.released, Some(probe));
        sim.commit(plan.start.clone());
        if plan.attempt.get() == 3 {
            // Held by the breaker: not sent, and not spent either.
            let state = sim.state();
            let met = kedge_core::decide::TroubleMet {
                outcome: kedge_core::event::AttemptOutcome::Held {
                    endpoint: wait.endpoint.clone(),
                    reason: "not sent: failing".into(),
                },
                trouble: kedge_core::event::Trouble::Unavailable,
                endpoint: wait.endpoint.clone(),
                message: "not sent: failing".into(),
            };
            let drafts = kedge_core::decide::wait_on_provider(
                &state,
                &plan.request_id,
                met,
                Timestamp::now(),
                std::time::Duration::from_secs(3600),
            );
            assert!(
                !drafts
                    .iter()
                    .any(|d| matches!(d.event, Decision::TimerScheduled(_))),
                "one bound per step"
            );
            sim.commit(drafts);
        } else {
            meet_trouble(&mut sim, &plan, kedge_core::event::Trouble::RateLimited);
        }
        let state = sim.state();
        assert_eq!(state.status, RunStatus::WaitingProvider);
        assert_eq!(state.provider.as_ref().map(|p| p.since), Some(wait.since));
        attempts.push(plan.attempt.get());
    }
    assert_eq!(attempts, (1..=11).collect::<Vec<u32>>());
    let timers = sim
        .state()
        .timers
        .values()
        .filter(|t| {
            matches!(
                t.purpose,
                kedge_core::event::TimerPurpose::ProviderWait { .. }
            )
        })
        .count();
    assert_eq!(timers, 1);
    // The provider is back: the released attempt answers and the message sent meanwhile is in
    // its context.
    released(&mut sim, false);
    let plan = sim.run_step(text("back again"));
    assert!(
        plan.context
            .iter()
            .any(|m| matches!(m, ChatMessage::User { text } if text == "still there?"))
    );
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.provider, None);
    // A release that comes after the run moved on is ignored.
    let ignored = state.ignored_inputs;
    released(&mut sim, false);
    assert_eq!(sim.state().ignored_inputs, ignored + 1);
}

/// Provider trouble and real failures mix: only the real ones (old journals' errors, crashes,
/// bad answers) count against `max_attempts_per_step`.
#[test]
fn only_attempts_that_were_not_provider_trouble_count_against_the_cap() {
    let budget = Budget {
        max_attempts_per_step: 2,
        ..Budget::default()
    };
    let mut sim = Sim::new(budget);
    let first = sim.expect_step();
    sim.commit(first.start.clone());
    meet_trouble(&mut sim, &first, kedge_core::event::Trouble::Unavailable);
    released(&mut sim, false);
    let second = sim.expect_step();
    sim.commit(second.start.clone());
    // A broken stream after content began: spent.
    sim.commit(vec![
        Draft::new(Event::ModelAttempt(ModelAttempt {
            request_id: second.request_id.clone(),
            outcome: kedge_core::event::AttemptOutcome::Error {
                class: kedge_core::event::ErrorClass::Retryable,
                message: "stream broke".into(),
                status: None,
                retry_after_ms: None,
                trouble: None,
            },
        }))
        .step(second.step)
        .attempt(second.attempt),
    ]);
    let state = sim.state();
    assert_eq!(state.open_step.as_ref().map(|o| o.spent()), Some(1));
    // One spent of two: the step goes on.
    let third = sim.expect_step();
    sim.commit(third.start.clone());
    sim.commit(vec![
        Draft::new(Event::ModelAttempt(ModelAttempt {
            request_id: third.request_id.clone(),
            outcome: kedge_core::event::AttemptOutcome::LeaseLost,
        }))
        .step(third.step)
        .attempt(third.attempt),
    ]);
    match decide(&sim.state()) {
        Next::Commit(drafts) => assert!(matches!(
            &drafts[0].event,
            Decision::RunFailed(f) if f.reason == FailureReason::AttemptsExhausted
        )),
        other => panic!("expected the run to fail, got {other:?}"),
    }
}

/// The bound on a step's wait fires (a durable timer): the run fails naming the provider and
/// its last error. A cancel while waiting cancels at once.
#[test]
fn a_wait_on_the_provider_ends_at_its_bound_or_a_cancel() {
    let mut sim = Sim::new(Budget::default());
    let first = sim.expect_step();
    sim.commit(first.start.clone());
    meet_trouble(&mut sim, &first, kedge_core::event::Trouble::Unavailable);
    let state = sim.state();
    let (timer_id, fire_at) = state
        .timers
        .iter()
        .find(|(_, t)| {
            t.purpose == kedge_core::event::TimerPurpose::ProviderWait { step: first.step }
        })
        .map(|(id, t)| (id.clone(), t.fire_at))
        .expect("the bound is scheduled");
    assert_eq!(Some(fire_at), state.provider.as_ref().map(|p| p.give_up_at));
    let mut cancelled = sim.clone();
    sim.input(
        Event::TimerFired(kedge_core::event::TimerFired { timer_id }),
        None,
    );
    let Next::Commit(drafts) = decide(&sim.state()) else {
        panic!("the run fails")
    };
    sim.commit(drafts);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.expect("failure");
    assert_eq!(failure.reason, FailureReason::ProviderUnavailable);
    assert!(
        failure.message.contains("openai http://127.0.0.1:1/v1")
            && failure.message.contains("HTTP 503 server_error"),
        "{}",
        failure.message
    );

    cancelled.input(
        Event::CancelRequested(CancelRequested {
            reason: "enough".into(),
            by: None,
        }),
        None,
    );
    let Next::Commit(drafts) = decide(&cancelled.state()) else {
        panic!("the run cancels")
    };
    cancelled.commit(drafts);
    assert_eq!(cancelled.state().status, RunStatus::Cancelled);
}

/// A deadline sooner than `provider_wait` bounds the wait instead.
#[test]
fn a_runs_deadline_bounds_its_wait_on_the_provider() {
    let budget = Budget {
        deadline_secs: Some(60),
        ..Budget::default()
    };
    let mut sim = Sim::new(budget);
    let first = sim.expect_step();
    sim.commit(first.start.clone());
    meet_trouble(&mut sim, &first, kedge_core::event::Trouble::Unavailable);
    let state = sim.state();
    let wait = state.provider.expect("waiting");
    assert_eq!(
        wait.give_up_at,
        state
            .created_at
            .saturating_add(std::time::Duration::from_secs(60))
    );
}

/// A `context.compacted` by estimate keeping the transcript from `keep_from`, with `elided`.
fn compaction(keep_from: u32, elided: Vec<u32>) -> kedge_core::event::ContextCompacted {
    kedge_core::event::ContextCompacted {
        keep_from,
        elided,
        estimated_tokens: 4000,
        budget_tokens: 2000,
        cause: kedge_core::event::CompactionCause::Estimate,
        summary: None,
        max_result_chars: None,
    }
}

/// A `context.compacted` changes what the model reads from the next step on, and one that
/// would break the conversation (a tool result cut from its call, the task left out, a step
/// back) does not fold.
#[test]
fn a_compaction_changes_what_the_model_reads_and_a_broken_one_does_not_fold() {
    let mut sim = Sim::new(Budget {
        max_steps: 50,
        ..Budget::default()
    });
    for i in 0..6 {
        sim.run_step(tools(&[(&format!("c{i}"), "read_file")]));
        let op = sim.ops_of(sim.state().step.get())[0].clone();
        sim.result(&op, &"x".repeat(2000));
    }
    let state = sim.state();
    let full = state.next_context();
    let compacted = |keep_from: u32, elided: Vec<u32>| {
        Draft::new(Event::ContextCompacted(compaction(keep_from, elided)))
    };
    // transcript: 0 task, then (assistant, tool) per step: assistants at 1, 3, 5, …
    for (keep_from, elided) in [(2, vec![]), (0, vec![]), (3, vec![1]), (3, vec![6, 4])] {
        let mut bad = sim.clone();
        bad.push(compacted(keep_from, elided.clone()));
        let folded = fold(bad.events.iter().map(|(s, e)| (*s, e)));
        assert!(
            folded.is_err(),
            "keep_from {keep_from} elided {elided:?} folded"
        );
    }
    sim.commit(vec![compacted(5, vec![6])]);
    let state = sim.state();
    let seen = state.next_context();
    assert!(matches!(&seen[0], ChatMessage::User { text } if text == "research kedging"));
    assert!(matches!(&seen[1], ChatMessage::User { text } if text.contains("4 earlier messages")));
    assert!(
        matches!(&seen[3], ChatMessage::Tool { content, .. } if content.starts_with(kedge_core::context::ELIDED))
    );
    assert_eq!(seen.len(), full.len() - 4 + 1);
    let plan = sim.expect_step();
    assert_eq!(plan.context, seen);
    assert_eq!(plan.context_digest, Digest::of(&seen));
    // A later compaction may only leave out more.
    let mut back = sim.clone();
    back.push(compacted(3, vec![]));
    assert!(fold(back.events.iter().map(|(s, e)| (*s, e))).is_err());
}

/// Under `summarize` the model reads its summary where the turns were left out; the summary's
/// call counts in the run's usage; a compaction that only elides more keeps it, one that leaves
/// out more without a new one drops it; a summary that is not the run's, or empty, or of
/// nothing, does not fold.
#[test]
fn a_summary_stands_for_the_turns_left_out_and_counts_in_the_usage() {
    let mut sim = Sim::new(Budget {
        max_steps: 50,
        ..Budget::default()
    });
    for i in 0..6 {
        sim.run_step(tools(&[(&format!("c{i}"), "read_file")]));
        let op = sim.ops_of(sim.state().step.get())[0].clone();
        sim.result(&op, &"x".repeat(2000));
    }
    let before = sim.state().usage;
    let run = sim.run.clone();
    let summary = |text: &str, keep_from: usize| kedge_core::event::CompactionSummary {
        text: text.into(),
        request_id: kedge_core::context::summary_request_id(&run, StepNo(7), keep_from),
        usage: kedge_core::event::Usage {
            input_tokens: 300,
            output_tokens: 20,
            ..Default::default()
        },
    };
    let compacted =
        |keep_from: u32, elided: Vec<u32>, s: Option<kedge_core::event::CompactionSummary>| {
            Draft::new(Event::ContextCompacted(
                kedge_core::event::ContextCompacted {
                    summary: s,
                    ..compaction(keep_from, elided)
                },
            ))
        };
    let other: RunId = "run_other".parse().expect("run id");
    let foreign = kedge_core::event::CompactionSummary {
        request_id: kedge_core::context::summary_request_id(&other, StepNo(7), 5),
        ..summary("S", 5)
    };
    let a_step = kedge_core::event::CompactionSummary {
        request_id: kedge_core::ids::ModelRequestId::new(&run, StepNo(7), kedge_core::Attempt(1)),
        ..summary("S", 5)
    };
    for bad in [
        compacted(1, vec![2], Some(summary("S", 1))),
        compacted(5, vec![], Some(summary("  ", 5))),
        compacted(5, vec![], Some(foreign)),
        compacted(5, vec![], Some(a_step)),
    ] {
        let mut b = sim.clone();
        b.push(bad);
        assert!(fold(b.events.iter().map(|(s, e)| (*s, e))).is_err());
    }
    sim.commit(vec![compacted(5, vec![], Some(summary("THE SUMMARY", 5)))]);
    let state = sim.state();
    let seen = state.next_context();
    assert!(matches!(&seen[1], ChatMessage::User { text }
        if text.contains("4 earlier messages") && text.ends_with("THE SUMMARY")));
    assert_eq!(state.usage.input_tokens, before.input_tokens + 300);
    assert_eq!(state.usage.output_tokens, before.output_tokens + 20);
    // Only results elided: the summary stands.
    sim.commit(vec![compacted(5, vec![6], None)]);
    assert!(
        matches!(&sim.state().next_context()[1], ChatMessage::User { text } if text.ends_with("THE SUMMARY"))
    );
    // More left out without a new summary: the plain note.
    sim.commit(vec![compacted(7, vec![], None)]);
    assert!(
        matches!(&sim.state().next_context()[1], ChatMessage::User { text }
        if text.contains("left out") && !text.contains("THE SUMMARY"))
    );
    // What a summary call reads: the part left out as the model reads it now, then the ask.
    let asked = kedge_core::context::summary_context(&sim.state(), 9);
    assert!(
        matches!(asked.last(), Some(ChatMessage::User { text }) if text == kedge_core::context::SUMMARY_ASK)
    );
    assert!(matches!(&asked[1], ChatMessage::User { text } if text.contains("left out")));
}

/// A cut of the results (`max_result_chars`) reaches the results the next step consumes too,
/// stays in force, and is never raised or set under the shortest cut.
#[test]
fn a_cut_of_the_results_reaches_the_next_steps_results_and_only_ever_lowers() {
    let mut sim = Sim::new(Budget {
        max_steps: 50,
        ..Budget::default()
    });
    for i in 0..3 {
        sim.run_step(tools(&[(&format!("c{i}"), "read_file")]));
        let op = sim.ops_of(sim.state().step.get())[0].clone();
        sim.result(&op, &"x".repeat(5000));
    }
    let cut = |max: u32| {
        Draft::new(Event::ContextCompacted(
            kedge_core::event::ContextCompacted {
                max_result_chars: Some(max),
                ..compaction(1, vec![])
            },
        ))
    };
    let mut under = sim.clone();
    under.push(cut(100));
    assert!(fold(under.events.iter().map(|(s, e)| (*s, e))).is_err());
    sim.commit(vec![cut(1000)]);
    let seen = sim.state().next_context();
    // The last result is not in the transcript yet (the next step consumes it): cut all the same.
    let cuts = seen
        .iter()
        .filter(|m| matches!(m, ChatMessage::Tool { content, .. } if content.contains("[cut to 1000 of 5000 characters")))
        .count();
    assert_eq!(cuts, 3);
    let plan = sim.expect_step();
    assert_eq!(plan.context, seen);
    let mut raised = sim.clone();
    raised.push(cut(2000));
    assert!(fold(raised.events.iter().map(|(s, e)| (*s, e))).is_err());
    sim.commit(vec![cut(500)]);
}

/// A message to a finished run whose budget is spent revives it and fails it again, once: the
/// failure answers the message. (It used to stay pending, and every drive revived and failed
/// the run again, in a loop that wrote to the journal without end.)
#[test]
fn a_message_to_a_run_whose_budget_is_spent_fails_it_once() {
    let mut sim = Sim::new(Budget {
        max_steps: 1,
        ..Budget::default()
    });
    sim.run_step(text("done"));
    sim.input(
        Event::UserMessage(UserMessage {
            text: "more".into(),
        }),
        None,
    );
    let Next::Commit(drafts) = decide(&sim.state()) else {
        panic!("the run is revived and fails")
    };
    assert!(matches!(drafts[0].event, Decision::RunRevived(_)));
    assert!(
        matches!(&drafts[1].event, Decision::RunFailed(f) if f.reason == FailureReason::MaxSteps)
    );
    sim.commit(drafts);
    assert!(matches!(decide(&sim.state()), Next::Idle(Idle::Terminal)));
    // A later message revives it again, and it fails again, once.
    sim.input(
        Event::UserMessage(UserMessage {
            text: "and more".into(),
        }),
        None,
    );
    let Next::Commit(drafts) = decide(&sim.state()) else {
        panic!("revived again")
    };
    sim.commit(drafts);
    assert!(matches!(decide(&sim.state()), Next::Idle(Idle::Terminal)));
    assert_eq!(sim.state().turn, 3);
}
