//! The model's context window (docs/ARCHITECTURE.md "The context window").
//!
//! Every step sends the whole conversation, so a run that goes on long enough outgrows the
//! model's window. Before that happens the conversation the model reads is *compacted*: a
//! journaled decision (`context.compacted`) says which older tool results are elided and from
//! which turn on the conversation is kept verbatim; everything before that turn, except the
//! task, is left out with a note. The journal keeps the whole history (`/history`, SSE, the
//! console show it all); only the model's context is compacted.
//!
//! What a compaction never removes: the task (the run's first message), the last
//! `keep_last_turns` turns verbatim, and the results of the last turn's tool calls (they
//! answer calls the model is waiting on). Tool results are elided oldest first; only when that
//! is not enough are whole turns left out, oldest first (`trim`).
//!
//! Sizes are *estimates*: a character count of each message's JSON divided by four, the usual
//! rule for English text and JSON with the providers' tokenizers. The estimate need not be
//! exact: a provider that still finds the request too long answers `context_length_exceeded`,
//! which makes the step compact once more, to half the size it sent.
//!
//! Pure functions of the folded state and the settings; the step service decides when to call
//! them and journals what they return.

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::fold::{ChatMessage, RunState};

/// What a compaction replaced an elided tool result with (followed by its length).
pub const ELIDED: &str =
    "[elided to fit the model's context window; the full result is in the run's journal:";

/// The note that stands for the turns left out.
pub fn left_out_note(messages: usize) -> String {
    format!(
        "[{messages} earlier messages of this conversation were left out to fit the model's \
         context window; the run's journal keeps them all. The task is above; the conversation \
         goes on below.]"
    )
}

/// The note that stands for the turns left out under a summary of them.
pub fn summary_note(messages: usize, summary: &str) -> String {
    format!(
        "[{messages} earlier messages of this conversation were left out to fit the model's \
         context window; the run's journal keeps them all. The task is above; this is a summary \
         of them, written for you earlier in this run:]\n\n{summary}"
    )
}

/// The longest summary a compaction may carry, in characters.
pub const MAX_SUMMARY_CHARS: usize = 100_000;

/// Summary calls are numbered from here among a step's attempts (a step has at most
/// `MAX_ATTEMPTS_PER_STEP` of its own): [`summary_request_id`].
pub const SUMMARY_ATTEMPTS: u32 = 1_000_000;

/// The system prompt of a summary call.
pub const SUMMARY_SYSTEM: &str = "You keep a long-running agent's memory. You are given the \
    first part of its conversation (its task, its messages, the tool calls it made and their \
    results). Write a summary the agent will read instead of that part: what was asked, what was \
    done and found (names, numbers, ids, paths, decisions, errors that matter), and what is still \
    open. Plain text, concise, no tool calls.";

/// The last message of a summary call's conversation.
pub const SUMMARY_ASK: &str = "Summarize the conversation above for the agent, as instructed. \
    Answer with the summary alone.";

/// The request id of the summary call made before step `step` for a compaction that keeps the
/// transcript from `keep_from`: the same after a crash, so its answer is found stored and
/// reused, never bought twice.
pub fn summary_request_id(
    run: &crate::ids::RunId,
    step: crate::StepNo,
    keep_from: usize,
) -> crate::ids::ModelRequestId {
    let n = u32::try_from(keep_from).unwrap_or(u32::MAX - SUMMARY_ATTEMPTS);
    crate::ids::ModelRequestId::new(
        run,
        step,
        crate::Attempt(SUMMARY_ATTEMPTS.saturating_add(n)),
    )
}

/// What a summary call for a compaction keeping the transcript from `keep_from` reads: the
/// part of the conversation it leaves out, as the model reads it now (an earlier summary
/// included), and the request to summarize it.
pub fn summary_context(state: &RunState, keep_from: usize) -> Vec<ChatMessage> {
    let upto = keep_from.min(state.transcript.len());
    let mut context = apply(&state.transcript[..upto], state.compaction.as_ref());
    context.push(ChatMessage::User {
        text: SUMMARY_ASK.into(),
    });
    context
}

/// How a run's context is kept within the model's window (the agent's `context`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct ContextSettings {
    /// The model's context window in tokens. Absent: Kedge's default for a known model
    /// (`kedge_model::known_window`), else unknown (the context is compacted only when the
    /// provider says it is too long).
    #[serde(skip_serializing_if = "Option::is_none")]
    #[schemars(range(min = 256, max = 100_000_000))]
    pub window_tokens: Option<u32>,
    /// `trim` (default): older tool results elided first, then older turns left out;
    /// `summarize`: the same, and the turns left out are replaced by the model's summary of
    /// them (a call of its own); `fail`: the run fails when its context does not fit (as it
    /// did before compaction existed).
    pub strategy: ContextStrategy,
    /// Turns (an assistant message with what answered it) always kept verbatim (default 4).
    #[schemars(range(min = 1, max = 1000))]
    pub keep_last_turns: u32,
}

impl Default for ContextSettings {
    fn default() -> Self {
        Self {
            window_tokens: None,
            strategy: ContextStrategy::Trim,
            keep_last_turns: DEFAULT_KEEP_LAST_TURNS,
        }
    }
}

/// A compaction leaves `1 / HEADROOM` of the budget free for the steps that follow.
pub const HEADROOM: u64 = 4;

/// Turns kept verbatim by default.
pub const DEFAULT_KEEP_LAST_TURNS: u32 = 4;

impl ContextSettings {
    pub fn is_default(&self) -> bool {
        *self == ContextSettings::default()
    }

    /// A setting out of range, as (field, reason).
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if let Some(w) = self.window_tokens
            && !(256..=100_000_000).contains(&w)
        {
            return Err((
                "context.window_tokens",
                format!("{w} is outside 256..=100000000"),
            ));
        }
        if !(1..=1000).contains(&self.keep_last_turns) {
            return Err((
                "context.keep_last_turns",
                format!("{} is outside 1..=1000", self.keep_last_turns),
            ));
        }
        Ok(())
    }
}

/// What a run does when its context does not fit the model's window.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, JsonSchema)]
#[serde(rename_all = "snake_case")]
pub enum ContextStrategy {
    #[default]
    Trim,
    Summarize,
    Fail,
}

/// A compaction in force: what of the transcript the model reads (`context.compacted`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Compaction {
    /// The transcript is kept verbatim from this index on (1: nothing left out but elided
    /// results; the task, index 0, is always kept).
    pub keep_from: usize,
    /// Transcript indexes of tool results whose content the model reads as elided.
    pub elided: Vec<usize>,
    /// The model's summary of the turns left out, read in their place.
    pub summary: Option<String>,
    /// Tool results longer than this many characters reach the model cut to it, with a note
    /// (a result too big for the window on its own; the journal keeps it whole).
    pub max_result_chars: Option<usize>,
}

/// The shortest a result is cut to.
pub const MIN_RESULT_CHARS: usize = 256;

/// A tool result's content as the model reads it under a cut to `max` characters.
pub fn cut_result(content: &str, max: usize) -> String {
    let len = content.chars().count();
    if len <= max {
        return content.to_owned();
    }
    let kept: String = content.chars().take(max).collect();
    format!(
        "{kept}\n[cut to {max} of {len} characters to fit the model's context window; the full \
         result is in the run's journal]"
    )
}

/// `messages` with their tool results cut under `compaction` (what follows the transcript in
/// the next step's context: the results and messages it consumes).
pub fn cut_pending(
    messages: Vec<ChatMessage>,
    compaction: Option<&Compaction>,
) -> Vec<ChatMessage> {
    let Some(max) = compaction.and_then(|c| c.max_result_chars) else {
        return messages;
    };
    messages
        .into_iter()
        .map(|m| match m {
            ChatMessage::Tool {
                call_id,
                content,
                is_error,
            } => ChatMessage::Tool {
                call_id,
                content: cut_result(&content, max),
                is_error,
            },
            other => other,
        })
        .collect()
}

/// The estimated tokens of the next step's context under `compaction`: the transcript as the
/// model reads it, and `pending` (what the step consumes after it).
pub fn context_tokens(
    transcript: &[ChatMessage],
    pending: &[ChatMessage],
    compaction: Option<&Compaction>,
) -> u64 {
    apply(transcript, compaction)
        .iter()
        .chain(&cut_pending(pending.to_vec(), compaction))
        .map(estimate)
        .sum()
}

/// The estimated tokens of a message: its JSON's characters / 4, plus a few for its framing.
pub fn estimate(message: &ChatMessage) -> u64 {
    let chars = serde_json::to_string(message).map_or(0, |s| s.chars().count());
    (chars as u64) / 4 + 4
}

/// The estimated tokens of a text (a system prompt, a tool schema).
pub fn estimate_text(text: &str) -> u64 {
    (text.chars().count() as u64) / 4 + 4
}

/// The transcript as the model reads it under `compaction` (`None`: as it is).
pub fn apply(transcript: &[ChatMessage], compaction: Option<&Compaction>) -> Vec<ChatMessage> {
    let Some(c) = compaction else {
        return transcript.to_vec();
    };
    let mut out = Vec::with_capacity(transcript.len().saturating_sub(c.keep_from) + 2);
    if let Some(task) = transcript.first() {
        out.push(task.clone());
    }
    let left_out = c.keep_from.saturating_sub(1).min(transcript.len());
    if left_out > 0 {
        out.push(ChatMessage::User {
            text: match &c.summary {
                Some(summary) => summary_note(left_out, summary),
                None => left_out_note(left_out),
            },
        });
    }
    for (i, m) in transcript.iter().enumerate().skip(c.keep_from.max(1)) {
        out.push(match m {
            ChatMessage::Tool {
                call_id,
                content,
                is_error,
            } if c.elided.binary_search(&i).is_ok() => ChatMessage::Tool {
                call_id: call_id.clone(),
                content: format!("{ELIDED} {} characters]", content.chars().count()),
                is_error: *is_error,
            },
            ChatMessage::Tool {
                call_id,
                content,
                is_error,
            } if c.max_result_chars.is_some() => ChatMessage::Tool {
                call_id: call_id.clone(),
                content: cut_result(content, c.max_result_chars.unwrap_or(usize::MAX)),
                is_error: *is_error,
            },
            other => other.clone(),
        });
    }
    out
}

/// When the context under `c` still does not fit the `window`, cuts the tool results it lets
/// through to the most characters that bring it within `budget` (at least
/// [`MIN_RESULT_CHARS`]: when even that does not fit, it is what is left to try). Only results
/// longer than the cut change, so a result too big on its own is cut and the others stay
/// whole. A cut in force is only ever lowered.
fn cut_to_fit(c: &mut Compaction, window: u64, budget: u64, size: impl Fn(&Compaction) -> u64) {
    if size(c) <= window {
        return;
    }
    let fits = |max: usize| {
        let mut tried = c.clone();
        tried.max_result_chars = Some(max);
        size(&tried) <= budget
    };
    let (mut lo, mut hi) = (MIN_RESULT_CHARS, c.max_result_chars.unwrap_or(1 << 24));
    if hi <= lo || !fits(lo) {
        // As far as a cut goes, when it changes anything.
        let mut shortest = c.clone();
        shortest.max_result_chars = Some(lo.min(hi));
        if size(&shortest) < size(c) {
            *c = shortest;
        }
        return;
    }
    // The largest cut that fits, between `lo` (fits) and `hi`.
    while hi - lo > 16 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    c.max_result_chars = Some(lo);
}

/// The compaction that brings the context of the run's next step within `budget` tokens (the
/// window less the system prompt, the tools and the answer's room), starting from the one in
/// force; `None` when the context fits, or when nothing more may be taken out (then the call
/// is made, and a provider that refuses it fails the run). `pending`: what the next step adds
/// after the transcript (tool results, messages), kept whole. A context that does not fit is
/// brought to three quarters of the budget ([`HEADROOM`]), so that one compaction lasts for
/// several steps instead of one per step.
pub fn compaction(
    state: &RunState,
    pending: &[ChatMessage],
    budget: u64,
    keep_last_turns: u32,
) -> Option<Compaction> {
    let transcript = &state.transcript;
    let current = state.compaction.clone().unwrap_or(Compaction {
        keep_from: 1,
        elided: Vec::new(),
        summary: None,
        max_result_chars: None,
    });
    let size = |c: &Compaction| -> u64 { context_tokens(transcript, pending, Some(c)) };
    if size(&current) <= budget {
        return None;
    }
    let window = budget;
    let budget = budget - budget / HEADROOM;
    // Turns start at assistant messages; the last `keep_last_turns` are kept verbatim.
    let starts: Vec<usize> = transcript
        .iter()
        .enumerate()
        .filter(|(_, m)| matches!(m, ChatMessage::Assistant { .. }))
        .map(|(i, _)| i)
        .collect();
    let keep = usize::try_from(keep_last_turns).unwrap_or(usize::MAX);
    let mut next = current.clone();
    let protected_from = if starts.len() > keep {
        starts[starts.len() - keep]
    } else {
        // No turn may be left out: only a cut of the results can help.
        cut_to_fit(&mut next, window, budget, size);
        return (next != current).then_some(next);
    };
    // First: tool results before the protected turns, oldest first.
    let first = next.keep_from.max(1);
    for (i, m) in transcript
        .iter()
        .enumerate()
        .take(protected_from)
        .skip(first)
    {
        if matches!(m, ChatMessage::Tool { .. }) && next.elided.binary_search(&i).is_err() {
            let at = next.elided.partition_point(|e| *e < i);
            next.elided.insert(at, i);
            if size(&next) <= budget {
                return Some(next);
            }
        }
    }
    // Then whole turns, oldest first (never a protected one).
    let from = next.keep_from;
    for &start in starts
        .iter()
        .filter(|s| **s > from && **s <= protected_from)
    {
        next.keep_from = start;
        next.elided.retain(|e| *e >= start);
        if size(&next) <= budget {
            break;
        }
    }
    // Last: results too big for the window on their own (the last turns' included) are cut.
    cut_to_fit(&mut next, window, budget, size);
    // More turns left out: an earlier summary no longer covers them all (the step service
    // asks for a new one under `summarize`).
    if next.keep_from != current.keep_from {
        next.summary = None;
    }
    (next != current).then_some(next)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::{AssistantMessage, ToolCall};

    fn assistant(call: &str) -> ChatMessage {
        ChatMessage::Assistant {
            message: AssistantMessage {
                text: String::new(),
                tool_calls: vec![ToolCall {
                    call_id: call.into(),
                    name: "read_file".into(),
                    arguments: serde_json::json!({}),
                }],
                ..AssistantMessage::default()
            },
        }
    }

    fn result(call: &str, size: usize) -> ChatMessage {
        ChatMessage::Tool {
            call_id: call.into(),
            content: "x".repeat(size),
            is_error: false,
        }
    }

    fn state(turns: usize, result_size: usize) -> RunState {
        let created = crate::event::Draft::new(crate::event::Event::RunCreated(Box::new(
            crate::fixtures::run_created("demo", "the task"),
        )));
        let run: crate::ids::RunId = "run_ctx".parse().expect("run id");
        let env = crate::event::Envelope::new(run, crate::event::Timestamp::now(), created);
        let mut s = RunState::created(1, &env).expect("created");
        for t in 0..turns {
            let id = format!("call_{t}");
            s.transcript.push(assistant(&id));
            s.transcript.push(result(&id, result_size));
        }
        s
    }

    fn total(s: &RunState, c: Option<&Compaction>) -> u64 {
        apply(&s.transcript, c).iter().map(estimate).sum()
    }

    #[test]
    fn a_context_that_fits_is_left_alone() {
        let s = state(10, 100);
        assert_eq!(compaction(&s, &[], total(&s, None), 4), None);
    }

    #[test]
    fn old_tool_results_go_first_then_old_turns_and_the_task_and_last_turns_stay() {
        let s = state(20, 4000);
        let full = total(&s, None);
        // A little too big: some old results elided, no turn left out.
        let c = compaction(&s, &[], full - 1500, 4).expect("compacts");
        assert_eq!(c.keep_from, 1);
        assert!(!c.elided.is_empty() && c.elided.iter().all(|i| *i < 33));
        assert!(total(&s, Some(&c)) <= full - 1500);
        // Far too big: turns are left out too, but never the last four.
        let c = compaction(&s, &[], 6000, 4).expect("compacts");
        assert_eq!(c.max_result_chars, None, "the last four turns fit: no cut");
        let seen = apply(&s.transcript, Some(&c));
        assert!(matches!(&seen[0], ChatMessage::User { text } if text == "the task"));
        assert!(matches!(&seen[1], ChatMessage::User { text } if text.contains("left out")));
        let last = &s.transcript[s.transcript.len() - 8..];
        assert_eq!(
            &seen[seen.len() - 8..],
            last,
            "the last four turns verbatim"
        );
        // The kept part starts at a turn: every tool result answers a call that is kept.
        assert!(matches!(seen[2], ChatMessage::Assistant { .. }));
    }

    #[test]
    fn a_compaction_only_grows_and_stops_when_nothing_more_may_go() {
        let s = state(6, 4000);
        let first = compaction(&s, &[], 5000, 4).expect("compacts");
        let mut s2 = s.clone();
        s2.compaction = Some(first.clone());
        // Nothing more to take out within the protected turns.
        let again = compaction(&s2, &[], 10, 4);
        assert!(
            again.is_none()
                || again
                    .as_ref()
                    .is_some_and(|c| c.keep_from >= first.keep_from)
        );
        let mut s3 = s2.clone();
        s3.compaction = again.or(Some(first));
        assert_eq!(compaction(&s3, &[], 10, 4), None);
        // Too few turns to leave one out: only the results can be cut, and once at the
        // shortest cut, nothing more.
        let few = state(3, 10_000);
        let cut = compaction(&few, &[], 10, 4).expect("cut");
        assert_eq!(
            (cut.keep_from, cut.max_result_chars),
            (1, Some(MIN_RESULT_CHARS))
        );
        let mut few_cut = few.clone();
        few_cut.compaction = Some(cut);
        assert_eq!(compaction(&few_cut, &[], 10, 4), None);
        assert_eq!(
            compaction(&state(3, 10), &[], 10, 4),
            None,
            "nothing to cut"
        );
    }

    #[test]
    fn a_result_too_big_for_the_window_on_its_own_is_cut_with_a_note_and_the_others_stay() {
        let mut s = state(6, 100);
        // The newest result, not yet in the transcript (the next step consumes it), is huge.
        let pending = vec![result("call_new", 200_000)];
        let window = 4_000;
        let c = compaction(&s, &pending, window, 4).expect("compacts");
        let max = c.max_result_chars.expect("a cut");
        assert!((MIN_RESULT_CHARS..200_000).contains(&max));
        assert!(context_tokens(&s.transcript, &pending, Some(&c)) <= window);
        // What the model reads: the big one cut, with the note; the small ones whole.
        let cut = cut_pending(pending.clone(), Some(&c));
        assert!(matches!(&cut[0], ChatMessage::Tool { content, .. }
            if content.contains(&format!("[cut to {max} of 200000 characters"))));
        s.compaction = Some(c.clone());
        let seen = apply(&s.transcript, Some(&c));
        assert!(seen.iter().all(
            |m| !matches!(m, ChatMessage::Tool { content, .. } if content.contains("[cut to"))
        ));
        assert_eq!(cut_result("short", max), "short");
    }

    #[test]
    fn settings_are_range_checked() {
        assert!(ContextSettings::default().check().is_ok());
        let bad = ContextSettings {
            window_tokens: Some(10),
            ..ContextSettings::default()
        };
        assert_eq!(bad.check().map_err(|e| e.0), Err("context.window_tokens"));
        let bad = ContextSettings {
            keep_last_turns: 0,
            ..ContextSettings::default()
        };
        assert_eq!(bad.check().map_err(|e| e.0), Err("context.keep_last_turns"));
    }
}
