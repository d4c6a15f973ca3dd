//! Kedge's application layer: what outside parties may do to runs, and what they see of them.
//!
//! - [`inputs`]: every input an outside party may append (message, answer, cancel, approval,
//!   callback), validated and given its dedup id ([`inputs::InputId`]) in one place; the bridge,
//!   the tenant gateway and the CLI all append through it.
//! - [`tasks`]: the client side of the task protocol (submit, intake's answer, the run id a task
//!   without one gets).
//! - [`view`]: what clients see of a run (public events, event JSON, the run view), shared by the
//!   HTTP bridge, the tenant gateway and the CLI.
//! - [`approvals`]: recording a person's approval decision.
//! - [`callbacks`]: delivering external callbacks to the runs that wait for them.
//! - [`schedules`]: what a tenant may do to its schedules (put, list, pause, resume, delete,
//!   trigger), shared by the bridge, the tenant gateway and the CLI.
//!
//! It imports `kedge-core`, `kedge-journal` and `kedge-runtime` (the process plumbing: the
//! [`kedge_runtime::Runtime`] handles, traces, rejections) and nothing above them; the runtime
//! never imports it, and the services and the binary that take outside requests do
//! (docs/ARCHITECTURE.md "Map of the house").

pub mod approvals;
pub mod callbacks;
pub mod inputs;
pub mod schedules;
pub mod tasks;
pub mod view;
