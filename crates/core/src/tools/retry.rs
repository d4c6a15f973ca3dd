//! Per-tool retry policies (`policy.<tool>.retry`): the error classes a runner reports, the
//! policy and its backoff, and the verdict on a failed attempt. The rules a stored policy is held
//! to are in `rules`.

use std::fmt;

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use super::builtin;
#[cfg(doc)]
use super::{NextAttempt, claim_dispatch};

/// Why a tool attempt failed, as its runner classifies it: the classes a `retry` policy may
/// retry. Any other failure (the tool's own error answer, arguments it refuses, a permission it
/// lacks) has no class: trying the same call again would fail the same way, so the model gets
/// it at once.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorClass {
    /// The attempt ran past its time limit (`policy.<tool>.timeout_secs`, else the tool
    /// service's `tool_timeout`) and was stopped. It may have done part or all of its work, so
    /// only a tool that is safe to run again is retried after one.
    Timeout,
    /// The call never reached the tool (an MCP server that could not be started or connected
    /// to); or, for a tool declared `idempotent`, the connection died with the call in flight.
    Transient,
    /// The tool refused the call for now, without running it, because of a rate limit.
    RateLimited,
}

impl ToolErrorClass {
    pub const ALL: &'static [ToolErrorClass] = &[
        ToolErrorClass::Timeout,
        ToolErrorClass::Transient,
        ToolErrorClass::RateLimited,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ToolErrorClass::Timeout => "timeout",
            ToolErrorClass::Transient => "transient",
            ToolErrorClass::RateLimited => "rate_limited",
        }
    }
}

impl fmt::Display for ToolErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Most attempts a tool's `retry` policy may ask for (the first included); a `tool.attempt`
/// numbered above it is no attempt ([`NextAttempt::after`]). Each attempt claims the
/// operation's record under its own number, 16 per dispatch ([`claim_dispatch`]).
pub const MAX_TOOL_ATTEMPTS: u32 = 10;
/// Longest wait between two attempts (ten minutes). An operation waiting for its next attempt
/// holds nothing; a run cancelled meanwhile does not wait for it (no attempt is running), and
/// the attempt, when it comes, is not run.
pub const MAX_BACKOFF_MS: i64 = 600_000;
/// Largest growth factor of the wait from one attempt to the next.
pub const MAX_MULTIPLIER: f64 = 10.0;

fn default_attempts() -> i64 {
    3
}
fn default_initial_backoff_ms() -> i64 {
    1_000
}
fn default_max_backoff_ms() -> i64 {
    30_000
}
fn default_multiplier() -> f64 {
    2.0
}
fn default_jitter() -> f64 {
    0.5
}
fn default_on() -> Vec<ToolErrorClass> {
    vec![ToolErrorClass::Transient, ToolErrorClass::RateLimited]
}
fn is_false(b: &bool) -> bool {
    !*b
}

/// A tool's retry policy (`policy.<tool>.retry`): how often an operation of the tool is tried,
/// how long the runner waits between attempts, and which failures are tried again. Frozen with
/// the agent revision and carried by every `tool.requested` of the tool, so a run keeps the
/// policy it started with. A tool without one is tried once, as before there were policies.
///
/// Every attempt runs under the same operation id (its claim in `kedge_idempotency`, its
/// `tool.started`, and for a retried one `tool.attempt`); the model sees one result, the last
/// attempt's. The numbers are signed on the wire so that a negative one is refused naming its
/// field ([`RetryPolicy::check`]); the accessors return them checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all, the first included: 1 to 10 (default 3).
    #[serde(default = "default_attempts")]
    #[schemars(range(min = 1, max = 10))]
    pub attempts: i64,
    /// Wait after the first failed attempt, in milliseconds: 1 to 600000 (default 1000).
    #[serde(default = "default_initial_backoff_ms")]
    #[schemars(range(min = 1, max = 600_000))]
    pub initial_backoff_ms: i64,
    /// Longest wait between two attempts, in milliseconds: `initial_backoff_ms` to 600000
    /// (default 30000).
    #[serde(default = "default_max_backoff_ms")]
    #[schemars(range(min = 1, max = 600_000))]
    pub max_backoff_ms: i64,
    /// Growth of the wait per failed attempt: 1 to 10 (default 2).
    #[serde(default = "default_multiplier")]
    #[schemars(range(min = 1, max = 10))]
    pub multiplier: f64,
    /// Share of each wait drawn at random, 0 to 1 (default 0.5): the wait is uniform in
    /// `[(1 - jitter) * w, w]`, so operations that failed together do not retry together.
    #[serde(default = "default_jitter")]
    #[schemars(range(min = 0, max = 1))]
    pub jitter: f64,
    /// The error classes that are retried (default `transient`, `rate_limited`: failures where
    /// the call never ran). `timeout` only for a tool that is safe to run again.
    #[serde(default = "default_on")]
    #[schemars(length(min = 1))]
    pub on: Vec<ToolErrorClass>,
    /// The tool may run twice for one operation without a second effect: it honours the
    /// operation id it is given (an MCP server: `_meta."kedge/operation_id"`). Lets `timeout`
    /// be retried, a connection lost mid-call count as `transient` instead of an ambiguous
    /// outcome, and an attempt whose runner died be run again rather than asked about. Kedge
    /// knows its built-ins: only others may declare it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub idempotent: bool,
}

// JSON numbers are never NaN, and `check` refuses what is not finite: equality is total.
impl Eq for RetryPolicy {}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: default_attempts(),
            initial_backoff_ms: default_initial_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            multiplier: default_multiplier(),
            jitter: default_jitter(),
            on: default_on(),
            idempotent: false,
        }
    }
}

/// Exponential backoff with jitter: the wait after the `n`-th failure is `initial *
/// multiplier^(n-1)`, at most `max`, of which the share `jitter` is drawn at random.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: std::time::Duration,
    pub max: std::time::Duration,
    pub multiplier: f64,
    pub jitter: f64,
}

impl Backoff {
    /// The wait after failure number `failed` (1 for the first), given `draw`, a uniformly
    /// random `u64` the caller supplies (the core has no randomness: the runner draws it and
    /// journals the wait it chose). `draw = 0` waits the whole ceiling, `u64::MAX` the least.
    /// Never more than `max`, never negative, whatever the inputs.
    pub fn delay(&self, failed: u32, draw: u64) -> std::time::Duration {
        let max_ms = self.max.as_secs_f64() * 1_000.0;
        let exponent = i32::try_from(failed.saturating_sub(1).min(1_000)).unwrap_or(1_000);
        let multiplier = if self.multiplier.is_finite() {
            self.multiplier.max(1.0)
        } else {
            1.0
        };
        let ceiling =
            (self.initial.as_secs_f64() * 1_000.0 * multiplier.powi(exponent)).min(max_ms);
        let jitter = if self.jitter.is_finite() {
            self.jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let share = draw as f64 / u64::MAX as f64;
        let ms = (ceiling * (1.0 - jitter * share)).clamp(0.0, max_ms);
        std::time::Duration::from_millis(ms.round() as u64)
    }
}

/// What the runner does after an attempt that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Journal the attempt (`tool.attempt`) and run attempt `next` after `delay`.
    Retry {
        next: u32,
        delay: std::time::Duration,
    },
    /// The model gets this attempt's error.
    GiveUp(GiveUp),
}

/// Why a failed attempt is the operation's last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUp {
    /// The failure has no retryable class (the tool's own error answer): the model reads it.
    NotRetryable,
    /// The policy does not list the class (or there is no policy).
    NotListed(ToolErrorClass),
    /// A timeout of a tool that is not safe to run again: it may have taken effect.
    NotSafeToRerun,
    /// Every attempt the policy allows has been made.
    Exhausted { attempts: u32 },
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GiveUp::NotRetryable => f.write_str("not retried: the tool's own error"),
            GiveUp::NotListed(c) => {
                write!(f, "not retried: the tool's retry policy does not list {c}")
            }
            GiveUp::NotSafeToRerun => f.write_str(
                "not retried: the tool is not known to be safe to run again after a timeout",
            ),
            GiveUp::Exhausted { attempts } => write!(f, "gave up after {attempts} attempts"),
        }
    }
}

impl RetryPolicy {
    /// Attempts in all (checked: 1..=[`MAX_TOOL_ATTEMPTS`]).
    pub fn max_attempts(&self) -> u32 {
        u32::try_from(self.attempts)
            .unwrap_or(1)
            .clamp(1, MAX_TOOL_ATTEMPTS)
    }

    /// The policy's backoff (numbers clamped to their checked ranges).
    pub fn backoff(&self) -> Backoff {
        let ms = |v: i64| {
            std::time::Duration::from_millis(u64::try_from(v.clamp(0, MAX_BACKOFF_MS)).unwrap_or(0))
        };
        Backoff {
            initial: ms(self.initial_backoff_ms),
            max: ms(self.max_backoff_ms.max(self.initial_backoff_ms)),
            multiplier: self.multiplier,
            jitter: self.jitter,
        }
    }

    /// Whether running `tool` again for the same operation is safe: Kedge's idempotent
    /// built-ins, or a tool the policy declares idempotent.
    pub fn rerun_safe(&self, tool: &str) -> bool {
        match builtin(tool) {
            Some(b) => b.idempotent,
            None => self.idempotent,
        }
    }

    /// What follows attempt `attempt` (1 for the first) of an operation of `tool` that failed
    /// with `class` (`None`: the tool's own error). `draw` is a uniformly random `u64` for the
    /// jitter. Pure: the runner journals what it decided.
    pub fn after_failure(
        &self,
        tool: &str,
        attempt: u32,
        class: Option<ToolErrorClass>,
        draw: u64,
    ) -> Verdict {
        let Some(class) = class else {
            return Verdict::GiveUp(GiveUp::NotRetryable);
        };
        if !self.on.contains(&class) {
            return Verdict::GiveUp(GiveUp::NotListed(class));
        }
        if class == ToolErrorClass::Timeout && !self.rerun_safe(tool) {
            return Verdict::GiveUp(GiveUp::NotSafeToRerun);
        }
        let attempts = self.max_attempts();
        if attempt >= attempts {
            return Verdict::GiveUp(GiveUp::Exhausted { attempts });
        }
        Verdict::Retry {
            next: attempt + 1,
            delay: self.backoff().delay(attempt, draw),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn policy(on: &[ToolErrorClass], attempts: i64, idempotent: bool) -> RetryPolicy {
        RetryPolicy {
            attempts,
            on: on.to_vec(),
            idempotent,
            ..RetryPolicy::default()
        }
    }

    /// Every subset of the classes.
    fn subsets() -> Vec<Vec<ToolErrorClass>> {
        (0..(1u32 << ToolErrorClass::ALL.len()))
            .map(|mask| {
                ToolErrorClass::ALL
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, c)| *c)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn which_failures_are_retried_for_every_class_list_safety_and_attempt() {
        let classes: Vec<Option<ToolErrorClass>> = std::iter::once(None)
            .chain(ToolErrorClass::ALL.iter().copied().map(Some))
            .collect();
        for on in subsets() {
            for (tool, declared_idempotent, safe) in [
                ("read_file", false, true),
                ("ledger_append", false, false),
                ("srv__tool", false, false),
                ("srv__tool", true, true),
            ] {
                let p = policy(&on, 3, declared_idempotent);
                assert_eq!(p.rerun_safe(tool), safe, "{tool}");
                for class in &classes {
                    for attempt in 1..=4u32 {
                        let verdict = p.after_failure(tool, attempt, *class, 0);
                        let expected = match class {
                            None => Verdict::GiveUp(GiveUp::NotRetryable),
                            Some(c) if !on.contains(c) => Verdict::GiveUp(GiveUp::NotListed(*c)),
                            Some(ToolErrorClass::Timeout) if !safe => {
                                Verdict::GiveUp(GiveUp::NotSafeToRerun)
                            }
                            Some(_) if attempt >= 3 => {
                                Verdict::GiveUp(GiveUp::Exhausted { attempts: 3 })
                            }
                            Some(_) => Verdict::Retry {
                                next: attempt + 1,
                                delay: p.backoff().delay(attempt, 0),
                            },
                        };
                        assert_eq!(
                            verdict, expected,
                            "{tool} on={on:?} {class:?} attempt {attempt}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_default_policy_retries_only_failures_that_never_ran() {
        let p: RetryPolicy = serde_json::from_value(json!({})).expect("defaults");
        assert_eq!(p, RetryPolicy::default());
        assert_eq!(p.max_attempts(), 3);
        assert_eq!(
            p.on,
            [ToolErrorClass::Transient, ToolErrorClass::RateLimited]
        );
        assert!(p.check("srv__tool").is_ok());
        assert!(matches!(
            p.after_failure("srv__tool", 1, Some(ToolErrorClass::Timeout), 0),
            Verdict::GiveUp(GiveUp::NotListed(ToolErrorClass::Timeout))
        ));
        // One attempt: never retried, whatever the class.
        let once = policy(ToolErrorClass::ALL, 1, true);
        for c in ToolErrorClass::ALL {
            assert_eq!(
                once.after_failure("srv__tool", 1, Some(*c), 0),
                Verdict::GiveUp(GiveUp::Exhausted { attempts: 1 })
            );
        }
    }

    #[test]
    fn backoff_grows_is_capped_and_its_jitter_stays_in_range() {
        let ms = std::time::Duration::from_millis;
        let b = Backoff {
            initial: ms(100),
            max: ms(1_000),
            multiplier: 2.0,
            jitter: 0.5,
        };
        // draw 0: the whole ceiling; u64::MAX: the ceiling less the jitter share.
        assert_eq!(b.delay(1, 0), ms(100));
        assert_eq!(b.delay(2, 0), ms(200));
        assert_eq!(b.delay(3, 0), ms(400));
        assert_eq!(b.delay(4, 0), ms(800));
        assert_eq!(b.delay(5, 0), ms(1_000), "capped");
        assert_eq!(b.delay(u32::MAX, 0), ms(1_000), "no overflow");
        assert_eq!(b.delay(1, u64::MAX), ms(50));
        assert_eq!(b.delay(9, u64::MAX), ms(500));
        assert_eq!(b.delay(0, 0), ms(100), "attempt 0 counts as the first");
        for failed in 1..=12 {
            let ceiling = b.delay(failed, 0);
            for draw in [1, u64::MAX / 3, u64::MAX / 2, u64::MAX - 1] {
                let d = b.delay(failed, draw);
                assert!(
                    d <= ceiling && d >= ceiling / 2,
                    "{failed} {draw}: {d:?} vs {ceiling:?}"
                );
            }
            assert!(b.delay(failed + 1, 0) >= ceiling, "never shrinks");
        }
        // Different draws give different waits (the point of jitter).
        assert_ne!(b.delay(3, u64::MAX / 4), b.delay(3, u64::MAX / 4 * 3));
        // No jitter: deterministic. Full jitter: anywhere down to zero.
        let exact = Backoff { jitter: 0.0, ..b };
        assert_eq!(exact.delay(2, u64::MAX), ms(200));
        let full = Backoff { jitter: 1.0, ..b };
        assert_eq!(full.delay(2, u64::MAX), ms(0));
        // Nonsense numbers (never stored: `check` refuses them) still give a wait within max.
        for bad in [f64::NAN, f64::INFINITY, -3.0, 0.0] {
            let b = Backoff {
                multiplier: bad,
                jitter: bad,
                ..b
            };
            assert!(b.delay(7, u64::MAX / 2) <= ms(1_000), "{bad}");
        }
    }
}
