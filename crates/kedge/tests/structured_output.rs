//! Structured output, through the services: an agent's `output_schema` goes
//! to the model as OpenAI `response_format` or as Anthropic's `output` tool (the strict mock
//! checks both), the final answer is validated against the schema of the run's revision, and the
//! run view reports `valid` or `invalid {errors}`; with `on_invalid_output: fail` an invalid
//! answer fails the run, naming the JSON path; with `retry` it goes back to the model with the
//! errors (`output.rejected`), a bounded number of times.

use crate::common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, EventType, FailureReason, OutputValidation, UserMessage};
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

const GOOD: &str = r#"{"answer": "Kedging moves a ship with its anchor.", "confidence": 0.9}"#;
const BAD: &str = r#"{"answer": 42, "confidence": "high"}"#;

fn schema() -> Value {
    json!({
        "type": "object",
        "required": ["answer", "confidence"],
        "properties": {
            "answer": {"type": "string"},
            "confidence": {"type": "number", "minimum": 0, "maximum": 1}
        }
    })
}

async fn store(h: &Harness, name: &str, on_invalid: Option<&str>) {
    let mut def = json!({
        "name": name,
        "system_prompt": "Answer as JSON.",
        "model": {"provider": "openai", "name": "gpt-mock",
                  "base_url": format!("{}/v1", h.mock.base_url())},
        "api_key_env": API_KEY_VAR,
        "tools": ["list_files"],
        "output_schema": schema(),
    });
    if let Some(choice) = on_invalid {
        def["on_invalid_output"] = choice.into();
    }
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

async fn view(h: &Harness, run: &kedge_core::ids::RunId) -> kedge_app::view::RunView {
    let state = h.state(run).await;
    let events = h.events(run).await;
    assert_schema_valid(&events);
    kedge_app::view::run_view(&state, &events)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_final_answer_is_requested_as_json_and_validated_against_the_output_schema() {
    let script = json!({"models": {"gpt-mock": {
        "rules": [
            {"when_last_user_contains": "good", "respond": {"text": GOOD}},
            {"when_last_user_contains": "bad", "respond": {"text": BAD}}
        ],
        "default": {"text": "not json at all"}
    }}});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    store(&h, "strict", None).await;
    store(&h, "lenient", Some("accept")).await;

    // A valid answer: succeeded, `valid`.
    let run = h.submit("strict", "A good question?", "task-good").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let v = view(&h, &run).await;
    let result = v.result.expect("a result");
    assert_eq!(result.output, GOOD);
    assert_eq!(result.validation, OutputValidation::Valid);
    let as_json = serde_json::to_value(&result.validation).expect("json");
    assert_eq!(as_json, json!({"status": "valid"}));

    // Every request asked for the schema in OpenAI's structured-output form.
    let bodies = h.mock.requests("gpt-mock");
    assert!(!bodies.is_empty());
    for b in &bodies {
        assert_eq!(
            b["response_format"],
            json!({"type": "json_schema",
                   "json_schema": {"name": "output", "schema": schema(), "strict": false}})
        );
    }

    // An invalid answer under `fail` (the default): the run fails naming the JSON paths.
    let run = h.submit("strict", "A bad question?", "task-bad").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.clone().expect("failed");
    assert_eq!(failure.reason, FailureReason::InvalidOutput, "{failure:?}");
    assert!(
        failure.message.contains("at /answer:"),
        "{}",
        failure.message
    );
    assert!(
        failure.message.contains("at /confidence:"),
        "{}",
        failure.message
    );
    assert!(view(&h, &run).await.result.is_none());
    let failed = run;

    // The same answer under `accept`: succeeded, `invalid {errors}`.
    let run = h.submit("lenient", "A bad question?", "task-bad-ok").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let result = view(&h, &run).await.result.expect("a result");
    assert_eq!(result.output, BAD);
    let OutputValidation::Invalid { errors } = &result.validation else {
        panic!("invalid expected: {:?}", result.validation)
    };
    assert!(
        errors.iter().any(|e| e.starts_with("at /answer:")),
        "{errors:?}"
    );

    // Text that is not JSON is invalid too.
    let run = h.submit("lenient", "Anything?", "task-prose").await;
    h.wait_terminal(&run, WAIT).await;
    let result = view(&h, &run).await.result.expect("a result");
    assert!(
        matches!(&result.validation, OutputValidation::Invalid { errors } if errors[0].contains("not JSON")),
        "{:?}",
        result.validation
    );

    // A run keeps the schema of its revision: after the agent is edited to drop the schema, a
    // new turn of the failed run is still checked (and asked for JSON), a new run is not.
    let plain = AgentDefinition::parse(
        json!({
            "name": "strict",
            "system_prompt": "Answer.",
            "model": {"provider": "openai", "name": "gpt-mock",
                      "base_url": format!("{}/v1", h.mock.base_url())},
            "api_key_env": API_KEY_VAR,
        })
        .to_string()
        .as_bytes(),
    )
    .expect("valid");
    h.rt.agents.put(&plain).await.expect("stored");
    h.input(
        &failed,
        Event::UserMessage(UserMessage {
            text: "Another bad one.".into(),
        }),
        "msg-bad-again",
    )
    .await;
    let state = h
        .wait_for(&failed, WAIT, |s| s.turn == 2 && s.status.is_terminal())
        .await;
    assert_eq!(state.status, RunStatus::Failed);
    assert_eq!(
        state.failure.as_ref().map(|f| f.reason),
        Some(FailureReason::InvalidOutput)
    );
    let last = h.mock.requests("gpt-mock").pop().expect("a request");
    assert_eq!(last["response_format"]["json_schema"]["schema"], schema());
    let run = h
        .submit("strict", "A bad question?", "task-bad-plain")
        .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let result = view(&h, &run).await.result.expect("a result");
    assert_eq!(result.validation, OutputValidation::NotChecked);
    let last = h.mock.requests("gpt-mock").pop().expect("a request");
    assert!(last.get("response_format").is_none(), "{last}");
    h.shutdown().await;
}

/// Stores `def` (a definition without `name`, `model` and key) as `name` on `model` of
/// `provider`, as `kedge agents put` would.
async fn put(h: &Harness, name: &str, provider: &str, model: &str, mut def: Value) {
    def["name"] = name.into();
    def["api_key_env"] = API_KEY_VAR.into();
    let base_url = match provider {
        "openai" => format!("{}/v1", h.mock.base_url()),
        _ => h.mock.base_url(),
    };
    def["model"] = json!({"provider": provider, "name": model, "base_url": base_url});
    def["output_schema"] = schema();
    let def = AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent");
    h.rt.agents.put(&def).await.expect("agent stored");
}

fn of_type(events: &[kedge_journal::Recorded], t: EventType) -> Vec<&Event> {
    events
        .iter()
        .map(|r| &r.envelope.event)
        .filter(|e| e.event_type() == t)
        .collect()
}

/// What the step sends the model after a rejected answer contains (`output_feedback`).
const FEEDBACK: &str = "does not match the required JSON Schema";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_invalid_answer_is_sent_back_with_its_errors_until_valid_or_retries_run_out() {
    let script = json!({"models": {
        // Invalid first; corrected once told why.
        "gpt-learner": {
            "rules": [{"when_last_user_contains": FEEDBACK, "respond": {"text": GOOD}}],
            "default": {"text": BAD}
        },
        // Never corrects itself.
        "gpt-stubborn": {"default": {"text": BAD}}
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    let retry = json!({"system_prompt": "Answer as JSON.", "tools": ["list_files"],
                       "on_invalid_output": "retry"});
    put(&h, "learner", "openai", "gpt-learner", retry.clone()).await;
    let mut once = retry.clone();
    once["output_retries"] = 1.into();
    put(&h, "stubborn", "openai", "gpt-stubborn", once).await;

    // Corrected after the feedback: succeeded, valid, one rejection journaled.
    let run = h.submit("learner", "A question?", "task-learner").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let v = view(&h, &run).await;
    let result = v.result.expect("a result");
    assert_eq!(result.output, GOOD);
    assert_eq!(result.validation, OutputValidation::Valid);
    let events = h.events(&run).await;
    let rejected = of_type(&events, EventType::OutputRejected);
    assert_eq!(rejected.len(), 1, "one output.rejected");
    let Event::OutputRejected(r) = rejected[0] else {
        unreachable!()
    };
    assert_eq!((r.retry, r.max_retries), (1, 2));
    assert!(
        r.errors.iter().any(|e| e.starts_with("at /answer:")),
        "{:?}",
        r.errors
    );
    assert_eq!(of_type(&events, EventType::StepCompleted).len(), 2);
    assert!(of_type(&events, EventType::ToolRequested).is_empty());
    // The second request carried the rejected answer, then the errors.
    let bodies = h.mock.requests("gpt-learner");
    assert_eq!(bodies.len(), 2, "two model calls");
    assert!(!bodies[0].to_string().contains(FEEDBACK));
    let messages = bodies[1]["messages"].as_array().expect("messages");
    let n = messages.len();
    assert_eq!(messages[n - 2]["role"], "assistant");
    assert_eq!(messages[n - 2]["content"], BAD);
    assert_eq!(messages[n - 1]["role"], "user");
    let feedback = messages[n - 1]["content"].as_str().expect("text");
    assert!(feedback.contains(FEEDBACK), "{feedback}");
    assert!(feedback.contains("at /answer:"), "{feedback}");
    assert!(feedback.contains("at /confidence:"), "{feedback}");
    assert!(feedback.contains("retry 1 of 2"), "{feedback}");
    assert_eq!(
        bodies[1]["response_format"]["json_schema"]["schema"],
        schema()
    );

    // Never corrected: its one retry used, the run fails as `fail` would, naming the errors.
    let run = h.submit("stubborn", "A question?", "task-stubborn").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Failed);
    let failure = state.failure.clone().expect("failed");
    assert_eq!(failure.reason, FailureReason::InvalidOutput, "{failure:?}");
    assert!(
        failure.message.contains("after 1 retry"),
        "{}",
        failure.message
    );
    assert!(
        failure.message.contains("at /answer:"),
        "{}",
        failure.message
    );
    assert!(
        failure.message.contains("at /confidence:"),
        "{}",
        failure.message
    );
    assert!(view(&h, &run).await.result.is_none());
    let events = h.events(&run).await;
    assert_eq!(of_type(&events, EventType::OutputRejected).len(), 1);
    assert_eq!(of_type(&events, EventType::StepCompleted).len(), 2);
    assert_eq!(h.mock.requests("gpt-stubborn").len(), 2, "1 + 1 retry");
    h.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_anthropic_agent_answers_through_the_output_tool_which_is_never_dispatched() {
    let good: Value = serde_json::from_str(GOOD).expect("json");
    let bad: Value = serde_json::from_str(BAD).expect("json");
    let script = json!({"models": {
        "claude-direct": {"default": {"text": "Here goes.", "tool_calls": [{"name": "output", "arguments": good}]}},
        "claude-learner": {
            "rules": [{"when_last_user_contains": FEEDBACK,
                       "respond": {"tool_calls": [{"name": "output", "arguments": good}]}}],
            "default": {"tool_calls": [{"name": "output", "arguments": bad}]}
        }
    }});
    let h = Harness::start(script, &[Svc::Intake, Svc::Step, Svc::Tool]).await;
    // No tools of its own: the output tool is forced.
    put(
        &h,
        "direct",
        "anthropic",
        "claude-direct",
        json!({"system_prompt": "Answer."}),
    )
    .await;
    // Tools of its own: the output tool is offered, not forced; an invalid answer is retried.
    put(
        &h,
        "learner",
        "anthropic",
        "claude-learner",
        json!({"system_prompt": "Answer.", "tools": ["list_files"], "on_invalid_output": "retry"}),
    )
    .await;

    let run = h.submit("direct", "A question?", "task-direct").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let result = view(&h, &run).await.result.expect("a result");
    assert_eq!(result.validation, OutputValidation::Valid);
    let output: Value = serde_json::from_str(&result.output).expect("the answer is JSON");
    assert_eq!(output, good, "the output tool's input is the answer");
    let events = h.events(&run).await;
    assert!(
        of_type(&events, EventType::ToolRequested).is_empty(),
        "the output tool is never dispatched"
    );
    let body = h.mock.requests("claude-direct").pop().expect("a request");
    assert_eq!(
        body["tools"],
        json!([{"name": "output", "input_schema": schema(),
                "description": body["tools"][0]["description"]}])
    );
    assert!(body["tools"][0]["description"].is_string());
    assert_eq!(
        body["tool_choice"],
        json!({"type": "tool", "name": "output"})
    );
    assert!(
        body["system"]
            .as_str()
            .is_some_and(|s| s.contains("`output` tool")),
        "{body}"
    );

    let run = h
        .submit("learner", "A question?", "task-claude-learner")
        .await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Succeeded, "{:?}", state.failure);
    let result = view(&h, &run).await.result.expect("a result");
    assert_eq!(result.validation, OutputValidation::Valid);
    let events = h.events(&run).await;
    assert_eq!(of_type(&events, EventType::OutputRejected).len(), 1);
    assert!(of_type(&events, EventType::ToolRequested).is_empty());
    let bodies = h.mock.requests("claude-learner");
    assert_eq!(bodies.len(), 2);
    for b in &bodies {
        let names: Vec<&str> = b["tools"]
            .as_array()
            .expect("tools")
            .iter()
            .filter_map(|t| t["name"].as_str())
            .collect();
        assert_eq!(names, ["list_files", "output"]);
        assert!(b.get("tool_choice").is_none(), "not forced: {b}");
    }
    // The rejected answer went back as the assistant's text, the errors as the user's turn,
    // asking for the output tool; the strict mock accepted the conversation.
    let messages = bodies[1]["messages"].as_array().expect("messages");
    let n = messages.len();
    assert_eq!(messages[n - 2]["role"], "assistant");
    let said: Value = serde_json::from_str(
        messages[n - 2]["content"][0]["text"]
            .as_str()
            .expect("a text block"),
    )
    .expect("JSON");
    assert_eq!(said, bad);
    let feedback = messages[n - 1]["content"][0]["text"]
        .as_str()
        .expect("text");
    assert!(feedback.contains("at /answer:"), "{feedback}");
    assert!(feedback.contains("`output` tool"), "{feedback}");
    h.shutdown().await;
}

/// The structured-output section of docs/CONFIG.md: each JSON fragment, added to the section's
/// example agent, is accepted by the agent schema and by `kedge agents put`'s rules.
#[test]
fn the_config_doc_structured_output_examples_are_accepted() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let doc = std::fs::read_to_string(root.join("docs/CONFIG.md")).expect("CONFIG.md");
    let section = doc
        .split("### Structured output")
        .nth(1)
        .and_then(|s| s.split("\n### ").next())
        .expect("a structured output section");
    let schema_text =
        std::fs::read_to_string(root.join("schemas/agent.schema.json")).expect("agent schema");
    let validator = jsonschema::validator_for(&serde_json::from_str(&schema_text).expect("json"))
        .expect("a valid schema");
    let mut checked = 0;
    for block in section.split("```json\n").skip(1) {
        let fragment = block.split("```").next().expect("a block");
        let fields: Value = serde_json::from_str(&format!("{{{fragment}}}"))
            .unwrap_or_else(|e| panic!("not JSON fields: {e}\n{fragment}"));
        let mut def = json!({
            "name": "doc", "system_prompt": "Answer.",
            "model": {"provider": "openai", "name": "gpt-4.1"},
        });
        for (k, v) in fields.as_object().expect("fields") {
            def[k] = v.clone();
        }
        let errors: Vec<String> = validator.iter_errors(&def).map(|e| e.to_string()).collect();
        assert!(errors.is_empty(), "{fragment}: {errors:?}");
        AgentDefinition::parse(def.to_string().as_bytes())
            .unwrap_or_else(|e| panic!("{fragment}: refused: {e}"));
        checked += 1;
    }
    assert!(checked >= 2, "the section shows fail and retry");
}
