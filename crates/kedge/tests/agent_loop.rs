//! The agent loop end to end against a real nats-server and the strict mock model, including
//! the crash experiments: a step worker killed after the model answered, a tool worker killed
//! after its side effect, two step workers racing.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::event::{Event, Nudge, ToolResult, UserMessage};
use kedge_core::task::TaskSubmission;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

fn call(name: &str, args: serde_json::Value) -> serde_json::Value {
    json!({"name": name, "arguments": args})
}

/// Three steps of two parallel tool calls each, then a final answer.
fn three_steps(model: &str) -> serde_json::Value {
    json!({"models": {model: {"steps": [
        {"text": "writing", "tool_calls": [
            call("write_file", json!({"path": "a.txt", "content": "alpha"})),
            call("write_file", json!({"path": "b.txt", "content": "beta"}))]},
        {"text": "reading", "tool_calls": [
            call("read_file", json!({"path": "a.txt"})),
            call("list_files", json!({}))]},
        {"text": "recording", "tool_calls": [
            call("ledger_append", json!({"text": "one"})),
            call("shell", json!({"command": "echo", "args": ["hi"]}))]},
        {"text": "all done"}
    ]}}})
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_three_step_run_with_parallel_tools_succeeds_with_one_call_per_request() {
    let h = Harness::start(three_steps("m3"), &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("three", "m3").await;
    let run = h.submit("three", "go", "task-3steps").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    assert_eq!(state.output.as_deref(), Some("all done"));
    assert_eq!(state.step.get(), 4);
    let calls = h.mock.calls();
    assert_eq!(calls.total, 4, "one model call per step");
    for (id, n) in &calls.by_request_id {
        assert_eq!(*n, 1, "request {id} sent {n} times");
    }
    // Every tool call of a step was answered before the next model call (the strict mock would
    // have refused otherwise), and results are in the context in call order.
    let requests = h.mock.requests("m3");
    let last = requests.last().expect("requests");
    let tool_msgs = last["messages"]
        .as_array()
        .expect("messages")
        .iter()
        .filter(|m| m["role"] == "tool")
        .count();
    assert_eq!(tool_msgs, 6);
    let events = h.events(&run).await;
    assert_schema_valid(&events);
    assert!(
        !events
            .iter()
            .any(|r| matches!(r.envelope.event, Event::ModelAttempt(_))),
        "no model call failed"
    );
    // Each response was kept once, by the `step.completed` that committed it: none went to the
    // idempotency bucket (the write a step that commits at once does not make).
    let mut completed = 0;
    for r in &events {
        if let Event::StepCompleted(c) = &r.envelope.event {
            let kept =
                h.rt.idempotency
                    .stored_response(&c.request_id)
                    .await
                    .expect("read the stored response");
            assert!(kept.is_none(), "response of {} stored", c.request_id);
            completed += 1;
        }
    }
    assert_eq!(completed, 4);
    assert_eq!(h.ledger().len(), 1);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn early_and_duplicate_wakes_never_call_the_model_with_a_result_missing() {
    // No tool service: the test plays the tool and wakes the run early on purpose.
    let script = json!({"models": {"mw": {"steps": [
        {"text": "two things", "tool_calls": [
            call("read_file", json!({"path": "x"})), call("read_file", json!({"path": "y"}))]},
        {"text": "done"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("wakes", "mw").await;
    let run = h.submit("wakes", "go", "task-wakes").await;
    let state = h
        .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingTool)
        .await;
    let ops: Vec<_> = state.ops.keys().cloned().collect();
    assert_eq!(ops.len(), 2);
    let result = |c: &str| {
        Event::ToolResult(ToolResult {
            content: c.into(),
            is_error: false,
            stopped: false,
        })
    };
    // One result, then nudges and a duplicate of that result: all early wakes.
    let env = |e: Event, op| {
        let mut d = kedge_core::event::Draft::new(e);
        d.op = Some(op);
        let env =
            kedge_core::event::Envelope::new(run.clone(), kedge_core::event::Timestamp::now(), d);
        kedge_core::InputEnvelope::try_from(env).expect("an input")
    };
    let id = kedge_core::ids::InputId::arbitrary;
    h.rt.journal
        .append_input(&id("r0"), &env(result("X"), ops[0].clone()))
        .await
        .expect("append");
    h.rt.journal
        .append_input(&id("r0-dup"), &env(result("X again"), ops[0].clone()))
        .await
        .expect("append");
    for i in 0..3 {
        h.input(
            &run,
            Event::Nudge(Nudge {
                reason: "test".into(),
            }),
            &format!("n{i}"),
        )
        .await;
    }
    tokio::time::sleep(Duration::from_millis(800)).await;
    assert_eq!(
        h.mock.total_calls(),
        1,
        "the model must not be called with a result missing"
    );
    assert_eq!(h.state(&run).await.status, RunStatus::WaitingTool);
    h.rt.journal
        .append_input(&id("r1"), &env(result("Y"), ops[1].clone()))
        .await
        .expect("append");
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(h.mock.total_calls(), 2);
    assert_schema_valid(&h.events(&run).await);
    h.shutdown().await;
}

/// A step worker killed after the model answered: with the answer journaled and its tool calls
/// not requested yet (a commit that landed at once), or with the answer stored in the
/// idempotency bucket and nothing committed (a commit that did not land: the switch makes the
/// step take it so). Either way the next worker completes the step from what was kept.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_step_worker_killed_after_the_model_answered_costs_no_second_call() {
    for (failpoint, reused) in [
        ("step.after_answer_committed", false),
        (
            "switch:step.answer_not_committed,step.after_model_stored",
            true,
        ),
    ] {
        let mut h = Harness::start(three_steps("mk"), &[Svc::Intake, Svc::Tool]).await;
        h.agent("crash", "mk").await;
        let doomed = h.spawn_process("step", "w-doomed", failpoint);
        let run = h.submit("crash", "go", "task-crash").await;
        assert!(
            h.wait_exit(doomed, WAIT).await,
            "{failpoint}: the armed worker should have aborted"
        );
        let after_crash = h.state(&run).await;
        assert_eq!(after_crash.status, RunStatus::Running, "{failpoint}");
        assert_eq!(
            after_crash.open_step.is_some(),
            reused,
            "{failpoint}: step 1 is open exactly when its answer was not committed"
        );
        assert!(
            after_crash.ops.is_empty(),
            "{failpoint}: nothing was requested"
        );
        assert_eq!(h.mock.total_calls(), 1);
        // A fresh worker takes over once the lease and the wake's ack wait expire.
        h.spawn_process("step", "w-fresh", "");
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(
            state.status,
            RunStatus::Succeeded,
            "{failpoint}: {:?}",
            state.failure
        );
        let calls = h.mock.calls();
        assert_eq!(
            calls.total, 4,
            "{failpoint}: 4 steps, 4 model calls: the crashed step was not paid twice"
        );
        assert!(
            calls.by_request_id.values().all(|n| *n == 1),
            "{failpoint}: {calls:?}"
        );
        let events = h.events(&run).await;
        let first: Vec<_> = events
            .iter()
            .filter_map(|r| match &r.envelope.event {
                Event::StepCompleted(c) if c.request_id.step().get() == 1 => Some(c.clone()),
                _ => None,
            })
            .collect();
        assert_eq!(first.len(), 1, "{failpoint}: step 1 completed once");
        assert_eq!(
            first[0].reused, reused,
            "{failpoint}: completed from the stored response exactly when one was stored"
        );
        assert!(
            events.iter().any(|r| matches!(&r.envelope.event, Event::StepStarted(s) if s.request_id == first[0].request_id)),
            "{failpoint}: the attempt is in the journal"
        );
        assert_eq!(h.ledger().len(), 1, "{failpoint}: the tool ran once");
        assert_schema_valid(&events);
        h.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_worker_killed_after_its_side_effect_does_not_repeat_it() {
    // After the effect; after the record and the result; after the record with the result not
    // journaled (the next runner's claim finds the record done and journals its result).
    for failpoint in [
        "tool.after_effect",
        "tool.after_record",
        "switch:tool.result_lost,tool.after_record",
    ] {
        let script = json!({"models": {"ml": {"steps": [
            {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 5"}))]},
            {"text": "paid"}
        ]}}});
        let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
        h.agent("ledger", "ml").await;
        let doomed = h.spawn_process("tool", "w-tool-doomed", failpoint);
        let run = h.submit("ledger", "go", "task-ledger").await;
        assert!(
            h.wait_exit(doomed, WAIT).await,
            "{failpoint}: the tool worker should abort"
        );
        assert_eq!(h.ledger().len(), 1, "{failpoint}: the effect happened once");
        h.spawn_process("tool", "w-tool-fresh", "");
        let state = h.wait_terminal(&run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{failpoint}");
        let ledger = h.ledger();
        assert_eq!(
            ledger.len(),
            1,
            "{failpoint}: the effect must not repeat: {ledger:?}"
        );
        let op = state.ops.keys().next().expect("one op").to_string();
        assert!(ledger[0].starts_with(&op), "keyed by the operation id");
        assert_schema_valid(&h.events(&run).await);
        h.shutdown().await;
    }
}

/// The record of an operation and its `tool.result` are written together: a runner can die with
/// the result journaled and the record still `running` (the switch leaves the record unwritten,
/// the failpoint kills the runner before it acknowledges the request). The runner that takes the
/// operation over finds the result in the journal, finishes the record from it and runs nothing:
/// an idempotent tool (no confirm query) would otherwise run a second time, under a second
/// `tool.started`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_result_journaled_before_its_record_is_not_run_again_by_the_taker() {
    let script = json!({"models": {"mw": {"steps": [
        {"text": "writing", "tool_calls": [call("write_file", json!({"path": "a.txt", "content": "alpha"}))]},
        {"text": "written"}
    ]}}});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("writer", "mw").await;
    let doomed = h.spawn_process(
        "tool",
        "w-tool-doomed",
        "switch:tool.record_lost,tool.after_record",
    );
    let run = h.submit("writer", "go", "task-record-lost").await;
    assert!(h.wait_exit(doomed, WAIT).await, "the tool worker aborts");
    // The run has its result already: it goes on without any tool runner.
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    let op = state.ops.keys().next().expect("one op").clone();
    let kv =
        h.rt.js
            .get_key_value("kedge_idempotency")
            .await
            .expect("bucket");
    let key = kedge_runtime::idempotency::IdempotencyStore::op_key(&op);
    let record = || async {
        let entry = kv
            .get(key.as_str())
            .await
            .expect("kv get")
            .expect("a record");
        serde_json::from_slice::<kedge_runtime::idempotency::OpRecord>(&entry).expect("record")
    };
    assert_eq!(
        record().await.state,
        kedge_runtime::idempotency::OpState::Running,
        "the record was left running"
    );
    // The request was not acknowledged: redelivered to a fresh runner, which takes the record
    // of the gone runner over.
    h.spawn_process("tool", "w-tool-fresh", "");
    let deadline = tokio::time::Instant::now() + WAIT;
    let finished = loop {
        let rec = record().await;
        if rec.state != kedge_runtime::idempotency::OpState::Running {
            break rec;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the fresh runner never finished the record"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(finished.runner, "w-tool-fresh");
    let events = h.events(&run).await;
    let result = events
        .iter()
        .find_map(|r| match &r.envelope.event {
            Event::ToolResult(t) => Some(t.clone()),
            _ => None,
        })
        .expect("a tool.result");
    assert_eq!(
        finished.state,
        kedge_runtime::idempotency::OpState::Done {
            content: result.content.clone(),
            is_error: result.is_error,
            how: kedge_runtime::idempotency::Finished::Ran,
        },
        "the record is finished from the journaled result"
    );
    let started = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ToolStarted(_)))
        .count();
    assert_eq!(started, 1, "the operation ran once");
    assert_eq!(
        events
            .iter()
            .filter(|r| matches!(r.envelope.event, Event::ToolResult(_)))
            .count(),
        1
    );
    assert_schema_valid(&events);
    h.shutdown().await;
}

/// A runner that took over an abandoned operation, confirmed it happened and recorded so, dies
/// before journaling `outcome.confirmed`: the next taker finds the record done and journals what
/// the first would have (how the result was learned), not a plain `tool.result`. The same holds
/// for a second taker racing a live one (two reconciler replicas asking at once).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirmed_outcome_recorded_by_a_runner_that_died_is_journaled_as_confirmed() {
    let script = json!({"models": {"mc": {"steps": [
        {"text": "paying", "tool_calls": [call("ledger_append", json!({"text": "pay 5"}))]},
        {"text": "paid"}
    ]}}});
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("ledger", "mc").await;
    let first = h.spawn_process("tool", "w-tool-first", "tool.after_effect");
    let run = h.submit("ledger", "go", "task-confirmed").await;
    assert!(h.wait_exit(first, WAIT).await, "the first runner aborts");
    let second = h.spawn_process("tool", "w-tool-second", "tool.after_confirmed_record");
    assert!(
        h.wait_exit(second, WAIT).await,
        "the second runner confirms, records and aborts"
    );
    h.spawn_process("tool", "w-tool-third", "");
    assert_eq!(
        h.wait_terminal(&run, WAIT).await.status,
        RunStatus::Succeeded
    );
    let events = h.events(&run).await;
    let count = |f: fn(&Event) -> bool| events.iter().filter(|r| f(&r.envelope.event)).count();
    assert_eq!(count(|e| matches!(e, Event::OutcomeConfirmed(_))), 1);
    assert_eq!(count(|e| matches!(e, Event::ToolResult(_))), 0);
    assert_eq!(h.ledger().len(), 1, "the effect did not repeat");
    assert_schema_valid(&events);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_step_workers_racing_make_one_call_per_step_and_no_conflicting_decisions() {
    let mut h = Harness::start(three_steps("mr"), &[Svc::Intake, Svc::Tool]).await;
    h.agent("race", "mr").await;
    h.spawn_service(Svc::Step, "w-a");
    h.spawn_service(Svc::Step, "w-b");
    let mut runs = Vec::new();
    for i in 0..6 {
        runs.push(h.submit("race", "go", &format!("task-race-{i}")).await);
    }
    // Extra wakes make both workers go for the same runs at the same time.
    for (i, run) in runs.iter().enumerate() {
        for j in 0..3 {
            h.input(
                run,
                Event::Nudge(Nudge {
                    reason: "race".into(),
                }),
                &format!("race-{i}-{j}"),
            )
            .await;
        }
    }
    for run in &runs {
        let state = h.wait_terminal(run, WAIT).await;
        assert_eq!(state.status, RunStatus::Succeeded);
        assert_eq!(state.step.get(), 4);
    }
    let calls = h.mock.calls();
    assert_eq!(calls.total, 6 * 4, "{calls:?}");
    assert!(calls.by_request_id.values().all(|n| *n == 1), "{calls:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_msg_id_makes_one_run_and_a_malformed_task_is_rejected_without_harm() {
    let script = json!({"models": {"mi": {"steps": [{"text": "hello"}]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("idem", "mi").await;
    let a = h.submit("idem", "hi", "same-key").await;
    let b = h.submit("idem", "hi", "same-key").await;
    assert_eq!(a, b, "the same key is the same run");
    h.wait_terminal(&a, WAIT).await;

    let tenant: kedge_core::ids::TenantId = "acme".parse().expect("valid");
    let ids = h.rt.run_ids().await.expect("the run-id key");
    assert_eq!(
        ids.keyed(&tenant, "same-key"),
        a,
        "the run id is derived from (tenant, key)"
    );
    // Intake crashed after writing run.created and before acking the task: the task comes back
    // (here under a new stream message, as after the duplicate window) and finds its run.
    let crashed = ids.keyed(&tenant, "crashed-key");
    let Event::RunCreated(mut created) = h.events(&a).await[0].envelope.event.clone() else {
        panic!("first event is run.created")
    };
    created.idempotency_key = Some("crashed-key".into());
    let env = kedge_core::DecisionEnvelope::new(
        crashed.clone(),
        kedge_core::event::Timestamp::now(),
        kedge_core::event::Draft::new(kedge_core::Decision::RunCreated(created)),
    );
    h.rt.journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&crashed, "intake"),
            kedge_core::ids::DecisionSeq::NONE,
            &[env],
        )
        .await
        .expect("the crashed intake's write");
    let c = h.submit("idem", "hi", "crashed-key").await;
    assert_eq!(
        c, crashed,
        "the redelivered task resolves to the run already created"
    );
    let created_events = h
        .events(&crashed)
        .await
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::RunCreated(_)))
        .count();
    assert_eq!(created_events, 1, "one run.created");
    h.wait_terminal(&crashed, WAIT).await;

    // Malformed tasks: each is answered with the field at fault and the services keep going.
    let placeholder = TaskSubmission::new("idem".parse().expect("valid"), String::new());
    let sub = |key: &'static str| kedge_intake::Submission {
        task: &placeholder,
        key,
        tenant: "acme",
        caller: None,
    };
    let cases: [(&[u8], &str, &str); 4] = [
        (b"{not json", "agent.task.idem", "body"),
        (br#"{"agent":"idem"}"#, "agent.task.idem", "input"),
        (
            br#"{"agent":"ghost","input":"x"}"#,
            "agent.task.ghost",
            "agent",
        ),
        (
            br#"{"agent":"idem","input":"x","extra":1}"#,
            "agent.task.idem",
            "extra",
        ),
    ];
    for (i, (body, subject, field)) in cases.iter().enumerate() {
        let key: &'static str = Box::leak(format!("bad-{i}").into_boxed_str());
        let answer = kedge_intake::submit_raw(
            &h.rt.client,
            subject,
            bytes::Bytes::copy_from_slice(body),
            &sub(key),
            Duration::from_secs(10),
        )
        .await
        .expect("answered");
        match answer {
            kedge_intake::Answer::Rejected { error } => {
                assert_eq!(error.field, *field, "{error:?}")
            }
            other => panic!("{field}: expected a rejection, got {other:?}"),
        }
    }
    let big = "x".repeat(kedge_core::task::MAX_INPUT_BYTES + 1);
    let answer = h
        .submit_task(
            &TaskSubmission::new("idem".parse().expect("valid"), big),
            "too-big",
        )
        .await;
    assert!(
        matches!(answer, kedge_intake::Answer::Rejected { ref error } if error.field == "input"),
        "{answer:?}"
    );
    // The rejections are recorded durably.
    let js = async_nats::jetstream::new(h.rt.client.clone());
    let mut stream = js
        .get_stream("KEDGE_REJECTIONS")
        .await
        .expect("rejections stream");
    let info = stream.info().await.expect("info");
    assert_eq!(info.state.messages, 5);
    // ...and intake still works.
    let c = h.submit("idem", "again", "after-bad").await;
    assert_eq!(h.wait_terminal(&c, WAIT).await.status, RunStatus::Succeeded);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_user_message_sent_during_a_step_reaches_the_next_model_request() {
    a_message_during_a_step("mu", false).await;
}

/// The net under the run-wide check: should the broker accept a decision past an input (the
/// switch `step.append_past_input` makes the step take its plain-checked append as checked
/// against the run's last message), the state folds the decision in and steps over the input, and
/// its next read (the tool's result) must find the input there and fold the run again: the
/// message still reaches the next model request. Without the net the cached state would read on
/// from after the decision and never see it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_input_an_append_was_accepted_past_is_found_by_the_next_read() {
    a_message_during_a_step("mp", true).await;
}

/// A user message lands while step 1's model call is in flight (model `model`; with `past_input`,
/// the step's next append is taken past it, see above): it is not in the call in flight, it is
/// in step 2's, each step is paid once, and step 1's `step.completed` landed after it.
async fn a_message_during_a_step(model: &str, past_input: bool) {
    let script = json!({"models": {model: {"steps": [
        {"text": "thinking", "delay_ms": 1500, "tool_calls": [call("list_files", json!({}))]},
        {"text": "noted"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("msg", model).await;
    let run = h.submit("msg", "start", "task-msg").await;
    h.wait_for(&run, WAIT, |s| s.open_step.is_some()).await;
    if past_input {
        // The next append of the run is the step's first decision after the model call.
        kedge_runtime::failpoint::arm("step.append_past_input", run.as_str(), 1);
    }
    h.input(
        &run,
        Event::UserMessage(UserMessage {
            text: "also check the tides".into(),
        }),
        "user-msg-1",
    )
    .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    let requests = h.mock.requests(model);
    assert_eq!(requests.len(), 2, "one model call per step");
    let first = requests[0].to_string();
    let second = requests[1].to_string();
    assert!(
        !first.contains("also check the tides"),
        "not in the step already in flight"
    );
    assert!(
        second.contains("also check the tides"),
        "in the next step: {second}"
    );
    // The message landed while the step's state lacked it: the step's `step.completed` came
    // after it (checked against the run's last message, or taken past it), paid once.
    let events = h.events(&run).await;
    let seq_of =
        |f: &dyn Fn(&Event) -> bool| events.iter().find(|r| f(&r.envelope.event)).map(|r| r.seq);
    let message = seq_of(&|e| matches!(e, Event::UserMessage(_))).expect("the message");
    let completed = seq_of(&|e| matches!(e, Event::StepCompleted(_))).expect("a step");
    assert!(message < completed, "{message} < {completed}");
    h.shutdown().await;
}

/// A model call that fails while a user message lands, unseen by the step's read after the
/// failure: the attempt's end is journaled all the same (the append finds the message, reads
/// the run again and commits on that state while the attempt is still the open one). A
/// retryable failure (503) is recorded as `model.attempt` and retried under a new request id. A
/// fatal one (400) ends the run (`run.failed`), and the message, which no step read, revives it
/// into a second turn, whose first step the fold accepts. (Before, the failure went unrecorded
/// and the refused call was made again as a second attempt of the same step.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_model_call_is_journaled_when_an_input_lands_during_it() {
    for (model, status) in [("mr", 503), ("mx", 400)] {
        let script = json!({"models": {model: {"steps": [
            {"text": "answered on the second call", "delay_ms": 1000,
             "fault": {"status": status, "times": 1}}
        ]}}});
        let h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
        h.agent("flaky", model).await;
        let run = h.submit("flaky", "start", "task-flaky").await;
        h.wait_for(&run, WAIT, |s| s.open_step.is_some()).await;
        // The message lands during the call, and the step's read after the failure misses it
        // (as it would one stored right after that read): the append must find it.
        kedge_runtime::failpoint::arm("step.input_after_failed_call_read", run.as_str(), 1);
        h.input(
            &run,
            Event::UserMessage(UserMessage {
                text: "are you there?".into(),
            }),
            "user-msg-1",
        )
        .await;
        // The refused run is terminal (failed) for a moment before the message revives it:
        // wait for the run's end after the message was read.
        h.wait_for(&run, WAIT, |s| {
            s.status.is_terminal() && s.pending_messages.is_empty()
        })
        .await;
        let state = h.wait_terminal(&run, WAIT).await;
        let events = h.events(&run).await;
        let attempts: Vec<_> = events
            .iter()
            .filter_map(|r| match &r.envelope.event {
                Event::ModelAttempt(a) => Some((r.seq, a.clone())),
                _ => None,
            })
            .collect();
        assert_eq!(
            attempts.len(),
            1,
            "{status}: the failed attempt is journaled"
        );
        let (attempt_seq, attempt) = &attempts[0];
        assert!(
            matches!(
                attempt.outcome,
                kedge_core::event::AttemptOutcome::Error { status: Some(s), .. } if s == status
            ),
            "{status}: {attempt:?}"
        );
        let message = events
            .iter()
            .find(|r| matches!(r.envelope.event, Event::UserMessage(_)))
            .expect("the message")
            .seq;
        assert!(message < *attempt_seq, "the message landed during the call");
        assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
        assert_eq!(
            h.mock.calls().total,
            2,
            "{status}: one call after the failed one"
        );
        let failed = events
            .iter()
            .find(|r| matches!(r.envelope.event, Event::RunFailed(_)))
            .map(|r| r.seq);
        if status == 503 {
            assert_eq!(failed, None);
            assert_eq!(state.turn, 1, "retried within the turn");
        } else {
            let failed = failed.expect("the refusal ended the turn");
            assert!(*attempt_seq < failed);
            assert!(
                events
                    .iter()
                    .any(|r| matches!(r.envelope.event, Event::RunRevived(_)) && r.seq > failed),
                "the unread message revived the run"
            );
            assert_eq!(state.turn, 2);
        }
        let calls = h.mock.calls();
        for (id, n) in &calls.by_request_id {
            assert_eq!(*n, 1, "request {id} sent {n} times");
        }
        assert_schema_valid(&events);
        h.shutdown().await;
    }
}

/// `policy.<tool>.timeout_secs` lowers the tool service's limit for that tool: a `sleep 20`
/// under a 1 s policy limit (service limit 30 s) is killed after about a second and the model
/// is told.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_policy_timeout_lowers_the_tool_limit() {
    let script = json!({"models": {"mt": {"steps": [
        {"text": "sleeping", "tool_calls": [call("shell", json!({"command": "sleep", "args": ["20"]}))]},
        {"text": "done"}
    ]}}});
    let h = Harness::start_with(script, &[Svc::Intake, Svc::Step, Svc::Tool], |c| {
        c.timeouts.tool_timeout_ms = 30_000;
        c.timeouts.tool_grace_ms = 5_000;
        c.timeouts.tool_ack_wait_ms = 40_000;
    })
    .await;
    h.agent_with_policy("mt", "mt", json!({"shell": {"timeout_secs": 1}}))
        .await;
    let started = std::time::Instant::now();
    let run = h.submit("mt", "go", "mt-1").await;
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded);
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "took {:?}",
        started.elapsed()
    );
    let result = done
        .ops
        .values()
        .next()
        .and_then(|o| o.result.clone())
        .expect("a result");
    assert!(
        result.is_error && result.content.contains("timed out after 1000 ms"),
        "{result:?}"
    );
    h.shutdown().await;
}
