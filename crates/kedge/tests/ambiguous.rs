//! A tool worker killed mid-operation: a tool with a confirm query continues without repeating
//! the effect (see agent_loop.rs); a tool whose outcome cannot be known parks the run in
//! `unknown` until a person resolves it — never an automatic retry.

use crate::common;

use std::time::Duration;

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::event::{Event, Resolution};
use kedge_core::fold::OpStatus;
use serde_json::json;

const WAIT: Duration = Duration::from_secs(30);

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ambiguous_outcome_waits_for_a_person_then_continues() {
    for resolution in [
        Resolution::Completed {
            content: "it did run".into(),
        },
        Resolution::Retry,
    ] {
        let script = json!({"models": {"ma": {"steps": [
            {"text": "running", "tool_calls": [{"name": "shell", "arguments": {"command": "echo", "args": ["once"]}}]},
            {"text": "done"}
        ]}}});
        let mut h = Harness::start(script, &[Svc::Intake, Svc::Step]).await;
        h.agent("amb", "ma").await;
        let doomed = h.spawn_process("tool", "w-doomed", "tool.after_effect");
        let run = h.submit("amb", "go", "amb-1").await;
        assert!(h.wait_exit(doomed, WAIT).await);
        h.spawn_process("tool", "w-fresh", "");
        let state = h
            .wait_for(&run, WAIT, |s| s.status == RunStatus::Unknown)
            .await;
        let (op, tool) = state.ops.iter().next().expect("one op");
        assert!(matches!(tool.status, OpStatus::Ambiguous { .. }));
        // It stays there: no automatic retry.
        tokio::time::sleep(Duration::from_millis(1500)).await;
        let still = h.state(&run).await;
        assert_eq!(still.status, RunStatus::Unknown);
        assert_eq!(h.mock.total_calls(), 1);
        // The operator's verdict, as `kedge resolve` and the bridge send it; sent twice (a
        // retried request), it lands once.
        let events = h.events(&run).await;
        let first = kedge_app::inputs::resolve(
            &h.rt,
            &run,
            &events,
            op,
            resolution.clone(),
            "operator".into(),
        )
        .await
        .expect("resolution journaled");
        assert!(!first.duplicate);
        let again = kedge_app::inputs::resolve(
            &h.rt,
            &run,
            &events,
            op,
            resolution.clone(),
            "operator".into(),
        )
        .await
        .expect("a repeat is no error");
        assert!(again.duplicate, "one verdict per ambiguity");
        assert_eq!(again.seq, first.seq);
        let done = h.wait_terminal(&run, WAIT).await;
        assert_eq!(done.status, RunStatus::Succeeded, "{resolution:?}");
        let result = done.ops[op].result.clone().expect("a result");
        let requested = h
            .events(&run)
            .await
            .iter()
            .filter(|r| matches!(r.envelope.event, Event::ToolRequested(_)))
            .count();
        match resolution {
            Resolution::Completed { .. } => {
                assert_eq!(result.content, "it did run");
                assert_eq!(requested, 1, "not dispatched again");
            }
            Resolution::Retry => {
                assert_eq!(result.content, "once\n", "ran again under the same id");
                assert_eq!(requested, 2, "re-dispatched once");
            }
            Resolution::Failed { .. } => unreachable!(),
        }
        h.shutdown().await;
    }
}
