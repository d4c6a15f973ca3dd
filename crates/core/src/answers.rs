//! The answers services give each other over core-NATS requests, as types: what the tool
//! service's resolve request came to ([`Handled`], [`ResolveReply`]) and the precondition query and its answers
//! ([`TargetQuery`], [`InspectReply`]). Both sides read and write them through these types, so
//! an asker never reads an answer by matching its text.

use serde::{Deserialize, Serialize};

use crate::ids::RunId;

/// What handling one operation request came to (the tool service's answer to a resolve
/// request, `subjects::TOOL_RESOLVE`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "handled", rename_all = "snake_case")]
pub enum Handled {
    /// The tool ran and its result is journaled.
    Ran,
    /// Its record already held the result: journaled without running again.
    Stored,
    /// Same operation id, other arguments: an error result is journaled.
    Conflict,
    /// Abandoned by a runner that is gone; the confirm query found it happened.
    Confirmed,
    /// Abandoned; the confirm query cannot tell: `outcome.ambiguous` is journaled.
    Ambiguous,
    /// Not run because the run's cancellation was requested.
    Cancelled,
    /// Not run: its approved target moved (`target.moved`); a fresh approval will be asked.
    Moved,
    /// A dispatch given back earlier (its target moved): nothing to do.
    Released,
    /// A live runner holds it, or its next attempt is not due yet; ask again after
    /// `retry_in_ms`.
    Busy { retry_in_ms: u64 },
    /// An attempt failed with an error its retry policy retries (`tool.attempt` is journaled);
    /// attempt `attempt` is due after `retry_in_ms`.
    Retrying { attempt: u32, retry_in_ms: u64 },
    /// Nothing done: the request is not what the journal decided.
    Refused { reason: String },
}

/// The tool service's answer to a resolve request: what handling it came to, or why it could
/// not be handled now (broker trouble, a request that does not parse; the next scan asks again).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ResolveReply {
    Handled(Handled),
    Failed { error: String },
}

/// A precondition query: where would this call's target be now?
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TargetQuery {
    pub run_id: RunId,
    pub tool: String,
    pub arguments: serde_json::Value,
}

/// The answer to a [`TargetQuery`]: the target's version, or none for a tool without a
/// precondition check. Unknown fields are refused, so a runner's refusal (`{"refused": …}`) is
/// never read as "no version".
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TargetAnswer {
    pub version: Option<String>,
}

/// Every answer the tool service gives a [`TargetQuery`] (`subjects::TOOL_INSPECT`): the
/// target's version, a refusal (no such run, or a tool its agent does not declare), or a query
/// that did not parse. An asker reads only [`TargetAnswer`]: the others are no version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum InspectReply {
    Version(TargetAnswer),
    Refused { refused: String },
    Invalid { error: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refused_precondition_query_is_not_an_answer() {
        assert!(serde_json::from_str::<TargetAnswer>(r#"{"refused": "no such run"}"#).is_err());
        let none: TargetAnswer = serde_json::from_str(r#"{"version": null}"#).expect("answer");
        assert_eq!(none.version, None);
    }

    #[test]
    fn every_inspect_reply_keeps_its_wire_shape() {
        let cases = [
            (
                InspectReply::Version(TargetAnswer {
                    version: Some("v1".into()),
                }),
                r#"{"version":"v1"}"#,
            ),
            (
                InspectReply::Refused {
                    refused: "no such run".into(),
                },
                r#"{"refused":"no such run"}"#,
            ),
            (
                InspectReply::Invalid {
                    error: "EOF".into(),
                },
                r#"{"error":"EOF"}"#,
            ),
        ];
        for (reply, wire) in cases {
            assert_eq!(serde_json::to_string(&reply).expect("JSON"), wire);
        }
    }

    #[test]
    fn a_refusal_reads_as_one() {
        let refused: Handled =
            serde_json::from_str(r#"{"handled":"refused","reason":"not journaled"}"#)
                .expect("an answer");
        assert!(matches!(refused, Handled::Refused { .. }));
        let busy = serde_json::to_string(&Handled::Busy { retry_in_ms: 5 }).expect("JSON");
        assert_eq!(busy, r#"{"handled":"busy","retry_in_ms":5}"#);
        let failed: ResolveReply = serde_json::from_str(r#"{"error":"no broker"}"#).expect("JSON");
        assert!(matches!(failed, ResolveReply::Failed { .. }));
        let ran: ResolveReply = serde_json::from_str(r#"{"handled":"ran"}"#).expect("JSON");
        assert_eq!(ran, ResolveReply::Handled(Handled::Ran));
    }
}
