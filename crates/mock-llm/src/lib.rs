//! A strict mock of the OpenAI Chat Completions and Anthropic Messages APIs.
//!
//! Kedge's integration tests and `kedge demo` use it as the model. It speaks both wire formats,
//! streaming and not, **rejects what the real APIs reject** (a mock more forgiving than the real
//! API blesses a wrong implementation), answers from a script, injects faults, and counts calls
//! per Kedge request id.
//!
//! ```no_run
//! # async fn demo() -> Result<(), kedge_mock_llm::ScriptError> {
//! use kedge_mock_llm::{MockHandle, Scripts};
//! let scripts = Scripts::from_json(r#"{"models": {"mock-demo": {"default": {"text": "hi"}}}}"#)?;
//! let mock = MockHandle::start(scripts).await;          // 127.0.0.1:<free port>, stops on drop
//! let url = format!("{}/v1/chat/completions", mock.base_url());
//! // ... point the client at `url`, then:
//! assert_eq!(mock.calls_for("req_123"), 1);
//! # Ok(()) }
//! ```
//!
//! # Endpoints
//!
//! | method and path | what |
//! | --- | --- |
//! | `POST /v1/chat/completions` | OpenAI; needs `Authorization: Bearer <non-empty>` (else 401) |
//! | `POST /v1/messages` | Anthropic; needs `x-api-key` (else 401) and `anthropic-version` (else 400) |
//! | `GET /_mock/calls` | `{"total": N, "by_request_id": {"req_…": n}, "by_model": {"m": n}, "troubled": N, "limited": N}` |
//! | `GET /_mock/requests?model=M` | the JSON bodies received for model `M`, in order (all models without `model`) |
//! | `PUT /_mock/scripts` | replace the script (JSON body as below); 204, or 400 `{"error": {"message", "path"}}` |
//! | `PUT /_mock/trouble` | put an outage in front of model calls (JSON body as in [A provider's bad day](#a-providers-bad-day)), replacing any other; 204, or 400 `{"error": {"message", "path"}}` |
//! | `GET /_mock/trouble` | the trouble in effect, as it was put (`null` when none, or once its `for_ms` has passed) |
//! | `DELETE /_mock/trouble` | end the trouble (if any); 204 |
//! | `POST /_mock/reset` | zero the counters (`troubled` too), forget the recorded bodies, fault counts and rate-limit windows (the script and the trouble stay); 204 |
//!
//! Every call that passes authentication is counted (under the `X-Kedge-Request-Id` header's
//! value, `""` without it, and under its `model`) and its body recorded, **including calls then
//! rejected** by validation or a rate limit, or answered with a trouble: a rejected call is still
//! a call Kedge made. `troubled` counts the calls answered with a trouble, once more; `limited`
//! the calls refused with 429 for going over their model's `limits`.
//!
//! # What is rejected
//!
//! With the real status codes, body shapes and wording:
//!
//! - **OpenAI**, 400 `{"error": {"message", "type": "invalid_request_error", "param", "code": null}}`:
//!   an assistant `tool_calls` not followed by tool messages answering every id (`param`
//!   `messages.[N].role`, N the first message after the tool messages, or the assistant message
//!   itself when it ends the conversation); a tool message that
//!   does not follow a `tool_calls` ("…preceeding…", their spelling); a `tool_call_id` not in the
//!   previous assistant's `tool_calls`; a tool message without `content` or `tool_call_id`; an
//!   assistant message without `content` and without `tool_calls`; an empty `tool_calls`;
//!   `function.arguments` that is not a string; function names (in `tools` and in `tool_calls`)
//!   outside `^[a-zA-Z0-9_-]{1,64}$`; missing `model` / `messages`, empty `messages`, unknown
//!   roles, `stream_options` without `stream: true`. Settings: an unknown parameter
//!   ("Unrecognized request argument supplied: …"); `temperature` outside 0–2, `top_p` outside
//!   0–1 ("decimal above maximum value"); `stop` not a string or an array of at most 4 strings;
//!   a `seed` that is not an integer; `max_tokens` / `max_completion_tokens` below 1;
//!   `reasoning_effort` other than `minimal`, `low`, `medium`, `high`; `tool_choice` other than
//!   `none` / `auto` / `required` / `{"type": "function", "function": {"name"}}` naming an
//!   offered function; `tool_choice` or `parallel_tool_calls` without `tools`; a
//!   `response_format` whose `type` is not `text` / `json_object` / `json_schema`, or whose
//!   `json_schema` lacks a `name` matching `^[a-zA-Z0-9_-]{1,64}$` or has a `schema` that is not
//!   an object or a `strict` that is not a boolean (the API's rules).
//! - **Anthropic**, 400 `{"type": "error", "error": {"type": "invalid_request_error", "message"},
//!   "request_id": "req_…"}`: a `tool_use` not answered by `tool_result` blocks at the start of
//!   the next user message ("messages.N: \`tool_use\` ids were found without \`tool_result\`
//!   blocks immediately after: toolu_…"); a `tool_result` whose id is not a `tool_use` of the
//!   previous message ("unexpected \`tool_use_id\` found in \`tool_result\` blocks"); ids not
//!   matching `^[a-zA-Z0-9_-]+$`; empty or whitespace-only text blocks; empty messages (except a
//!   final assistant prefill, which must not end in whitespace); a `"system"` role message;
//!   missing `model` / `max_tokens` / `messages`; invalid or duplicate tool names ("tools: Tool
//!   names must be unique."); a custom tool with fields other than `name`, `description` (a
//!   string), `input_schema`, `cache_control`, `type`, or whose `input_schema` is missing, not
//!   an object, without `"type": "object"`, or not a valid JSON Schema (draft 2020-12). Consecutive same-role
//!   messages are **merged** before the tool checks, as the current API does, not rejected.
//!   Settings: an unknown parameter ("seed: Extra inputs are not permitted"); `temperature`
//!   or `top_p` outside 0–1; `stop_sequences` not a list of strings; `tool_choice` other than
//!   `auto` / `any` / `tool` (+ `name`, an offered tool) / `none`, or without `tools`;
//!   `thinking` without `type: enabled` and `budget_tokens` ≥ 1024 and < `max_tokens`; with
//!   thinking, a temperature other than 1, `top_p` below 0.95 or a forcing `tool_choice`;
//!   a `thinking` block whose `signature` is not the one the mock gave it (text changed or made
//!   up), and, with thinking, a last assistant turn whose tool use is being answered that does
//!   not start with its thinking block; `cache_control` other than `{"type": "ephemeral"}`
//!   (optional `ttl` `5m` / `1h`), on a thinking block, or on more than 4 blocks in all.
//!   With thinking enabled, every answer starts with a signed `thinking` block
//!   (`thinking_delta` pieces and a `signature_delta` when streamed).
//! - An unknown `model`: 404 (`model_not_found` / `not_found_error`).
//!
//! # Script format
//!
//! JSON, keyed by the request's `model`. Unknown fields are refused; errors name the JSON path.
//! A model has `steps`, `rules` and `default` (all optional), and may have `limits` and a
//! `context_window`:
//!
//! ```json
//! { "models": { "mock-demo": {
//!     "steps": [
//!       {"tool_calls": [{"name": "list_files", "arguments": {}},
//!                       {"name": "read_file", "arguments": {"path": "notes.txt"}}]},
//!       {"text": "Let me ask.", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Proceed?"}}]},
//!       {"text": "All done."}
//!     ],
//!     "rules": [ {"when_last_user_contains": "tides", "respond": {"text": "High tide at noon."}} ],
//!     "default": {"text": "ok"},
//!     "limits": {"requests_per_minute": 20, "tokens_per_minute": 4000},
//!     "context_window": 2000
//! } } }
//! ```
//!
//! **Limits and context window.** Tokens here are the request's *input* tokens, as `usage`
//! counts them (see [Responses](#responses)); `max_tokens` is not counted. Both are checked after
//! validation and the model lookup, before the script is consulted (so a refused call reaches no
//! entry and counts toward no `fault.times`):
//!
//! | field | effect |
//! | --- | --- |
//! | `"context_window": N` | a request of more than N input tokens gets a 400: OpenAI `{"error": {"message": "This model's maximum context length is N tokens. However, your messages resulted in M tokens. Please reduce the length of the messages.", "type": "invalid_request_error", "param": "messages", "code": "context_length_exceeded"}}`; Anthropic `invalid_request_error` "prompt is too long: M tokens > N maximum" |
//! | `"limits": {"requests_per_minute": N, "tokens_per_minute": M}` | either or both (each at least 1), per model over a **sliding** 60 s window shared by both wire formats: a call is admitted when one more request and its input tokens fit under the limits of the calls admitted in the last 60 s. Refused calls take nothing from the window |
//!
//! A model with `limits` sends the rate-limit headers on every response to a call that reached
//! the limit check, with the true remaining counts after the call, for the limits it has: OpenAI
//! `x-ratelimit-limit-requests`, `x-ratelimit-remaining-requests`, `x-ratelimit-reset-requests`
//! and the same for `-tokens` (reset as a Go duration: `20ms`, `1.5s`, `1m0s`); Anthropic
//! `anthropic-ratelimit-requests-limit` / `-remaining` / `-reset` and the same for `-tokens-` and
//! `-input-tokens-` (reset an RFC 3339 UTC time, whole seconds). Reset is when the window is empty
//! again (60 s after the newest admitted call). A call over a limit gets a 429 with these
//! headers, `retry-after` (seconds, rounded up) and `retry-after-ms` saying when enough of the
//! window has slid out for it, and the real body. For model `M`: OpenAI `{"error": {"message":
//! "Rate limit reached for M in organization org-mock on requests per min (RPM): Limit N, Used N,
//! Requested 1. Please try again in 59.98s. …", "type": "requests", "param": null, "code":
//! "rate_limit_exceeded"}}` (`tokens per min (TPM)` and `"type": "tokens"` for the token limit);
//! Anthropic `rate_limit_error` "This request would exceed the rate limit for your organization of
//! N requests per minute (model: M). …" (or `input tokens per minute`). A call with more input
//! tokens than `tokens_per_minute` can never fit: a 429 ("Request too large for M …" at OpenAI)
//! without `retry-after`. Replacing the script or resetting empties the windows.
//!
//! **Which entry answers.** `rules` first, in order: a rule matches when all its conditions hold
//! for the last message — `when_last_user_contains` (the last message is a user message whose
//! text contains the string) and `when_last_tool_result_contains` (a tool result of the last
//! message contains it; for OpenAI, any of the trailing run of `tool` messages). Otherwise
//! `steps[n]`, where n is the number of assistant turns already in the request (after merging,
//! not counting a final Anthropic prefill): the same conversation gets the same answer however
//! often it is retried. Past the last step: `default`, or a plain `"ok"` text.
//!
//! **A response** has `text` (non-blank) and/or `tool_calls` (`name` matching
//! `^[a-zA-Z0-9_-]{1,64}$`, `arguments` a JSON object, `{}` when left out). Tool call ids are
//! generated, `call_<n>` / `toolu_<n>`, unique within the process. Optional behaviour:
//!
//! | field | effect |
//! | --- | --- |
//! | `"delay_ms": N` | wait N ms before answering (also before a fault) |
//! | `"chunk_delay_ms": N` | streaming: wait N ms before each SSE event, each event its own write (without it, the whole stream goes out in one write) |
//! | `"fault": {"status": S, "retry_after_ms": N, "times": K}` | the first K calls (default 1) reaching this entry get status S (400, 401, 403, 404, 413, 429, 500, 503 or 529) with the provider's error body; with `retry_after_ms`, also `retry-after` (seconds, rounded up) and `retry-after-ms` headers |
//! | `"hang": true` | never answer (the client must time out); released only when the server shuts down |
//! | `"drop_after_chunks": N` | streaming: send N SSE events, then close the connection without the end of the stream (never the final chunk / `[DONE]` / `message_stop`); non-streaming: send half the JSON body, then close |
//! | `"stream_error": true` | streaming: after half the events, an error event (`data: {"error": …}` / `event: error` with `overloaded_error`), then the stream ends; non-streaming calls answer normally |
//! | `"fail_times": K` | `hang`, `drop_after_chunks` and `stream_error` apply to the first K calls reaching this entry only (default: every call) |
//!
//! Calls are counted per (model, entry) — entries are `steps[i]`, `rules[i]` and `default` —
//! for `fault.times` and `fail_times`; the fault is served first, so with `"fault": {"times": 1}`
//! and `"hang": true` the first call gets the fault and the next ones hang. Replacing the script
//! or resetting zeroes these counts.
//!
//! # Responses
//!
//! Real shapes: `chat.completion` / `chat.completion.chunk` (text in `delta.content` pieces; each
//! `delta.tool_calls[]` fragment carries `index`, the first one also `id`, `type` and
//! `function.name`, the next ones only `function.arguments` pieces, at least two; a final chunk
//! with an empty delta and `finish_reason`; with `stream_options.include_usage` a `choices: []`
//! chunk with `usage`; then `data: [DONE]`), and Anthropic `message` / the event sequence
//! `message_start`, `ping`, per block `content_block_start` / `content_block_delta`
//! (`text_delta`, `input_json_delta` in at least two pieces) / `content_block_stop`,
//! `message_delta`, `message_stop`. Usage is deterministic: input tokens = characters of the
//! compact JSON of `messages` (plus `system`) / 4 + 1; output tokens = characters of the text,
//! tool names and argument JSON / 4 + 1.
//!
//! # A provider's bad day
//!
//! `PUT /_mock/trouble` (or [`MockLlm::set_trouble`]) puts an outage in front of every model call
//! of both wire formats until `DELETE /_mock/trouble` (`set_trouble(None)`) or its `for_ms`
//! ends it. The body (unknown fields refused, errors name the field):
//!
//! | field | meaning |
//! | --- | --- |
//! | `"kind"` | required: `unavailable`, `overloaded`, `rate_limited`, `reset` or `stream_cut`, below |
//! | `"status": S` | `unavailable` only: 500, 502, 503 or 504 instead of the default, for both formats |
//! | `"models": ["m", …]` | only calls whose `model` is one of these (at least one; default: every call) |
//! | `"for_ms": N` | ends by itself N ms (at least 1) after the PUT |
//! | `"retry_after_ms": N` | `unavailable`, `overloaded`, `rate_limited` only (at most a day): also `retry-after` (seconds, rounded up) and `retry-after-ms` headers; without it, no `retry-after` header at all |
//!
//! | kind | OpenAI call | Anthropic call |
//! | --- | --- | --- |
//! | `unavailable` | 503 `{"error": {"message": "The server is overloaded or not ready yet.", "type": "server_error", "param": null, "code": null}}` (500 "The server had an error while processing your request. Sorry about that!", 502 "Bad gateway.", 504 "Gateway timeout." with `status`) | 500 `{"type": "error", "error": {"type": "api_error", "message": "Internal server error"}, "request_id": "req_…"}` (502 "Bad gateway", 503 "Service unavailable", 504 "Gateway timeout" with `status`) |
//! | `overloaded` | 503 as above (OpenAI has no 529) | 529 `{"type": "error", "error": {"type": "overloaded_error", "message": "Overloaded"}, "request_id": "req_…"}` |
//! | `rate_limited` | 429 `{"error": {"message": "Rate limit reached for M in organization org-mock on requests per min (RPM): …", "type": "requests", "param": null, "code": "rate_limit_exceeded"}}` | 429 `{"type": "error", "error": {"type": "rate_limit_error", "message": "Number of request tokens has exceeded your per-minute rate limit …"}, "request_id": "req_…"}` |
//! | `reset` | the connection is reset (TCP RST) before any byte of a response: the client sees a connection error, no status | same |
//! | `stream_cut` | streaming: 200, the headers and at most the opening chunk (role, empty content), then the connection closes: no content, no final chunk, no `[DONE]`; non-streaming: 200 and half the JSON body, then the close | streaming: 200, the headers and at most `message_start`, then the close; non-streaming: as OpenAI |
//!
//! A `rate_limited` 429 carries the rate-limit headers above with remaining 0, the limits the
//! model's `limits` give (else 50 requests and 30000 tokens), and as reset its `retry_after_ms`,
//! else the time left of its `for_ms`, at most a minute.
//!
//! **Where it strikes.** Authentication comes first (a call without a key gets its 401, is not
//! counted and is not troubled); the call is then counted and recorded as usual. Every kind but
//! `stream_cut` answers right away, whatever the body (an invalid request or an unknown model
//! in trouble gets the outage, not its 400 / 404). `stream_cut` is the model failing while it
//! answers, so it strikes only calls that pass validation, the model lookup, the context window
//! and the limits (an admitted call counts in its model's window). A troubled call reaches no
//! script entry and waits no `delay_ms`. `troubled` in `GET /_mock/calls`
//! ([`MockLlm::troubled_calls`]) counts the calls answered with a trouble; `POST /_mock/reset`
//! zeroes it but does not end the trouble.
//!
//! `reset` needs the connection: [`serve`] and [`MockHandle`] accept through a listener whose
//! connections a handler can reset. On a [`MockLlm::router`] mounted in another server, the
//! response body fails before its first byte instead, and hyper closes the connection without
//! sending anything (a close rather than a RST, still a connection error to the client).
//!
//! In Rust: [`Trouble::new`]`(`[`TroubleKind`]`)` with [`Trouble::with_status`],
//! [`Trouble::for_models`], [`Trouble::lasting`], [`Trouble::with_retry_after`] (each
//! validating, as the endpoint does), or [`Trouble::from_json`]; then [`MockLlm::set_trouble`],
//! [`MockLlm::trouble`], [`MockLlm::troubled_calls`] (the same on [`MockHandle`]).

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

mod anthropic;
mod conn;
mod error;
mod limits;
mod openai;
mod reply;
mod script;
mod server;
mod trouble;

pub use script::{ScriptError, Scripts};
pub use trouble::{Trouble, TroubleError, TroubleKind, UNAVAILABLE_STATUSES};

use limits::{Refusal, Window};
use script::{Cue, Entry, Limits, Response};

/// The header carrying Kedge's request id; calls are counted per value.
pub const REQUEST_ID_HEADER: &str = "x-kedge-request-id";

/// Call counters, as `GET /_mock/calls` returns them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct CallCounts {
    /// Every counted call.
    pub total: u64,
    /// Per `X-Kedge-Request-Id` (`""` for calls without the header).
    pub by_request_id: BTreeMap<String, u64>,
    /// Per request `model` (`""` when the body has none).
    pub by_model: BTreeMap<String, u64>,
    /// The calls answered with a trouble (also counted above).
    pub troubled: u64,
    /// The calls refused with 429 for going over the script's `limits` (also counted above).
    pub limited: u64,
}

/// A request body as received.
#[derive(Debug)]
enum RecordedBody {
    /// The bytes (shared with the request, not copied).
    Received(axum::body::Bytes),
    /// Not read (too large, cut off): recorded as JSON `null`.
    Unread,
}

impl RecordedBody {
    /// The body as JSON; one that is not JSON as a JSON string of its text.
    fn value(&self) -> Value {
        match self {
            RecordedBody::Received(bytes) => serde_json::from_slice(bytes)
                .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(bytes).into_owned())),
            RecordedBody::Unread => Value::Null,
        }
    }
}

#[derive(Debug, Default)]
struct State {
    scripts: Scripts,
    counts: CallCounts,
    /// (model, body) in arrival order, parsed only when asked for: a body is as long as the
    /// conversation, and the mock's work per call should be a model's, not a copy of it.
    requests: Vec<(String, RecordedBody)>,
    /// Calls that reached each (model, entry), for `fault.times` and `fail_times`.
    hits: HashMap<(String, Entry), u64>,
    /// The trouble in effect, if any.
    trouble: Option<ActiveTrouble>,
    /// The calls each model with `limits` admitted in the last minute.
    windows: HashMap<String, Window>,
}

impl State {
    /// The trouble in effect at `now`; one whose time is up is forgotten.
    fn trouble_at(&mut self, now: Instant) -> Option<&ActiveTrouble> {
        if self
            .trouble
            .as_ref()
            .is_some_and(|t| t.until.is_some_and(|until| now >= until))
        {
            self.trouble = None;
        }
        self.trouble.as_ref()
    }
}

/// A trouble and when it ends by itself (`None`: when ended, or never representable).
#[derive(Debug, Clone)]
struct ActiveTrouble {
    trouble: Trouble,
    until: Option<Instant>,
}

/// What a model call in trouble gets: the trouble, and (for `rate_limited`) the headers'
/// reset and the limits to report.
#[derive(Debug, Clone)]
pub(crate) struct TroubleNow {
    pub(crate) trouble: Trouble,
    /// When the trouble's 429 says the limit resets: its `retry_after_ms`, else the time left
    /// of its `for_ms`, at most a minute (a minute when it has neither).
    pub(crate) reset: Duration,
    pub(crate) limits: Option<Limits>,
}

/// How the scripted limits of a model take a call.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Admission {
    /// The model is not in the script.
    UnknownModel,
    /// More input tokens than its `context_window`.
    TooLong { window: u64 },
    /// Under its limits (or it has none): the quotas to report, if it has limits.
    Admitted(Option<limits::Usage>),
    /// Over a limit.
    Limited(Refusal),
}

/// The mock's shared state: script, counters, recorded requests. Cheap to clone (shared).
#[derive(Debug, Clone, Default)]
pub struct MockLlm {
    state: Arc<Mutex<State>>,
}

impl MockLlm {
    /// A mock answering from `scripts`.
    pub fn new(scripts: Scripts) -> MockLlm {
        MockLlm {
            state: Arc::new(Mutex::new(State {
                scripts,
                ..State::default()
            })),
        }
    }

    /// The routes, for mounting in another server. Calls that `hang` there wait until the
    /// client goes away ([`serve`] releases them at shutdown), and a `reset` trouble closes the
    /// connection instead of resetting it (see [A provider's bad day](crate#a-providers-bad-day)).
    pub fn router(&self) -> axum::Router {
        server::router(self.clone(), None)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// All counters.
    pub fn calls(&self) -> CallCounts {
        self.lock().counts.clone()
    }

    /// Calls that carried `X-Kedge-Request-Id: request_id` (`""`: calls without the header).
    pub fn calls_for(&self, request_id: &str) -> u64 {
        self.lock()
            .counts
            .by_request_id
            .get(request_id)
            .copied()
            .unwrap_or(0)
    }

    /// Every counted call.
    pub fn total_calls(&self) -> u64 {
        self.lock().counts.total
    }

    /// The bodies received for `model`, in order (bodies that were not JSON are recorded as a
    /// JSON string under the model `""`).
    pub fn requests(&self, model: &str) -> Vec<Value> {
        self.lock()
            .requests
            .iter()
            .filter(|(m, _)| m == model)
            .map(|(_, body)| body.value())
            .collect()
    }

    /// Every (model, body) received, in order.
    pub fn all_requests(&self) -> Vec<(String, Value)> {
        self.lock()
            .requests
            .iter()
            .map(|(model, body)| (model.clone(), body.value()))
            .collect()
    }

    /// Replaces the script and zeroes the per-entry fault counts and the rate-limit windows
    /// (call counters stay).
    pub fn set_scripts(&self, scripts: Scripts) {
        let mut state = self.lock();
        state.scripts = scripts;
        state.hits.clear();
        state.windows.clear();
    }

    /// Zeroes the counters (`troubled` included), forgets recorded bodies, fault counts and
    /// rate-limit windows; the script and the trouble stay.
    pub fn reset(&self) {
        let mut state = self.lock();
        state.counts = CallCounts::default();
        state.requests.clear();
        state.hits.clear();
        state.windows.clear();
    }

    /// Puts `trouble` in front of every model call (the ones for its `models`), replacing any
    /// other; `None` ends it. Its `for_ms` counts from now.
    pub fn set_trouble(&self, trouble: Option<Trouble>) {
        let now = Instant::now();
        self.lock().trouble = trouble.map(|trouble| ActiveTrouble {
            until: trouble.for_duration().and_then(|d| now.checked_add(d)),
            trouble,
        });
    }

    /// The trouble in effect (`None` once ended or its time is up).
    pub fn trouble(&self) -> Option<Trouble> {
        self.lock()
            .trouble_at(Instant::now())
            .map(|t| t.trouble.clone())
    }

    /// The calls answered with a trouble since the last reset.
    pub fn troubled_calls(&self) -> u64 {
        self.lock().counts.troubled
    }

    /// The trouble a call for `model` is in now, if any.
    pub(crate) fn trouble_for(&self, model: &str) -> Option<TroubleNow> {
        let now = Instant::now();
        let mut state = self.lock();
        let active = state.trouble_at(now)?.clone();
        if !active.trouble.applies_to(model) {
            return None;
        }
        let left = active
            .until
            .map_or(limits::WINDOW, |until| until.saturating_duration_since(now))
            .min(limits::WINDOW);
        Some(TroubleNow {
            reset: active.trouble.retry_after().unwrap_or(left),
            limits: state.scripts.model(model).and_then(|m| m.limits),
            trouble: active.trouble,
        })
    }

    /// Counts a call answered with a trouble.
    pub(crate) fn note_troubled(&self) {
        self.lock().counts.troubled += 1;
    }

    /// Counts a call refused for going over its model's `limits`.
    pub(crate) fn note_limited(&self) {
        self.lock().counts.limited += 1;
    }

    /// Checks a call of `input_tokens` for `model` against its `context_window` and `limits`,
    /// and counts it in the model's window when admitted.
    pub(crate) fn admit(&self, model: &str, input_tokens: u64) -> Admission {
        let now = Instant::now();
        let mut state = self.lock();
        let Some(script) = state.scripts.model(model) else {
            return Admission::UnknownModel;
        };
        if let Some(window) = script.context_window
            && input_tokens > window
        {
            return Admission::TooLong { window };
        }
        let Some(limits) = script.limits else {
            return Admission::Admitted(None);
        };
        match state
            .windows
            .entry(model.to_owned())
            .or_default()
            .admit(&limits, input_tokens, now)
        {
            Ok(usage) => Admission::Admitted(Some(usage)),
            Err(refusal) => Admission::Limited(refusal),
        }
    }

    fn record(&self, request_id: &str, model: &str, body: RecordedBody) {
        let mut state = self.lock();
        state.counts.total += 1;
        *state
            .counts
            .by_request_id
            .entry(request_id.to_owned())
            .or_default() += 1;
        *state.counts.by_model.entry(model.to_owned()).or_default() += 1;
        state.requests.push((model.to_owned(), body));
    }

    /// The entry answering `cue` for `model` and how many calls reached it (this one included);
    /// `None` for an unknown model.
    fn choose(&self, model: &str, cue: &Cue) -> Option<(Entry, Response, u64)> {
        let mut state = self.lock();
        let (entry, response) = {
            let script = state.scripts.model(model)?;
            let (entry, response) = script.choose(cue);
            (entry, response.cloned().unwrap_or_else(Response::plain_ok))
        };
        let hit = state.hits.entry((model.to_owned(), entry)).or_default();
        *hit += 1;
        Some((entry, response, *hit))
    }
}

/// Serves `mock` on `listener` until `shutdown` resolves, then stops accepting, releases calls
/// that `hang` or wait on `delay_ms` (they get a 503), and returns once open calls are done.
pub async fn serve(
    listener: TcpListener,
    mock: MockLlm,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    let (release_tx, release_rx) = watch::channel(false);
    let app = server::router(mock, Some(release_rx))
        .into_make_service_with_connect_info::<conn::ConnReset>();
    let signal = async move {
        shutdown.await;
        let _ = release_tx.send(true);
    };
    axum::serve(conn::ResettableListener(listener), app)
        .with_graceful_shutdown(signal)
        .await
}

/// An in-process mock on `127.0.0.1:<free port>` for tests; it stops when dropped.
#[derive(Debug)]
pub struct MockHandle {
    addr: SocketAddr,
    mock: MockLlm,
    shutdown: Option<oneshot::Sender<()>>,
}

impl MockHandle {
    /// Binds a free loopback port and serves `scripts` on the current Tokio runtime.
    ///
    /// # Panics
    /// If no loopback port can be bound (a test-environment failure).
    pub async fn start(scripts: Scripts) -> MockHandle {
        let listener = TcpListener::bind("127.0.0.1:0")
            .await
            .expect("mock-llm: bind 127.0.0.1:0");
        let addr = listener
            .local_addr()
            .expect("mock-llm: local address of a bound listener");
        let mock = MockLlm::new(scripts);
        let (tx, rx) = oneshot::channel::<()>();
        let served = mock.clone();
        tokio::spawn(async move {
            let shutdown = async move {
                let _ = rx.await;
            };
            if let Err(e) = serve(listener, served, shutdown).await {
                tracing::warn!(error = %e, "mock-llm server stopped with an error");
            }
        });
        MockHandle {
            addr,
            mock,
            shutdown: Some(tx),
        }
    }

    /// `http://127.0.0.1:PORT`; the APIs are at `/v1/chat/completions` and `/v1/messages`.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// The bound address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// The shared state (counters, script).
    pub fn mock(&self) -> &MockLlm {
        &self.mock
    }

    /// See [`MockLlm::calls_for`].
    pub fn calls_for(&self, request_id: &str) -> u64 {
        self.mock.calls_for(request_id)
    }

    /// See [`MockLlm::total_calls`].
    pub fn total_calls(&self) -> u64 {
        self.mock.total_calls()
    }

    /// See [`MockLlm::calls`].
    pub fn calls(&self) -> CallCounts {
        self.mock.calls()
    }

    /// See [`MockLlm::requests`].
    pub fn requests(&self, model: &str) -> Vec<Value> {
        self.mock.requests(model)
    }

    /// See [`MockLlm::set_scripts`].
    pub fn set_scripts(&self, scripts: Scripts) {
        self.mock.set_scripts(scripts);
    }

    /// See [`MockLlm::reset`].
    pub fn reset(&self) {
        self.mock.reset();
    }

    /// See [`MockLlm::set_trouble`].
    pub fn set_trouble(&self, trouble: Option<Trouble>) {
        self.mock.set_trouble(trouble);
    }

    /// See [`MockLlm::trouble`].
    pub fn trouble(&self) -> Option<Trouble> {
        self.mock.trouble()
    }

    /// See [`MockLlm::troubled_calls`].
    pub fn troubled_calls(&self) -> u64 {
        self.mock.troubled_calls()
    }
}

impl Drop for MockHandle {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }
}

/// How the real APIs name a JSON value's type in their messages.
pub(crate) fn json_kind(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(n) if n.is_i64() || n.is_u64() => "an integer",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}
