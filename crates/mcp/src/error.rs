//! Errors of the pool. A tool that ran and failed is not one of them: that is an
//! [`Outcome::Completed`](crate::Outcome::Completed) with `is_error: true`, for the model to read.

use std::time::Duration;

/// Why the pool could not give an answer from the server.
///
/// What each means for a [`Pool::call`](crate::Pool::call) (see also [`McpError::may_have_run`]):
/// - [`UnknownServer`](Self::UnknownServer), [`Connect`](Self::Connect): the request was never
///   sent; the tool did not run. Safe to retry.
/// - [`Disconnected`](Self::Disconnected): the connection died while the request was in flight
///   (child exited, pipe broke, HTTP transport failed). **The outcome is unknown**: the server may
///   have run the tool, side effects included, and only the answer was lost. For a tool that is not
///   idempotent the caller must treat the call as ambiguous (ask, reconcile, or rely on the server
///   deduplicating by the `kedge/operation_id` sent in `_meta`), not blindly retry.
/// - [`Protocol`](Self::Protocol): the server answered something that is not an MCP tool result.
///   It did receive the request, so this is ambiguous too.
///
/// The dead connection is dropped from the pool in every case; the next call reconnects.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum McpError {
    /// No server of that name is configured.
    #[error("no MCP server named {0:?} is configured")]
    UnknownServer(String),
    /// Starting the child or the MCP handshake (`initialize`) failed or timed out.
    #[error("cannot connect to MCP server {server:?}: {reason}")]
    Connect {
        /// The configured server name.
        server: String,
        /// What went wrong (for stdio, with the last lines of the child's stderr).
        reason: String,
    },
    /// The connection died with the request in flight: the outcome of a call is unknown.
    #[error("connection to MCP server {server:?} lost, outcome unknown: {reason}")]
    Disconnected {
        /// The configured server name.
        server: String,
        /// What went wrong.
        reason: String,
    },
    /// The server's answer broke the protocol (not a tool result, or an error for `tools/list`).
    #[error("MCP server {server:?} broke the protocol: {reason}")]
    Protocol {
        /// The configured server name.
        server: String,
        /// What went wrong.
        reason: String,
    },
    /// A request that has no caller-given timeout (`tools/list`) went unanswered for this long;
    /// it was cancelled on the server.
    #[error("MCP server {server:?} did not answer within {after:?}")]
    TimedOut {
        /// The configured server name.
        server: String,
        /// The time waited.
        after: Duration,
    },
}

impl McpError {
    /// The configured name of the server concerned.
    pub fn server(&self) -> &str {
        match self {
            Self::UnknownServer(server)
            | Self::Connect { server, .. }
            | Self::Disconnected { server, .. }
            | Self::Protocol { server, .. }
            | Self::TimedOut { server, .. } => server,
        }
    }

    /// Whether the server may have received the request, and so may have run the tool: `false`
    /// only when it certainly did not (unknown server, no connection). A caller retrying a
    /// non-idempotent tool must treat `true` as "maybe done".
    pub fn may_have_run(&self) -> bool {
        match self {
            Self::UnknownServer(_) | Self::Connect { .. } => false,
            Self::Disconnected { .. } | Self::Protocol { .. } | Self::TimedOut { .. } => true,
        }
    }
}
