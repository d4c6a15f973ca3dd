//! Compensation through `fold` and `decide` alone (docs/ARCHITECTURE.md "Compensation"): a run
//! that ends cancelled or failed, whose agent compensates, undoes the effects of its
//! compensable tools newest first, each compensation an operation of its own, and lists every
//! effect with its level and fate; irreversible effects are listed, never hidden.

use std::sync::Arc;

use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{Idle, ModelResponse, Next, complete_step, decide};
use kedge_core::event::{
    AssistantMessage, Budget, CancelRequested, CompensationStatus, Decision, Digest, Draft,
    Envelope, Event, FailureReason, FinishReason, Level, OpFate, OpSummary, OutcomeAmbiguous,
    RunCreated, StopCause, Timestamp, ToolCall, ToolRequested, ToolResult, Usage,
};
use kedge_core::fold::{RunState, fold};
use kedge_core::ids::{OperationId, RunId, StepNo};
use kedge_core::machine::RunStatus;
use kedge_core::tools::Contract;
use serde_json::json;

fn definition(on_cancel: &str, on_failure: &str, declare: bool) -> AgentDefinition {
    let schema = json!({"type": "object", "properties": {"amount": {"type": "number"}}});
    let mut v = json!({
        "name": "shop",
        "system_prompt": "You shop.",
        "model": {"provider": "openai", "name": "mock", "base_url": "http://127.0.0.1:1/v1"},
        "tools": [
            {"name": "pay", "description": "pay", "parameters": schema},
            {"name": "refund", "description": "refund", "parameters": {"type": "object"}},
            {"name": "ship", "description": "ship", "parameters": {"type": "object"}},
            "read_file", "ask_user"
        ],
        "on_cancel": on_cancel,
        "on_failure": on_failure
    });
    if declare {
        v["policy"] = json!({
            "pay": {"reversibility": "compensable", "timeout_secs": 9,
                    "compensate": {"tool": "refund", "arguments": {
                        "amount": "${arguments.amount}", "note": "refund of ${op}: ${result}"}}},
            "refund": {"reversibility": "irreversible", "timeout_secs": 5},
            "ship": {"reversibility": "irreversible"},
            "read_file": {"reversibility": "reversible"}
        });
    }
    AgentDefinition::parse(v.to_string().as_bytes()).expect("valid definition")
}

struct Sim {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    seq: u64,
    contract: Arc<Contract>,
}

impl Sim {
    fn new(def: &AgentDefinition, budget: Budget) -> Sim {
        let created = RunCreated {
            agent_digest: def.digest(),
            prompt_digest: def.prompt_digest(),
            tools_digest: def.tools_digest(),
            policy_digest: def.policy_digest(),
            budget,
            ..kedge_core::fixtures::run_created("shop", "buy a boat")
        };
        let mut sim = Sim {
            run: "run_comp".parse().expect("valid"),
            events: Vec::new(),
            seq: 0,
            contract: Contract::of(def),
        };
        sim.push(Draft::new(Event::RunCreated(Box::new(created))));
        sim
    }

    fn push(&mut self, draft: Draft<impl Into<Event>>) -> u64 {
        self.seq += 2;
        let env = Envelope::new(self.run.clone(), Timestamp::now(), draft);
        self.events.push((self.seq, env));
        self.seq
    }

    fn state(&self) -> RunState {
        fold(self.events.iter().map(|(s, e)| (*s, e))).expect("journal folds")
    }

    fn commit(&mut self, drafts: Vec<Draft<impl Into<Event>>>) {
        for d in drafts {
            self.push(d);
        }
        self.state();
    }

    /// Commits what `decide` says (a commit expected).
    fn decide_commit(&mut self) -> Vec<Draft<Decision>> {
        match decide(&self.state()) {
            Next::Commit(drafts) => {
                self.commit(drafts.clone());
                drafts
            }
            other => panic!("a commit expected, got {other:?}"),
        }
    }

    fn step(&mut self, calls: &[(&str, serde_json::Value)]) {
        let Next::Step(plan) = decide(&self.state()) else {
            panic!("a step expected, got {:?}", decide(&self.state()));
        };
        self.commit(plan.start.clone());
        let response = ModelResponse {
            message: AssistantMessage {
                text: String::new(),
                tool_calls: calls
                    .iter()
                    .enumerate()
                    .map(|(i, (name, args))| ToolCall {
                        call_id: format!("call_{}_{i}", plan.step),
                        name: (*name).into(),
                        arguments: args.clone(),
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
        };
        let drafts = complete_step(
            &self.state(),
            plan.step,
            plan.attempt,
            plan.request_id.clone(),
            response,
            false,
            Timestamp::now(),
            &self.contract,
        );
        self.commit(drafts);
    }

    fn result(&mut self, op: &OperationId, content: &str, is_error: bool) {
        let mut d = Draft::new(Event::ToolResult(ToolResult {
            content: content.into(),
            is_error,
            stopped: false,
        }));
        d.op = Some(op.clone());
        self.push(d);
    }

    fn cancel(&mut self) {
        self.push(Draft::new(Event::CancelRequested(CancelRequested {
            reason: "changed my mind".into(),
            by: None,
        })));
    }

    fn op(&self, step: u32, index: u32) -> OperationId {
        OperationId::new(&self.run, StepNo(step), index)
    }

    /// Replays the whole journal through this build's decisions.
    fn replays(&self) {
        let checked =
            kedge_core::replay::check(&self.events, &self.contract).expect("decides the same");
        assert!(checked.groups > 0);
    }

    /// Two payments (steps 1 and 2), a shipment (step 2), then a question (step 3): the run
    /// waits for the user.
    fn shop(&mut self) {
        self.step(&[("pay", json!({"amount": 5}))]);
        let pay1 = self.op(1, 0);
        self.result(&pay1, "paid 5", false);
        self.step(&[
            ("pay", json!({"amount": 7})),
            ("ship", json!({"to": "home"})),
        ]);
        let (pay2, ship) = (self.op(2, 0), self.op(2, 1));
        self.result(&pay2, "paid 7", false);
        self.result(&ship, "shipped", false);
        self.step(&[("ask_user", json!({"question": "colour?"}))]);
        assert_eq!(self.state().status, RunStatus::WaitingUser);
    }
}

/// The request of a compensation, from a committed group.
fn requested(drafts: &[Draft<Decision>]) -> (OperationId, ToolRequested) {
    match drafts {
        [d] => match &d.event {
            Decision::ToolRequested(r) => (d.op.clone().expect("op"), r.clone()),
            other => panic!("a compensation's request expected, got {other:?}"),
        },
        other => panic!("one decision expected, got {other:?}"),
    }
}

fn summary<'a>(list: &'a [OpSummary], op: &OperationId) -> &'a OpSummary {
    list.iter()
        .find(|s| s.op == *op)
        .unwrap_or_else(|| panic!("{op} is not listed in {list:?}"))
}

#[test]
fn a_cancel_compensates_newest_first_with_own_ids_and_lists_the_irreversible() {
    let def = definition("compensate", "none", true);
    let mut sim = Sim::new(&def, Budget::default());
    sim.shop();
    let (pay1, pay2, ship, ask) = (sim.op(1, 0), sim.op(2, 0), sim.op(2, 1), sim.op(3, 0));
    sim.cancel();
    let start = sim.decide_commit();
    assert!(
        matches!(start[0].event, Decision::RunCancelling(_)),
        "{start:?}"
    );
    let Decision::RunCompensating(k) = &start[1].event else {
        panic!("compensating expected, got {start:?}");
    };
    assert_eq!(k.cause, StopCause::Cancel);
    let planned: Vec<_> = k.plan.iter().map(|p| p.op.clone()).collect();
    assert_eq!(planned, [pay2.clone(), pay1.clone()], "newest first");
    assert_eq!(sim.state().status, RunStatus::Compensating);

    // One at a time, newest first, each under the id derived from what it undoes.
    let (c2, r2) = requested(&sim.decide_commit());
    assert_eq!(c2, pay2.compensation_of().expect("an id"));
    assert_ne!(c2, pay2);
    assert_eq!(r2.compensates.as_ref(), Some(&pay2));
    assert_eq!(r2.tool, "refund");
    assert_eq!(
        r2.arguments,
        json!({"amount": 7, "note": format!("refund of {pay2}: paid 7")})
    );
    assert_eq!(
        r2.limits.timeout_secs,
        Some(5),
        "the compensating tool's own policy"
    );
    assert_eq!(
        decide(&sim.state()),
        Next::Idle(Idle::WaitingTools { missing: 1 })
    );
    sim.result(&c2, "refunded 7", false);
    let (c1, r1) = requested(&sim.decide_commit());
    assert_eq!(c1, pay1.compensation_of().expect("an id"));
    assert_eq!(r1.arguments["amount"], 5);
    sim.result(&c1, "refunded 5", false);

    let end = sim.decide_commit();
    let Decision::RunCancelled(done) = &end[0].event else {
        panic!("run.cancelled expected, got {end:?}");
    };
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Cancelled);
    // Every effect listed with its level and fate; compensations under what they undo.
    assert_eq!(done.operations.len(), 4, "{:?}", done.operations);
    for (op, c) in [(&pay1, &c1), (&pay2, &c2)] {
        let s = summary(&done.operations, op);
        assert_eq!(
            (s.fate, s.level),
            (OpFate::Completed, Some(Level::Compensable))
        );
        let comp = s.compensation.as_ref().expect("compensated");
        assert_eq!(comp.status, CompensationStatus::Compensated);
        assert_eq!(comp.op.as_ref(), Some(c));
    }
    let s = summary(&done.operations, &ship);
    assert_eq!(
        (s.fate, s.level),
        (OpFate::Completed, Some(Level::Irreversible))
    );
    assert_eq!(s.compensation, None, "listed, never undone");
    let s = summary(&done.operations, &ask);
    assert_eq!(
        (s.fate, s.level),
        (OpFate::NeverStarted, Some(Level::Undeclared))
    );
    // The requests journal each effect's level.
    assert_eq!(
        state.ops[&ship].reversibility.as_ref().map(|r| r.level),
        Some(Level::Irreversible)
    );
    assert!(
        !state
            .transcript
            .iter()
            .any(|m| format!("{m:?}").contains("refunded")),
        "the model never sees a compensation"
    );
    sim.replays();
}

#[test]
fn a_failure_compensates_and_ends_with_its_failure_listing_the_effects() {
    let def = definition("none", "compensate", true);
    let budget = Budget {
        max_steps: 2,
        ..Budget::default()
    };
    let mut sim = Sim::new(&def, budget);
    sim.step(&[("pay", json!({"amount": 5}))]);
    sim.result(&sim.op(1, 0), "paid 5", false);
    sim.step(&[
        ("pay", json!({"amount": 7})),
        ("read_file", json!({"path": "a"})),
    ]);
    sim.result(&sim.op(2, 0), "paid 7", false);
    sim.result(&sim.op(2, 1), "text", false);
    // The third step is over budget: the run fails, through its compensation.
    let start = sim.decide_commit();
    let Decision::RunCompensating(k) = &start[0].event else {
        panic!("compensating expected, got {start:?}");
    };
    assert_eq!(k.cause, StopCause::Failure);
    assert_eq!(
        k.failure.as_ref().map(|f| f.reason),
        Some(FailureReason::MaxSteps)
    );
    let (c2, _) = requested(&sim.decide_commit());
    assert_eq!(c2.compensated(), Some(sim.op(2, 0)));
    sim.result(&c2, "refunded 7", false);
    let (c1, _) = requested(&sim.decide_commit());
    sim.result(&c1, "refunded 5", false);
    let end = sim.decide_commit();
    let Decision::RunFailed(f) = &end[0].event else {
        panic!("run.failed expected, got {end:?}");
    };
    assert_eq!(f.reason, FailureReason::MaxSteps);
    assert_eq!(f.effects.len(), 3);
    let read = summary(&f.effects, &sim.op(2, 1));
    assert_eq!(read.level, Some(Level::Reversible));
    assert_eq!(read.compensation, None);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Failed);
    assert_eq!(
        state.failure.as_ref().map(|f| f.effects.len()),
        Some(3),
        "the view's failure lists them"
    );
    sim.replays();
}

#[test]
fn a_compensation_that_fails_or_is_ambiguous_is_listed_and_the_next_one_runs() {
    let def = definition("compensate", "compensate", true);
    let mut sim = Sim::new(&def, Budget::default());
    sim.step(&[("pay", json!({"amount": 1}))]);
    sim.result(&sim.op(1, 0), "paid 1", false);
    sim.step(&[("pay", json!({"amount": 2}))]);
    sim.result(&sim.op(2, 0), "paid 2", false);
    sim.step(&[("pay", json!({"amount": 3}))]);
    sim.result(&sim.op(3, 0), "paid 3", false);
    sim.step(&[("ask_user", json!({"question": "more?"}))]);
    sim.cancel();
    sim.decide_commit();
    let (c3, _) = requested(&sim.decide_commit());
    sim.result(&c3, "refund refused: card expired", true);
    let (c2, _) = requested(&sim.decide_commit());
    let mut d = Draft::new(Event::OutcomeAmbiguous(OutcomeAmbiguous {
        detail: "the runner died mid-refund".into(),
    }));
    d.op = Some(c2.clone());
    sim.push(d);
    // An ambiguous compensation does not park the run: listed, and the next one runs.
    let (c1, _) = requested(&sim.decide_commit());
    sim.result(&c1, "refunded 1", false);
    let end = sim.decide_commit();
    let Decision::RunCancelled(done) = &end[0].event else {
        panic!("run.cancelled expected, got {end:?}");
    };
    let status = |op: &OperationId| {
        summary(&done.operations, op)
            .compensation
            .as_ref()
            .map(|c| (c.status, c.detail.clone()))
    };
    assert_eq!(
        status(&sim.op(3, 0)),
        Some((
            CompensationStatus::Failed,
            "refund refused: card expired".into()
        ))
    );
    assert_eq!(
        status(&sim.op(2, 0)).map(|s| s.0),
        Some(CompensationStatus::Ambiguous)
    );
    assert_eq!(
        status(&sim.op(1, 0)).map(|s| s.0),
        Some(CompensationStatus::Compensated)
    );
    assert_eq!(sim.state().status, RunStatus::Cancelled);
    sim.replays();
}

#[test]
fn policy_none_ends_as_before_and_undeclared_agents_journal_what_they_always_did() {
    // Declared levels, no compensation: the end is immediate and lists the levels.
    let def = definition("none", "none", true);
    let mut sim = Sim::new(&def, Budget::default());
    sim.shop();
    sim.cancel();
    let end = sim.decide_commit();
    assert!(matches!(end[0].event, Decision::RunCancelling(_)));
    let Decision::RunCancelled(done) = &end[1].event else {
        panic!("run.cancelled at once expected, got {end:?}");
    };
    let pay = summary(&done.operations, &sim.op(1, 0));
    assert_eq!(
        (pay.level, &pay.compensation),
        (Some(Level::Compensable), &None)
    );
    sim.replays();

    // No declaration at all (every agent before this feature): the same events, byte for byte,
    // as before: no level, no compensation, no reversibility on the requests.
    let def = definition("compensate", "compensate", false);
    let mut sim = Sim::new(&def, Budget::default());
    sim.shop();
    for (_, env) in &sim.events {
        let v = serde_json::to_value(env).expect("json");
        assert!(v["data"].get("reversibility").is_none(), "{v}");
    }
    sim.cancel();
    let end = sim.decide_commit();
    let Decision::RunCancelled(done) = &end[1].event else {
        panic!("run.cancelled at once expected, got {end:?}");
    };
    let v = serde_json::to_value(done).expect("json");
    assert_eq!(
        v["operations"][0],
        json!({"op": sim.op(1, 0), "fate": "completed"}),
        "{v}"
    );
    sim.replays();
}

#[test]
fn forged_compensations_are_ignored_or_refused() {
    let def = definition("compensate", "none", true);
    let mut sim = Sim::new(&def, Budget::default());
    sim.shop();
    let pay2 = sim.op(2, 0);
    let c2 = pay2.compensation_of().expect("an id");
    // A result for a compensation nobody requested: ignored (anyone may append inputs).
    let ignored = sim.state().ignored_inputs;
    sim.result(&c2, "refunded everything", false);
    assert_eq!(sim.state().ignored_inputs, ignored + 1);
    assert!(!sim.state().ops.contains_key(&c2));
    // A decision requesting a compensation outside a compensation (only the writer journals
    // decisions; one that did this would be refused by every fold).
    let forged = |compensates: Option<OperationId>, op: OperationId| {
        let mut d = Draft::new(Event::ToolRequested(ToolRequested {
            call_id: "x".into(),
            tool: "refund".into(),
            arguments: json!({}),
            args_digest: Digest::of_json(&json!({})),
            redispatch: 0,
            expect_version: None,
            limits: kedge_core::tools::RunLimits::default(),
            reversibility: None,
            compensates,
        }));
        d.op = Some(op);
        d.step = Some(StepNo(2));
        d
    };
    for draft in [
        forged(Some(pay2.clone()), c2.clone()),
        forged(None, c2.clone()),
        forged(Some(pay2.clone()), sim.op(2, 5)),
    ] {
        let mut events = sim.events.clone();
        events.push((
            sim.seq + 1,
            Envelope::new(sim.run.clone(), Timestamp::now(), draft),
        ));
        let folded = fold(events.iter().map(|(s, e)| (*s, e)));
        assert!(folded.is_err(), "{folded:?}");
    }
    // The real compensation still runs, and its real result counts.
    sim.cancel();
    sim.decide_commit();
    let (c, _) = requested(&sim.decide_commit());
    assert_eq!(c, c2);
    sim.result(&c2, "refunded 7", false);
    let comp = kedge_core::compensation::outcome_of(&sim.state(), &pay2).expect("settled");
    assert_eq!(comp.detail, "refunded 7");
    sim.replays();
}

#[test]
fn a_cancel_during_a_model_call_compensates_after_the_step_is_recorded() {
    let def = definition("compensate", "none", true);
    let mut sim = Sim::new(&def, Budget::default());
    sim.step(&[("pay", json!({"amount": 5}))]);
    sim.result(&sim.op(1, 0), "paid 5", false);
    let Next::Step(plan) = decide(&sim.state()) else {
        panic!("a step expected");
    };
    sim.commit(plan.start.clone());
    sim.cancel();
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        ModelResponse {
            message: AssistantMessage {
                text: String::new(),
                tool_calls: vec![ToolCall {
                    call_id: "late".into(),
                    name: "pay".into(),
                    arguments: json!({"amount": 100}),
                }],
                thinking: Vec::new(),
            },
            usage: Usage::default(),
            finish: FinishReason::ToolCalls,
        },
        false,
        Timestamp::now(),
        &sim.contract,
    );
    let kinds: Vec<_> = drafts.iter().map(|d| d.event.event_type()).collect();
    assert_eq!(
        kinds.iter().map(|k| k.as_str()).collect::<Vec<_>>(),
        ["step.completed", "run.cancelling", "run.compensating"]
    );
    sim.commit(drafts);
    let (c, _) = requested(&sim.decide_commit());
    assert_eq!(c.compensated(), Some(sim.op(1, 0)));
    sim.result(&c, "refunded 5", false);
    sim.decide_commit();
    assert_eq!(sim.state().status, RunStatus::Cancelled);
    sim.replays();
}

#[test]
fn definitions_are_checked_naming_the_field() {
    let base = || {
        json!({
            "name": "shop", "system_prompt": "x",
            "model": {"provider": "openai", "name": "m"},
            "tools": [{"name": "pay"}, {"name": "refund"}, "ask_user"],
        })
    };
    for (policy, field) in [
        (
            json!({"pay": {"reversibility": "compensable"}}),
            "policy.pay.compensate",
        ),
        (
            json!({"pay": {"reversibility": "compensable", "compensate": {"tool": "nope"}}}),
            "policy.pay.compensate.tool",
        ),
        (
            json!({"pay": {"reversibility": "compensable", "compensate": {"tool": "ask_user"}}}),
            "policy.pay.compensate.tool",
        ),
        (
            json!({"pay": {"reversibility": "compensable", "compensate": {"tool": "refund"}},
                   "refund": {"approval": "always"}}),
            "policy.pay.compensate.tool",
        ),
        (
            json!({"pay": {"reversibility": "compensable",
                           "compensate": {"tool": "refund", "arguments": {"a": "${argument.x}"}}}}),
            "policy.pay.compensate.arguments",
        ),
        (
            json!({"pay": {"reversibility": "irreversible", "compensate": {"tool": "refund"}}}),
            "policy.pay.compensate",
        ),
        (
            json!({"pay": {"reversibility": "undeclared"}}),
            "policy.pay.reversibility",
        ),
    ] {
        let mut v = base();
        v["policy"] = policy;
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(field);
        assert_eq!(e.field, field, "{e}");
    }
    let mut v = base();
    v["on_cancel"] = json!("rollback");
    assert!(AgentDefinition::parse(v.to_string().as_bytes()).is_err());
    // A tool compensated by itself, or two compensating each other: fine (a compensation is
    // never compensated, so no chain can loop).
    v["on_cancel"] = json!("compensate");
    v["policy"] = json!({
        "pay": {"reversibility": "compensable", "compensate": {"tool": "refund"}},
        "refund": {"reversibility": "compensable", "compensate": {"tool": "pay"}}
    });
    let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
    let stored = serde_json::to_vec(&d).expect("json");
    assert_eq!(AgentDefinition::parse(&stored).expect("reads back"), d);
}

#[test]
fn a_revived_turn_compensates_its_own_effects_only() {
    let def = definition("none", "compensate", true);
    let budget = Budget {
        max_steps: 3,
        ..Budget::default()
    };
    let mut sim = Sim::new(&def, budget);
    sim.step(&[("pay", json!({"amount": 5}))]);
    sim.result(&sim.op(1, 0), "paid 5", false);
    // Three steps of a budget of three: the fourth fails the run, through its compensation.
    sim.step(&[("pay", json!({"amount": 6}))]);
    sim.result(&sim.op(2, 0), "paid 6", false);
    sim.step(&[("read_file", json!({"path": "a"}))]);
    sim.result(&sim.op(3, 0), "text", false);
    let start = sim.decide_commit();
    assert!(matches!(start[0].event, Decision::RunCompensating(_)));
    for _ in 0..2 {
        let (c, _) = requested(&sim.decide_commit());
        sim.result(&c, "refunded", false);
    }
    sim.decide_commit();
    assert_eq!(sim.state().status, RunStatus::Failed);
    // A new message revives it; the budget fails the new turn at once: nothing of it to
    // compensate, and the last turn's effects are not compensated twice.
    sim.push(Draft::new(Event::UserMessage(
        kedge_core::event::UserMessage {
            text: "again".into(),
        },
    )));
    let again = sim.decide_commit();
    let kinds: Vec<_> = again
        .iter()
        .map(|d| d.event.event_type().as_str())
        .collect();
    assert_eq!(kinds, ["run.revived", "run.failed"]);
    let state = sim.state();
    assert_eq!(state.status, RunStatus::Failed);
    assert_eq!(state.compensation, None);
    assert_eq!(state.turn_first_step, StepNo(4));
    sim.replays();
}

/// docs/CONFIG.md's compensation example, added to a minimal agent, is accepted by the agent
/// schema and by the definition's rules.
#[test]
fn the_config_doc_compensation_example_is_accepted() {
    let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
    let doc = std::fs::read_to_string(format!("{root}/docs/CONFIG.md")).expect("CONFIG.md");
    let section = doc
        .split("### Compensation")
        .nth(1)
        .expect("a compensation section");
    let fragment = section
        .split("```json\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a JSON example");
    let fields: serde_json::Value =
        serde_json::from_str(&format!("{{{fragment}}}")).expect("JSON fields");
    let mut def = json!({"name": "doc", "system_prompt": "Shop.",
                         "model": {"provider": "openai", "name": "gpt-4.1"}});
    for (k, v) in fields.as_object().expect("fields") {
        def[k] = v.clone();
    }
    let schema: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(format!("{root}/schemas/agent.schema.json")).expect("schema"),
    )
    .expect("json");
    let validator = jsonschema::validator_for(&schema).expect("a valid schema");
    let errors: Vec<String> = validator.iter_errors(&def).map(|e| e.to_string()).collect();
    assert!(errors.is_empty(), "{errors:?}");
    let d = AgentDefinition::parse(def.to_string().as_bytes()).expect("accepted");
    let r = Contract::of(&d)
        .reversibility("pay__charge")
        .expect("declared");
    assert_eq!(r.compensate_on, [StopCause::Cancel]);
    assert_eq!(r.compensate.expect("compensable").tool, "pay__refund");
}
