//! The MCP servers the tool service calls (`mcp_servers`): `KEDGE_MCP_SERVERS`, the check of the
//! servers' names, and `--dump-config`'s redaction of stdio servers' `env`. docs/CONFIG.md "MCP
//! servers (`mcp_servers`)".

use kedge_core::config::mcp::ServerConfig;

use super::{Config, ConfigError, REDACTED};

/// `mcp_servers` as `--dump-config` prints it: each stdio server's `env` values redacted.
pub(super) fn redacted_mcp_env<S: serde::Serializer>(
    servers: &std::collections::BTreeMap<String, ServerConfig>,
    s: S,
) -> Result<S::Ok, S::Error> {
    let shown: std::collections::BTreeMap<&String, ServerConfig> = servers
        .iter()
        .map(|(name, config)| {
            let config = match config {
                ServerConfig::Stdio {
                    command,
                    args,
                    env,
                    sandbox,
                } => ServerConfig::Stdio {
                    command: command.clone(),
                    args: args.clone(),
                    env: env
                        .keys()
                        .map(|k| (k.clone(), REDACTED.to_owned()))
                        .collect(),
                    sandbox: sandbox.clone(),
                },
                other => other.clone(),
            };
            (name, config)
        })
        .collect();
    serde::Serialize::serialize(&shown, s)
}

impl Config {
    /// Applies `KEDGE_MCP_SERVERS`, a JSON object of server configurations.
    pub(super) fn apply_mcp_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_MCP_SERVERS") {
            self.mcp_servers = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_MCP_SERVERS",
                reason: format!("not a JSON object of server configurations: {e}"),
            })?;
        }
        Ok(())
    }

    /// Server names are letters, digits and `-`, so that a tool `<server>__<tool>` splits one way.
    pub(super) fn check_mcp_servers(&self) -> Result<(), ConfigError> {
        if let Some(bad) = self.mcp_servers.keys().find(|name| {
            name.is_empty() || !name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
        }) {
            return Err(ConfigError::Invalid {
                field: "mcp_servers",
                reason: format!(
                    "server name `{bad}`: use letters, digits and `-` (tools are named `<server>__<tool>`)"
                ),
            });
        }
        Ok(())
    }
}
