//! Hostile input never panics the pure core: property tests over task parsing, agent
//! definitions, the journal envelope, `fold` and `decide`.
//!
//! Every property only asks for `Ok` or `Err` (a panic fails the test and proptest shrinks the
//! input); where something parses, the numbers in it must be within the documented ranges, so
//! parse + validate is the gate.

use std::sync::OnceLock;

use kedge_core::agent::{
    AgentDefinition, MAX_APPROVAL_TTL_SECS, MAX_ATTEMPTS_PER_STEP, MAX_DEADLINE_SECS,
    MAX_OUTPUT_TOKENS, MAX_STEPS, MAX_TOOL_TIMEOUT_SECS, valid_tool_name,
};
use kedge_core::decide::{ModelResponse, Next, complete_step, decide, finish_step};
use kedge_core::event::{
    ApprovalDecided, AssistantMessage, Budget, CallbackReceived, CancelRequested, Digest, Draft,
    Envelope, Event, FinishReason, ModelSpec, Nudge, OutcomeAmbiguous, OutcomeConfirmed,
    OutcomeNotFound, OutcomeResolved, QuestionAnswered, Resolution, RunCreated, TargetMoved,
    TimerFired, Timestamp, ToolCall, ToolResult, ToolStarted, Usage, UserMessage, Verdict,
};
use kedge_core::fold::{RunState, fold};
use kedge_core::ids::{
    ApprovalId, Attempt, CallbackKey, OperationId, QuestionId, RunId, StepNo, TimerId,
};
use kedge_core::task::{BudgetOverride, MAX_INPUT_BYTES, TaskSubmission};
use kedge_core::tools::Contract;
use proptest::prelude::*;
use proptest::sample::{Index, select};
use serde_json::{Map, Number, Value, json};

fn config() -> ProptestConfig {
    ProptestConfig {
        // `PROPTEST_CASES=20000` for a longer hunt; CI runs 256 per property (about 2 s).
        cases: std::env::var("PROPTEST_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(256),
        // A failure is kept in the test's output (and below as a regular test), not in files.
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

// ---------------------------------------------------------------------------------------------
// Arbitrary JSON.
// ---------------------------------------------------------------------------------------------

/// Numbers biased to the edges: the type limits, the documented range limits and just past them.
fn arb_number() -> impl Strategy<Value = Number> {
    let edges: Vec<u64> = vec![
        0,
        1,
        2,
        u64::from(u32::MAX),
        u64::from(u32::MAX) + 1,
        u64::MAX,
        u64::MAX - 1,
        i64::MAX as u64,
        i64::MAX as u64 + 1,
        u64::from(MAX_STEPS),
        u64::from(MAX_STEPS) + 1,
        u64::from(MAX_ATTEMPTS_PER_STEP),
        u64::from(MAX_ATTEMPTS_PER_STEP) + 1,
        MAX_DEADLINE_SECS,
        MAX_DEADLINE_SECS + 1,
        MAX_APPROVAL_TTL_SECS + 1,
        MAX_TOOL_TIMEOUT_SECS,
        MAX_TOOL_TIMEOUT_SECS + 1,
        MAX_OUTPUT_TOKENS,
        MAX_OUTPUT_TOKENS + 1,
    ];
    prop_oneof![
        3 => select(edges).prop_map(Number::from),
        2 => any::<u64>().prop_map(Number::from),
        2 => any::<i64>().prop_map(Number::from),
        1 => select(vec![i64::MIN, -1, -(i64::from(u32::MAX))]).prop_map(Number::from),
        2 => any::<f64>().prop_filter_map("finite", Number::from_f64),
        1 => select(vec![1e300, -1e300, 1.5, -0.0, f64::MAX, f64::MIN_POSITIVE, 1e19, 0.5])
            .prop_filter_map("finite", Number::from_f64),
    ]
}

/// Strings: short unicode, ids that name real things, whitespace, and long runs.
fn arb_string() -> impl Strategy<Value = String> {
    prop_oneof![
        4 => "\\PC{0,12}",
        2 => ".{0,8}",
        2 => select(vec![
            "", " ", "\n\t", "\u{0}", "\u{feff}", "é", "🦀", "demo", "read_file", "shell",
            "ask_user", "wait", "await_callback", "run_sim", "run_x1", "op_sim_1_0", "q_sim_1_0",
            "apr_sim_1_0_v0", "tmr_deadline_sim", "cbk_sim_1_0", "openai", "anthropic", "never",
            "always", "at_or_above_risk", "high", "object", "string", "sha256:",
        ])
        .prop_map(str::to_owned),
        1 => (any::<char>(), 0usize..3000).prop_map(|(c, n)| std::iter::repeat_n(c, n).collect()),
        1 => Just("x".repeat(MAX_INPUT_BYTES + 1)),
    ]
}

/// Object keys: the crate's real field names (so arbitrary objects collide with real fields)
/// and anything else.
fn arb_key() -> impl Strategy<Value = String> {
    prop_oneof![
        select(vec![
            "agent",
            "input",
            "run_id",
            "budget",
            "metadata",
            "max_steps",
            "max_tokens",
            "max_attempts_per_step",
            "deadline_secs",
            "name",
            "system_prompt",
            "model",
            "provider",
            "base_url",
            "tools",
            "policy",
            "parameters",
            "description",
            "type",
            "properties",
            "required",
            "approval",
            "risk",
            "approval_risk",
            "timeout_secs",
            "approval_ttl_secs",
            "max_output_tokens",
            "tenants",
            "api_key_env",
            "data",
            "digest",
            "at",
            "step",
            "attempt",
            "op",
            "$ref",
            "pattern",
            "items",
        ])
        .prop_map(str::to_owned),
        "\\PC{0,8}",
    ]
}

fn arb_json() -> impl Strategy<Value = Value> {
    let leaf = prop_oneof![
        1 => Just(Value::Null),
        1 => any::<bool>().prop_map(Value::Bool),
        3 => arb_number().prop_map(Value::Number),
        3 => arb_string().prop_map(Value::String),
    ];
    leaf.prop_recursive(5, 64, 8, |inner| {
        prop_oneof![
            prop::collection::vec(inner.clone(), 0..8).prop_map(Value::Array),
            prop::collection::vec((arb_key(), inner), 0..8)
                .prop_map(|kv| Value::Object(kv.into_iter().collect::<Map<_, _>>())),
        ]
    })
}

// ---------------------------------------------------------------------------------------------
// Valid documents and their mutations.
// ---------------------------------------------------------------------------------------------

fn valid_task() -> Value {
    json!({
        "agent": "demo",
        "input": "hi",
        "run_id": "run_x1",
        "budget": {"max_steps": 3, "max_tokens": 10, "max_attempts_per_step": 2, "deadline_secs": 60},
        "metadata": {"k": "v", "n": 1}
    })
}

fn valid_agent() -> Value {
    json!({
        "name": "demo",
        "system_prompt": "You are helpful.",
        "model": {"provider": "openai", "name": "mock-demo", "base_url": "http://127.0.0.1:1/v1"},
        "api_key_env": "OPENAI_API_KEY",
        "tools": [
            "shell",
            {"name": "read_file", "description": "Read a file",
             "parameters": {"type": "object", "properties": {"path": {"type": "string"}},
                            "required": ["path"]}},
            {"name": "time__now"}
        ],
        "policy": {
            "shell": {"approval": "at_or_above_risk", "risk": "high", "approval_risk": "medium",
                      "timeout_secs": 30, "approval_ttl_secs": 3600},
            "read_file": {"approval": "never"}
        },
        "budget": {"max_steps": 10, "max_tokens": 1000, "max_attempts_per_step": 3, "deadline_secs": 600},
        "max_output_tokens": 1024,
        "tenants": ["acme"],
        "output_schema": {"type": "object", "required": ["answer"],
                          "properties": {"answer": {"type": "string"}}},
        "on_invalid_output": "retry",
        "output_retries": 2
    })
}

fn agent_definition() -> AgentDefinition {
    AgentDefinition::parse(&to_bytes(&valid_agent())).expect("the valid agent parses")
}

/// Every journaled envelope of the fixtures, as `(seq, envelope JSON)`, one list per fixture.
fn fixture_journals() -> &'static [Vec<(u64, Value)>] {
    static JOURNALS: OnceLock<Vec<Vec<(u64, Value)>>> = OnceLock::new();
    JOURNALS.get_or_init(|| {
        [
            include_str!("fixtures/three-steps-parallel-tools.jsonl"),
            include_str!("fixtures/cancel-with-running-tool.jsonl"),
            include_str!("fixtures/output-rejected-then-valid.jsonl"),
        ]
        .iter()
        .map(|text| {
            text.lines()
                .filter(|l| !l.trim().is_empty())
                .map(|l| {
                    let line: Value = serde_json::from_str(l).expect("fixture line is JSON");
                    let seq = line["seq"].as_u64().expect("fixture seq");
                    (seq, line["event"].clone())
                })
                .collect()
        })
        .collect()
    })
}

fn fixture_envelopes() -> Vec<Value> {
    fixture_journals()
        .iter()
        .flatten()
        .map(|(_, v)| v.clone())
        .collect()
}

/// Where in a document a mutation applies: a key of an object or an index of an array.
#[derive(Debug, Clone)]
enum Seg {
    Key(String),
    Index(usize),
}

fn paths(v: &Value, prefix: &mut Vec<Seg>, out: &mut Vec<Vec<Seg>>) {
    out.push(prefix.clone());
    match v {
        Value::Object(o) => {
            for (k, child) in o {
                prefix.push(Seg::Key(k.clone()));
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        Value::Array(a) => {
            for (i, child) in a.iter().enumerate() {
                prefix.push(Seg::Index(i));
                paths(child, prefix, out);
                prefix.pop();
            }
        }
        _ => {}
    }
}

fn node_mut<'a>(v: &'a mut Value, path: &[Seg]) -> &'a mut Value {
    path.iter().fold(v, |v, seg| match seg {
        Seg::Key(k) => &mut v[k.as_str()],
        Seg::Index(i) => &mut v[*i],
    })
}

/// One mutation of a document.
#[derive(Debug, Clone)]
enum Mutation {
    /// Replace the value at a node.
    Replace(Index, Value),
    /// Remove a node from its object (or array).
    Remove(Index),
    /// Add a key to an object node.
    Insert(Index, String, Value),
}

fn arb_mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        6 => (any::<Index>(), arb_json()).prop_map(|(i, v)| Mutation::Replace(i, v)),
        1 => any::<Index>().prop_map(Mutation::Remove),
        2 => (any::<Index>(), arb_key(), arb_json()).prop_map(|(i, k, v)| Mutation::Insert(i, k, v)),
    ]
}

fn mutate(mut doc: Value, m: &Mutation) -> Value {
    let mut all = Vec::new();
    paths(&doc, &mut Vec::new(), &mut all);
    match m {
        Mutation::Replace(i, value) => {
            *node_mut(&mut doc, &all[i.index(all.len())]) = value.clone()
        }
        Mutation::Remove(i) => {
            let path = &all[i.index(all.len())];
            if let Some((last, parent)) = path.split_last() {
                match (node_mut(&mut doc, parent), last) {
                    (Value::Object(o), Seg::Key(k)) => {
                        o.remove(k);
                    }
                    (Value::Array(a), Seg::Index(i)) => {
                        a.remove(*i);
                    }
                    _ => {}
                }
            }
        }
        Mutation::Insert(i, key, value) => {
            if let Value::Object(o) = node_mut(&mut doc, &all[i.index(all.len())]) {
                o.insert(key.clone(), value.clone());
            }
        }
    }
    doc
}

/// An envelope whose digest matches its (mutated) data, so the typed parse is reached.
fn redigest(mut env: Value) -> Value {
    if let Value::Object(o) = &mut env {
        let data = o.get("data").cloned().unwrap_or(Value::Null);
        o.insert(
            "digest".into(),
            Value::String(Digest::of_json(&data).to_string()),
        );
    }
    env
}

// ---------------------------------------------------------------------------------------------
// The checks: never a panic, and what parses is within range.
// ---------------------------------------------------------------------------------------------

fn check_task(bytes: &[u8]) {
    let Ok(task) = TaskSubmission::parse(bytes) else {
        return;
    };
    assert!(!task.input.trim().is_empty(), "empty input accepted");
    assert!(
        task.input.len() <= MAX_INPUT_BYTES,
        "oversized input accepted"
    );
    if let Some(b) = &task.budget {
        let in_range = |v: Option<u64>, max: u64| v.is_none_or(|v| (1..=max).contains(&v));
        assert!(
            in_range(b.max_steps.map(u64::from), u64::from(MAX_STEPS)),
            "{b:?}"
        );
        assert!(in_range(b.max_tokens, u64::MAX), "{b:?}");
        assert!(
            in_range(
                b.max_attempts_per_step.map(u64::from),
                u64::from(MAX_ATTEMPTS_PER_STEP)
            ),
            "{b:?}"
        );
        assert!(in_range(b.deadline_secs, MAX_DEADLINE_SECS), "{b:?}");
        // A task only tightens a default, so the result stays in range too.
        let applied = b.apply_to(&Budget::default());
        assert_budget_in_range(&applied);
    }
}

fn assert_budget_in_range(b: &Budget) {
    assert!((1..=MAX_STEPS).contains(&b.max_steps), "{b:?}");
    assert!(b.max_tokens >= 1, "{b:?}");
    assert!(
        (1..=MAX_ATTEMPTS_PER_STEP).contains(&b.max_attempts_per_step),
        "{b:?}"
    );
    assert!(
        b.deadline_secs
            .is_none_or(|d| (1..=MAX_DEADLINE_SECS).contains(&d)),
        "{b:?}"
    );
}

fn assert_definition_in_range(def: &AgentDefinition) {
    assert_budget_in_range(&def.budget);
    assert!(
        (1..=MAX_OUTPUT_TOKENS).contains(&u64::from(def.max_output_tokens)),
        "max_output_tokens {}",
        def.max_output_tokens
    );
    for t in &def.tools {
        assert!(valid_tool_name(&t.name), "tool name {:?}", t.name);
    }
    for (name, p) in &def.policy {
        assert!(def.tools.iter().any(|t| &t.name == name), "policy.{name}");
        assert!(
            p.timeout_secs
                .is_none_or(|v| (1..=MAX_TOOL_TIMEOUT_SECS).contains(&v)),
            "{p:?}"
        );
        assert!(
            p.approval_ttl_secs
                .is_none_or(|v| (1..=MAX_APPROVAL_TTL_SECS).contains(&v)),
            "{p:?}"
        );
    }
}

fn check_agent(bytes: &[u8]) {
    if let Ok(def) = AgentDefinition::parse(bytes) {
        assert_definition_in_range(&def);
        assert_eq!(def.validate(), Ok(()), "a parsed definition validates");
        // What is stored reads back (the step service parses stored revisions).
        let stored = serde_json::to_vec(&def).expect("serializes");
        let again = AgentDefinition::parse(&stored);
        assert!(again.is_ok(), "stored definition does not parse: {again:?}");
    }
    // `validate` on its own, over whatever deserializes (including what it must refuse).
    if let Ok(def) = serde_json::from_slice::<AgentDefinition>(bytes)
        && def.validate().is_ok()
    {
        assert_definition_in_range(&def);
    }
}

fn check_envelope(bytes: &[u8]) {
    // The journal's decoder (no serde `flatten`, the data decoded by its type from its raw
    // bytes) takes exactly what serde's derived one takes, and reads the same envelope.
    let derived = serde_json::from_slice::<Envelope>(bytes)
        .ok()
        .filter(|e| e.verify_digest().is_ok());
    let decoded = Envelope::from_json_bytes(bytes);
    assert_eq!(
        decoded.as_ref().ok(),
        derived.as_ref(),
        "the decoder and serde's derived one disagree: {decoded:?}"
    );
    if let Ok(env) = decoded {
        // A parsed envelope survives the rest of its life: serialization, subject, a fold.
        let _ = env.subject();
        let back = Envelope::from_json_bytes(&env.to_json_bytes());
        assert!(
            back.is_ok(),
            "a parsed envelope does not read back: {back:?}"
        );
        if let Ok(state) = fold([(1, &env)]) {
            let _ = decide(&state);
        }
    }
}

fn to_bytes(v: &Value) -> Vec<u8> {
    serde_json::to_vec(v).expect("a Value serializes")
}

// ---------------------------------------------------------------------------------------------
// Journals: a valid start, then arbitrary inputs (and, interleaved, the step's own decisions).
// ---------------------------------------------------------------------------------------------

fn run() -> RunId {
    "run_sim".parse().expect("valid")
}

fn created(budget: Budget) -> Envelope {
    Envelope::new(
        run(),
        Timestamp::now(),
        Draft::new(Event::RunCreated(Box::new(RunCreated {
            model: ModelSpec {
                // A priced model whenever the budget limits cost, so that the cost check runs.
                price: budget.max_cost.map(|_| kedge_core::event::Price {
                    input_per_mtok: 1000.0,
                    output_per_mtok: 4000.0,
                    currency: "USD".into(),
                }),
                ..kedge_core::fixtures::run_created("demo", "").model
            },
            budget,
            idempotency_key: Some("task-1".into()),
            ..kedge_core::fixtures::run_created("demo", "research kedging")
        }))),
    )
}

/// Any budget, not only valid ones: a journal is read as it is.
fn arb_budget() -> impl Strategy<Value = Budget> {
    let small = prop_oneof![3 => 0u32..6, 1 => any::<u32>()];
    (
        small.clone(),
        prop_oneof![3 => 0u64..5000, 1 => any::<u64>()],
        small,
        prop::option::of(prop_oneof![0u64..100, any::<u64>()]),
        prop::option::of(prop_oneof![0.0f64..0.01, any::<f64>()]),
    )
        .prop_map(
            |(max_steps, max_tokens, max_attempts_per_step, deadline_secs, max_cost)| Budget {
                max_steps,
                max_tokens,
                max_attempts_per_step,
                deadline_secs,
                max_cost,
            },
        )
}

/// Operations of this run (steps 0..=4, calls 0..=3, which the fixtures use) and of another.
fn arb_op() -> impl Strategy<Value = OperationId> {
    prop_oneof![
        8 => (0u32..5, 0u32..4).prop_map(|(s, i)| OperationId::new(&run(), StepNo(s), i)),
        1 => (any::<u32>(), any::<u32>()).prop_map(|(s, i)| OperationId::new(&run(), StepNo(s), i)),
        1 => (0u32..5, 0u32..4)
            .prop_map(|(s, i)| OperationId::new(&"run_other".parse().expect("valid"), StepNo(s), i)),
    ]
}

fn arb_question() -> impl Strategy<Value = QuestionId> {
    prop_oneof![
        4 => arb_op().prop_map(|op| QuestionId::for_operation(&op)),
        1 => "q_[a-z0-9_]{1,10}".prop_map(|s| s.parse().expect("valid")),
    ]
}

fn arb_approval() -> impl Strategy<Value = ApprovalId> {
    prop_oneof![
        4 => (arb_op(), 0u32..3).prop_map(|(op, v)| ApprovalId::for_operation(&op, v)),
        1 => "apr_[a-z0-9_]{1,10}".prop_map(|s| s.parse().expect("valid")),
    ]
}

fn arb_timer() -> impl Strategy<Value = TimerId> {
    prop_oneof![
        3 => arb_op().prop_map(|op| TimerId::for_operation(&op)),
        2 => Just(TimerId::for_deadline(&run())),
        2 => arb_approval().prop_map(|a| TimerId::for_approval(&a)),
        1 => "tmr_[a-z0-9_]{1,10}".prop_map(|s| s.parse().expect("valid")),
    ]
}

fn arb_callback() -> impl Strategy<Value = CallbackKey> {
    prop_oneof![
        4 => arb_op().prop_map(|op| CallbackKey::for_operation(&op)),
        1 => "cbk_[a-z0-9_]{1,10}".prop_map(|s| s.parse().expect("valid")),
    ]
}

fn arb_digest() -> impl Strategy<Value = Digest> {
    prop_oneof![
        // The digests of the arguments a scripted model sends (so a decision can match).
        3 => select(vec![json!({}), json!({"path": "a"}), json!({"secs": 1}), json!({"prompt": "?"}), json!({"command": "ls"})])
            .prop_map(|v| Digest::of_json(&v)),
        1 => any::<[u8; 8]>().prop_map(|b| Digest::of_bytes(&b)),
    ]
}

/// Every input event type.
fn arb_input_event() -> impl Strategy<Value = Event> {
    prop_oneof![
        1 => arb_string().prop_map(|text| Event::UserMessage(UserMessage { text })),
        1 => (arb_string(), 0u32..4).prop_map(|(runner, attempt)| Event::ToolStarted(ToolStarted { runner, attempt })),
        2 => (0u32..4, 0u32..3, 0usize..3, arb_string(), any::<u64>(), arb_timestamp()).prop_map(
            |(attempt, dispatch, class, error, delay_ms, retry_at)| {
                Event::ToolAttempt(kedge_core::event::ToolAttempt {
                    attempt,
                    dispatch,
                    class: kedge_core::tools::ToolErrorClass::ALL[class],
                    error,
                    delay_ms,
                    retry_at,
                })
            }
        ),
        3 => (arb_string(), any::<bool>(), any::<bool>()).prop_map(|(content, is_error, stopped)| {
            Event::ToolResult(ToolResult { content, is_error, stopped })
        }),
        2 => (arb_question(), arb_string()).prop_map(|(question_id, answer)| {
            Event::QuestionAnswered(QuestionAnswered { question_id, answer })
        }),
        2 => (arb_approval(), any::<bool>(), arb_digest(), arb_string(), prop::option::of(arb_string()))
            .prop_map(|(approval_id, approve, args_digest, approver, comment)| {
                Event::ApprovalDecided(ApprovalDecided {
                    approval_id,
                    verdict: if approve { Verdict::Approve } else { Verdict::Deny },
                    args_digest,
                    approver,
                    comment,
                })
            }),
        2 => arb_timer().prop_map(|timer_id| Event::TimerFired(TimerFired { timer_id })),
        2 => (arb_callback(), arb_json())
            .prop_map(|(key, payload)| Event::CallbackReceived(CallbackReceived { key, payload })),
        1 => (arb_string(), prop::option::of(arb_string()))
            .prop_map(|(reason, by)| Event::CancelRequested(CancelRequested { reason, by })),
        1 => arb_string().prop_map(|content| Event::OutcomeConfirmed(OutcomeConfirmed { content })),
        1 => Just(Event::OutcomeNotFound(OutcomeNotFound {})),
        1 => arb_string().prop_map(|detail| Event::OutcomeAmbiguous(OutcomeAmbiguous { detail })),
        1 => (0u8..3, arb_string(), arb_string()).prop_map(|(r, text, by)| {
            let resolution = match r {
                0 => Resolution::Retry,
                1 => Resolution::Completed { content: text },
                _ => Resolution::Failed { reason: text },
            };
            Event::OutcomeResolved(OutcomeResolved { resolution, by })
        }),
        1 => (arb_string(), arb_string())
            .prop_map(|(expected, found)| Event::TargetMoved(TargetMoved { expected, found })),
        1 => arb_string().prop_map(|reason| Event::Nudge(Nudge { reason })),
    ]
}

fn arb_timestamp() -> impl Strategy<Value = Timestamp> {
    prop_oneof![
        8 => Just(None),
        1 => (-1_000_000_000_000i64..1_000_000_000_000).prop_map(|s| {
            time::OffsetDateTime::from_unix_timestamp(s).ok().map(Timestamp)
        }),
        1 => select(vec![Timestamp::MIN, Timestamp::MAX]).prop_map(Some),
    ]
    .prop_map(|t| t.unwrap_or_else(Timestamp::now))
}

/// One input as it lands on the run's subjects: any event, any `op`/`step`/`attempt`, any time.
#[derive(Debug, Clone)]
struct Input {
    event: Event,
    op: Option<OperationId>,
    step: Option<StepNo>,
    attempt: Option<Attempt>,
    at: Timestamp,
}

fn arb_input() -> impl Strategy<Value = Input> {
    let counter = || prop::option::of(prop_oneof![4 => 0u32..5, 1 => any::<u32>()]);
    (
        arb_input_event(),
        prop_oneof![2 => arb_op().prop_map(Some), 1 => Just(None)],
        counter(),
        counter(),
        arb_timestamp(),
    )
        .prop_map(|(event, op, step, attempt, at)| Input {
            event,
            op,
            step: step.map(StepNo),
            attempt: attempt.map(Attempt),
            at,
        })
}

/// What a scripted model answers: text and tool calls, including the step's own tools.
fn arb_response() -> impl Strategy<Value = ModelResponse> {
    let call = (
        "call_[a-z0-9]{1,3}",
        select(vec![
            "read_file",
            "shell",
            "ask_user",
            "wait",
            "await_callback",
            "no_such_tool",
        ]),
        prop_oneof![
            3 => select(vec![json!({}), json!({"path": "a"}), json!({"secs": 1}), json!({"prompt": "?"}), json!({"command": "ls"})]),
            1 => arb_json(),
        ],
    )
        .prop_map(|(call_id, name, arguments)| ToolCall {
            call_id,
            name: name.into(),
            arguments,
        });
    (
        arb_string(),
        prop::collection::vec(call, 0..4),
        (any::<u32>(), any::<u32>()),
        select(vec![
            FinishReason::Stop,
            FinishReason::ToolCalls,
            FinishReason::Length,
            FinishReason::Other,
        ]),
    )
        .prop_map(|(text, tool_calls, (i, o), finish)| ModelResponse {
            message: AssistantMessage {
                text,
                tool_calls,
                thinking: Vec::new(),
            },
            usage: Usage {
                input_tokens: u64::from(i),
                output_tokens: u64::from(o),
                cost: None,
            },
            finish,
        })
}

#[derive(Debug, Clone)]
enum Action {
    /// An input lands, `gap` sequence numbers after the last event.
    Input(Box<Input>, u64),
    /// The step service acts on `decide`: commits its decisions, answering a step with this.
    Advance(ModelResponse),
}

fn arb_action() -> impl Strategy<Value = Action> {
    prop_oneof![
        3 => (arb_input(), prop_oneof![8 => 1u64..5, 1 => any::<u64>()])
            .prop_map(|(i, gap)| Action::Input(Box::new(i), gap)),
        2 => arb_response().prop_map(Action::Advance),
    ]
}

/// The start of a journal: a fresh `run.created` with any budget, or a prefix of a fixture.
#[derive(Debug, Clone)]
enum Start {
    Fresh(Budget),
    Fixture(usize, Index),
}

fn arb_start() -> impl Strategy<Value = Start> {
    prop_oneof![
        arb_budget().prop_map(Start::Fresh),
        (0..fixture_journals().len(), any::<Index>()).prop_map(|(f, i)| Start::Fixture(f, i)),
    ]
}

fn start_journal(start: &Start) -> Vec<(u64, Envelope)> {
    match start {
        Start::Fresh(budget) => vec![(1, created(budget.clone()))],
        Start::Fixture(f, i) => {
            let journal = &fixture_journals()[*f];
            let len = 1 + i.index(journal.len());
            journal[..len]
                .iter()
                .map(|(seq, v)| {
                    let env = Envelope::from_json_bytes(&to_bytes(v)).expect("fixture envelope");
                    (*seq, env)
                })
                .collect()
        }
    }
}

/// Folds the journal and, on a state, runs `decide` and the state's other readers.
fn fold_and_decide(journal: &[(u64, Envelope)]) -> Option<(RunState, Next)> {
    let state = fold(journal.iter().map(|(s, e)| (*s, e))).ok()?;
    let _ = state.waiting_on();
    let _ = state.next_context();
    let _ = state.op_summaries();
    let _ = state.unresolved_ops().count();
    let _ = state.last_step_ops();
    let _ = state.ops_stuck_since(Timestamp::now());
    let next = decide(&state);
    Some((state, next))
}

fn run_journal(start: &Start, actions: &[Action], contract: &Contract) {
    let mut journal = start_journal(start);
    let mut seq = journal.last().map_or(0, |(s, _)| *s);
    let mut push = |journal: &mut Vec<(u64, Envelope)>, env: Envelope, gap: u64| {
        // Sequence numbers only grow; past `u64::MAX` nothing more can land.
        match seq.checked_add(gap.max(1)) {
            Some(s) => {
                seq = s;
                journal.push((s, env));
                true
            }
            None => false,
        }
    };
    for action in actions {
        match action {
            Action::Input(input, gap) => {
                let draft = Draft {
                    event: input.event.clone(),
                    step: input.step,
                    attempt: input.attempt,
                    op: input.op.clone(),
                    inline: false,
                };
                if !push(&mut journal, Envelope::new(run(), input.at, draft), *gap) {
                    return;
                }
            }
            Action::Advance(response) => {
                let Some((state, next)) = fold_and_decide(&journal) else {
                    return;
                };
                let now = Timestamp::now();
                let drafts = match next {
                    Next::Idle(_) => Vec::new(),
                    Next::Commit(drafts) => drafts,
                    Next::Step(plan) => {
                        for d in &plan.start {
                            push(&mut journal, Envelope::new(run(), now, d.clone()), 1);
                        }
                        let after = match fold(journal.iter().map(|(s, e)| (*s, e))) {
                            Ok(after) => after,
                            Err(e) => panic!("a step's start does not fold: {e}"),
                        };
                        complete_step(
                            &after,
                            plan.step,
                            plan.attempt,
                            plan.request_id.clone(),
                            response.clone(),
                            false,
                            now,
                            contract,
                        )
                    }
                    Next::Finish(c) => finish_step(&state, &c, now, contract),
                };
                let committed = !drafts.is_empty();
                for d in drafts {
                    push(&mut journal, Envelope::new(run(), now, d), 1);
                }
                // What the writer decides on a state that folds, folds: a decision the state
                // machine refuses would stop the run's journal from folding for good.
                if committed && let Err(e) = fold(journal.iter().map(|(s, e)| (*s, e))) {
                    panic!("decide's decisions do not fold: {e}");
                }
            }
        }
        // After every event: the journal folds or does not, and decide answers.
        let _ = fold_and_decide(&journal);
    }
}

/// Every fixture envelope as recorded: decoded, and alike by both decoders (`check_envelope`).
#[test]
fn every_fixture_envelope_decodes_alike() {
    for env in fixture_envelopes() {
        let bytes = to_bytes(&env);
        assert!(Envelope::from_json_bytes(&bytes).is_ok(), "{env}");
        check_envelope(&bytes);
    }
}

// ---------------------------------------------------------------------------------------------
// The properties.
// ---------------------------------------------------------------------------------------------

proptest! {
    #![proptest_config(config())]

    /// 1a. Arbitrary bytes.
    #[test]
    fn arbitrary_bytes_never_panic(bytes in prop::collection::vec(any::<u8>(), 0..512)) {
        check_task(&bytes);
        check_agent(&bytes);
        check_envelope(&bytes);
    }

    /// 1b. Arbitrary JSON values.
    #[test]
    fn arbitrary_json_never_panics(value in arb_json()) {
        let bytes = to_bytes(&value);
        check_task(&bytes);
        check_agent(&bytes);
        check_envelope(&bytes);
    }

    /// 1c + 2. A valid task with one part replaced, removed or added: parses or is refused,
    /// and what parses is within range.
    #[test]
    fn mutated_tasks_never_panic(mutations in prop::collection::vec(arb_mutation(), 1..3)) {
        let doc = mutations.iter().fold(valid_task(), mutate);
        check_task(&to_bytes(&doc));
    }

    /// 1c + 2. The same for agent definitions (`parse`, then `validate`).
    #[test]
    fn mutated_agent_definitions_never_panic(
        mutations in prop::collection::vec(arb_mutation(), 1..3),
    ) {
        let doc = mutations.iter().fold(valid_agent(), mutate);
        check_agent(&to_bytes(&doc));
    }

    /// 1c. Every fixture envelope mutated, as sent (the digest no longer matches) and with the
    /// digest recomputed (the typed parse is reached).
    #[test]
    fn mutated_envelopes_never_panic(
        which in any::<Index>(),
        mutation in arb_mutation(),
        fix_digest in any::<bool>(),
    ) {
        let envs = fixture_envelopes();
        let mut doc = mutate(which.get(&envs).clone(), &mutation);
        if fix_digest {
            doc = redigest(doc);
        }
        check_envelope(&to_bytes(&doc));
    }

    /// 2. Every budget number a task can carry: accepted exactly when in range.
    #[test]
    fn task_budgets_are_range_checked(
        max_steps in prop::option::of(prop_oneof![0u32..=MAX_STEPS + 1, any::<u32>()]),
        max_tokens in prop::option::of(prop_oneof![0u64..3, any::<u64>()]),
        max_attempts_per_step in prop::option::of(prop_oneof![0u32..=MAX_ATTEMPTS_PER_STEP + 1, any::<u32>()]),
        deadline_secs in prop::option::of(prop_oneof![0u64..=MAX_DEADLINE_SECS + 1, any::<u64>()]),
        max_cost in prop::option::of(prop_oneof![-1.0f64..1.0, -1e300f64..1e300]),
    ) {
        let budget = BudgetOverride { max_steps, max_tokens, max_attempts_per_step, deadline_secs, max_cost };
        let mut doc = valid_task();
        doc["budget"] = serde_json::to_value(&budget).expect("json");
        let ok = |v: Option<u64>, max: u64| v.is_none_or(|v| (1..=max).contains(&v));
        let expected = ok(max_steps.map(u64::from), u64::from(MAX_STEPS))
            && ok(max_tokens, u64::MAX)
            && ok(max_attempts_per_step.map(u64::from), u64::from(MAX_ATTEMPTS_PER_STEP))
            && ok(deadline_secs, MAX_DEADLINE_SECS)
            && max_cost.is_none_or(|c| c > 0.0);
        let parsed = TaskSubmission::parse(&to_bytes(&doc));
        prop_assert_eq!(parsed.is_ok(), expected, "{:?}: {:?}", budget, parsed);
        check_task(&to_bytes(&doc));
    }

    /// 3. A valid start, then up to 30 arbitrary inputs interleaved with the step's own
    /// decisions: `fold` answers `Ok` or `Err` and `decide` answers on every state.
    #[test]
    fn fold_and_decide_never_panic(
        start in arb_start(),
        actions in prop::collection::vec(arb_action(), 0..30),
        with_policy in any::<bool>(),
    ) {
        // Either no contract (every call goes through) or the agent's, whose `shell` calls
        // need approval.
        let contract = if with_policy {
            Contract::of(&agent_definition())
        } else {
            Default::default()
        };
        run_journal(&start, &actions, &contract);
    }
}

// ---------------------------------------------------------------------------------------------
// Found by the properties above (not panics: `decide` answering what `fold` then refuses).
// ---------------------------------------------------------------------------------------------

/// A run that used its last step and finished, then gets a user message: `decide` commits
/// `run.failed` (max steps) from `succeeded`, which the transition table refuses, so the
/// journal would stop folding. (Also from `failed`, with `max_steps: 0`.)
#[test]
/// Found by no_panic: `decide` used to propose a bare `run.failed` in a finished run that got a
/// message with no steps left, which the state machine refuses (the run stopped folding). It now
/// revives the run and then fails it with the reason.
fn a_message_to_a_finished_run_with_no_steps_left_folds() {
    let mut journal = vec![(
        1,
        created(Budget {
            max_steps: 1,
            ..Budget::default()
        }),
    )];
    let state = |journal: &[(u64, Envelope)]| {
        fold(journal.iter().map(|(s, e)| (*s, e))).expect("the journal folds")
    };
    let Next::Step(plan) = decide(&state(&journal)) else {
        panic!("expected a step");
    };
    let mut seq = 1;
    for d in &plan.start {
        seq += 1;
        journal.push((seq, Envelope::new(run(), Timestamp::now(), d.clone())));
    }
    let done = ModelResponse {
        message: AssistantMessage {
            text: "done".into(),
            tool_calls: vec![],
            thinking: Vec::new(),
        },
        usage: Usage::default(),
        finish: FinishReason::Stop,
    };
    let after = state(&journal);
    for d in complete_step(
        &after,
        plan.step,
        plan.attempt,
        plan.request_id,
        done,
        false,
        Timestamp::now(),
        &Contract::default(),
    ) {
        seq += 1;
        journal.push((seq, Envelope::new(run(), Timestamp::now(), d)));
    }
    seq += 1;
    let more = Draft::new(Event::UserMessage(UserMessage {
        text: "more".into(),
    }));
    journal.push((seq, Envelope::new(run(), Timestamp::now(), more)));
    if let Next::Commit(drafts) = decide(&state(&journal)) {
        for d in drafts {
            seq += 1;
            journal.push((seq, Envelope::new(run(), Timestamp::now(), d)));
        }
    }
    let last = state(&journal);
    assert_eq!(last.status, kedge_core::RunStatus::Failed);
    assert!(
        last.failure
            .as_ref()
            .is_some_and(|f| f.message.contains("steps")),
        "{:?}",
        last.failure
    );
}
