//! The model a definition runs on and the models it falls back to: each checked by its
//! provider's rules (`crate::settings::check`), priced alike when the run's cost is counted.

use super::validate::{err, in_range};
use super::{AgentDefinition, DefinitionError, MAX_FALLBACKS, OUTPUT_TOOL};

impl AgentDefinition {
    /// The model's settings and price, by its provider's rules, and the price a cost budget
    /// counts with.
    pub(super) fn check_model(&self, tool_names: &[&str]) -> Result<(), DefinitionError> {
        crate::settings::check(
            self.model.provider,
            &self.model.settings,
            self.model.price.as_ref(),
            self.max_output_tokens,
            tool_names,
        )
        .map_err(|(field, reason)| DefinitionError {
            field: format!("model.{field}"),
            reason,
        })?;
        if self.budget.max_cost.is_some() && self.model.price.is_none() {
            return err(
                "budget.max_cost".into(),
                "needs model.price to count what the run costs",
            );
        }
        Ok(())
    }

    /// The fallback models: each checked as `model` is, and priced like it when the run's cost
    /// is counted.
    pub(super) fn check_fallbacks(&self, tool_names: &[&str]) -> Result<(), DefinitionError> {
        let err = |field: String, reason: String| Err(DefinitionError { field, reason });
        if self.fallbacks.len() > MAX_FALLBACKS {
            return err(
                "fallbacks".into(),
                format!("at most {MAX_FALLBACKS} fallback models"),
            );
        }
        if self.fallbacks.is_empty() && self.fallback_after_secs.is_some() {
            return err("fallback_after_secs".into(), "only with fallbacks".into());
        }
        in_range(
            "fallback_after_secs",
            self.fallback_after_secs.unwrap_or_default(),
            0,
            86_400,
        )?;
        for (i, f) in self.fallbacks.iter().enumerate() {
            let m = &f.model;
            if m.name.trim().is_empty() {
                return err(format!("fallbacks[{i}].name"), "must not be empty".into());
            }
            crate::settings::check(
                m.provider,
                &m.settings,
                m.price.as_ref(),
                self.max_output_tokens,
                tool_names,
            )
            .map_err(|(field, reason)| DefinitionError {
                field: format!("fallbacks[{i}].{field}"),
                reason,
            })?;
            if self.budget.max_cost.is_some() && m.currency() != self.model.currency() {
                return err(
                    format!("fallbacks[{i}].price"),
                    "with budget.max_cost every fallback needs a price in model.price's currency"
                        .into(),
                );
            }
            if let Some(schema) = &self.output_schema
                && m.provider == crate::event::Provider::Anthropic
                && (schema.get("type").and_then(|t| t.as_str()) != Some("object")
                    || tool_names.contains(&OUTPUT_TOOL))
            {
                return err(
                    format!("fallbacks[{i}].provider"),
                    "an Anthropic model answers an output_schema through its `output` tool: the \
                     schema must have \"type\": \"object\" and no tool may be named `output`"
                        .into(),
                );
            }
            if f.api_key_env.as_deref().is_some_and(|k| {
                k.is_empty() || !k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            }) {
                return err(
                    format!("fallbacks[{i}].api_key_env"),
                    "must be an environment variable name ([A-Za-z0-9_]+)".into(),
                );
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{DEFAULT_FALLBACK_AFTER_SECS, def};

    #[test]
    fn fallback_models_are_checked_like_the_model_and_name_the_field_at_fault() {
        let with = |extra: serde_json::Value| {
            let mut v = def();
            for (k, x) in extra.as_object().expect("object") {
                v[k] = x.clone();
            }
            AgentDefinition::parse(v.to_string().as_bytes())
        };
        let claude = serde_json::json!({"provider": "anthropic", "name": "claude", "api_key_env": "TEAM_KEY"});
        let d = with(serde_json::json!({"fallbacks": [claude], "fallback_after_secs": 5}))
            .expect("a fallback");
        assert_eq!(d.fallbacks[0].model.name, "claude");
        assert_eq!(d.fallbacks[0].api_key_env.as_deref(), Some("TEAM_KEY"));
        assert_eq!(d.fallback_after(), std::time::Duration::from_secs(5));
        let d = with(serde_json::json!({"fallbacks": [claude]})).expect("the default wait");
        assert_eq!(
            d.fallback_after(),
            std::time::Duration::from_secs(DEFAULT_FALLBACK_AFTER_SECS)
        );
        let priced = serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 1, "output_per_mtok": 1}});
        for (extra, field) in [
            (
                serde_json::json!({"fallback_after_secs": 5}),
                "fallback_after_secs",
            ),
            (
                serde_json::json!({"fallbacks": [claude, claude, claude, claude]}),
                "fallbacks",
            ),
            (
                serde_json::json!({"fallbacks": [claude], "fallback_after_secs": 100000}),
                "fallback_after_secs",
            ),
            (
                serde_json::json!({"fallbacks": [{"provider": "anthropic", "name": " "}]}),
                "fallbacks[0].name",
            ),
            (
                serde_json::json!({"fallbacks": [{"provider": "anthropic", "name": "c", "settings": {"seed": 1}}]}),
                "fallbacks[0].settings.seed",
            ),
            (
                serde_json::json!({"fallbacks": [{"provider": "openai", "name": "c", "api_key_env": "a-b"}]}),
                "fallbacks[0].api_key_env",
            ),
            // Counting the cost needs every model priced in one currency.
            (
                serde_json::json!({"model": priced, "budget": {"max_steps": 5, "max_tokens": 1000, "max_attempts_per_step": 3, "max_cost": 1.0}, "fallbacks": [claude]}),
                "fallbacks[0].price",
            ),
            (
                serde_json::json!({"fallbacks": [claude], "output_schema": {"type": "array"}}),
                "fallbacks[0].provider",
            ),
        ] {
            let e = with(extra.clone()).expect_err("refused");
            assert_eq!(e.field, field, "{extra}: {}", e.reason);
        }
    }

    fn with(
        model: serde_json::Value,
        extra: serde_json::Value,
    ) -> Result<AgentDefinition, DefinitionError> {
        let mut v = def();
        v["model"] = model;
        for (k, x) in extra.as_object().expect("object") {
            v[k] = x.clone();
        }
        AgentDefinition::parse(v.to_string().as_bytes())
    }

    fn openai(settings: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"provider": "openai", "name": "m", "settings": settings})
    }

    fn anthropic(settings: serde_json::Value) -> serde_json::Value {
        serde_json::json!({"provider": "anthropic", "name": "m", "settings": settings})
    }

    /// Each model (with the definition's other fields in `extra`) is refused, naming `field`.
    fn refused(cases: Vec<(serde_json::Value, serde_json::Value, &str)>) {
        for (model, extra, field) in cases {
            let e = with(model.clone(), extra).expect_err(field);
            assert_eq!(e.field, field, "{model}: {e}");
        }
    }

    #[test]
    fn the_settings_each_provider_has_are_accepted() {
        let none = serde_json::json!({});
        let d = with(
            openai(serde_json::json!({
                "temperature": 1.5, "top_p": 0.9, "stop": ["END"], "seed": 7,
                "tool_choice": {"tool": "read_file"}, "parallel_tool_calls": false,
                "reasoning_effort": "low"
            })),
            none.clone(),
        )
        .expect("valid OpenAI settings");
        assert_eq!(d.model.settings.seed, Some(7));
        with(
            anthropic(serde_json::json!({
                "thinking": {"budget_tokens": 1024}, "top_p": 0.95, "cache": true,
                "tool_choice": "auto", "stop": ["a", "b", "c", "d", "e"]
            })),
            none.clone(),
        )
        .expect("valid Anthropic settings");
    }

    #[test]
    fn sampling_is_held_to_the_providers_ranges() {
        let none = serde_json::json!({});
        refused(vec![
            (
                openai(serde_json::json!({"temperature": 2.5})),
                none.clone(),
                "model.settings.temperature",
            ),
            (
                anthropic(serde_json::json!({"temperature": 1.5})),
                none.clone(),
                "model.settings.temperature",
            ),
            (
                openai(serde_json::json!({"top_p": -0.1})),
                none.clone(),
                "model.settings.top_p",
            ),
        ]);
    }

    #[test]
    fn stop_sequences_are_counted_and_never_empty() {
        let none = serde_json::json!({});
        refused(vec![
            (
                openai(serde_json::json!({"stop": ["a", "b", "c", "d", "e"]})),
                none.clone(),
                "model.settings.stop",
            ),
            (
                openai(serde_json::json!({"stop": [""]})),
                none.clone(),
                "model.settings.stop[0]",
            ),
        ]);
    }

    #[test]
    fn a_setting_the_provider_does_not_have_is_refused() {
        let none = serde_json::json!({});
        refused(vec![
            (
                anthropic(serde_json::json!({"seed": 1})),
                none.clone(),
                "model.settings.seed",
            ),
            (
                anthropic(serde_json::json!({"reasoning_effort": "high"})),
                none.clone(),
                "model.settings.reasoning_effort",
            ),
            (
                openai(serde_json::json!({"thinking": {"budget_tokens": 2048}})),
                none.clone(),
                "model.settings.thinking",
            ),
            (
                openai(serde_json::json!({"cache": true})),
                none.clone(),
                "model.settings.cache",
            ),
        ]);
    }

    #[test]
    fn tool_choice_and_parallel_calls_need_the_tools_they_name() {
        let none = serde_json::json!({});
        refused(vec![
            (
                openai(serde_json::json!({"tool_choice": {"tool": "shell"}})),
                none.clone(),
                "model.settings.tool_choice",
            ),
            (
                openai(serde_json::json!({"tool_choice": "required"})),
                serde_json::json!({"tools": [], "policy": {}}),
                "model.settings.tool_choice",
            ),
            (
                openai(serde_json::json!({"parallel_tool_calls": true})),
                serde_json::json!({"tools": [], "policy": {}}),
                "model.settings.parallel_tool_calls",
            ),
        ]);
    }

    #[test]
    fn thinking_has_a_budget_within_the_output_and_rules_out_sampling_and_forced_calls() {
        let none = serde_json::json!({});
        refused(vec![
            (
                anthropic(serde_json::json!({"thinking": {"budget_tokens": 1000}})),
                none.clone(),
                "model.settings.thinking.budget_tokens",
            ),
            (
                anthropic(serde_json::json!({"thinking": {"budget_tokens": 4096}})),
                none.clone(),
                "model.settings.thinking.budget_tokens",
            ),
            (
                anthropic(
                    serde_json::json!({"thinking": {"budget_tokens": 2048}, "temperature": 1}),
                ),
                none.clone(),
                "model.settings.temperature",
            ),
            (
                anthropic(serde_json::json!({"thinking": {"budget_tokens": 2048}, "top_p": 0.5})),
                none.clone(),
                "model.settings.top_p",
            ),
            (
                anthropic(
                    serde_json::json!({"thinking": {"budget_tokens": 2048}, "tool_choice": "required"}),
                ),
                none.clone(),
                "model.settings.tool_choice",
            ),
        ]);
    }

    #[test]
    fn a_price_is_positive_in_a_currency_code() {
        let none = serde_json::json!({});
        refused(vec![
            (
                serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": -1, "output_per_mtok": 1}}),
                none.clone(),
                "model.price.input_per_mtok",
            ),
            (
                serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 1, "output_per_mtok": 1, "currency": "US$"}}),
                none.clone(),
                "model.price.currency",
            ),
        ]);
    }

    #[test]
    fn a_cost_budget_needs_a_price_and_a_limit_above_zero() {
        refused(vec![
            (
                serde_json::json!({"provider": "openai", "name": "m"}),
                serde_json::json!({"budget": {"max_steps": 5, "max_tokens": 100, "max_attempts_per_step": 1, "max_cost": 1.0}}),
                "budget.max_cost",
            ),
            (
                serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 1, "output_per_mtok": 1}}),
                serde_json::json!({"budget": {"max_steps": 5, "max_tokens": 100, "max_attempts_per_step": 1, "max_cost": 0}}),
                "budget.max_cost",
            ),
        ]);
        let d = with(
            serde_json::json!({"provider": "openai", "name": "m", "price": {"input_per_mtok": 2, "output_per_mtok": 8}}),
            serde_json::json!({"budget": {"max_steps": 5, "max_tokens": 100, "max_attempts_per_step": 1, "max_cost": 0.5}}),
        )
        .expect("a priced model with a cost budget");
        assert_eq!(d.model.price.as_ref().expect("price").currency, "USD");
        assert_eq!(
            AgentDefinition::parse(&serde_json::to_vec(&d).expect("json"))
                .expect("reads back")
                .budget
                .max_cost,
            Some(0.5)
        );
    }
}
