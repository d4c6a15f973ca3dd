//! The JSON Schemas under `schemas/`, generated from the Rust types.
//!
//! `schemas/` is what non-Rust clients read; the test `schemas_match_the_types` fails when a file
//! there differs from what the types generate (run it with `KEDGE_BLESS=1` to rewrite them).

use crate::agent::AgentDefinition;
use crate::event::{Envelope, Event};
use crate::task::{TaskRejection, TaskSubmission};

/// Every schema document: (path under `schemas/`, pretty JSON text with a trailing newline).
pub fn documents() -> Vec<(String, String)> {
    let mut docs = vec![
        (
            "task.schema.json".to_owned(),
            schemars::schema_for!(TaskSubmission),
        ),
        (
            "task-rejection.schema.json".to_owned(),
            schemars::schema_for!(TaskRejection),
        ),
        (
            "envelope.schema.json".to_owned(),
            schemars::schema_for!(Envelope),
        ),
        (
            "agent.schema.json".to_owned(),
            schemars::schema_for!(AgentDefinition),
        ),
    ];
    for (event_type, schema) in Event::data_schemas() {
        docs.push((
            format!("events/{}.schema.json", event_type.as_str()),
            schema,
        ));
    }
    docs.into_iter()
        .map(|(path, schema)| {
            let mut text = serde_json::to_string_pretty(&schema).unwrap_or_default();
            text.push('\n');
            (path, text)
        })
        .collect()
}
