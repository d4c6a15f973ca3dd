//! `kedge mcp tools`: a configured MCP server's tools as agent-definition tool entries.

use std::process::ExitCode;

use anyhow::bail;
use kedge_runtime::Config;

/// `kedge mcp tools`.
pub(super) async fn mcp_tools(config: &Config, server: &str) -> anyhow::Result<ExitCode> {
    // Through the tool service's sandbox, as the tool service would start it.
    let pool = kedge_tool::sandbox::mcp_pool(config);
    if !pool.has_server(server) {
        bail!(
            "no MCP server `{server}` in mcp_servers (configured: {})",
            pool.server_names().collect::<Vec<_>>().join(", ")
        );
    }
    let tools = pool.tools(server).await;
    pool.close().await;
    let specs = mcp_tool_specs(server, tools?);
    println!("{}", serde_json::to_string_pretty(&specs)?);
    Ok(ExitCode::SUCCESS)
}

/// A server's tools as agent-definition tool entries. Tools whose `<server>__<tool>` name a model
/// API would refuse (`[a-zA-Z0-9_-]{1,64}`) are left out, with a note on stderr.
pub(super) fn mcp_tool_specs(
    server: &str,
    tools: Vec<kedge_mcp::ToolInfo>,
) -> Vec<serde_json::Value> {
    tools
        .into_iter()
        .filter_map(|t| {
            let name = format!("{server}__{}", t.name);
            let valid = name.len() <= 64
                && name
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
            if !valid {
                eprintln!(
                    "skipped `{}`: `{name}` is not a valid model tool name",
                    t.name
                );
                return None;
            }
            Some(serde_json::json!({
                "name": name,
                "description": t.description.unwrap_or_default(),
                "parameters": t.input_schema,
            }))
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mcp_tools_become_tool_entries_and_unusable_names_are_left_out() {
        let info = |name: &str| kedge_mcp::ToolInfo {
            name: name.into(),
            description: Some(format!("does {name}")),
            input_schema: serde_json::json!({"type": "object"}),
            meta: None,
        };
        let specs = mcp_tool_specs(
            "time",
            vec![
                info("get_current_time"),
                info("bad.name"),
                info(&"x".repeat(60)),
            ],
        );
        assert_eq!(specs.len(), 1);
        assert_eq!(specs[0]["name"], "time__get_current_time");
        assert_eq!(
            specs[0]["parameters"],
            serde_json::json!({"type": "object"})
        );
        let def: kedge_core::agent::ToolSpec =
            serde_json::from_value(specs[0].clone()).expect("a valid agent tool entry");
        assert_eq!(def.description, "does get_current_time");
    }
}
