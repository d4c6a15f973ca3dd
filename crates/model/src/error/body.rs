//! The providers' error objects, as both APIs send them (in a response body, or inside a
//! stream), and how they read.

use serde::Deserialize;

/// `{"error": {...}}`: the error body of both providers (Anthropic adds `"type":"error"` around
/// it, OpenAI streams it as a `data:` chunk).
#[derive(Debug, Deserialize)]
pub(crate) struct ErrorEnvelope {
    #[serde(default)]
    pub error: Option<ErrorBody>,
}

/// The provider's error object: `type` and `message` in both APIs, `code` in OpenAI's.
#[derive(Debug, Clone, Default, Deserialize)]
pub(crate) struct ErrorBody {
    #[serde(default, rename = "type")]
    pub kind: Option<String>,
    #[serde(default)]
    pub message: Option<String>,
    #[serde(default)]
    pub code: Option<serde_json::Value>,
}

impl ErrorBody {
    pub(super) fn code_str(&self) -> Option<String> {
        match &self.code {
            Some(serde_json::Value::String(s)) => Some(s.clone()),
            Some(serde_json::Value::Number(n)) => Some(n.to_string()),
            _ => None,
        }
    }

    /// `type (code): message`, with whichever parts are present.
    pub(super) fn describe(&self) -> String {
        let mut out = String::new();
        if let Some(kind) = &self.kind {
            out.push_str(kind);
        }
        if let Some(code) = self.code_str().filter(|c| Some(c) != self.kind.as_ref()) {
            if out.is_empty() {
                out.push_str(&code);
            } else {
                out.push_str(&format!(" ({code})"));
            }
        }
        let message = self.message.as_deref().unwrap_or("").trim();
        match (out.is_empty(), message.is_empty()) {
            (true, true) => "unknown error".to_owned(),
            (true, false) => truncate(message, 2000).to_owned(),
            (false, true) => out,
            (false, false) => format!("{out}: {}", truncate(message, 2000)),
        }
    }

    /// A type or code that says the request itself is wrong (retrying it is pointless).
    pub(super) fn is_request_problem(&self) -> bool {
        const FATAL: &[&str] = &[
            "invalid_request_error",
            "authentication_error",
            "permission_error",
            "not_found_error",
            "request_too_large",
            "invalid_api_key",
            "model_not_found",
            "context_length_exceeded",
        ];
        [self.kind.clone(), self.code_str()]
            .iter()
            .flatten()
            .any(|t| FATAL.contains(&t.as_str()))
    }
}

pub(super) fn truncate(s: &str, max: usize) -> &str {
    if s.len() <= max {
        return s;
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    &s[..end]
}
