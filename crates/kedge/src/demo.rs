//! `kedge demo`: one command that shows a durable agent run end to end.
//!
//! It starts its own nats-server (data under `.kedge/demo`), the strict mock model and the
//! services in this process, stores the demo agent, submits a task whose run writes and reads
//! files, runs a command, calls tools in parallel, asks the user a question (answered at the
//! terminal, or automatically after a pause) and records a side effect; it prints the journal
//! live as a timeline and exits 0 when the run succeeded.
//!
//! `--crash` runs the step worker as a separate process armed to abort right after the model's
//! first answer is journaled (`step.completed`), before the tool calls it asks for are requested,
//! then starts a fresh worker: the run resumes from the journal, the fresh worker finishes the
//! step from the journaled answer, and the model is called exactly once for every request.

use kedge_core::Input;
use kedge_core::InputEnvelope;
use std::io::IsTerminal;
use std::path::PathBuf;
use std::pin::pin;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use clap::Args;
use futures::StreamExt;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Draft, Event, QuestionAnswered, Timestamp};
use kedge_core::ids::{AgentName, QuestionId, RunId};
use kedge_core::machine::RunStatus;
use kedge_mock_llm::{MockHandle, Scripts};
use kedge_runtime::{Config, Runtime};

use kedge_serve::{Service, TransientKedge};

use crate::cli::{self, SubmitArgs};
use crate::local_nats::LocalNats;
use crate::timeline;

/// The demo's mock-model script (also `kedge mock-llm`'s default).
pub const SCRIPT: &str = include_str!("../demo/script.json");
const AGENT: &str = include_str!("../demo/agent.json");
const API_KEY_VAR: &str = "KEDGE_DEMO_API_KEY";

#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Kill the step worker right after the model answers, and show the run resuming.
    #[arg(long)]
    pub crash: bool,
    /// Where the demo keeps its nats-server data and workspaces (cleared at start).
    #[arg(long, default_value = ".kedge/demo")]
    pub dir: PathBuf,
    /// Seconds before the question is answered automatically (when nobody is at the terminal).
    #[arg(long, default_value_t = 2)]
    pub answer_after: u64,
    /// Give up after this many seconds.
    #[arg(long, default_value_t = 120)]
    pub timeout: u64,
}

pub async fn run(args: DemoArgs, base: Config) -> anyhow::Result<ExitCode> {
    if args.dir.exists() {
        std::fs::remove_dir_all(&args.dir)
            .with_context(|| format!("clear {}", args.dir.display()))?;
    }
    let nats = LocalNats::start(&args.dir.join("nats")).await?;
    println!(
        "▸ nats-server on {} (data in {})",
        nats.url,
        args.dir.display()
    );
    let mock = MockHandle::start(Scripts::from_json(SCRIPT)?).await;
    println!("▸ mock model on {}", mock.base_url());

    let mut config = base;
    // The demo's own server: no credentials, no TLS, whatever the caller's NATS settings are.
    config.nats_urls = vec![nats.url.clone()];
    config.nats = kedge_runtime::NatsConfig::default();
    config.workspace_root = args.dir.join("workspaces");
    config
        .api_keys
        .insert(API_KEY_VAR.into(), "demo-key".into());
    // The demo's agent counts its side effect with the test tool.
    config.ledger_tool = true;
    // Short timeouts so that a crashed worker's run is picked up within seconds.
    let t = &mut config.timeouts;
    t.lease_ttl_ms = 2_000;
    t.lease_renew_ms = 500;
    t.step_ack_wait_ms = 3_000;
    t.stall_after_ms = 10_000;
    config.check()?;
    let rt = Runtime::connect(config.clone()).await?;

    let mut def = AgentDefinition::parse(AGENT.as_bytes())?;
    def.model.base_url = Some(format!("{}/v1", mock.base_url()));
    let revision = rt.agents.put(&def).await?;
    println!("▸ agent `{}` stored at revision {revision}", def.name);

    let in_process: &[Service] = if args.crash {
        &[Service::Intake, Service::Tool]
    } else {
        &[Service::Intake, Service::Step, Service::Tool]
    };
    let mut services = TransientKedge::new();
    services.start_on(rt.clone(), in_process);
    let mut worker = if args.crash {
        println!(
            "▸ step worker runs as a separate process, armed to crash right after the model's answer is journaled, before its tool calls are requested"
        );
        Some(spawn_step_worker(&config, true)?)
    } else {
        None
    };

    let submit = SubmitArgs {
        agent: "demo".parse::<AgentName>()?,
        input: "Take notes on kedging, check them, and record a summary once I agree.".into(),
        key: Some(format!("demo-{}", RunId::generate().body())),
        run_id: None,
        tenant: "default".into(),
        watch: false,
    };
    let run = cli::submit(&rt, &submit).await?;
    println!("▸ submitted: run {run}\n");

    let watched = tokio::time::timeout(
        Duration::from_secs(args.timeout),
        follow(&rt, &run, &args, &config, &mut worker),
    )
    .await;
    let _ = services.shutdown().await;
    if let Some(mut w) = worker.take() {
        let _ = w.kill();
        let _ = w.wait();
    }
    let state = match watched {
        Ok(r) => r?,
        Err(_) => bail!("the run did not finish within {} s", args.timeout),
    };

    println!("\n{}", timeline::status_line(&state));
    let calls = mock.calls();
    let steps = state.step.get().max(1);
    println!(
        "▸ model calls: {} for {} steps ({:.3} per step); per request id: {}",
        calls.total,
        steps,
        calls.total as f64 / f64::from(steps),
        calls
            .by_request_id
            .iter()
            .map(|(id, n)| format!("{id}×{n}"))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let ledger =
        std::fs::read_to_string(config.workspace_root.join("ledger.log")).unwrap_or_default();
    println!("▸ ledger lines: {}", ledger.lines().count());
    if calls.by_request_id.values().any(|n| *n != 1) {
        println!("✗ some model request was sent more than once");
        return Ok(ExitCode::FAILURE);
    }
    Ok(if state.status == RunStatus::Succeeded {
        println!("✓ the run succeeded");
        ExitCode::SUCCESS
    } else {
        println!("✗ the run ended {}", state.status);
        ExitCode::FAILURE
    })
}

/// The variables of NATS settings (`docs/CONFIG.md`, "Connecting to NATS").
const NATS_SETTINGS: &[&str] = &[
    "KEDGE_NATS_CREDS",
    "KEDGE_NATS_NKEY",
    "KEDGE_NATS_USER",
    "KEDGE_NATS_PASSWORD",
    "KEDGE_NATS_TOKEN",
    "KEDGE_NATS_TLS_CA",
    "KEDGE_NATS_TLS_CERT",
    "KEDGE_NATS_TLS_KEY",
    "KEDGE_NATS_TLS_REQUIRED",
    "KEDGE_NATS_INBOX_PREFIX",
    "NATS_CONTEXT",
    "NATS_URL",
    "NATS_CREDS",
    "NATS_NKEY",
    "NATS_USER",
    "NATS_PASSWORD",
];

fn spawn_step_worker(config: &Config, crash: bool) -> anyhow::Result<std::process::Child> {
    let exe = std::env::current_exe().context("locate the kedge binary")?;
    let t = &config.timeouts;
    let mut cmd = std::process::Command::new(exe);
    cmd.args(["serve", "step"])
        .env("KEDGE_NATS_URL", config.nats_urls.join(","))
        .env("KEDGE_WORKSPACE_ROOT", &config.workspace_root)
        .env(API_KEY_VAR, "demo-key")
        .env("KEDGE_MODEL_KEYS", API_KEY_VAR)
        .env("KEDGE_LEASE_TTL_MS", t.lease_ttl_ms.to_string())
        .env("KEDGE_LEASE_RENEW_MS", t.lease_renew_ms.to_string())
        .env("KEDGE_STEP_ACK_WAIT_MS", t.step_ack_wait_ms.to_string())
        .env("KEDGE_STALL_AFTER_MS", t.stall_after_ms.to_string())
        .env("KEDGE_LOG", "error")
        .stdin(std::process::Stdio::null());
    // It connects to the demo's own server: none of the caller's NATS settings apply.
    for var in NATS_SETTINGS {
        cmd.env_remove(var);
    }
    if crash {
        cmd.env("KEDGE_FAILPOINTS", "step.after_answer_committed");
    } else {
        cmd.env_remove("KEDGE_FAILPOINTS");
    }
    cmd.spawn().context("start a step worker process")
}

/// Prints the run's timeline until it ends, answering its questions and replacing a crashed
/// step worker.
async fn follow(
    rt: &Runtime,
    run: &RunId,
    args: &DemoArgs,
    config: &Config,
    worker: &mut Option<std::process::Child>,
) -> anyhow::Result<kedge_core::RunState> {
    let mut tail = pin!(rt.journal.tail(run, 0));
    let mut state: Option<kedge_core::RunState> = None;
    let mut ticker = tokio::time::interval(Duration::from_millis(200));
    loop {
        tokio::select! {
            next = tail.next() => {
                let Some(next) = next else { bail!("the journal tail ended") };
                let r = next?;
                println!("{}", timeline::line(&r));
                match &mut state {
                    None => state = Some(kedge_core::RunState::created(r.seq, &r.envelope)?),
                    Some(s) => s.apply(r.seq, &r.envelope)?,
                }
                if let Event::QuestionAsked(q) = &r.envelope.event {
                    let rt = rt.clone();
                    let run = run.clone();
                    let (question, prompt) = (q.question_id.clone(), q.prompt.clone());
                    let after = Duration::from_secs(args.answer_after);
                    tokio::spawn(async move {
                        if let Err(e) = answer(&rt, &run, question, &prompt, after).await {
                            eprintln!("could not answer: {e:#}");
                        }
                    });
                }
                if let Some(s) = &state
                    && s.status.is_terminal()
                {
                    return Ok(s.clone());
                }
            }
            _ = ticker.tick() => {
                if let Some(w) = worker
                    && let Ok(Some(status)) = w.try_wait()
                {
                    println!("        ✗ step worker process exited ({status}) with the model's answer journaled and its tool calls not requested; starting a fresh one");
                    *worker = Some(spawn_step_worker(config, false)?);
                }
            }
        }
    }
}

/// Answers a question: from the terminal when there is one, else automatically after a pause.
async fn answer(
    rt: &Runtime,
    run: &RunId,
    question: QuestionId,
    prompt: &str,
    after: Duration,
) -> anyhow::Result<()> {
    let text = if std::io::stdin().is_terminal() {
        println!(
            "        ? {prompt} (type an answer and press Enter; “yes” in {} s)",
            after.as_secs() * 5
        );
        let read = tokio::task::spawn_blocking(|| {
            let mut line = String::new();
            std::io::stdin().read_line(&mut line).map(|_| line)
        });
        match tokio::time::timeout(after * 5, read).await {
            Ok(Ok(Ok(line))) if !line.trim().is_empty() => line.trim().to_owned(),
            _ => "yes".to_owned(),
        }
    } else {
        tokio::time::sleep(after).await;
        "yes, go ahead".to_owned()
    };
    let input = InputEnvelope::new(
        run.clone(),
        Timestamp::now(),
        Draft::new(Input::QuestionAnswered(QuestionAnswered {
            question_id: question.clone(),
            answer: text,
        })),
    );
    // Answered before (a repeat of the demo's answer) is answered.
    rt.journal
        .append_input(&kedge_core::ids::InputId::answer(&question), &input)
        .await?;
    Ok(())
}
