//! Kedge's built-in tools ([`BUILTINS`]) and the schemas of their arguments.

use serde_json::{Value, json};

use crate::agent::ToolSpec;

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tools::check_schema;

    #[test]
    fn every_builtin_schema_is_a_valid_object_schema() {
        for b in BUILTINS {
            let p = b.parameters();
            assert_eq!(p["type"], "object", "{}", b.name);
            check_schema(&p).unwrap_or_else(|e| panic!("{}: {e}", b.name));
        }
    }

    #[test]
    fn builtin_idempotency_matches_the_confirm_semantics() {
        for b in BUILTINS {
            let expected = matches!(b.name, "read_file" | "write_file" | "list_files");
            assert_eq!(b.idempotent, expected, "{}", b.name);
        }
    }
}
