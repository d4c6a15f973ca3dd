//! What both formats share: the parsed request summary, the generated answer, ids and usage.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{SystemTime, UNIX_EPOCH};

use serde_json::{Map, Value};

use crate::error::Provider;
use crate::script::{Cue, Response};

/// What validation extracted from an accepted request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Parsed {
    pub(crate) model: String,
    pub(crate) stream: bool,
    /// OpenAI `stream_options.include_usage`.
    pub(crate) include_usage: bool,
    /// Anthropic `thinking` enabled: the answer starts with a signed thinking block.
    pub(crate) thinking: bool,
    pub(crate) cue: Cue,
    /// Characters counted for `input_tokens`: the compact JSON of `messages` (and `system`).
    pub(crate) input_chars: usize,
}

/// One generated answer, ids included.
#[derive(Debug, Clone)]
pub(crate) struct Output {
    /// `chatcmpl-…` or `msg_…`.
    pub(crate) id: String,
    pub(crate) created: u64,
    pub(crate) model: String,
    pub(crate) text: Option<String>,
    /// The thinking block's text (Anthropic, with thinking enabled).
    pub(crate) thinking: Option<String>,
    pub(crate) calls: Vec<Call>,
    pub(crate) input_tokens: u64,
    pub(crate) output_tokens: u64,
}

/// One generated tool call.
#[derive(Debug, Clone)]
pub(crate) struct Call {
    /// `call_<n>` or `toolu_<n>`.
    pub(crate) id: String,
    pub(crate) name: String,
    /// The arguments as compact JSON text (OpenAI's `arguments`, Anthropic's streamed `partial_json`).
    pub(crate) arguments: String,
    pub(crate) input: Map<String, Value>,
}

impl Output {
    pub(crate) fn generate(provider: Provider, parsed: &Parsed, response: &Response) -> Output {
        let (message_prefix, call_prefix) = match provider {
            Provider::OpenAi => ("chatcmpl-mock", "call_"),
            Provider::Anthropic => ("msg_mock", "toolu_"),
        };
        let calls: Vec<Call> = response
            .tool_calls
            .iter()
            .map(|c| {
                let input = c.arguments.clone();
                Call {
                    id: format!("{call_prefix}{}", next_id()),
                    name: c.name.clone(),
                    arguments: Value::Object(input.clone()).to_string(),
                    input,
                }
            })
            .collect();
        let thinking = parsed.thinking.then(|| {
            format!(
                "Step {}: deciding how to answer.",
                parsed.cue.assistant_turns + 1
            )
        });
        let output_chars = response.text.as_deref().map_or(0, |t| t.chars().count())
            + thinking.as_deref().map_or(0, |t| t.chars().count())
            + calls
                .iter()
                .map(|c| c.name.chars().count() + c.arguments.chars().count())
                .sum::<usize>();
        Output {
            id: format!("{message_prefix}{}", next_id()),
            created: SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            model: parsed.model.clone(),
            text: response.text.clone(),
            thinking,
            calls,
            input_tokens: tokens(parsed.input_chars),
            output_tokens: tokens(output_chars),
        }
    }
}

static NEXT_ID: AtomicU64 = AtomicU64::new(1);

/// A process-wide counter: generated ids never repeat within a process.
pub(crate) fn next_id() -> u64 {
    NEXT_ID.fetch_add(1, Ordering::Relaxed)
}

/// Anthropic's `request_id` / `request-id` (and OpenAI's `x-request-id`).
pub(crate) fn new_request_id() -> String {
    format!("req_mock{:016}", next_id())
}

/// The signature the mock gives a thinking block: a keyed hash (FNV-1a, 64 bits) of its text,
/// so that a block sent back changed, or made up, no longer matches.
pub(crate) fn thinking_signature(thinking: &str) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in b"kedge-mock-llm thinking key\0"
        .iter()
        .chain(thinking.as_bytes())
    {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("mocksig_{h:016x}")
}

/// Deterministic token count: characters / 4 + 1.
pub(crate) fn tokens(chars: usize) -> u64 {
    (chars / 4 + 1) as u64
}

/// Splits `s` into stream pieces of at most ~16 characters, and into at least two pieces
/// whenever it has two characters or more (so clients must reassemble fragments).
pub(crate) fn pieces(s: &str) -> Vec<&str> {
    let boundaries: Vec<usize> = s.char_indices().map(|(i, _)| i).collect();
    let n = boundaries.len();
    if n <= 1 {
        return if s.is_empty() { Vec::new() } else { vec![s] };
    }
    let k = n.div_ceil(16).max(2);
    let mut out = Vec::with_capacity(k);
    let mut start = 0;
    for part in 1..=k {
        let end_char = n * part / k;
        let end = boundaries.get(end_char).copied().unwrap_or(s.len());
        if end > start {
            out.push(&s[start..end]);
            start = end;
        }
    }
    out
}

/// One server-sent event frame. `event` is Anthropic's event name.
pub(crate) fn sse(event: Option<&str>, data: &str) -> String {
    match event {
        Some(event) => format!("event: {event}\ndata: {data}\n\n"),
        None => format!("data: {data}\n\n"),
    }
}

/// Characters of `value`'s compact JSON (what `value.to_string().chars().count()` gives),
/// counted as it is written out: no copy of the request, which grows with the conversation.
pub(crate) fn json_chars(value: &impl serde::Serialize) -> usize {
    /// Counts UTF-8 characters: every byte that does not continue one starts one.
    struct Chars(usize);
    impl std::io::Write for Chars {
        fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
            self.0 += buf.iter().filter(|b| (**b & 0xC0) != 0x80).count();
            Ok(buf.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let mut chars = Chars(0);
    // Writing JSON values into a counter cannot fail.
    let _ = serde_json::to_writer(&mut chars, value);
    chars.0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn json_chars_counts_what_the_compact_json_shows() {
        let v = serde_json::json!([{"role": "user", "content": "naïve café — 東京 🦀"}, 1, null]);
        assert_eq!(json_chars(&v), v.to_string().chars().count());
        let items = vec![v.clone(), serde_json::json!("x")];
        assert_eq!(
            json_chars(&items),
            serde_json::Value::Array(items.clone())
                .to_string()
                .chars()
                .count()
        );
    }

    #[test]
    fn pieces_split_in_at_least_two_and_reassemble() {
        for s in [
            "{}",
            "ab",
            "héllo wörld",
            &"x".repeat(100),
            "{\"path\":\"notes.txt\"}",
        ] {
            let p = pieces(s);
            assert!(p.len() >= 2, "{s:?} -> {p:?}");
            assert!(
                p.iter().all(|x| !x.is_empty() && x.chars().count() <= 16),
                "{p:?}"
            );
            assert_eq!(p.concat(), s);
        }
        assert_eq!(pieces("a"), ["a"]);
        assert!(pieces("").is_empty());
    }

    #[test]
    fn tokens_are_chars_over_four_plus_one() {
        assert_eq!(tokens(0), 1);
        assert_eq!(tokens(7), 2);
        assert_eq!(tokens(8), 3);
    }
}
