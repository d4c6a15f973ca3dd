//! A provider's bad day: an outage the test switches on and off at run time.
//!
//! A [`Trouble`] is validated while it is built (from JSON or with its builder methods), like a
//! script: a value that exists is one the mock can serve.

use std::collections::BTreeSet;
use std::fmt;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

/// What goes wrong. See the crate documentation for what each kind sends.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum TroubleKind {
    /// A 5xx outage: OpenAI 503 `server_error`, Anthropic 500 `api_error` (or `status`).
    Unavailable,
    /// Anthropic 529 `overloaded_error`; OpenAI, which has no 529, 503 `server_error`.
    Overloaded,
    /// 429 with each API's rate-limit body and headers (remaining 0).
    RateLimited,
    /// The connection is closed without any response.
    Reset,
    /// 200 and the start of the answer, then the connection closes.
    StreamCut,
}

impl TroubleKind {
    /// Whether the kind answers with an error status (so `retry_after_ms` has a place to go).
    fn has_status(self) -> bool {
        matches!(
            self,
            TroubleKind::Unavailable | TroubleKind::Overloaded | TroubleKind::RateLimited
        )
    }
}

/// The statuses an `unavailable` trouble may use instead of its default.
pub const UNAVAILABLE_STATUSES: [u16; 4] = [500, 502, 503, 504];

/// The longest `retry_after_ms` accepted: a day.
const MAX_RETRY_AFTER_MS: u64 = 24 * 60 * 60 * 1000;

/// An outage in front of every model call (or those for `models`), until it is ended or its
/// `for_ms` has passed. Serializes as the JSON `PUT /_mock/trouble` takes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "RawTrouble")]
pub struct Trouble {
    kind: TroubleKind,
    #[serde(skip_serializing_if = "Option::is_none")]
    status: Option<u16>,
    #[serde(skip_serializing_if = "Option::is_none")]
    models: Option<BTreeSet<String>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    for_ms: Option<u64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    retry_after_ms: Option<u64>,
}

#[derive(Clone, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawTrouble {
    kind: TroubleKind,
    #[serde(default)]
    status: Option<u16>,
    #[serde(default)]
    models: Option<Vec<String>>,
    #[serde(default)]
    for_ms: Option<u64>,
    #[serde(default)]
    retry_after_ms: Option<u64>,
}

impl TryFrom<RawTrouble> for Trouble {
    type Error = String;

    fn try_from(raw: RawTrouble) -> Result<Trouble, String> {
        check(raw).map_err(|(_, message)| message)
    }
}

/// Validates `raw`; the error names the offending field.
fn check(raw: RawTrouble) -> Result<Trouble, (&'static str, String)> {
    if let Some(status) = raw.status {
        if raw.kind != TroubleKind::Unavailable {
            return Err((
                "status",
                "`status` only applies to kind `unavailable`".to_owned(),
            ));
        }
        if !UNAVAILABLE_STATUSES.contains(&status) {
            return Err((
                "status",
                format!("status {status} is not one of {UNAVAILABLE_STATUSES:?}"),
            ));
        }
    }
    let models = match raw.models {
        None => None,
        Some(models) if models.is_empty() => {
            return Err((
                "models",
                "`models` must name at least one model (leave it out for every model)".to_owned(),
            ));
        }
        Some(models) => {
            if models.iter().any(String::is_empty) {
                return Err(("models", "a model name must not be empty".to_owned()));
            }
            Some(models.into_iter().collect())
        }
    };
    if raw.for_ms == Some(0) {
        return Err((
            "for_ms",
            "`for_ms` must be at least 1 (leave it out for a trouble that lasts until ended)"
                .to_owned(),
        ));
    }
    if let Some(ms) = raw.retry_after_ms {
        if !raw.kind.has_status() {
            return Err((
                "retry_after_ms",
                "`retry_after_ms` only applies to kinds `unavailable`, `overloaded` and \
                 `rate_limited`"
                    .to_owned(),
            ));
        }
        if ms > MAX_RETRY_AFTER_MS {
            return Err((
                "retry_after_ms",
                format!("`retry_after_ms` must be at most {MAX_RETRY_AFTER_MS} (a day)"),
            ));
        }
    }
    Ok(Trouble {
        kind: raw.kind,
        status: raw.status,
        models,
        for_ms: raw.for_ms,
        retry_after_ms: raw.retry_after_ms,
    })
}

impl Trouble {
    /// A trouble of `kind` for every model, until ended.
    pub fn new(kind: TroubleKind) -> Trouble {
        Trouble {
            kind,
            status: None,
            models: None,
            for_ms: None,
            retry_after_ms: None,
        }
    }

    /// Parses and validates the JSON `PUT /_mock/trouble` takes.
    pub fn from_json(json: &str) -> Result<Trouble, TroubleError> {
        Trouble::from_slice(json.as_bytes())
    }

    /// [`Trouble::from_json`] over bytes (which must be UTF-8 JSON).
    pub fn from_slice(json: &[u8]) -> Result<Trouble, TroubleError> {
        let value = serde_json::from_slice(json).map_err(|e| TroubleError {
            path: String::new(),
            message: e.to_string(),
        })?;
        Trouble::from_value(value)
    }

    /// Validates a trouble already parsed as JSON: an object with the fields above.
    pub fn from_value(value: Value) -> Result<Trouble, TroubleError> {
        // Serde would also take a struct as a list of its fields' values: refuse that.
        if !value.is_object() {
            return Err(TroubleError {
                path: String::new(),
                message: format!(
                    "a trouble must be a JSON object, not {}",
                    crate::json_kind(&value)
                ),
            });
        }
        let raw: RawTrouble =
            serde_path_to_error::deserialize(value).map_err(TroubleError::from_path_error)?;
        Trouble::checked(raw)
    }

    /// The same trouble with another HTTP status (`unavailable` only: 500, 502, 503 or 504).
    pub fn with_status(self, status: u16) -> Result<Trouble, TroubleError> {
        let mut raw = self.raw();
        raw.status = Some(status);
        Trouble::checked(raw)
    }

    /// Limited to calls for these models.
    pub fn for_models<I, S>(self, models: I) -> Result<Trouble, TroubleError>
    where
        I: IntoIterator<Item = S>,
        S: Into<String>,
    {
        let mut raw = self.raw();
        raw.models = Some(models.into_iter().map(Into::into).collect());
        Trouble::checked(raw)
    }

    /// Ends by itself `duration` (whole milliseconds, at least 1) after it is set.
    pub fn lasting(self, duration: Duration) -> Result<Trouble, TroubleError> {
        let mut raw = self.raw();
        raw.for_ms = Some(u64::try_from(duration.as_millis()).unwrap_or(u64::MAX));
        Trouble::checked(raw)
    }

    /// With `retry-after` / `retry-after-ms` headers (error kinds only, at most a day).
    pub fn with_retry_after(self, retry_after: Duration) -> Result<Trouble, TroubleError> {
        let mut raw = self.raw();
        raw.retry_after_ms = Some(u64::try_from(retry_after.as_millis()).unwrap_or(u64::MAX));
        Trouble::checked(raw)
    }

    /// What goes wrong.
    pub fn kind(&self) -> TroubleKind {
        self.kind
    }

    /// The status set for `unavailable`, if any.
    pub fn status(&self) -> Option<u16> {
        self.status
    }

    /// The models it applies to; `None`: every model.
    pub fn models(&self) -> Option<impl Iterator<Item = &str>> {
        self.models
            .as_ref()
            .map(|models| models.iter().map(String::as_str))
    }

    /// How long it lasts after it is set; `None`: until ended.
    pub fn for_duration(&self) -> Option<Duration> {
        self.for_ms.map(Duration::from_millis)
    }

    /// The `retry-after` it sends, if any.
    pub fn retry_after(&self) -> Option<Duration> {
        self.retry_after_ms.map(Duration::from_millis)
    }

    pub(crate) fn retry_after_ms(&self) -> Option<u64> {
        self.retry_after_ms
    }

    /// Whether a call for `model` is in trouble.
    pub(crate) fn applies_to(&self, model: &str) -> bool {
        self.models.as_ref().is_none_or(|m| m.contains(model))
    }

    fn raw(self) -> RawTrouble {
        RawTrouble {
            kind: self.kind,
            status: self.status,
            models: self.models.map(|m| m.into_iter().collect()),
            for_ms: self.for_ms,
            retry_after_ms: self.retry_after_ms,
        }
    }

    fn checked(raw: RawTrouble) -> Result<Trouble, TroubleError> {
        check(raw).map_err(|(path, message)| TroubleError {
            path: path.to_owned(),
            message,
        })
    }
}

/// Why a trouble was refused, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid mock-llm trouble at `{}`: {message}", if self.path.is_empty() { "(root)" } else { &self.path })]
pub struct TroubleError {
    path: String,
    message: String,
}

impl TroubleError {
    fn from_path_error(e: serde_path_to_error::Error<serde_json::Error>) -> TroubleError {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        TroubleError {
            path,
            message: e.into_inner().to_string(),
        }
    }

    /// The JSON path of the problem, e.g. `status` (empty for the document root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What is wrong there.
    pub fn message(&self) -> &str {
        &self.message
    }
}

impl fmt::Display for TroubleKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            TroubleKind::Unavailable => "unavailable",
            TroubleKind::Overloaded => "overloaded",
            TroubleKind::RateLimited => "rate_limited",
            TroubleKind::Reset => "reset",
            TroubleKind::StreamCut => "stream_cut",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> TroubleError {
        match Trouble::from_json(json) {
            Ok(t) => panic!("accepted: {t:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn parses_and_round_trips() {
        let json = r#"{"kind":"unavailable","status":502,"models":["b","a"],"for_ms":500,"retry_after_ms":1500}"#;
        let t = Trouble::from_json(json).expect("valid");
        assert_eq!(t.kind(), TroubleKind::Unavailable);
        assert_eq!(t.status(), Some(502));
        assert_eq!(
            t.models().map(Iterator::collect::<Vec<_>>),
            Some(vec!["a", "b"])
        );
        assert!(t.applies_to("a") && !t.applies_to("c"));
        let back = serde_json::to_value(&t).expect("serializes");
        assert_eq!(Trouble::from_value(back).expect("valid"), t);
        assert_eq!(
            serde_json::to_string(&Trouble::new(TroubleKind::Reset)).expect("serializes"),
            r#"{"kind":"reset"}"#
        );
    }

    #[test]
    fn refuses_what_cannot_be_served_with_its_path() {
        let cases = [
            (
                r#"{"kind":"unavailable","sttus":502}"#,
                "sttus",
                "unknown field",
            ),
            (r#"{"kind":"meltdown"}"#, "kind", "unknown variant"),
            (r#"{}"#, "", "missing field `kind`"),
            (
                r#"{"kind":"overloaded","status":500}"#,
                "status",
                "only applies",
            ),
            (
                r#"{"kind":"unavailable","status":418}"#,
                "status",
                "not one of",
            ),
            (
                r#"{"kind":"reset","models":[]}"#,
                "models",
                "at least one model",
            ),
            (
                r#"{"kind":"reset","models":[""]}"#,
                "models",
                "must not be empty",
            ),
            (r#"{"kind":"reset","for_ms":0}"#, "for_ms", "at least 1"),
            (
                r#"{"kind":"reset","retry_after_ms":5}"#,
                "retry_after_ms",
                "only applies",
            ),
            (
                r#"{"kind":"rate_limited","retry_after_ms":1e20}"#,
                "retry_after_ms",
                "invalid type",
            ),
            (
                r#"{"kind":"rate_limited","retry_after_ms":86400001}"#,
                "retry_after_ms",
                "at most",
            ),
            (r#"{"kind":"reset","for_ms":-1}"#, "for_ms", "invalid value"),
            (r#"null"#, "", "not null"),
            (r#"["reset"]"#, "", "not an array"),
            (r#"{"kind":"reset"} x"#, "", "trailing characters"),
        ];
        for (json, path, message) in cases {
            let e = err(json);
            assert_eq!(e.path(), path, "{json}: {e}");
            assert!(e.message().contains(message), "{json}: {e}");
        }
    }

    #[test]
    fn builders_validate_too() {
        let t = Trouble::new(TroubleKind::Unavailable)
            .with_status(504)
            .and_then(|t| t.for_models(["m"]))
            .and_then(|t| t.lasting(Duration::from_millis(250)))
            .and_then(|t| t.with_retry_after(Duration::from_secs(2)))
            .expect("valid");
        assert_eq!(t.for_duration(), Some(Duration::from_millis(250)));
        assert_eq!(t.retry_after(), Some(Duration::from_secs(2)));
        let e = Trouble::new(TroubleKind::StreamCut)
            .with_status(503)
            .expect_err("status on stream_cut");
        assert_eq!(e.path(), "status");
        let e = Trouble::new(TroubleKind::Reset)
            .lasting(Duration::from_micros(10))
            .expect_err("0 ms");
        assert_eq!(e.path(), "for_ms");
        let no_models: [&str; 0] = [];
        assert!(
            Trouble::new(TroubleKind::Reset)
                .for_models(no_models)
                .is_err()
        );
    }
}
