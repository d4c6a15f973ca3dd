//! [`ToolSpec`]: a tool as the model sees it, and how a definition may write it (a built-in by
//! name, or in full).

use schemars::JsonSchema;
use serde::{Deserialize, Serialize};

use crate::ids::AgentName;

/// A tool as the model sees it.
///
/// In a definition a tool is an object (`name`, `description`, `parameters`) or, for a built-in
/// tool, just its name. A built-in listed without `parameters` (or with `null` or `{}`) gets
/// Kedge's schema and, if it has no description, Kedge's description (docs/CONFIG.md lists them);
/// any other tool without `parameters` accepts any object (`{"type": "object", "properties":
/// {}}`). What is stored is the resolved tool, so a run keeps the schema of its revision.
#[derive(Debug, Clone, PartialEq, Serialize, JsonSchema)]
#[serde(deny_unknown_fields)]
#[schemars(with = "ToolEntry")]
pub struct ToolSpec {
    pub name: String,
    #[serde(default)]
    pub description: String,
    /// JSON Schema of the arguments object.
    #[serde(default = "empty_object_schema")]
    pub parameters: serde_json::Value,
}

/// A tool as a definition may write it.
#[derive(Deserialize, JsonSchema)]
#[serde(untagged)]
#[allow(dead_code)] // only its schema is used; deserialization goes through `ToolSpecWire`
enum ToolEntry {
    /// A built-in tool by name (`read_file`, `shell`, …): Kedge supplies its schema.
    Name(String),
    Spec(ToolSpecWire),
}

/// A tool declared in full.
#[derive(Deserialize, JsonSchema)]
#[serde(deny_unknown_fields)]
struct ToolSpecWire {
    /// `[a-zA-Z0-9_-]{1,64}`; an MCP tool is `<server>__<tool>`.
    name: String,
    #[serde(default)]
    description: String,
    /// JSON Schema of the arguments object (`"type": "object"`). Omitted for a built-in tool:
    /// Kedge's schema; for any other tool: any object.
    #[serde(default)]
    parameters: Option<serde_json::Value>,
    /// Only for the `run_agent` tool (and required there): the agents its model may start as
    /// child runs. Kedge writes the tool's parameters from it (the agent's name, one of these,
    /// and the child's input); it is not stored apart.
    #[serde(default)]
    agents: Option<Vec<AgentName>>,
}

impl TryFrom<ToolSpecWire> for ToolSpec {
    type Error = String;
    fn try_from(w: ToolSpecWire) -> Result<ToolSpec, String> {
        match (&w.agents, w.name == crate::child::RUN_AGENT_TOOL) {
            (Some(_), false) => {
                return Err(format!(
                    "`agents` is only for the `{}` tool, not `{}`",
                    crate::child::RUN_AGENT_TOOL,
                    w.name
                ));
            }
            (Some(agents), true) => {
                if agents.is_empty() {
                    return Err("`run_agent`'s `agents` must name at least one agent".into());
                }
                if w.parameters.is_some() {
                    return Err(
                        "`run_agent`'s parameters are Kedge's: name the agents in `agents`, \
                         not `parameters`"
                            .into(),
                    );
                }
                return Ok(ToolSpec {
                    description: if w.description.is_empty() {
                        crate::child::default_description(agents)
                    } else {
                        w.description
                    },
                    parameters: crate::child::parameters(agents),
                    name: w.name,
                });
            }
            (None, _) => {}
        }
        Ok(ToolSpec::from_wire(w))
    }
}

impl ToolSpec {
    fn from_wire(w: ToolSpecWire) -> ToolSpec {
        let unset = match &w.parameters {
            None | Some(serde_json::Value::Null) => true,
            Some(serde_json::Value::Object(o)) => o.is_empty(),
            Some(_) => false,
        };
        match crate::tools::builtin(&w.name) {
            Some(b) if unset => ToolSpec {
                description: if w.description.is_empty() {
                    b.description.to_owned()
                } else {
                    w.description
                },
                name: w.name,
                parameters: b.parameters(),
            },
            _ => ToolSpec {
                name: w.name,
                description: w.description,
                parameters: match w.parameters {
                    None | Some(serde_json::Value::Null) => empty_object_schema(),
                    Some(p) => p,
                },
            },
        }
    }
}

impl<'de> Deserialize<'de> for ToolSpec {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> Result<ToolSpec, D::Error> {
        // A string is a built-in's name (any other name gets the permissive default, as an
        // entry without parameters does; `validate` checks the name).
        match serde_json::Value::deserialize(d)? {
            serde_json::Value::String(name) => ToolSpec::try_from(ToolSpecWire {
                name,
                description: String::new(),
                parameters: None,
                agents: None,
            })
            .map_err(serde::de::Error::custom),
            other => serde_json::from_value::<ToolSpecWire>(other)
                .map_err(serde::de::Error::custom)
                .and_then(|w| ToolSpec::try_from(w).map_err(serde::de::Error::custom)),
        }
    }
}

fn empty_object_schema() -> serde_json::Value {
    serde_json::json!({"type": "object", "properties": {}})
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::agent::{AgentDefinition, def};

    #[test]
    fn builtins_by_name_get_kedges_schema_and_explicit_schemas_are_kept() {
        let mut v = def();
        v["tools"] = serde_json::json!([
            "shell",
            {"name": "read_file"},
            {"name": "write_file", "description": "mine", "parameters": {}},
            {"name": "list_files", "parameters": {"type": "object", "properties": {}}},
            {"name": "time__now"}
        ]);
        v["policy"] = serde_json::json!({});
        let d = AgentDefinition::parse(v.to_string().as_bytes()).expect("valid");
        let shell = crate::tools::builtin("shell").expect("built-in");
        assert_eq!(d.tools[0], shell.spec());
        assert_eq!(
            d.tools[1].parameters["required"],
            serde_json::json!(["path"])
        );
        assert_eq!(d.tools[2].description, "mine");
        assert_eq!(
            d.tools[2].parameters["required"],
            serde_json::json!(["path", "content"])
        );
        assert_eq!(
            d.tools[3].parameters,
            empty_object_schema(),
            "an explicit schema stays"
        );
        assert_eq!(d.tools[4].parameters, empty_object_schema());
        // What is stored reads back the same (the schema is part of the revision).
        let stored = serde_json::to_vec(&d).expect("json");
        assert_eq!(AgentDefinition::parse(&stored).expect("valid"), d);
    }
}
