//! [`Contract`]: the verdict on a tool call (is the tool offered, do its arguments match its
//! schema) and on a final answer (does it match the agent's `output_schema`).

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::sync::{Arc, Mutex, OnceLock};

use serde_json::Value;

use crate::agent::{AgentDefinition, OnInvalidOutput, ToolPolicy, ToolSpec};
use crate::event::{Digest, OutputValidation, ToolCall};

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
                limits: cp.limits(),
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::builtin;
    use serde_json::json;

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
}
