//! Unprefixed names used as subject tokens: agent names and tenants.

use std::borrow::Cow;
use std::fmt;
use std::str::FromStr;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};

use super::{IdError, is_token_char};

/// Declares an unprefixed name that is used as a subject token (agent names, tenants).
macro_rules! token_name {
    ($(#[$meta:meta])* $name:ident, $max:literal) => {
        $(#[$meta])*
        #[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
        #[serde(try_from = "String", into = "String")]
        pub struct $name(String);

        impl $name {
            pub fn as_str(&self) -> &str {
                &self.0
            }
        }

        impl FromStr for $name {
            type Err = IdError;
            fn from_str(s: &str) -> Result<Self, IdError> {
                let kind = stringify!($name);
                if s.is_empty() {
                    return Err(IdError::Empty { kind });
                }
                if s.len() > $max {
                    return Err(IdError::TooLong { kind, max: $max });
                }
                match s.chars().find(|c| !is_token_char(*c)) {
                    Some(ch) => Err(IdError::InvalidChar { kind, ch }),
                    None => Ok(Self(s.to_owned())),
                }
            }
        }

        impl TryFrom<String> for $name {
            type Error = IdError;
            fn try_from(s: String) -> Result<Self, IdError> {
                s.parse()
            }
        }

        impl From<$name> for String {
            fn from(id: $name) -> String {
                id.0
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, "{}({})", stringify!($name), self.0)
            }
        }

        impl JsonSchema for $name {
            fn schema_name() -> Cow<'static, str> {
                stringify!($name).into()
            }
            fn json_schema(_: &mut SchemaGenerator) -> Schema {
                json_schema!({
                    "type": "string",
                    "pattern": concat!("^[A-Za-z0-9_-]{1,", stringify!($max), "}$"),
                })
            }
        }
    };
}

token_name!(
    /// An agent's name: the last token of `agent.task.<agent>` and the key in `kedge_agents`.
    AgentName,
    64
);
token_name!(
    /// The tenant a run belongs to; runs of one tenant are invisible to another.
    TenantId,
    64
);
