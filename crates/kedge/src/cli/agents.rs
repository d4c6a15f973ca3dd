//! `kedge agents put|get|list|history`: agent definitions in kedge_agents.

use std::process::ExitCode;

use anyhow::Context;
use kedge_core::agent::AgentDefinition;
use kedge_runtime::Runtime;

use super::AgentsCmd;

pub(super) async fn agents(rt: Runtime, cmd: AgentsCmd) -> anyhow::Result<ExitCode> {
    match cmd {
        AgentsCmd::Put { file } => {
            let bytes = std::fs::read(&file).with_context(|| format!("read {}", file.display()))?;
            let def = AgentDefinition::parse(&bytes)?;
            // The operator's model policy: caught here, where the author can fix it, rather
            // than at the run's first step.
            rt.config
                .check_model(
                    &kedge_model::api_key_env(&def),
                    def.model.base_url.as_deref(),
                )
                .map_err(|e| anyhow::anyhow!("{}: {e}", def.name))?;
            for (i, f) in def.fallbacks.iter().enumerate() {
                rt.config
                    .check_model(
                        &kedge_model::fallback_key_env(f),
                        f.model.base_url.as_deref(),
                    )
                    .map_err(|e| anyhow::anyhow!("{}: fallbacks[{i}]: {e}", def.name))?;
            }
            let revision = rt.agents.put(&def).await?;
            println!("{} revision {revision}", def.name);
        }
        AgentsCmd::Get { name, revision } => {
            let def = match revision {
                Some(r) => rt.agents.at_revision(&name, r).await?,
                None => rt.agents.latest(&name).await?.1,
            };
            println!("{}", serde_json::to_string_pretty(&*def)?);
        }
        AgentsCmd::List => {
            for (name, revision) in rt.agents.list().await? {
                println!("{name}\trevision {revision}");
            }
        }
        AgentsCmd::History { name } => {
            for revision in rt.agents.history(&name).await? {
                println!("{revision}");
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}
