//! The model's context window (docs/ARCHITECTURE.md "The context window"): a conversation that
//! would not fit is compacted first, a decision of its own, with a summary of what it leaves
//! out when the agent asks for one.

use kedge_core::Decision;
use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{ModelResponse, StepPlan};
use kedge_core::event::{ContextCompacted, Digest, Draft};
use kedge_core::fold::{ChatMessage, RunState};
use kedge_core::ids::ModelRequestId;
use kedge_core::machine::RunStatus;
use kedge_model::{ModelCall, ModelError};
use kedge_runtime::idempotency::StoredResponse;
use kedge_runtime::provider::Admit;

use super::commit::Writing;
use super::model::{CallError, count_call};
use super::provider::{Called, trouble_report};
use super::{DriveError, Driver};

/// The `context.compacted` that brings the run's next model request within its model's window
/// ([`kedge_core::context::compaction`]), or `None` when it fits, the window is not known,
/// nothing more may be taken out, or the agent's `context.strategy` is `fail`. `refused`: the
/// provider refused the last request as too long; the conversation is then brought to half its
/// estimate (the estimate undercounted), or within the window the refusal names.
pub(super) fn compaction(
    state: &RunState,
    def: &AgentDefinition,
    refused: Option<&ModelError>,
) -> Option<kedge_core::event::ContextCompacted> {
    use kedge_core::context::{self, ContextStrategy};
    // A run that has not started has no turn to leave out; a cancelling or compensating one
    // calls no model.
    if def.context.strategy == ContextStrategy::Fail
        || matches!(
            state.status,
            RunStatus::Queued
                | RunStatus::Cancelling
                | RunStatus::Compensating
                | RunStatus::Unknown
                | RunStatus::Cancelled
        )
    {
        return None;
    }
    let window = def
        .context
        .window_tokens
        .or_else(|| kedge_model::context::known_window(&state.bundle.model))
        .map(u64::from);
    // An unknown window is compacted only on the provider's refusal: no estimate per step.
    if window.is_none() && refused.is_none() {
        return None;
    }
    let overhead = kedge_model::context::overhead_tokens(&def.system_prompt, &def.tools)
        .saturating_add(u64::from(def.max_output_tokens));
    let pending = state.consumable(state.last_seq);
    let estimated = context::context_tokens(&state.transcript, &pending, state.compaction.as_ref());
    let budget = match refused {
        None => window?.saturating_sub(overhead),
        Some(e) => {
            let named = e.window_named().or(window).unwrap_or(u64::MAX);
            (estimated / 2).min(named.saturating_sub(overhead))
        }
    };
    let c = context::compaction(state, &pending, budget, def.context.keep_last_turns)?;
    let index = |i: usize| u32::try_from(i).unwrap_or(u32::MAX);
    Some(kedge_core::event::ContextCompacted {
        keep_from: index(c.keep_from),
        elided: c.elided.into_iter().map(index).collect(),
        estimated_tokens: estimated,
        budget_tokens: budget,
        cause: match refused {
            None => kedge_core::event::CompactionCause::Estimate,
            Some(_) => kedge_core::event::CompactionCause::TooLong,
        },
        summary: None,
        max_result_chars: c
            .max_result_chars
            .filter(|n| state.compaction.as_ref().and_then(|p| p.max_result_chars) != Some(*n))
            .map(index),
    })
}

impl Driver {
    /// Commits `compacted`, the compaction that brings the step's context within its model's
    /// window (with a summary of what it leaves out when the agent asks for one); for a revival
    /// (a terminal run the plan starts again), the plan's first decisions alone instead. Either
    /// way the step is then decided again.
    pub(super) async fn compact(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        def: &AgentDefinition,
        plan: &StepPlan,
        compacted: ContextCompacted,
    ) -> Result<(), DriveError> {
        let mut compacted = compacted;
        if state.status.is_terminal() {
            // A revival: its first decisions alone, so that the compaction lands in
            // the running run they leave (the step is decided again after it).
            self.commit(state, w, revival(&plan.start)).await?;
        } else {
            tracing::info!("compacting the model's context to fit its window");
            let before = state.compaction.as_ref().map_or(1, |c| c.keep_from);
            let keep_from = usize::try_from(compacted.keep_from).unwrap_or(usize::MAX);
            if def.context.strategy == kedge_core::context::ContextStrategy::Summarize
                && keep_from > before
            {
                compacted.summary = self.summarize(state, def, plan.step, keep_from).await;
            }
            let draft = Draft::new(Decision::ContextCompacted(compacted));
            self.commit(state, w, vec![draft]).await?;
        }
        Ok(())
    }

    /// The run's model's summary of the turns a compaction keeping the transcript from
    /// `keep_from` leaves out (`context.strategy: summarize`, docs/ARCHITECTURE.md "The context
    /// window"): a call of its own, under a request id fixed by the step and `keep_from`, whose
    /// answer is stored before it is journaled and reused after a crash. `None` (the compaction
    /// then trims) when the call is not made or fails: the run's model's endpoint is failing or
    /// its rate limit has no slot for it soon, the agent marks values sensitive (a summary would
    /// journal them in clear), or the model answers with no text. Never a reason to fail the
    /// run.
    async fn summarize(
        &self,
        state: &RunState,
        def: &AgentDefinition,
        step: kedge_core::StepNo,
        keep_from: usize,
    ) -> Option<kedge_core::event::CompactionSummary> {
        use kedge_core::context;
        if def.marks_sensitive() {
            return None;
        }
        let request_id = context::summary_request_id(&state.run_id, step, keep_from);
        let messages = context::summary_context(state, keep_from);
        let digest = kedge_core::event::Digest::of(&messages);
        let primary = Called::primary(state, def);
        let stored = match self.rt.idempotency.stored_response(&request_id).await {
            Ok(found) => found.filter(|s| s.context_digest == digest),
            Err(e) => {
                tracing::warn!(error = %e, "cannot look for a stored summary; trimming instead");
                return None;
            }
        };
        let response = match stored {
            Some(stored) => {
                tracing::info!(request_id = %request_id, "reusing the stored summary");
                stored.response
            }
            None => {
                self.call_for_summary(def, &primary, &request_id, &messages, digest)
                    .await?
            }
        };
        let text = summary_text(&response.message.text);
        if text.is_empty() {
            tracing::warn!("the summary call answered no text; trimming instead");
            return None;
        }
        Some(kedge_core::event::CompactionSummary {
            text,
            request_id,
            usage: response.usage.priced(primary.spec.price.as_ref()),
        })
    }

    /// The summary call of [`Driver::summarize`] to the run's model (`primary`) on `messages`
    /// (whose digest is `digest`), its answer stored under `request_id` before it is returned;
    /// `None` when it is not made (the endpoint is failing, the rate limit has no slot soon, the
    /// operator's policy refuses the model), fails, or cannot be stored.
    async fn call_for_summary(
        &self,
        def: &AgentDefinition,
        primary: &Called,
        request_id: &ModelRequestId,
        messages: &[ChatMessage],
        digest: Digest,
    ) -> Option<ModelResponse> {
        let providers = self.providers().await.ok()?;
        if !providers.breaker(&primary.endpoint).lets(None) {
            return None;
        }
        // The model's rate limits hold for this call too; over them, it trims instead
        // of waiting its turn.
        if let Some(t) = primary.turn(&self.rt.config, &providers, def, messages) {
            let admitted = providers
                .admit(
                    &primary.endpoint,
                    &primary.spec.name,
                    t.configured,
                    t.tokens,
                )
                .await;
            match admitted {
                Admit::After(wait) => tokio::time::sleep(wait).await,
                Admit::Queue { .. } => return None,
            }
        }
        self.rt
            .config
            .check_model(&primary.key_var, primary.spec.base_url.as_deref())
            .ok()?;
        let api_key = self.rt.config.api_key(&primary.key_var);
        let call = ModelCall {
            spec: &primary.spec,
            api_key: api_key.as_deref(),
            system: kedge_core::context::SUMMARY_SYSTEM,
            // The conversation holds tool calls; a provider wants their tools declared.
            tools: &def.tools,
            context: messages,
            request_id,
            max_output_tokens: def.max_output_tokens,
            output_schema: None,
            timeout: self.rt.config.timeouts.model_timeout(),
        };
        let called_at = std::time::Instant::now();
        let result = self
            .model
            .complete(&call, &mut |_| {})
            .await
            .map_err(CallError::Model);
        count_call(&primary.spec, &result, called_at.elapsed());
        let response = match result {
            Ok(r) => {
                providers.report_success(&primary.endpoint).await;
                r
            }
            Err(CallError::Model(e)) => {
                if let Some(report) = trouble_report(&e, false) {
                    providers.report_trouble(&primary.endpoint, &report).await;
                }
                tracing::warn!(error = %e, "the summary call failed; trimming instead");
                return None;
            }
            Err(CallError::Cancelled) => return None,
        };
        let stored = StoredResponse {
            context_digest: digest,
            response: response.clone(),
        };
        // Stored before it is journaled: a crash in between reuses it.
        if let Err(e) = self
            .rt
            .idempotency
            .store_response(request_id, &stored)
            .await
        {
            tracing::warn!(error = %e, "the summary could not be stored; trimming instead");
            return None;
        }
        Some(response)
    }
}

/// The first decisions of a revival's plan `start` alone: those before its `step.started`.
fn revival(start: &[Draft<Decision>]) -> Vec<Draft<Decision>> {
    start
        .iter()
        .take_while(|d| !matches!(d.event, Decision::StepStarted(_)))
        .cloned()
        .collect()
}

/// A summary as it is journaled: the model's `text` without the whitespace around it, at most
/// [`kedge_core::context::MAX_SUMMARY_CHARS`] characters of it.
fn summary_text(text: &str) -> String {
    text.trim()
        .chars()
        .take(kedge_core::context::MAX_SUMMARY_CHARS)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::event::{RunStarted, StepStarted};
    use kedge_core::ids::RunId;
    use kedge_core::{Attempt, StepNo};

    fn step_started() -> Draft<Decision> {
        let run: RunId = "run_revive1".parse().expect("a run id");
        Draft::new(Decision::StepStarted(StepStarted {
            request_id: ModelRequestId::new(&run, StepNo(3), Attempt(1)),
            context_digest: Digest::of_bytes(b"context"),
            inputs_through: 7,
            model: None,
        }))
    }

    #[test]
    fn a_revival_commits_only_its_decisions_before_the_step_started() {
        let start = vec![
            Draft::new(Decision::RunStarted(RunStarted {})),
            step_started(),
            Draft::new(Decision::RunStarted(RunStarted {})),
        ];
        let first = revival(&start);
        assert_eq!(first.len(), 1);
        assert!(matches!(first[0].event, Decision::RunStarted(_)));
        assert!(revival(&[step_started()]).is_empty());
        assert!(revival(&[]).is_empty());
    }

    #[test]
    fn a_summary_is_trimmed_and_bounded_in_characters() {
        assert_eq!(summary_text("  \n what was done \t"), "what was done");
        assert_eq!(summary_text(" \n "), "");
        let max = kedge_core::context::MAX_SUMMARY_CHARS;
        // Characters, not bytes: a multi-byte text is cut on a character boundary.
        let long = "é".repeat(max + 10);
        let text = summary_text(&long);
        assert_eq!(text.chars().count(), max);
        assert!(text.chars().all(|c| c == 'é'));
        assert_eq!(summary_text(&"x".repeat(max)).len(), max);
    }
}
