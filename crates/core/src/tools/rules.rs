//! The rules a tool's retry policy is held to when its agent is stored ([`RetryPolicy::check`]).

use super::{
    MAX_BACKOFF_MS, MAX_MULTIPLIER, MAX_TOOL_ATTEMPTS, RetryPolicy, ToolErrorClass, builtin,
};

impl RetryPolicy {
    /// The policy's rules, for `tool`: `Err((field under retry, reason))` names the first
    /// broken one (`attempts`, `initial_backoff_ms`, `max_backoff_ms`, `multiplier`, `jitter`,
    /// `on`, `idempotent`).
    pub fn check(&self, tool: &str) -> Result<(), (&'static str, String)> {
        let max_attempts = i64::from(MAX_TOOL_ATTEMPTS);
        if !(1..=max_attempts).contains(&self.attempts) {
            return Err((
                "attempts",
                format!("{} is outside 1..={max_attempts}", self.attempts),
            ));
        }
        if !(1..=MAX_BACKOFF_MS).contains(&self.initial_backoff_ms) {
            return Err((
                "initial_backoff_ms",
                format!(
                    "{} is outside 1..={MAX_BACKOFF_MS}",
                    self.initial_backoff_ms
                ),
            ));
        }
        if !(self.initial_backoff_ms..=MAX_BACKOFF_MS).contains(&self.max_backoff_ms) {
            return Err((
                "max_backoff_ms",
                format!(
                    "{} is outside {}..={MAX_BACKOFF_MS} (at least initial_backoff_ms)",
                    self.max_backoff_ms, self.initial_backoff_ms
                ),
            ));
        }
        if !(self.multiplier.is_finite() && (1.0..=MAX_MULTIPLIER).contains(&self.multiplier)) {
            return Err((
                "multiplier",
                format!("{} is outside 1..={MAX_MULTIPLIER}", self.multiplier),
            ));
        }
        if !(self.jitter.is_finite() && (0.0..=1.0).contains(&self.jitter)) {
            return Err(("jitter", format!("{} is outside 0..=1", self.jitter)));
        }
        if self.on.is_empty() {
            return Err((
                "on",
                "lists no error class, so nothing would be retried (leave `retry` out instead)"
                    .to_owned(),
            ));
        }
        if let Some(b) = builtin(tool) {
            if self.idempotent && !b.idempotent {
                return Err((
                    "idempotent",
                    format!("`{tool}` is a built-in that Kedge knows is not idempotent"),
                ));
            }
            if crate::fold::handled_by_step(tool) {
                return Err((
                    "on",
                    format!(
                        "`{tool}` is handled by the step service, not a tool runner: it has no attempts to retry"
                    ),
                ));
            }
        }
        if self.on.contains(&ToolErrorClass::Timeout) && !self.rerun_safe(tool) {
            return Err((
                "on",
                format!(
                    "`timeout` retries a call that may have taken effect: only for a tool that is \
                     safe to run again (read_file, write_file, list_files, or a tool declared \
                     `idempotent: true`, which must honour the operation id it is given); \
                     `{tool}` is not"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn refused(cases: Vec<(RetryPolicy, &str, &str)>) {
        for (p, tool, field) in cases {
            let (got, reason) = p.check(tool).expect_err(field);
            assert_eq!(got, field, "{tool} {p:?}: {reason}");
            assert!(!reason.is_empty());
        }
    }

    #[test]
    fn attempts_are_1_to_10() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    attempts: 0,
                    ..ok.clone()
                },
                "srv__t",
                "attempts",
            ),
            (
                RetryPolicy {
                    attempts: 11,
                    ..ok.clone()
                },
                "srv__t",
                "attempts",
            ),
            (
                RetryPolicy {
                    attempts: -1,
                    ..ok.clone()
                },
                "srv__t",
                "attempts",
            ),
        ]);
    }

    #[test]
    fn the_first_wait_is_1_ms_to_the_longest_backoff() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    initial_backoff_ms: -5,
                    ..ok.clone()
                },
                "srv__t",
                "initial_backoff_ms",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: 0,
                    ..ok.clone()
                },
                "srv__t",
                "initial_backoff_ms",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: 700_000,
                    max_backoff_ms: 700_000,
                    ..ok.clone()
                },
                "srv__t",
                "initial_backoff_ms",
            ),
        ]);
    }

    #[test]
    fn the_longest_wait_is_at_least_the_first_and_at_most_the_longest_backoff() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    max_backoff_ms: 999_999_999,
                    ..ok.clone()
                },
                "srv__t",
                "max_backoff_ms",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: 5_000,
                    max_backoff_ms: 1_000,
                    ..ok.clone()
                },
                "srv__t",
                "max_backoff_ms",
            ),
        ]);
    }

    #[test]
    fn the_multiplier_is_1_to_10() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    multiplier: 0.5,
                    ..ok.clone()
                },
                "srv__t",
                "multiplier",
            ),
            (
                RetryPolicy {
                    multiplier: 11.0,
                    ..ok.clone()
                },
                "srv__t",
                "multiplier",
            ),
        ]);
    }

    #[test]
    fn the_jitter_is_0_to_1() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    jitter: -0.1,
                    ..ok.clone()
                },
                "srv__t",
                "jitter",
            ),
            (
                RetryPolicy {
                    jitter: 1.5,
                    ..ok.clone()
                },
                "srv__t",
                "jitter",
            ),
        ]);
    }

    #[test]
    fn a_policy_lists_at_least_one_class() {
        let ok = RetryPolicy::default();
        refused(vec![(
            RetryPolicy {
                on: vec![],
                ..ok.clone()
            },
            "srv__t",
            "on",
        )]);
    }

    #[test]
    fn timeouts_are_retried_only_for_tools_safe_to_run_again() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    ..ok.clone()
                },
                "srv__t",
                "on",
            ),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    ..ok.clone()
                },
                "shell",
                "on",
            ),
        ]);
    }

    #[test]
    fn a_built_in_kedge_knows_is_not_idempotent_cannot_be_declared_so() {
        let ok = RetryPolicy::default();
        refused(vec![
            (
                RetryPolicy {
                    idempotent: true,
                    ..ok.clone()
                },
                "shell",
                "idempotent",
            ),
            (
                RetryPolicy {
                    idempotent: true,
                    ..ok.clone()
                },
                "ledger_append",
                "idempotent",
            ),
        ]);
    }

    #[test]
    fn a_tool_the_step_service_handles_has_no_attempts_to_retry() {
        let ok = RetryPolicy::default();
        refused(vec![(ok.clone(), "ask_user", "on")]);
    }

    #[test]
    fn policies_within_the_rules_pass() {
        let ok = RetryPolicy::default();
        for (p, tool) in [
            (ok.clone(), "srv__t"),
            (ok.clone(), "shell"),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    ..ok.clone()
                },
                "read_file",
            ),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    idempotent: true,
                    ..ok.clone()
                },
                "srv__t",
            ),
            (
                RetryPolicy {
                    idempotent: true,
                    ..ok.clone()
                },
                "write_file",
            ),
            (
                RetryPolicy {
                    attempts: 10,
                    initial_backoff_ms: 1,
                    max_backoff_ms: MAX_BACKOFF_MS,
                    multiplier: 10.0,
                    jitter: 1.0,
                    ..ok.clone()
                },
                "srv__t",
            ),
        ] {
            assert_eq!(p.check(tool), Ok(()), "{tool} {p:?}");
        }
    }

    #[test]
    fn unknown_fields_and_classes_are_refused_when_parsed() {
        // Unknown fields and classes are refused when parsed.
        assert!(serde_json::from_value::<RetryPolicy>(json!({"retries": 3})).is_err());
        assert!(serde_json::from_value::<RetryPolicy>(json!({"on": ["permanent"]})).is_err());
    }
}
