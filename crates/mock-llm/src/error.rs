//! Errors as the providers spell them: one [`ApiError`], rendered in either wire shape.

use axum::http::StatusCode;
use serde_json::{Value, json};

/// The class of an error; each provider names it in its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    RequestTooLarge,
    RateLimit,
    Api,
    Overloaded,
}

/// An error answer, before it is put in a provider's shape.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct ApiError {
    pub(crate) status: StatusCode,
    pub(crate) class: ErrorClass,
    pub(crate) message: String,
    /// OpenAI's `param` (Anthropic puts the path in the message instead).
    pub(crate) param: Option<String>,
    /// OpenAI's `code`.
    pub(crate) code: Option<&'static str>,
}

impl ApiError {
    /// A 400 `invalid_request_error`.
    pub(crate) fn invalid(message: impl Into<String>) -> ApiError {
        ApiError {
            status: StatusCode::BAD_REQUEST,
            class: ErrorClass::InvalidRequest,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// A 400 `invalid_request_error` naming OpenAI's `param`.
    pub(crate) fn invalid_param(message: impl Into<String>, param: impl Into<String>) -> ApiError {
        ApiError {
            param: Some(param.into()),
            ..ApiError::invalid(message)
        }
    }

    pub(crate) fn new(status: StatusCode, class: ErrorClass, message: impl Into<String>) -> Self {
        ApiError {
            status,
            class,
            message: message.into(),
            param: None,
            code: None,
        }
    }

    /// The error a scripted `fault` answers with, in the provider's usual words.
    pub(crate) fn fault(status: u16, provider: Provider) -> ApiError {
        let status = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let (class, message, code) = match (status.as_u16(), provider) {
            (400, _) => (
                ErrorClass::InvalidRequest,
                "Invalid request (mock fault).",
                None,
            ),
            (401, Provider::OpenAi) => (
                ErrorClass::Authentication,
                "Incorrect API key provided (mock fault).",
                Some("invalid_api_key"),
            ),
            (401, Provider::Anthropic) => (
                ErrorClass::Authentication,
                "invalid x-api-key (mock fault)",
                None,
            ),
            (403, _) => (
                ErrorClass::Permission,
                "Your API key does not have permission to use the specified resource (mock fault).",
                None,
            ),
            (404, _) => (
                ErrorClass::NotFound,
                "The requested resource could not be found (mock fault).",
                None,
            ),
            (413, _) => (
                ErrorClass::RequestTooLarge,
                "Request exceeds the maximum allowed number of bytes (mock fault).",
                None,
            ),
            (429, Provider::OpenAi) => (
                ErrorClass::RateLimit,
                "Rate limit reached for requests (mock fault). Please try again later.",
                Some("rate_limit_exceeded"),
            ),
            (429, Provider::Anthropic) => (
                ErrorClass::RateLimit,
                "Number of request tokens has exceeded your per-minute rate limit (mock fault)",
                None,
            ),
            (529, Provider::Anthropic) => (ErrorClass::Overloaded, "Overloaded", None),
            (503, Provider::OpenAi) | (529, Provider::OpenAi) => (
                ErrorClass::Overloaded,
                "The engine is currently overloaded, please try again later.",
                None,
            ),
            (_, Provider::OpenAi) => (
                ErrorClass::Api,
                "The server had an error while processing your request. Sorry about that!",
                None,
            ),
            (_, Provider::Anthropic) => (ErrorClass::Api, "Internal server error", None),
        };
        ApiError {
            status,
            class,
            message: message.to_owned(),
            param: None,
            code,
        }
    }

    /// The body in the provider's shape. `request_id` is Anthropic's `req_…`.
    pub(crate) fn body(&self, provider: Provider, request_id: &str) -> Value {
        match provider {
            Provider::OpenAi => json!({
                "error": {
                    "message": self.message,
                    "type": self.openai_type(),
                    "param": self.param,
                    "code": self.code,
                }
            }),
            Provider::Anthropic => json!({
                "type": "error",
                "error": { "type": self.anthropic_type(), "message": self.message },
                "request_id": request_id,
            }),
        }
    }

    /// The payload of a mid-stream error event (Anthropic's carries no request id).
    pub(crate) fn stream_body(&self, provider: Provider) -> Value {
        match provider {
            Provider::OpenAi => self.body(provider, ""),
            Provider::Anthropic => json!({
                "type": "error",
                "error": { "type": self.anthropic_type(), "message": self.message },
            }),
        }
    }

    fn openai_type(&self) -> &'static str {
        match self.class {
            ErrorClass::InvalidRequest
            | ErrorClass::Authentication
            | ErrorClass::Permission
            | ErrorClass::NotFound
            | ErrorClass::RequestTooLarge => "invalid_request_error",
            ErrorClass::RateLimit => "requests",
            ErrorClass::Api | ErrorClass::Overloaded => "server_error",
        }
    }

    fn anthropic_type(&self) -> &'static str {
        match self.class {
            ErrorClass::InvalidRequest => "invalid_request_error",
            ErrorClass::Authentication => "authentication_error",
            ErrorClass::Permission => "permission_error",
            ErrorClass::NotFound => "not_found_error",
            ErrorClass::RequestTooLarge => "request_too_large",
            ErrorClass::RateLimit => "rate_limit_error",
            ErrorClass::Api => "api_error",
            ErrorClass::Overloaded => "overloaded_error",
        }
    }
}

/// Which wire format a request speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Provider {
    OpenAi,
    Anthropic,
}

impl Provider {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Provider::OpenAi => "openai",
            Provider::Anthropic => "anthropic",
        }
    }
}
