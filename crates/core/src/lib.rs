//! Kedge's pure core. No I/O, no clock, no randomness except id generation at the edges.
//!
//! - [`ids`]: typed identifiers with prefixed string forms.
//! - [`event`]: the journal envelope and every event type, split into decisions and inputs.
//! - [`subjects`]: stream, bucket and subject names (the broker layout).
//! - [`machine`]: the run state machine as one declared transition table.
//! - [`fold`](mod@fold): `fold(journal) -> RunState`.
//! - [`decide`](mod@decide): what the step service should do next, as pure functions of the state.
//! - [`agent`]: agent definitions (prompt, model, tools, policy, budget).
//! - [`child`]: child runs (`run_agent`): the verdict on a call, the child's bundle and budget,
//!   and the result a child gives its parent.
//! - [`concurrency`]: concurrency keys and priorities: key templates, the waiting order, the
//!   slot record's transitions.
//! - [`config`]: the timeouts and the relations between them; how to reach an MCP server
//!   ([`config::mcp`]).
//! - [`task`]: the task submission and its validation.
//! - [`tools`]: the built-in tools' schemas and a run's tool contract (what the model may call,
//!   with what arguments).
//! - [`settings`]: model settings (sampling, tool choice, thinking, caching) and prices.
//! - [`schema`]: the JSON Schemas under `schemas/`, generated from these types.
//!
//! Invariant: a run's state is a function of its journal alone (principle 1); everything
//! time- or configuration-dependent arrives as a recorded event or in the frozen run bundle.

pub mod admission;
pub mod agent;
pub mod answers;
pub mod bounded;
pub mod child;
pub mod compensation;
pub mod concurrency;
pub mod config;
pub mod context;
pub mod decide;
pub mod event;
pub mod fairness;
#[cfg(any(test, feature = "test-util"))]
pub mod fixtures;
pub mod fold;
pub mod ids;
pub mod machine;
pub mod quota;
pub mod replay;
pub mod schedule;
pub mod schema;
pub mod settings;
pub mod subjects;
pub mod task;
pub mod tools;

pub use decide::{ModelResponse, Next, StepPlan, complete_step, decide};
pub use event::{
    Decision, DecisionEnvelope, Draft, Envelope, Event, EventKind, EventType, Input, InputEnvelope,
};
pub use fold::{ChatMessage, FoldError, RunState, fold};
pub use ids::{Attempt, OperationId, RunId, StepNo};
pub use machine::{RunStatus, TransitionError};
