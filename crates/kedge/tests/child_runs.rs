//! Child runs (`run_agent`) through the services: a parent's `run_agent` call
//! starts a child run on the mock model, the child's answer (validated against its
//! `output_schema`) is the parent's tool result, a child that needs a person shows in the
//! parent's waiting view, a cancel of the parent cancels the child and waits for it, and hostile
//! calls are refused with a result the model reads. The crash tests kill (abort, as kill -9) the
//! step process at the two windows that matter: right after the parent's worker created the
//! child, and right after the child's worker ended the child but before it gave the parent its
//! result. Each ends with one child per operation and one result.

use crate::common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{CancelRequested, Event, EventType, OpFate, WaitReason};
use kedge_core::ids::{InputId, OperationId, RunId, StepNo};
use kedge_journal::Recorded;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(40);

/// Stores agent `name` on mock model `model`, with `extra` merged into the definition.
async fn put(h: &Harness, name: &str, model: &str, extra: Value) {
    let mut def = json!({
        "name": name,
        "system_prompt": format!("You are {name}."),
        "model": {"provider": "openai", "name": model,
                  "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "budget": {"max_steps": 10, "max_tokens": 100000, "max_attempts_per_step": 3},
    });
    if let (Some(d), Some(e)) = (def.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            d.insert(k.clone(), v.clone());
        }
    }
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

fn starts(agents: &[&str]) -> Value {
    json!({"tools": [{"name": "run_agent", "agents": agents}]})
}

/// A parent model that starts `agent` first, then answers `done: <the result>`.
fn parent_model(agent: &str) -> Value {
    json!({
        "rules": [
            {"when_last_tool_result_contains": "child run", "respond": {"text": "done: the child failed"}},
            {"when_last_tool_result_contains": "not run", "respond": {"text": "done: refused"}},
            {"when_last_tool_result_contains": "tide", "respond": {"text": "done: sail at noon"}}
        ],
        "default": {"tool_calls": [{"name": "run_agent",
                                    "arguments": {"agent": agent, "input": "When is high tide?"}}]}
    })
}

fn tide_schema() -> Value {
    json!({"type": "object", "required": ["tide"], "properties": {"tide": {"type": "string"}}})
}

fn of_type(events: &[Recorded], t: EventType) -> Vec<&Recorded> {
    events
        .iter()
        .filter(|r| r.envelope.event_type() == t)
        .collect()
}

fn op1(run: &RunId) -> OperationId {
    OperationId::new(run, StepNo(1), 0)
}

/// The parent's one result for its `run_agent` operation, after checking there is exactly one.
fn the_result(events: &[Recorded], op: &OperationId) -> kedge_core::event::ToolResult {
    let results: Vec<_> = of_type(events, EventType::ToolResult)
        .into_iter()
        .filter(|r| r.envelope.op.as_ref() == Some(op))
        .collect();
    assert_eq!(results.len(), 1, "one result for {op}");
    let Event::ToolResult(r) = &results[0].envelope.event else {
        unreachable!()
    };
    r.clone()
}

/// Checks the links of both journals and that the child is the only run the operation started.
async fn assert_linked(h: &Harness, parent: &RunId, child_agent: &str) -> RunId {
    let op = op1(parent);
    let child = RunId::for_child(&op);
    let events = h.events(parent).await;
    let started = of_type(&events, EventType::ChildStarted);
    assert_eq!(started.len(), 1, "one child.started");
    let Event::ChildStarted(c) = &started[0].envelope.event else {
        unreachable!()
    };
    assert_eq!((&c.child, c.agent.as_str()), (&child, child_agent));
    let child_events = h.events(&child).await;
    let created = of_type(&child_events, EventType::RunCreated);
    assert_eq!(created.len(), 1, "one run.created for the child");
    let Event::RunCreated(b) = &created[0].envelope.event else {
        unreachable!()
    };
    let link = b.parent.as_ref().expect("the child names its parent");
    assert_eq!((&link.run_id, &link.op), (parent, &op));
    let parent_state = h.state(parent).await;
    assert_eq!(b.tenant, parent_state.bundle.tenant, "the parent's tenant");
    assert!(b.budget.max_steps <= parent_state.bundle.budget.max_steps);
    assert!(b.budget.max_tokens <= parent_state.bundle.budget.max_tokens);
    assert_schema_valid(&events);
    assert_schema_valid(&child_events);
    child
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_childs_answer_is_the_parents_tool_result_and_an_invalid_one_an_error() {
    let script = json!({"models": {
        "gpt-captain": parent_model("navigator"),
        "gpt-bosun": parent_model("sloppy"),
        "gpt-navigator": {"default": {"text": "{\"tide\": \"noon\"}"}},
        "gpt-sloppy": {"default": {"text": "{\"tide\": 12}"}}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    put(&h, "captain", "gpt-captain", starts(&["navigator"])).await;
    put(&h, "bosun", "gpt-bosun", starts(&["sloppy"])).await;
    let schema = json!({"output_schema": tide_schema()});
    put(&h, "navigator", "gpt-navigator", schema.clone()).await;
    put(&h, "sloppy", "gpt-sloppy", schema).await;

    // The model is offered run_agent with the agents it may start.
    let run = h
        .submit("captain", "Plan the voyage.", "task-captain")
        .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("done: sail at noon"));
    let first = &h.mock.requests("gpt-captain")[0];
    let tool = first["tools"]
        .as_array()
        .and_then(|t| t.iter().find(|t| t["function"]["name"] == "run_agent"))
        .expect("run_agent offered");
    assert_eq!(
        tool["function"]["parameters"]["properties"]["agent"]["enum"],
        json!(["navigator"])
    );
    let child = assert_linked(&h, &run, "navigator").await;
    let child_state = h.state(&child).await;
    assert_eq!(child_state.status, RunStatus::Succeeded);
    assert_eq!(child_state.bundle.input, "When is high tide?");
    let result = the_result(&h.events(&run).await, &op1(&run));
    assert_eq!(result.content, "{\"tide\": \"noon\"}");
    assert!(!result.is_error);
    assert_eq!(h.mock.requests("gpt-navigator").len(), 1);

    // An ended child woken again (a nudge, a redelivered wake) gives its result again: the
    // broker's duplicate, which the drive takes as given, not as a failure to retry.
    let nudge = h
        .input(
            &child,
            Event::Nudge(kedge_core::event::Nudge {
                reason: "again".into(),
            }),
            "nudge:test:again",
        )
        .await;
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    loop {
        let mut c: async_nats::jetstream::consumer::PullConsumer =
            h.rt.js
                .get_consumer_from_stream("step", "KEDGE_RUNS")
                .await
                .expect("consumer");
        let info = c.info().await.expect("consumer info");
        if info.ack_floor.stream_sequence >= nudge && info.num_ack_pending == 0 {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "the ended child's wake was not acked: {info:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        the_result(&h.events(&run).await, &op1(&run)).content,
        "{\"tide\": \"noon\"}"
    );

    // A child whose answer fails its output_schema fails; the parent reads an error naming it
    // and goes on.
    let run = h.submit("bosun", "Plan the voyage.", "task-bosun").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("done: the child failed"));
    let child = assert_linked(&h, &run, "sloppy").await;
    assert_eq!(h.state(&child).await.status, RunStatus::Failed);
    let result = the_result(&h.events(&run).await, &op1(&run));
    assert!(result.is_error);
    assert!(
        result.content.contains("failed (invalid_output)") && result.content.contains("at /tide"),
        "{}",
        result.content
    );
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn hostile_run_agent_calls_are_refused_with_a_result_the_model_reads() {
    let script = json!({"models": {
        "gpt-ouroboros": parent_model("ouroboros"),
        "gpt-ghostly": parent_model("ghost"),
        "gpt-stranger": parent_model("navigator"),
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    // An agent that may start itself (recursion), one that names an agent nobody stored, and
    // one that names an agent not shared with its tenant: no child, an error result.
    put(&h, "ouroboros", "gpt-ouroboros", starts(&["ouroboros"])).await;
    put(&h, "ghostly", "gpt-ghostly", starts(&["ghost"])).await;
    put(&h, "stranger", "gpt-stranger", starts(&["navigator"])).await;
    put(
        &h,
        "navigator",
        "gpt-navigator",
        json!({"tenants": ["globex"]}),
    )
    .await;
    for (agent, why) in [
        ("ouroboros", "may not start itself"),
        ("ghostly", "no agent named `ghost`"),
        ("stranger", "no agent named `navigator`"),
    ] {
        let run = h.submit(agent, "Go.", &format!("task-{agent}")).await;
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(
            state.status,
            RunStatus::Succeeded,
            "{agent}: {:?}",
            state.failure
        );
        assert_eq!(state.output.as_deref(), Some("done: refused"), "{agent}");
        let events = h.events(&run).await;
        let result = the_result(&events, &op1(&run));
        assert!(result.is_error, "{agent}");
        assert!(result.content.contains(why), "{agent}: {}", result.content);
        let child = RunId::for_child(&op1(&run));
        let created = of_type(&h.events(&child).await, EventType::RunCreated).len();
        assert_eq!(created, 0, "{agent}: no child run");
    }
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_waiting_on_a_person_shows_in_the_parent_and_a_cancel_stops_both() {
    let script = json!({"models": {
        "gpt-captain": parent_model("asker"),
        "gpt-asker": {"default": {"tool_calls": [{"name": "ask_user",
                                                  "arguments": {"question": "Which harbour?"}}]}}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    put(&h, "captain", "gpt-captain", starts(&["asker"])).await;
    put(&h, "asker", "gpt-asker", json!({"tools": ["ask_user"]})).await;

    let run = h.submit("captain", "Plan the voyage.", "task-asker").await;
    let child = RunId::for_child(&op1(&run));
    h.wait_for(&child, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingTool)
        .await;
    // The parent's view lists the child and the question to answer on it.
    let events = h.events(&run).await;
    let mut view = kedge_app::view::run_view(&state, &events);
    kedge_app::view::add_children(&h.rt.journal, &state, &mut view).await;
    let waiting = view.waiting.expect("waiting");
    assert_eq!(waiting.on, WaitReason::Tool);
    assert_eq!(waiting.children.len(), 1, "{:?}", waiting.children);
    let c = &waiting.children[0];
    assert_eq!(
        (&c.run_id, &c.op, c.on),
        (&child, &op1(&run), WaitReason::User)
    );
    assert_eq!(c.questions.len(), 1);
    assert_eq!(c.questions[0].prompt, "Which harbour?");
    let as_json = serde_json::to_value(c).expect("json");
    assert_eq!(as_json["run_id"], child.as_str());

    // Cancelling the parent cancels the child and waits for it.
    h.input(
        &run,
        Event::CancelRequested(CancelRequested {
            reason: "storm".into(),
            by: Some("test".into()),
        }),
        InputId::cancel(&run).as_str(),
    )
    .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Cancelled);
    let child_state = h.state(&child).await;
    assert_eq!(child_state.status, RunStatus::Cancelled);
    let events = h.events(&run).await;
    // The parent's run.cancelled comes after the child's result and lists it stopped.
    let result = the_result(&events, &op1(&run));
    assert!(result.is_error && result.stopped, "{result:?}");
    let cancelled = of_type(&events, EventType::RunCancelled);
    let Event::RunCancelled(c) = &cancelled[0].envelope.event else {
        unreachable!()
    };
    assert_eq!(c.operations.len(), 1);
    assert_eq!(c.operations[0].fate, OpFate::Stopped);
    let result_seq = of_type(&events, EventType::ToolResult)[0].seq;
    assert!(cancelled[0].seq > result_seq);
    let child_cancelled = of_type(&h.events(&child).await, EventType::RunCancelled)[0]
        .envelope
        .at;
    assert!(cancelled[0].envelope.at >= child_cancelled);
    h.shutdown().await;
}

/// The crash tests' agents: a parent that starts `navigator`, whose answer is valid.
async fn crash_setup(failpoint: &str) -> (Harness, usize) {
    let script = json!({"models": {
        "gpt-captain": parent_model("navigator"),
        "gpt-navigator": {"default": {"text": "{\"tide\": \"noon\"}"}}
    }});
    // Intake and the tool service in this process; the step service as a process to kill.
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Tool]).await;
    put(&h, "captain", "gpt-captain", starts(&["navigator"])).await;
    put(
        &h,
        "navigator",
        "gpt-navigator",
        json!({"output_schema": tide_schema()}),
    )
    .await;
    let doomed = h.spawn_process("step", "w-doomed", failpoint);
    (h, doomed)
}

/// After the standby finished: one child, one result, the parent succeeded with it.
async fn assert_one_child_one_result(h: &Harness, run: &RunId) {
    let state = h.wait_terminal(run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("done: sail at noon"));
    let child = assert_linked(h, run, "navigator").await;
    let child_events = h.events(&child).await;
    assert_eq!(of_type(&child_events, EventType::RunSucceeded).len(), 1);
    let result = the_result(&h.events(run).await, &op1(run));
    assert_eq!(result.content, "{\"tide\": \"noon\"}");
    assert_eq!(
        h.mock.requests("gpt-navigator").len(),
        1,
        "the child answered once"
    );
    assert_eq!(
        h.mock.requests("gpt-captain").len(),
        2,
        "the parent called twice"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_parents_worker_killed_after_creating_the_child_makes_no_second_child() {
    let (mut h, doomed) = crash_setup("step.after_child_created").await;
    let run = h
        .submit("captain", "Plan the voyage.", "task-crash-parent")
        .await;
    assert!(
        h.wait_exit(doomed, WAIT).await,
        "the worker reached its failpoint"
    );
    // Dead with the child created and the parent waiting: nothing moves until a worker comes.
    let child = RunId::for_child(&op1(&run));
    assert_eq!(
        of_type(&h.events(&child).await, EventType::RunCreated).len(),
        1
    );
    assert_eq!(h.state(&run).await.status, RunStatus::WaitingTool);
    h.spawn_process("step", "w-standby", "");
    assert_one_child_one_result(&h, &run).await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_childs_worker_killed_before_giving_its_result_delivers_it_once() {
    let (mut h, doomed) = crash_setup("step.before_child_result").await;
    let run = h
        .submit("captain", "Plan the voyage.", "task-crash-child")
        .await;
    assert!(
        h.wait_exit(doomed, WAIT).await,
        "the worker reached its failpoint"
    );
    // The child ended; the parent waits without its result.
    let child = RunId::for_child(&op1(&run));
    assert_eq!(h.state(&child).await.status, RunStatus::Succeeded);
    let parent = h.state(&run).await;
    assert_eq!(parent.status, RunStatus::WaitingTool);
    assert!(of_type(&h.events(&run).await, EventType::ToolResult).is_empty());
    h.spawn_process("step", "w-standby", "");
    assert_one_child_one_result(&h, &run).await;
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_child_result_lost_with_its_wake_is_recovered_by_the_reconciler() {
    let script = json!({"models": {
        "gpt-captain": parent_model("navigator"),
        "gpt-navigator": {"default": {"text": "{\"tide\": \"noon\"}"}}
    }});
    let mut h = Harness::start_with(script, &[Svc::Intake, Svc::Tool], |c| {
        c.timeouts.stall_after_ms = 3_500;
    })
    .await;
    put(&h, "captain", "gpt-captain", starts(&["navigator"])).await;
    put(&h, "navigator", "gpt-navigator", json!({})).await;
    let doomed = h.spawn_process("step", "w-doomed", "step.before_child_result");
    let run = h
        .submit("captain", "Plan the voyage.", "task-lost-result")
        .await;
    assert!(
        h.wait_exit(doomed, WAIT).await,
        "the worker reached its failpoint"
    );
    // The worst case the step's own repair cannot see: the wake that would have been
    // redelivered is taken and acked, and nothing acts on it (on either of the step's
    // consumers: a new run's wake or an input's).
    let mut acked = 0;
    for _ in 0..5 {
        for durable in [
            kedge_core::subjects::Durable::Step,
            kedge_core::subjects::Durable::StepCreated,
        ] {
            acked += common::swallow(
                &h.rt.js,
                durable,
                Duration::from_secs(3),
                Duration::from_secs(1),
            )
            .await;
        }
        if acked > 0 {
            break;
        }
    }
    assert!(acked > 0, "the child's pending wake");
    h.spawn_service(Svc::Step, "w-step");
    tokio::time::sleep(Duration::from_millis(1_000)).await;
    let child = RunId::for_child(&op1(&run));
    assert_eq!(h.state(&child).await.status, RunStatus::Succeeded);
    assert_eq!(
        h.state(&run).await.status,
        RunStatus::WaitingTool,
        "stalled"
    );

    // Once the child has been quiet past stall_after, the reconciler nudges it and its next
    // drive gives the parent its result.
    tokio::time::sleep(Duration::from_millis(3_600)).await;
    let rec = h.runtime_as(kedge_runtime::secure::Kind::Reconciler).await;
    let report = kedge_reconciler::scan_once(&rec).await.expect("scan");
    assert!(report.nudged.contains(&run), "{report:?}");
    assert_one_child_one_result(&h, &run).await;
    let nudges = of_type(&h.events(&child).await, EventType::Nudge).len();
    assert_eq!(nudges, 1, "the child was nudged once");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_childs_worker_killed_mid_model_call_is_replaced_while_the_parent_waits() {
    let script = json!({"models": {
        "gpt-captain": parent_model("navigator"),
        "gpt-navigator": {"default": {"text": "{\"tide\": \"noon\"}", "delay_ms": 2500}}
    }});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Tool]).await;
    put(&h, "captain", "gpt-captain", starts(&["navigator"])).await;
    put(&h, "navigator", "gpt-navigator", json!({})).await;
    let workers = [
        ("w-a", h.spawn_process("step", "w-a", "")),
        ("w-b", h.spawn_process("step", "w-b", "")),
    ];
    for (w, _) in workers {
        h.heartbeat_of(w).await;
    }
    let run = h
        .submit("captain", "Plan the voyage.", "task-kill-child")
        .await;
    let child = RunId::for_child(&op1(&run));
    // The child's model call is in flight: kill the worker that holds the child.
    let deadline = std::time::Instant::now() + WAIT;
    let holder = loop {
        let started = of_type(&h.events(&child).await, EventType::StepStarted).len();
        if started > 0
            && let Some(l) = h.rt.leases.holder(&child).await.expect("lease read")
        {
            break l.owner;
        }
        assert!(std::time::Instant::now() < deadline, "nobody drove {child}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    };
    let (_, doomed) = workers
        .into_iter()
        .find(|(w, _)| *w == holder)
        .expect("one of ours drives the child");
    assert_eq!(h.state(&run).await.status, RunStatus::WaitingTool);
    h.kill9(doomed);

    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("done: sail at noon"));
    assert_linked(&h, &run, "navigator").await;
    let result = the_result(&h.events(&run).await, &op1(&run));
    assert_eq!(result.content, "{\"tide\": \"noon\"}");
    // The standby took the child over with a new attempt; the parent was not called again
    // until the result came.
    let child_events = h.events(&child).await;
    let attempts: Vec<u32> = child_events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::StepStarted(s) => Some(s.request_id.attempt().get()),
            _ => None,
        })
        .collect();
    assert_eq!(attempts, vec![1, 2], "the standby started attempt 2");
    assert_eq!(of_type(&child_events, EventType::RunSucceeded).len(), 1);
    assert_eq!(h.mock.requests("gpt-captain").len(), 2);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grandchild_waiting_on_a_person_shows_in_the_root_and_its_answer_flows_up() {
    let script = json!({"models": {
        "gpt-captain": parent_model("navigator"),
        "gpt-navigator": {
            "rules": [{"when_last_tool_result_contains": "harbour",
                       "respond": {"text": "the tide at harbour Nice turns at noon"}}],
            "default": {"tool_calls": [{"name": "run_agent",
                                        "arguments": {"agent": "asker", "input": "Ask where."}}]}
        },
        "gpt-asker": {
            "rules": [{"when_last_tool_result_contains": "Nice",
                       "respond": {"text": "harbour Nice"}}],
            "default": {"tool_calls": [{"name": "ask_user",
                                        "arguments": {"question": "Which harbour?"}}]}
        }
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    put(&h, "captain", "gpt-captain", starts(&["navigator"])).await;
    put(&h, "navigator", "gpt-navigator", starts(&["asker"])).await;
    put(&h, "asker", "gpt-asker", json!({"tools": ["ask_user"]})).await;

    let run = h.submit("captain", "Plan the voyage.", "task-nested").await;
    let child = RunId::for_child(&op1(&run));
    let grandchild = RunId::for_child(&op1(&child));
    let asked = h
        .wait_for(&grandchild, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let link = asked.bundle.parent.clone().expect("linked");
    assert_eq!(link.run_id, child);
    assert_eq!(
        link.ancestors
            .iter()
            .map(|a| a.as_str())
            .collect::<Vec<_>>(),
        vec!["captain", "navigator"]
    );
    // The root's view lists the grandchild's question, on the grandchild's run id.
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingTool)
        .await;
    let events = h.events(&run).await;
    let mut view = kedge_app::view::run_view(&state, &events);
    kedge_app::view::add_children(&h.rt.journal, &state, &mut view).await;
    let waiting = view.waiting.expect("waiting");
    assert_eq!(waiting.children.len(), 1, "{:?}", waiting.children);
    assert_eq!(waiting.children[0].run_id, grandchild);
    let question = waiting.children[0].questions[0].question_id.clone();

    // Answered there, the answer flows up: grandchild → child → root.
    h.input(
        &grandchild,
        Event::QuestionAnswered(kedge_core::event::QuestionAnswered {
            question_id: question.clone(),
            answer: "Nice".into(),
        }),
        InputId::answer(&question).as_str(),
    )
    .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("done: sail at noon"));
    assert_eq!(
        the_result(&h.events(&child).await, &op1(&child)).content,
        "harbour Nice"
    );
    assert_eq!(
        the_result(&h.events(&run).await, &op1(&run)).content,
        "the tide at harbour Nice turns at noon"
    );
    h.shutdown().await;
}
