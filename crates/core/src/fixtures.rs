//! Events that the tests and benches of several crates build alike (feature `test-util`; this
//! crate's own tests have it). `kedge_testkit::fixtures` re-exports them.

use crate::event::{Budget, Digest, Envelope, ModelSpec, Provider, RunCreated};

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
        concurrency: None,
    }
}

/// A journal recorded by an earlier build (`crates/core/tests/fixtures/<name>.jsonl`: one
/// `{"seq": …, "event": <envelope>}` per line), each envelope's digest checked.
///
/// # Panics
/// If the file cannot be read or a line is not a valid envelope (a broken fixture).
#[allow(clippy::expect_used)]
pub fn load_journal(path: &std::path::Path) -> Vec<(u64, Envelope)> {
    let text = std::fs::read_to_string(path).expect("a readable fixture");
    text.lines()
        .filter(|line| !line.trim().is_empty())
        .map(|line| {
            let v: serde_json::Value = serde_json::from_str(line).expect("a JSON line");
            let seq = v["seq"].as_u64().expect("seq");
            let bytes = serde_json::to_vec(&v["event"]).expect("json");
            let env = Envelope::from_json_bytes(&bytes).expect("an envelope with a valid digest");
            (seq, env)
        })
        .collect()
}

/// Every journal recorded by earlier builds (see [`load_journal`]), with its path, in name
/// order: what every later build must keep replaying.
///
/// # Panics
/// If the fixtures directory or a fixture cannot be read.
#[allow(clippy::expect_used)]
pub fn recorded_journals() -> Vec<(std::path::PathBuf, Vec<(u64, Envelope)>)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let mut paths: Vec<_> = std::fs::read_dir(dir)
        .expect("the fixtures directory")
        .map(|entry| entry.expect("a fixture").path())
        .filter(|path| path.extension().and_then(|e| e.to_str()) == Some("jsonl"))
        .collect();
    paths.sort();
    paths
        .into_iter()
        .map(|path| {
            let journal = load_journal(&path);
            (path, journal)
        })
        .collect()
}
