//! `schemas/` must match the Rust types, and what the core produces must validate against it.

use std::path::PathBuf;

fn schemas_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../schemas")
}

#[test]
fn schemas_match_the_types() {
    let dir = schemas_dir();
    let bless = std::env::var_os("KEDGE_BLESS").is_some();
    let docs = kedge_core::schema::documents();
    let mut stale = Vec::new();
    for (path, text) in &docs {
        let file = dir.join(path);
        if bless {
            std::fs::create_dir_all(file.parent().expect("has a parent")).expect("mkdir");
            std::fs::write(&file, text).expect("write schema");
            continue;
        }
        match std::fs::read_to_string(&file) {
            Ok(on_disk) if on_disk == *text => {}
            _ => stale.push(path.clone()),
        }
    }
    // No file for a type that no longer exists.
    let known: Vec<_> = docs.iter().map(|(p, _)| p.clone()).collect();
    let events = std::fs::read_dir(dir.join("events")).expect("schemas/events exists");
    for entry in events {
        let name = format!(
            "events/{}",
            entry.expect("entry").file_name().to_string_lossy()
        );
        if !known.contains(&name) {
            stale.push(format!("{name} (no such event type)"));
        }
    }
    assert!(
        stale.is_empty(),
        "schemas/ drifted from the types: {stale:?}; regenerate with \
         `KEDGE_BLESS=1 cargo test -p kedge-core --test schemas` and review the diff"
    );
}

#[test]
fn every_event_data_schema_is_a_valid_schema() {
    for (path, text) in kedge_core::schema::documents() {
        let schema: serde_json::Value = serde_json::from_str(&text).expect("json");
        jsonschema::validator_for(&schema).unwrap_or_else(|e| panic!("{path}: {e}"));
    }
}

#[test]
fn the_envelope_schema_rejects_what_the_types_reject() {
    let text = std::fs::read_to_string(schemas_dir().join("envelope.schema.json")).expect("file");
    let schema: serde_json::Value = serde_json::from_str(&text).expect("json");
    let validator = jsonschema::validator_for(&schema).expect("valid schema");
    let good = serde_json::json!({
        "run_id": "run_a", "at": "2026-11-30T05:00:00Z", "type": "user.message",
        "data": {"text": "hi"},
        "digest": "sha256:0000000000000000000000000000000000000000000000000000000000000000"
    });
    assert!(validator.is_valid(&good));
    for (field, bad) in [
        ("type", serde_json::json!("user.shouted")),
        ("run_id", serde_json::json!("run_a.b")),
        ("data", serde_json::json!({"txt": "hi"})),
        ("digest", serde_json::json!("md5:00")),
    ] {
        let mut v = good.clone();
        v[field] = bad;
        assert!(!validator.is_valid(&v), "{field} accepted");
    }
}

#[test]
fn the_agent_schema_accepts_a_definition_and_rejects_unknown_fields() {
    let text = std::fs::read_to_string(schemas_dir().join("agent.schema.json")).expect("file");
    let schema: serde_json::Value = serde_json::from_str(&text).expect("json");
    let validator = jsonschema::validator_for(&schema).expect("valid schema");
    let good = serde_json::json!({
        "name": "helper",
        "system_prompt": "You help.",
        "model": {"provider": "openai", "name": "gpt-test"},
        "tools": [{"name": "time__get_current_time", "parameters": {"type": "object"}}, {"name": "shell"}],
        "policy": {"shell": {"approval": "at_or_above_risk", "risk": "high", "timeout_secs": 5}},
        "budget": {"max_steps": 10, "max_tokens": 100000, "max_attempts_per_step": 3}
    });
    assert!(
        validator.is_valid(&good),
        "{:?}",
        validator
            .iter_errors(&good)
            .map(|e| e.to_string())
            .collect::<Vec<_>>()
    );
    kedge_core::agent::AgentDefinition::parse(good.to_string().as_bytes())
        .expect("and the type takes it");
    let mut bad = good.clone();
    bad["policy"]["shell"]["timeout"] = 5.into();
    assert!(
        !validator.is_valid(&bad),
        "an unknown policy field is refused"
    );
}
