//! Events that the tests and benches of several crates build alike (feature `test-util`; this
//! crate's own tests have it). `kedge_testkit::fixtures` re-exports them.

use crate::event::{Budget, Digest, ModelSpec, Provider, RunCreated};

/// A `run.created` as the core would freeze it: agent `agent` (revision 1) on the mock model,
/// tenant `acme`, input `input`, no caller, budget or parent. Tests change what they need with
/// struct update syntax (`RunCreated { caller: …, ..run_created("a", "hi") }`).
///
/// # Panics
/// If `agent` is not a valid agent name (a test's mistake).
#[allow(clippy::expect_used)]
pub fn run_created(agent: &str, input: &str) -> RunCreated {
    RunCreated {
        agent: agent.parse().expect("a valid agent name"),
        agent_revision: 1,
        agent_digest: Digest::of_bytes(b"agent"),
        model: ModelSpec {
            provider: Provider::Openai,
            name: "mock".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        },
        prompt_digest: Digest::of_bytes(b"prompt"),
        tools_digest: Digest::of_bytes(b"tools"),
        policy_digest: Digest::of_bytes(b"policy"),
        budget: Budget::default(),
        tenant: "acme".parse().expect("a valid tenant"),
        caller: None,
        idempotency_key: None,
        input: input.into(),
        runtime_version: "test".into(),
        metadata: Default::default(),
        traceparent: None,
        parent: None,
    }
}
