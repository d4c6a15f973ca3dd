//! Errors as RFC 9457 problem details (`application/problem+json`).
//!
//! Every failure the bridge answers is a [`Problem`]: `type` (a `urn:kedge:problem:<slug>` a
//! client can branch on), `title`, `status`, `detail`, and `field` when one input is at fault
//! (`input`, `budget.max_steps`, `Idempotency-Key`, `after`, …). Nothing a client sends makes
//! the bridge panic: bodies, paths and queries are parsed by hand so that every error names what
//! it is about.

use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use kedge_journal::{ErrorKind, JournalError};
use serde::Serialize;

/// A problem detail, and the response it becomes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Problem {
    #[serde(rename = "type")]
    pub kind: String,
    pub title: String,
    pub status: u16,
    pub detail: String,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub field: Option<String>,
    /// Seconds for a `Retry-After` header.
    #[serde(skip)]
    pub retry_after: Option<u64>,
}

impl Problem {
    pub fn new(status: StatusCode, slug: &str, title: &str, detail: impl Into<String>) -> Self {
        Self {
            kind: format!("urn:kedge:problem:{slug}"),
            title: title.to_owned(),
            status: status.as_u16(),
            detail: detail.into(),
            field: None,
            retry_after: None,
        }
    }

    pub fn with_field(mut self, field: impl Into<String>) -> Self {
        self.field = Some(field.into());
        self
    }

    /// 400: the request cannot be read (not JSON, a malformed id or cursor, a bad header).
    pub fn malformed(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::BAD_REQUEST,
            "malformed-request",
            "Malformed request",
            detail,
        )
        .with_field(field)
    }

    /// 422: the request is well-formed but a field's value is not acceptable.
    pub fn invalid(field: impl Into<String>, detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            "invalid-field",
            "Invalid field",
            detail,
        )
        .with_field(field)
    }

    pub fn not_found(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::NOT_FOUND, "not-found", "Not found", detail)
    }

    pub fn conflict(slug: &str, detail: impl Into<String>) -> Self {
        Self::new(StatusCode::CONFLICT, slug, "Conflict", detail)
    }

    pub fn too_large(limit: usize) -> Self {
        Self::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "body-too-large",
            "Body too large",
            format!("the request body is over the {limit}-byte limit"),
        )
        .with_field("body")
    }

    pub fn unauthorized(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::UNAUTHORIZED,
            "unauthorized",
            "Unauthorized",
            detail,
        )
    }

    pub fn forbidden(detail: impl Into<String>) -> Self {
        Self::new(StatusCode::FORBIDDEN, "forbidden", "Forbidden", detail)
    }

    /// 503 with a `Retry-After`.
    pub fn unavailable(detail: impl Into<String>, retry_after: u64) -> Self {
        let mut p = Self::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable",
            "Service unavailable",
            detail,
        );
        p.retry_after = Some(retry_after);
        p
    }

    pub fn internal(detail: impl Into<String>) -> Self {
        Self::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "internal",
            "Internal error",
            detail,
        )
    }

    pub fn status_code(&self) -> StatusCode {
        StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR)
    }
}

impl From<JournalError> for Problem {
    fn from(e: JournalError) -> Self {
        match e.kind() {
            ErrorKind::Unavailable => Problem::unavailable(e.to_string(), 1),
            ErrorKind::Conflict
            | ErrorKind::Duplicate
            | ErrorKind::TooOld
            | ErrorKind::Invalid
            | ErrorKind::Other => {
                tracing::warn!(error = %e, "journal failure");
                Problem::internal(e.to_string())
            }
        }
    }
}

impl IntoResponse for Problem {
    fn into_response(self) -> Response {
        let status = self.status_code();
        let body = serde_json::to_vec(&self).unwrap_or_default();
        let mut response = (status, body).into_response();
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if status == StatusCode::UNAUTHORIZED {
            headers.insert(
                header::WWW_AUTHENTICATE,
                HeaderValue::from_static("Bearer realm=\"kedge\""),
            );
        }
        if let Some(secs) = self.retry_after
            && let Ok(v) = HeaderValue::from_str(&secs.to_string())
        {
            headers.insert(header::RETRY_AFTER, v);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_problem_serializes_with_its_field_and_type() {
        let p = Problem::invalid("budget.max_steps", "must be at least 1");
        let v = serde_json::to_value(&p).expect("json");
        assert_eq!(v["type"], "urn:kedge:problem:invalid-field");
        assert_eq!(v["status"], 422);
        assert_eq!(v["field"], "budget.max_steps");
        let r = Problem::unavailable("down", 2).into_response();
        assert_eq!(r.status(), StatusCode::SERVICE_UNAVAILABLE);
        assert_eq!(
            r.headers().get(header::RETRY_AFTER).map(|v| v.as_bytes()),
            Some(&b"2"[..])
        );
        assert_eq!(
            r.headers().get(header::CONTENT_TYPE).map(|v| v.as_bytes()),
            Some(&b"application/problem+json"[..])
        );
    }
}
