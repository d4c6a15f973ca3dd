//! Crash injection for the fault tests: `KEDGE_FAILPOINTS=step.after_model_stored,…` makes the
//! process abort (as abruptly as `kill -9`, no cleanup) when it reaches a named point.
//!
//! The points are named where they are hit; docs/CONFIG.md lists them. With the variable unset
//! a hit costs one atomic load.

use std::sync::OnceLock;

fn armed() -> &'static [String] {
    static ARMED: OnceLock<Vec<String>> = OnceLock::new();
    ARMED.get_or_init(|| {
        std::env::var("KEDGE_FAILPOINTS")
            .map(|v| {
                v.split(',')
                    .map(|s| s.trim().to_owned())
                    .filter(|s| !s.is_empty())
                    .collect()
            })
            .unwrap_or_default()
    })
}

/// Aborts the process if `name` is armed.
pub fn hit(name: &str) {
    if armed().iter().any(|a| a == name) {
        eprintln!("kedge: failpoint {name} hit, aborting");
        std::process::abort();
    }
}
