//! The tool contract: which tools a run's model may call, and with what arguments.
//!
//! The agent definition is the contract. A run's frozen agent revision declares its tools, each
//! with the JSON Schema of its arguments; [`Contract`] is that list with the schemas compiled.
//! [`Contract::check`] is the verdict on one tool call the model made: a call to a tool the
//! revision does not declare is refused ("not offered"), and so is a call whose arguments do not
//! match the tool's schema (the refusal names the JSON path of each mismatch). A refused call is
//! never dispatched; the model gets the refusal as the call's error result.
//!
//! Kedge supplies the schemas of its built-in tools ([`BUILTINS`]): an agent that lists a
//! built-in by name (a bare `"read_file"`, or an entry without `parameters`) gets Kedge's schema
//! and description, which match what the tool service accepts. The schema is written into the
//! stored revision, so a run keeps the schema its revision was stored with.
//!
//! Invariants: the verdict is a pure function of the call and the revision's tools (no clock, no
//! I/O), so the same journal and revision always give the same verdict; a schema that does not
//! compile refuses every call of its tool rather than letting them through.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::agent::{AgentDefinition, OnInvalidOutput, ToolPolicy, ToolSpec};
use crate::event::{Digest, OutputValidation, ToolCall};

/// A tool Kedge implements itself, with the schema of its arguments.
#[derive(Debug, Clone, Copy)]
pub struct Builtin {
    pub name: &'static str,
    pub description: &'static str,
    /// Running it twice has the effect of running it once (the tool service's
    /// `Builtin::idempotent` says the same; a test there checks it): a timed-out attempt may be
    /// retried.
    pub idempotent: bool,
    schema: fn() -> Value,
}

impl Builtin {
    /// The JSON Schema of the tool's arguments.
    pub fn parameters(&self) -> Value {
        (self.schema)()
    }

    /// The tool as an agent definition lists it.
    pub fn spec(&self) -> ToolSpec {
        ToolSpec {
            name: self.name.to_owned(),
            description: self.description.to_owned(),
            parameters: self.parameters(),
        }
    }
}

fn path_property(what: &str) -> Value {
    json!({"type": "string", "minLength": 1,
           "description": format!("{what}, relative to the run's workspace (no `..`, not absolute)")})
}

/// Every built-in tool, in the order the docs list them.
pub const BUILTINS: &[Builtin] = &[
    Builtin {
        name: "read_file",
        description: "Read a text file of the run's workspace.",
        idempotent: true,
        schema: || {
            json!({"type": "object",
                   "properties": {"path": path_property("The file to read")},
                   "required": ["path"], "additionalProperties": false})
        },
    },
    Builtin {
        name: "write_file",
        description: "Write (create or replace) a text file in the run's workspace.",
        idempotent: true,
        schema: || {
            json!({"type": "object",
                   "properties": {"path": path_property("The file to write"),
                                  "content": {"type": "string", "description": "The whole new content of the file"}},
                   "required": ["path", "content"], "additionalProperties": false})
        },
    },
    Builtin {
        name: "list_files",
        description: "List a directory of the run's workspace (directories end with `/`).",
        idempotent: true,
        schema: || {
            json!({"type": "object",
                   "properties": {"path": {"type": "string",
                                           "description": "The directory to list, relative to the run's workspace (default: its root)"}},
                   "additionalProperties": false})
        },
    },
    Builtin {
        name: "shell",
        description: "Run one allowlisted command (no shell) in the run's workspace.",
        idempotent: false,
        schema: || {
            json!({"type": "object",
                   "properties": {"command": {"type": "string", "minLength": 1,
                                              "description": "The program to run; must be on the operator's allowlist"},
                                  "args": {"type": "array", "items": {"type": "string"},
                                           "description": "Its arguments (no absolute paths, no `..`)"}},
                   "required": ["command"], "additionalProperties": false})
        },
    },
    Builtin {
        name: "ledger_append",
        description: "Append one line to the ledger (a counted side effect).",
        idempotent: false,
        schema: || {
            json!({"type": "object",
                   "properties": {"text": {"type": "string", "description": "The line to append"}},
                   "required": ["text"], "additionalProperties": false})
        },
    },
    Builtin {
        name: "ask_user",
        description: "Ask the user a question and wait for the answer.",
        idempotent: false,
        schema: || {
            json!({"type": "object",
                   "properties": {"question": {"type": "string", "minLength": 1, "description": "The question"},
                                  "timeout_seconds": {"type": "number", "minimum": 0,
                                                      "description": "Close the question unanswered after this long"}},
                   "required": ["question"], "additionalProperties": false})
        },
    },
    Builtin {
        name: "wait",
        description: "Wait a number of seconds (at most seven days) before continuing.",
        idempotent: false,
        schema: || {
            json!({"type": "object",
                   "properties": {"seconds": {"type": "number", "minimum": 0,
                                              "description": "How long to wait (longer than seven days is cut to seven days)"}},
                   "required": ["seconds"], "additionalProperties": false})
        },
    },
    Builtin {
        name: "await_callback",
        description: "Wait for an external callback; its payload is the result.",
        idempotent: false,
        schema: || {
            json!({"type": "object",
                   "properties": {"timeout_seconds": {"type": "number", "minimum": 0,
                                                      "description": "Give up after this long (default one day, at most seven days)"}},
                   "additionalProperties": false})
        },
    },
];

/// The built-in tool named `name`, if there is one.
pub fn builtin(name: &str) -> Option<&'static Builtin> {
    BUILTINS.iter().find(|b| b.name == name)
}

/// Longest text of one schema error shown to the model.
const MAX_ERROR_CHARS: usize = 300;
/// Schema errors listed in one refusal.
const MAX_ERRORS: usize = 5;

/// One place where arguments do not match a schema.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArgumentError {
    /// JSON Pointer into the arguments (`/path`, `/args/0`); empty for the arguments as a whole.
    pub path: String,
    pub message: String,
}

impl fmt::Display for ArgumentError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.path.is_empty() {
            write!(f, "at (root): {}", self.message)
        } else {
            write!(f, "at {}: {}", self.path, self.message)
        }
    }
}

/// Why a tool call is not run. Its display is the error result the model reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The run's agent revision does not declare the tool.
    NotOffered { tool: String, offered: Vec<String> },
    /// The arguments do not match the tool's schema.
    InvalidArguments {
        tool: String,
        errors: Vec<ArgumentError>,
    },
    /// The tool's schema does not compile (a revision stored before schemas were checked).
    BrokenSchema { tool: String, reason: String },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::NotOffered { tool, offered } => {
                write!(
                    f,
                    "not run: tool not offered: `{tool}` is not a tool of this agent"
                )?;
                if offered.is_empty() {
                    write!(f, " (it has none)")
                } else {
                    write!(f, "; its tools are {}", offered.join(", "))
                }
            }
            Refusal::InvalidArguments { tool, errors } => {
                write!(
                    f,
                    "not run: invalid arguments for `{tool}` (they must match its JSON Schema): "
                )?;
                for (i, e) in errors.iter().enumerate() {
                    if i > 0 {
                        f.write_str("; ")?;
                    }
                    write!(f, "{e}")?;
                }
                Ok(())
            }
            Refusal::BrokenSchema { tool, reason } => {
                write!(f, "not run: the schema of `{tool}` is not usable: {reason}")
            }
        }
    }
}

/// A declared tool with its compiled schema.
struct Offered {
    validator: Result<jsonschema::Validator, String>,
}

/// What a run's agent revision lets the model call: its tools (schemas compiled) and its policy.
///
/// `Contract::default()` declares no list at all: every tool is offered with the default policy
/// and arguments are not checked. It exists for tests and benches that script a model without an
/// agent; the step service always uses [`Contract::of`] the run's revision.
#[derive(Default)]
pub struct Contract {
    tools: Option<BTreeMap<String, Offered>>,
    policy: BTreeMap<String, ToolPolicy>,
    /// The revision's `output_schema`, compiled, if it declares one.
    output: Option<Offered>,
    on_invalid_output: OnInvalidOutput,
    /// With [`OnInvalidOutput::Retry`]: retries per turn before the run fails.
    output_retries: u32,
    /// The run ends the agent compensates (`on_cancel`, `on_failure`).
    compensate_on: Vec<crate::event::StopCause>,
}

impl fmt::Debug for Contract {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Contract")
            .field(
                "tools",
                &self.tools.as_ref().map(|t| t.keys().collect::<Vec<_>>()),
            )
            .field("policy", &self.policy)
            .field("output_schema", &self.output.is_some())
            .field("on_invalid_output", &self.on_invalid_output)
            .field("output_retries", &self.output_retries)
            .finish()
    }
}

/// Contracts of the definitions seen lately, by the digest of their tools and policy (compiling
/// a schema costs far more than a digest); cleared when it grows past this many.
const CACHED_CONTRACTS: usize = 256;

fn cache() -> &'static Mutex<HashMap<Digest, Arc<Contract>>> {
    static CACHE: OnceLock<Mutex<HashMap<Digest, Arc<Contract>>>> = OnceLock::new();
    CACHE.get_or_init(Mutex::default)
}

impl Contract {
    /// The contract of an agent revision, compiled once per tools and policy and then shared.
    pub fn of(def: &AgentDefinition) -> Arc<Contract> {
        let key = Digest::of(&(
            &def.tools,
            &def.policy,
            &def.output_schema,
            def.on_invalid_output,
            def.output_retries(),
            def.on_cancel,
            def.on_failure,
        ));
        if let Ok(cache) = cache().lock()
            && let Some(c) = cache.get(&key)
        {
            return c.clone();
        }
        let contract = Arc::new(
            Contract::new(&def.tools, &def.policy)
                .with_output(def.output_schema.as_ref(), def.on_invalid_output)
                .with_output_retries(def.output_retries())
                .with_compensation(def.on_cancel, def.on_failure),
        );
        if let Ok(mut cache) = cache().lock() {
            if cache.len() >= CACHED_CONTRACTS {
                cache.clear();
            }
            cache.insert(key, contract.clone());
        }
        contract
    }

    /// The contract of these tools and policy, compiled now.
    pub fn new(tools: &[ToolSpec], policy: &BTreeMap<String, ToolPolicy>) -> Contract {
        let tools = tools
            .iter()
            .map(|t| {
                let sensitive = policy.get(&t.name).map_or(&[][..], |p| &p.sensitive[..]);
                let schema = without_sensitive(&t.parameters, sensitive);
                let validator = jsonschema::validator_for(&schema).map_err(|e| e.to_string());
                (t.name.clone(), Offered { validator })
            })
            .collect();
        Contract {
            tools: Some(tools),
            policy: policy.clone(),
            output: None,
            on_invalid_output: OnInvalidOutput::default(),
            output_retries: 0,
            compensate_on: Vec::new(),
        }
    }

    /// This contract with the agent's compensation choices (`on_cancel`, `on_failure`).
    pub fn with_compensation(
        mut self,
        on_cancel: crate::agent::OnEnd,
        on_failure: crate::agent::OnEnd,
    ) -> Contract {
        use crate::agent::OnEnd;
        use crate::event::StopCause;
        self.compensate_on = [
            (on_cancel, StopCause::Cancel),
            (on_failure, StopCause::Failure),
        ]
        .into_iter()
        .filter(|(on, _)| *on == OnEnd::Compensate)
        .map(|(_, cause)| cause)
        .collect();
        self
    }

    /// What a request of `tool` journals about its reversibility
    /// (`ToolRequested::reversibility`): the level its policy declares, a compensable tool's
    /// compensation with the compensating tool's own policy, and the run ends the agent
    /// compensates. `None` when the policy declares nothing (so requests of agents that do not
    /// use compensation are what they always were).
    pub fn reversibility(&self, tool: &str) -> Option<crate::event::Reversibility> {
        let p = self.policy.get(tool)?;
        let level = p.reversibility?;
        let compensate = p.compensate.as_ref().map(|c| {
            let cp = self.policy(&c.tool);
            crate::event::CompensateSpec {
                tool: c.tool.clone(),
                arguments: c
                    .arguments
                    .clone()
                    .unwrap_or_else(|| Value::String("${arguments}".into())),
                timeout_secs: cp.timeout_secs,
                network: cp.network,
                retry: cp.retry.clone(),
                max_output_bytes: cp.max_output_bytes,
            }
        });
        Some(crate::event::Reversibility {
            level,
            compensate_on: if compensate.is_some() {
                self.compensate_on.clone()
            } else {
                Vec::new()
            },
            compensate,
        })
    }

    /// This contract with the final answer checked against `schema` (none: not checked).
    pub fn with_output(mut self, schema: Option<&Value>, on_invalid: OnInvalidOutput) -> Contract {
        self.output = schema.map(|s| Offered {
            validator: jsonschema::validator_for(s).map_err(|e| e.to_string()),
        });
        self.on_invalid_output = on_invalid;
        self
    }

    /// This contract with `n` retries of an invalid answer per turn (under
    /// [`OnInvalidOutput::Retry`]; the agent's `output_retries`).
    pub fn with_output_retries(mut self, n: u32) -> Contract {
        self.output_retries = n;
        self
    }

    /// What an answer that does not match the output schema means for the run.
    pub fn on_invalid_output(&self) -> OnInvalidOutput {
        self.on_invalid_output
    }

    /// Retries of an invalid answer per turn under [`OnInvalidOutput::Retry`].
    pub fn output_retries(&self) -> u32 {
        self.output_retries
    }

    /// Whether the final answer `text` matches the revision's `output_schema`: it must parse as
    /// JSON and validate; each error names the JSON Pointer of the place (`at /items/0: …`).
    /// `not_checked` when the revision declares no schema. Pure: a replay decides the same.
    pub fn check_output(&self, text: &str) -> OutputValidation {
        let Some(output) = &self.output else {
            return OutputValidation::NotChecked;
        };
        let validator = match &output.validator {
            Ok(v) => v,
            Err(reason) => {
                return OutputValidation::Invalid {
                    errors: vec![format!("output_schema is not usable: {}", clip(reason))],
                };
            }
        };
        let value: Value = match serde_json::from_str(text) {
            Ok(v) => v,
            Err(e) => {
                return OutputValidation::Invalid {
                    errors: vec![format!("at (root): the answer is not JSON: {e}")],
                };
            }
        };
        if validator.is_valid(&value) {
            return OutputValidation::Valid;
        }
        let errors = validator
            .iter_errors(&value)
            .take(MAX_ERRORS)
            .map(|e| {
                ArgumentError {
                    path: e.instance_path().as_str().to_owned(),
                    message: clip(&e.to_string()),
                }
                .to_string()
            })
            .collect();
        OutputValidation::Invalid { errors }
    }

    /// The policy for a tool (the default for a tool without an entry). Only asked for tools the
    /// contract offers: an undeclared tool never gets as far as its policy.
    pub fn policy(&self, tool: &str) -> ToolPolicy {
        self.policy.get(tool).cloned().unwrap_or_default()
    }

    /// Whether the call may run: the tool is declared and the arguments match its schema.
    pub fn check(&self, call: &ToolCall) -> Result<(), Refusal> {
        let Some(tools) = &self.tools else {
            return Ok(());
        };
        let Some(offered) = tools.get(&call.name) else {
            return Err(Refusal::NotOffered {
                tool: call.name.clone(),
                offered: tools.keys().cloned().collect(),
            });
        };
        let validator = match &offered.validator {
            Ok(v) => v,
            Err(reason) => {
                return Err(Refusal::BrokenSchema {
                    tool: call.name.clone(),
                    reason: reason.clone(),
                });
            }
        };
        if validator.is_valid(&call.arguments) {
            return Ok(());
        }
        let errors = validator
            .iter_errors(&call.arguments)
            .take(MAX_ERRORS)
            .map(|e| ArgumentError {
                path: e.instance_path().as_str().to_owned(),
                message: clip(&e.to_string()),
            })
            .collect();
        Err(Refusal::InvalidArguments {
            tool: call.name.clone(),
            errors,
        })
    }
}

/// `s` cut to [`MAX_ERROR_CHARS`] characters (an error may quote a long argument).
fn clip(s: &str) -> String {
    match s.char_indices().nth(MAX_ERROR_CHARS) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_owned(),
    }
}

/// `schema` with the properties `sensitive` accepting any value: their values reach the core
/// sealed (`kedge_runtime::seal`), so only their presence can be checked here (the tool checks
/// the values).
fn without_sensitive(schema: &Value, sensitive: &[String]) -> Value {
    let mut schema = schema.clone();
    if let Some(properties) = schema.get_mut("properties").and_then(Value::as_object_mut) {
        for name in sensitive {
            if let Some(p) = properties.get_mut(name) {
                *p = Value::Bool(true);
            }
        }
    }
    schema
}

/// Checks that `schema` is a JSON Schema Kedge can validate arguments against: valid against its
/// meta-schema, and compilable (patterns are valid regular expressions, every `$ref` resolves
/// inside the schema; nothing is fetched).
pub fn check_schema(schema: &Value) -> Result<(), String> {
    jsonschema::meta::validate(schema).map_err(|e| {
        let at = e.instance_path().as_str();
        if at.is_empty() {
            format!("not a valid JSON Schema: {}", clip(&e.to_string()))
        } else {
            format!("not a valid JSON Schema at {at}: {}", clip(&e.to_string()))
        }
    })?;
    jsonschema::validator_for(schema)
        .map(|_| ())
        .map_err(|e| format!("the schema does not compile: {}", clip(&e.to_string())))
}

// ---------------------------------------------------------------------------------------------
// Per-tool retry policy
// ---------------------------------------------------------------------------------------------

/// Why a tool attempt failed, as its runner classifies it: the classes a `retry` policy may
/// retry. Any other failure (the tool's own error answer, arguments it refuses, a permission it
/// lacks) has no class: trying the same call again would fail the same way, so the model gets
/// it at once.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, JsonSchema,
)]
#[serde(rename_all = "snake_case")]
pub enum ToolErrorClass {
    /// The attempt ran past its time limit (`policy.<tool>.timeout_secs`, else the tool
    /// service's `tool_timeout`) and was stopped. It may have done part or all of its work, so
    /// only a tool that is safe to run again is retried after one.
    Timeout,
    /// The call never reached the tool (an MCP server that could not be started or connected
    /// to); or, for a tool declared `idempotent`, the connection died with the call in flight.
    Transient,
    /// The tool refused the call for now, without running it, because of a rate limit.
    RateLimited,
}

impl ToolErrorClass {
    pub const ALL: &'static [ToolErrorClass] = &[
        ToolErrorClass::Timeout,
        ToolErrorClass::Transient,
        ToolErrorClass::RateLimited,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            ToolErrorClass::Timeout => "timeout",
            ToolErrorClass::Transient => "transient",
            ToolErrorClass::RateLimited => "rate_limited",
        }
    }
}

impl fmt::Display for ToolErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Most attempts a tool's `retry` policy may ask for (the first included); a `tool.attempt`
/// numbered above it is no attempt ([`NextAttempt::after`]). Each attempt claims the
/// operation's record under its own number, 16 per dispatch ([`claim_dispatch`]).
pub const MAX_TOOL_ATTEMPTS: u32 = 10;
/// Longest wait between two attempts (ten minutes). An operation waiting for its next attempt
/// holds nothing; a run cancelled meanwhile does not wait for it (no attempt is running), and
/// the attempt, when it comes, is not run.
pub const MAX_BACKOFF_MS: i64 = 600_000;
/// Largest growth factor of the wait from one attempt to the next.
pub const MAX_MULTIPLIER: f64 = 10.0;

fn default_attempts() -> i64 {
    3
}
fn default_initial_backoff_ms() -> i64 {
    1_000
}
fn default_max_backoff_ms() -> i64 {
    30_000
}
fn default_multiplier() -> f64 {
    2.0
}
fn default_jitter() -> f64 {
    0.5
}
fn default_on() -> Vec<ToolErrorClass> {
    vec![ToolErrorClass::Transient, ToolErrorClass::RateLimited]
}
fn is_false(b: &bool) -> bool {
    !*b
}

/// A tool's retry policy (`policy.<tool>.retry`): how often an operation of the tool is tried,
/// how long the runner waits between attempts, and which failures are tried again. Frozen with
/// the agent revision and carried by every `tool.requested` of the tool, so a run keeps the
/// policy it started with. A tool without one is tried once, as before there were policies.
///
/// Every attempt runs under the same operation id (its claim in `kedge_idempotency`, its
/// `tool.started`, and for a retried one `tool.attempt`); the model sees one result, the last
/// attempt's. The numbers are signed on the wire so that a negative one is refused naming its
/// field ([`RetryPolicy::check`]); the accessors return them checked.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
pub struct RetryPolicy {
    /// Attempts in all, the first included: 1 to 10 (default 3).
    #[serde(default = "default_attempts")]
    #[schemars(range(min = 1, max = 10))]
    pub attempts: i64,
    /// Wait after the first failed attempt, in milliseconds: 1 to 600000 (default 1000).
    #[serde(default = "default_initial_backoff_ms")]
    #[schemars(range(min = 1, max = 600_000))]
    pub initial_backoff_ms: i64,
    /// Longest wait between two attempts, in milliseconds: `initial_backoff_ms` to 600000
    /// (default 30000).
    #[serde(default = "default_max_backoff_ms")]
    #[schemars(range(min = 1, max = 600_000))]
    pub max_backoff_ms: i64,
    /// Growth of the wait per failed attempt: 1 to 10 (default 2).
    #[serde(default = "default_multiplier")]
    #[schemars(range(min = 1, max = 10))]
    pub multiplier: f64,
    /// Share of each wait drawn at random, 0 to 1 (default 0.5): the wait is uniform in
    /// `[(1 - jitter) * w, w]`, so operations that failed together do not retry together.
    #[serde(default = "default_jitter")]
    #[schemars(range(min = 0, max = 1))]
    pub jitter: f64,
    /// The error classes that are retried (default `transient`, `rate_limited`: failures where
    /// the call never ran). `timeout` only for a tool that is safe to run again.
    #[serde(default = "default_on")]
    #[schemars(length(min = 1))]
    pub on: Vec<ToolErrorClass>,
    /// The tool may run twice for one operation without a second effect: it honours the
    /// operation id it is given (an MCP server: `_meta."kedge/operation_id"`). Lets `timeout`
    /// be retried, a connection lost mid-call count as `transient` instead of an ambiguous
    /// outcome, and an attempt whose runner died be run again rather than asked about. Kedge
    /// knows its built-ins: only others may declare it.
    #[serde(default, skip_serializing_if = "is_false")]
    pub idempotent: bool,
}

// JSON numbers are never NaN, and `check` refuses what is not finite: equality is total.
impl Eq for RetryPolicy {}

impl Default for RetryPolicy {
    fn default() -> Self {
        RetryPolicy {
            attempts: default_attempts(),
            initial_backoff_ms: default_initial_backoff_ms(),
            max_backoff_ms: default_max_backoff_ms(),
            multiplier: default_multiplier(),
            jitter: default_jitter(),
            on: default_on(),
            idempotent: false,
        }
    }
}

/// Exponential backoff with jitter: the wait after the `n`-th failure is `initial *
/// multiplier^(n-1)`, at most `max`, of which the share `jitter` is drawn at random.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Backoff {
    pub initial: std::time::Duration,
    pub max: std::time::Duration,
    pub multiplier: f64,
    pub jitter: f64,
}

impl Backoff {
    /// The wait after failure number `failed` (1 for the first), given `draw`, a uniformly
    /// random `u64` the caller supplies (the core has no randomness: the runner draws it and
    /// journals the wait it chose). `draw = 0` waits the whole ceiling, `u64::MAX` the least.
    /// Never more than `max`, never negative, whatever the inputs.
    pub fn delay(&self, failed: u32, draw: u64) -> std::time::Duration {
        let max_ms = self.max.as_secs_f64() * 1_000.0;
        let exponent = i32::try_from(failed.saturating_sub(1).min(1_000)).unwrap_or(1_000);
        let multiplier = if self.multiplier.is_finite() {
            self.multiplier.max(1.0)
        } else {
            1.0
        };
        let ceiling =
            (self.initial.as_secs_f64() * 1_000.0 * multiplier.powi(exponent)).min(max_ms);
        let jitter = if self.jitter.is_finite() {
            self.jitter.clamp(0.0, 1.0)
        } else {
            0.0
        };
        let share = draw as f64 / u64::MAX as f64;
        let ms = (ceiling * (1.0 - jitter * share)).clamp(0.0, max_ms);
        std::time::Duration::from_millis(ms.round() as u64)
    }
}

/// What the runner does after an attempt that failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verdict {
    /// Journal the attempt (`tool.attempt`) and run attempt `next` after `delay`.
    Retry {
        next: u32,
        delay: std::time::Duration,
    },
    /// The model gets this attempt's error.
    GiveUp(GiveUp),
}

/// Why a failed attempt is the operation's last.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GiveUp {
    /// The failure has no retryable class (the tool's own error answer): the model reads it.
    NotRetryable,
    /// The policy does not list the class (or there is no policy).
    NotListed(ToolErrorClass),
    /// A timeout of a tool that is not safe to run again: it may have taken effect.
    NotSafeToRerun,
    /// Every attempt the policy allows has been made.
    Exhausted { attempts: u32 },
}

impl fmt::Display for GiveUp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GiveUp::NotRetryable => f.write_str("not retried: the tool's own error"),
            GiveUp::NotListed(c) => {
                write!(f, "not retried: the tool's retry policy does not list {c}")
            }
            GiveUp::NotSafeToRerun => f.write_str(
                "not retried: the tool is not known to be safe to run again after a timeout",
            ),
            GiveUp::Exhausted { attempts } => write!(f, "gave up after {attempts} attempts"),
        }
    }
}

/// The dispatch number an operation's record in `kedge_idempotency` is claimed under, for
/// attempt `attempt` (1 for the first) of dispatch `dispatch` of an operation whose request
/// carries a retry policy (`retried`). The record's claim orders dispatches: a claim with a
/// greater number than the record's takes over what the journal has superseded, without a
/// confirm query. Attempts are ordered the same way inside a dispatch: attempt n+1 is claimed
/// only after attempt n's failure is journaled (`tool.attempt`), so it supersedes it.
/// An operation without a policy (one attempt) keeps the plain dispatch number, so records
/// written before policies existed mean what they meant.
pub fn claim_dispatch(dispatch: u32, attempt: u32, retried: bool) -> u32 {
    if !retried {
        return dispatch;
    }
    // Room for MAX_TOOL_ATTEMPTS per dispatch (16 > 10); a later dispatch is always greater
    // than any attempt of an earlier one.
    const STRIDE: u32 = 16;
    dispatch
        .saturating_mul(STRIDE)
        .saturating_add(attempt.clamp(1, STRIDE) - 1)
}

/// Where an operation under a retry policy stands in one dispatch, from its journaled
/// `tool.attempt`s: the attempt to make next, and when it is due.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NextAttempt {
    /// 1 when no attempt of the dispatch has failed yet.
    pub number: u32,
    /// The last failed attempt's `retry_at`: no runner starts the next one earlier.
    pub due: Option<crate::event::Timestamp>,
}

impl NextAttempt {
    /// Before any attempt of a dispatch failed.
    pub const FIRST: NextAttempt = NextAttempt {
        number: 1,
        due: None,
    };

    /// Where the dispatch stands after `failed`, a `tool.attempt` of it journaled at `at` (its
    /// envelope's time), or `None` when `failed` changes nothing: the one rule for reading a
    /// `tool.attempt`, which the fold ([`crate::fold`]) and the runners both apply.
    ///
    /// A failure is taken only if it is later than what is known (attempts are numbered up,
    /// a repeat changes nothing) and a real attempt: numbers outside 1..=[`MAX_TOOL_ATTEMPTS`]
    /// are set aside (no policy makes them: a forged or buggy event). Its `retry_at` is held to
    /// at most [`MAX_BACKOFF_MS`] after `at`, so no event parks an operation longer than the
    /// longest backoff a policy can ask for.
    pub fn after(
        self,
        failed: &crate::event::ToolAttempt,
        at: crate::event::Timestamp,
    ) -> Option<NextAttempt> {
        if !(1..=MAX_TOOL_ATTEMPTS).contains(&failed.attempt) || failed.attempt < self.number {
            return None;
        }
        let latest = at.saturating_add(std::time::Duration::from_millis(MAX_BACKOFF_MS as u64));
        let due = if failed.retry_at.0 > latest.0 {
            latest
        } else {
            failed.retry_at
        };
        Some(NextAttempt {
            number: failed.attempt + 1,
            due: Some(due),
        })
    }
}

/// The next attempt of dispatch `dispatch`, given the operation's `tool.attempt`s in journal
/// order, each with its envelope's time (repeats and other dispatches included): what
/// [`NextAttempt::after`] makes of them.
pub fn next_attempt<'a>(
    attempts: impl IntoIterator<Item = (&'a crate::event::ToolAttempt, crate::event::Timestamp)>,
    dispatch: u32,
) -> NextAttempt {
    attempts
        .into_iter()
        .filter(|(a, _)| a.dispatch == dispatch)
        .fold(NextAttempt::FIRST, |next, (a, at)| {
            next.after(a, at).unwrap_or(next)
        })
}

impl RetryPolicy {
    /// Attempts in all (checked: 1..=[`MAX_TOOL_ATTEMPTS`]).
    pub fn max_attempts(&self) -> u32 {
        u32::try_from(self.attempts)
            .unwrap_or(1)
            .clamp(1, MAX_TOOL_ATTEMPTS)
    }

    /// The policy's backoff (numbers clamped to their checked ranges).
    pub fn backoff(&self) -> Backoff {
        let ms = |v: i64| {
            std::time::Duration::from_millis(u64::try_from(v.clamp(0, MAX_BACKOFF_MS)).unwrap_or(0))
        };
        Backoff {
            initial: ms(self.initial_backoff_ms),
            max: ms(self.max_backoff_ms.max(self.initial_backoff_ms)),
            multiplier: self.multiplier,
            jitter: self.jitter,
        }
    }

    /// Whether running `tool` again for the same operation is safe: Kedge's idempotent
    /// built-ins, or a tool the policy declares idempotent.
    pub fn rerun_safe(&self, tool: &str) -> bool {
        match builtin(tool) {
            Some(b) => b.idempotent,
            None => self.idempotent,
        }
    }

    /// What follows attempt `attempt` (1 for the first) of an operation of `tool` that failed
    /// with `class` (`None`: the tool's own error). `draw` is a uniformly random `u64` for the
    /// jitter. Pure: the runner journals what it decided.
    pub fn after_failure(
        &self,
        tool: &str,
        attempt: u32,
        class: Option<ToolErrorClass>,
        draw: u64,
    ) -> Verdict {
        let Some(class) = class else {
            return Verdict::GiveUp(GiveUp::NotRetryable);
        };
        if !self.on.contains(&class) {
            return Verdict::GiveUp(GiveUp::NotListed(class));
        }
        if class == ToolErrorClass::Timeout && !self.rerun_safe(tool) {
            return Verdict::GiveUp(GiveUp::NotSafeToRerun);
        }
        let attempts = self.max_attempts();
        if attempt >= attempts {
            return Verdict::GiveUp(GiveUp::Exhausted { attempts });
        }
        Verdict::Retry {
            next: attempt + 1,
            delay: self.backoff().delay(attempt, draw),
        }
    }

    /// The policy's rules, for `tool`: `Err((field under retry, reason))` names the first
    /// broken one (`attempts`, `initial_backoff_ms`, `max_backoff_ms`, `multiplier`, `jitter`,
    /// `on`, `idempotent`).
    pub fn check(&self, tool: &str) -> Result<(), (&'static str, String)> {
        let max_attempts = i64::from(MAX_TOOL_ATTEMPTS);
        if !(1..=max_attempts).contains(&self.attempts) {
            return Err((
                "attempts",
                format!("{} is outside 1..={max_attempts}", self.attempts),
            ));
        }
        if !(1..=MAX_BACKOFF_MS).contains(&self.initial_backoff_ms) {
            return Err((
                "initial_backoff_ms",
                format!(
                    "{} is outside 1..={MAX_BACKOFF_MS}",
                    self.initial_backoff_ms
                ),
            ));
        }
        if !(self.initial_backoff_ms..=MAX_BACKOFF_MS).contains(&self.max_backoff_ms) {
            return Err((
                "max_backoff_ms",
                format!(
                    "{} is outside {}..={MAX_BACKOFF_MS} (at least initial_backoff_ms)",
                    self.max_backoff_ms, self.initial_backoff_ms
                ),
            ));
        }
        if !(self.multiplier.is_finite() && (1.0..=MAX_MULTIPLIER).contains(&self.multiplier)) {
            return Err((
                "multiplier",
                format!("{} is outside 1..={MAX_MULTIPLIER}", self.multiplier),
            ));
        }
        if !(self.jitter.is_finite() && (0.0..=1.0).contains(&self.jitter)) {
            return Err(("jitter", format!("{} is outside 0..=1", self.jitter)));
        }
        if self.on.is_empty() {
            return Err((
                "on",
                "lists no error class, so nothing would be retried (leave `retry` out instead)"
                    .to_owned(),
            ));
        }
        if let Some(b) = builtin(tool) {
            if self.idempotent && !b.idempotent {
                return Err((
                    "idempotent",
                    format!("`{tool}` is a built-in that Kedge knows is not idempotent"),
                ));
            }
            if crate::fold::handled_by_step(tool) {
                return Err((
                    "on",
                    format!(
                        "`{tool}` is handled by the step service, not a tool runner: it has no attempts to retry"
                    ),
                ));
            }
        }
        if self.on.contains(&ToolErrorClass::Timeout) && !self.rerun_safe(tool) {
            return Err((
                "on",
                format!(
                    "`timeout` retries a call that may have taken effect: only for a tool that is \
                     safe to run again (read_file, write_file, list_files, or a tool declared \
                     `idempotent: true`, which must honour the operation id it is given); \
                     `{tool}` is not"
                ),
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn call(name: &str, arguments: Value) -> ToolCall {
        ToolCall {
            call_id: "c1".into(),
            name: name.into(),
            arguments,
        }
    }

    fn contract(names: &[&str]) -> Contract {
        let tools: Vec<ToolSpec> = names
            .iter()
            .map(|n| builtin(n).expect("a built-in").spec())
            .collect();
        Contract::new(&tools, &BTreeMap::new())
    }

    #[test]
    fn every_builtin_schema_is_a_valid_object_schema() {
        for b in BUILTINS {
            let p = b.parameters();
            assert_eq!(p["type"], "object", "{}", b.name);
            check_schema(&p).unwrap_or_else(|e| panic!("{}: {e}", b.name));
        }
    }

    #[test]
    fn an_undeclared_tool_is_not_offered() {
        let c = contract(&["shell", "read_file"]);
        let r = c
            .check(&call("write_file", json!({"path": "a", "content": "x"})))
            .expect_err("not declared");
        assert!(matches!(r, Refusal::NotOffered { .. }));
        let text = r.to_string();
        assert!(text.contains("tool not offered"), "{text}");
        assert!(text.contains("read_file, shell"), "{text}");
    }

    #[test]
    fn invalid_arguments_name_the_json_path() {
        let c = contract(&["read_file", "shell"]);
        assert_eq!(
            c.check(&call("read_file", json!({"path": "a.txt"}))),
            Ok(())
        );
        let r = c
            .check(&call("read_file", json!({"path": 5})))
            .expect_err("wrong type");
        let text = r.to_string();
        assert!(text.contains("at /path:"), "{text}");
        let r = c
            .check(&call("shell", json!({"command": "ls", "args": ["-l", 3]})))
            .expect_err("wrong item");
        assert!(r.to_string().contains("at /args/1:"), "{r}");
        let r = c
            .check(&call("read_file", json!("not an object")))
            .expect_err("not an object");
        assert!(r.to_string().contains("at (root):"), "{r}");
        let r = c
            .check(&call("read_file", json!({"path": "a", "mode": "x"})))
            .expect_err("extra property");
        assert!(r.to_string().contains("mode"), "{r}");
    }

    #[test]
    fn a_sensitive_parameter_is_checked_for_presence_only() {
        let pay = ToolSpec {
            name: "pay".into(),
            description: String::new(),
            parameters: json!({"type": "object", "required": ["to", "card"],
                "properties": {"to": {"type": "string"}, "card": {"type": "string", "pattern": "^[0-9]{16}$"}},
                "additionalProperties": false}),
        };
        let sealed = json!({"to": "bob", "card": "kedge:sealed:v1:AAAA"});
        let plain = Contract::new(std::slice::from_ref(&pay), &BTreeMap::new());
        assert!(plain.check(&call("pay", sealed.clone())).is_err());
        let policy = BTreeMap::from([(
            "pay".to_owned(),
            ToolPolicy {
                sensitive: vec!["card".into()],
                ..ToolPolicy::default()
            },
        )]);
        let c = Contract::new(&[pay], &policy);
        assert_eq!(c.check(&call("pay", sealed)), Ok(()));
        // The other parameters are still checked, and the sensitive one must be there.
        assert!(
            c.check(&call("pay", json!({"to": 5, "card": "x"})))
                .is_err()
        );
        assert!(c.check(&call("pay", json!({"to": "bob"}))).is_err());
    }

    #[test]
    fn long_arguments_are_clipped_in_the_refusal() {
        let c = contract(&["read_file"]);
        let r = c
            .check(&call("read_file", json!({"path": ["x".repeat(10_000)]})))
            .expect_err("wrong type");
        assert!(r.to_string().len() < 1_000, "{}", r.to_string().len());
    }

    #[test]
    fn the_default_contract_offers_everything() {
        let c = Contract::default();
        assert_eq!(c.check(&call("anything", json!(null))), Ok(()));
    }

    #[test]
    fn bad_schemas_are_named() {
        assert!(check_schema(&json!({"type": "object"})).is_ok());
        assert!(check_schema(&json!({"type": "objekt"})).is_err());
        assert!(
            check_schema(&json!({"type": "object", "properties": {"a": {"pattern": "("}}}))
                .is_err()
        );
        assert!(check_schema(&json!({"type": "object", "properties": {"a": {"$ref": "https://example.com/s.json"}}})).is_err());
    }

    #[test]
    fn contracts_are_shared_per_definition() {
        let def: AgentDefinition = serde_json::from_value(json!({
            "name": "t", "system_prompt": "p",
            "model": {"provider": "openai", "name": "m"},
            "tools": ["read_file"]
        }))
        .expect("parses");
        assert!(Arc::ptr_eq(&Contract::of(&def), &Contract::of(&def)));
    }

    // --- retry policy -------------------------------------------------------------------------

    fn policy(on: &[ToolErrorClass], attempts: i64, idempotent: bool) -> RetryPolicy {
        RetryPolicy {
            attempts,
            on: on.to_vec(),
            idempotent,
            ..RetryPolicy::default()
        }
    }

    /// Every subset of the classes.
    fn subsets() -> Vec<Vec<ToolErrorClass>> {
        (0..(1u32 << ToolErrorClass::ALL.len()))
            .map(|mask| {
                ToolErrorClass::ALL
                    .iter()
                    .enumerate()
                    .filter(|(i, _)| mask & (1 << i) != 0)
                    .map(|(_, c)| *c)
                    .collect()
            })
            .collect()
    }

    #[test]
    fn which_failures_are_retried_for_every_class_list_safety_and_attempt() {
        let classes: Vec<Option<ToolErrorClass>> = std::iter::once(None)
            .chain(ToolErrorClass::ALL.iter().copied().map(Some))
            .collect();
        for on in subsets() {
            for (tool, declared_idempotent, safe) in [
                ("read_file", false, true),
                ("ledger_append", false, false),
                ("srv__tool", false, false),
                ("srv__tool", true, true),
            ] {
                let p = policy(&on, 3, declared_idempotent);
                assert_eq!(p.rerun_safe(tool), safe, "{tool}");
                for class in &classes {
                    for attempt in 1..=4u32 {
                        let verdict = p.after_failure(tool, attempt, *class, 0);
                        let expected = match class {
                            None => Verdict::GiveUp(GiveUp::NotRetryable),
                            Some(c) if !on.contains(c) => Verdict::GiveUp(GiveUp::NotListed(*c)),
                            Some(ToolErrorClass::Timeout) if !safe => {
                                Verdict::GiveUp(GiveUp::NotSafeToRerun)
                            }
                            Some(_) if attempt >= 3 => {
                                Verdict::GiveUp(GiveUp::Exhausted { attempts: 3 })
                            }
                            Some(_) => Verdict::Retry {
                                next: attempt + 1,
                                delay: p.backoff().delay(attempt, 0),
                            },
                        };
                        assert_eq!(
                            verdict, expected,
                            "{tool} on={on:?} {class:?} attempt {attempt}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_default_policy_retries_only_failures_that_never_ran() {
        let p: RetryPolicy = serde_json::from_value(json!({})).expect("defaults");
        assert_eq!(p, RetryPolicy::default());
        assert_eq!(p.max_attempts(), 3);
        assert_eq!(
            p.on,
            [ToolErrorClass::Transient, ToolErrorClass::RateLimited]
        );
        assert!(p.check("srv__tool").is_ok());
        assert!(matches!(
            p.after_failure("srv__tool", 1, Some(ToolErrorClass::Timeout), 0),
            Verdict::GiveUp(GiveUp::NotListed(ToolErrorClass::Timeout))
        ));
        // One attempt: never retried, whatever the class.
        let once = policy(ToolErrorClass::ALL, 1, true);
        for c in ToolErrorClass::ALL {
            assert_eq!(
                once.after_failure("srv__tool", 1, Some(*c), 0),
                Verdict::GiveUp(GiveUp::Exhausted { attempts: 1 })
            );
        }
    }

    #[test]
    fn backoff_grows_is_capped_and_its_jitter_stays_in_range() {
        let ms = std::time::Duration::from_millis;
        let b = Backoff {
            initial: ms(100),
            max: ms(1_000),
            multiplier: 2.0,
            jitter: 0.5,
        };
        // draw 0: the whole ceiling; u64::MAX: the ceiling less the jitter share.
        assert_eq!(b.delay(1, 0), ms(100));
        assert_eq!(b.delay(2, 0), ms(200));
        assert_eq!(b.delay(3, 0), ms(400));
        assert_eq!(b.delay(4, 0), ms(800));
        assert_eq!(b.delay(5, 0), ms(1_000), "capped");
        assert_eq!(b.delay(u32::MAX, 0), ms(1_000), "no overflow");
        assert_eq!(b.delay(1, u64::MAX), ms(50));
        assert_eq!(b.delay(9, u64::MAX), ms(500));
        assert_eq!(b.delay(0, 0), ms(100), "attempt 0 counts as the first");
        for failed in 1..=12 {
            let ceiling = b.delay(failed, 0);
            for draw in [1, u64::MAX / 3, u64::MAX / 2, u64::MAX - 1] {
                let d = b.delay(failed, draw);
                assert!(
                    d <= ceiling && d >= ceiling / 2,
                    "{failed} {draw}: {d:?} vs {ceiling:?}"
                );
            }
            assert!(b.delay(failed + 1, 0) >= ceiling, "never shrinks");
        }
        // Different draws give different waits (the point of jitter).
        assert_ne!(b.delay(3, u64::MAX / 4), b.delay(3, u64::MAX / 4 * 3));
        // No jitter: deterministic. Full jitter: anywhere down to zero.
        let exact = Backoff { jitter: 0.0, ..b };
        assert_eq!(exact.delay(2, u64::MAX), ms(200));
        let full = Backoff { jitter: 1.0, ..b };
        assert_eq!(full.delay(2, u64::MAX), ms(0));
        // Nonsense numbers (never stored: `check` refuses them) still give a wait within max.
        for bad in [f64::NAN, f64::INFINITY, -3.0, 0.0] {
            let b = Backoff {
                multiplier: bad,
                jitter: bad,
                ..b
            };
            assert!(b.delay(7, u64::MAX / 2) <= ms(1_000), "{bad}");
        }
    }

    #[test]
    fn claim_numbers_order_dispatches_then_attempts_and_keep_plain_dispatches() {
        for d in 0..50 {
            assert_eq!(
                claim_dispatch(d, 1, false),
                d,
                "no policy: the plain dispatch"
            );
        }
        let mut last = None;
        for d in 0..6u32 {
            for a in 1..=MAX_TOOL_ATTEMPTS {
                let n = claim_dispatch(d, a, true);
                if let Some(prev) = last {
                    assert!(n > prev, "({d}, {a}) = {n} after {prev}");
                }
                last = Some(n);
            }
        }
        // A later dispatch supersedes every attempt of an earlier one.
        assert!(claim_dispatch(1, 1, true) > claim_dispatch(0, MAX_TOOL_ATTEMPTS, true));
        assert_eq!(claim_dispatch(u32::MAX, 5, true), u32::MAX, "saturates");
    }

    #[test]
    fn a_policy_breaking_a_rule_names_the_field() {
        let ok = RetryPolicy::default();
        let cases: Vec<(RetryPolicy, &str, &str)> = vec![
            (
                RetryPolicy {
                    attempts: 0,
                    ..ok.clone()
                },
                "srv__t",
                "attempts",
            ),
            (
                RetryPolicy {
                    attempts: 11,
                    ..ok.clone()
                },
                "srv__t",
                "attempts",
            ),
            (
                RetryPolicy {
                    attempts: -1,
                    ..ok.clone()
                },
                "srv__t",
                "attempts",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: -5,
                    ..ok.clone()
                },
                "srv__t",
                "initial_backoff_ms",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: 0,
                    ..ok.clone()
                },
                "srv__t",
                "initial_backoff_ms",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: 700_000,
                    max_backoff_ms: 700_000,
                    ..ok.clone()
                },
                "srv__t",
                "initial_backoff_ms",
            ),
            (
                RetryPolicy {
                    max_backoff_ms: 999_999_999,
                    ..ok.clone()
                },
                "srv__t",
                "max_backoff_ms",
            ),
            (
                RetryPolicy {
                    initial_backoff_ms: 5_000,
                    max_backoff_ms: 1_000,
                    ..ok.clone()
                },
                "srv__t",
                "max_backoff_ms",
            ),
            (
                RetryPolicy {
                    multiplier: 0.5,
                    ..ok.clone()
                },
                "srv__t",
                "multiplier",
            ),
            (
                RetryPolicy {
                    multiplier: 11.0,
                    ..ok.clone()
                },
                "srv__t",
                "multiplier",
            ),
            (
                RetryPolicy {
                    jitter: -0.1,
                    ..ok.clone()
                },
                "srv__t",
                "jitter",
            ),
            (
                RetryPolicy {
                    jitter: 1.5,
                    ..ok.clone()
                },
                "srv__t",
                "jitter",
            ),
            (
                RetryPolicy {
                    on: vec![],
                    ..ok.clone()
                },
                "srv__t",
                "on",
            ),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    ..ok.clone()
                },
                "srv__t",
                "on",
            ),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    ..ok.clone()
                },
                "shell",
                "on",
            ),
            (
                RetryPolicy {
                    idempotent: true,
                    ..ok.clone()
                },
                "shell",
                "idempotent",
            ),
            (
                RetryPolicy {
                    idempotent: true,
                    ..ok.clone()
                },
                "ledger_append",
                "idempotent",
            ),
            (ok.clone(), "ask_user", "on"),
        ];
        for (p, tool, field) in cases {
            let (got, reason) = p.check(tool).expect_err(field);
            assert_eq!(got, field, "{tool} {p:?}: {reason}");
            assert!(!reason.is_empty());
        }
        for (p, tool) in [
            (ok.clone(), "srv__t"),
            (ok.clone(), "shell"),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    ..ok.clone()
                },
                "read_file",
            ),
            (
                RetryPolicy {
                    on: vec![ToolErrorClass::Timeout],
                    idempotent: true,
                    ..ok.clone()
                },
                "srv__t",
            ),
            (
                RetryPolicy {
                    idempotent: true,
                    ..ok.clone()
                },
                "write_file",
            ),
            (
                RetryPolicy {
                    attempts: 10,
                    initial_backoff_ms: 1,
                    max_backoff_ms: MAX_BACKOFF_MS,
                    multiplier: 10.0,
                    jitter: 1.0,
                    ..ok.clone()
                },
                "srv__t",
            ),
        ] {
            assert_eq!(p.check(tool), Ok(()), "{tool} {p:?}");
        }
        // Unknown fields and classes are refused when parsed.
        assert!(serde_json::from_value::<RetryPolicy>(json!({"retries": 3})).is_err());
        assert!(serde_json::from_value::<RetryPolicy>(json!({"on": ["permanent"]})).is_err());
    }

    #[test]
    fn builtin_idempotency_matches_the_confirm_semantics() {
        for b in BUILTINS {
            let expected = matches!(b.name, "read_file" | "write_file" | "list_files");
            assert_eq!(b.idempotent, expected, "{}", b.name);
        }
    }

    #[test]
    fn the_next_attempt_follows_the_last_failed_one_of_the_same_dispatch() {
        use crate::event::{Timestamp, ToolAttempt};
        let at = |s: i64| Timestamp(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(s));
        let failed = |attempt, dispatch, t| {
            (
                ToolAttempt {
                    attempt,
                    dispatch,
                    class: ToolErrorClass::Transient,
                    error: "x".into(),
                    delay_ms: 1,
                    retry_at: at(t),
                },
                at(0),
            )
        };
        let of =
            |j: &[(ToolAttempt, Timestamp)], d| next_attempt(j.iter().map(|(a, t)| (a, *t)), d);
        assert_eq!(of(&[], 0), NextAttempt::FIRST);
        let journal = [
            failed(2, 0, 20),
            failed(1, 0, 10),
            failed(2, 0, 20),
            failed(5, 1, 99),
        ];
        assert_eq!(
            of(&journal, 0),
            NextAttempt {
                number: 3,
                due: Some(at(20))
            }
        );
        assert_eq!(
            of(&journal, 1),
            NextAttempt {
                number: 6,
                due: Some(at(99))
            }
        );
        assert_eq!(of(&journal, 2), NextAttempt::FIRST);
    }

    #[test]
    fn a_tool_attempt_parks_an_operation_no_longer_than_the_longest_backoff() {
        use crate::event::{Timestamp, ToolAttempt};
        let at = |s: i64| Timestamp(time::OffsetDateTime::UNIX_EPOCH + time::Duration::seconds(s));
        let failed = |attempt, retry_at| ToolAttempt {
            attempt,
            dispatch: 0,
            class: ToolErrorClass::Transient,
            error: "x".into(),
            delay_ms: 1,
            retry_at,
        };
        let max = MAX_BACKOFF_MS / 1000;
        // Years ahead, or the end of time: due at most the longest backoff after the event.
        for far in [at(100 + 3 * 365 * 86_400), Timestamp::MAX] {
            assert_eq!(
                NextAttempt::FIRST.after(&failed(1, far), at(100)),
                Some(NextAttempt {
                    number: 2,
                    due: Some(at(100 + max))
                })
            );
        }
        // Within the bound: as journaled.
        assert_eq!(
            NextAttempt::FIRST.after(&failed(1, at(130)), at(100)),
            Some(NextAttempt {
                number: 2,
                due: Some(at(130))
            })
        );
        // No policy makes attempt 0 or more than MAX_TOOL_ATTEMPTS: set aside, whatever came
        // before; an earlier number than what is known changes nothing.
        for n in [0, MAX_TOOL_ATTEMPTS + 1, u32::MAX] {
            assert_eq!(NextAttempt::FIRST.after(&failed(n, at(1)), at(0)), None);
        }
        let third = NextAttempt {
            number: 3,
            due: Some(at(5)),
        };
        assert_eq!(third.after(&failed(1, at(9)), at(0)), None);
        assert_eq!(
            third.after(&failed(MAX_TOOL_ATTEMPTS, at(9)), at(0)),
            Some(NextAttempt {
                number: MAX_TOOL_ATTEMPTS + 1,
                due: Some(at(9))
            })
        );
    }
}
