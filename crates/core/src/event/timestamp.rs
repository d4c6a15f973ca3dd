//! [`Timestamp`]: the UTC instants events carry, RFC 3339 on the wire.

use std::borrow::Cow;
use std::fmt;

use schemars::{JsonSchema, Schema, SchemaGenerator, json_schema};
use serde::{Deserialize, Serialize};
use time::OffsetDateTime;
use time::format_description::well_known::Rfc3339;

/// A UTC instant, RFC 3339 on the wire.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Timestamp(#[serde(with = "time::serde::rfc3339")] pub OffsetDateTime);

impl Timestamp {
    /// The latest instant a timestamp holds (9999-12-31T23:59:59.999999999Z).
    pub const MAX: Timestamp = Timestamp(time::PrimitiveDateTime::MAX.assume_utc());
    /// The earliest instant a timestamp holds (-9999-01-01T00:00:00Z).
    pub const MIN: Timestamp = Timestamp(time::PrimitiveDateTime::MIN.assume_utc());

    pub fn now() -> Self {
        Self(OffsetDateTime::now_utc())
    }

    /// `self + d`, or [`Timestamp::MAX`] when that is past the last representable instant.
    /// Time arithmetic in the core goes through these helpers: `OffsetDateTime + Duration`
    /// panics on overflow, and the amounts come from tasks, definitions and model output.
    pub fn saturating_add(self, d: std::time::Duration) -> Timestamp {
        time::Duration::try_from(d)
            .ok()
            .and_then(|d| self.0.checked_add(d))
            .map_or(Timestamp::MAX, Timestamp)
    }

    /// `self + d` for a signed duration, clamped to [`Timestamp::MIN`]..=[`Timestamp::MAX`].
    pub fn saturating_add_signed(self, d: time::Duration) -> Timestamp {
        match self.0.checked_add(d) {
            Some(t) => Timestamp(t),
            None if d.is_negative() => Timestamp::MIN,
            None => Timestamp::MAX,
        }
    }
}

impl fmt::Debug for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Display::fmt(self, f)
    }
}

impl fmt::Display for Timestamp {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0.format(&Rfc3339) {
            Ok(s) => f.write_str(&s),
            Err(_) => write!(f, "{:?}", self.0),
        }
    }
}

impl JsonSchema for Timestamp {
    fn schema_name() -> Cow<'static, str> {
        "Timestamp".into()
    }
    fn json_schema(_: &mut SchemaGenerator) -> Schema {
        json_schema!({ "type": "string", "format": "date-time" })
    }
}
