//! Model adapters: one streamed call to OpenAI Chat Completions or Anthropic Messages,
//! provider-neutral in ([`ModelCall`]: system prompt, tools, [`ChatMessage`]s) and out
//! ([`ModelResponse`], or a classified [`ModelError`]).
//!
//! Invariants:
//! - **Valid by construction.** Requests satisfy what the strict APIs check (the strict mock,
//!   `kedge-mock-llm`, lists them under "What is rejected"): every tool call answered right after
//!   its assistant turn, tool results first in the next user message (Anthropic), no empty
//!   messages or text blocks. See [`context`] for how a context that breaks these is repaired
//!   rather than sent.
//! - **No truncated success.** Every call is streamed, and a stream that breaks, stalls or ends
//!   before its terminal marker (`[DONE]`, `message_stop`) is a retryable [`ModelError`], never a
//!   partial response.
//! - **One call, no retries.** [`ModelClient::complete`] makes exactly one HTTP request. The
//!   step service journals each attempt and retries with a new attempt number (and request id),
//!   honouring [`ModelError::retry_after`]. Neither API has an idempotency key on these
//!   endpoints, so Kedge's journal is the only protection against paying twice.
//! - **The key stays secret.** The API key is sent in a header marked sensitive, never logged,
//!   not shown by `Debug`, and scrubbed from error messages.
//!
//! Every request carries the header `X-Kedge-Request-Id: <request id>` (the mock LLM counts
//! calls by it; real providers ignore it).

pub mod anthropic;
pub mod context;
mod error;
pub mod openai;
mod sse;

use std::fmt;
use std::time::{Duration, SystemTime};

use futures::StreamExt;
use kedge_core::agent::{AgentDefinition, ToolSpec};
use kedge_core::decide::ModelResponse;
use kedge_core::event::{ModelSpec, Provider};
use kedge_core::fold::ChatMessage;
use kedge_core::ids::ModelRequestId;
use kedge_core::settings::ToolChoice;
use reqwest::header::{ACCEPT, CONTENT_TYPE, HeaderMap, HeaderName, HeaderValue};
use tokio::time::Instant;
use tracing::Instrument;

pub use context::{EMPTY_PLACEHOLDER, MISSING_RESULT, parse_arguments};
pub use error::{ModelError, ModelErrorKind, RateLimits, retry_after, status_class};
pub use kedge_core::event::ErrorClass;

/// The header that carries the model request id.
pub const REQUEST_ID_HEADER: &str = "x-kedge-request-id";

/// One model call, provider-neutral.
#[derive(Clone, Copy)]
pub struct ModelCall<'a> {
    /// Provider, model name and base URL (`None` → [`openai::DEFAULT_BASE_URL`] /
    /// [`anthropic::DEFAULT_BASE_URL`]); see [`endpoint`] for the forms accepted.
    pub spec: &'a ModelSpec,
    /// Read from the environment by the caller (see [`api_key_env`]). `None` sends no
    /// credentials (for local servers that need none).
    pub api_key: Option<&'a str>,
    pub system: &'a str,
    pub tools: &'a [ToolSpec],
    pub context: &'a [ChatMessage],
    /// Sent as `X-Kedge-Request-Id`.
    pub request_id: &'a ModelRequestId,
    pub max_output_tokens: u32,
    /// The agent's `output_schema`: the final answer is requested as JSON matching it in the
    /// provider's structured-output form (OpenAI `response_format`; Anthropic an `output` tool
    /// whose input is the answer, see [`anthropic::answer_from_output_tool`]).
    pub output_schema: Option<&'a serde_json::Value>,
    /// Limit on the whole call, from sending the request to the last byte of the stream.
    /// Waiting for the first byte and the gaps between chunks are also bounded by
    /// [`ModelClient::with_idle_timeout`] when that is shorter.
    pub timeout: Duration,
}

impl fmt::Debug for ModelCall<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ModelCall")
            .field("spec", self.spec)
            .field("api_key", &self.api_key.map(|_| "<redacted>"))
            .field("system_len", &self.system.len())
            .field("tools", &self.tools.len())
            .field("context", &self.context.len())
            .field("request_id", self.request_id)
            .field("max_output_tokens", &self.max_output_tokens)
            .field("output_schema", &self.output_schema.is_some())
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// A piece of the response as it streams (for `agent.delta.<run_id>`). Ephemeral: the
/// [`ModelResponse`] that [`ModelClient::complete`] returns is authoritative.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Delta {
    /// The next piece of the assistant's text.
    Text(String),
    /// The model started a tool call (its arguments are not streamed). `call_id` may be empty
    /// on an OpenAI-compatible server that sends the name before the id.
    ToolCall { call_id: String, name: String },
    /// The rate limits the headers of a successful response name (before any content): what
    /// the fleet paces the endpoint's calls by, with any it is configured with.
    Limits(RateLimits),
}

/// The environment variable that holds the agent's API key: its `api_key_env`, else
/// `OPENAI_API_KEY` / `ANTHROPIC_API_KEY` by provider.
pub fn api_key_env(def: &AgentDefinition) -> String {
    def.api_key_env
        .clone()
        .unwrap_or_else(|| default_api_key_env(def.model.provider).to_owned())
}

/// The environment variable that holds a fallback model's API key: its `api_key_env`, else
/// the provider's conventional one.
pub fn fallback_key_env(f: &kedge_core::agent::FallbackModel) -> String {
    f.api_key_env
        .clone()
        .unwrap_or_else(|| default_api_key_env(f.model.provider).to_owned())
}

/// The agent's API key from the environment variable [`api_key_env`] names; `None` when it is
/// unset or empty.
pub fn api_key_from_env(def: &AgentDefinition) -> Option<String> {
    std::env::var(api_key_env(def))
        .ok()
        .filter(|k| !k.trim().is_empty())
}

/// The conventional API key variable of a provider.
pub fn default_api_key_env(provider: Provider) -> &'static str {
    match provider {
        Provider::Openai => "OPENAI_API_KEY",
        Provider::Anthropic => "ANTHROPIC_API_KEY",
    }
}

/// The URL a call is posted to. Base URLs are taken the way each provider's SDK writes them:
/// OpenAI's with the version (`https://api.openai.com/v1`, `http://127.0.0.1:8080/v1`; a bare
/// `scheme://host[:port]` gets `/v1`), Anthropic's without it (`https://api.anthropic.com`; one
/// that already ends in `/v1` is taken as is).
pub fn endpoint(spec: &ModelSpec) -> String {
    let base = spec
        .base_url
        .as_deref()
        .unwrap_or(match spec.provider {
            Provider::Openai => openai::DEFAULT_BASE_URL,
            Provider::Anthropic => anthropic::DEFAULT_BASE_URL,
        })
        .trim_end_matches('/');
    let has_version = base.ends_with("/v1");
    match spec.provider {
        Provider::Openai if has_version || has_path(base) => format!("{base}/chat/completions"),
        Provider::Openai => format!("{base}/v1/chat/completions"),
        Provider::Anthropic if has_version => format!("{base}/messages"),
        Provider::Anthropic => format!("{base}/v1/messages"),
    }
}

/// Whether a URL (without a trailing `/`) has a path after its authority.
fn has_path(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, rest)| rest);
    rest.contains('/')
}

/// The tool choice a call sends: the agent's `model.settings.tool_choice`, except that one that
/// forces a tool call (`required`, a named tool) holds for the first step after a user message
/// only; a step that continues after tool results gets `auto`, or the run could never end.
pub fn effective_tool_choice(call: &ModelCall<'_>) -> Option<ToolChoice> {
    let choice = call.spec.settings.tool_choice.clone()?;
    let after_user = matches!(call.context.last(), Some(ChatMessage::User { .. }));
    if choice.forces_a_call() && !after_user {
        Some(ToolChoice::Auto)
    } else {
        Some(choice)
    }
}

/// The request body of a call, as it would be sent.
pub fn request_body(call: &ModelCall<'_>) -> serde_json::Value {
    match call.spec.provider {
        Provider::Openai => openai::request_body(call),
        Provider::Anthropic => anthropic::request_body(call),
    }
}

/// The request body of a call as the bytes sent ([`request_body`] is the same as a value).
fn request_json(call: &ModelCall<'_>) -> Result<Vec<u8>, ModelError> {
    match call.spec.provider {
        Provider::Openai => openai::request_json(call),
        Provider::Anthropic => anthropic::request_json(call),
    }
    .map_err(|e| {
        ModelError::fatal(
            ModelErrorKind::Request,
            format!("the request body does not serialize: {e}"),
        )
    })
}

/// A model API client. Cheap to clone (one shared connection pool).
#[derive(Debug, Clone)]
pub struct ModelClient {
    http: reqwest::Client,
    idle_timeout: Option<Duration>,
}

impl Default for ModelClient {
    fn default() -> Self {
        Self::new()
    }
}

enum Decoder {
    OpenAi(openai::Decoder),
    Anthropic(anthropic::Decoder),
}

impl Decoder {
    fn new(call: &ModelCall<'_>) -> Self {
        match call.spec.provider {
            Provider::Openai => Decoder::OpenAi(openai::Decoder::default()),
            Provider::Anthropic if call.output_schema.is_some() => {
                Decoder::Anthropic(anthropic::Decoder::with_output_tool())
            }
            Provider::Anthropic => Decoder::Anthropic(anthropic::Decoder::default()),
        }
    }
    fn on_event(
        &mut self,
        event: &sse::SseEvent,
        on_delta: &mut dyn FnMut(Delta),
    ) -> Result<(), ModelError> {
        match self {
            Decoder::OpenAi(d) => d.on_event(event, on_delta),
            Decoder::Anthropic(d) => d.on_event(event, on_delta),
        }
    }
    fn is_done(&self) -> bool {
        match self {
            Decoder::OpenAi(d) => d.is_done(),
            Decoder::Anthropic(d) => d.is_done(),
        }
    }
    fn finish(self) -> Result<ModelResponse, ModelError> {
        match self {
            Decoder::OpenAi(d) => d.finish(),
            Decoder::Anthropic(d) => d.finish(),
        }
    }
}

impl ModelClient {
    pub fn new() -> ModelClient {
        // No redirects: a model endpoint that answers 3xx must not carry the API key elsewhere.
        let http = reqwest::Client::builder()
            .user_agent(concat!("kedge/", env!("CARGO_PKG_VERSION")))
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        Self::with_http(http)
    }

    /// A client over an existing `reqwest` client (proxies, custom roots, …). Timeouts
    /// configured on it apply on top of the call's own.
    pub fn with_http(http: reqwest::Client) -> ModelClient {
        ModelClient {
            http,
            idle_timeout: None,
        }
    }

    /// Also fail a call that waits longer than `idle` for its response headers or between two
    /// stream chunks (a stalled stream is found before [`ModelCall::timeout`] runs out).
    pub fn with_idle_timeout(mut self, idle: Duration) -> ModelClient {
        self.idle_timeout = Some(idle);
        self
    }

    /// Makes the call, streaming: `on_delta` gets the text as it arrives. Returns the whole
    /// response once the stream has ended properly. Makes one attempt; never retries.
    ///
    /// Dropping the future aborts the request.
    pub async fn complete(
        &self,
        call: &ModelCall<'_>,
        on_delta: &mut (dyn FnMut(Delta) + Send),
    ) -> Result<ModelResponse, ModelError> {
        let span = tracing::info_span!(
            "model.call",
            request_id = %call.request_id,
            provider = ?call.spec.provider,
            model = %call.spec.name,
        );
        async {
            let started = Instant::now();
            // Whether the answer had begun to arrive: a failure before it is the provider's
            // trouble, one after it spends an attempt (see [`ModelError::trouble`]).
            let mut content_seen = false;
            let mut seen = |d: Delta| {
                content_seen |= match &d {
                    Delta::Text(t) => !t.is_empty(),
                    Delta::ToolCall { .. } => true,
                    Delta::Limits(_) => false,
                };
                on_delta(d);
            };
            let result = self.run(call, &mut seen).await;
            let result = result.map_err(|e| e.scrub(call.api_key).with_trouble(content_seen));
            let elapsed_ms = started.elapsed().as_millis() as u64;
            match &result {
                Ok(r) => tracing::debug!(
                    elapsed_ms,
                    input_tokens = r.usage.input_tokens,
                    output_tokens = r.usage.output_tokens,
                    tool_calls = r.message.tool_calls.len(),
                    finish = ?r.finish,
                    "model call completed"
                ),
                Err(e) => tracing::debug!(
                    elapsed_ms,
                    class = ?e.class,
                    kind = %e.kind,
                    status = e.status,
                    error = %e.message,
                    "model call failed"
                ),
            }
            result
        }
        .instrument(span)
        .await
    }

    async fn run(
        &self,
        call: &ModelCall<'_>,
        on_delta: &mut (dyn FnMut(Delta) + Send),
    ) -> Result<ModelResponse, ModelError> {
        let deadline = Instant::now() + call.timeout;
        let body = request_json(call)?;
        let headers = headers(call)?;
        let request = self
            .http
            .post(endpoint(call.spec))
            .headers(headers)
            .header(CONTENT_TYPE, HeaderValue::from_static("application/json"))
            .body(body);

        let first_wait = self.wait_until(deadline);
        let response = match tokio::time::timeout_at(first_wait, request.send()).await {
            Err(_) => {
                return Err(timeout_error(deadline, call.timeout, "no response headers"));
            }
            Ok(Err(e)) => return Err(send_error(&e)),
            Ok(Ok(r)) => r,
        };

        let status = response.status();
        // Learned from answers only: a refusal's headers may describe a quota or a trouble
        // rather than the limit the calls keep to (and the refusal itself is waited out).
        if status.is_success()
            && let Some(limits) = error::RateLimits::from_headers(response.headers())
        {
            on_delta(Delta::Limits(limits));
        }
        if !status.is_success() {
            let headers = response.headers().clone();
            let body = match tokio::time::timeout_at(deadline, response.bytes()).await {
                Ok(Ok(bytes)) => bytes.to_vec(),
                _ => Vec::new(),
            };
            return Err(ModelError::from_response(
                status.as_u16(),
                &headers,
                &body,
                SystemTime::now(),
            ));
        }
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .and_then(|v| v.to_str().ok())
            .unwrap_or("")
            .to_ascii_lowercase();
        if content_type.starts_with("application/json") {
            // Not a stream: the server ignored `"stream": true`, or a proxy answered 200 with an
            // error object. Either way the same request would get the same answer.
            let body = match tokio::time::timeout_at(deadline, response.bytes()).await {
                Ok(Ok(bytes)) => bytes.to_vec(),
                _ => Vec::new(),
            };
            return Err(
                match serde_json::from_slice::<error::ErrorEnvelope>(&body) {
                    Ok(error::ErrorEnvelope { error: Some(e) }) => ModelError::from_error_body(
                        &e,
                        &format!("HTTP {status} with an error body"),
                    ),
                    _ => ModelError::fatal(
                        ModelErrorKind::Protocol,
                        format!("HTTP {status} with a JSON body, expected an event stream"),
                    ),
                },
            );
        }
        // Any other content type (or none) is read as an event stream: a body that is not one
        // ends without its terminal marker and is reported as such.

        let mut stream = response.bytes_stream();
        let mut parser = sse::SseParser::new();
        let mut decoder = Decoder::new(call);
        while !decoder.is_done() {
            let chunk =
                match tokio::time::timeout_at(self.wait_until(deadline), stream.next()).await {
                    Err(_) => return Err(timeout_error(deadline, call.timeout, "stream stalled")),
                    Ok(None) => break,
                    Ok(Some(Err(e))) => {
                        return Err(ModelError::retryable(
                            ModelErrorKind::StreamEnded,
                            format!("stream broke: {}", error_chain(&e)),
                        ));
                    }
                    Ok(Some(Ok(chunk))) => chunk,
                };
            let events = parser.push(&chunk).map_err(|_| {
                ModelError::retryable(
                    ModelErrorKind::Protocol,
                    format!("stream line longer than {} bytes", sse::MAX_LINE),
                )
            })?;
            for event in &events {
                decoder.on_event(event, &mut *on_delta)?;
            }
        }
        if !decoder.is_done()
            && let Some(event) = parser.finish()
        {
            decoder.on_event(&event, &mut *on_delta)?;
        }
        let response = decoder.finish()?;
        Ok(match call.spec.provider {
            // The answer given through the `output` tool is the answer.
            Provider::Anthropic if call.output_schema.is_some() => {
                anthropic::answer_from_output_tool(response)
            }
            Provider::Anthropic | Provider::Openai => response,
        })
    }

    /// How long the next read may wait: the idle timeout, but never past the deadline.
    fn wait_until(&self, deadline: Instant) -> Instant {
        match self.idle_timeout {
            Some(idle) => deadline.min(Instant::now() + idle),
            None => deadline,
        }
    }
}

fn headers(call: &ModelCall<'_>) -> Result<HeaderMap, ModelError> {
    let mut h = HeaderMap::new();
    h.insert(ACCEPT, HeaderValue::from_static("text/event-stream"));
    let request_id = HeaderValue::from_str(&call.request_id.to_string()).map_err(|_| {
        ModelError::fatal(
            ModelErrorKind::Request,
            "request id is not a valid header value",
        )
    })?;
    h.insert(HeaderName::from_static(REQUEST_ID_HEADER), request_id);
    let bad_key = || {
        ModelError::fatal(
            ModelErrorKind::Request,
            "the API key is not a valid header value",
        )
    };
    match call.spec.provider {
        Provider::Openai => {
            if let Some(key) = call.api_key {
                let mut v =
                    HeaderValue::from_str(&format!("Bearer {key}")).map_err(|_| bad_key())?;
                v.set_sensitive(true);
                h.insert(reqwest::header::AUTHORIZATION, v);
            }
        }
        Provider::Anthropic => {
            if let Some(key) = call.api_key {
                let mut v = HeaderValue::from_str(key).map_err(|_| bad_key())?;
                v.set_sensitive(true);
                h.insert(HeaderName::from_static("x-api-key"), v);
            }
            h.insert(
                HeaderName::from_static("anthropic-version"),
                HeaderValue::from_static(anthropic::API_VERSION),
            );
        }
    }
    Ok(h)
}

fn timeout_error(deadline: Instant, timeout: Duration, what: &str) -> ModelError {
    let message = if Instant::now() >= deadline {
        format!("{what}: the call exceeded its {timeout:?} timeout")
    } else {
        format!("{what}: idle timeout")
    };
    ModelError::retryable(ModelErrorKind::Timeout, message)
}

fn send_error(e: &reqwest::Error) -> ModelError {
    let message = error_chain(e);
    if e.is_builder() {
        ModelError::fatal(ModelErrorKind::Request, message)
    } else if e.is_timeout() {
        ModelError::retryable(ModelErrorKind::Timeout, message)
    } else {
        // Connect failures, resets, and everything else before the headers: transient.
        ModelError::retryable(ModelErrorKind::Connect, message)
    }
}

/// An error and its sources, `: `-separated (reqwest's own message alone is rarely enough).
fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut out = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = s.source();
    }
    out
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use kedge_core::event::{AssistantMessage, ToolCall};
    use kedge_core::ids::{Attempt, RunId, StepNo};
    use std::sync::LazyLock;

    static TOOLS: LazyLock<Vec<ToolSpec>> = LazyLock::new(|| {
        vec![
            ToolSpec {
                name: "read_dir".into(),
                description: "List a directory".into(),
                parameters: serde_json::json!({"type": "object", "properties": {"path": {"type": "string"}}}),
            },
            ToolSpec {
                name: "now".into(),
                description: String::new(),
                parameters: serde_json::json!({"type": "object", "properties": {}}),
            },
        ]
    });

    static REQUEST_ID: LazyLock<ModelRequestId> = LazyLock::new(|| {
        let run: RunId = "run_t1".parse().expect("run id");
        ModelRequestId::new(&run, StepNo(3), Attempt(1))
    });

    /// A conversation with parallel tool calls, an error result, a user message after the
    /// results, arguments that were not JSON, an empty result and an empty assistant turn.
    pub(crate) fn conversation() -> Vec<ChatMessage> {
        let call = |id: &str, name: &str, arguments: serde_json::Value| ToolCall {
            call_id: id.into(),
            name: name.into(),
            arguments,
        };
        vec![
            ChatMessage::User {
                text: "List /etc and tell me the time.".into(),
            },
            ChatMessage::Assistant {
                message: AssistantMessage {
                    text: String::new(),
                    tool_calls: vec![
                        call("call_1", "read_dir", serde_json::json!({"path": "/etc"})),
                        call("call_2", "now", serde_json::json!({})),
                    ],
                    thinking: Vec::new(),
                },
            },
            ChatMessage::Tool {
                call_id: "call_1".into(),
                content: "hosts\npasswd".into(),
                is_error: false,
            },
            ChatMessage::Tool {
                call_id: "call_2".into(),
                content: "clock unavailable".into(),
                is_error: true,
            },
            ChatMessage::User {
                text: "Also, be quick.".into(),
            },
            ChatMessage::Assistant {
                message: AssistantMessage {
                    text: "Working on it.".into(),
                    tool_calls: vec![call("call_3", "now", "{oops".into())],
                    thinking: Vec::new(),
                },
            },
            ChatMessage::Tool {
                call_id: "call_3".into(),
                content: String::new(),
                is_error: false,
            },
            ChatMessage::Assistant {
                message: AssistantMessage {
                    text: String::new(),
                    tool_calls: vec![],
                    thinking: Vec::new(),
                },
            },
            ChatMessage::User {
                text: "Thanks".into(),
            },
        ]
    }

    pub(crate) fn call_with<'a>(spec: &'a ModelSpec, context: &'a [ChatMessage]) -> ModelCall<'a> {
        ModelCall {
            spec,
            api_key: Some("sk-test"),
            system: "Be brief.",
            tools: &TOOLS,
            context,
            request_id: &REQUEST_ID,
            max_output_tokens: 256,
            output_schema: None,
            timeout: Duration::from_secs(5),
        }
    }

    #[test]
    fn the_call_future_is_send() {
        fn is_send<T: Send>(_: &T) {}
        let spec = ModelSpec {
            provider: Provider::Openai,
            name: "m".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        let context = conversation();
        let call = call_with(&spec, &context);
        let client = ModelClient::new();
        let mut sink = |_d: Delta| {};
        let future = client.complete(&call, &mut sink);
        is_send(&future);
    }

    #[test]
    fn endpoints_and_key_variables() {
        let mut spec = ModelSpec {
            provider: Provider::Openai,
            name: "m".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        assert_eq!(
            endpoint(&spec),
            "https://api.openai.com/v1/chat/completions"
        );
        spec.base_url = Some("http://127.0.0.1:8080/v1/".into());
        assert_eq!(endpoint(&spec), "http://127.0.0.1:8080/v1/chat/completions");
        spec.base_url = Some("http://127.0.0.1:11434".into());
        assert_eq!(
            endpoint(&spec),
            "http://127.0.0.1:11434/v1/chat/completions",
            "a bare host gets the version"
        );
        spec.base_url = Some("https://gateway.example/openai/v1".into());
        assert_eq!(
            endpoint(&spec),
            "https://gateway.example/openai/v1/chat/completions"
        );
        spec.provider = Provider::Anthropic;
        spec.base_url = None;
        assert_eq!(endpoint(&spec), "https://api.anthropic.com/v1/messages");
        // As Anthropic's SDKs write it, and the older form with the version.
        for base in [
            "https://api.anthropic.com",
            "https://api.anthropic.com/",
            "https://api.anthropic.com/v1",
        ] {
            spec.base_url = Some(base.into());
            assert_eq!(endpoint(&spec), "https://api.anthropic.com/v1/messages");
        }
        assert_eq!(
            default_api_key_env(Provider::Anthropic),
            "ANTHROPIC_API_KEY"
        );
    }

    #[test]
    fn headers_carry_the_request_id_and_hide_the_key() {
        let spec = ModelSpec {
            provider: Provider::Anthropic,
            name: "m".into(),
            base_url: None,
            settings: Default::default(),
            price: None,
        };
        let context = conversation();
        let call = call_with(&spec, &context);
        let h = headers(&call).expect("headers");
        assert_eq!(h[REQUEST_ID_HEADER], "req_t1_3_1");
        assert_eq!(h["anthropic-version"], "2023-06-01");
        assert!(h["x-api-key"].is_sensitive());
        assert!(!format!("{call:?}").contains("sk-test"));
        let spec = ModelSpec {
            provider: Provider::Openai,
            ..spec
        };
        let mut call = call_with(&spec, &context);
        let h = headers(&call).expect("headers");
        assert_eq!(h["authorization"], "Bearer sk-test");
        call.api_key = Some("bad\nkey");
        let e = headers(&call).expect_err("invalid header");
        assert!(!e.message.contains("bad"));
        call.api_key = None;
        assert!(
            headers(&call)
                .expect("headers")
                .get("authorization")
                .is_none()
        );
    }
}
