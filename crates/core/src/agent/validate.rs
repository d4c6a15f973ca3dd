//! The rules a definition is held to before it is stored ([`AgentDefinition::validate`]): each
//! section is checked by a function of its own, in a fixed order, and the first broken rule is
//! reported naming its field. The model and its fallbacks are checked in `models`, the
//! reversibility declarations in `compensation`.

use super::{
    AgentDefinition, MAX_OUTPUT_RETRIES, MAX_TOOL_OUTPUT_BYTES, OUTPUT_TOOL, OnInvalidOutput,
    SANDBOXED_TOOLS,
};
use crate::event::Budget;

/// A definition that cannot be stored.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {reason}")]
pub struct DefinitionError {
    pub field: String,
    pub reason: String,
}

/// Most steps a run may be given.
pub const MAX_STEPS: u32 = 100_000;
/// Most attempts per step.
pub const MAX_ATTEMPTS_PER_STEP: u32 = 100;
/// Longest run deadline (a year): the timer service holds the deadline timer that long.
pub const MAX_DEADLINE_SECS: u64 = 366 * 24 * 3600;
/// Longest approval validity (the approval's expiry is a durable timer).
pub const MAX_APPROVAL_TTL_SECS: u64 = 366 * 24 * 3600;
/// Longest per-tool time limit (it can only tighten the tool service's own `tool_timeout`).
pub const MAX_TOOL_TIMEOUT_SECS: u64 = 24 * 3600;
/// Largest `max_output_tokens`.
pub const MAX_OUTPUT_TOKENS: u64 = 1 << 20;

/// A refusal naming `field` and why.
pub(super) fn err<T>(field: String, reason: &str) -> Result<T, DefinitionError> {
    Err(DefinitionError {
        field,
        reason: reason.into(),
    })
}

pub(super) fn in_range(field: &str, value: u64, min: u64, max: u64) -> Result<(), DefinitionError> {
    if (min..=max).contains(&value) {
        Ok(())
    } else {
        Err(DefinitionError {
            field: field.to_owned(),
            reason: format!("{value} is outside {min}..={max}"),
        })
    }
}

/// Range checks of a budget, shared by agent definitions and (for the limits a task sets)
/// tasks: `Err((field, reason))` names the first field out of range, prefixed with `prefix`.
pub fn check_budget(b: &Budget, prefix: &str) -> Result<(), (String, String)> {
    let limits = [
        (
            "max_steps",
            Some(u64::from(b.max_steps)),
            u64::from(MAX_STEPS),
        ),
        ("max_tokens", Some(b.max_tokens), u64::MAX),
        (
            "max_attempts_per_step",
            Some(u64::from(b.max_attempts_per_step)),
            u64::from(MAX_ATTEMPTS_PER_STEP),
        ),
        ("deadline_secs", b.deadline_secs, MAX_DEADLINE_SECS),
    ];
    for (field, value, max) in limits {
        if let Some(v) = value
            && !(1..=max).contains(&v)
        {
            return Err((
                format!("{prefix}{field}"),
                format!("{v} is outside 1..={max}"),
            ));
        }
    }
    if let Some(c) = b.max_cost
        && !(c.is_finite() && c > 0.0)
    {
        return Err((
            format!("{prefix}max_cost"),
            format!("{c} must be a number > 0"),
        ));
    }
    Ok(())
}

/// Provider function names: `[a-zA-Z0-9_-]{1,64}` (the stricter of the two APIs).
pub fn valid_tool_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

impl AgentDefinition {
    pub fn parse(bytes: &[u8]) -> Result<AgentDefinition, DefinitionError> {
        let def: AgentDefinition = serde_json::from_slice(bytes).map_err(|e| DefinitionError {
            field: "definition".into(),
            reason: e.to_string(),
        })?;
        def.validate()?;
        Ok(def)
    }

    pub fn validate(&self) -> Result<(), DefinitionError> {
        let seen = self.check_tools()?;
        if let Some(schema) = &self.output_schema
            && let Err(reason) = crate::tools::check_schema(schema)
        {
            return err("output_schema".into(), &reason);
        }
        if let Err((field, reason)) = self.context.check() {
            return err(field.into(), &reason);
        }
        self.check_output()?;
        self.check_policies(&seen)?;
        self.check_sensitive_task_fields()?;
        self.check_compensation()?;
        self.check_concurrency()?;
        check_budget(&self.budget, "budget.")
            .map_err(|(field, reason)| DefinitionError { field, reason })?;
        in_range(
            "max_output_tokens",
            u64::from(self.max_output_tokens),
            1,
            MAX_OUTPUT_TOKENS,
        )?;
        let tool_names: Vec<&str> = self.tools.iter().map(|t| t.name.as_str()).collect();
        self.check_model(&tool_names)?;
        self.check_fallbacks(&tool_names)
    }

    /// The default concurrency key's template and limit, and the default priority
    /// (docs/ARCHITECTURE.md "Concurrency keys and priorities").
    fn check_concurrency(&self) -> Result<(), DefinitionError> {
        let reject = |r: crate::task::TaskRejection| DefinitionError {
            field: r.field,
            reason: r.reason,
        };
        if let Some(c) = &self.concurrency {
            c.validate("concurrency").map_err(reject)?;
        }
        if let Some(p) = self.priority {
            crate::concurrency::check_priority("priority", p).map_err(reject)?;
        }
        Ok(())
    }

    /// The tools: names, schemas, and `run_agent`'s agents. Returns the tools' names.
    fn check_tools(&self) -> Result<std::collections::BTreeSet<&str>, DefinitionError> {
        let mut seen = std::collections::BTreeSet::new();
        for (i, t) in self.tools.iter().enumerate() {
            if !valid_tool_name(&t.name) {
                return err(format!("tools[{i}].name"), "must match [a-zA-Z0-9_-]{1,64}");
            }
            if !seen.insert(t.name.as_str()) {
                return err(format!("tools[{i}].name"), "duplicate tool name");
            }
            if t.parameters.get("type").and_then(|v| v.as_str()) != Some("object") {
                return err(
                    format!("tools[{i}].parameters"),
                    "must be a JSON Schema with \"type\": \"object\"",
                );
            }
            if let Err(reason) = crate::tools::check_schema(&t.parameters) {
                return err(format!("tools[{i}].parameters"), &reason);
            }
            if t.name == crate::child::RUN_AGENT_TOOL && crate::child::allowed(t).is_none() {
                return err(
                    format!("tools[{i}].agents"),
                    "run_agent must name the agents it may start (`\"agents\": [..]`); its \
                     parameters are Kedge's",
                );
            }
        }
        Ok(seen)
    }

    /// What an answer that does not match `output_schema` means (`on_invalid_output`,
    /// `output_retries`), and what an Anthropic model needs to answer through its `output` tool.
    fn check_output(&self) -> Result<(), DefinitionError> {
        if let Some(n) = self.output_retries {
            if self.on_invalid_output != OnInvalidOutput::Retry {
                return err(
                    "output_retries".into(),
                    "only with \"on_invalid_output\": \"retry\"",
                );
            }
            in_range(
                "output_retries",
                u64::from(n),
                1,
                u64::from(MAX_OUTPUT_RETRIES),
            )?;
        }
        if self.on_invalid_output == OnInvalidOutput::Retry && self.output_schema.is_none() {
            return err(
                "on_invalid_output".into(),
                "retry needs an output_schema to check the answer against",
            );
        }
        if let Some(schema) = &self.output_schema
            && self.model.provider == crate::event::Provider::Anthropic
            && schema.get("type").and_then(|t| t.as_str()) != Some("object")
        {
            return err(
                "output_schema".into(),
                "an Anthropic agent's output_schema must have \"type\": \"object\" (it is the \
                 input schema of the `output` tool the answer is given through)",
            );
        }
        if self.output_schema.is_some()
            && self.model.provider == crate::event::Provider::Anthropic
            && let Some(i) = self.tools.iter().position(|t| t.name == OUTPUT_TOOL)
        {
            return err(
                format!("tools[{i}].name"),
                "`output` is the tool an Anthropic agent with an output_schema answers through",
            );
        }
        Ok(())
    }

    /// The per-tool policies (`policy.<tool>`): each names a tool of this agent (`seen`), and
    /// its network grant, retry policy, sensitive parameters and limits are checked.
    fn check_policies(
        &self,
        seen: &std::collections::BTreeSet<&str>,
    ) -> Result<(), DefinitionError> {
        for (name, p) in &self.policy {
            if !seen.contains(name.as_str()) {
                return err(format!("policy.{name}"), "names no tool of this agent");
            }
            if p.network && !SANDBOXED_TOOLS.contains(&name.as_str()) {
                return err(
                    format!("policy.{name}.network"),
                    "only tools that run in the sandbox (shell) can be granted the network",
                );
            }
            if let Some(retry) = &p.retry
                && let Err((field, reason)) = retry.check(name)
            {
                return err(format!("policy.{name}.retry.{field}"), &reason);
            }
            let properties = self
                .tools
                .iter()
                .find(|t| t.name == *name)
                .and_then(|t| t.parameters.get("properties"))
                .and_then(|p| p.as_object());
            for (i, param) in p.sensitive.iter().enumerate() {
                if param.is_empty() || properties.is_some_and(|props| !props.contains_key(param)) {
                    return err(
                        format!("policy.{name}.sensitive[{i}]"),
                        "must name a parameter of the tool (a property of its schema)",
                    );
                }
            }
            for (field, value, max) in [
                ("timeout_secs", p.timeout_secs, MAX_TOOL_TIMEOUT_SECS),
                (
                    "max_output_bytes",
                    p.max_output_bytes,
                    MAX_TOOL_OUTPUT_BYTES,
                ),
                (
                    "approval_ttl_secs",
                    p.approval_ttl_secs,
                    MAX_APPROVAL_TTL_SECS,
                ),
            ] {
                if let Some(v) = value {
                    in_range(&format!("policy.{name}.{field}"), v, 1, max)?;
                }
            }
        }
        Ok(())
    }

    /// The sensitive task fields: `input` or `metadata.<key>`.
    fn check_sensitive_task_fields(&self) -> Result<(), DefinitionError> {
        for (i, field) in self.sensitive_task_fields.iter().enumerate() {
            let known = field == "input"
                || field
                    .strip_prefix("metadata.")
                    .is_some_and(|key| !key.is_empty());
            if !known {
                return err(
                    format!("sensitive_task_fields[{i}]"),
                    "must be `input` or `metadata.<key>`",
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{DEFAULT_OUTPUT_RETRIES, def};

    #[test]
    fn an_output_schema_is_checked_when_stored_and_fail_is_the_default() {
        let d = AgentDefinition::parse(def().to_string().as_bytes()).expect("valid");
        assert_eq!(d.output_schema, None);
        assert_eq!(d.on_invalid_output, OnInvalidOutput::Fail);
        let mut v = def();
        v["output_schema"] = serde_json::json!({"type": "object", "required": ["answer"],
            "properties": {"answer": {"type": "string"}}});
        v["on_invalid_output"] = serde_json::json!("accept");
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.on_invalid_output, OnInvalidOutput::Accept);
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
        for bad in [
            serde_json::json!({"type": "strin"}),
            serde_json::json!({"type": "string", "pattern": "("}),
            serde_json::json!({"$ref": "#/definitions/missing"}),
        ] {
            v["output_schema"] = bad.clone();
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("bad schema");
            assert_eq!(e.field, "output_schema", "{bad}: {e}");
        }
        v["output_schema"] = serde_json::json!({"type": "string"});
        v["on_invalid_output"] = serde_json::json!("retry_forever");
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown choice");
        assert!(
            e.reason.contains("on_invalid_output") || e.reason.contains("retry_forever"),
            "{e}"
        );
    }

    #[test]
    fn retrying_an_invalid_output_is_bounded_and_checked_naming_the_field() {
        let mut v = def();
        v["output_schema"] = serde_json::json!({"type": "object", "required": ["answer"]});
        v["on_invalid_output"] = serde_json::json!("retry");
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.on_invalid_output, OnInvalidOutput::Retry);
        assert_eq!(d.output_retries(), DEFAULT_OUTPUT_RETRIES);
        v["output_retries"] = serde_json::json!(5);
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.output_retries(), 5);
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
        assert_eq!(
            crate::tools::Contract::of(&d).output_retries(),
            5,
            "the contract carries it"
        );
        for (patch, field) in [
            (serde_json::json!({"output_retries": 0}), "output_retries"),
            (serde_json::json!({"output_retries": 6}), "output_retries"),
            (
                serde_json::json!({"on_invalid_output": "fail", "output_retries": 2}),
                "output_retries",
            ),
            (
                serde_json::json!({"on_invalid_output": "accept", "output_retries": 1}),
                "output_retries",
            ),
            (
                serde_json::json!({"output_schema": null, "output_retries": null}),
                "on_invalid_output",
            ),
        ] {
            let mut v = v.clone();
            for (k, x) in patch.as_object().expect("object") {
                v[k] = x.clone();
            }
            if v["output_schema"].is_null() {
                v.as_object_mut().expect("object").remove("output_schema");
            }
            if v["output_retries"].is_null() {
                v.as_object_mut().expect("object").remove("output_retries");
            }
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(field);
            assert_eq!(e.field, field, "{patch}: {e}");
        }
        let e = AgentDefinition::parse(
            serde_json::json!({"name": "x", "system_prompt": "", "model": {"provider": "openai", "name": "m"},
                "output_schema": {"type": "object"}, "output_retries": -1})
            .to_string()
            .as_bytes(),
        )
        .expect_err("negative");
        assert!(
            e.reason.contains("output_retries") || e.reason.contains("-1"),
            "{e}"
        );
        // Fail and accept retry nothing.
        let d = AgentDefinition::parse(def().to_string().as_bytes()).expect("valid");
        assert_eq!(d.output_retries(), 0);
    }

    #[test]
    fn an_anthropic_agent_with_an_output_schema_keeps_the_output_tool_name_free() {
        let mut v = def();
        v["tools"] = serde_json::json!(["read_file", {"name": "output"}]);
        v["policy"] = serde_json::json!({});
        // Without a schema, or on OpenAI, `output` is a name like any other.
        AgentDefinition::parse(v.to_string().as_bytes()).expect("no schema");
        v["output_schema"] = serde_json::json!({"type": "object"});
        AgentDefinition::parse(v.to_string().as_bytes()).expect("openai");
        v["model"] = serde_json::json!({"provider": "anthropic", "name": "claude"});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("taken");
        assert_eq!(e.field, "tools[1].name");
        assert!(e.reason.contains("output"), "{e}");
        // The schema is the tool's input schema: Anthropic takes objects only.
        v["tools"] = serde_json::json!(["read_file"]);
        AgentDefinition::parse(v.to_string().as_bytes()).expect("an object schema");
        v["output_schema"] = serde_json::json!({"type": "array"});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("not an object");
        assert_eq!(e.field, "output_schema");
    }

    #[test]
    fn schemas_and_numbers_are_checked_when_stored() {
        let mut v = def();
        v["tools"][0]["parameters"] =
            serde_json::json!({"type": "object", "properties": {"path": {"type": "strin"}}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("bad schema");
        assert_eq!(e.field, "tools[0].parameters");
        for (field, value, name) in [
            (
                "budget",
                serde_json::json!({"max_steps": 1, "max_tokens": 1, "max_attempts_per_step": 1, "deadline_secs": u64::MAX}),
                "budget.deadline_secs",
            ),
            (
                "budget",
                serde_json::json!({"max_steps": 0, "max_tokens": 1, "max_attempts_per_step": 1}),
                "budget.max_steps",
            ),
            (
                "budget",
                serde_json::json!({"max_steps": 1, "max_tokens": 1, "max_attempts_per_step": 1000}),
                "budget.max_attempts_per_step",
            ),
            (
                "max_output_tokens",
                serde_json::json!(0),
                "max_output_tokens",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"approval_ttl_secs": u64::MAX}}),
                "policy.read_file.approval_ttl_secs",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"max_output_bytes": 0}}),
                "policy.read_file.max_output_bytes",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"sensitive": ["path", "nope"]}}),
                "policy.read_file.sensitive[1]",
            ),
            (
                "sensitive_task_fields",
                serde_json::json!(["input", "metadata."]),
                "sensitive_task_fields[1]",
            ),
            (
                "sensitive_task_fields",
                serde_json::json!(["output"]),
                "sensitive_task_fields[0]",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"max_output_bytes": 16 * 1024 * 1024 + 1}}),
                "policy.read_file.max_output_bytes",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"timeout_secs": 0}}),
                "policy.read_file.timeout_secs",
            ),
            (
                "policy",
                serde_json::json!({"read_file": {"network": true}}),
                "policy.read_file.network",
            ),
        ] {
            let mut v = def();
            v[field] = value;
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(name);
            assert_eq!(e.field, name);
        }
    }

    #[test]
    fn bad_definitions_name_the_field() {
        let mut v = def();
        v["tools"][0]["name"] = "read file".into();
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("bad name");
        assert_eq!(e.field, "tools[0].name");
        let mut v = def();
        v["policy"] = serde_json::json!({"shell": {}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown tool");
        assert_eq!(e.field, "policy.shell");
        let mut v = def();
        v["tools"][0]["parameters"] = serde_json::json!({"type": "string"});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("not object");
        assert_eq!(e.field, "tools[0].parameters");
    }

    #[test]
    fn a_tool_retry_policy_is_checked_when_stored_naming_the_field() {
        let mut v = def();
        v["tools"] = serde_json::json!(["read_file", "shell", {"name": "srv__search"}]);
        v["policy"] = serde_json::json!({
            "srv__search": {"timeout_secs": 5, "retry": {"attempts": 4, "initial_backoff_ms": 200,
                "max_backoff_ms": 5000, "multiplier": 3, "jitter": 0.2,
                "on": ["timeout", "transient", "rate_limited"], "idempotent": true}},
            "read_file": {"retry": {"on": ["timeout"]}},
            "shell": {"retry": {}}
        });
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        let r = d.tool_policy("srv__search").retry.expect("a policy");
        assert_eq!((r.max_attempts(), r.idempotent), (4, true));
        assert_eq!(
            d.tool_policy("shell").retry,
            Some(crate::tools::RetryPolicy::default())
        );
        assert_eq!(
            d.tool_policy("list_files").retry,
            None,
            "none declared: one attempt"
        );
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
        for (tool, retry, field) in [
            (
                "srv__search",
                serde_json::json!({"attempts": 0}),
                "policy.srv__search.retry.attempts",
            ),
            (
                "srv__search",
                serde_json::json!({"attempts": 1000}),
                "policy.srv__search.retry.attempts",
            ),
            (
                "srv__search",
                serde_json::json!({"attempts": -2}),
                "policy.srv__search.retry.attempts",
            ),
            (
                "srv__search",
                serde_json::json!({"initial_backoff_ms": -100}),
                "policy.srv__search.retry.initial_backoff_ms",
            ),
            (
                "srv__search",
                serde_json::json!({"max_backoff_ms": 86_400_000}),
                "policy.srv__search.retry.max_backoff_ms",
            ),
            (
                "srv__search",
                serde_json::json!({"multiplier": 0}),
                "policy.srv__search.retry.multiplier",
            ),
            (
                "srv__search",
                serde_json::json!({"jitter": 2}),
                "policy.srv__search.retry.jitter",
            ),
            (
                "srv__search",
                serde_json::json!({"on": ["timeout"]}),
                "policy.srv__search.retry.on",
            ),
            (
                "shell",
                serde_json::json!({"on": ["timeout"]}),
                "policy.shell.retry.on",
            ),
            (
                "shell",
                serde_json::json!({"idempotent": true}),
                "policy.shell.retry.idempotent",
            ),
        ] {
            let mut v = v.clone();
            v["policy"] = serde_json::json!({ tool: {"retry": retry} });
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err(field);
            assert_eq!(e.field, field, "{e}");
        }
        // Misspelled fields and classes are refused too.
        v["policy"] = serde_json::json!({"shell": {"retry": {"retries": 3}}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown field");
        assert!(e.reason.contains("retries"), "{e}");
        v["policy"] = serde_json::json!({"shell": {"retry": {"on": ["flaky"]}}});
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("unknown class");
        assert!(e.reason.contains("flaky"), "{e}");
    }

    #[test]
    fn a_default_concurrency_key_and_priority_are_checked_naming_the_field() {
        let mut v = def();
        v["concurrency"] = serde_json::json!({"key": "{metadata.customer}", "limit": 3});
        v["priority"] = serde_json::json!(5);
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        assert_eq!(d.concurrency.as_ref().map(|c| c.limit), Some(3));
        assert_eq!(d.priority, Some(5));
        for (bad, field) in [
            (
                serde_json::json!({"key": "{nope}", "limit": 3}),
                "concurrency.key",
            ),
            (
                serde_json::json!({"key": "k", "limit": 0}),
                "concurrency.limit",
            ),
        ] {
            v["concurrency"] = bad;
            let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("refused");
            assert_eq!(e.field, field, "{e}");
        }
        v["concurrency"] = serde_json::json!({"key": "k", "limit": 1});
        v["priority"] = serde_json::json!(-1001);
        let e = AgentDefinition::parse(v.to_string().as_bytes()).expect_err("refused");
        assert_eq!(e.field, "priority");
    }
}
