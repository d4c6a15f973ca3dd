//! The MCP client of Kedge's tool service: calls tools on configured
//! [Model Context Protocol](https://modelcontextprotocol.io) servers, with stops and timeouts that
//! reach the server, and errors that say whether a tool may have run.
//!
//! Built on the official SDK, `rmcp`, client side only.
//!
//! # The pool
//!
//! A [`Pool`] holds one session per configured server ([`ServerConfig`]: a child process speaking
//! stdio, or a Streamable HTTP endpoint), keyed by a name of the caller's choosing.
//!
//! - **Lazy.** Nothing starts until the first [`Pool::tools`] or [`Pool::call`] for that server.
//! - **One session per server, shared.** Concurrent calls go over the same session, multiplexed
//!   by JSON-RPC request id. Concurrent first calls wait for one connect: one child is started,
//!   not one per caller.
//! - **Reopened after death.** A session whose transport ended (child exited, pipe broke, HTTP
//!   transport failed) is dropped; the next use opens a new one. A request that had not been
//!   written yet when the session turned out dead is retried once on the new session.
//! - **Closed explicitly.** [`Pool::close`] shuts children down (stdin closed, then SIGTERM, then
//!   SIGKILL to the child's process group) and deletes HTTP sessions. Dropping the pool inside a
//!   Tokio runtime also ends children, without waiting.
//! - Cheap to [`Clone`]; every clone is the same pool.
//! - **Launched, not spawned blindly.** A stdio server's process is made by the pool's
//!   [`Launcher`]: [`Direct`] (what [`Pool::new`] uses) runs it unconfined with a cleared
//!   environment and refuses a server whose configuration asks for a sandbox
//!   ([`StdioSandbox`]); [`Pool::with_launcher`] takes another, e.g. the tool service's, which
//!   confines such servers in its sandbox. This crate does not know how a sandbox is made.
//!
//! # Calls, stops and timeouts
//!
//! [`Pool::call`] sends `tools/call` with the caller's operation id in the request's `_meta`
//! under `"kedge/operation_id"` ([`OPERATION_ID_META_KEY`]), so a server that cares can
//! deduplicate a retried operation, and the call's deadline (RFC 3339) under `"kedge/deadline"`
//! ([`DEADLINE_META_KEY`]), after which the server should not start it. It then waits for the
//! first of:
//!
//! - the answer → [`Outcome::Completed`]. A tool's own failure (`isError: true`) and a JSON-RPC
//!   error answer (e.g. `-32602` unknown tool from the Python servers; the Node servers answer
//!   unknown tools with `isError: true` instead) are both `Completed { is_error: true, .. }`:
//!   they are for the model to read. The JSON-RPC one reads `"MCP error <code>: <message>"`.
//! - the `stop` future → the client sends `notifications/cancelled` with the request's id and a
//!   reason, and returns [`Outcome::Stopped`].
//! - the `timeout` → the same cancel, and [`Outcome::TimedOut`].
//!
//! Cancellation in MCP is advisory: the server may already have done part or all of the work,
//! and a late answer is discarded. Dropping the `call` future mid-request sends the cancel too.
//!
//! Content is rendered to one string: text blocks joined with `"\n"`; other blocks (image,
//! audio, resources) as a one-line JSON description (type, MIME type, size, URI), never dropped;
//! `structuredContent` as JSON when there is no text.
//!
//! # Errors and side effects
//!
//! [`McpError::UnknownServer`] and [`McpError::Connect`] mean the request was never sent: the
//! tool did not run. [`McpError::Disconnected`] means the session died with the request in
//! flight: **the tool may or may not have run**, with its side effects, and only the answer is
//! lost. A caller must treat it as ambiguous for tools that are not idempotent — it must not
//! retry them blindly. [`McpError::may_have_run`] gives the distinction.
//!
//! # Tolerated server quirks
//!
//! `notifications/tools/list_changed` sent before a `tools/list` answer (server-everything) is
//! harmless; it only invalidates the SDK's tool-list cache. Progress notifications are ignored.
//! Server→client requests (sampling, roots, elicitation) are refused: the pool declares no
//! client capabilities.
//!
//! # Observability
//!
//! Spans `mcp_call` (fields `server`, `tool`, `operation_id`, `request_id`, `pid`), `mcp_tools`
//! and `mcp_close`. A child's stderr is logged at debug level under target `kedge_mcp::stderr`,
//! and its last lines are part of a connect error.

mod connection;
mod content;
mod error;
mod launch;
mod pool;

pub use error::McpError;
/// How to reach a server: plain data in the core, so that a configuration holds it without linking
/// this client.
pub use kedge_core::config::mcp::{ServerConfig, StdioSandbox};
pub use launch::{Direct, Launch, Launcher, direct_command};
pub use pool::{
    DEADLINE_META_KEY, DEFAULT_CONNECT_TIMEOUT, OPERATION_ID_META_KEY, Outcome, Pool, ToolInfo,
};
