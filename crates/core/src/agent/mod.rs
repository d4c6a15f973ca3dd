//! Agent definitions: what a run of an agent is made of (prompt, model, tools, policy, budget).
//!
//! Definitions live in the `kedge_agents` KV bucket under the agent's name; the bucket's revision
//! history is the version history. A run freezes the revision and the digests of each part in
//! `run.created`, so a later edit never changes a run in flight.
//!
//! The module is split by role:
//! - `definition`: the definition's types and what a run reads of it;
//! - `tool` and `policy`: the tools it declares (and how a definition may write them) and their
//!   policies;
//! - `validate`: the rules a definition is held to before it is stored, one function per
//!   section, with `models` (the model and its fallbacks) and `compensation`.

mod compensation;
mod definition;
mod models;
mod policy;
mod tool;
mod validate;

pub use definition::{
    AgentDefinition, DEFAULT_FALLBACK_AFTER_SECS, DEFAULT_OUTPUT_RETRIES, FallbackModel,
    MAX_FALLBACKS, MAX_OUTPUT_RETRIES, OUTPUT_TOOL, OnEnd, OnInvalidOutput,
};
pub use policy::{
    ApprovalRule, CompensateDecl, DEFAULT_APPROVAL_TTL_SECS, MAX_TOOL_OUTPUT_BYTES,
    SANDBOXED_TOOLS, ToolPolicy,
};
pub use tool::ToolSpec;
pub use validate::{
    DefinitionError, MAX_APPROVAL_TTL_SECS, MAX_ATTEMPTS_PER_STEP, MAX_DEADLINE_SECS,
    MAX_OUTPUT_TOKENS, MAX_STEPS, MAX_TOOL_TIMEOUT_SECS, check_budget, valid_tool_name,
};

/// The definition the tests of this module start from.
#[cfg(test)]
fn def() -> serde_json::Value {
    serde_json::json!({
        "name": "demo",
        "system_prompt": "You are helpful.",
        "model": {"provider": "openai", "name": "mock-demo", "base_url": "http://127.0.0.1:1/v1"},
        "tools": [{"name": "read_file", "description": "Read a file",
                   "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
        "policy": {"read_file": {"approval": "never"}}
    })
}
