//! `kedge providers`: the fleet's view of each model endpoint (kedge_providers).

use std::process::ExitCode;

use kedge_runtime::Runtime;

use super::Output;

/// `kedge providers`: each model endpoint the fleet knows, from kedge_providers.
pub(super) async fn providers(rt: &Runtime, output: Output) -> anyhow::Result<ExitCode> {
    let providers = rt.providers().await?;
    let view = providers.snapshot();
    let paces = providers.paces();
    if output != Output::Text {
        let items: Vec<serde_json::Value> = view
            .iter()
            .map(|(id, b, waiting)| {
                serde_json::json!({"id": id, "breaker": b, "waiting_runs": waiting})
            })
            .collect();
        let out = serde_json::json!({"endpoints": items, "rate_limits": paces});
        println!("{}", serde_json::to_string_pretty(&out)?);
        return Ok(ExitCode::SUCCESS);
    }
    if view.is_empty() {
        println!("no model endpoint has met trouble");
    }
    for p in &paces {
        println!(
            "{} model {}: keeps to {} (configured: {}; named by the provider: {})",
            p.endpoint,
            p.model,
            p.limits(),
            p.configured,
            p.learned
        );
    }
    for (id, b, waiting) in &view {
        println!("{} [{id}]", b.endpoint);
        let since = b
            .opened_at
            .map(|t| format!(" since {t}"))
            .unwrap_or_default();
        let next = match (b.state, b.next_probe_at) {
            (kedge_runtime::provider::BreakerState::Open, Some(at)) => {
                format!(", next probe at {at} ({} sent)", b.probes)
            }
            _ => String::new(),
        };
        println!(
            "  {}{since}{next}; {waiting} run(s) waiting",
            b.state.as_str()
        );
        if !b.last_error.is_empty() {
            let trouble = b.trouble.map(|t| format!("{t}: ")).unwrap_or_default();
            println!("  last trouble: {trouble}{}", b.last_error);
        }
    }
    Ok(ExitCode::SUCCESS)
}
