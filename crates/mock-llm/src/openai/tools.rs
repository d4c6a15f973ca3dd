//! The tool definitions (`tools`) and the function names, in `tools` and in `tool_calls`.

use serde_json::Value;

use super::{empty_array, field, missing, wrong_type};
use crate::error::ApiError;
use crate::script::valid_tool_name;

pub(super) fn check_function_name(path: &str, name: Option<&Value>) -> Result<(), ApiError> {
    let name = match name {
        None | Some(Value::Null) => return Err(missing(path)),
        Some(Value::String(s)) => s,
        Some(other) => return Err(wrong_type(path, "a string", other)),
    };
    if valid_tool_name(name) {
        return Ok(());
    }
    let message = if name.is_empty() {
        format!(
            "Invalid '{path}': empty string. Expected a string with minimum length 1, but got an \
             empty string instead."
        )
    } else if name.len() > 64 {
        format!(
            "Invalid '{path}': string too long. Expected a string with maximum length 64, but got \
             a string with length {} instead.",
            name.len()
        )
    } else {
        format!(
            "Invalid '{path}': string does not match pattern. Expected a string that matches the \
             pattern '^[a-zA-Z0-9_-]+$'."
        )
    };
    Err(ApiError::invalid_param(message, path))
}

pub(super) fn check_tools(tools: &Value) -> Result<(), ApiError> {
    let Some(tools) = tools.as_array() else {
        return Err(wrong_type("tools", "an array", tools));
    };
    if tools.is_empty() {
        return Err(empty_array("tools"));
    }
    for (i, tool) in tools.iter().enumerate() {
        let Some(obj) = tool.as_object() else {
            return Err(wrong_type(&format!("tools[{i}]"), "an object", tool));
        };
        match field(obj, "type") {
            None => return Err(missing(&format!("tools[{i}].type"))),
            Some(Value::String(t)) if t == "function" => {}
            // Other tool kinds (custom grammars…) carry no `function` object.
            Some(Value::String(_)) => continue,
            Some(other) => return Err(wrong_type(&format!("tools[{i}].type"), "a string", other)),
        }
        let Some(function) = field(obj, "function") else {
            return Err(missing(&format!("tools[{i}].function")));
        };
        let Some(function) = function.as_object() else {
            return Err(wrong_type(
                &format!("tools[{i}].function"),
                "an object",
                function,
            ));
        };
        check_function_name(&format!("tools[{i}].function.name"), function.get("name"))?;
    }
    Ok(())
}
