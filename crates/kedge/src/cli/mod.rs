//! Command-line parsing and the subcommands: the clap command tree and [`run`], the dispatcher;
//! each subcommand is a function in one of the modules below (`serving`: `kedge serve`, a call
//! into `kedge_serve`; `runs`: reading runs; `inputs`: submitting and steering them; `dead`,
//! `agents`, `providers`, `mcp`).

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kedge_core::ids::{AgentName, QuestionId, RunId};
use kedge_runtime::{Config, Runtime};

mod serving;
#[cfg(feature = "mock-llm")]
use serving::mock_llm;
use serving::{layout, serve_command};
// The services `kedge serve` runs, named on its command line.
use kedge_serve::Service;

mod runs;
use runs::{journal, list_runs, purge, rebuild, show_run, status, watch};

mod inputs;
use inputs::{approve, cancel, message, resolve, send_answer, submit_command};
// For `kedge demo` (demo.rs).
#[cfg(feature = "mock-llm")]
pub use inputs::submit;

mod dead;
use dead::dead;

mod agents;
use agents::agents;

mod providers;
use providers::providers;

mod tenants;
use tenants::{TenantsCmd, tenants};

mod mcp;
use mcp::mcp_tools;

mod schedules;
use schedules::{SchedulesCmd, schedules_command};

#[derive(Debug, Parser)]
#[command(
    name = "kedge",
    version,
    about = "Durable execution for long-running AI agents, on NATS JetStream"
)]
pub struct Cli {
    /// JSON configuration file (layered over the defaults, under KEDGE_* variables and flags).
    #[arg(long, global = true, env = "KEDGE_CONFIG")]
    pub config: Option<PathBuf>,
    /// NATS server URL(s), comma-separated (overrides the file, the context and KEDGE_NATS_URL).
    #[arg(long, global = true)]
    pub nats_url: Option<String>,
    /// A `nats` CLI context: $XDG_CONFIG_HOME/nats/context/NAME.json (else NATS_CONTEXT).
    #[arg(long, global = true, value_name = "NAME")]
    pub context: Option<String>,
    /// NATS user credentials (.creds) file.
    #[arg(long, global = true, value_name = "FILE")]
    pub creds: Option<PathBuf>,
    /// File holding a NATS user nkey seed (SU…).
    #[arg(long, global = true, value_name = "FILE")]
    pub nkey: Option<PathBuf>,
    /// NATS user name (with --password or KEDGE_NATS_PASSWORD).
    #[arg(long, global = true)]
    pub user: Option<String>,
    /// NATS password (visible to other local users in the process list: prefer
    /// KEDGE_NATS_PASSWORD).
    #[arg(long, global = true)]
    pub password: Option<kedge_runtime::Secret>,
    /// NATS authentication token (prefer KEDGE_NATS_TOKEN). Not `--token`: that is `approve`'s
    /// approver token.
    #[arg(long, global = true)]
    pub nats_token: Option<kedge_runtime::Secret>,
    /// CA certificate (PEM) that signed the NATS servers' certificates; requires TLS.
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_ca: Option<PathBuf>,
    /// TLS client certificate (PEM), with --tls-key.
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_cert: Option<PathBuf>,
    /// Private key (PEM) of --tls-cert.
    #[arg(long, global = true, value_name = "FILE")]
    pub tls_key: Option<PathBuf>,
    /// Print the effective configuration and exit.
    #[arg(long, global = true)]
    pub dump_config: bool,
    /// Log as JSON lines.
    #[arg(long, global = true)]
    pub log_json: bool,
    #[command(subcommand)]
    pub command: Command,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Run services in this process until SIGINT/SIGTERM (`kedge serve all`, `kedge serve step tool`).
    Serve {
        #[arg(required = true, value_enum)]
        services: Vec<Service>,
    },
    /// Create the broker layout where missing and verify it (streams, buckets, server version).
    Layout,
    /// Agent definitions in kedge_agents.
    #[command(subcommand)]
    Agents(AgentsCmd),
    /// Submit a task and print the run id.
    Submit(SubmitArgs),
    /// Print a run's events as a timeline, live, until the run ends (or --follow stops): each
    /// line with the time since the run was created, the model's text streaming into the step
    /// that is thinking, and, on a terminal, a question answered right there.
    Watch {
        run: RunId,
        /// Start after this journal sequence.
        #[arg(long, default_value_t = 0)]
        after: u64,
        /// Keep following after the run ends.
        #[arg(long)]
        follow: bool,
        /// `text` (the timeline, default) or `jsonl` (`{"seq", "event"}` per event, as
        /// `kedge journal` prints them; `json` means the same here).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Print a shell completion script (`kedge completion bash > /etc/bash_completion.d/kedge`;
    /// zsh: into a directory of `$fpath` as `_kedge`; fish: `~/.config/fish/completions/kedge.fish`).
    Completion { shell: clap_complete::Shell },
    /// Print a run's journal as JSON lines (`{"seq": …, "event": <envelope>}`).
    Journal { run: RunId },
    /// Print a run's folded state.
    Status {
        run: RunId,
        /// `text` (default) or `json` (the run view of GET /v1/runs/{id}).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Send a new user message to a run (revives a succeeded or failed run).
    Message { run: RunId, text: String },
    /// Answer a question a run asked.
    Answer {
        run: RunId,
        question: QuestionId,
        text: String,
    },
    /// Request a run's cancellation.
    Cancel {
        run: RunId,
        #[arg(long, default_value = "cancelled from the CLI")]
        reason: String,
    },
    /// Decide an approval (sent to the approval service, which authenticates the token).
    Approve {
        run: RunId,
        approval: kedge_core::ids::ApprovalId,
        /// The argument digest you were shown (`kedge journal` prints it in approval.requested).
        #[arg(long)]
        digest: kedge_core::event::Digest,
        /// Deny instead of approve.
        #[arg(long)]
        deny: bool,
        #[arg(long)]
        comment: Option<String>,
        /// Your approver token.
        #[arg(long, env = "KEDGE_APPROVER_TOKEN")]
        token: String,
    },
    /// Resolve an operation whose outcome is ambiguous (the run waits in `unknown`).
    Resolve {
        run: RunId,
        op: kedge_core::ids::OperationId,
        /// It did not happen: run it again under the same operation id.
        #[arg(long, conflicts_with_all = ["completed", "failed"])]
        retry: bool,
        /// It happened; this is its result.
        #[arg(long)]
        completed: Option<String>,
        /// Give the model an error result with this reason.
        #[arg(long)]
        failed: Option<String>,
        /// Who decides (recorded in the journal).
        #[arg(long, default_value = "cli")]
        by: String,
    },
    /// Serve the strict mock model (OpenAI and Anthropic wire formats).
    #[cfg(feature = "mock-llm")]
    MockLlm {
        #[arg(long, default_value_t = 0)]
        port: u16,
        /// Script file (JSON); default: the demo's script.
        #[arg(long)]
        script: Option<PathBuf>,
    },
    /// A demo run on the built-in mock model, with its own nats-server.
    #[cfg(feature = "mock-llm")]
    Demo(crate::demo::DemoArgs),
    /// The kedge_runs projection (a cache of the journal).
    #[command(subcommand)]
    Runs(RunsCmd),
    /// Messages a consumer gave up on (dead letters, `agent.rejected.dead.<consumer>` in
    /// KEDGE_REJECTIONS).
    #[command(subcommand)]
    Dead(DeadCmd),
    /// The configured MCP servers (`mcp_servers`).
    #[command(subcommand)]
    Mcp(McpCmd),
    /// A tenant's schedules: an agent's task fired on a cron expression or an interval
    /// (docs/RUNBOOK.md, "Schedules").
    #[command(subcommand)]
    Schedules(SchedulesCmd),
    /// The fleet's view of each model endpoint (kedge_providers): its breaker (closed, open:
    /// only probes go out, recovering: the waiting runs are being released), since when, the
    /// last error, the next probe and how many runs wait on it.
    Providers {
        /// `text` (a table, default) or `json` (one array).
        #[arg(long, short = 'o', value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// Tenants and their quotas (kedge_quotas): `kedge tenants usage`.
    #[command(subcommand)]
    Tenants(TenantsCmd),
    /// Write the secured nats-server configuration (accounts, least-privilege users, one account
    /// per tenant) and each kind's nkey; see docs/SECURITY.md.
    NatsConfig(crate::nats_config::NatsConfigArgs),
}

#[derive(Debug, Subcommand)]
pub enum McpCmd {
    /// Print a server's tools as agent-definition tool entries (`<server>__<tool>`, description,
    /// JSON Schema), ready for an agent's `tools`.
    Tools { server: String },
}

#[derive(Debug, Subcommand)]
pub enum DeadCmd {
    /// List the dead letters, oldest first (one line each; `--json` for the records).
    List {
        #[arg(long)]
        json: bool,
    },
    /// Drive the run of a dead letter again (a wake of the step: the run gets a nudge). SEQ is
    /// the dead letter's sequence in KEDGE_REJECTIONS, as `list` prints it.
    Retry { seq: u64 },
}

#[derive(Debug, Subcommand)]
pub enum RunsCmd {
    /// Recompute kedge_runs from the journal (every run; removes entries of runs not in it).
    Rebuild,
    /// One run: status, what it waits on with the commands that answer it (ready to paste,
    /// the approval's digest included), usage and cost, the result and its validation.
    Show {
        run: RunId,
        /// `text` (default) or `json` (the run view of GET /v1/runs/{id}).
        #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
        output: Output,
    },
    /// List a tenant's runs from kedge_runs, newest first (a cache of the journal: a run a
    /// moment old may be missing; `kedge runs rebuild` recomputes it).
    List(ListArgs),
    /// Remove finished runs' data: journal, idempotency records, lease, timers, set-aside
    /// records and projection entry (never a run that is not finished; resumable). Needs the
    /// operator's credentials. See docs/RUNBOOK.md "Retention".
    Purge(PurgeArgs),
}

/// How a read command prints.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Output {
    Text,
    /// One JSON document.
    Json,
    /// One JSON document per line (what `json` means for a single item).
    Jsonl,
}

#[derive(Debug, Args)]
pub struct ListArgs {
    /// The tenant whose runs to list.
    #[arg(long, default_value = kedge_core::subjects::DEFAULT_TENANT)]
    tenant: kedge_core::ids::TenantId,
    /// Only runs in this status (snake_case, e.g. waiting_user; repeatable).
    #[arg(long, value_parser = parse_status)]
    status: Vec<kedge_core::RunStatus>,
    /// Only runs of this agent.
    #[arg(long)]
    agent: Option<AgentName>,
    /// At most this many (the newest).
    #[arg(long, default_value_t = 50)]
    limit: usize,
    /// `text` (a table, default), `json` (one array) or `jsonl` (one summary per line).
    #[arg(short = 'o', long = "output", value_enum, default_value_t = Output::Text)]
    output: Output,
    /// The same as `-o jsonl`.
    #[arg(long, conflicts_with = "output")]
    json: bool,
}

fn parse_status(s: &str) -> Result<kedge_core::RunStatus, String> {
    serde_json::from_value(serde_json::Value::String(s.to_owned())).map_err(|_| {
        let all: Vec<String> = kedge_core::RunStatus::ALL
            .iter()
            .map(ToString::to_string)
            .collect();
        format!("unknown status {s:?}; one of {}", all.join(", "))
    })
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("which").required(true).multiple(true).args(["run", "finished_before"])))]
pub struct PurgeArgs {
    /// Only these runs (repeatable).
    #[arg(long = "run")]
    run: Vec<RunId>,
    /// Only runs that ended (their last run.succeeded/failed/cancelled) before this instant
    /// (RFC 3339, e.g. 2026-11-01T00:00:00Z); without --run, every such run in the journal.
    #[arg(long)]
    finished_before: Option<String>,
    /// Archive each run's journal first, as JSON Lines in the object store kedge_blobs
    /// (archive/runs/<run_id>.jsonl).
    #[arg(long)]
    archive: bool,
    /// Check and count; remove nothing.
    #[arg(long)]
    dry_run: bool,
    /// Print the outcome as JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Subcommand)]
pub enum AgentsCmd {
    /// Store a definition (JSON file); prints the new revision.
    Put { file: PathBuf },
    /// Print a definition (the current revision unless --revision).
    Get {
        name: AgentName,
        #[arg(long)]
        revision: Option<u64>,
    },
    /// List agents and their current revisions.
    List,
    /// List an agent's revisions.
    History { name: AgentName },
}

#[derive(Debug, Args)]
pub struct SubmitArgs {
    pub agent: AgentName,
    pub input: String,
    /// Idempotency key (sent as Nats-Msg-Id); the same key never makes two runs.
    #[arg(long)]
    pub key: Option<String>,
    #[arg(long)]
    pub run_id: Option<RunId>,
    #[arg(long, default_value = "default")]
    pub tenant: String,
    /// Then watch the run until it ends.
    #[arg(long)]
    pub watch: bool,
}

/// The effective configuration: defaults, file, `nats` context, environment, then flags.
pub fn config(cli: &Cli) -> anyhow::Result<Config> {
    Ok(Config::load_layered(
        cli.config.as_deref(),
        &flags(cli),
        |k| std::env::var(k).ok(),
    )?)
}

/// The global flags that are configuration.
fn flags(cli: &Cli) -> kedge_runtime::config::Flags {
    kedge_runtime::config::Flags {
        nats_url: cli.nats_url.clone(),
        context: cli.context.clone(),
        creds: cli.creds.clone(),
        nkey: cli.nkey.clone(),
        user: cli.user.clone(),
        password: cli.password.clone(),
        token: cli.nats_token.clone(),
        tls_ca: cli.tls_ca.clone(),
        tls_cert: cli.tls_cert.clone(),
        tls_key: cli.tls_key.clone(),
    }
}

/// Runs the parsed command; each subcommand is a function in one of the modules below.
pub async fn run(cli: Cli) -> anyhow::Result<ExitCode> {
    let mut config = config(&cli)?;
    if cli.dump_config {
        println!("{}", serde_json::to_string_pretty(&config)?);
        return Ok(ExitCode::SUCCESS);
    }
    // A person at a command waits for a broker that is coming up only as long as they would:
    // processes that set up or serve keep the configured wait (compose starts them together).
    if !matches!(
        cli.command,
        Command::Serve { .. } | Command::Layout | Command::Agents(_) | Command::NatsConfig(_)
    ) && !serves_the_mock(&cli.command)
    {
        config.nats.connect_wait_ms = config.nats.connect_wait_ms.min(CLI_CONNECT_WAIT_MS);
    }
    match cli.command {
        #[cfg(feature = "mock-llm")]
        Command::Demo(args) => crate::demo::run(args, config).await,
        Command::Dead(cmd) => dead(&Runtime::connect_existing(config).await?, cmd).await,
        Command::Schedules(cmd) => {
            schedules_command(&Runtime::connect_existing(config).await?, cmd).await
        }
        Command::Providers { output } => {
            providers(&Runtime::connect_existing(config).await?, output).await
        }
        Command::Tenants(cmd) => tenants(&Runtime::connect_existing(config).await?, cmd).await,
        Command::Runs(RunsCmd::Rebuild) => rebuild(&Runtime::connect_existing(config).await?).await,
        Command::Completion { shell } => completion(shell),
        Command::Runs(RunsCmd::Show { run, output }) => {
            show_run(&Runtime::connect_existing(config).await?, &run, output).await
        }
        Command::Runs(RunsCmd::List(args)) => {
            list_runs(&Runtime::connect_existing(config).await?, args).await
        }
        Command::Runs(RunsCmd::Purge(args)) => {
            purge(&Runtime::connect_existing(config).await?, args).await
        }
        Command::NatsConfig(args) => nats_config(&args),
        Command::Mcp(McpCmd::Tools { server }) => mcp_tools(&config, &server).await,
        #[cfg(feature = "mock-llm")]
        Command::MockLlm { port, script } => mock_llm(port, script).await,
        Command::Serve { services } => serve_command(config, &services).await,
        Command::Layout => layout(config).await,
        Command::Agents(cmd) => agents(Runtime::connect(config).await?, cmd).await,
        Command::Submit(args) => submit_command(config, &args).await,
        Command::Watch {
            run,
            after,
            follow,
            output,
        } => {
            watch(
                &Runtime::connect_existing(config).await?,
                &run,
                after,
                follow,
                output,
            )
            .await
        }
        Command::Journal { run } => journal(&Runtime::connect_existing(config).await?, &run).await,
        Command::Status {
            run,
            output: Output::Json | Output::Jsonl,
        } => {
            show_run(
                &Runtime::connect_existing(config).await?,
                &run,
                Output::Json,
            )
            .await
        }
        Command::Status {
            run,
            output: Output::Text,
        } => status(&Runtime::connect_existing(config).await?, &run).await,
        Command::Message { run, text } => {
            message(&Runtime::connect_existing(config).await?, &run, text).await
        }
        Command::Answer {
            run,
            question,
            text,
        } => {
            send_answer(
                &Runtime::connect_existing(config).await?,
                &run,
                question,
                text,
            )
            .await
        }
        Command::Approve {
            run,
            approval,
            digest,
            deny,
            comment,
            token,
        } => approve(config, &run, approval, digest, deny, comment, &token).await,
        Command::Resolve {
            run,
            op,
            retry,
            completed,
            failed,
            by,
        } => resolve(config, &run, &op, retry, completed, failed, by).await,
        Command::Cancel { run, reason } => {
            cancel(&Runtime::connect_existing(config).await?, &run, reason).await
        }
    }
}

/// `kedge completion`: the shell completion script.
fn completion(shell: clap_complete::Shell) -> anyhow::Result<ExitCode> {
    let mut cmd = <Cli as clap::CommandFactory>::command();
    clap_complete::generate(shell, &mut cmd, "kedge", &mut std::io::stdout());
    Ok(ExitCode::SUCCESS)
}

/// `kedge nats-config`.
fn nats_config(args: &crate::nats_config::NatsConfigArgs) -> anyhow::Result<ExitCode> {
    crate::nats_config::run(args)?;
    Ok(ExitCode::SUCCESS)
}

/// Whether the command runs the mock model (`kedge demo`, `kedge mock-llm`: only in a build
/// with the `mock-llm` feature, the default).
fn serves_the_mock(command: &Command) -> bool {
    #[cfg(feature = "mock-llm")]
    if matches!(command, Command::Demo(_) | Command::MockLlm { .. }) {
        return true;
    }
    let _ = command;
    false
}

/// How long a command that reads or sends to a deployment keeps trying an unreachable broker.
const CLI_CONNECT_WAIT_MS: u64 = 1_000;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nats_flags_are_global_and_clash_with_no_subcommand_flag() {
        use clap::CommandFactory;
        Cli::command().debug_assert();
        let cli = Cli::try_parse_from([
            "kedge",
            "--creds",
            "/k/u.creds",
            "layout",
            "--context",
            "prod",
            "--tls-ca",
            "/k/ca.pem",
            "--password",
            "pw-secret-1",
            "--nats-token",
            "tok-secret-2",
        ])
        .expect("parses");
        let f = flags(&cli);
        assert_eq!(f.creds.as_deref(), Some(std::path::Path::new("/k/u.creds")));
        assert_eq!(f.context.as_deref(), Some("prod"));
        assert_eq!(f.tls_ca.as_deref(), Some(std::path::Path::new("/k/ca.pem")));
        assert_eq!(f.password.as_ref().map(|p| p.expose()), Some("pw-secret-1"));
        assert_eq!(f.token.as_ref().map(|t| t.expose()), Some("tok-secret-2"));
        let debug = format!("{cli:?} {f:?}");
        assert!(
            !debug.contains("pw-secret-1") && !debug.contains("tok-secret-2"),
            "{debug}"
        );
    }
}
