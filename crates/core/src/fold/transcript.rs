//! The conversation the model reads: the transcript a run's steps consume, the context of the
//! next step (docs/ARCHITECTURE.md "The context window") and its digest.

use serde::{Deserialize, Serialize};

use crate::event::{AssistantMessage, Digest, SeqDigest};

use super::run::RunState;

/// One message of the provider-neutral conversation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "role", rename_all = "snake_case")]
pub enum ChatMessage {
    User {
        text: String,
    },
    Assistant {
        #[serde(flatten)]
        message: AssistantMessage,
    },
    Tool {
        call_id: String,
        content: String,
        is_error: bool,
    },
}

/// The hash state of a run's transcript so far ([`RunState::next_context_digested`]): derived
/// from the transcript, so two states are equal whatever it holds, and a clone carries it.
#[derive(Default)]
pub struct TranscriptDigest(std::sync::Mutex<SeqDigest>);

impl TranscriptDigest {
    fn hashed(&self) -> SeqDigest {
        self.0.lock().map(|d| d.clone()).unwrap_or_default()
    }

    fn keep(&self, hashed: &SeqDigest) {
        if let Ok(mut d) = self.0.lock()
            && hashed.items() > d.items()
        {
            *d = hashed.clone();
        }
    }
}

impl Clone for TranscriptDigest {
    fn clone(&self) -> Self {
        Self(std::sync::Mutex::new(self.hashed()))
    }
}

impl PartialEq for TranscriptDigest {
    fn eq(&self, _: &Self) -> bool {
        true
    }
}

impl std::fmt::Debug for TranscriptDigest {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("TranscriptDigest")
            .field(&self.hashed().items())
            .finish()
    }
}

/// The message the model reads after its final answer was rejected (`output.rejected`): the
/// errors and what to do, in the run's wire format's terms (an Anthropic model answers through
/// the [`crate::agent::OUTPUT_TOOL`] tool). A pure function of the event and the frozen bundle,
/// so every fold and replay builds the same context.
pub fn output_feedback(
    provider: crate::event::Provider,
    r: &crate::event::OutputRejected,
) -> String {
    let mut text = format!(
        "Your answer does not match the required JSON Schema (retry {} of {}):\n",
        r.retry, r.max_retries
    );
    for e in &r.errors {
        text.push_str("- ");
        text.push_str(e);
        text.push('\n');
    }
    text.push_str(match provider {
        crate::event::Provider::Openai => {
            "Answer again with the corrected JSON only: it must match the schema, with nothing \
             before or after it."
        }
        crate::event::Provider::Anthropic => {
            "Answer again by calling the `output` tool with the corrected answer: it must match \
             the schema."
        }
    });
    text
}

/// The text a model sees for a callback payload: a JSON string as is, anything else as JSON.
pub(super) fn payload_text(payload: &serde_json::Value) -> String {
    match payload {
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

impl RunState {
    /// What a step whose context includes inputs up to `through` adds to the transcript: the
    /// results of the previous step's tool calls (in call order), then the user's new messages.
    pub fn consumable(&self, through: u64) -> Vec<ChatMessage> {
        let mut out = Vec::new();
        let answered_in_transcript = |call_id: &str| {
            self.transcript
                .iter()
                .any(|m| matches!(m, ChatMessage::Tool { call_id: c, .. } if c == call_id))
        };
        for op in self.last_step_ops() {
            if let Some(result) = &op.result
                && result.seq <= through
                && !answered_in_transcript(&op.call.call_id)
            {
                out.push(ChatMessage::Tool {
                    call_id: op.call.call_id.clone(),
                    content: result.content.clone(),
                    is_error: result.is_error,
                });
            }
        }
        for m in self.pending_messages.iter().filter(|m| m.seq <= through) {
            out.push(ChatMessage::User {
                text: m.text.clone(),
            });
        }
        out
    }

    /// The model context of a step that starts now: the transcript (as a compaction in force
    /// leaves it, [`crate::context::apply`]) plus everything consumable.
    pub fn next_context(&self) -> Vec<ChatMessage> {
        let mut context = match &self.compaction {
            Some(c) => crate::context::apply(&self.transcript, Some(c)),
            None => self.transcript.clone(),
        };
        context.extend(crate::context::cut_pending(
            self.consumable(self.last_seq),
            self.compaction.as_ref(),
        ));
        context
    }

    /// A `context.compacted` checked against the transcript: it only grows what is left out,
    /// keeps the task, starts what it keeps at a turn (never at a tool result, whose call would
    /// be left out) and elides only tool results.
    pub(super) fn checked_compaction(
        &self,
        c: &crate::event::ContextCompacted,
    ) -> Result<crate::context::Compaction, String> {
        let len = self.transcript.len();
        let keep_from = usize::try_from(c.keep_from).map_err(|_| "keep_from too large")?;
        if keep_from == 0 || keep_from > len {
            return Err(format!("keep_from {keep_from} is outside 1..={len}"));
        }
        if keep_from > 1 && !matches!(self.transcript[keep_from], ChatMessage::Assistant { .. }) {
            return Err(format!("keep_from {keep_from} is not the start of a turn"));
        }
        let before = self.compaction.as_ref().map_or(1, |c| c.keep_from);
        if keep_from < before {
            return Err(format!(
                "keep_from {keep_from} is before the last one, {before}"
            ));
        }
        let mut elided = Vec::with_capacity(c.elided.len());
        for e in &c.elided {
            let i = usize::try_from(*e).map_err(|_| "an elided index is too large")?;
            let is_result = self
                .transcript
                .get(i)
                .is_some_and(|m| matches!(m, ChatMessage::Tool { .. }));
            if i < keep_from || !is_result || elided.last().is_some_and(|l| *l >= i) {
                return Err(format!(
                    "elided {i} is not a kept tool result in ascending order"
                ));
            }
            elided.push(i);
        }
        let summary = match &c.summary {
            // Only results elided: the summary of the turns left out still stands.
            None if keep_from == before => self.compaction.as_ref().and_then(|c| c.summary.clone()),
            None => None,
            Some(_) if keep_from == 1 => return Err("a summary of nothing left out".into()),
            Some(s) if s.text.trim().is_empty() => return Err("an empty summary".into()),
            Some(s) if s.text.chars().count() > crate::context::MAX_SUMMARY_CHARS => {
                return Err(format!(
                    "a summary longer than {} characters",
                    crate::context::MAX_SUMMARY_CHARS
                ));
            }
            Some(s)
                if s.request_id.run() != &self.run_id
                    || s.request_id.attempt().get() < crate::context::SUMMARY_ATTEMPTS =>
            {
                return Err("a summary's request id is not this run's summary request".into());
            }
            Some(s) => Some(s.text.clone()),
        };
        let previous_cut = self.compaction.as_ref().and_then(|c| c.max_result_chars);
        let max_result_chars = match c.max_result_chars {
            None => previous_cut,
            Some(n) => {
                let n = usize::try_from(n).map_err(|_| "max_result_chars too large")?;
                if n < crate::context::MIN_RESULT_CHARS {
                    return Err(format!(
                        "max_result_chars {n} is under {}",
                        crate::context::MIN_RESULT_CHARS
                    ));
                }
                if previous_cut.is_some_and(|p| n > p) {
                    return Err(format!("max_result_chars {n} raises the cut in force"));
                }
                Some(n)
            }
        };
        Ok(crate::context::Compaction {
            keep_from,
            elided,
            summary,
            max_result_chars,
        })
    }

    /// [`RunState::next_context`] and its digest (`Digest::of` the context, the same value):
    /// the transcript's messages are hashed once over the run's life (kept in
    /// [`RunState::transcript_digest`]), only what follows them at every step.
    pub fn next_context_digested(&self) -> (Vec<ChatMessage>, Digest) {
        let context = self.next_context();
        // A compacted context is not the transcript's prefix: hashed whole.
        if self.compaction.is_some() {
            let digest = Digest::of(&context);
            return (context, digest);
        }
        let mut hashed = self.transcript_digest.hashed();
        // Appended to only; anything else (a state built by hand) is hashed again.
        if hashed.items() > self.transcript.len() {
            hashed = SeqDigest::default();
        }
        for m in &self.transcript[hashed.items()..] {
            hashed.push(m);
        }
        self.transcript_digest.keep(&hashed);
        for m in &context[self.transcript.len()..] {
            hashed.push(m);
        }
        (context, hashed.digest())
    }
}
