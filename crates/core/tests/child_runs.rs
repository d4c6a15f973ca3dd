//! Child runs (`run_agent`) through `fold` and `decide` alone: the link a step
//! journals, the verdicts on hostile calls, the child's bundle and budget, the result a child
//! gives its parent, and a cancel that waits for the children.

use kedge_core::agent::AgentDefinition;
use kedge_core::child::{self, MAX_DEPTH, Plan, RUN_AGENT_TOOL};
use kedge_core::decide::{Idle, ModelResponse, Next, complete_step, decide, finish_step};
use kedge_core::event::{
    AssistantMessage, Budget, CancelRequested, Decision, Draft, Envelope, Event, FailureReason,
    FinishReason, OpFate, OutputValidation, ParentLink, RunCreated, RunFailed, RunSucceeded,
    Timestamp, ToolCall, ToolResult, Usage,
};
use kedge_core::fold::{ChatMessage, FoldError, RunState, fold};
use kedge_core::ids::{AgentName, OperationId, RunId, StepNo};
use kedge_core::machine::RunStatus;
use kedge_core::tools::Contract;
use serde_json::json;

fn name(s: &str) -> AgentName {
    s.parse().expect("agent name")
}

fn bundle(agent: &str, budget: Budget, parent: Option<ParentLink>) -> RunCreated {
    RunCreated {
        budget,
        traceparent: Some("00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01".into()),
        parent,
        ..kedge_core::fixtures::run_created(agent, "plan a voyage")
    }
}

/// An in-memory journal of one run.
struct Sim {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    seq: u64,
}

impl Sim {
    fn new(created: RunCreated) -> Sim {
        let mut sim = Sim {
            run: "run_parent".parse().expect("run id"),
            events: Vec::new(),
            seq: 0,
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

    fn try_state(&self) -> Result<RunState, FoldError> {
        fold(self.events.iter().map(|(s, e)| (*s, e)))
    }

    fn state(&self) -> RunState {
        self.try_state().expect("journal folds")
    }

    fn commit(&mut self, drafts: Vec<Draft<impl Into<Event>>>) {
        for d in drafts {
            self.push(d);
        }
        self.state();
    }

    /// Runs the next step, answered with `response`; returns the step's decision group.
    fn step(&mut self, response: ModelResponse, contract: &Contract) -> Vec<Draft<Decision>> {
        let Next::Step(plan) = decide(&self.state()) else {
            panic!("a step expected, got {:?}", decide(&self.state()))
        };
        self.commit(plan.start.clone());
        let drafts = complete_step(
            &self.state(),
            plan.step,
            plan.attempt,
            plan.request_id.clone(),
            response,
            false,
            Timestamp::now(),
            contract,
        );
        self.commit(drafts.clone());
        drafts
    }

    fn result(&mut self, op: &OperationId, result: ToolResult) {
        self.push(Draft::new(Event::ToolResult(result)).op(op.clone()));
    }
}

fn call_agent(agent: &str, input: &str) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: String::new(),
            tool_calls: vec![ToolCall {
                call_id: "call_1".into(),
                name: RUN_AGENT_TOOL.into(),
                arguments: json!({"agent": agent, "input": input}),
            }],
            thinking: Vec::new(),
        },
        usage: Usage {
            input_tokens: 100,
            output_tokens: 20,
            cost: None,
        },
        finish: FinishReason::ToolCalls,
    }
}

fn answer(text: &str) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: text.into(),
            tool_calls: Vec::new(),
            thinking: Vec::new(),
        },
        usage: Usage::default(),
        finish: FinishReason::Stop,
    }
}

/// The definition of `name` that may start `agents`.
fn definition(agent: &str, agents: &[&str]) -> AgentDefinition {
    let mut tools = vec![json!("read_file")];
    if !agents.is_empty() {
        tools.push(json!({"name": "run_agent", "agents": agents}));
    }
    let v = json!({
        "name": agent,
        "system_prompt": "p",
        "model": {"provider": "openai", "name": "mock"},
        "tools": tools,
    });
    AgentDefinition::parse(v.to_string().as_bytes()).expect("valid definition")
}

fn contract_of(agent: &str, agents: &[&str]) -> std::sync::Arc<Contract> {
    Contract::of(&definition(agent, agents))
}

fn types(drafts: &[Draft<Decision>]) -> Vec<&'static str> {
    drafts
        .iter()
        .map(|d| d.event.event_type().as_str())
        .collect()
}

fn op1(sim: &Sim) -> OperationId {
    OperationId::new(&sim.run, StepNo(1), 0)
}

#[test]
fn a_run_agent_call_links_the_derived_child_and_its_result_is_the_tool_result() {
    let contract = contract_of("captain", &["navigator"]);
    let mut sim = Sim::new(bundle("captain", Budget::default(), None));
    let group = sim.step(call_agent("navigator", "chart the tides"), &contract);
    assert_eq!(
        types(&group),
        vec![
            "step.completed",
            "run.gated",
            "tool.requested",
            "child.started"
        ]
    );
    assert_eq!(sim.state().status, RunStatus::WaitingTool);
    let op = op1(&sim);
    let child = RunId::for_child(&op);
    let Decision::ChildStarted(started) = &group[3].event else {
        unreachable!()
    };
    assert_eq!(
        (&started.child, started.agent.as_str()),
        (&child, "navigator")
    );
    assert_eq!(group[3].op.as_ref(), Some(&op));
    let state = sim.state();
    assert_eq!(state.status, RunStatus::WaitingTool);
    assert_eq!(state.children.get(&op), Some(&child));
    // Waits holding nothing: no step until the child's result arrives.
    assert_eq!(
        decide(&state),
        Next::Idle(Idle::WaitingTools { missing: 1 })
    );
    // The child's answer is the operation's result; a second one (a redelivery beyond the
    // duplicate window, a revived child) is ignored.
    let first = ToolResult {
        content: "High tide at noon.".into(),
        is_error: false,
        stopped: false,
    };
    sim.result(&op, first.clone());
    sim.result(
        &op,
        ToolResult {
            content: "another answer".into(),
            ..first
        },
    );
    let state = sim.state();
    assert_eq!(state.ignored_inputs, 1);
    let Next::Step(plan) = decide(&state) else {
        panic!("the parent wakes")
    };
    assert!(plan.context.iter().any(|m| matches!(m,
        ChatMessage::Tool { call_id, content, is_error: false } if call_id == "call_1" && content == "High tide at noon.")));
    sim.commit(plan.start.clone());
    let drafts = complete_step(
        &sim.state(),
        plan.step,
        plan.attempt,
        plan.request_id.clone(),
        answer("Sail at noon."),
        false,
        Timestamp::now(),
        &contract,
    );
    sim.commit(drafts);
    assert_eq!(sim.state().status, RunStatus::Succeeded);
}

#[test]
fn the_child_id_is_derived_from_the_operation_alone() {
    let run: RunId = "run_parent".parse().expect("run id");
    let a = RunId::for_child(&OperationId::new(&run, StepNo(1), 0));
    assert_eq!(a, RunId::for_child(&OperationId::new(&run, StepNo(1), 0)));
    assert_ne!(a, RunId::for_child(&OperationId::new(&run, StepNo(1), 1)));
    assert_ne!(a, RunId::for_child(&OperationId::new(&run, StepNo(2), 0)));
    // Valid and of fixed length whatever the parent's id.
    let long: RunId = format!("run_{}", "x".repeat(64)).parse().expect("run id");
    let b = RunId::for_child(&OperationId::new(&long, StepNo(u32::MAX), u32::MAX));
    assert_eq!(b.as_str().len(), a.as_str().len());
    assert_eq!(b.as_str().parse::<RunId>(), Ok(b.clone()));
    assert!(a.as_str().starts_with("run_ch"));
}

#[test]
fn a_group_cut_short_after_any_decision_is_finished_with_the_same_link() {
    let contract = contract_of("captain", &["navigator"]);
    let mut whole = Sim::new(bundle("captain", Budget::default(), None));
    let group = whole.step(call_agent("navigator", "chart"), &contract);
    for landed in 1..group.len() {
        let mut sim = Sim::new(bundle("captain", Budget::default(), None));
        let Next::Step(plan) = decide(&sim.state()) else {
            panic!("step")
        };
        sim.commit(plan.start.clone());
        sim.commit(group[..landed].to_vec());
        let Next::Finish(cut) = decide(&sim.state()) else {
            panic!("finish expected after {landed}")
        };
        let rest = finish_step(&sim.state(), &cut, Timestamp::now(), &contract);
        assert_eq!(types(&rest), types(&group[landed..]), "after {landed}");
        sim.commit(rest);
        assert_eq!(sim.state().children, whole.state().children);
    }
}

#[test]
fn a_link_to_another_run_or_a_non_run_agent_operation_does_not_fold() {
    let contract = contract_of("captain", &["navigator"]);
    let mut sim = Sim::new(bundle("captain", Budget::default(), None));
    sim.step(call_agent("navigator", "chart"), &contract);
    let op = op1(&sim);
    let forged = |child: RunId, op: OperationId| {
        Draft::new(Decision::ChildStarted(kedge_core::event::ChildStarted {
            child,
            agent: name("navigator"),
        }))
        .op(op)
    };
    // `run.waiting` ended the group; a link needs `running`, so fold a fresh step first.
    for (child, op) in [
        ("run_elsewhere".parse().expect("id"), op.clone()),
        (
            RunId::for_child(&OperationId::new(&sim.run, StepNo(9), 0)),
            OperationId::new(&sim.run, StepNo(9), 0),
        ),
    ] {
        let mut s = Sim::new(bundle("captain", Budget::default(), None));
        let Next::Step(plan) = decide(&s.state()) else {
            panic!("step")
        };
        s.commit(plan.start.clone());
        let mut group = complete_step(
            &s.state(),
            plan.step,
            plan.attempt,
            plan.request_id.clone(),
            call_agent("navigator", "chart"),
            false,
            Timestamp::now(),
            &contract,
        );
        group[3] = forged(child, op);
        for d in group {
            s.push(d);
        }
        assert!(
            matches!(s.try_state(), Err(FoldError::Inconsistent { .. })),
            "{:?}",
            s.try_state()
        );
    }
}

#[test]
fn hostile_calls_start_no_child() {
    let contract = contract_of("captain", &["navigator"]);
    // Not an allowed agent, or garbage input: refused by the tool's schema (the enum), never
    // dispatched; the model reads the refusal.
    for args in [
        json!({"agent": "captain", "input": "again"}),
        json!({"agent": "stranger", "input": "x"}),
        json!({"agent": "navigator"}),
        json!({"agent": "navigator", "input": 42}),
        json!({"agent": "navigator", "input": "x", "budget": 1}),
        json!("navigator"),
    ] {
        let call = ToolCall {
            call_id: "c".into(),
            name: RUN_AGENT_TOOL.into(),
            arguments: args.clone(),
        };
        assert!(contract.check(&call).is_err(), "{args}");
        let mut sim = Sim::new(bundle("captain", Budget::default(), None));
        let mut r = call_agent("navigator", "x");
        r.message.tool_calls[0].arguments = args.clone();
        let group = sim.step(r, &contract);
        assert_eq!(types(&group), vec!["step.completed", "run.gated"], "{args}");
        assert_eq!(sim.state().status, RunStatus::WaitingTool);
        assert!(sim.state().children.is_empty());
    }

    // Recursion: an agent that is running above may not be started below, however the
    // definition allows it.
    let ancestors = vec![name("admiral"), name("captain")];
    let link = ParentLink {
        run_id: "run_grand".parse().expect("id"),
        op: OperationId::new(&"run_grand".parse().expect("id"), StepNo(1), 0),
        ancestors: ancestors.clone(),
    };
    let loose = contract_of("navigator", &["admiral", "captain", "navigator", "pilot"]);
    for agent in ["admiral", "captain", "navigator"] {
        let mut sim = Sim::new(bundle("navigator", Budget::default(), Some(link.clone())));
        let group = sim.step(call_agent(agent, "x"), &loose);
        assert_eq!(
            types(&group),
            vec!["step.completed", "run.gated", "tool.requested"],
            "{agent}"
        );
        let state = sim.state();
        assert!(state.children.is_empty());
        let op = op1(&sim);
        let Plan::Refuse(why) = child::plan(&state, &op, &state.ops[&op].call) else {
            panic!("refused")
        };
        assert!(why.contains("may not start itself"), "{why}");
    }
    let mut sim = Sim::new(bundle("navigator", Budget::default(), Some(link.clone())));
    let group = sim.step(call_agent("pilot", "x"), &loose);
    assert!(types(&group).contains(&"child.started"));

    // Depth: a run MAX_DEPTH deep starts no child.
    let deep: Vec<AgentName> = (0..MAX_DEPTH).map(|i| name(&format!("a{i}"))).collect();
    let link = ParentLink {
        ancestors: deep,
        ..link
    };
    let mut sim = Sim::new(bundle("navigator", Budget::default(), Some(link)));
    let group = sim.step(call_agent("pilot", "x"), &loose);
    assert!(!types(&group).contains(&"child.started"));
    let state = sim.state();
    let op = op1(&sim);
    let Plan::Refuse(why) = child::plan(&state, &op, &state.ops[&op].call) else {
        panic!("refused")
    };
    assert!(why.contains(&format!("at most {MAX_DEPTH} deep")), "{why}");
    // One level less is allowed.
    let shallower: Vec<AgentName> = (0..MAX_DEPTH - 1).map(|i| name(&format!("a{i}"))).collect();
    let mut sim = Sim::new(bundle(
        "navigator",
        Budget::default(),
        Some(ParentLink {
            run_id: "run_grand".parse().expect("id"),
            op: OperationId::new(&"run_grand".parse().expect("id"), StepNo(1), 0),
            ancestors: shallower,
        }),
    ));
    let group = sim.step(call_agent("pilot", "x"), &loose);
    assert!(types(&group).contains(&"child.started"));
}

#[test]
fn a_cancel_waits_for_the_children_and_lists_them_stopped() {
    let contract = contract_of("captain", &["navigator"]);
    let mut sim = Sim::new(bundle("captain", Budget::default(), None));
    sim.step(call_agent("navigator", "chart"), &contract);
    sim.push(Draft::new(Event::CancelRequested(CancelRequested {
        reason: "enough".into(),
        by: None,
    })));
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancelling")
    };
    assert_eq!(
        types(&d),
        vec!["run.cancelling"],
        "a child runs: not cancelled yet"
    );
    sim.commit(d);
    assert_eq!(
        decide(&sim.state()),
        Next::Idle(Idle::Stopping { running: 1 })
    );
    // The child, asked to cancel, ends and says so.
    let op = op1(&sim);
    sim.result(
        &op,
        ToolResult {
            content: "child run was cancelled".into(),
            is_error: true,
            stopped: true,
        },
    );
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancelled")
    };
    let Decision::RunCancelled(c) = &d[0].event else {
        panic!("cancelled expected: {d:?}")
    };
    assert_eq!(c.operations.len(), 1);
    assert_eq!(
        (&c.operations[0].op, c.operations[0].fate),
        (&op, OpFate::Stopped)
    );
    sim.commit(d);
    assert_eq!(sim.state().status, RunStatus::Cancelled);

    // A refused run_agent call (no child) does not hold a cancel up.
    let loose = contract_of("captain", &["captain"]);
    let mut sim = Sim::new(bundle("captain", Budget::default(), None));
    sim.step(call_agent("captain", "me again"), &loose);
    sim.push(Draft::new(Event::CancelRequested(CancelRequested {
        reason: "enough".into(),
        by: None,
    })));
    let Next::Commit(d) = decide(&sim.state()) else {
        panic!("cancel")
    };
    assert_eq!(types(&d), vec!["run.cancelling", "run.cancelled"]);
}

fn parent_state(budget: Budget, priced: bool) -> RunState {
    let mut created = bundle("captain", budget, None);
    if priced {
        created.model.price = Some(kedge_core::event::Price {
            input_per_mtok: 1.0,
            output_per_mtok: 1.0,
            currency: "EUR".into(),
        });
    }
    let sim = Sim::new(created);
    sim.state()
}

#[test]
fn a_childs_budget_is_the_tighter_of_its_own_and_what_the_parent_has_left() {
    let own = Budget {
        max_steps: 30,
        max_tokens: 500_000,
        max_attempts_per_step: 5,
        deadline_secs: Some(7200),
        max_cost: None,
    };
    let mut parent = parent_state(
        Budget {
            max_steps: 10,
            max_tokens: 1_000,
            max_attempts_per_step: 2,
            deadline_secs: Some(3600),
            max_cost: None,
        },
        false,
    );
    parent.step = StepNo(4);
    parent.usage.input_tokens = 600;
    let model = parent.bundle.model.clone();
    let now = parent
        .created_at
        .saturating_add(std::time::Duration::from_secs(600));
    let b = child::budget(&parent, &own, &model, now).expect("a budget");
    assert_eq!(b.max_steps, 6);
    assert_eq!(b.max_tokens, 400);
    assert_eq!(b.max_attempts_per_step, 2);
    assert_eq!(b.deadline_secs, Some(3000));
    assert_eq!(b.max_cost, None);
    // Looser parents leave the child's own limits.
    let roomy = parent_state(Budget::default(), false);
    let tight = Budget {
        max_steps: 3,
        max_tokens: 50,
        max_attempts_per_step: 1,
        deadline_secs: Some(5),
        max_cost: None,
    };
    assert_eq!(
        child::budget(&roomy, &tight, &model, roomy.created_at),
        Ok(tight.clone())
    );
    // Nothing left: refused.
    let mut spent = parent.clone();
    spent.step = StepNo(10);
    assert!(child::budget(&spent, &own, &model, now).is_err());
    let mut spent = parent.clone();
    spent.usage.output_tokens = 400;
    assert!(child::budget(&spent, &own, &model, now).is_err());
    let late = parent
        .created_at
        .saturating_add(std::time::Duration::from_secs(3600));
    assert!(child::budget(&parent, &own, &model, late).is_err());
    // A cost limit carries over only where it can be counted: same currency, priced model.
    let mut costly = parent_state(
        Budget {
            max_cost: Some(2.0),
            ..Budget::default()
        },
        true,
    );
    costly.usage.cost = Some(0.5);
    let priced = costly.bundle.model.clone();
    let b = child::budget(&costly, &Budget::default(), &priced, now).expect("a budget");
    assert_eq!(b.max_cost, Some(1.5));
    let b = child::budget(
        &costly,
        &Budget {
            max_cost: Some(1.0),
            ..Budget::default()
        },
        &priced,
        now,
    )
    .expect("a budget");
    assert_eq!(b.max_cost, Some(1.0));
    let why = child::budget(&costly, &Budget::default(), &model, now).expect_err("no price");
    assert!(why.contains("no price"), "{why}");
    let mut dollars = priced.clone();
    if let Some(p) = &mut dollars.price {
        p.currency = "USD".into();
    }
    assert!(child::budget(&costly, &Budget::default(), &dollars, now).is_err());
    costly.usage.cost = Some(2.0);
    assert!(child::budget(&costly, &Budget::default(), &priced, now).is_err());
}

#[test]
fn the_childs_bundle_is_in_the_parents_tenant_and_trace_and_links_back() {
    let parent = parent_state(Budget::default(), false);
    let op = OperationId::new(&parent.run_id, StepNo(1), 0);
    let def = definition("navigator", &[]);
    let created = child::created(
        &parent,
        &op,
        7,
        &def,
        "chart the tides".into(),
        parent.created_at,
    )
    .expect("created");
    assert_eq!(created.agent.as_str(), "navigator");
    assert_eq!(created.agent_revision, 7);
    assert_eq!(created.agent_digest, def.digest());
    assert_eq!(created.tools_digest, def.tools_digest());
    assert_eq!(created.tenant, parent.bundle.tenant);
    assert_eq!(created.traceparent, parent.bundle.traceparent);
    assert_eq!(created.input, "chart the tides");
    assert_eq!(created.idempotency_key, None);
    let link = created.parent.clone().expect("a parent link");
    assert_eq!((&link.run_id, &link.op), (&parent.run_id, &op));
    assert_eq!(link.ancestors, vec![name("captain")]);
    assert!(child::is_child_of(&created, &parent.run_id, &op));
    assert!(!child::is_child_of(
        &created,
        &parent.run_id,
        &OperationId::new(&parent.run_id, StepNo(1), 1)
    ));
    let mut orphan = created.clone();
    orphan.parent = None;
    assert!(!child::is_child_of(&orphan, &parent.run_id, &op));
    // An agent not shared with the parent's tenant does not exist to it.
    let mut private = def.clone();
    private.tenants = Some(vec!["globex".parse().expect("tenant")]);
    let why = child::created(&parent, &op, 7, &private, "x".into(), parent.created_at)
        .expect_err("refused");
    assert!(why.contains("no agent named `navigator`"), "{why}");
}

fn ended(status: &str) -> RunState {
    let mut sim = Sim::new(bundle("navigator", Budget::default(), None));
    sim.run = "run_child".parse().expect("id");
    sim.events.clear();
    sim.push(Draft::new(Event::RunCreated(Box::new(bundle(
        "navigator",
        Budget::default(),
        None,
    )))));
    match status {
        "valid" | "invalid" => {
            let Next::Step(plan) = decide(&sim.state()) else {
                panic!("step")
            };
            sim.commit(plan.start.clone());
            let mut drafts = complete_step(
                &sim.state(),
                plan.step,
                plan.attempt,
                plan.request_id.clone(),
                answer("{\"tide\": 12}"),
                false,
                Timestamp::now(),
                &Contract::default(),
            );
            if status == "invalid" {
                *drafts.last_mut().expect("terminal") =
                    Draft::new(Decision::RunSucceeded(RunSucceeded {
                        output: "{\"tide\": 12}".into(),
                        validation: OutputValidation::Invalid {
                            errors: vec!["at /tide: 12 is not of type \"string\"".into()],
                        },
                    }));
            }
            sim.commit(drafts);
        }
        "failed" => sim.commit(vec![Draft::new(Event::RunFailed(RunFailed {
            reason: FailureReason::MaxSteps,
            message: "the run used its 3 steps".into(),
            effects: Vec::new(),
        }))]),
        "cancelled" => {
            sim.push(Draft::new(Event::CancelRequested(CancelRequested {
                reason: "stop".into(),
                by: None,
            })));
            let Next::Commit(d) = decide(&sim.state()) else {
                panic!("cancel")
            };
            sim.commit(d);
        }
        _ => {}
    }
    sim.state()
}

#[test]
fn a_child_gives_its_answer_or_an_error_once_it_ended() {
    let r = child::result(&ended("valid")).expect("ended");
    assert_eq!(
        (r.content.as_str(), r.is_error, r.stopped),
        ("{\"tide\": 12}", false, false)
    );
    let r = child::result(&ended("invalid")).expect("ended");
    assert!(r.is_error && !r.stopped);
    assert!(
        r.content.contains("does not match its output_schema"),
        "{}",
        r.content
    );
    assert!(r.content.contains("at /tide:"), "{}", r.content);
    let r = child::result(&ended("failed")).expect("ended");
    assert!(r.is_error && !r.stopped);
    assert!(
        r.content
            .contains("failed (max_steps): the run used its 3 steps"),
        "{}",
        r.content
    );
    let r = child::result(&ended("cancelled")).expect("ended");
    assert!(r.is_error && r.stopped, "{r:?}");
    assert!(r.content.contains("was cancelled"));
    assert_eq!(child::result(&ended("queued")), None);
}

#[test]
fn run_agent_is_declared_with_the_agents_it_may_start() {
    let def = definition("captain", &["navigator", "pilot"]);
    let tool = def
        .tools
        .iter()
        .find(|t| t.name == RUN_AGENT_TOOL)
        .expect("run_agent");
    assert_eq!(
        child::allowed(tool),
        Some(vec![name("navigator"), name("pilot")])
    );
    assert_eq!(
        tool.parameters["properties"]["agent"]["enum"],
        json!(["navigator", "pilot"])
    );
    assert!(
        tool.description.contains("navigator, pilot"),
        "{}",
        tool.description
    );
    // The stored form (resolved parameters, no `agents`) reads back as the same definition.
    let stored = serde_json::to_vec(&def).expect("json");
    assert_eq!(AgentDefinition::parse(&stored).expect("parses"), def);

    let parse = |tools: serde_json::Value| {
        let v = json!({"name": "captain", "system_prompt": "p",
                       "model": {"provider": "openai", "name": "mock"}, "tools": tools});
        AgentDefinition::parse(v.to_string().as_bytes())
    };
    // Unknown fields are refused, naming them.
    let e = parse(json!([{"name": "run_agent", "agents": ["pilot"], "agent_list": []}]))
        .expect_err("refused");
    assert!(e.to_string().contains("agent_list"), "{e}");
    // `agents` belongs to run_agent alone.
    let e = parse(json!([{"name": "read_file", "agents": ["pilot"]}])).expect_err("refused");
    assert!(
        e.to_string()
            .contains("`agents` is only for the `run_agent` tool"),
        "{e}"
    );
    // run_agent must name its agents, and its parameters are Kedge's.
    let e = parse(json!(["run_agent"])).expect_err("refused");
    assert_eq!(e.field, "tools[0].agents", "{e}");
    let e = parse(json!([{"name": "run_agent", "parameters": {"type": "object"}}]))
        .expect_err("refused");
    assert_eq!(e.field, "tools[0].agents", "{e}");
    let e = parse(json!([{"name": "run_agent", "agents": []}])).expect_err("refused");
    assert!(e.to_string().contains("at least one agent"), "{e}");
    let e = parse(json!([{"name": "run_agent", "agents": ["pilot"],
                          "parameters": {"type": "object"}}]))
    .expect_err("refused");
    assert!(e.to_string().contains("parameters are Kedge's"), "{e}");
    let e = parse(json!([{"name": "run_agent", "agents": ["no.dots"]}])).expect_err("refused");
    assert!(e.to_string().contains("contains `.`"), "{e}");
}

#[test]
fn the_config_doc_child_runs_example_is_accepted() {
    let path = concat!(env!("CARGO_MANIFEST_DIR"), "/../../docs/CONFIG.md");
    let doc = std::fs::read_to_string(path).expect("docs/CONFIG.md");
    let section = doc
        .split("### Child runs (`run_agent`)")
        .nth(1)
        .expect("a child runs section");
    let block = section
        .split("```json\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a JSON example in the section");
    let def = AgentDefinition::parse(block.as_bytes()).expect("the example is accepted");
    let tool = def
        .tools
        .iter()
        .find(|t| t.name == RUN_AGENT_TOOL)
        .expect("run_agent");
    assert_eq!(
        child::allowed(tool),
        Some(vec![name("navigator"), name("quartermaster")])
    );
}
