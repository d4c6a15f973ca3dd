//! The example agent definitions (`examples/agents/*.json`) and the one in docs/CONFIG.md are
//! checked against each other's authorities: the agent schema (`schemas/agent.schema.json`),
//! Kedge's own rules (what `kedge agents put` runs: parse, validate) and the default model
//! policy (their key variables and base URLs are allowed out of the box).

use std::path::{Path, PathBuf};

use kedge_core::agent::AgentDefinition;
use kedge_runtime::Config;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn check(name: &str, text: &str, validator: &jsonschema::Validator) {
    let value: serde_json::Value =
        serde_json::from_str(text).unwrap_or_else(|e| panic!("{name}: not JSON: {e}"));
    let errors: Vec<String> = validator
        .iter_errors(&value)
        .map(|e| format!("{}: {e}", e.instance_path()))
        .collect();
    assert!(errors.is_empty(), "{name}: schema: {errors:?}");
    let def =
        AgentDefinition::parse(text.as_bytes()).unwrap_or_else(|e| panic!("{name}: refused: {e}"));
    def.validate()
        .unwrap_or_else(|e| panic!("{name}: refused: {e}"));
    let key = kedge_model::api_key_env(&def);
    Config::default()
        .check_model(&key, def.model.base_url.as_deref())
        .unwrap_or_else(|e| panic!("{name}: outside the default model policy: {e}"));
}

fn validator() -> jsonschema::Validator {
    let text = std::fs::read_to_string(repo().join("schemas/agent.schema.json")).expect("schema");
    let schema: serde_json::Value = serde_json::from_str(&text).expect("schema JSON");
    jsonschema::validator_for(&schema).expect("a valid schema")
}

#[test]
fn every_example_agent_is_accepted() {
    let validator = validator();
    let dir = repo().join("examples/agents");
    let mut seen = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("examples/agents") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|e| e == "json") {
            let text = std::fs::read_to_string(&path).expect("read");
            let name = path
                .file_name()
                .expect("name")
                .to_string_lossy()
                .into_owned();
            check(&name, &text, &validator);
            seen.push(name);
        }
    }
    seen.sort();
    assert_eq!(
        seen,
        [
            "anthropic.json",
            "local-openai-compatible.json",
            "mcp-time.json",
            "openai.json"
        ],
        "examples/agents/README.md lists these"
    );
}

#[test]
fn the_config_doc_example_agent_is_accepted() {
    let doc = std::fs::read_to_string(repo().join("docs/CONFIG.md")).expect("CONFIG.md");
    let section = doc
        .split("## Agent definitions")
        .nth(1)
        .expect("an agent definitions section");
    let block = section
        .split("```json\n")
        .nth(1)
        .and_then(|b| b.split("```").next())
        .expect("a JSON example in the section");
    check("docs/CONFIG.md", block, &validator());
}
