//! Structured output (issue 12, item 1), through the services: an agent's `output_schema` goes
//! to the model as OpenAI `response_format` (the strict mock checks it), the final answer is
//! validated against the schema of the run's revision, and the run view reports `valid` or
//! `invalid {errors}`; with `on_invalid_output: fail` an invalid answer fails the run, naming
//! the JSON path.

mod common;

use std::time::Duration;

use common::{API_KEY_VAR, Harness, Svc, assert_schema_valid};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, FailureReason, OutputValidation, UserMessage};
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

async fn view(h: &Harness, run: &kedge_core::ids::RunId) -> kedge_runtime::view::RunView {
    let state = h.state(run).await;
    let events = h.events(run).await;
    assert_schema_valid(&events);
    kedge_runtime::view::run_view(&state, &events)
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
