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
//!
//! The module is split by role:
//! - `builtin`: Kedge's built-in tools and their schemas;
//! - `contract`: the verdict on a tool call and on a final answer ([`Contract`]);
//! - `retry` and `rules`: per-tool retry policies, their backoff and verdicts, and the rules a
//!   stored policy is held to;
//! - `attempt`: claim numbering and the next attempt of an operation under a retry policy;
//! - `limits`: the terms an operation runs under ([`RunLimits`]), carried on its requests.

mod attempt;
mod builtin;
mod contract;
mod limits;
mod retry;
mod rules;

pub use attempt::{NextAttempt, claim_dispatch, next_attempt, supersedes};
pub use builtin::{BUILTINS, Builtin, builtin};
pub use contract::{ArgumentError, Contract, Refusal, check_schema};
pub use limits::RunLimits;
pub use retry::{
    Backoff, GiveUp, MAX_BACKOFF_MS, MAX_MULTIPLIER, MAX_TOOL_ATTEMPTS, RetryPolicy,
    ToolErrorClass, Verdict,
};
