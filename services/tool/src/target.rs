//! What a tool name refers to, and how each kind of tool runs, confirms and checks its target.

use kedge_core::ids::{OperationId, RunId};
use kedge_core::tools::ToolErrorClass;
use kedge_mcp::{McpError, Outcome, Pool};
use serde_json::Value;
use tokio::sync::watch;

use crate::builtin::{Builtin, Confirm, Env, Output};

/// A tool name, resolved.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    Builtin(Builtin),
    /// `<server>__<tool>`, `<server>` a configured MCP server.
    Mcp {
        server: String,
        tool: String,
    },
    Unknown,
}

/// How running an operation ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Ran {
    /// A result for the model; `stopped` when the run's cancel stopped it.
    Done { out: Output, stopped: bool },
    /// The connection to the MCP server died with the call in flight: it may or may not have
    /// taken effect.
    CutOff(String),
}

impl Target {
    pub fn of(name: &str, mcp: &Pool) -> Target {
        if let Some(b) = Builtin::by_name(name) {
            return Target::Builtin(b);
        }
        match name.split_once("__") {
            Some((server, tool)) if !tool.is_empty() && mcp.has_server(server) => Target::Mcp {
                server: server.to_owned(),
                tool: tool.to_owned(),
            },
            _ => Target::Unknown,
        }
    }

    /// The confirm query for an operation whose runner is gone; `None` when running it again is
    /// harmless (idempotent built-ins, unknown tools). An MCP tool is asked through its server's
    /// status tool when it has one (`mcp_status`).
    pub async fn confirm(&self, env: &Env, mcp: &Pool, op: &OperationId) -> Option<Confirm> {
        match self {
            Target::Builtin(t) if !t.idempotent() => Some(env.confirm(*t, op).await),
            Target::Builtin(_) | Target::Unknown => None,
            Target::Mcp { server, tool } => Some(mcp_status(env, mcp, server, tool, op).await),
        }
    }

    /// The confirm query asked before the call's deadline, when the tool's server can answer it
    /// then: its status tool sees calls in flight (`"kedge/sees_in_flight": true` in the status
    /// tool's `_meta`, docs/API.md "For MCP server authors"). `None` for any other target, or a
    /// server that does not declare it (or cannot be listed): the deadline is waited for.
    pub async fn early_confirm(&self, env: &Env, mcp: &Pool, op: &OperationId) -> Option<Confirm> {
        let Target::Mcp { server, tool } = self else {
            return None;
        };
        let tools = mcp.tools(server).await.ok()?;
        let declares = tools.iter().any(|t| {
            t.name == MCP_STATUS_TOOL
                && t.meta
                    .as_ref()
                    .and_then(|m| m.get(SEES_IN_FLIGHT_META_KEY))
                    .and_then(Value::as_bool)
                    == Some(true)
        });
        if !declares {
            return None;
        }
        Some(ask_status(env, mcp, server, tool, op).await)
    }

    /// The precondition check (see [`Env::target_version`]); MCP tools have none.
    pub async fn version(&self, env: &Env, run: &RunId, args: &Value) -> Option<String> {
        match self {
            Target::Builtin(t) => env.target_version(*t, run, args).await,
            Target::Mcp { .. } | Target::Unknown => None,
        }
    }

    /// Runs the operation until it ends or `stop` turns true (the run's cancel).
    pub async fn run(
        &self,
        env: &Env,
        mcp: &Pool,
        op: &OperationId,
        args: &Value,
        mut stop: watch::Receiver<bool>,
    ) -> Ran {
        let stopped = || Ran::Done {
            out: Output::error("stopped: the run's cancellation was requested"),
            stopped: true,
        };
        match self {
            Target::Builtin(t) => tokio::select! {
                out = env.run(*t, op, args) => Ran::Done { out, stopped: false },
                // Dropping the tool's future kills a `shell` child (kill_on_drop).
                _ = stop_requested(&mut stop) => stopped(),
            },
            Target::Mcp { server, tool } => {
                let arguments = match args {
                    Value::Object(map) => map.clone(),
                    Value::Null => serde_json::Map::new(),
                    other => {
                        return Ran::Done {
                            out: Output::error(format!(
                                "arguments must be a JSON object, got {other}"
                            )),
                            stopped: false,
                        };
                    }
                };
                let stop = async move { stop_requested(&mut stop).await };
                match mcp
                    .call(server, tool, arguments, &op.to_string(), env.timeout, stop)
                    .await
                {
                    // The tool's own answer (an error included): for the model.
                    Ok(Outcome::Completed { content, is_error }) => Ran::Done {
                        out: Output {
                            content: env.truncate(content),
                            is_error,
                            class: None,
                        },
                        stopped: false,
                    },
                    Ok(Outcome::Stopped) => Ran::Done {
                        out: Output::error(
                            "stopped: the run's cancellation was requested; \
                             the MCP server was sent a cancel",
                        ),
                        stopped: true,
                    },
                    Ok(Outcome::TimedOut) => Ran::Done {
                        out: Output::failed(
                            format!(
                                "timed out after {} ms; the MCP server was sent a cancel \
                                 (it may still finish the work)",
                                env.timeout.as_millis()
                            ),
                            ToolErrorClass::Timeout,
                        ),
                        stopped: false,
                    },
                    // Never sent: nothing happened. A server that cannot be reached now may be
                    // reachable in a moment; one that is not configured never will be.
                    Err(e) if !e.may_have_run() => Ran::Done {
                        out: match e {
                            McpError::Connect { .. } => {
                                Output::failed(format!("not run: {e}"), ToolErrorClass::Transient)
                            }
                            _ => Output::error(format!("not run: {e}")),
                        },
                        stopped: false,
                    },
                    Err(e) => Ran::CutOff(format!(
                        "the MCP call `{tool}` on `{server}` was cut off ({e}); \
                         whether it took effect cannot be known"
                    )),
                }
            }
            Target::Unknown => Ran::Done {
                out: Output::error("unknown tool"),
                stopped: false,
            },
        }
    }
}

/// Resolves when the run's cancel turns `stop` true; never when its sender is gone (that is
/// no cancel).
async fn stop_requested(stop: &mut watch::Receiver<bool>) {
    if stop.wait_for(|s| *s).await.is_err() {
        std::future::pending::<()>().await;
    }
}

/// The tool an MCP server may offer to answer Kedge's confirm query (docs/ARCHITECTURE.md,
/// "Status queries for MCP tools"): called with `{"operation_id": "op_…", "tool": "<name>"}`, it
/// answers one text item holding `{"status": "confirmed", "content": "…", "is_error": false}`,
/// `{"status": "not_found"}`, `{"status": "in_flight"}` or `{"status": "ambiguous", "detail": "…"}`.
pub const MCP_STATUS_TOOL: &str = "kedge_status";

/// The key in [`MCP_STATUS_TOOL`]'s `_meta` by which a server declares that its status query
/// sees calls in flight (answers `in_flight` for a call it is still running): see
/// [`Target::early_confirm`].
pub const SEES_IN_FLIGHT_META_KEY: &str = "kedge/sees_in_flight";

/// Asks `server`'s [`MCP_STATUS_TOOL`] what became of operation `op` of `tool`, whose runner
/// died with the call in flight. Anything but a well-formed answer (no such tool, an error, a
/// timeout, an answer that does not parse or names another status) is `Ambiguous`: a person
/// decides, as without the convention. The server's `content` is cut like any tool output.
async fn mcp_status(env: &Env, mcp: &Pool, server: &str, tool: &str, op: &OperationId) -> Confirm {
    // What the server says is journaled (outcome.ambiguous): cut like any tool output.
    let ambiguous = |why: String| cut_off_ambiguous(env, server, tool, why);
    match mcp.tools(server).await {
        Ok(tools) if tools.iter().any(|t| t.name == MCP_STATUS_TOOL) => {}
        Ok(_) => {
            return ambiguous(format!(
                "the server has no `{MCP_STATUS_TOOL}` tool to say whether it took effect"
            ));
        }
        Err(e) => return ambiguous(format!("its status could not be asked: {e}")),
    }
    ask_status(env, mcp, server, tool, op).await
}

/// What a person is told when the confirm query could not settle a cut-off MCP call.
fn cut_off_ambiguous(env: &Env, server: &str, tool: &str, why: String) -> Confirm {
    Confirm::Ambiguous(env.truncate(format!(
        "the MCP call `{tool}` on `{server}` was cut off with its runner, and {why}"
    )))
}

/// Calls `server`'s [`MCP_STATUS_TOOL`] (known to be offered) about operation `op` of `tool`, and
/// reads its answer (see [`mcp_status`]).
async fn ask_status(env: &Env, mcp: &Pool, server: &str, tool: &str, op: &OperationId) -> Confirm {
    let ambiguous = |why: String| cut_off_ambiguous(env, server, tool, why);
    let mut arguments = serde_json::Map::new();
    arguments.insert("operation_id".into(), Value::from(op.to_string()));
    arguments.insert("tool".into(), Value::from(tool));
    // The status call carries its own id in `_meta`: a server that deduplicates calls by the
    // operation id must not take the query for the operation (and answer a later re-run from it).
    let asked = mcp
        .call(
            server,
            MCP_STATUS_TOOL,
            arguments,
            &format!("{op}:status"),
            env.timeout,
            std::future::pending(),
        )
        .await;
    let text = match asked {
        Ok(Outcome::Completed {
            content,
            is_error: false,
        }) => content,
        Ok(Outcome::Completed { content, .. }) => {
            return ambiguous(format!("`{MCP_STATUS_TOOL}` answered an error: {content}"));
        }
        Ok(other) => return ambiguous(format!("`{MCP_STATUS_TOOL}` did not answer: {other:?}")),
        Err(e) => return ambiguous(format!("`{MCP_STATUS_TOOL}` failed: {e}")),
    };
    match parse_status(&text) {
        Some(StatusAnswer::Confirmed { content, is_error }) => Confirm::Confirmed(Output {
            content: env.truncate(content),
            is_error,
            class: None,
        }),
        Some(StatusAnswer::NotFound) => Confirm::NotFound,
        Some(StatusAnswer::InFlight) => Confirm::InFlight,
        Some(StatusAnswer::Ambiguous { detail }) => ambiguous(format!(
            "its server cannot tell whether it took effect: {detail}"
        )),
        None => ambiguous(format!(
            "`{MCP_STATUS_TOOL}` answered something that is not a status: {}",
            text.chars().take(200).collect::<String>()
        )),
    }
}

/// A status tool's answer.
#[derive(Debug, Clone, PartialEq, Eq, serde::Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
enum StatusAnswer {
    Confirmed {
        content: String,
        #[serde(default)]
        is_error: bool,
    },
    NotFound,
    InFlight,
    Ambiguous {
        #[serde(default)]
        detail: String,
    },
}

fn parse_status(text: &str) -> Option<StatusAnswer> {
    let value: Value = serde_json::from_str(text.trim()).ok()?;
    // Only an object: serde would also take `["not_found"]` for a tagged enum.
    value
        .is_object()
        .then(|| serde_json::from_value(value).ok())
        .flatten()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_answer_parses_only_when_well_formed() {
        assert_eq!(
            parse_status(r#"{"status": "confirmed", "content": "charged 5"}"#),
            Some(StatusAnswer::Confirmed {
                content: "charged 5".into(),
                is_error: false
            })
        );
        assert_eq!(
            parse_status(r#" {"status": "not_found"} "#),
            Some(StatusAnswer::NotFound)
        );
        assert_eq!(
            parse_status(r#"{"status": "in_flight"}"#),
            Some(StatusAnswer::InFlight)
        );
        assert_eq!(
            parse_status(r#"{"status": "ambiguous", "detail": "in flight"}"#),
            Some(StatusAnswer::Ambiguous {
                detail: "in flight".into()
            })
        );
        for bad in [
            "",
            "confirmed",
            r#"{"status": "done"}"#,
            r#"{"status": "inflight"}"#,
            r#"{"status": "confirmed"}"#,
            r#"["not_found"]"#,
        ] {
            assert_eq!(parse_status(bad), None, "{bad}");
        }
    }
}
