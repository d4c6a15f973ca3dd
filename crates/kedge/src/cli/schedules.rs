//! `kedge schedules`: a tenant's schedules (docs/RUNBOOK.md, "Schedules"), through
//! `kedge_app::schedules`, the same code as the bridge's and the gateway's.

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand};
use kedge_app::schedules::{self, Op};
use kedge_core::ids::TenantId;
use kedge_runtime::Runtime;

/// `kedge schedules …`
#[derive(Debug, Subcommand)]
pub enum SchedulesCmd {
    /// Create or replace schedule NAME from a JSON file (`-` for standard input): `agent`,
    /// `task` (input, metadata, budget), `cron` or `interval_secs`, `time_zone`, `overlap`,
    /// `catch_up`, `catch_up_window_secs`, `catch_up_max` (docs/API.md, "Schedules").
    Put {
        name: String,
        file: PathBuf,
        #[command(flatten)]
        tenant: TenantArg,
    },
    /// The tenant's schedules with their next fire time.
    List {
        #[command(flatten)]
        tenant: TenantArg,
        /// Print the JSON answer.
        #[arg(long)]
        json: bool,
    },
    /// One schedule (JSON).
    Get {
        name: String,
        #[command(flatten)]
        tenant: TenantArg,
    },
    /// Stop firing (no instant fires while paused).
    Pause {
        name: String,
        #[command(flatten)]
        tenant: TenantArg,
    },
    /// Fire again from now on (instants missed while paused do not fire).
    Resume {
        name: String,
        #[command(flatten)]
        tenant: TenantArg,
    },
    /// Delete the schedule (its runs go on).
    Delete {
        name: String,
        #[command(flatten)]
        tenant: TenantArg,
    },
    /// Fire once now, whatever runs.
    Trigger {
        name: String,
        #[command(flatten)]
        tenant: TenantArg,
    },
}

#[derive(Debug, Args)]
pub struct TenantArg {
    /// The tenant whose schedule it is.
    #[arg(long, default_value = kedge_core::subjects::DEFAULT_TENANT)]
    tenant: TenantId,
}

/// Runs `kedge schedules …`.
pub(super) async fn schedules_command(rt: &Runtime, cmd: SchedulesCmd) -> anyhow::Result<ExitCode> {
    let mut body = Vec::new();
    let mut table = false;
    let (tenant, op) = match cmd {
        SchedulesCmd::Put { name, file, tenant } => {
            body = if file.as_os_str() == "-" {
                let mut b = Vec::new();
                std::io::Read::read_to_end(&mut std::io::stdin(), &mut b)?;
                b
            } else {
                std::fs::read(&file)?
            };
            (tenant, Op::Put(name))
        }
        SchedulesCmd::List { tenant, json } => {
            table = !json;
            (tenant, Op::List)
        }
        SchedulesCmd::Get { name, tenant } => (tenant, Op::Get(name)),
        SchedulesCmd::Pause { name, tenant } => (tenant, Op::Pause(name)),
        SchedulesCmd::Resume { name, tenant } => (tenant, Op::Resume(name)),
        SchedulesCmd::Delete { name, tenant } => (tenant, Op::Delete(name)),
        SchedulesCmd::Trigger { name, tenant } => (tenant, Op::Trigger(name)),
    };
    match schedules::apply(rt, &tenant.tenant, op, &body).await {
        Ok(v) if table => {
            print_table(&v);
            Ok(ExitCode::SUCCESS)
        }
        Ok(v) => {
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(ExitCode::SUCCESS)
        }
        Err(e) => {
            let field = match &e {
                kedge_runtime::schedules::ScheduleError::Invalid(r) => format!(" ({})", r.field),
                _ => String::new(),
            };
            eprintln!("refused{field}: {e}");
            Ok(ExitCode::from(2))
        }
    }
}

fn print_table(v: &serde_json::Value) {
    let empty = Vec::new();
    let items = v["schedules"].as_array().unwrap_or(&empty);
    if items.is_empty() {
        println!("no schedules");
        return;
    }
    println!("NAME\tAGENT\tWHEN\tNEXT FIRE\tSTATE\tFIRED\tSKIPPED\tLAST RUN");
    for s in items {
        let when = s["schedule"]["cron"]
            .as_str()
            .map(|c| {
                format!(
                    "cron {c} {}",
                    s["schedule"]["time_zone"].as_str().unwrap_or("")
                )
            })
            .or_else(|| {
                s["schedule"]["interval_secs"]
                    .as_u64()
                    .map(|i| format!("every {i}s"))
            })
            .unwrap_or_default();
        println!(
            "{}\t{}\t{}\t{}\t{}\t{}\t{}\t{}",
            s["name"].as_str().unwrap_or(""),
            s["schedule"]["agent"].as_str().unwrap_or(""),
            when,
            s["next_fire_at"].as_str().unwrap_or("-"),
            if s["paused"].as_bool() == Some(true) {
                "paused"
            } else {
                "active"
            },
            s["state"]["fired"].as_u64().unwrap_or(0),
            s["state"]["skipped"].as_u64().unwrap_or(0),
            s["state"]["last_run"].as_str().unwrap_or("-"),
        );
    }
}
