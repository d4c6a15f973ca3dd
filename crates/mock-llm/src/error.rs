//! Errors as the providers spell them: one [`ApiError`], rendered in either wire shape.

use axum::http::StatusCode;
use serde_json::{Value, json};

use crate::limits::Exceeded;

/// The class of an error; each provider names it in its own way.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ErrorClass {
    InvalidRequest,
    Authentication,
    Permission,
    NotFound,
    RequestTooLarge,
    RateLimit,
    /// A rate limit on tokens (OpenAI names it `tokens`, not `requests`).
    TokenRateLimit,
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

    /// An `unavailable` trouble: by default OpenAI's 503 and Anthropic's 500 (a 503 is rare
    /// there), else `status` (500, 502, 503 or 504) for both.
    pub(crate) fn unavailable(status: Option<u16>, provider: Provider) -> ApiError {
        let status = status.unwrap_or(match provider {
            Provider::OpenAi => 503,
            Provider::Anthropic => 500,
        });
        let message = match (status, provider) {
            (500, Provider::OpenAi) => {
                "The server had an error while processing your request. Sorry about that!"
            }
            (502, Provider::OpenAi) => "Bad gateway.",
            (504, Provider::OpenAi) => "Gateway timeout.",
            (_, Provider::OpenAi) => "The server is overloaded or not ready yet.",
            (502, Provider::Anthropic) => "Bad gateway",
            (503, Provider::Anthropic) => "Service unavailable",
            (504, Provider::Anthropic) => "Gateway timeout",
            (_, Provider::Anthropic) => "Internal server error",
        };
        ApiError::new(
            StatusCode::from_u16(status).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
            ErrorClass::Api,
            message,
        )
    }

    /// An `overloaded` trouble: Anthropic's 529; OpenAI has no 529 and answers 503.
    pub(crate) fn overloaded(provider: Provider) -> ApiError {
        match provider {
            Provider::OpenAi => ApiError::unavailable(Some(503), provider),
            Provider::Anthropic => ApiError::new(
                StatusCode::from_u16(529).unwrap_or(StatusCode::SERVICE_UNAVAILABLE),
                ErrorClass::Overloaded,
                "Overloaded",
            ),
        }
    }

    /// A `rate_limited` trouble's 429: OpenAI reports the request limit of `model` as reached.
    pub(crate) fn trouble_rate_limited(
        provider: Provider,
        model: &str,
        requests_limit: u64,
        reset: &str,
    ) -> ApiError {
        let message = match provider {
            Provider::OpenAi => {
                let on = if model.is_empty() { "requests" } else { model };
                format!(
                    "Rate limit reached for {on} in organization org-mock on requests per min \
                     (RPM): Limit {requests_limit}, Used {requests_limit}, Requested 1. Please \
                     try again in {reset}. Visit https://platform.openai.com/account/rate-limits \
                     to learn more."
                )
            }
            Provider::Anthropic => "Number of request tokens has exceeded your per-minute rate \
                limit (https://docs.anthropic.com/en/api/rate-limits); see the response headers \
                for current usage. Please reduce the prompt length or the maximum tokens \
                requested, or try again later. You may also contact sales at \
                https://www.anthropic.com/contact-sales to discuss your options for a rate limit \
                increase."
                .to_owned(),
        };
        ApiError {
            code: (provider == Provider::OpenAi).then_some("rate_limit_exceeded"),
            ..ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                ErrorClass::RateLimit,
                message,
            )
        }
    }

    /// A call over a scripted limit of `model`. `tokens` is what the call asked for;
    /// `retry_in` is when it would fit (OpenAI says so in the message).
    pub(crate) fn over_limit(
        provider: Provider,
        model: &str,
        exceeded: Exceeded,
        tokens: u64,
        retry_in: Option<&str>,
    ) -> ApiError {
        let again = retry_in.map_or_else(String::new, |d| format!(" Please try again in {d}."));
        let (class, message) = match (provider, exceeded) {
            (Provider::OpenAi, Exceeded::Requests { limit }) => (
                ErrorClass::RateLimit,
                format!(
                    "Rate limit reached for {model} in organization org-mock on requests per min \
                     (RPM): Limit {limit}, Used {limit}, Requested 1.{again} Visit \
                     https://platform.openai.com/account/rate-limits to learn more."
                ),
            ),
            (Provider::OpenAi, Exceeded::Tokens { limit, used }) => (
                ErrorClass::TokenRateLimit,
                format!(
                    "Rate limit reached for {model} in organization org-mock on tokens per min \
                     (TPM): Limit {limit}, Used {used}, Requested {tokens}.{again} Visit \
                     https://platform.openai.com/account/rate-limits to learn more."
                ),
            ),
            (Provider::OpenAi, Exceeded::TooLarge { limit }) => (
                ErrorClass::TokenRateLimit,
                format!(
                    "Request too large for {model} in organization org-mock on tokens per min \
                     (TPM): Limit {limit}, Requested {tokens}. The input or output tokens must be \
                     reduced in order to run successfully. Visit \
                     https://platform.openai.com/account/rate-limits to learn more."
                ),
            ),
            (Provider::Anthropic, Exceeded::Requests { limit }) => (
                ErrorClass::RateLimit,
                format!(
                    "This request would exceed the rate limit for your organization of {limit} \
                     requests per minute (model: {model}). For details, refer to: \
                     https://docs.anthropic.com/en/api/rate-limits. You can see the response \
                     headers for current usage. Please try again later."
                ),
            ),
            (
                Provider::Anthropic,
                Exceeded::Tokens { limit, .. } | Exceeded::TooLarge { limit },
            ) => (
                ErrorClass::RateLimit,
                format!(
                    "This request would exceed the rate limit for your organization of {limit} \
                     input tokens per minute (model: {model}). For details, refer to: \
                     https://docs.anthropic.com/en/api/rate-limits. You can see the response \
                     headers for current usage. Please reduce the prompt length or try again \
                     later."
                ),
            ),
        };
        ApiError {
            code: (provider == Provider::OpenAi).then_some("rate_limit_exceeded"),
            ..ApiError::new(StatusCode::TOO_MANY_REQUESTS, class, message)
        }
    }

    /// A request over the model's `context_window` (`tokens` in it, `window` allowed).
    pub(crate) fn context_too_long(provider: Provider, window: u64, tokens: u64) -> ApiError {
        match provider {
            Provider::OpenAi => ApiError {
                code: Some("context_length_exceeded"),
                ..ApiError::invalid_param(
                    format!(
                        "This model's maximum context length is {window} tokens. However, your \
                         messages resulted in {tokens} tokens. Please reduce the length of the \
                         messages."
                    ),
                    "messages",
                )
            },
            Provider::Anthropic => ApiError::invalid(format!(
                "prompt is too long: {tokens} tokens > {window} maximum"
            )),
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
            ErrorClass::TokenRateLimit => "tokens",
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
            ErrorClass::RateLimit | ErrorClass::TokenRateLimit => "rate_limit_error",
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
