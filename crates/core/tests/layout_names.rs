//! The broker layout is named in one place: `kedge_core::subjects` (docs/ARCHITECTURE.md, "The
//! broker layout"). This test reads every product source file and fails when a string literal
//! outside the registry spells a stream, a bucket, the stream behind a bucket or a subject of
//! the layout; and it checks that every subject and bucket in the permissions file
//! (`nats/secure/permissions.json`, generated from the registry by
//! `kedge_runtime::secure::permissions`) belongs to the layout.

use std::path::{Path, PathBuf};

use kedge_core::subjects::{
    AGENTS_BUCKET, AGENTS_STREAM, BLOBS_BUCKET, BLOBS_STREAM, IDEMPOTENCY_BUCKET,
    IDEMPOTENCY_STREAM, LEASES_BUCKET, LEASES_STREAM, PROVIDERS_BUCKET, PROVIDERS_STREAM,
    QUOTAS_BUCKET, QUOTAS_STREAM, REJECTIONS_STREAM, RUNS_BUCKET, RUNS_BUCKET_STREAM, RUNS_STREAM,
    SCHEDULES_BUCKET, SCHEDULES_STREAM, SECRETS_BUCKET, SECRETS_STREAM, SLOTS_BUCKET, SLOTS_STREAM,
    TASKS_STREAM, TIMERS_STREAM,
};

/// Names of the layout: a literal holding one of them as a whole word is a spelling.
const NAMES: &[&str] = &[
    TASKS_STREAM,
    RUNS_STREAM,
    TIMERS_STREAM,
    REJECTIONS_STREAM,
    LEASES_BUCKET,
    IDEMPOTENCY_BUCKET,
    RUNS_BUCKET,
    AGENTS_BUCKET,
    PROVIDERS_BUCKET,
    QUOTAS_BUCKET,
    SECRETS_BUCKET,
    BLOBS_BUCKET,
    SLOTS_BUCKET,
    SLOTS_STREAM,
    LEASES_STREAM,
    IDEMPOTENCY_STREAM,
    RUNS_BUCKET_STREAM,
    AGENTS_STREAM,
    PROVIDERS_STREAM,
    QUOTAS_STREAM,
    SECRETS_STREAM,
    BLOBS_STREAM,
    SCHEDULES_BUCKET,
    SCHEDULES_STREAM,
];

/// Starts of subjects of the layout (Kedge's own trees and the broker's internal ones).
const SUBJECT_ROOTS: &[&str] = &[
    "agent.task",
    "agent.run",
    "agent.delta",
    "agent.rejected",
    "agent.approval",
    "agent.callback",
    "kedge.",
    "$KV.",
    "$O.",
    "$JS.",
    "$SYS.",
];

/// The metrics table's help texts: documentation an operator reads (like a comment), which
/// may say where a metric's subject of interest is recorded.
const HELP_TEXTS: &str = "crates/runtime/src/metrics.rs";

/// Crates whose sources are not product code: the test kit and the mock model server.
const NOT_PRODUCT: &[&str] = &["crates/testkit", "crates/mock-llm"];

/// The one module allowed to spell the layout (its files).
const REGISTRY: &str = "crates/core/src/subjects/";

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// Every product source file (`src/` of the crates and services), relative to the repo.
fn product_sources() -> Vec<(String, String)> {
    let root = repo();
    let mut files = Vec::new();
    for parent in ["crates", "services"] {
        let Ok(crates) = std::fs::read_dir(root.join(parent)) else {
            continue;
        };
        for c in crates.flatten() {
            rust_files(&c.path().join("src"), &mut files);
        }
    }
    let mut out = Vec::new();
    for path in files {
        let rel = path
            .strip_prefix(&root)
            .expect("under the repo")
            .to_string_lossy()
            .replace('\\', "/");
        // A unit-test module kept in a file of its own (`#[cfg(test)] mod tests;`) is a test.
        if rel.starts_with(REGISTRY)
            || NOT_PRODUCT.iter().any(|n| rel.starts_with(n))
            || rel.ends_with("/tests.rs")
        {
            continue;
        }
        let text = std::fs::read_to_string(&path).expect("readable source");
        out.push((rel, text));
    }
    assert!(out.len() > 50, "found the sources ({} files)", out.len());
    out
}

/// The string literals of a line of code (escapes kept as written). Raw strings are rare in
/// the product and hold JSON, not subjects.
fn literals(line: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let bytes = line.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] == b'\'' && i + 2 < bytes.len() && bytes[i + 2] == b'\'' {
            // A char literal such as '"'.
            i += 3;
            continue;
        }
        if bytes[i] == b'"' {
            let start = i + 1;
            let mut j = start;
            while j < bytes.len() && bytes[j] != b'"' {
                j += if bytes[j] == b'\\' { 2 } else { 1 };
            }
            out.push(&line[start..j.min(bytes.len())]);
            i = j + 1;
        } else {
            i += 1;
        }
    }
    out
}

fn is_word(b: u8) -> bool {
    b.is_ascii_alphanumeric() || b == b'_'
}

/// Whether `text` holds `name` as a whole word.
fn has_word(text: &str, name: &str) -> bool {
    text.match_indices(name).any(|(at, _)| {
        let before = text.as_bytes().get(at.wrapping_sub(1)).copied();
        let after = text.as_bytes().get(at + name.len()).copied();
        !before.is_some_and(is_word) && !after.is_some_and(is_word)
    })
}

/// Why a literal spells the layout, if it does.
fn spelling(literal: &str) -> Option<String> {
    if let Some(name) = NAMES.iter().find(|n| has_word(literal, n)) {
        return Some(format!("names `{name}`"));
    }
    SUBJECT_ROOTS
        .iter()
        .find(|root| {
            literal.match_indices(*root).any(|(at, _)| {
                let before = literal.as_bytes().get(at.wrapping_sub(1)).copied();
                let after = literal.as_bytes().get(at + root.len()).copied();
                let open = root.ends_with('.');
                !before.is_some_and(|b| is_word(b) || b == b'.' || b == b'/')
                    && if open {
                        after.is_some_and(|b| b.is_ascii_alphabetic() || b"*>{".contains(&b))
                    } else {
                        after.is_none_or(|b| b == b'.')
                    }
            })
        })
        .map(|root| format!("builds a subject under `{root}`"))
}

/// The code of a file a reader of the product sees: without its unit-test module and comments.
fn code_lines(text: &str) -> impl Iterator<Item = (usize, &str)> {
    let code = text
        .find("#[cfg(test)]\nmod tests")
        .map_or(text, |at| &text[..at]);
    code.lines()
        .enumerate()
        .map(|(n, l)| (n + 1, l))
        .filter(|(_, l)| {
            let t = l.trim_start();
            !t.starts_with("//") && !t.contains("include_str!(")
        })
}

#[test]
fn no_product_source_outside_the_registry_spells_the_layout() {
    let mut found = Vec::new();
    for (file, text) in product_sources() {
        for (n, line) in code_lines(&text) {
            let t = line.trim();
            if file == HELP_TEXTS && t.starts_with('"') && t.ends_with("\";") {
                continue;
            }
            for lit in literals(line) {
                if let Some(why) = spelling(lit) {
                    found.push(format!("{file}:{n}: \"{lit}\" {why}"));
                }
            }
        }
    }
    assert!(
        found.is_empty(),
        "the broker layout is spelled outside kedge_core::subjects; build these through the \
         registry:\n{}",
        found.join("\n")
    );
}

#[test]
fn the_check_finds_what_it_looks_for() {
    for spelled in [
        "agent.run.*.i.cancel.requested",
        "kedge.timer.fired.{run}.{timer}",
        "$KV.{bucket}.",
        "KV_kedge_runs",
        "open KEDGE_REJECTIONS",
        "kedge_idempotency unavailable: {0}",
        "$JS.API.CONSUMER.INFO.{stream}.{name}",
    ] {
        assert!(spelling(spelled).is_some(), "{spelled}");
    }
    for fine in [
        "kedge_runs_created_total",
        "KEDGE_RUNS_DIR",
        "kedge_mcp::stderr",
        "see docs/agent.md",
        "agent.schema.json",
        "tool.requested",
        "the agent. Then",
    ] {
        assert_eq!(spelling(fine), None, "{fine}");
    }
    assert_eq!(
        literals(r#"let s = format!("agent.x.{a}", b) + "kedge.y"; '"';"#),
        ["agent.x.{a}", "kedge.y"]
    );
}

/// Every entry of a JSON array of subjects under `value` (recursively).
fn subjects_in(value: &serde_json::Value, out: &mut Vec<String>) {
    match value {
        serde_json::Value::Array(items) => {
            for item in items {
                if let Some(s) = item.as_str() {
                    out.push(s.to_owned());
                } else {
                    subjects_in(item, out);
                }
            }
        }
        serde_json::Value::Object(map) => {
            for (key, v) in map {
                if key != "about" && key != "description" {
                    subjects_in(v, out);
                }
            }
        }
        _ => {}
    }
}

#[test]
fn every_subject_of_the_permissions_file_belongs_to_the_layout() {
    let text = std::fs::read_to_string(repo().join("nats/secure/permissions.json"))
        .expect("the permissions file");
    let perms: serde_json::Value = serde_json::from_str(&text).expect("JSON");
    let mut all = Vec::new();
    subjects_in(&perms, &mut all);
    assert!(all.len() > 50, "read the file ({} entries)", all.len());
    // The layout's buckets are named `kedge_…`; its streams are the rest of the names.
    let buckets: Vec<&str> = NAMES
        .iter()
        .copied()
        .filter(|n| n.starts_with("kedge_"))
        .collect();
    let streams: Vec<&str> = NAMES
        .iter()
        .copied()
        .filter(|n| !n.starts_with("kedge_"))
        .collect();
    for s in &all {
        let ok = if let Some((stream, name)) = s.split_once('/') {
            // A durable consumer entry.
            kedge_core::subjects::Durable::named(name).is_some_and(|d| d.stream() == stream)
        } else if let Some(rest) = s.strip_prefix("$KV.").or_else(|| s.strip_prefix("$O.")) {
            rest == ">" || buckets.iter().any(|b| rest.starts_with(&format!("{b}.")))
        } else if s.starts_with("$JS.") {
            // JetStream API subjects: any stream named must be the layout's (or a wildcard).
            s.split('.')
                .filter(|t| {
                    t.starts_with("KEDGE_") || t.starts_with("KV_") || t.starts_with("OBJ_")
                })
                .all(|t| streams.contains(&t))
        } else {
            ["agent.", "kedge.", "$SYS.", "_INBOX.", "_R_."]
                .iter()
                .any(|root| s.starts_with(root))
        };
        assert!(
            ok,
            "`{s}` in nats/secure/permissions.json is not of the layout"
        );
    }
}
