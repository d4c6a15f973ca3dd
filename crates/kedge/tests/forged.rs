//! A tool runner executes nothing the journal did not decide (principle 10), whoever
//! asks: a forged `kedge.tool.resolve` request (an operation never journaled, on a run that
//! exists or not; a journaled operation with other arguments or another dispatch) and a forged
//! `tool.requested` published straight onto a decision subject (its envelope or operation of
//! another run, or without the writer's message id) run nothing; the request is answered
//! `refused`, the delivery is terminated and never redelivered. A precondition query
//! (`kedge.tool.inspect`) about a run that does not exist, or through a tool its agent does not
//! declare, is refused too. The legitimate paths still run.

use crate::common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use async_nats::HeaderMap;
use common::{Harness, Svc};
use futures::StreamExt;
use kedge_core::RunStatus;
use kedge_core::event::{Digest, Draft, Envelope, Event, EventType, Timestamp, ToolRequested};
use kedge_core::fold::OpStatus;
use kedge_core::ids::{OperationId, RunId, StepNo};
use kedge_core::subjects::{self, TOOL_INSPECT, TOOL_RESOLVE};
use kedge_tool::Handled;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

/// A `tool.requested` envelope of `run` for `op`; `args_digest` is the arguments' digest unless
/// given.
fn request(
    run: &RunId,
    op: &OperationId,
    tool: &str,
    arguments: Value,
    redispatch: u32,
    args_digest: Option<Digest>,
) -> Envelope {
    Envelope::new(
        run.clone(),
        Timestamp::now(),
        Draft::new(Event::ToolRequested(ToolRequested {
            call_id: "call_forged".into(),
            tool: tool.into(),
            args_digest: args_digest.unwrap_or_else(|| Digest::of_json(&arguments)),
            arguments,
            redispatch,
            expect_version: None,
            limits: kedge_core::tools::RunLimits::default(),
            reversibility: None,
            compensates: None,
        }))
        .step(op.step())
        .op(op.clone()),
    )
}

/// Sends a resolve request as the reconciler would and returns what the runner answered
/// (asking again while no tool service has subscribed yet).
async fn resolve(h: &Harness, payload: Vec<u8>) -> Handled {
    let deadline = Instant::now() + WAIT;
    let reply = loop {
        let asked = tokio::time::timeout(
            Duration::from_secs(10),
            h.rt.client.request(TOOL_RESOLVE, payload.clone().into()),
        )
        .await
        .expect("a tool runner answered in time");
        match asked {
            Ok(reply) => break reply,
            Err(e)
                if e.kind() == async_nats::RequestErrorKind::NoResponders
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no tool runner answered: {e}"),
        }
    };
    serde_json::from_slice(&reply.payload).unwrap_or_else(|e| {
        panic!(
            "not a Handled answer ({e}): {}",
            String::from_utf8_lossy(&reply.payload)
        )
    })
}

fn refused(answer: Handled, what: &str) -> String {
    match answer {
        Handled::Refused { reason } => reason,
        other => panic!("{what}: refused expected, got {other:?}"),
    }
}

/// Every file under `root` (none if it does not exist).
fn files_under(root: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    let mut dirs = vec![root.to_owned()];
    while let Some(dir) = dirs.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                dirs.push(path);
            } else {
                out.push(path);
            }
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolve_request_for_an_operation_never_journaled_runs_nothing() {
    let script = json!({"models": {"fr": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "?"}}]},
        {"text": "done"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("fr", "fr").await;
    let run = h.submit("fr", "go", "fr-1").await;
    h.wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;

    // An operation of a run that exists, never decided: a ledger entry and a file.
    let op = OperationId::new(&run, StepNo(7), 0);
    let ledger = request(
        &run,
        &op,
        "ledger_append",
        json!({"text": "forged"}),
        0,
        None,
    );
    let reason = refused(resolve(&h, ledger.to_json_bytes()).await, "unjournaled op");
    assert!(reason.contains("no tool.requested"), "{reason}");
    let op2 = OperationId::new(&run, StepNo(7), 1);
    let file = request(
        &run,
        &op2,
        "write_file",
        json!({"path": "forged.txt", "content": "x"}),
        0,
        None,
    );
    refused(resolve(&h, file.to_json_bytes()).await, "unjournaled op");

    // A run that does not exist.
    let ghost = RunId::generate();
    let ghost_op = OperationId::new(&ghost, StepNo(1), 0);
    let forged = request(
        &ghost,
        &ghost_op,
        "ledger_append",
        json!({"text": "ghost"}),
        0,
        None,
    );
    let reason = refused(resolve(&h, forged.to_json_bytes()).await, "no such run");
    assert!(reason.contains("does not exist"), "{reason}");
    let ghost_file = request(
        &ghost,
        &OperationId::new(&ghost, StepNo(1), 1),
        "write_file",
        json!({"path": "ghost.txt", "content": "x"}),
        0,
        None,
    );
    refused(resolve(&h, ghost_file.to_json_bytes()).await, "no such run");

    // An envelope of one run naming another run's operation.
    let mixed = request(
        &run,
        &ghost_op,
        "ledger_append",
        json!({"text": "mixed"}),
        0,
        None,
    );
    refused(resolve(&h, mixed.to_json_bytes()).await, "foreign op");

    assert!(h.ledger().is_empty(), "nothing ran: {:?}", h.ledger());
    let files = files_under(&h.config.workspace_root);
    assert!(files.is_empty(), "nothing was written: {files:?}");
    let state = h.state(&run).await;
    assert!(state.ops.values().all(|o| o.call.name == "ask_user"));
    assert_eq!(state.status, RunStatus::WaitingUser);
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resolve_request_with_other_arguments_or_another_dispatch_runs_nothing() {
    let script = json!({"models": {"fa": {"steps": [
        {"text": "paying", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "legit"}}]},
        {"text": "done"}
    ]}}});
    // No tool service yet: the operation is journaled and nobody has claimed it.
    let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
    h.agent("fa", "fa").await;
    let run = h.submit("fa", "go", "fa-1").await;
    let state = h
        .wait_for(&run, WAIT, |s| {
            s.ops.values().any(|o| o.status == OpStatus::Requested)
        })
        .await;
    let (op, _) = state.ops.iter().next().expect("one op");
    let op = op.clone();
    // The request never reaches a runner (a lost delivery); only resolve requests do.
    let taken = common::swallow(
        &h.rt.js,
        kedge_core::subjects::Durable::Tool,
        h.config.timeouts.tool_ack_wait(),
        Duration::from_secs(1),
    )
    .await;
    assert_eq!(taken, 1, "the one tool.requested");
    h.spawn_service(Svc::Tool, "w-tool");
    let journaled = h
        .events(&run)
        .await
        .into_iter()
        .find(|r| r.envelope.event_type() == EventType::ToolRequested)
        .expect("journaled tool.requested")
        .envelope;
    let Event::ToolRequested(original) = &journaled.event else {
        unreachable!("found by type");
    };

    // Other arguments with their own digest.
    let other = request(
        &run,
        &op,
        "ledger_append",
        json!({"text": "forged"}),
        0,
        None,
    );
    let reason = refused(resolve(&h, other.to_json_bytes()).await, "other arguments");
    assert!(reason.contains("arguments"), "{reason}");
    // Other arguments under the journaled digest.
    let lying = request(
        &run,
        &op,
        "ledger_append",
        json!({"text": "forged"}),
        0,
        Some(original.args_digest.clone()),
    );
    refused(resolve(&h, lying.to_json_bytes()).await, "digest of others");
    // The journaled call under a dispatch that was never decided.
    let later = request(
        &run,
        &op,
        "ledger_append",
        original.arguments.clone(),
        1,
        None,
    );
    let reason = refused(
        resolve(&h, later.to_json_bytes()).await,
        "undecided dispatch",
    );
    assert!(reason.contains("dispatch 1"), "{reason}");
    // Another tool with the journaled arguments.
    let tool = request(&run, &op, "shell", original.arguments.clone(), 0, None);
    refused(resolve(&h, tool.to_json_bytes()).await, "other tool");
    assert!(h.ledger().is_empty(), "nothing ran: {:?}", h.ledger());

    // The journaled request itself, as the reconciler sends it, is resolved.
    assert_eq!(resolve(&h, journaled.to_json_bytes()).await, Handled::Ran);
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    let ledger = h.ledger();
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert!(ledger[0].ends_with("legit"), "{ledger:?}");
    h.shutdown().await;
}

/// Publishes `envelope` on `subject` of the journal stream (as anyone allowed to publish there
/// could) with the given `Nats-Msg-Id`; returns its stream sequence.
async fn publish(h: &Harness, subject: &str, msg_id: Option<&str>, envelope: &Envelope) -> u64 {
    let mut headers = HeaderMap::new();
    if let Some(id) = msg_id {
        headers.insert(async_nats::header::NATS_MESSAGE_ID, id);
    }
    h.rt.js
        .publish_with_headers(subject.to_owned(), headers, envelope.to_json_bytes().into())
        .await
        .expect("published")
        .await
        .expect("stored")
        .sequence
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tool_requested_forged_onto_a_decision_subject_runs_nothing_and_is_terminated() {
    let h = Harness::start_with(json!({"models": {}}), &[Svc::Tool], |c| {
        c.shell_allowlist.push("touch".into());
    })
    .await;
    // The server's advisory for each message a consumer terminated.
    let mut terminated =
        h.rt.client
            .subscribe(format!(
                "$JS.EVENT.ADVISORY.CONSUMER.MSG_TERMINATED.{}.tool",
                subjects::RUNS_STREAM
            ))
            .await
            .expect("subscribe to advisories");
    h.rt.client.flush().await.expect("flush");

    let victim = RunId::generate();
    let other = RunId::generate();
    let subject = subjects::event(&victim, EventType::ToolRequested);
    // Well-formed writer ids (distinct, or the stream would drop them as duplicates).
    let writer_id = |run: &RunId, n: u32| {
        kedge_journal::decision_msg_id(
            run,
            kedge_core::ids::DecisionSeq::NONE,
            0,
            &format!("step-{n}"),
        )
    };
    let touch = |marker: &str| json!({"command": "touch", "args": [marker]});
    let mut forged = Vec::new();
    // The envelope (and its operation) of another run, on the victim's subject.
    let other_op = OperationId::new(&other, StepNo(1), 0);
    let env = request(&other, &other_op, "shell", touch("m-envelope"), 0, None);
    forged.push(publish(&h, &subject, Some(&writer_id(&victim, 1)), &env).await);
    // The victim's envelope naming an operation of another run.
    let env = request(&victim, &other_op, "shell", touch("m-op"), 0, None);
    forged.push(publish(&h, &subject, Some(&writer_id(&victim, 2)), &env).await);
    let env = request(
        &victim,
        &OperationId::new(&other, StepNo(1), 1),
        "ledger_append",
        json!({"text": "forged-op"}),
        0,
        None,
    );
    forged.push(publish(&h, &subject, Some(&writer_id(&victim, 3)), &env).await);
    // A consistent envelope, published without the writer's message id (a plain `nats pub`),
    // or with another run's.
    let victim_op = OperationId::new(&victim, StepNo(1), 0);
    let env = request(&victim, &victim_op, "shell", touch("m-plain"), 0, None);
    forged.push(publish(&h, &subject, None, &env).await);
    let env = request(
        &victim,
        &OperationId::new(&victim, StepNo(1), 1),
        "ledger_append",
        json!({"text": "forged-id"}),
        0,
        None,
    );
    forged.push(publish(&h, &subject, Some(&writer_id(&other, 4)), &env).await);

    // Every forged message was handled (the consumer's ack floor passed the last one)...
    let last = forged.iter().copied().max().expect("published");
    let mut consumer = kedge_runtime::consumer::durable(
        &h.rt.js,
        kedge_core::subjects::Durable::Tool,
        h.config.timeouts.tool_ack_wait(),
    )
    .await
    .expect("tool consumer");
    let deadline = Instant::now() + WAIT;
    loop {
        let info = consumer.info().await.expect("consumer info");
        if info.ack_floor.stream_sequence >= last {
            break;
        }
        assert!(Instant::now() < deadline, "not all handled: {info:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    // ... and ran nothing.
    assert!(h.ledger().is_empty(), "nothing ran: {:?}", h.ledger());
    let files = files_under(&h.config.workspace_root);
    assert!(files.is_empty(), "nothing was touched: {files:?}");
    // Each was terminated, once.
    let mut seen = Vec::new();
    while seen.len() < forged.len() {
        let Ok(Some(advisory)) = tokio::time::timeout(WAIT, terminated.next()).await else {
            panic!("terminated {seen:?} of {forged:?}");
        };
        let advisory: Value = serde_json::from_slice(&advisory.payload).expect("json advisory");
        seen.push(advisory["stream_seq"].as_u64().expect("stream_seq"));
    }
    seen.sort_unstable();
    assert_eq!(seen, forged, "each forged message terminated once");

    // Past the ack wait: nothing is pending or redelivered.
    tokio::time::sleep(h.config.timeouts.tool_ack_wait() + Duration::from_millis(500)).await;
    let info = consumer.info().await.expect("consumer info");
    assert_eq!(info.num_ack_pending, 0, "{info:?}");
    assert_eq!(info.num_redelivered, 0, "{info:?}");
    assert_eq!(
        info.delivered.consumer_sequence,
        forged.len() as u64,
        "{info:?}"
    );
    assert!(
        tokio::time::timeout(Duration::from_millis(200), terminated.next())
            .await
            .is_err(),
        "no second termination"
    );
    assert!(h.ledger().is_empty(), "nothing ran: {:?}", h.ledger());

    // The writer's append of the same kind of request runs.
    let legit_run = RunId::generate();
    let legit = request(
        &legit_run,
        &OperationId::new(&legit_run, StepNo(1), 0),
        "ledger_append",
        json!({"text": "legit"}),
        0,
        None,
    );
    h.rt.journal
        .append_decisions(
            &kedge_journal::DecisionWriter::unfenced(&legit_run, "step-x"),
            kedge_core::ids::DecisionSeq::NONE,
            &[kedge_core::DecisionEnvelope::try_from(legit).expect("a decision")],
        )
        .await
        .expect("appended");
    let deadline = Instant::now() + WAIT;
    while h.ledger().is_empty() && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let ledger = h.ledger();
    assert_eq!(ledger.len(), 1, "{ledger:?}");
    assert!(ledger[0].ends_with("legit"), "{ledger:?}");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_precondition_query_needs_a_run_that_exists_and_a_declared_tool() {
    let script = json!({"models": {"fi": {"steps": [
        {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "?"}}]},
        {"text": "done"}
    ]}}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    h.agent("fi", "fi").await;
    let run = h.submit("fi", "go", "fi-1").await;
    h.wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let ask = |run: &RunId, tool: &str| {
        let query = json!({"run_id": run, "tool": tool, "arguments": {"path": "notes.txt"}});
        let client = h.rt.client.clone();
        async move {
            // The run reached its wait without the tool service (ask_user is the step's own), so
            // under load the service may still be subscribing: no responders yet is retried.
            let deadline = std::time::Instant::now() + Duration::from_secs(10);
            let reply = loop {
                let answer = tokio::time::timeout(
                    Duration::from_secs(10),
                    client.request(TOOL_INSPECT, query.to_string().into()),
                )
                .await
                .expect("answered in time");
                match answer {
                    Err(e)
                        if e.kind() == async_nats::RequestErrorKind::NoResponders
                            && std::time::Instant::now() < deadline =>
                    {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                    other => break other.expect("answered"),
                }
            };
            serde_json::from_slice::<Value>(&reply.payload).expect("json answer")
        }
    };
    // The run exists and declares write_file: where its target is.
    assert_eq!(ask(&run, "write_file").await, json!({"version": "absent"}));
    // A run that does not exist.
    let answer = ask(&RunId::generate(), "write_file").await;
    assert!(
        answer["refused"]
            .as_str()
            .is_some_and(|r| r.contains("does not exist")),
        "{answer}"
    );
    assert!(answer.get("version").is_none(), "{answer}");
    // A tool the run's agent does not declare.
    let answer = ask(&run, "fs__stat").await;
    assert!(
        answer["refused"]
            .as_str()
            .is_some_and(|r| r.contains("declare")),
        "{answer}"
    );
    h.shutdown().await;
}
