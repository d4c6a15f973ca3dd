//! The HTTP shell: routes, the request pipeline, faults and streaming bodies.
//!
//! Pipeline of a model call: auth (401, not counted) → count and record → trouble other than
//! `stream_cut` (the provider is down whatever is asked) → body parse → (Anthropic) version
//! header → validation (400) → model lookup (404) → `context_window` (400) → `limits` (429;
//! admitted calls carry the rate-limit headers from here on) → `stream_cut` trouble → choose the
//! script entry and count the hit → `delay_ms` → `fault` → `hang` → answer (JSON, or SSE with
//! `stream_error` / `drop_after_chunks`).

use std::io;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::connect_info::ConnectInfo;
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, FromRequestParts, Query, State};
use axum::http::request::Parts;
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post, put};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::conn::ConnReset;
use crate::error::{ApiError, ErrorClass, Provider};
use crate::limits::{self, Quota, Refusal, Usage};
use crate::reply::{Output, Parsed, new_request_id, sse, tokens};
use crate::script::{Response as Scripted, Scripts};
use crate::trouble::{Trouble, TroubleKind};
use crate::{Admission, MockLlm, REQUEST_ID_HEADER, RecordedBody, TroubleNow, anthropic, openai};

/// Larger bodies get a 413 in the provider's shape (Anthropic's own limit is 32 MB).
const BODY_LIMIT: usize = 32 * 1024 * 1024;

/// How long a stream that is about to be cut waits so that what it sent reaches the client.
const FLUSH_BEFORE_CUT: Duration = Duration::from_millis(50);

#[derive(Clone)]
struct AppState {
    mock: MockLlm,
    /// Fires when the server shuts down, to release hanging and delayed calls.
    /// `None` (a router mounted by the caller): they wait for ever.
    release: Option<watch::Receiver<bool>>,
}

impl AppState {
    async fn released(&self) {
        match &self.release {
            Some(rx) => {
                let mut rx = rx.clone();
                // An error means the sender is gone: the server is stopping as well.
                let _ = rx.wait_for(|released| *released).await;
            }
            None => std::future::pending().await,
        }
    }
}

pub(crate) fn router(mock: MockLlm, release: Option<watch::Receiver<bool>>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(openai_call))
        .route("/v1/messages", post(anthropic_call))
        .route("/_mock/calls", get(calls))
        .route("/_mock/requests", get(requests))
        .route("/_mock/scripts", put(put_scripts))
        .route(
            "/_mock/trouble",
            get(get_trouble).put(put_trouble).delete(delete_trouble),
        )
        .route("/_mock/reset", post(reset))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(AppState { mock, release })
}

/// The connection's reset flag, when the router is served by [`crate::serve`].
struct Conn(Option<ConnReset>);

impl<S: Send + Sync> FromRequestParts<S> for Conn {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Conn, Self::Rejection> {
        Ok(Conn(
            parts
                .extensions
                .get::<ConnectInfo<ConnReset>>()
                .map(|info| info.0.clone()),
        ))
    }
}

async fn openai_call(
    State(st): State<AppState>,
    conn: Conn,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    model_call(Provider::OpenAi, st, conn, headers, body).await
}

async fn anthropic_call(
    State(st): State<AppState>,
    conn: Conn,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    model_call(Provider::Anthropic, st, conn, headers, body).await
}

async fn model_call(
    provider: Provider,
    st: AppState,
    conn: Conn,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = new_request_id();
    let mut reply = Reply {
        provider,
        request_id: &request_id,
        extra: HeaderMap::new(),
    };
    let auth = match provider {
        Provider::OpenAi => openai::check_auth(&headers),
        Provider::Anthropic => anthropic::check_auth(&headers),
    };
    if let Err(e) = auth {
        return reply.error(&e, None);
    }
    let client_request_id = headers
        .get(REQUEST_ID_HEADER)
        .and_then(|v| v.to_str().ok())
        .unwrap_or_default()
        .to_owned();

    let (bytes, json, model) = match body {
        Ok(bytes) => {
            let json = serde_json::from_slice::<Value>(&bytes);
            let model = json
                .as_ref()
                .ok()
                .and_then(|v| v.get("model"))
                .and_then(Value::as_str)
                .unwrap_or_default()
                .to_owned();
            st.mock.record(
                &client_request_id,
                &model,
                RecordedBody::Received(bytes.clone()),
            );
            (Ok(bytes), json, model)
        }
        Err(rejection) => {
            st.mock.record(&client_request_id, "", RecordedBody::Unread);
            (Err(rejection), Ok(Value::Null), String::new())
        }
    };

    // A `stream_cut` strikes later, once the call is accepted.
    let trouble = st.mock.trouble_for(&model);
    if let Some(t) = &trouble
        && let Some(response) = reply.trouble(t, &model, conn)
    {
        st.mock.note_troubled();
        tracing::debug!(provider = provider.name(), model, client_request_id, trouble = %t.trouble.kind(), "mock-llm in trouble");
        return response;
    }

    if let Err(rejection) = bytes {
        let e = if rejection.status() == StatusCode::PAYLOAD_TOO_LARGE {
            ApiError::new(
                StatusCode::PAYLOAD_TOO_LARGE,
                ErrorClass::RequestTooLarge,
                "Request exceeds the maximum allowed number of bytes.",
            )
        } else {
            ApiError::invalid(rejection.body_text())
        };
        return reply.error(&e, None);
    }
    if provider == Provider::Anthropic
        && let Err(e) = anthropic::check_version(&headers)
    {
        return reply.error(&e, None);
    }
    let Ok(body) = json else {
        let e = match provider {
            Provider::OpenAi => openai::unparsable_body(),
            Provider::Anthropic => anthropic::unparsable_body(),
        };
        return reply.error(&e, None);
    };
    let validated = match provider {
        Provider::OpenAi => openai::validate(&body),
        Provider::Anthropic => anthropic::validate(&body),
    };
    let parsed = match validated {
        Ok(parsed) => parsed,
        Err(e) => {
            tracing::debug!(provider = provider.name(), model, client_request_id, error = %e.message, "mock-llm rejected a request");
            return reply.error(&e, None);
        }
    };

    let input_tokens = tokens(parsed.input_chars);
    match st.mock.admit(&parsed.model, input_tokens) {
        Admission::UnknownModel => {
            let e = match provider {
                Provider::OpenAi => openai::model_not_found(&parsed.model),
                Provider::Anthropic => anthropic::model_not_found(&parsed.model),
            };
            return reply.error(&e, None);
        }
        Admission::TooLong { window } => {
            return reply.error(
                &ApiError::context_too_long(provider, window, input_tokens),
                None,
            );
        }
        Admission::Limited(Refusal {
            exceeded,
            usage,
            retry_after,
        }) => {
            st.mock.note_limited();
            reply.extra = limits::headers(provider, &usage);
            let retry_in = retry_after.map(limits::go_duration);
            let e = ApiError::over_limit(
                provider,
                &parsed.model,
                exceeded,
                input_tokens,
                retry_in.as_deref(),
            );
            let retry_after_ms = retry_after.map(|d| duration_ms(d).max(1));
            return reply.error(&e, retry_after_ms);
        }
        Admission::Admitted(Some(usage)) => {
            reply.extra = limits::headers(provider, &usage);
        }
        Admission::Admitted(None) => {}
    }

    if trouble.is_some() {
        // A `stream_cut`: the answer starts, then the connection goes.
        st.mock.note_troubled();
        tracing::debug!(
            provider = provider.name(),
            model,
            client_request_id,
            trouble = "stream_cut",
            "mock-llm in trouble"
        );
        return reply.stream_cut(&parsed);
    }

    let Some((entry, response, hit)) = st.mock.choose(&parsed.model, &parsed.cue) else {
        // The script was replaced since the model was looked up.
        let e = match provider {
            Provider::OpenAi => openai::model_not_found(&parsed.model),
            Provider::Anthropic => anthropic::model_not_found(&parsed.model),
        };
        return reply.error(&e, None);
    };
    tracing::debug!(
        provider = provider.name(),
        model = parsed.model,
        client_request_id,
        %entry,
        hit,
        stream = parsed.stream,
        "mock-llm answering"
    );

    if response.delay_ms > 0 {
        tokio::select! {
            () = tokio::time::sleep(Duration::from_millis(response.delay_ms)) => {}
            () = st.released() => return reply.shutting_down(),
        }
    }
    if let Some(fault) = response.fault_for(hit) {
        return reply.error(
            &ApiError::fault(fault.status, provider),
            fault.retry_after_ms,
        );
    }
    let failing = response.failures_apply(hit);
    if failing && response.hang {
        st.released().await;
        return reply.shutting_down();
    }
    let drop_after = response.drop_after_chunks.filter(|_| failing);
    let chunk_delay = Duration::from_millis(response.chunk_delay_ms);
    let out = Output::generate(provider, &parsed, &response);

    if !parsed.stream {
        let body = match provider {
            Provider::OpenAi => openai::completion(&out),
            Provider::Anthropic => anthropic::message(&out),
        };
        let mut bytes = body.to_string().into_bytes();
        let body = match drop_after {
            // A cut non-streaming answer: half the JSON, then the connection closes.
            Some(_) => {
                bytes.truncate(bytes.len() / 2);
                frames_body(vec![Bytes::from(bytes)], Duration::ZERO, true)
            }
            None => Body::from(bytes),
        };
        return reply.with_headers(StatusCode::OK, "application/json", body, None);
    }

    let mut frames = match provider {
        Provider::OpenAi => openai::stream_frames(&out, parsed.include_usage),
        Provider::Anthropic => anthropic::stream_frames(&out),
    };
    if failing && response.stream_error {
        let (status, event) = match provider {
            Provider::OpenAi => (500, None),
            Provider::Anthropic => (529, Some("error")),
        };
        let error = ApiError::fault(status, provider).stream_body(provider);
        frames.truncate((frames.len() / 2).max(1));
        frames.push(sse(event, &error.to_string()));
    }
    let mut cut = false;
    if let Some(n) = drop_after {
        // Never the last frame: a dropped stream has no final chunk / [DONE] / message_stop.
        let keep = n.min(frames.len().saturating_sub(1));
        frames.truncate(keep);
        cut = true;
    }
    let frames = frames.into_iter().map(Bytes::from).collect();
    reply.with_headers(
        StatusCode::OK,
        "text/event-stream; charset=utf-8",
        frames_body(frames, chunk_delay, cut),
        None,
    )
}

/// Sends `frames` (after `delay` each); when `cut`, then aborts the connection instead of
/// ending the body, so the client sees an incomplete response. Frames with no delay between them
/// go out in one write, as a server that has them all at once sends them: one body chunk per
/// frame would cost a write, a TCP segment and a wakeup of the client each, which a model with
/// no latency to hide behind does not (the agent-loop bench measures the runtime, not this).
fn frames_body(frames: Vec<Bytes>, delay: Duration, cut: bool) -> Body {
    if delay.is_zero() && !cut {
        return Body::from(frames.concat());
    }
    let stream = futures::stream::unfold(
        (frames.into_iter(), false),
        move |(mut frames, done)| async move {
            if done {
                return None;
            }
            match frames.next() {
                Some(frame) => {
                    if !delay.is_zero() {
                        tokio::time::sleep(delay).await;
                    }
                    Some((Ok(frame), (frames, false)))
                }
                None if cut => {
                    tokio::time::sleep(FLUSH_BEFORE_CUT).await;
                    let e = io::Error::new(
                        io::ErrorKind::ConnectionAborted,
                        "mock-llm: connection dropped by script",
                    );
                    Some((Err(e), (frames, true)))
                }
                None => None,
            }
        },
    );
    Body::from_stream(stream)
}

/// Builds responses for one call: the provider's shapes and request-id header.
struct Reply<'a> {
    provider: Provider,
    request_id: &'a str,
    /// Headers every response to this call carries (the rate-limit headers).
    extra: HeaderMap,
}

impl Reply<'_> {
    /// The answer to a call in trouble, before its body is looked at; `None` for a
    /// `stream_cut`, which strikes only once the call is accepted.
    fn trouble(&self, t: &TroubleNow, model: &str, conn: Conn) -> Option<Response> {
        let provider = self.provider;
        let retry_after_ms = t.trouble.retry_after_ms();
        let response = match t.trouble.kind() {
            TroubleKind::Unavailable => self.error(
                &ApiError::unavailable(t.trouble.status(), provider),
                retry_after_ms,
            ),
            TroubleKind::Overloaded => self.error(&ApiError::overloaded(provider), retry_after_ms),
            TroubleKind::RateLimited => {
                let quota = |limit: u64| Quota {
                    limit,
                    remaining: 0,
                    reset: t.reset,
                };
                let limits = t.limits.as_ref();
                let requests = limits
                    .and_then(|l| l.requests_per_minute)
                    .unwrap_or(limits::TROUBLE_REQUESTS_LIMIT);
                let tokens = limits
                    .and_then(|l| l.tokens_per_minute)
                    .unwrap_or(limits::TROUBLE_TOKENS_LIMIT);
                let usage = Usage {
                    requests: Some(quota(requests)),
                    tokens: Some(quota(tokens)),
                };
                let e = ApiError::trouble_rate_limited(
                    provider,
                    model,
                    requests,
                    &limits::go_duration(t.reset),
                );
                let mut response = self.error(&e, retry_after_ms);
                response
                    .headers_mut()
                    .extend(limits::headers(provider, &usage));
                response
            }
            TroubleKind::Reset => reset_connection(conn),
            TroubleKind::StreamCut => return None,
        };
        Some(response)
    }

    /// A `stream_cut`: 200 and the headers, the stream's opening event at most (OpenAI's role
    /// chunk, Anthropic's `message_start`), then the connection closes; a non-streaming call
    /// gets half its JSON body, then the close.
    fn stream_cut(&self, parsed: &Parsed) -> Response {
        let out = Output::generate(self.provider, parsed, &Scripted::plain_ok());
        if !parsed.stream {
            let body = match self.provider {
                Provider::OpenAi => openai::completion(&out),
                Provider::Anthropic => anthropic::message(&out),
            };
            let mut bytes = body.to_string().into_bytes();
            bytes.truncate(bytes.len() / 2);
            let body = frames_body(vec![Bytes::from(bytes)], Duration::ZERO, true);
            return self.with_headers(StatusCode::OK, "application/json", body, None);
        }
        let mut frames = match self.provider {
            Provider::OpenAi => openai::stream_frames(&out, parsed.include_usage),
            Provider::Anthropic => anthropic::stream_frames(&out),
        };
        frames.truncate(1);
        let frames = frames.into_iter().map(Bytes::from).collect();
        self.with_headers(
            StatusCode::OK,
            "text/event-stream; charset=utf-8",
            frames_body(frames, Duration::ZERO, true),
            None,
        )
    }

    fn error(&self, e: &ApiError, retry_after_ms: Option<u64>) -> Response {
        let body = e.body(self.provider, self.request_id).to_string();
        self.with_headers(
            e.status,
            "application/json",
            Body::from(body),
            retry_after_ms,
        )
    }

    fn shutting_down(&self) -> Response {
        let e = ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            ErrorClass::Api,
            "mock-llm is shutting down",
        );
        self.error(&e, None)
    }

    fn with_headers(
        &self,
        status: StatusCode,
        content_type: &'static str,
        body: Body,
        retry_after_ms: Option<u64>,
    ) -> Response {
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(content_type));
        if content_type.starts_with("text/event-stream") {
            headers.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        }
        let id_header = match self.provider {
            Provider::OpenAi => "x-request-id",
            Provider::Anthropic => "request-id",
        };
        if let Ok(v) = HeaderValue::from_str(self.request_id) {
            headers.insert(id_header, v);
        }
        headers.extend(self.extra.clone());
        if let Some(ms) = retry_after_ms {
            headers.insert(header::RETRY_AFTER, HeaderValue::from(ms.div_ceil(1000)));
            headers.insert("retry-after-ms", HeaderValue::from(ms));
        }
        response
    }
}

async fn calls(State(st): State<AppState>) -> Json<crate::CallCounts> {
    Json(st.mock.calls())
}

#[derive(Deserialize)]
struct RequestsQuery {
    model: Option<String>,
}

async fn requests(State(st): State<AppState>, Query(q): Query<RequestsQuery>) -> Json<Vec<Value>> {
    Json(match q.model {
        Some(model) => st.mock.requests(&model),
        None => st
            .mock
            .all_requests()
            .into_iter()
            .map(|(_, body)| body)
            .collect(),
    })
}

async fn put_scripts(State(st): State<AppState>, body: String) -> Response {
    match Scripts::from_json(&body) {
        Ok(scripts) => {
            st.mock.set_scripts(scripts);
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => control_error(&e.to_string(), e.path()),
    }
}

/// Closes the connection without a response. Served by [`crate::serve`], the connection is
/// reset before a byte of the response leaves (see `conn`); mounted elsewhere (no reset flag),
/// the body fails before its first byte, which makes hyper drop the connection without sending
/// what it buffered.
fn reset_connection(conn: Conn) -> Response {
    match conn.0 {
        Some(flag) => {
            flag.reset();
            // Never sent: writing it is what finds the connection reset.
            StatusCode::INTERNAL_SERVER_ERROR.into_response()
        }
        None => {
            let fail = futures::stream::once(async {
                Err::<Bytes, _>(io::Error::new(
                    io::ErrorKind::ConnectionReset,
                    "mock-llm: connection reset by trouble",
                ))
            });
            Body::from_stream(fail).into_response()
        }
    }
}

fn duration_ms(d: Duration) -> u64 {
    u64::try_from(d.as_millis()).unwrap_or(u64::MAX)
}

/// 400 `{"error": {"message", "path"}}`, as for a refused script.
fn control_error(message: &str, path: &str) -> Response {
    control_error_status(StatusCode::BAD_REQUEST, message, path)
}

fn control_error_status(status: StatusCode, message: &str, path: &str) -> Response {
    (
        status,
        Json(json!({"error": {"message": message, "path": path}})),
    )
        .into_response()
}

async fn get_trouble(State(st): State<AppState>) -> Json<Option<Trouble>> {
    Json(st.mock.trouble())
}

async fn put_trouble(State(st): State<AppState>, body: Result<Bytes, BytesRejection>) -> Response {
    let body = match body {
        Ok(body) => body,
        // Too large (413) or not read: the same shape as the other refusals.
        Err(rejection) => {
            return control_error_status(rejection.status(), &rejection.body_text(), "");
        }
    };
    match Trouble::from_slice(&body) {
        Ok(trouble) => {
            st.mock.set_trouble(Some(trouble));
            StatusCode::NO_CONTENT.into_response()
        }
        Err(e) => control_error(&e.to_string(), e.path()),
    }
}

async fn delete_trouble(State(st): State<AppState>) -> StatusCode {
    st.mock.set_trouble(None);
    StatusCode::NO_CONTENT
}

async fn reset(State(st): State<AppState>) -> StatusCode {
    st.mock.reset();
    StatusCode::NO_CONTENT
}
