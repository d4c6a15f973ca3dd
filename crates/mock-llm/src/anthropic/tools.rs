//! The tool definitions (`tools`): custom tools' names, fields and input schemas.

use serde_json::Value;

use crate::error::ApiError;
use crate::script::valid_tool_name;

pub(super) fn check_tools(tools: &Value) -> Result<(), ApiError> {
    let Some(tools) = tools.as_array() else {
        return Err(ApiError::invalid("tools: Input should be a valid list"));
    };
    for (i, tool) in tools.iter().enumerate() {
        let Some(obj) = tool.as_object() else {
            return Err(ApiError::invalid(format!(
                "tools.{i}: Input should be a valid dictionary"
            )));
        };
        // Server tools (`"type": "web_search_20250305"`, …) have their own shapes.
        if obj
            .get("type")
            .and_then(Value::as_str)
            .is_some_and(|t| t != "custom")
        {
            continue;
        }
        match obj.get("name") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.name: Field required"
                )));
            }
            Some(Value::String(name)) if valid_tool_name(name) => {}
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.name: String should match pattern '^[a-zA-Z0-9_-]{{1,64}}$'"
                )));
            }
        }
        for key in obj.keys() {
            if !matches!(
                key.as_str(),
                "type" | "name" | "description" | "input_schema" | "cache_control"
            ) {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.{key}: Extra inputs are not permitted"
                )));
            }
        }
        if obj
            .get("description")
            .is_some_and(|d| !d.is_string() && !d.is_null())
        {
            return Err(ApiError::invalid(format!(
                "tools.{i}.custom.description: Input should be a valid string"
            )));
        }
        let schema = match obj.get("input_schema") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema: Field required"
                )));
            }
            Some(Value::Object(schema)) => schema,
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema: Input should be a valid dictionary"
                )));
            }
        };
        match schema.get("type") {
            None | Some(Value::Null) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema.type: Field required"
                )));
            }
            Some(Value::String(t)) if t == "object" => {}
            Some(_) => {
                return Err(ApiError::invalid(format!(
                    "tools.{i}.custom.input_schema.type: Input should be 'object'"
                )));
            }
        }
        if jsonschema::meta::validate(&Value::Object(schema.clone())).is_err() {
            return Err(ApiError::invalid(format!(
                "tools.{i}.custom.input_schema: JSON schema is invalid. It must match JSON Schema \
                 draft 2020-12 (https://json-schema.org/draft/2020-12). Learn more about tool use \
                 at https://docs.claude.com/en/docs/tool-use."
            )));
        }
    }
    let mut names: Vec<&str> = tools
        .iter()
        .filter_map(|t| t.get("name").and_then(Value::as_str))
        .collect();
    names.sort_unstable();
    if names.windows(2).any(|w| w[0] == w[1]) {
        return Err(ApiError::invalid("tools: Tool names must be unique."));
    }
    Ok(())
}
