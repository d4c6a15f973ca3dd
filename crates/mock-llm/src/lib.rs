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
//! | `GET /_mock/calls` | `{"total": N, "by_request_id": {"req_…": n}, "by_model": {"m": n}}` |
//! | `GET /_mock/requests?model=M` | the JSON bodies received for model `M`, in order (all models without `model`) |
//! | `PUT /_mock/scripts` | replace the script (JSON body as below); 204, or 400 `{"error": {"message", "path"}}` |
//! | `POST /_mock/reset` | zero the counters, forget the recorded bodies and fault counts (the script stays); 204 |
//!
//! Every call that passes authentication is counted (under the `X-Kedge-Request-Id` header's
//! value, `""` without it, and under its `model`) and its body recorded, **including calls then
//! rejected** by validation: a rejected call is still a call Kedge made.
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
//!   an object or a `strict` that is not a boolean (the API's rules; PEERS.md does not list them).
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
//!     "default": {"text": "ok"}
//! } } }
//! ```
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

use std::collections::{BTreeMap, HashMap};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use serde::Serialize;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::{oneshot, watch};

mod anthropic;
mod error;
mod openai;
mod reply;
mod script;
mod server;

pub use script::{ScriptError, Scripts};

use script::{Cue, Entry, Response};

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
    /// client goes away; [`serve`] releases them at shutdown.
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

    /// Replaces the script and zeroes the per-entry fault counts (call counters stay).
    pub fn set_scripts(&self, scripts: Scripts) {
        let mut state = self.lock();
        state.scripts = scripts;
        state.hits.clear();
    }

    /// Zeroes the counters, forgets recorded bodies and fault counts; the script stays.
    pub fn reset(&self) {
        let mut state = self.lock();
        state.counts = CallCounts::default();
        state.requests.clear();
        state.hits.clear();
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
    let app = server::router(mock, Some(release_rx));
    let signal = async move {
        shutdown.await;
        let _ = release_tx.send(true);
    };
    axum::serve(listener, app)
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
