//! [`ModelError`]: what went wrong with one model call, classified for the caller.
//!
//! The class is what the step service acts on: [`ErrorClass::Retryable`] → journal the attempt
//! and try again with a new attempt number (after [`ModelError::retry_after`] when the provider
//! said so); [`ErrorClass::Fatal`] → the same request would fail again, so the step fails.
//! [`ModelErrorKind`] says what happened, for logs, metrics and tests.
//!
//! Classification:
//! - HTTP 408, 429, 500, 502, 503, 504, 529 and every other 5xx except 501 → retryable; any
//!   other non-success status → fatal, with the provider's own error message.
//! - connect failures, timeouts, streams that break or end before their terminal marker, and
//!   undecodable stream data → retryable.
//! - an error *inside* a 200 stream (`data: {"error":…}`, Anthropic's `event: error`) → fatal
//!   only when its type names a request problem (`invalid_request_error`, `authentication_error`,
//!   `permission_error`, `not_found_error`, `request_too_large`, …); otherwise (overloaded,
//!   rate limit, `api_error`, `server_error`, unknown) retryable.
//!
//! Provider trouble ([`ModelError::trouble`]), which spends none of a step's attempts: the
//! run waits on the provider instead (docs/ARCHITECTURE.md, "Provider trouble"):
//! - *rate limited*: HTTP 429, except OpenAI's `insufficient_quota` (a billing problem that
//!   waiting does not mend: fatal), and a `rate_limit_error` inside a stream;
//! - *unavailable*: HTTP 408, 529 and every 5xx except 501; a connection refused or reset; a
//!   timeout before the response headers; a stream that breaks, stalls or ends before any
//!   content; an `overloaded_error`, `api_error` or `server_error` inside a stream before any
//!   content.
//!
//! Everything else retryable (a stream cut after content began, undecodable data) spends an
//! attempt, like a crash.

use std::fmt;
use std::time::{Duration, SystemTime};

use kedge_core::event::{AttemptOutcome, ErrorClass, Trouble};
use reqwest::header::HeaderMap;

mod body;
mod headers;

pub(crate) use body::{ErrorBody, ErrorEnvelope};
pub use headers::{RateLimits, rate_limit_reset, retry_after};

use body::truncate;

/// What kind of failure a [`ModelError`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelErrorKind {
    /// The provider answered with a non-success HTTP status (see [`ModelError::status`]).
    Status,
    /// The request could not be built (bad base URL, an API key that is not a valid header).
    Request,
    /// No connection could be made, or it failed before the response headers.
    Connect,
    /// The call's timeout elapsed: before the response headers, between two stream chunks, or
    /// in total.
    Timeout,
    /// The stream broke or ended before its terminal marker (`[DONE]` / `message_stop`).
    StreamEnded,
    /// The provider reported an error inside the stream.
    Provider,
    /// The response was not what the wire format promises (not an event stream, undecodable
    /// JSON, a tool call without a name).
    Protocol,
}

impl ModelErrorKind {
    /// The kind's name (its `Display`, and a bounded metrics label).
    pub fn as_str(self) -> &'static str {
        match self {
            ModelErrorKind::Status => "status",
            ModelErrorKind::Request => "request",
            ModelErrorKind::Connect => "connect",
            ModelErrorKind::Timeout => "timeout",
            ModelErrorKind::StreamEnded => "stream_ended",
            ModelErrorKind::Provider => "provider",
            ModelErrorKind::Protocol => "protocol",
        }
    }
}

impl fmt::Display for ModelErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A model call that produced no response.
///
/// `message` never contains the API key (the client scrubs it) and is safe to journal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("model call failed ({kind}): {message}")]
pub struct ModelError {
    pub class: ErrorClass,
    pub kind: ModelErrorKind,
    /// The HTTP status, when the provider answered with one.
    pub status: Option<u16>,
    /// How long the provider asked us to wait (`retry-after-ms`, else `retry-after`).
    pub retry_after: Option<Duration>,
    pub message: String,
    /// Set when the failure is the provider's trouble, not the request's or the answer's.
    pub trouble: Option<Trouble>,
}

impl ModelError {
    /// The call was not made: the operator's policy does not allow the agent's key variable or
    /// endpoint. Fatal: the same call would be refused again.
    pub fn refused_by_policy(reason: impl Into<String>) -> Self {
        Self::new(ErrorClass::Fatal, ModelErrorKind::Request, reason)
    }

    pub(crate) fn new(class: ErrorClass, kind: ModelErrorKind, message: impl Into<String>) -> Self {
        Self {
            class,
            kind,
            status: None,
            retry_after: None,
            message: message.into(),
            trouble: None,
        }
    }

    pub(crate) fn retryable(kind: ModelErrorKind, message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Retryable, kind, message)
    }

    pub(crate) fn fatal(kind: ModelErrorKind, message: impl Into<String>) -> Self {
        Self::new(ErrorClass::Fatal, kind, message)
    }

    pub fn is_retryable(&self) -> bool {
        self.class == ErrorClass::Retryable
    }

    /// The journal form of this error (the data of a `model.attempt` event).
    pub fn to_attempt_outcome(&self) -> AttemptOutcome {
        AttemptOutcome::Error {
            class: self.class,
            message: self.message.clone(),
            status: self.status,
            retry_after_ms: self
                .retry_after
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            trouble: self.trouble,
        }
    }

    /// Whether the provider refused the request as longer than the model's context window
    /// (OpenAI `context_length_exceeded`, Anthropic "prompt is too long", llama.cpp's server
    /// `exceed_context_size_error`).
    pub fn is_too_long(&self) -> bool {
        const SAID: &[&str] = &[
            "context_length_exceeded",
            "prompt is too long",
            "maximum context length",
            "exceed_context_size_error",
            "exceeds the available context size",
        ];
        self.class == ErrorClass::Fatal && SAID.iter().any(|s| self.message.contains(s))
    }

    /// The window a too-long refusal names, when it does ("maximum context length is N
    /// tokens", "… > N maximum").
    pub fn window_named(&self) -> Option<u64> {
        let m = &self.message;
        let after = |marker: &str| {
            m.find(marker).and_then(|at| {
                m[at + marker.len()..]
                    .split(|c: char| !c.is_ascii_digit())
                    .find(|t| !t.is_empty())
                    .and_then(|t| t.parse().ok())
            })
        };
        after("maximum context length is ").or_else(|| {
            let at = m.find(" maximum")?;
            m[..at]
                .rsplit(|c: char| !c.is_ascii_digit())
                .find(|t| !t.is_empty())?
                .parse()
                .ok()
        })
    }

    /// Classifies the error as provider trouble (see the module docs); `content_seen`: the
    /// stream had begun to carry the answer when it failed.
    pub(crate) fn with_trouble(mut self, content_seen: bool) -> Self {
        self.trouble = match (self.class, self.kind) {
            (ErrorClass::Fatal, _) => None,
            (ErrorClass::Retryable, ModelErrorKind::Status) => match self.status {
                Some(429) => Some(Trouble::RateLimited),
                _ => Some(Trouble::Unavailable),
            },
            (ErrorClass::Retryable, ModelErrorKind::Connect) => Some(Trouble::Unavailable),
            (
                ErrorClass::Retryable,
                ModelErrorKind::Timeout | ModelErrorKind::StreamEnded | ModelErrorKind::Provider,
            ) if self.message.contains("rate_limit_error") => Some(Trouble::RateLimited),
            (
                ErrorClass::Retryable,
                ModelErrorKind::Timeout | ModelErrorKind::StreamEnded | ModelErrorKind::Provider,
            ) if !content_seen => Some(Trouble::Unavailable),
            (ErrorClass::Retryable, _) => None,
        };
        self
    }

    /// The error for a non-success HTTP response, from its status, headers and body.
    pub(crate) fn from_response(
        status: u16,
        headers: &HeaderMap,
        body: &[u8],
        now: SystemTime,
    ) -> Self {
        let mut class = status_class(status);
        let message = match serde_json::from_slice::<ErrorEnvelope>(body) {
            Ok(ErrorEnvelope { error: Some(e) }) => {
                // Out of credit, not over a rate: waiting does not mend it.
                if e.code_str().as_deref() == Some("insufficient_quota") {
                    class = ErrorClass::Fatal;
                }
                format!("HTTP {status} {}", e.describe())
            }
            _ => {
                let text = String::from_utf8_lossy(body);
                let text = text.trim();
                if text.is_empty() {
                    format!("HTTP {status}")
                } else {
                    format!("HTTP {status}: {}", truncate(text, 500))
                }
            }
        };
        Self {
            class,
            kind: ModelErrorKind::Status,
            status: Some(status),
            retry_after: retry_after(headers, now).or_else(|| {
                // A 429 without `retry-after`: when the exhausted limit resets, from the
                // providers' rate-limit headers.
                (status == 429)
                    .then(|| rate_limit_reset(headers, now))
                    .flatten()
            }),
            message,
            trouble: None,
        }
    }

    /// The error for an error object reported inside a 200 stream.
    pub(crate) fn from_stream_error(body: &ErrorBody) -> Self {
        Self::from_error_body(body, "error in stream")
    }

    /// The error for an error object inside a successful response, classified by its type.
    pub(crate) fn from_error_body(body: &ErrorBody, context: &str) -> Self {
        let class = if body.is_request_problem() {
            ErrorClass::Fatal
        } else {
            ErrorClass::Retryable
        };
        Self::new(
            class,
            ModelErrorKind::Provider,
            format!("{context}: {}", body.describe()),
        )
    }

    /// Replaces every occurrence of `secret` in the message (providers sometimes echo keys).
    pub(crate) fn scrub(mut self, secret: Option<&str>) -> Self {
        if let Some(secret) = secret.filter(|s| s.len() >= 4)
            && self.message.contains(secret)
        {
            self.message = self.message.replace(secret, "<redacted>");
        }
        self
    }
}

/// Whether an HTTP status is worth retrying.
pub fn status_class(status: u16) -> ErrorClass {
    match status {
        408 | 429 | 529 => ErrorClass::Retryable,
        501 => ErrorClass::Fatal,
        500..=599 => ErrorClass::Retryable,
        _ => ErrorClass::Fatal,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::headers::tests::headers;

    #[test]
    fn statuses_are_classified() {
        for s in [408, 429, 500, 502, 503, 504, 529] {
            assert_eq!(status_class(s), ErrorClass::Retryable, "{s}");
        }
        for s in [400, 401, 403, 404, 413, 422, 501] {
            assert_eq!(status_class(s), ErrorClass::Fatal, "{s}");
        }
    }

    #[test]
    fn response_errors_carry_the_providers_message() {
        let now = SystemTime::now();
        let openai = br#"{"error":{"message":"Invalid parameter: messages with role 'tool' must be a response to a preceeding message with 'tool_calls'.","type":"invalid_request_error","param":"messages.[2].role","code":null}}"#;
        let e = ModelError::from_response(400, &HeaderMap::new(), openai, now);
        assert_eq!(e.class, ErrorClass::Fatal);
        assert_eq!(e.status, Some(400));
        assert!(
            e.message
                .starts_with("HTTP 400 invalid_request_error: Invalid parameter"),
            "{}",
            e.message
        );
        let anthropic = br#"{"type":"error","error":{"type":"overloaded_error","message":"Overloaded"},"request_id":"req_1"}"#;
        let h = headers(&[("retry-after", "2")]);
        let e = ModelError::from_response(529, &h, anthropic, now);
        assert_eq!(e.class, ErrorClass::Retryable);
        assert_eq!(e.message, "HTTP 529 overloaded_error: Overloaded");
        assert_eq!(e.retry_after, Some(Duration::from_secs(2)));
        let e = ModelError::from_response(502, &HeaderMap::new(), b"<html>bad gateway</html>", now);
        assert_eq!(e.message, "HTTP 502: <html>bad gateway</html>");
        assert!(e.is_retryable());
    }

    #[test]
    fn stream_errors_are_classified_by_type() {
        let body = |kind: &str| ErrorBody {
            kind: Some(kind.into()),
            message: Some("m".into()),
            code: None,
        };
        for t in [
            "overloaded_error",
            "rate_limit_error",
            "api_error",
            "server_error",
            "something_new",
        ] {
            assert!(
                ModelError::from_stream_error(&body(t)).is_retryable(),
                "{t}"
            );
        }
        for t in ["invalid_request_error", "authentication_error"] {
            assert!(
                !ModelError::from_stream_error(&body(t)).is_retryable(),
                "{t}"
            );
        }
        let coded = ErrorBody {
            kind: None,
            message: Some("too long".into()),
            code: Some("context_length_exceeded".into()),
        };
        let e = ModelError::from_stream_error(&coded);
        assert!(!e.is_retryable());
        assert_eq!(
            e.message,
            "error in stream: context_length_exceeded: too long"
        );
    }

    #[test]
    fn secrets_are_scrubbed_and_outcomes_carry_milliseconds() {
        let mut e = ModelError::fatal(ModelErrorKind::Status, "bad key sk-secret-123 given");
        e.retry_after = Some(Duration::from_millis(1500));
        let e = e.scrub(Some("sk-secret-123"));
        assert_eq!(e.message, "bad key <redacted> given");
        assert_eq!(
            e.to_attempt_outcome(),
            AttemptOutcome::Error {
                class: ErrorClass::Fatal,
                message: "bad key <redacted> given".into(),
                status: None,
                retry_after_ms: Some(1500),
                trouble: None,
            }
        );
    }

    fn status_error(status: u16, body: &str) -> ModelError {
        ModelError::from_response(
            status,
            &HeaderMap::new(),
            body.as_bytes(),
            SystemTime::now(),
        )
    }

    #[test]
    fn a_too_long_refusal_is_recognised_with_the_window_it_names() {
        let openai = status_error(
            400,
            r#"{"error":{"message":"This model's maximum context length is 8192 tokens. However, your messages resulted in 9000 tokens.","type":"invalid_request_error","param":"messages","code":"context_length_exceeded"}}"#,
        );
        assert!(openai.is_too_long());
        assert_eq!(openai.window_named(), Some(8192));
        let anthropic = status_error(
            400,
            r#"{"type":"error","error":{"type":"invalid_request_error","message":"prompt is too long: 250000 tokens > 200000 maximum"}}"#,
        );
        assert!(anthropic.is_too_long());
        assert_eq!(anthropic.window_named(), Some(200_000));
        let llama = status_error(
            400,
            r#"{"error":{"code":400,"message":"the request exceeds the available context size, try increasing it","type":"exceed_context_size_error","n_prompt_tokens":600,"n_ctx":512}}"#,
        );
        assert!(llama.is_too_long());
        let other = status_error(
            400,
            r#"{"error":{"message":"bad role","type":"invalid_request_error"}}"#,
        );
        assert!(!other.is_too_long());
        assert_eq!(other.window_named(), None);
    }

    #[test]
    fn provider_trouble_is_told_from_the_requests_fault_and_a_bad_answer() {
        let trouble = |e: ModelError, seen: bool| e.with_trouble(seen).trouble;
        for s in [500, 502, 503, 504, 529, 408] {
            assert_eq!(
                trouble(status_error(s, ""), false),
                Some(Trouble::Unavailable),
                "{s}"
            );
        }
        assert_eq!(
            trouble(
                status_error(429, r#"{"error":{"code":"rate_limit_exceeded"}}"#),
                false
            ),
            Some(Trouble::RateLimited)
        );
        // Out of credit: waiting does not mend it.
        let quota = status_error(
            429,
            r#"{"error":{"code":"insufficient_quota","message":"x"}}"#,
        );
        assert_eq!(quota.class, ErrorClass::Fatal);
        assert_eq!(trouble(quota, false), None);
        for s in [400, 401, 403, 404, 413, 501] {
            assert_eq!(trouble(status_error(s, ""), false), None, "{s}");
        }
        let connect = ModelError::retryable(ModelErrorKind::Connect, "connection refused");
        assert_eq!(trouble(connect.clone(), true), Some(Trouble::Unavailable));
        // Before any content: the provider's; after it: a spent attempt.
        for kind in [ModelErrorKind::StreamEnded, ModelErrorKind::Timeout] {
            let e = ModelError::retryable(kind, "stream broke");
            assert_eq!(
                trouble(e.clone(), false),
                Some(Trouble::Unavailable),
                "{kind}"
            );
            assert_eq!(trouble(e, true), None, "{kind}");
        }
        let overloaded = ModelError::from_stream_error(&ErrorBody {
            kind: Some("overloaded_error".into()),
            message: Some("Overloaded".into()),
            code: None,
        });
        assert_eq!(
            trouble(overloaded.clone(), false),
            Some(Trouble::Unavailable)
        );
        assert_eq!(trouble(overloaded, true), None);
        let limited = ModelError::from_stream_error(&ErrorBody {
            kind: Some("rate_limit_error".into()),
            message: None,
            code: None,
        });
        assert_eq!(trouble(limited, true), Some(Trouble::RateLimited));
        let protocol = ModelError::retryable(ModelErrorKind::Protocol, "undecodable");
        assert_eq!(trouble(protocol, false), None);
        let outcome = status_error(503, "")
            .with_trouble(false)
            .to_attempt_outcome();
        assert!(outcome.is_free());
    }
}
