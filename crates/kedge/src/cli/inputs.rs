//! Sending to runs: `kedge submit`, and an operator's inputs (`message`, `answer`, `approve`,
//! `resolve`, `cancel`), through the same checks as the bridge and the gateway.

use kedge_core::Input;
use kedge_core::InputEnvelope;
use std::process::ExitCode;
use std::time::Duration;

use anyhow::{Context, bail};
use kedge_app::inputs::InputId;
use kedge_core::event::{Draft, Timestamp};
use kedge_core::ids::{QuestionId, RunId};
use kedge_core::subjects;
use kedge_core::task::TaskSubmission;
use kedge_runtime::{Config, Runtime};

use super::{Output, SubmitArgs, watch};

/// `kedge submit`: prints the run id, then watches the run with `--watch`.
pub(super) async fn submit_command(config: Config, args: &SubmitArgs) -> anyhow::Result<ExitCode> {
    let rt = Runtime::connect_existing(config).await?;
    let run = submit(&rt, args).await?;
    println!("{run}");
    if args.watch {
        return watch(&rt, &run, 0, false, Output::Text).await;
    }
    Ok(ExitCode::SUCCESS)
}

/// Publishes a task and waits for intake's answer.
pub async fn submit(rt: &Runtime, args: &SubmitArgs) -> anyhow::Result<RunId> {
    let task = TaskSubmission {
        agent: args.agent.clone(),
        input: args.input.clone(),
        run_id: args.run_id.clone(),
        budget: None,
        metadata: Default::default(),
        concurrency: None,
        priority: None,
    };
    let key = args.key.clone().unwrap_or_else(uuid_like);
    let submission = kedge_intake::Submission {
        task: &task,
        key: &key,
        tenant: &args.tenant,
        caller: Some("kedge-cli"),
    };
    match kedge_intake::submit(&rt.client, &submission, Duration::from_secs(30)).await? {
        kedge_intake::Answer::Accepted { run_id } => Ok(run_id),
        kedge_intake::Answer::Rejected { error } => bail!("task rejected: {error}"),
    }
}

pub(super) fn uuid_like() -> String {
    RunId::generate().body().to_owned()
}

/// `kedge message`.
pub(super) async fn message(rt: &Runtime, run: &RunId, text: String) -> anyhow::Result<ExitCode> {
    let events = run_events(rt, run).await?;
    report_input(kedge_app::inputs::message(rt, run, &events, text, None).await)
}

/// Answers a run's question (`kedge answer`, and `kedge watch` on a terminal), through the
/// same checks as the bridge and the gateway (`kedge_app::inputs`).
pub(super) async fn send_answer(
    rt: &Runtime,
    run: &RunId,
    question: QuestionId,
    answer: String,
) -> anyhow::Result<ExitCode> {
    let events = run_events(rt, run).await?;
    report_input(kedge_app::inputs::answer(rt, run, &events, &question, answer).await)
}

/// `kedge approve`: the decision goes to the approval service, which authenticates the token.
pub(super) async fn approve(
    config: Config,
    run: &RunId,
    approval: kedge_core::ids::ApprovalId,
    digest: kedge_core::event::Digest,
    deny: bool,
    comment: Option<String>,
    token: &str,
) -> anyhow::Result<ExitCode> {
    if !kedge_runtime::connect::protects_secrets(&config) {
        bail!(
            "refusing to send an approver token over a connection without TLS to a \
             server that is not on this host; configure TLS (--tls-ca, tls:// URLs) or \
             decide as an approver user through the tenant gateway"
        );
    }
    let rt = Runtime::connect_existing(config).await?;
    let body = kedge_approval::DecisionRequest {
        approval_id: approval,
        verdict: if deny {
            kedge_core::event::Verdict::Deny
        } else {
            kedge_core::event::Verdict::Approve
        },
        args_digest: digest,
        comment,
    };
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Authorization", format!("Bearer {token}").as_str());
    let reply = tokio::time::timeout(
        Duration::from_secs(10),
        rt.client.request_with_headers(
            subjects::approval(run),
            headers,
            serde_json::to_vec(&body)?.into(),
        ),
    )
    .await
    .context("no answer from the approval service within 10 s")??;
    match serde_json::from_slice::<kedge_approval::DecisionAnswer>(&reply.payload)? {
        kedge_approval::DecisionAnswer::Journaled { seq } => {
            println!("journaled at {seq}");
            Ok(ExitCode::SUCCESS)
        }
        kedge_approval::DecisionAnswer::Refused { code, reason } => {
            bail!("refused ({code}): {reason}")
        }
    }
}

/// `kedge resolve`.
pub(super) async fn resolve(
    config: Config,
    run: &RunId,
    op: &kedge_core::ids::OperationId,
    retry: bool,
    completed: Option<String>,
    failed: Option<String>,
    by: String,
) -> anyhow::Result<ExitCode> {
    use kedge_core::event::Resolution;
    let resolution = match (retry, completed, failed) {
        (true, None, None) => Resolution::Retry,
        (false, Some(content), None) => Resolution::Completed { content },
        (false, None, Some(reason)) => Resolution::Failed { reason },
        _ => bail!("give exactly one of --retry, --completed TEXT, --failed REASON"),
    };
    let rt = Runtime::connect_existing(config).await?;
    let events = rt.journal.read(run, 0).await?;
    let done = kedge_app::inputs::resolve(&rt, run, &events, op, resolution, by)
        .await
        .map_err(|r| anyhow::anyhow!("refused ({}): {r}", r.status()))?;
    if done.duplicate {
        println!(
            "already resolved (journaled at {}); the first verdict stands",
            done.seq
        );
    } else {
        println!("journaled at {}", done.seq);
    }
    Ok(ExitCode::SUCCESS)
}

/// `kedge cancel`.
pub(super) async fn cancel(rt: &Runtime, run: &RunId, reason: String) -> anyhow::Result<ExitCode> {
    let events = run_events(rt, run).await?;
    let by = Some("cli".to_owned());
    report_input(kedge_app::inputs::cancel(rt, run, &events, reason, by).await)
}

/// A run's journal, for an operator's input (`kedge message|answer|cancel`: an operator may
/// act on any tenant's run); an error when there is no such run.
pub(super) async fn run_events(
    rt: &Runtime,
    run: &RunId,
) -> anyhow::Result<Vec<kedge_journal::Recorded>> {
    let events = rt.journal.read(run, 0).await?;
    if events.is_empty() {
        bail!("no run {run}");
    }
    Ok(events)
}

/// Prints where an input was journaled (or that it already was); a refusal is the error.
pub(super) fn report_input(
    done: Result<kedge_app::inputs::Appended, kedge_app::inputs::Refusal>,
) -> anyhow::Result<ExitCode> {
    let done = done.map_err(|r| anyhow::anyhow!("refused ({}): {r}", r.status()))?;
    match (done.duplicate, done.seq) {
        (false, seq) => println!("journaled at {seq}"),
        (true, 0) => println!("already journaled"),
        (true, seq) => println!("already journaled at {seq}"),
    }
    Ok(ExitCode::SUCCESS)
}

/// Journals an operator's nudge of a run (`kedge dead retry`).
pub(super) async fn send_input(
    rt: &Runtime,
    run: &RunId,
    input: Input,
    key: &InputId,
) -> anyhow::Result<ExitCode> {
    if rt.journal.last_seq(run).await?.is_none() {
        bail!("no run {run}");
    }
    let input = InputEnvelope::new(run.clone(), Timestamp::now(), Draft::new(input));
    let appended = rt.journal.append_input(key, &input).await?;
    if appended.duplicate {
        println!("already journaled at {}", appended.seq);
    } else {
        println!("journaled at {}", appended.seq);
    }
    Ok(ExitCode::SUCCESS)
}
