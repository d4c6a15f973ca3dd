//! A run started by one build and finished by another. The journal of a run recorded by an
//! earlier build (a replay fixture of crates/core/tests/fixtures, with the agent revision it ran
//! under) is cut where that build left the run waiting, put on a fresh broker as that build
//! stored it (same subjects, same stream sequences), and this build's services take it from
//! there: the run finishes, and every decision this build adds agrees with what the earlier one
//! decided before it (the replay check of `Harness::wait_terminal`).
//!
//! Fixtures are kept from release to release, so this test runs each release's services on
//! journals an earlier release wrote.

use crate::common;

use std::time::Duration;

use async_nats::jetstream;
use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Draft, Envelope, Event, EventKind};
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

/// A fixture's journal through `through` (its stream sequence), and its agent revision.
fn recorded(name: &str, through: u64) -> (Vec<(u64, Envelope)>, AgentDefinition) {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/fixtures");
    let text = std::fs::read_to_string(dir.join(format!("{name}.jsonl"))).expect("fixture");
    let mut events = Vec::new();
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).expect("json line");
        let seq = v["seq"].as_u64().expect("seq");
        if seq > through {
            break;
        }
        let bytes = serde_json::to_vec(&v["event"]).expect("json");
        events.push((seq, Envelope::from_json_bytes(&bytes).expect("envelope")));
    }
    let agent = std::fs::read_to_string(dir.join(format!("{name}.agent.json"))).expect("agent");
    (
        events,
        serde_json::from_str(&agent).expect("agent definition"),
    )
}

/// Puts the recorded journal on the broker at its recorded stream sequences (a message on a
/// subject no consumer reads fills each gap), each decision with its writer's `Nats-Msg-Id`,
/// the model endpoint moved to this test's mock, and stores the agent revision the run froze.
async fn restore(h: &Harness, events: &[(u64, Envelope)], mut def: AgentDefinition) {
    let base_url = format!("{}/v1", h.mock.base_url());
    def.model.base_url = Some(base_url.clone());
    let revision = h.rt.agents.put(&def).await.expect("agent stored");
    let js = jetstream::new(h.rt.client.clone());
    let mut next = 1;
    let mut last_decision = 0;
    for (seq, env) in events {
        while next < *seq {
            js.publish("agent.run.gap", "".into())
                .await
                .expect("publish")
                .await
                .expect("stored");
            next += 1;
        }
        let mut env = env.clone();
        if let Event::RunCreated(created) = &mut env.event {
            assert_eq!(
                created.agent_revision, revision,
                "the revision the run froze"
            );
            created.model.base_url = Some(base_url.clone());
            // The endpoint moved, so the envelope is sealed again (its digest covers the data).
            env = Envelope::new(
                env.run_id.clone(),
                env.at,
                Draft {
                    event: env.event.clone(),
                    step: env.step,
                    attempt: env.attempt,
                    op: env.op.clone(),
                    inline: env.inline,
                },
            );
        }
        // A decision carries its writer's id, naming the run's decision before it (the fixture
        // keeps the events, not the headers: the earlier build's writer is named here).
        let mut headers = async_nats::HeaderMap::new();
        if env.kind() == EventKind::Decision {
            let id = kedge_journal::decision_msg_id(
                &env.run_id,
                kedge_core::ids::DecisionSeq::at(last_decision),
                0,
                "earlier-build",
            );
            headers.insert("Nats-Msg-Id", id.as_str());
            last_decision = *seq;
        }
        let ack = js
            .publish_with_headers(env.subject(), headers, env.to_json_bytes().into())
            .await
            .expect("publish")
            .await
            .expect("stored");
        assert_eq!(ack.sequence, *seq, "stored at its recorded sequence");
        next += 1;
    }
}

/// Waiting on a timer when the earlier build stopped: this build's timer service fires it,
/// its step service asks the model for the next step, and the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_run_left_waiting_on_a_timer_by_an_earlier_build_finishes_on_this_one() {
    let fixture = "a-past-due-timer-fires-at-once";
    // Through `run.waiting {on: external}`: the wait tool's timer is scheduled, not fired.
    let (events, def) = recorded(fixture, 7);
    assert!(
        matches!(
            events.last().map(|(_, e)| &e.event),
            Some(Event::RunWaiting(_))
        ),
        "the fixture is cut while its run waits"
    );
    let model = def.model.name.clone();
    let mut h = Harness::start(
        // By assistant turns: the first was answered for the earlier build.
        json!({"models": {model: {"steps": [{"text": "not asked again"}, {"text": "rested"}]}}}),
        &[],
    )
    .await;
    restore(&h, &events, def).await;
    let run = events[0].1.run_id.clone();
    assert_eq!(h.state(&run).await.status, RunStatus::WaitingExternal);
    for svc in [Svc::Step, Svc::Tool, Svc::Timer] {
        h.spawn_service(svc, "w-new-build");
    }
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    assert_eq!(done.output.as_deref(), Some("rested"));
    assert_eq!(
        h.mock.total_calls(),
        1,
        "one model call: the step after the timer"
    );
    h.shutdown().await;
}

/// Left in `unknown` by the earlier build (a shell command's runner died mid-effect): a person
/// resolves it on this build with `retry`, this build's services run it again under the same
/// operation id, and the run succeeds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_operation_left_by_an_earlier_build_is_resolved_and_run_on_this_one() {
    let fixture = "an-ambiguous-outcome-waits-for-a-person-then-continues";
    // Through `run.unknown`: the operation's outcome is ambiguous, the run waits for a person.
    let (events, def) = recorded(fixture, 9);
    assert!(
        matches!(
            events.last().map(|(_, e)| &e.event),
            Some(Event::RunUnknown(_))
        ),
        "the fixture is cut while its run waits for a person"
    );
    let model = def.model.name.clone();
    let mut h = Harness::start(
        json!({"models": {model: {"steps": [{"text": "not asked again"}, {"text": "done"}]}}}),
        &[],
    )
    .await;
    restore(&h, &events, def).await;
    let run = events[0].1.run_id.clone();
    let state = h.state(&run).await;
    assert_eq!(state.status, RunStatus::Unknown);
    let op = state
        .ops
        .keys()
        .next()
        .expect("the ambiguous operation")
        .clone();
    for svc in [Svc::Step, Svc::Tool] {
        h.spawn_service(svc, "w-new-build");
    }
    let journal = h.events(&run).await;
    kedge_app::inputs::resolve(
        &h.rt,
        &run,
        &journal,
        &op,
        kedge_core::event::Resolution::Retry,
        "operator".into(),
    )
    .await
    .expect("resolved");
    let done = h.wait_terminal(&run, WAIT).await;
    assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
    assert_eq!(done.output.as_deref(), Some("done"));
    let result = done.ops[&op].result.clone().expect("a result");
    assert_eq!(
        result.content, "once\n",
        "run again under the same operation id"
    );
    h.shutdown().await;
}

/// An operation left `running` by an earlier build whose runner died: this
/// build's runner takes it over and asks the tool's status query about the earlier build's
/// operation id (the built-in ledger's, by operation id). `confirmed`: the earlier effect's
/// result is journaled (`outcome.confirmed`) and nothing runs again; `not_found`: this runner
/// runs it, once, under the same id. Either way the run finishes on this build.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_operation_left_running_by_an_earlier_build_is_answered_by_its_status_query() {
    let fixture = "a-step-worker-killed-after-the-model-answered-costs-no-second-call";
    for effect_happened in [true, false] {
        // Through the ledger operation's `tool.started`: the earlier build's runner took it.
        let (events, def) = recorded(fixture, 26);
        assert!(
            matches!(
                events.last().map(|(_, e)| &e.event),
                Some(Event::ToolStarted(_))
            ),
            "the fixture is cut with the operation started"
        );
        let (op, args_digest) = events
            .iter()
            .find_map(|(_, e)| match &e.event {
                Event::ToolRequested(t) if t.tool == "ledger_append" => {
                    Some((e.op.clone().expect("op"), t.args_digest.clone()))
                }
                _ => None,
            })
            .expect("the ledger operation");
        let model = def.model.name.clone();
        let mut h = Harness::start(
            // By assistant turns: three were answered for the earlier build.
            json!({"models": {model: {"steps": [
                {"text": "not asked again"}, {"text": "not asked again"},
                {"text": "not asked again"}, {"text": "all done"}
            ]}}}),
            &[],
        )
        .await;
        restore(&h, &events, def).await;
        let run = events[0].1.run_id.clone();
        // What the earlier build left beside its journal: the operation's record, held by a
        // runner that is gone, and (or not) the effect in the ledger.
        let kv =
            h.rt.js
                .get_key_value("kedge_idempotency")
                .await
                .expect("bucket");
        let record = json!({"args_digest": args_digest, "runner": "w-earlier-build",
            "dispatch": 0, "state": "running"});
        kv.put(format!("op.{op}"), record.to_string().into())
            .await
            .expect("record");
        let ledger = h.config.workspace_root.join("ledger.log");
        std::fs::create_dir_all(&h.config.workspace_root).expect("workspace root");
        if effect_happened {
            std::fs::write(&ledger, format!("{op}\tone\n")).expect("ledger");
        }
        for svc in [Svc::Step, Svc::Tool] {
            h.spawn_service(svc, "w-new-build");
        }
        let done = h.wait_terminal(&run, WAIT).await;
        assert_eq!(done.status, RunStatus::Succeeded, "{:?}", done.failure);
        assert_eq!(done.output.as_deref(), Some("all done"));
        let events = h.events(&run).await;
        let confirmed = events.iter().any(|r| {
            matches!(r.envelope.event, Event::OutcomeConfirmed(_))
                && r.envelope.op.as_ref() == Some(&op)
        });
        assert_eq!(confirmed, effect_happened, "confirmed only what happened");
        assert_eq!(
            done.ops[&op].result.clone().expect("a result").content,
            "recorded: one"
        );
        let lines = std::fs::read_to_string(&ledger).expect("ledger");
        assert_eq!(
            lines
                .lines()
                .filter(|l| l.starts_with(&format!("{op}\t")))
                .count(),
            1,
            "the effect once, whoever made it: {lines}"
        );
        h.shutdown().await;
    }
}
