//! The script format: what each model answers, and which faults it injects.
//!
//! Every type here validates itself while it is deserialized (`#[serde(try_from)]` over a raw
//! twin with `deny_unknown_fields`), so a [`Scripts`] value that exists is a valid script, however
//! it was built, and [`serde_path_to_error`] names the JSON path of the first problem.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde_json::Value;

/// A validated script: for each model name, the answers the mock gives.
///
/// Build one with [`Scripts::from_json`] or [`Scripts::from_value`]; the format is described in
/// the crate documentation.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Scripts {
    #[serde(default)]
    models: BTreeMap<String, ModelScript>,
}

impl Scripts {
    /// Parses and validates a script; the error names the JSON path of the first problem.
    pub fn from_json(json: &str) -> Result<Scripts, ScriptError> {
        let mut de = serde_json::Deserializer::from_str(json);
        let scripts: Scripts =
            serde_path_to_error::deserialize(&mut de).map_err(ScriptError::from_path_error)?;
        de.end().map_err(|e| ScriptError {
            path: String::new(),
            message: e.to_string(),
        })?;
        Ok(scripts)
    }

    /// Validates a script already parsed as JSON (e.g. built with `serde_json::json!`).
    pub fn from_value(value: Value) -> Result<Scripts, ScriptError> {
        serde_path_to_error::deserialize(value).map_err(ScriptError::from_path_error)
    }

    /// The scripted model names, in order.
    pub fn models(&self) -> impl Iterator<Item = &str> {
        self.models.keys().map(String::as_str)
    }

    pub(crate) fn model(&self, name: &str) -> Option<&ModelScript> {
        self.models.get(name)
    }
}

/// Why a script was refused, and where.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid mock-llm script at `{}`: {message}", self.display_path())]
pub struct ScriptError {
    path: String,
    message: String,
}

impl ScriptError {
    fn from_path_error(e: serde_path_to_error::Error<serde_json::Error>) -> ScriptError {
        let path = e.path().to_string();
        let path = if path == "." { String::new() } else { path };
        ScriptError {
            path,
            message: e.into_inner().to_string(),
        }
    }

    /// The JSON path of the problem, e.g. `models.mock-demo.steps[1].tool_calls[0].name`
    /// (empty for the document root).
    pub fn path(&self) -> &str {
        &self.path
    }

    /// What is wrong there.
    pub fn message(&self) -> &str {
        &self.message
    }

    fn display_path(&self) -> &str {
        if self.path.is_empty() {
            "(root)"
        } else {
            &self.path
        }
    }
}

/// One model's script.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub(crate) struct ModelScript {
    #[serde(default)]
    pub(crate) steps: Vec<Response>,
    #[serde(default)]
    pub(crate) rules: Vec<Rule>,
    #[serde(default)]
    pub(crate) default: Option<Response>,
    /// Per-minute request and input-token limits, over a sliding 60 s window.
    #[serde(default)]
    pub(crate) limits: Option<Limits>,
    /// The most input tokens a request may carry (the crate's estimate), else a 400.
    #[serde(default, deserialize_with = "context_window")]
    pub(crate) context_window: Option<u64>,
}

fn context_window<'de, D: serde::Deserializer<'de>>(de: D) -> Result<Option<u64>, D::Error> {
    match u64::deserialize(de)? {
        0 => Err(serde::de::Error::custom(
            "`context_window` must be at least 1 token",
        )),
        n => Ok(Some(n)),
    }
}

/// A model's rate limits: calls and input tokens per minute.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(try_from = "RawLimits")]
pub(crate) struct Limits {
    pub(crate) requests_per_minute: Option<u64>,
    pub(crate) tokens_per_minute: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLimits {
    #[serde(default)]
    requests_per_minute: Option<u64>,
    #[serde(default)]
    tokens_per_minute: Option<u64>,
}

impl TryFrom<RawLimits> for Limits {
    type Error = String;

    fn try_from(raw: RawLimits) -> Result<Limits, String> {
        if raw.requests_per_minute.is_none() && raw.tokens_per_minute.is_none() {
            return Err(
                "`limits` needs `requests_per_minute` and/or `tokens_per_minute` (leave it out \
                 for no limit)"
                    .into(),
            );
        }
        if raw.requests_per_minute == Some(0) || raw.tokens_per_minute == Some(0) {
            return Err(
                "a limit must be at least 1 (to refuse every call, use the trouble endpoint)"
                    .into(),
            );
        }
        Ok(Limits {
            requests_per_minute: raw.requests_per_minute,
            tokens_per_minute: raw.tokens_per_minute,
        })
    }
}

/// Which entry of a model's script answered: faults are counted per (model, entry).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Entry {
    Rule(usize),
    Step(usize),
    Default,
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Entry::Rule(i) => write!(f, "rules[{i}]"),
            Entry::Step(i) => write!(f, "steps[{i}]"),
            Entry::Default => f.write_str("default"),
        }
    }
}

/// What the request looks like, as far as choosing an answer goes.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Cue {
    /// Assistant turns already in the conversation (a final Anthropic prefill excluded).
    pub(crate) assistant_turns: usize,
    /// The text of the last message, when it is a user message with text.
    pub(crate) last_user_text: Option<String>,
    /// The tool results the last message carries (OpenAI: the trailing run of tool messages).
    pub(crate) last_tool_results: Vec<String>,
}

impl ModelScript {
    /// Rules first (in order), then the step numbered by the assistant turns, then `default`.
    /// `None` means the built-in default (a plain "ok").
    pub(crate) fn choose(&self, cue: &Cue) -> (Entry, Option<&Response>) {
        if let Some((i, rule)) = self.rules.iter().enumerate().find(|(_, r)| r.matches(cue)) {
            return (Entry::Rule(i), Some(&rule.respond));
        }
        match self.steps.get(cue.assistant_turns) {
            Some(step) => (Entry::Step(cue.assistant_turns), Some(step)),
            None => (Entry::Default, self.default.as_ref()),
        }
    }
}

/// A rule: answer `respond` when every given condition holds for the last message.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawRule")]
pub(crate) struct Rule {
    when_last_user_contains: Option<String>,
    when_last_tool_result_contains: Option<String>,
    respond: Response,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawRule {
    #[serde(default)]
    when_last_user_contains: Option<String>,
    #[serde(default)]
    when_last_tool_result_contains: Option<String>,
    respond: Response,
}

impl TryFrom<RawRule> for Rule {
    type Error = String;

    fn try_from(raw: RawRule) -> Result<Rule, String> {
        if raw.when_last_user_contains.is_none() && raw.when_last_tool_result_contains.is_none() {
            return Err(
                "a rule needs `when_last_user_contains` or `when_last_tool_result_contains`".into(),
            );
        }
        if raw.when_last_user_contains.as_deref() == Some("")
            || raw.when_last_tool_result_contains.as_deref() == Some("")
        {
            return Err("a rule's condition must not be empty (it would match everything)".into());
        }
        Ok(Rule {
            when_last_user_contains: raw.when_last_user_contains,
            when_last_tool_result_contains: raw.when_last_tool_result_contains,
            respond: raw.respond,
        })
    }
}

impl Rule {
    fn matches(&self, cue: &Cue) -> bool {
        let user_ok = self
            .when_last_user_contains
            .as_deref()
            .is_none_or(|needle| {
                cue.last_user_text
                    .as_deref()
                    .is_some_and(|text| text.contains(needle))
            });
        let tool_ok = self
            .when_last_tool_result_contains
            .as_deref()
            .is_none_or(|needle| cue.last_tool_results.iter().any(|r| r.contains(needle)));
        user_ok && tool_ok
    }
}

/// One scripted answer, with its optional faults.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawResponse")]
pub(crate) struct Response {
    pub(crate) text: Option<String>,
    pub(crate) tool_calls: Vec<ToolCallScript>,
    pub(crate) delay_ms: u64,
    pub(crate) chunk_delay_ms: u64,
    pub(crate) fault: Option<Fault>,
    pub(crate) hang: bool,
    pub(crate) drop_after_chunks: Option<usize>,
    pub(crate) stream_error: bool,
    pub(crate) fail_times: Option<u64>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawResponse {
    #[serde(default)]
    text: Option<String>,
    #[serde(default)]
    tool_calls: Vec<ToolCallScript>,
    #[serde(default)]
    delay_ms: u64,
    #[serde(default)]
    chunk_delay_ms: u64,
    #[serde(default)]
    fault: Option<Fault>,
    #[serde(default)]
    hang: bool,
    #[serde(default)]
    drop_after_chunks: Option<usize>,
    #[serde(default)]
    stream_error: bool,
    #[serde(default)]
    fail_times: Option<u64>,
}

impl TryFrom<RawResponse> for Response {
    type Error = String;

    fn try_from(raw: RawResponse) -> Result<Response, String> {
        match raw.text.as_deref() {
            Some(t) if t.trim().is_empty() => {
                return Err(
                    "`text` must contain non-whitespace text (the real APIs refuse \
                            empty text blocks when the conversation is sent back)"
                        .into(),
                );
            }
            None if raw.tool_calls.is_empty() => {
                return Err("a response needs `text` or `tool_calls`".into());
            }
            _ => {}
        }
        if raw.fail_times == Some(0) {
            return Err("`fail_times` must be at least 1 (leave it out for every call)".into());
        }
        Ok(Response {
            text: raw.text,
            tool_calls: raw.tool_calls,
            delay_ms: raw.delay_ms,
            chunk_delay_ms: raw.chunk_delay_ms,
            fault: raw.fault,
            hang: raw.hang,
            drop_after_chunks: raw.drop_after_chunks,
            stream_error: raw.stream_error,
            fail_times: raw.fail_times,
        })
    }
}

impl Response {
    /// The built-in answer past the end of the steps when the model has no `default`.
    pub(crate) fn plain_ok() -> Response {
        Response {
            text: Some("ok".to_owned()),
            tool_calls: Vec::new(),
            delay_ms: 0,
            chunk_delay_ms: 0,
            fault: None,
            hang: false,
            drop_after_chunks: None,
            stream_error: false,
            fail_times: None,
        }
    }

    /// The `fault` to answer with on the `hit`-th call (1-based) reaching this entry, if any.
    pub(crate) fn fault_for(&self, hit: u64) -> Option<&Fault> {
        self.fault.as_ref().filter(|f| hit <= f.times)
    }

    /// Whether `hang`, `drop_after_chunks` and `stream_error` apply on the `hit`-th call.
    pub(crate) fn failures_apply(&self, hit: u64) -> bool {
        self.fail_times.is_none_or(|k| hit <= k)
    }
}

/// A scripted tool call: the mock generates its id.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawToolCall")]
pub(crate) struct ToolCallScript {
    pub(crate) name: String,
    pub(crate) arguments: serde_json::Map<String, Value>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawToolCall {
    name: String,
    #[serde(default)]
    arguments: Option<Value>,
}

impl TryFrom<RawToolCall> for ToolCallScript {
    type Error = String;

    fn try_from(raw: RawToolCall) -> Result<ToolCallScript, String> {
        if !valid_tool_name(&raw.name) {
            return Err(format!(
                "tool name {:?} must match ^[a-zA-Z0-9_-]{{1,64}}$ (both APIs refuse others)",
                raw.name
            ));
        }
        let arguments = match raw.arguments {
            None => serde_json::Map::new(),
            Some(Value::Object(map)) => map,
            Some(other) => {
                return Err(format!(
                    "`arguments` must be a JSON object, not {}",
                    crate::json_kind(&other)
                ));
            }
        };
        Ok(ToolCallScript {
            name: raw.name,
            arguments,
        })
    }
}

/// The HTTP statuses a script may inject.
pub(crate) const FAULT_STATUSES: [u16; 9] = [400, 401, 403, 404, 413, 429, 500, 503, 529];

/// An error answer for the first `times` calls reaching the entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(try_from = "RawFault")]
pub(crate) struct Fault {
    pub(crate) status: u16,
    pub(crate) retry_after_ms: Option<u64>,
    pub(crate) times: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFault {
    status: u16,
    #[serde(default)]
    retry_after_ms: Option<u64>,
    #[serde(default)]
    times: Option<u64>,
}

impl TryFrom<RawFault> for Fault {
    type Error = String;

    fn try_from(raw: RawFault) -> Result<Fault, String> {
        if !FAULT_STATUSES.contains(&raw.status) {
            return Err(format!(
                "fault status {} is not one of {:?}",
                raw.status, FAULT_STATUSES
            ));
        }
        let times = raw.times.unwrap_or(1);
        if times == 0 {
            return Err("`times` must be at least 1".into());
        }
        Ok(Fault {
            status: raw.status,
            retry_after_ms: raw.retry_after_ms,
            times,
        })
    }
}

/// `^[a-zA-Z0-9_-]{1,64}$`: the function/tool names both APIs accept.
pub(crate) fn valid_tool_name(name: &str) -> bool {
    (1..=64).contains(&name.len())
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

#[cfg(test)]
mod tests {
    use super::*;

    fn err(json: &str) -> ScriptError {
        match Scripts::from_json(json) {
            Ok(s) => panic!("accepted: {s:?}"),
            Err(e) => e,
        }
    }

    #[test]
    fn the_brief_example_parses() {
        let s = Scripts::from_json(
            r#"{ "models": { "mock-demo": {
                "steps": [
                  {"tool_calls": [{"name": "list_files", "arguments": {}}, {"name": "read_file", "arguments": {"path": "notes.txt"}}]},
                  {"text": "Let me ask.", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Proceed?"}}]},
                  {"text": "All done."}
                ],
                "rules": [ {"when_last_user_contains": "tides", "respond": {"text": "High tide at noon."}} ],
                "default": {"text": "ok"}
            } } }"#,
        )
        .expect("valid");
        assert_eq!(s.models().collect::<Vec<_>>(), ["mock-demo"]);
        let m = s.model("mock-demo").expect("model");
        assert_eq!(m.steps.len(), 3);
        assert_eq!(m.steps[0].tool_calls[1].name, "read_file");
    }

    #[test]
    fn unknown_fields_are_refused_with_their_path() {
        let e = err(r#"{"models":{"m":{"steps":[{"text":"a"},{"txt":"b"}]}}}"#);
        assert_eq!(e.path(), "models.m.steps[1].txt", "{e}");
        assert!(e.message().contains("unknown field `txt`"), "{e}");
        let e = err(r#"{"models":{"m":{"stepz":[]}}}"#);
        assert!(e.message().contains("unknown field `stepz`"), "{e}");
        let e = err(r#"{"modelz":{}}"#);
        assert!(e.message().contains("unknown field `modelz`"), "{e}");
    }

    #[test]
    fn invalid_tool_names_are_refused_with_their_path() {
        let e = err(
            r#"{"models":{"m":{"steps":[{"tool_calls":[{"name":"ok"},{"name":"read file"}]}]}}}"#,
        );
        assert_eq!(e.path(), "models.m.steps[0].tool_calls[1]", "{e}");
        assert!(e.message().contains("read file"), "{e}");
        let long = "a".repeat(65);
        let e = err(&format!(
            r#"{{"models":{{"m":{{"default":{{"tool_calls":[{{"name":"{long}"}}]}}}}}}}}"#
        ));
        assert_eq!(e.path(), "models.m.default.tool_calls[0]", "{e}");
    }

    #[test]
    fn arguments_must_be_an_object() {
        let e =
            err(r#"{"models":{"m":{"steps":[{"tool_calls":[{"name":"x","arguments":"{}"}]}]}}}"#);
        assert_eq!(e.path(), "models.m.steps[0].tool_calls[0]", "{e}");
        assert!(e.message().contains("a string"), "{e}");
    }

    #[test]
    fn responses_need_output_and_faults_a_known_status() {
        let e = err(r#"{"models":{"m":{"steps":[{"delay_ms":5}]}}}"#);
        assert!(e.message().contains("needs `text` or `tool_calls`"), "{e}");
        let e = err(r#"{"models":{"m":{"steps":[{"text":"  "}]}}}"#);
        assert!(e.message().contains("non-whitespace"), "{e}");
        let e = err(r#"{"models":{"m":{"steps":[{"text":"a","fault":{"status":418}}]}}}"#);
        assert_eq!(e.path(), "models.m.steps[0].fault", "{e}");
        let e =
            err(r#"{"models":{"m":{"steps":[{"text":"a","fault":{"status":429,"times":0}}]}}}"#);
        assert!(e.message().contains("at least 1"), "{e}");
        let e = err(r#"{"models":{"m":{"rules":[{"respond":{"text":"a"}}]}}}"#);
        assert_eq!(e.path(), "models.m.rules[0]", "{e}");
    }

    #[test]
    fn limits_and_context_window_are_checked() {
        let s = Scripts::from_json(
            r#"{"models":{"m":{"limits":{"requests_per_minute":2},"context_window":100}}}"#,
        )
        .expect("valid");
        let m = s.model("m").expect("model");
        assert_eq!(m.context_window, Some(100));
        assert_eq!(
            m.limits,
            Some(Limits {
                requests_per_minute: Some(2),
                tokens_per_minute: None
            })
        );
        let e = err(r#"{"models":{"m":{"limits":{}}}}"#);
        assert_eq!(e.path(), "models.m.limits", "{e}");
        let e = err(r#"{"models":{"m":{"limits":{"tokens_per_minute":0}}}}"#);
        assert!(e.message().contains("at least 1"), "{e}");
        let e = err(r#"{"models":{"m":{"limits":{"requests_per_min":5}}}}"#);
        assert_eq!(e.path(), "models.m.limits.requests_per_min", "{e}");
        let e = err(r#"{"models":{"m":{"context_window":0}}}"#);
        assert_eq!(e.path(), "models.m.context_window", "{e}");
        let e = err(r#"{"models":{"m":{"context_window":-5}}}"#);
        assert_eq!(e.path(), "models.m.context_window", "{e}");
    }

    #[test]
    fn trailing_garbage_and_bad_json_are_refused() {
        assert!(Scripts::from_json(r#"{"models":{}} x"#).is_err());
        assert!(Scripts::from_json(r#"{"models":"#).is_err());
    }

    #[test]
    fn choice_rules_then_steps_then_default() {
        let s = Scripts::from_json(
            r#"{"models":{"m":{
                "steps":[{"text":"s0"},{"text":"s1"}],
                "rules":[{"when_last_user_contains":"tides","respond":{"text":"r0"}},
                         {"when_last_tool_result_contains":"ERROR","respond":{"text":"r1"}}],
                "default":{"text":"d"}}}}"#,
        )
        .expect("valid");
        let m = s.model("m").expect("model");
        let text = |cue: &Cue| {
            let (entry, r) = m.choose(cue);
            (entry, r.and_then(|r| r.text.clone()))
        };
        let mut cue = Cue::default();
        assert_eq!(text(&cue), (Entry::Step(0), Some("s0".into())));
        cue.assistant_turns = 1;
        assert_eq!(text(&cue), (Entry::Step(1), Some("s1".into())));
        cue.assistant_turns = 7;
        assert_eq!(text(&cue), (Entry::Default, Some("d".into())));
        cue.last_user_text = Some("when are the tides?".into());
        assert_eq!(text(&cue), (Entry::Rule(0), Some("r0".into())));
        cue.last_user_text = None;
        cue.last_tool_results = vec!["fine".into(), "ERROR: no such file".into()];
        assert_eq!(text(&cue), (Entry::Rule(1), Some("r1".into())));
    }
}
