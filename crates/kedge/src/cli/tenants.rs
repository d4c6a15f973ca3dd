//! `kedge tenants usage`: each tenant's use of its quotas (kedge_quotas, docs/RUNBOOK.md
//! "Tenant quotas").

use std::process::ExitCode;

use clap::Subcommand;
use kedge_core::ids::TenantId;
use kedge_runtime::Runtime;
use kedge_runtime::quota::TenantUsage;

use super::Output;

#[derive(Debug, Subcommand)]
pub enum TenantsCmd {
    /// Each tenant's use of its quotas, counted once for the fleet: runs started this minute,
    /// unfinished runs, model tokens and cost today, against its limits (0: none).
    Usage {
        /// Only this tenant (default: every tenant configured or counted).
        tenant: Option<TenantId>,
        /// `text` (a table, default) or `json` (one array).
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
}

pub(super) async fn tenants(rt: &Runtime, cmd: TenantsCmd) -> anyhow::Result<ExitCode> {
    let TenantsCmd::Usage { tenant, output } = cmd;
    let quotas = rt.quotas().await?;
    let tenants = match tenant {
        Some(t) => vec![t],
        None => quotas.tenants().await?,
    };
    let mut rows = Vec::with_capacity(tenants.len());
    for t in &tenants {
        rows.push(quotas.usage(t).await?);
    }
    if output != Output::Text {
        println!("{}", serde_json::to_string_pretty(&rows)?);
        return Ok(ExitCode::SUCCESS);
    }
    if !quotas.enabled() {
        println!("no tenant has a quota (quotas in docs/CONFIG.md); nothing is counted");
    }
    println!(
        "{:<24} {:>14} {:>12} {:>24} {:>22}",
        "TENANT", "RUNS/MINUTE", "ACTIVE", "TOKENS TODAY", "COST TODAY"
    );
    for u in &rows {
        println!("{}", line(u));
    }
    if let Some(u) = rows.first() {
        println!("(the day window rolls in {} s)", u.day_ends_in_secs);
    }
    Ok(ExitCode::SUCCESS)
}

/// `used/limit`, or `used/-` without a limit.
fn of(used: String, limit: String, set: bool) -> String {
    format!("{used}/{}", if set { limit } else { "-".to_owned() })
}

fn line(u: &TenantUsage) -> String {
    let l = &u.limits;
    format!(
        "{:<24} {:>14} {:>12} {:>24} {:>22}",
        u.tenant.to_string(),
        of(
            u.runs_this_minute.to_string(),
            l.runs_per_minute.to_string(),
            l.runs_per_minute > 0
        ),
        of(
            u.active_runs.to_string(),
            l.max_active_runs.to_string(),
            l.max_active_runs > 0
        ),
        of(
            u.today.tokens.to_string(),
            l.tokens_per_day.to_string(),
            l.tokens_per_day > 0
        ),
        of(
            format!("{:.4}", u.today.cost),
            format!("{:.4} {}", l.cost_per_day, u.currency),
            l.cost_per_day > 0.0
        ),
    )
}
