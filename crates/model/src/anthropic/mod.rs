//! Anthropic Messages (`POST <base>/messages`), streamed.
//!
//! Request: `system` at the top level (omitted when empty), `max_tokens` (required), and the
//! [normalized](crate::context) conversation as content blocks, with consecutive same-role turns
//! merged into one message:
//! - assistant: a `text` block when the text is not blank, then one `tool_use` block per call
//!   (`input` is always an object);
//! - tool results: `tool_result` blocks (`is_error` when set; no `content` when empty) in the
//!   *next* user message, always before that message's other blocks, so a user message that
//!   arrived after the results is merged in behind them;
//! - user: a `text` block when the text is not blank; a message left with no block at all gets
//!   [`crate::EMPTY_PLACEHOLDER`] (text blocks must be non-empty).
//!
//! Tool ids are sent as they came from the provider; one that does not match `^[a-zA-Z0-9_-]+$`
//! (never the case for Anthropic's own ids) has its other characters replaced by `_`, on the
//! `tool_use` and its `tool_result` alike.
//!
//! Settings (`model.settings`): `temperature`, `top_p`, `stop_sequences`, `thinking: {type:
//! enabled, budget_tokens}`, `tool_choice` (`auto`, `none`, `any`, `tool` + `name`, see
//! [`crate::effective_tool_choice`]; `disable_parallel_tool_use` for `parallel_tool_calls:
//! false`) only with `tools`. With `cache`, `cache_control: {type: ephemeral}` marks the system
//! prompt (then sent as one text block), the last tool and the last block of the last message:
//! three breakpoints of the four allowed, so each step of a long run reads the prefix the previous
//! step wrote. Thinking blocks of an assistant turn come first in its content, exactly as
//! received (thinking text and signature, or redacted data).
//!
//! Structured output (an agent's `output_schema`; Anthropic has no `response_format`): the
//! schema is offered as the input schema of one more tool, `output`, after the agent's own, and
//! the system prompt ends with [`OUTPUT_INSTRUCTION`]. The call is forced (`tool_choice: {type:
//! tool, name: output}`) only when it is the only tool and thinking is off (the API refuses a
//! forcing choice with thinking); otherwise it is offered. A call to it is the answer
//! ([`answer_from_output_tool`]): its input becomes the turn's text and the call is removed, so
//! it is never dispatched and never needs a `tool_result`.
//!
//! Response: `message_start`, per block `content_block_start` / `content_block_delta`
//! (`text_delta`, `input_json_delta`, `thinking_delta`, `signature_delta`) / `content_block_stop`, `message_delta` (stop reason,
//! output tokens), `message_stop`; `ping` ignored; `error` → [`ModelError`](crate::ModelError). Input tokens count
//! cache reads and writes too (`input_tokens + cache_creation_input_tokens +
//! cache_read_input_tokens`), since all of them are billed input.

mod output;
mod request;
mod stream;

pub use output::{OUTPUT_INSTRUCTION, answer_from_output_tool};
pub use request::{request_body, request_json};
pub(crate) use stream::Decoder;

/// The public endpoint.
pub const DEFAULT_BASE_URL: &str = "https://api.anthropic.com";

/// The `anthropic-version` header sent with every request.
pub const API_VERSION: &str = "2023-06-01";
