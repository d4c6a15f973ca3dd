//! The HTTP shell: routes, the request pipeline, faults and streaming bodies.
//!
//! Pipeline of a model call: auth (401, not counted) → count and record → body parse →
//! (Anthropic) version header → validation (400) → model lookup (404) → choose the script entry
//! and count the hit → `delay_ms` → `fault` → `hang` → answer (JSON, or SSE with
//! `stream_error` / `drop_after_chunks`).

use std::io;
use std::time::Duration;

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::rejection::BytesRejection;
use axum::extract::{DefaultBodyLimit, Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Json, Response};
use axum::routing::{get, post, put};
use serde::Deserialize;
use serde_json::{Value, json};
use tokio::sync::watch;

use crate::error::{ApiError, ErrorClass, Provider};
use crate::reply::{Output, new_request_id, sse};
use crate::script::Scripts;
use crate::{MockLlm, REQUEST_ID_HEADER, RecordedBody, anthropic, openai};

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
        .route("/_mock/reset", post(reset))
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .with_state(AppState { mock, release })
}

async fn openai_call(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    model_call(Provider::OpenAi, st, headers, body).await
}

async fn anthropic_call(
    State(st): State<AppState>,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    model_call(Provider::Anthropic, st, headers, body).await
}

async fn model_call(
    provider: Provider,
    st: AppState,
    headers: HeaderMap,
    body: Result<Bytes, BytesRejection>,
) -> Response {
    let request_id = new_request_id();
    let reply = Reply {
        provider,
        request_id: &request_id,
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

    let bytes = match body {
        Ok(bytes) => bytes,
        Err(rejection) => {
            st.mock.record(&client_request_id, "", RecordedBody::Unread);
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
    };
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
    let Some((entry, response, hit)) = st.mock.choose(&parsed.model, &parsed.cue) else {
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
}

impl Reply<'_> {
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
        Err(e) => (
            StatusCode::BAD_REQUEST,
            Json(json!({"error": {"message": e.to_string(), "path": e.path()}})),
        )
            .into_response(),
    }
}

async fn reset(State(st): State<AppState>) -> StatusCode {
    st.mock.reset();
    StatusCode::NO_CONTENT
}
