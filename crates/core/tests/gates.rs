//! Version gates (Temporal's `patched()`): a change to the decision code takes its new branch
//! only in runs that journal its marker (`run.gated`), the first time they reach it live; a
//! journal without the marker keeps the old branch, in replay and when a new build continues
//! it. The first gate, `wait_from_step_group`: a step that requested tools journals no
//! `run.waiting`, and the fold derives the same status from the group.

use kedge_core::decide::{ModelResponse, Next, complete_step, complete_step_gated, decide};
use kedge_core::event::{
    AssistantMessage, Decision, Draft, Envelope, Event, EventType, FinishReason, Gate, RunGated,
    Timestamp, ToolCall, ToolResult, Usage, WaitReason,
};
use kedge_core::fold::{Gates, RunState, fold};
use kedge_core::ids::{OperationId, RunId};
use kedge_core::machine::RunStatus;
use kedge_core::tools::Contract;

const GATE: Gate = Gate::WaitFromStepGroup;

/// An in-memory journal.
#[derive(Clone)]
struct Journal {
    run: RunId,
    events: Vec<(u64, Envelope)>,
    seq: u64,
}

impl Journal {
    fn new() -> Journal {
        let run: RunId = "run_gates".parse().expect("valid");
        let created = kedge_core::fixtures::run_created("demo", "go");
        let mut j = Journal {
            run,
            events: Vec::new(),
            seq: 0,
        };
        j.push(Draft::new(Event::RunCreated(Box::new(created))));
        j
    }

    fn push(&mut self, draft: Draft<impl Into<Event>>) {
        self.seq += 2;
        let env = Envelope::new(self.run.clone(), Timestamp::now(), draft);
        self.events.push((self.seq, env));
    }

    fn commit(&mut self, drafts: Vec<Draft<impl Into<Event>>>) {
        for d in drafts {
            self.push(d);
        }
        self.state();
    }

    fn state(&self) -> RunState {
        fold(self.events.iter().map(|(s, e)| (*s, e))).expect("journal folds")
    }

    /// Starts the next step (committing its start) and returns the group that completes it
    /// with `response`, taking `take` anew (`None`: as the live writer, every gate).
    fn step(
        &mut self,
        response: ModelResponse,
        contract: &Contract,
        take: Option<Gates>,
    ) -> Vec<Draft<Decision>> {
        let Next::Step(plan) = decide(&self.state()) else {
            panic!("expected a step, got {:?}", decide(&self.state()))
        };
        self.commit(plan.start.clone());
        let state = self.state();
        match take {
            None => complete_step(
                &state,
                plan.step,
                plan.attempt,
                plan.request_id.clone(),
                response,
                false,
                Timestamp::now(),
                contract,
            ),
            Some(take) => complete_step_gated(
                &state,
                plan.step,
                plan.attempt,
                plan.request_id.clone(),
                response,
                false,
                Timestamp::now(),
                contract,
                take,
            ),
        }
    }

    /// Answers every operation of the run that has none.
    fn answer_all(&mut self) {
        let open: Vec<OperationId> = self
            .state()
            .unresolved_ops()
            .map(|o| o.op.clone())
            .collect();
        for op in open {
            let mut d = Draft::new(Event::ToolResult(ToolResult {
                content: "ok".into(),
                is_error: false,
                stopped: false,
            }));
            d.op = Some(op);
            self.push(d);
        }
    }

    fn count(&self, t: EventType) -> usize {
        self.events
            .iter()
            .filter(|(_, e)| e.event_type() == t)
            .count()
    }
}

fn types(drafts: &[Draft<Decision>]) -> Vec<&'static str> {
    drafts
        .iter()
        .map(|d| d.event.event_type().as_str())
        .collect()
}

fn calls(calls: &[(&str, serde_json::Value)]) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: String::new(),
            tool_calls: calls
                .iter()
                .enumerate()
                .map(|(i, (name, arguments))| ToolCall {
                    call_id: format!("c{i}"),
                    name: (*name).into(),
                    arguments: arguments.clone(),
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

fn answer(text: &str) -> ModelResponse {
    ModelResponse {
        message: AssistantMessage {
            text: text.into(),
            tool_calls: Vec::new(),
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

fn read(path: &str) -> (&'static str, serde_json::Value) {
    ("read_file", serde_json::json!({ "path": path }))
}

/// Any tool is allowed (no declared tools), `held` needs a person's approval.
fn contract() -> Contract {
    let policy = [(
        "held".to_owned(),
        kedge_core::agent::ToolPolicy {
            approval: kedge_core::agent::ApprovalRule::Always,
            ..Default::default()
        },
    )]
    .into();
    let declared: Vec<_> = ["read_file", "held", "ask_user", "wait", "await_callback"]
        .iter()
        .map(|n| kedge_core::agent::ToolSpec {
            name: (*n).into(),
            description: String::new(),
            parameters: serde_json::json!({"type": "object"}),
        })
        .collect();
    Contract::new(&declared, &policy)
}

fn replays(j: &Journal, contract: &Contract) -> kedge_core::replay::Checked {
    kedge_core::replay::check(&j.events, contract).unwrap_or_else(|e| panic!("replay: {e}"))
}

/// The steps of one run: three tool steps, then a final answer.
fn script() -> Vec<ModelResponse> {
    vec![
        calls(&[read("a"), read("b")]),
        calls(&[read("c")]),
        calls(&[read("d"), read("e"), read("f")]),
        answer("done"),
    ]
}

/// Runs `script` with the old branch everywhere (as the build before the gate did) or live.
fn run(live: bool) -> (Journal, Vec<RunStatus>) {
    let contract = contract();
    let mut j = Journal::new();
    let mut statuses = Vec::new();
    for response in script() {
        let take = if live { None } else { Some(Gates::NONE) };
        let group = j.step(response, &contract, take);
        j.commit(group);
        statuses.push(j.state().status);
        j.answer_all();
    }
    (j, statuses)
}

#[test]
fn an_old_journal_without_the_marker_replays_with_run_waiting() {
    let contract = contract();
    let (old, old_statuses) = run(false);
    assert_eq!(old.count(EventType::RunWaiting), 3);
    assert_eq!(old.count(EventType::RunGated), 0);
    assert_eq!(old.state().status, RunStatus::Succeeded);
    // This build decides the old branch at every group of it: the groups carry no marker.
    let checked = replays(&old, &contract);
    assert!(checked.groups >= 8, "{checked:?}");
    // Had it taken the new branch for them, replay would say so.
    let mut forged = old.clone();
    let at = forged
        .events
        .iter()
        .position(|(_, e)| e.event_type() == EventType::RunWaiting)
        .expect("a run.waiting");
    forged.events.remove(at);
    assert!(kedge_core::replay::check(&forged.events, &contract).is_err());
    // The recorded fixtures (older builds) keep replaying: the gate changed nothing for them.
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut with_waiting = 0;
    for entry in std::fs::read_dir(dir).expect("fixtures") {
        let path = entry.expect("entry").path();
        if path.extension().and_then(|e| e.to_str()) != Some("jsonl") {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("read");
        if text.contains("\"run.gated\"") {
            continue;
        }
        with_waiting += usize::from(text.contains("\"run.waiting\""));
    }
    assert!(with_waiting >= 10, "{with_waiting}");
    assert_eq!(
        old_statuses,
        [
            RunStatus::WaitingTool,
            RunStatus::WaitingTool,
            RunStatus::WaitingTool,
            RunStatus::Succeeded
        ]
    );
}

#[test]
fn a_new_run_journals_the_marker_once_and_no_run_waiting_with_the_same_statuses() {
    let contract = contract();
    let (new, new_statuses) = run(true);
    let (_, old_statuses) = run(false);
    assert_eq!(new.count(EventType::RunGated), 1);
    assert_eq!(new.count(EventType::RunWaiting), 0);
    assert_eq!(
        new_statuses, old_statuses,
        "the status is the same either way"
    );
    let state = new.state();
    assert!(state.gates.contains(GATE));
    assert_eq!(state.status, RunStatus::Succeeded);
    assert!(state.completing.is_none());
    // The marker is right after the first step group's `step.completed`, which counts it.
    let first = new
        .events
        .iter()
        .position(|(_, e)| e.event_type() == EventType::StepCompleted)
        .expect("step.completed");
    let (_, completed) = &new.events[first];
    let Event::StepCompleted(done) = &completed.event else {
        unreachable!()
    };
    assert_eq!(done.follows, Some(3), "the marker and two tool.requested");
    assert_eq!(new.events[first + 1].1.event_type(), EventType::RunGated);
    // Later groups count only their tools; the final answer's group ends as before.
    let counts: Vec<Option<u32>> = new
        .events
        .iter()
        .filter_map(|(_, e)| match &e.event {
            Event::StepCompleted(d) => Some(d.follows),
            _ => None,
        })
        .collect();
    assert_eq!(counts, [Some(3), Some(1), Some(3), None]);
    // Two messages fewer per step than the old shape minus the one marker.
    let (old, _) = run(false);
    assert_eq!(old.events.len() - new.events.len(), 3 - 1);
    replays(&new, &contract);
}

#[test]
fn an_old_run_continued_by_this_build_takes_the_new_branch_from_its_next_group() {
    let contract = contract();
    let mut j = Journal::new();
    // The build before the gate: one tool step with run.waiting.
    let group = j.step(calls(&[read("a")]), &contract, Some(Gates::NONE));
    assert_eq!(
        types(&group),
        ["step.completed", "tool.requested", "run.waiting"]
    );
    j.commit(group);
    j.answer_all();
    // This build, live: the marker with its first step group, once.
    for (i, response) in [calls(&[read("b")]), calls(&[read("c")])]
        .into_iter()
        .enumerate()
    {
        let group = j.step(response, &contract, None);
        let want: &[&str] = if i == 0 {
            &["step.completed", "run.gated", "tool.requested"]
        } else {
            &["step.completed", "tool.requested"]
        };
        assert_eq!(types(&group), want);
        j.commit(group);
        assert_eq!(j.state().status, RunStatus::WaitingTool);
        j.answer_all();
    }
    let group = j.step(answer("done"), &contract, None);
    j.commit(group);
    assert_eq!(j.state().status, RunStatus::Succeeded);
    // Replay takes the old branch for the first group (no marker) and the new one after.
    replays(&j, &contract);
}

#[test]
fn every_wait_reason_is_derived_as_run_waiting_named_it() {
    let contract = contract();
    let cases: Vec<(Vec<(&str, serde_json::Value)>, WaitReason)> = vec![
        (vec![read("a")], WaitReason::Tool),
        (
            vec![("ask_user", serde_json::json!({"question": "?"}))],
            WaitReason::User,
        ),
        (
            vec![(
                "ask_user",
                serde_json::json!({"question": "?", "timeout_seconds": 60}),
            )],
            WaitReason::User,
        ),
        (
            vec![("wait", serde_json::json!({"seconds": 60}))],
            WaitReason::External,
        ),
        (
            vec![("await_callback", serde_json::json!({}))],
            WaitReason::External,
        ),
        (vec![("held", serde_json::json!({}))], WaitReason::Approval),
        (
            vec![
                read("a"),
                ("wait", serde_json::json!({"seconds": 1})),
                ("ask_user", serde_json::json!({"question": "?"})),
            ],
            WaitReason::User,
        ),
        (
            vec![
                ("ask_user", serde_json::json!({"question": "?"})),
                ("held", serde_json::json!({})),
                read("b"),
            ],
            WaitReason::Approval,
        ),
        // Refused (not declared): nothing dispatched, the next step answers it.
        (
            vec![("undeclared", serde_json::json!({}))],
            WaitReason::Tool,
        ),
    ];
    for (call_list, on) in cases {
        let mut old = Journal::new();
        let group = old.step(calls(&call_list), &contract, Some(Gates::NONE));
        let Some(Decision::RunWaiting(w)) = group.last().map(|d| &d.event) else {
            panic!("old branch ends with run.waiting: {:?}", types(&group))
        };
        assert_eq!(w.on, on, "{call_list:?}");
        old.commit(group);
        let mut new = Journal::new();
        let group = new.step(calls(&call_list), &contract, None);
        if on == WaitReason::Tool {
            // Waiting on its tools alone: no run.waiting, the status derived from the group.
            assert!(!types(&group).contains(&"run.waiting"));
            assert_eq!(types(&group)[1], "run.gated");
            assert_eq!(new.state().settled_by(&group), Some(on), "{call_list:?}");
            assert_eq!(new.state().settled_by(&group[..group.len() - 1]), None);
        } else {
            // On a person, a timer or a callback: the explicit run.waiting stays (the
            // reconciler leaves such a run alone on its last event), and the gate is not taken.
            assert_eq!(types(&group).last(), Some(&"run.waiting"), "{call_list:?}");
            assert!(!types(&group).contains(&"run.gated"));
            assert_eq!(new.state().settled_by(&group), None);
        }
        new.commit(group);
        let (o, n) = (old.state(), new.state());
        assert_eq!(n.status, o.status, "{call_list:?}");
        assert_eq!(n.waiting_on(), Some(on), "{call_list:?}");
        let ops = |s: &RunState| {
            s.ops
                .values()
                .map(|o| (o.op.clone(), o.status.clone(), o.result.is_some()))
                .collect::<Vec<_>>()
        };
        assert_eq!(ops(&n), ops(&o));
        assert!(n.completing.is_none());
        assert_eq!(decide(&n), decide(&o), "{call_list:?}");
        replays(&old, &contract);
        replays(&new, &contract);
    }
}

#[test]
fn a_group_cut_short_is_finished_on_the_branch_its_writer_took() {
    use kedge_core::decide::finish_step;
    let contract = contract();
    let response = || calls(&[read("a"), read("b"), ("undeclared", serde_json::json!({}))]);
    for live in [true, false] {
        let take = if live { None } else { Some(Gates::NONE) };
        let mut whole = Journal::new();
        let group = whole.step(response(), &contract, take);
        let base = whole.clone();
        whole.commit(group.clone());
        let settled = whole.state();
        assert_eq!(settled.status, RunStatus::WaitingTool);
        // Cut after every decision but the last: the next writer (this build, live) finishes
        // the group as its writer began it.
        for landed in 1..group.len() {
            let mut cut = base.clone();
            cut.commit(group[..landed].to_vec());
            let state = cut.state();
            let Next::Finish(c) = decide(&state) else {
                panic!("a cut-short group is finished first ({landed})")
            };
            let rest = finish_step(&state, &c, Timestamp::now(), &contract);
            let settles = state.settled_by(&rest);
            assert_eq!(
                settles,
                live.then_some(WaitReason::Tool),
                "{live} after {landed}"
            );
            assert_eq!(
                types(&rest),
                types(&group[landed..]),
                "{live} after {landed}"
            );
            cut.commit(rest);
            let state = cut.state();
            assert_eq!(state.status, settled.status);
            assert_eq!(state.gates, settled.gates);
            replays(&cut, &contract);
        }
    }
}

#[test]
fn a_forged_or_duplicate_marker_is_harmless() {
    let contract = contract();
    let (new, _) = run(true);
    // A second marker of the same gate, journaled as a decision between groups (a writer bug, or
    // someone with the writer's credentials): the fold is unchanged but for the marker itself,
    // and the run goes on as before.
    let at = new
        .events
        .iter()
        .position(|(_, e)| e.event_type() == EventType::ToolResult)
        .expect("a result");
    let mut dup = new.clone();
    let marker = Envelope::new(
        dup.run.clone(),
        Timestamp::now(),
        Draft::new(Event::RunGated(RunGated { gate: GATE })),
    );
    dup.events
        .insert(at, (dup.events[at - 1].0 + 1, marker.clone()));
    let (a, b) = (new.state(), dup.state());
    assert_eq!(b.status, a.status);
    assert_eq!(b.gates, a.gates);
    assert_eq!(b.transcript, a.transcript);
    assert_eq!(b.ops, a.ops);
    // Cut both at the same point: the same next decision, and no second marker decided.
    let prefix =
        |j: &Journal, n: usize| fold(j.events[..n].iter().map(|(s, e)| (*s, e))).expect("folds");
    let (pa, pb) = (prefix(&new, at + 1), prefix(&dup, at + 2));
    assert_eq!(pb.status, pa.status);
    assert_eq!(decide(&pb), decide(&pa));
    // Replay reports it: the code never decides a marker twice.
    assert!(kedge_core::replay::check(&dup.events, &contract).is_err());

    // A marker forged into an old run (no group took the gate): statuses stay what the
    // journal's own groups say, and this build's next group takes the new branch without a
    // second marker.
    let mut old = Journal::new();
    let group = old.step(calls(&[read("a")]), &contract, Some(Gates::NONE));
    old.commit(group);
    let before = old.state();
    old.push(Draft::new(Event::RunGated(RunGated { gate: GATE })));
    let after = old.state();
    assert_eq!(after.status, before.status);
    assert!(after.gates.contains(GATE));
    old.answer_all();
    let group = old.step(calls(&[read("b")]), &contract, None);
    assert_eq!(types(&group), ["step.completed", "tool.requested"]);
    old.commit(group);
    assert_eq!(old.state().status, RunStatus::WaitingTool);
    // A marker on an input subject never reaches the fold: it is not an input.
    assert_eq!(
        EventType::RunGated.kind(),
        kedge_core::event::EventKind::Decision
    );
    // An unknown gate is not an event at all.
    let unknown = serde_json::json!({"gate": "from_the_future"});
    assert!(serde_json::from_value::<RunGated>(unknown).is_err());
}

#[test]
fn the_marker_is_in_the_table_and_changes_no_status() {
    use kedge_core::machine::apply;
    for s in RunStatus::ALL {
        let got = apply(Some(*s), EventType::RunGated, None);
        if s.is_terminal() {
            assert!(got.is_err(), "{s}");
        } else {
            assert_eq!(got, Ok(*s));
        }
    }
    assert_eq!(Gates::all().iter().collect::<Vec<_>>(), Gate::ALL);
    assert!(Gates::NONE.with(GATE).contains(GATE));
    assert!(!Gates::all().without(GATE).contains(GATE));
}
