//! Unprefixed names used as subject tokens: agent names, tenants and workers.

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

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(&self.0)
            }
        }

        string_form!(
            $name,
            concat!("^[A-Za-z0-9_-]{1,", stringify!($max), "}$"),
            |id| id.0
        );
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
token_name!(
    /// A Kedge process's worker: who holds a run's lease, runs an operation, leads a provider's
    /// release, and heartbeats on `kedge.live.<worker>` (so it must be a subject token). What a
    /// broker record names as a holder is read as a plain string and parsed here before a
    /// subject is built from it.
    WorkerId,
    128
);

impl WorkerId {
    /// A fresh worker id, `w-` and 12 hex digits: what a process without a configured id is.
    pub fn generate() -> Self {
        Self(format!(
            "w-{}",
            &uuid::Uuid::new_v4().simple().to_string()[..12]
        ))
    }
}
