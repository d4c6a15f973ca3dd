//! The model call: the request sent with the run's sealed values opened, its token deltas
//! forwarded, aborted by a cancel request; what it is counted as, and the delay before an
//! attempt that failed is tried again.

use std::time::Duration;

use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{ModelResponse, StepPlan};
use kedge_core::fold::{ChatMessage, RunState};
use kedge_model::{Delta, ModelCall, ModelError};
use kedge_runtime::Runtime;
use kedge_runtime::metrics::{self, ModelOutcome};
use kedge_runtime::provider::{Limits, Providers};
use kedge_runtime::seal::{self, SealError};

use super::Driver;
use super::provider::{Called, trouble_report};

impl Driver {
    /// Makes the model call `called` of `plan` and tells what it taught: the call counted, the
    /// rate limits the provider named learned, the endpoint's breaker told of its success or
    /// of the provider's trouble (`probe`: the call was the fleet's probe of the endpoint).
    pub(super) async fn call_reported(
        &self,
        state: &RunState,
        def: &AgentDefinition,
        called: &Called,
        plan: &StepPlan,
        providers: &Providers,
        probe: bool,
    ) -> Result<ModelResponse, CallError> {
        let endpoint = &called.endpoint;
        let called_at = std::time::Instant::now();
        let mut learned = None;
        let result = self
            .call_model(state, def, called, plan, &mut learned)
            .await;
        count_call(&called.spec, &result, called_at.elapsed());
        if let Some(l) = learned {
            let learned = Limits {
                requests_per_minute: l.requests_per_minute,
                tokens_per_minute: l.tokens_per_minute,
            };
            providers.learn(endpoint, &called.spec.name, learned).await;
        }
        match &result {
            Ok(response) => {
                providers.report_success(endpoint).await;
                self.record_quota_usage(state, &called.spec, &response.usage);
            }
            Err(CallError::Model(e)) => {
                if let Some(report) = trouble_report(e, probe) {
                    providers.report_trouble(endpoint, &report).await;
                }
            }
            Err(CallError::Cancelled) => {}
        }
        result
    }

    async fn call_model(
        &self,
        state: &RunState,
        def: &AgentDefinition,
        called: &Called,
        plan: &StepPlan,
        learned: &mut Option<kedge_model::RateLimits>,
    ) -> Result<kedge_core::decide::ModelResponse, CallError> {
        // The operator's model policy, at run time too: a definition stored around
        // `kedge agents put` still cannot send the conversation or a key elsewhere.
        self.rt
            .config
            .check_model(&called.key_var, called.spec.base_url.as_deref())
            .map_err(|reason| CallError::Model(ModelError::refused_by_policy(reason)))?;
        let api_key = self.rt.config.api_key(&called.key_var);
        // Sensitive values are sealed in the journal; the model reads them in clear.
        let context = open_context(&self.rt, state, def, &plan.context)
            .map_err(|e| CallError::Model(ModelError::refused_by_policy(e.to_string())))?;
        let call = ModelCall {
            spec: &called.spec,
            api_key: api_key.as_deref(),
            system: &def.system_prompt,
            tools: &def.tools,
            context: context.as_deref().unwrap_or(&plan.context),
            request_id: &plan.request_id,
            max_output_tokens: def.max_output_tokens,
            output_schema: def.output_schema.as_ref(),
            timeout: self.rt.config.timeouts.model_timeout(),
        };
        // Token deltas go to core NATS, never to the journal.
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel::<String>();
        let client = self.rt.client.clone();
        let subject = kedge_core::subjects::delta(&state.run_id);
        let header = serde_json::json!({"step": plan.step, "attempt": plan.attempt});
        let forward = tokio::spawn(async move {
            while let Some(mut text) = rx.recv().await {
                // Deltas already waiting go out as one (a fast stream, or a provider that sends
                // many small chunks at once): nothing is held back, and the text is the same.
                while let Ok(more) = rx.try_recv() {
                    text.push_str(&more);
                }
                let mut body = header.clone();
                body["text"] = text.into();
                let _ = client
                    .publish(subject.clone(), body.to_string().into())
                    .await;
            }
        });
        let mut on_delta = |d: Delta| match d {
            Delta::Text(t) => {
                let _ = tx.send(t);
            }
            Delta::Limits(l) => *learned = Some(l),
            _ => {}
        };
        let mut cancels = self.cancels.subscribe();
        let run = state.run_id.clone();
        let cancelled = async move {
            loop {
                match cancels.recv().await {
                    Ok(r) if r == run => return,
                    Ok(_) | Err(tokio::sync::broadcast::error::RecvError::Lagged(_)) => {}
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => {
                        std::future::pending::<()>().await
                    }
                }
            }
        };
        let result = if state.cancel_requested.is_some() {
            Err(CallError::Cancelled)
        } else {
            // A lost lease does not abort the call: the answer is paid for, so it is stored
            // (and reused by whoever holds the run now) even if this worker may not commit it.
            tokio::select! {
                r = self.model.complete(&call, &mut on_delta) => r.map_err(CallError::Model),
                _ = cancelled => Err(CallError::Cancelled),
            }
        };
        drop(tx);
        let _ = forward.await;
        // The sensitive arguments of its tool calls are sealed before the response is stored,
        // decided on or logged.
        result.and_then(|mut response| {
            seal_response(&self.rt, state, def, &mut response)
                .map_err(|e| CallError::Model(ModelError::refused_by_policy(e.to_string())))?;
            Ok(response)
        })
    }
}

/// The context to send the model with the sealed values of the run opened
/// ([`kedge_runtime::seal`]); `None` when nothing in it is sealed (the plan's is sent as is).
/// Refused when the agent marks values sensitive and this process has no seal key.
fn open_context(
    rt: &Runtime,
    state: &RunState,
    def: &AgentDefinition,
    context: &[ChatMessage],
) -> Result<Option<Vec<ChatMessage>>, SealError> {
    if rt.seal.is_none() {
        // Nothing can be sealed for this run; a string that looks sealed is the model's text.
        return if def.marks_sensitive() {
            Err(SealError::NoKey)
        } else {
            Ok(None)
        };
    }
    // Looked for in place first: most contexts hold nothing sealed, and this runs every step.
    if !holds_sealed(context) {
        return Ok(None);
    }
    let mut value = serde_json::to_value(context).unwrap_or_default();
    seal::open_all(rt.seal.as_ref(), &state.run_id, &mut value)?;
    serde_json::from_value(value)
        .map(Some)
        .map_err(|_| SealError::Unopenable("a sealed value does not fit where it was"))
}

/// Whether a value in `context` is sealed: a message's text, a tool call's arguments, a tool's
/// result.
fn holds_sealed(context: &[ChatMessage]) -> bool {
    context.iter().any(|m| match m {
        ChatMessage::User { text } => seal::is_sealed(text),
        ChatMessage::Assistant { message } => {
            seal::is_sealed(&message.text)
                || message
                    .tool_calls
                    .iter()
                    .any(|c| seal::holds_sealed(&c.arguments))
        }
        ChatMessage::Tool { content, .. } => seal::is_sealed(content),
    })
}

/// Seals the arguments the agent marks sensitive (`policy.<tool>.sensitive`) in the model's
/// tool calls.
fn seal_response(
    rt: &Runtime,
    state: &RunState,
    def: &AgentDefinition,
    response: &mut kedge_core::decide::ModelResponse,
) -> Result<(), SealError> {
    for call in &mut response.message.tool_calls {
        let names = def.sensitive_params(&call.name);
        if !names.is_empty() {
            seal::seal_fields(rt.seal.as_ref(), &state.run_id, &mut call.arguments, names)?;
        }
    }
    Ok(())
}

pub(super) enum CallError {
    Model(ModelError),
    Cancelled,
}

/// The wait before the next attempt: the provider's `retry-after` if given, else exponential
/// backoff with jitter ([`kedge_core::decide::model_retry_delay`]: many runs failing at once on
/// one provider do not retry in step); never more than `max`.
pub(super) fn retry_delay(e: &ModelError, attempt: u32, max: Duration) -> Duration {
    kedge_core::decide::model_retry_delay(attempt, e.retry_after, max, kedge_runtime::jitter_draw())
}

/// Counts a model call attempt: its outcome and duration, an error's class and kind, an
/// answer's tokens and cost at the frozen price of the model that answered.
pub(super) fn count_call(
    model: &kedge_core::event::ModelSpec,
    result: &Result<kedge_core::decide::ModelResponse, CallError>,
    took: Duration,
) {
    match result {
        Ok(response) => {
            metrics::model_call(ModelOutcome::Ok, took);
            let usage = &response.usage;
            let price = model.price.as_ref();
            let cost = price.map(|p| (p.cost(usage), p.currency.as_str()));
            metrics::model_usage(usage.input_tokens, usage.output_tokens, cost);
        }
        Err(CallError::Cancelled) => metrics::model_call(ModelOutcome::Cancelled, took),
        Err(CallError::Model(e)) => {
            metrics::model_call(ModelOutcome::Error, took);
            metrics::model_error(e.class, e.kind.as_str());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::event::{AssistantMessage, ErrorClass, ToolCall};
    use kedge_model::ModelErrorKind;

    fn error(retry_after: Option<Duration>) -> ModelError {
        ModelError {
            class: ErrorClass::Retryable,
            kind: ModelErrorKind::Status,
            status: Some(503),
            retry_after,
            message: "overloaded".into(),
            trouble: None,
        }
    }

    #[test]
    fn a_retry_waits_what_the_provider_asked_within_the_bound() {
        let max = Duration::from_secs(30);
        let asked = Duration::from_secs(5);
        assert_eq!(retry_delay(&error(Some(asked)), 1, max), asked);
        assert_eq!(retry_delay(&error(Some(asked)), 6, max), asked);
        assert_eq!(
            retry_delay(&error(Some(Duration::from_secs(120))), 1, max),
            max
        );
        for attempt in 1..12 {
            assert!(retry_delay(&error(None), attempt, max) <= max);
        }
        let tight = Duration::from_millis(1);
        assert!(retry_delay(&error(None), 5, tight) <= tight);
    }

    fn assistant(text: &str, arguments: serde_json::Value) -> ChatMessage {
        ChatMessage::Assistant {
            message: AssistantMessage {
                text: text.into(),
                tool_calls: vec![ToolCall {
                    call_id: "call_1".into(),
                    name: "read_file".into(),
                    arguments,
                }],
                thinking: Vec::new(),
            },
        }
    }

    #[test]
    fn a_sealed_value_is_found_wherever_the_context_holds_it() {
        let sealed = format!("{}c2VhbGVk", seal::PREFIX);
        let user = |text: &str| ChatMessage::User { text: text.into() };
        let tool = |content: &str| ChatMessage::Tool {
            call_id: "call_1".into(),
            content: content.into(),
            is_error: false,
        };
        let plain = [
            user("hello"),
            assistant("reading", serde_json::json!({"path": "a.txt"})),
            tool("42"),
        ];
        assert!(!holds_sealed(&plain));
        assert!(!holds_sealed(&[]));
        assert!(holds_sealed(&[user("hello"), user(&sealed)]));
        assert!(holds_sealed(&[tool(&sealed)]));
        assert!(holds_sealed(&[assistant(&sealed, serde_json::json!({}))]));
        let nested = serde_json::json!({"path": "a.txt", "env": {"keys": ["x", sealed]}});
        assert!(holds_sealed(&[assistant("reading", nested)]));
        // The prefix inside a text is not a sealed value.
        assert!(!holds_sealed(&[user(&format!("see {sealed}"))]));
    }
}
