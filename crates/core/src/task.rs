//! The task a client publishes to `agent.task.<agent>` to start a run.
//!
//! Validation here is pure: intake calls [`TaskSubmission::parse`] and answers a rejection naming
//! the field. The client's `Nats-Msg-Id` is the idempotency key and is not part of the body.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::event::Budget;
use crate::ids::{AgentName, RunId};

/// Largest accepted `input`, in bytes. A task is one NATS message, so this stays under
/// nats-server's default `max_payload` (1 MiB) with the rest of the task beside it; in the journal
/// an input over 64 KiB goes by reference (`kedge_blobs`).
pub const MAX_INPUT_BYTES: usize = 768 * 1024;
/// Largest accepted task body, in bytes (under the broker's default 1 MiB `max_payload`).
pub const MAX_TASK_BYTES: usize = 960 * 1024;

/// A task submission.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct TaskSubmission {
    /// The agent to run; must match the subject's last token when published over NATS.
    pub agent: AgentName,
    /// The user's first message.
    pub input: String,
    /// A run id of the client's choosing (`run_` + up to 64 of `[A-Za-z0-9_-]`), scoped to the
    /// tenant: the run is `run_` + the first 32 hex digits of SHA-256 of
    /// `chosen\0<tenant>\0<run_id>`, which the client can compute to follow it at once.
    /// Intake generates one when absent.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub run_id: Option<RunId>,
    /// Tightens the agent's default budget; a field left out keeps the default.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub budget: Option<BudgetOverride>,
    /// Free-form metadata, copied into `run.created`.
    #[serde(default, skip_serializing_if = "serde_json::Map::is_empty")]
    pub metadata: serde_json::Map<String, serde_json::Value>,
    /// At most `limit` runs of the key the template `key` expands to over this task, in its
    /// tenant, run at once; the others wait `queued` (docs/API.md "Tasks"). Absent: the agent's
    /// `concurrency`, if any.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub concurrency: Option<crate::concurrency::ConcurrencySpec>,
    /// The run's place among its key's waiting runs: higher first, -1000..=1000. Absent: the
    /// agent's `priority`, else 0.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub priority: Option<i32>,
}

impl TaskSubmission {
    /// A task of `agent` with `input` and nothing else: no chosen run id, the agent's budget,
    /// concurrency and priority, no metadata.
    pub fn new(agent: AgentName, input: impl Into<String>) -> Self {
        TaskSubmission {
            agent,
            input: input.into(),
            run_id: None,
            budget: None,
            metadata: Default::default(),
            concurrency: None,
            priority: None,
        }
    }
}

/// Per-task budget limits.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct BudgetOverride {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_steps: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_tokens: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_attempts_per_step: Option<u32>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub deadline_secs: Option<u64>,
    /// In the currency of the agent's `model.price` (an agent without a price refuses it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_cost: Option<f64>,
}

impl BudgetOverride {
    /// The agent's default with each given limit applied; a task can only tighten a limit.
    pub fn apply_to(&self, default: &Budget) -> Budget {
        let min_opt = |a: Option<u64>, b: Option<u64>| match (a, b) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        };
        Budget {
            max_steps: self
                .max_steps
                .map_or(default.max_steps, |v| v.min(default.max_steps)),
            max_tokens: self
                .max_tokens
                .map_or(default.max_tokens, |v| v.min(default.max_tokens)),
            max_attempts_per_step: self
                .max_attempts_per_step
                .map_or(default.max_attempts_per_step, |v| {
                    v.min(default.max_attempts_per_step)
                }),
            deadline_secs: min_opt(self.deadline_secs, default.deadline_secs),
            max_cost: match (self.max_cost, default.max_cost) {
                (Some(a), Some(b)) => Some(a.min(b)),
                (a, b) => a.or(b),
            },
        }
    }
}

/// Why a task was refused, naming the field at fault.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct TaskRejection {
    /// The offending field (`input`, `budget.max_steps`, …), or `body` for the whole message.
    pub field: String,
    pub reason: String,
    /// Seconds after which the same task may be accepted: set when a tenant quota refused it
    /// (`field` is `quota.<name>`; docs/ARCHITECTURE.md "Quotas").
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub retry_after_secs: Option<u64>,
}

impl TaskRejection {
    pub fn new(field: impl Into<String>, reason: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            reason: reason.into(),
            retry_after_secs: None,
        }
    }

    /// The rejection of a task a tenant quota refused.
    pub fn quota(e: &crate::quota::Exceeded) -> Self {
        Self {
            field: format!("quota.{}", e.quota.as_str()),
            reason: e.reason(),
            retry_after_secs: Some(e.retry_after_secs),
        }
    }
}

impl TaskSubmission {
    /// Parses and validates a task body.
    pub fn parse(body: &[u8]) -> Result<TaskSubmission, TaskRejection> {
        if body.len() > MAX_TASK_BYTES {
            return Err(TaskRejection::new(
                "body",
                format!(
                    "{} bytes is over the {MAX_TASK_BYTES}-byte limit",
                    body.len()
                ),
            ));
        }
        let value: serde_json::Value = serde_json::from_slice(body)
            .map_err(|e| TaskRejection::new("body", format!("not valid JSON: {e}")))?;
        let obj = value
            .as_object()
            .ok_or_else(|| TaskRejection::new("body", "must be a JSON object"))?;
        check_known(
            obj,
            "",
            &[
                "agent",
                "input",
                "run_id",
                "budget",
                "metadata",
                "concurrency",
                "priority",
            ],
        )?;
        let budget = match obj.get("budget") {
            Some(serde_json::Value::Object(b)) => {
                check_known(
                    b,
                    "budget.",
                    &[
                        "max_steps",
                        "max_tokens",
                        "max_attempts_per_step",
                        "deadline_secs",
                        "max_cost",
                    ],
                )?;
                Some(BudgetOverride {
                    max_steps: field(b, "budget.", "max_steps")?,
                    max_tokens: field(b, "budget.", "max_tokens")?,
                    max_attempts_per_step: field(b, "budget.", "max_attempts_per_step")?,
                    deadline_secs: field(b, "budget.", "deadline_secs")?,
                    max_cost: field(b, "budget.", "max_cost")?,
                })
            }
            None | Some(serde_json::Value::Null) => None,
            Some(_) => return Err(TaskRejection::new("budget", "must be an object")),
        };
        let task = TaskSubmission {
            agent: required(obj, "agent")?,
            input: required(obj, "input")?,
            run_id: field(obj, "", "run_id")?,
            budget,
            metadata: field(obj, "", "metadata")?.unwrap_or_default(),
            concurrency: field(obj, "", "concurrency")?,
            priority: field(obj, "", "priority")?,
        };
        task.validate()?;
        Ok(task)
    }

    fn validate(&self) -> Result<(), TaskRejection> {
        if let Some(c) = &self.concurrency {
            c.validate("concurrency")?;
        }
        if let Some(p) = self.priority {
            crate::concurrency::check_priority("priority", p)?;
        }
        if self.input.trim().is_empty() {
            return Err(TaskRejection::new("input", "must not be empty"));
        }
        if self.input.len() > MAX_INPUT_BYTES {
            return Err(TaskRejection::new(
                "input",
                format!(
                    "{} bytes is over the {MAX_INPUT_BYTES}-byte limit",
                    self.input.len()
                ),
            ));
        }
        if let Some(b) = &self.budget {
            // Every number is range-checked here, where it enters: a deadline of `u64::MAX`
            // seconds must be a rejection naming the field, not arithmetic trouble later.
            use crate::agent::{MAX_ATTEMPTS_PER_STEP, MAX_DEADLINE_SECS, MAX_STEPS};
            for (field, value, max) in [
                (
                    "budget.max_steps",
                    b.max_steps.map(u64::from),
                    u64::from(MAX_STEPS),
                ),
                ("budget.max_tokens", b.max_tokens, u64::MAX),
                (
                    "budget.max_attempts_per_step",
                    b.max_attempts_per_step.map(u64::from),
                    u64::from(MAX_ATTEMPTS_PER_STEP),
                ),
                ("budget.deadline_secs", b.deadline_secs, MAX_DEADLINE_SECS),
            ] {
                match value {
                    Some(0) => return Err(TaskRejection::new(field, "must be at least 1")),
                    Some(v) if v > max => {
                        return Err(TaskRejection::new(
                            field,
                            format!("{v} is over the limit of {max}"),
                        ));
                    }
                    _ => {}
                }
            }
            if let Some(c) = b.max_cost
                && !(c.is_finite() && c > 0.0)
            {
                return Err(TaskRejection::new(
                    "budget.max_cost",
                    format!("{c} must be a number > 0"),
                ));
            }
        }
        Ok(())
    }
}

type Object = serde_json::Map<String, serde_json::Value>;

fn check_known(obj: &Object, prefix: &str, known: &[&str]) -> Result<(), TaskRejection> {
    match obj.keys().find(|k| !known.contains(&k.as_str())) {
        Some(k) => Err(TaskRejection::new(
            format!("{prefix}{k}"),
            format!("unknown field; expected one of {}", known.join(", ")),
        )),
        None => Ok(()),
    }
}

/// An optional field, deserialized on its own so that an error names it.
fn field<T: serde::de::DeserializeOwned>(
    obj: &Object,
    prefix: &str,
    name: &str,
) -> Result<Option<T>, TaskRejection> {
    match obj.get(name) {
        None | Some(serde_json::Value::Null) => Ok(None),
        Some(v) => serde_json::from_value(v.clone())
            .map(Some)
            .map_err(|e| TaskRejection::new(format!("{prefix}{name}"), e.to_string())),
    }
}

fn required<T: serde::de::DeserializeOwned>(obj: &Object, name: &str) -> Result<T, TaskRejection> {
    field(obj, "", name)?.ok_or_else(|| TaskRejection::new(name, "is required"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_valid_task_parses() {
        let t = TaskSubmission::parse(
            br#"{"agent":"demo","input":"hi","run_id":"run_x1","budget":{"max_steps":3}}"#,
        )
        .expect("valid");
        assert_eq!(t.agent.as_str(), "demo");
        assert_eq!(t.run_id.map(String::from).as_deref(), Some("run_x1"));
        let t = TaskSubmission::parse(
            br#"{"agent":"demo","input":"hi","metadata":{"ticket":7},"priority":-3,
                 "concurrency":{"key":"ticket-{metadata.ticket}","limit":1}}"#,
        )
        .expect("valid");
        assert_eq!(t.priority, Some(-3));
        let c = t.concurrency.expect("a key");
        let run = c
            .resolve("concurrency", &t.agent, &t.metadata, -3)
            .expect("expands");
        assert_eq!(
            (run.key.as_str(), run.limit, run.priority),
            ("ticket-7", 1, -3)
        );
    }

    #[test]
    fn rejections_name_the_field() {
        let cases: &[(&[u8], &str)] = &[
            (br#"{"input":"hi"}"#, "agent"),
            (br#"{"agent":"demo"}"#, "input"),
            (br#"{"agent":"demo","input":"  "}"#, "input"),
            (br#"{"agent":"de.mo","input":"hi"}"#, "agent"),
            (
                br#"{"agent":"demo","input":"hi","run_id":"apr_1"}"#,
                "run_id",
            ),
            (br#"{"agent":"demo","input":"hi","colour":"red"}"#, "colour"),
            (
                br#"{"agent":"demo","input":"hi","budget":{"max_steps":0}}"#,
                "budget.max_steps",
            ),
            (
                br#"{"agent":"demo","input":"hi","budget":{"deadline_secs":18446744073709551615}}"#,
                "budget.deadline_secs",
            ),
            (
                br#"{"agent":"demo","input":"hi","budget":{"deadline_secs":-1}}"#,
                "budget.deadline_secs",
            ),
            (
                br#"{"agent":"demo","input":"hi","budget":{"deadline_secs":1e300}}"#,
                "budget.deadline_secs",
            ),
            (
                br#"{"agent":"demo","input":"hi","budget":{"max_steps":4294967295}}"#,
                "budget.max_steps",
            ),
            (
                br#"{"agent":"demo","input":"hi","budget":{"max_attempts_per_step":1000}}"#,
                "budget.max_attempts_per_step",
            ),
            (b"not json", "body"),
            (
                br#"{"agent":"demo","input":"hi","concurrency":{"key":"{x}","limit":1}}"#,
                "concurrency.key",
            ),
            (
                br#"{"agent":"demo","input":"hi","concurrency":{"key":"k","limit":0}}"#,
                "concurrency.limit",
            ),
            (
                br#"{"agent":"demo","input":"hi","concurrency":{"key":"k"}}"#,
                "concurrency",
            ),
            (
                br#"{"agent":"demo","input":"hi","concurrency":{"key":"k","limit":1,"x":1}}"#,
                "concurrency",
            ),
            (
                br#"{"agent":"demo","input":"hi","priority":1001}"#,
                "priority",
            ),
            (
                br#"{"agent":"demo","input":"hi","priority":"high"}"#,
                "priority",
            ),
        ];
        for (body, field) in cases {
            let err = TaskSubmission::parse(body).expect_err("rejected");
            assert_eq!(
                err.field,
                *field,
                "{}: {err:?}",
                String::from_utf8_lossy(body)
            );
        }
        let big = format!(
            r#"{{"agent":"demo","input":"{}"}}"#,
            "x".repeat(MAX_INPUT_BYTES + 1)
        );
        assert_eq!(
            TaskSubmission::parse(big.as_bytes())
                .expect_err("too big")
                .field,
            "input"
        );
    }

    #[test]
    fn a_task_budget_only_tightens() {
        let default = Budget::default();
        let o = BudgetOverride {
            max_steps: Some(5),
            max_tokens: Some(u64::MAX),
            ..Default::default()
        };
        let b = o.apply_to(&default);
        assert_eq!(b.max_steps, 5);
        assert_eq!(b.max_tokens, default.max_tokens);
    }
}
