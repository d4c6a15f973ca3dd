//! Provider-neutral preparation of the conversation, shared by both wire formats.
//!
//! Both APIs reject a tool call that is not answered right after the assistant turn that made it,
//! and a tool result that answers nothing (so does the strict mock, `kedge-mock-llm`: its "What is
//! rejected"). The step service never builds such a context on purpose, but a request must be
//! valid by construction, so [`normalize`] enforces it:
//! - each tool result is moved to directly after the assistant turn whose call it answers (ahead
//!   of any user message that came between);
//! - a call with no result gets a synthetic error result ([`MISSING_RESULT`]);
//! - a result that answers no call of the preceding assistant turn (or answers one twice) is
//!   dropped, with a warning.
//!
//! Both also reject empty messages, so a message that would carry no text gets
//! [`EMPTY_PLACEHOLDER`] instead.

use std::borrow::Cow;

use kedge_core::fold::ChatMessage;
use serde_json::Value;

/// Sent in place of a text that would otherwise be empty where the API requires content: an
/// assistant turn with neither text nor tool calls, an empty user message, an empty tool result
/// on OpenAI. Keeping the turn (rather than dropping it) keeps the alternation, and the number of
/// assistant turns, exactly as journaled.
pub const EMPTY_PLACEHOLDER: &str = "(empty)";

/// The content of the synthetic result given to a tool call that has none.
pub const MISSING_RESULT: &str = "no result was recorded for this tool call";

/// The key under which arguments that are not a JSON object are wrapped when a past tool call is
/// sent back to the provider (Anthropic requires `input` to be an object; see
/// [`parse_arguments`]).
pub const RAW_ARGUMENTS_KEY: &str = "raw_arguments";

/// The conversation with every tool call answered directly after its assistant turn: the
/// context's own messages borrowed (the request body copies them once), synthetic results owned.
pub fn normalize(context: &[ChatMessage]) -> Vec<Cow<'_, ChatMessage>> {
    struct Open {
        pending: Vec<String>,
        /// Where the next tool result goes: after the assistant turn and the results so far.
        insert_at: usize,
    }

    fn close(out: &mut Vec<Cow<'_, ChatMessage>>, open: Option<Open>) {
        let Some(mut open) = open else { return };
        for call_id in open.pending.drain(..) {
            tracing::warn!(%call_id, "tool call has no result; sending a synthetic error result");
            out.insert(
                open.insert_at,
                Cow::Owned(ChatMessage::Tool {
                    call_id,
                    content: MISSING_RESULT.to_owned(),
                    is_error: true,
                }),
            );
            open.insert_at += 1;
        }
    }

    let mut out = Vec::with_capacity(context.len());
    let mut open: Option<Open> = None;
    for message in context {
        match message {
            ChatMessage::User { .. } => out.push(Cow::Borrowed(message)),
            ChatMessage::Assistant { message: turn } => {
                close(&mut out, open.take());
                out.push(Cow::Borrowed(message));
                if !turn.tool_calls.is_empty() {
                    open = Some(Open {
                        pending: turn.tool_calls.iter().map(|c| c.call_id.clone()).collect(),
                        insert_at: out.len(),
                    });
                }
            }
            ChatMessage::Tool { call_id, .. } => {
                let slot = open.as_mut().and_then(|o| {
                    let i = o.pending.iter().position(|p| p == call_id)?;
                    o.pending.remove(i);
                    Some(o)
                });
                match slot {
                    Some(o) => {
                        out.insert(o.insert_at, Cow::Borrowed(message));
                        o.insert_at += 1;
                    }
                    None => tracing::warn!(
                        %call_id,
                        "dropping a tool result that answers no open tool call"
                    ),
                }
            }
        }
    }
    close(&mut out, open);
    out
}

/// The arguments of a tool call as assembled from the stream.
///
/// An empty string (a call without arguments) is `{}`. Text that is not valid JSON (models do
/// produce it, especially when cut off by the token limit) is kept verbatim as a JSON *string*
/// rather than failing the step: the tool then rejects the arguments and the model sees why and
/// can try again, which is what a person would want.
pub fn parse_arguments(raw: &str) -> Value {
    if raw.trim().is_empty() {
        return Value::Object(serde_json::Map::new());
    }
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_owned()))
}

/// Arguments of a past tool call as sent back to the provider: an object as is, anything else
/// (the invalid-JSON fallback of [`parse_arguments`]) wrapped as `{"raw_arguments": value}`.
/// Borrowed when it is an object (the common case: nothing is copied).
pub(crate) fn history_arguments(arguments: &Value) -> Cow<'_, Value> {
    match arguments {
        Value::Object(_) => Cow::Borrowed(arguments),
        other => Cow::Owned(serde_json::json!({ RAW_ARGUMENTS_KEY: other })),
    }
}

/// `text`, or [`EMPTY_PLACEHOLDER`] when it has no visible characters.
pub(crate) fn non_empty(text: &str) -> &str {
    if text.trim().is_empty() {
        EMPTY_PLACEHOLDER
    } else {
        text
    }
}

/// Kedge's default context window (tokens) of a model it knows by name, for an agent whose
/// `context.window_tokens` is not set; `None` for a model it does not know (then the context is
/// compacted only when the provider says a request is too long). Conservative: the smallest
/// window the providers document for the family.
pub fn known_window(spec: &kedge_core::event::ModelSpec) -> Option<u32> {
    const KNOWN: &[(&str, u32)] = &[
        ("gpt-4.1", 1_047_576),
        ("gpt-5", 400_000),
        ("gpt-4o", 128_000),
        ("gpt-4-turbo", 128_000),
        ("o1", 128_000),
        ("o3", 200_000),
        ("o4-mini", 200_000),
        ("gpt-3.5-turbo", 16_385),
        ("claude-", 200_000),
    ];
    let name = spec.name.to_ascii_lowercase();
    KNOWN
        .iter()
        .find(|(prefix, _)| name.starts_with(prefix))
        .map(|(_, window)| *window)
}

/// The estimated tokens of what every request of an agent sends besides the conversation:
/// its system prompt and its tools' names, descriptions and schemas.
pub fn overhead_tokens(system: &str, tools: &[kedge_core::agent::ToolSpec]) -> u64 {
    let tools: u64 = tools
        .iter()
        .map(|t| kedge_core::context::estimate_text(&serde_json::to_string(t).unwrap_or_default()))
        .sum();
    kedge_core::context::estimate_text(system) + tools
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::event::{AssistantMessage, ToolCall};

    fn user(text: &str) -> ChatMessage {
        ChatMessage::User { text: text.into() }
    }
    fn owned(messages: Vec<Cow<'_, ChatMessage>>) -> Vec<ChatMessage> {
        messages.into_iter().map(Cow::into_owned).collect()
    }
    fn calls(ids: &[&str]) -> ChatMessage {
        ChatMessage::Assistant {
            message: AssistantMessage {
                text: String::new(),
                tool_calls: ids
                    .iter()
                    .map(|id| ToolCall {
                        call_id: (*id).into(),
                        name: "t".into(),
                        arguments: serde_json::json!({}),
                    })
                    .collect(),
                thinking: Vec::new(),
            },
        }
    }
    fn result(id: &str) -> ChatMessage {
        ChatMessage::Tool {
            call_id: id.into(),
            content: format!("r{id}"),
            is_error: false,
        }
    }

    #[test]
    fn a_well_formed_context_is_unchanged() {
        let ctx = vec![
            user("hi"),
            calls(&["a", "b"]),
            result("b"),
            result("a"),
            user("more"),
        ];
        assert_eq!(owned(normalize(&ctx)), ctx);
    }

    #[test]
    fn results_move_ahead_of_user_messages_and_missing_ones_are_synthesized() {
        let ctx = vec![
            user("hi"),
            calls(&["a", "b", "c"]),
            result("a"),
            user("interrupting"),
            result("c"),
            calls(&["d"]),
        ];
        let missing = |id: &str| ChatMessage::Tool {
            call_id: id.into(),
            content: MISSING_RESULT.into(),
            is_error: true,
        };
        assert_eq!(
            owned(normalize(&ctx)),
            vec![
                user("hi"),
                calls(&["a", "b", "c"]),
                result("a"),
                result("c"),
                missing("b"),
                user("interrupting"),
                calls(&["d"]),
                missing("d"),
            ]
        );
    }

    #[test]
    fn orphan_and_duplicate_results_are_dropped() {
        let ctx = vec![
            user("hi"),
            result("x"),
            calls(&["a"]),
            result("a"),
            result("a"),
            result("zz"),
        ];
        assert_eq!(
            owned(normalize(&ctx)),
            vec![user("hi"), calls(&["a"]), result("a")]
        );
    }

    #[test]
    fn arguments_parse_leniently() {
        assert_eq!(parse_arguments(""), serde_json::json!({}));
        assert_eq!(
            parse_arguments(r#"{"path":"/x"}"#),
            serde_json::json!({"path": "/x"})
        );
        assert_eq!(
            parse_arguments(r#"{"path":"/x"#),
            Value::String(r#"{"path":"/x"#.into())
        );
        assert_eq!(
            history_arguments(&Value::String("{bad".into())).into_owned(),
            serde_json::json!({"raw_arguments": "{bad"})
        );
    }

    #[test]
    fn known_models_have_a_window_and_unknown_ones_none() {
        let spec = |name: &str| -> kedge_core::event::ModelSpec {
            serde_json::from_value(serde_json::json!({"provider": "openai", "name": name}))
                .expect("spec")
        };
        assert_eq!(known_window(&spec("gpt-4o-mini")), Some(128_000));
        assert_eq!(known_window(&spec("claude-sonnet-4-5")), Some(200_000));
        assert_eq!(known_window(&spec("my-local-model")), None);
    }
}
