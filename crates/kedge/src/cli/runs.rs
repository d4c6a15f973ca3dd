//! Reading runs: `kedge watch`, `journal`, `status` and `runs show|list|purge|rebuild`.

use std::process::ExitCode;

use anyhow::{Context, bail};
use futures::StreamExt;
use kedge_core::event::Event;
use kedge_core::ids::{QuestionId, RunId};
use kedge_core::subjects;
use kedge_runtime::Runtime;

use super::{ListArgs, Output, PurgeArgs, send_answer};
use crate::timeline;

/// `kedge runs rebuild`.
pub(super) async fn rebuild(rt: &Runtime) -> anyhow::Result<ExitCode> {
    let report = kedge_projector::rebuild(rt).await?;
    println!(
        "{} rebuilt: {} runs in the journal, {} written, {} unchanged, {} failed to fold, {} stale entries removed",
        subjects::RUNS_BUCKET,
        report.runs,
        report.written,
        report.unchanged,
        report.failed,
        report.removed
    );
    Ok(if report.failed == 0 {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    })
}

/// `kedge journal`.
pub(super) async fn journal(rt: &Runtime, run: &RunId) -> anyhow::Result<ExitCode> {
    for r in rt.journal.read(run, 0).await? {
        println!("{}", serde_json::json!({"seq": r.seq, "event": r.envelope}));
    }
    Ok(ExitCode::SUCCESS)
}

/// `kedge status` (text; `-o json` is `kedge runs show -o json`).
pub(super) async fn status(rt: &Runtime, run: &RunId) -> anyhow::Result<ExitCode> {
    let page = rt.journal.read_with_set_aside(run, 0).await?;
    if page.events.is_empty() {
        bail!("no run {run}");
    }
    let state = kedge_core::fold(page.events.iter().map(|r| (r.seq, &r.envelope)))?;
    println!("{}", timeline::status_line(&state));
    if let Some(v) = kedge_app::view::result_validation(&page.events) {
        println!("{}", timeline::validation_line(&v));
    }
    // Messages on the run's subjects that are not events of the run: skipped by every
    // reader, recorded on agent.rejected.journal.<run>.<seq> (KEDGE_REJECTIONS).
    if !page.set_aside.is_empty() {
        println!(
            "set aside: {} message(s) on the run's subjects that are not events of it",
            page.set_aside.len()
        );
        for a in &page.set_aside {
            println!("  seq {} on {}: {}", a.seq, a.subject, a.reason);
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `kedge runs show`.
pub(super) async fn show_run(
    rt: &Runtime,
    run: &RunId,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let events = rt.journal.read(run, 0).await?;
    if events.is_empty() {
        bail!("no run {run}");
    }
    let state = kedge_core::fold(events.iter().map(|r| (r.seq, &r.envelope)))?;
    let mut view = kedge_app::view::run_view(&state, &events);
    kedge_app::view::add_children(&rt.journal, &state, &mut view).await;
    if output != Output::Text {
        println!("{}", serde_json::to_string_pretty(&view)?);
        return Ok(ExitCode::SUCCESS);
    }
    println!("{}", timeline::status_line(&state));
    println!(
        "agent {} (revision {}), turn {}, created {}, updated {}",
        view.agent, view.agent_revision, view.turn, view.created_at, view.updated_at
    );
    let u = &view.usage;
    match (u.cost, &u.currency) {
        (Some(cost), currency) => println!(
            "usage: {} input + {} output tokens, cost {cost:.6} {}",
            u.input_tokens,
            u.output_tokens,
            currency.as_deref().unwrap_or("")
        ),
        (None, _) => println!(
            "usage: {} input + {} output tokens",
            u.input_tokens, u.output_tokens
        ),
    }
    for line in answer_lines(run, &view, &events) {
        println!("{line}");
    }
    if let Some(result) = &view.result {
        println!("result: {}", result.output);
        if let Some(v) = kedge_app::view::result_validation(&events) {
            println!("{}", timeline::validation_line(&v));
        }
    }
    if let Some(f) = &view.failure {
        println!("failed ({:?}): {}", f.reason, f.message);
    }
    for line in timeline::effect_lines(&view.effects) {
        println!("{line}");
    }
    Ok(ExitCode::SUCCESS)
}

/// What a run waits on, each with the command that answers it, ready to paste (an approval's
/// digest is the one its request carries: the approver approves exactly those arguments).
pub(super) fn answer_lines(
    run: &RunId,
    view: &kedge_app::view::RunView,
    events: &[kedge_journal::Recorded],
) -> Vec<String> {
    if let Some(p) = &view.provider {
        return vec![
            format!(
                "waiting on its model provider {} ({}) since {}; gives up at {}",
                p.endpoint, p.trouble, p.since, p.give_up_at
            ),
            format!("  last error: {}", p.last_error),
            "  the fleet releases it when the endpoint answers again (`kedge providers` shows the next probe)".into(),
        ];
    }
    if let Some(q) = &view.queued {
        return vec![format!(
            "queued: concurrency key {:?} is at its limit of {}; place {} when it began waiting (priority {}); starts when a slot frees",
            q.key, q.limit, q.place, q.priority
        )];
    }
    let Some(w) = &view.waiting else {
        return Vec::new();
    };
    let mut lines = vec![format!("waiting on: {:?}", w.on)];
    for q in &w.questions {
        lines.push(format!("  question: {}", q.prompt));
        lines.push(format!(
            "    kedge answer {run} {} '<your answer>'",
            q.question_id
        ));
    }
    for a in &w.approvals {
        let request = events.iter().rev().find_map(|r| match &r.envelope.event {
            Event::ApprovalRequested(req) if req.approval_id == a.approval_id => Some(req),
            _ => None,
        });
        match request {
            Some(req) => {
                lines.push(format!(
                    "  approval of {} (risk {:?}, expires {}): {}",
                    req.tool, req.risk, req.expires_at, req.arguments
                ));
                lines.push(format!(
                    "    kedge approve {run} {} --digest {} [--deny]",
                    a.approval_id, req.args_digest
                ));
            }
            None => lines.push(format!("  approval {} of {}", a.approval_id, a.tool)),
        }
    }
    for op in w.operations.iter().filter(|o| o.status == "ambiguous") {
        lines.push(format!("  ambiguous operation {} ({})", op.op, op.tool));
        lines.push(format!(
            "    kedge resolve {run} {} --completed '<its result>' | --retry | --failed '<reason>'",
            op.op
        ));
    }
    for t in &w.timers {
        lines.push(format!("  timer {} fires at {}", t.timer_id, t.fire_at));
    }
    // A child run that needs a person is answered on the child's run id.
    for c in &w.children {
        lines.push(format!(
            "  child run {} ({}, {}) waits on {:?}",
            c.run_id, c.agent, c.op, c.on
        ));
        for q in &c.questions {
            lines.push(format!("    question: {}", q.prompt));
            lines.push(format!(
                "      kedge answer {} {} '<your answer>'",
                c.run_id, q.question_id
            ));
        }
        for a in &c.approvals {
            lines.push(format!(
                "    approval {} of {}: kedge runs show {} for the command",
                a.approval_id, a.tool, c.run_id
            ));
        }
    }
    lines
}

/// `kedge runs list`.
pub(super) async fn list_runs(rt: &Runtime, args: ListArgs) -> anyhow::Result<ExitCode> {
    let projection = kedge_runtime::projection::Projection::open(rt).await?;
    let mut runs = projection.list(&args.tenant).await?;
    runs.retain(|r| {
        (args.status.is_empty() || args.status.contains(&r.status))
            && args.agent.as_ref().is_none_or(|a| *a == r.agent)
    });
    runs.sort_by_key(|r| std::cmp::Reverse(r.created_at));
    runs.truncate(args.limit);
    let output = if args.json {
        Output::Jsonl
    } else {
        args.output
    };
    if output == Output::Json {
        println!("{}", serde_json::to_string_pretty(&runs)?);
        return Ok(ExitCode::SUCCESS);
    }
    for r in &runs {
        if output == Output::Jsonl {
            println!("{}", serde_json::to_string(r)?);
        } else {
            println!(
                "{}  {:<16} {:<20} created {}  tokens {}/{}",
                r.run_id,
                r.status.to_string(),
                r.agent.to_string(),
                r.created_at,
                r.usage.input_tokens,
                r.usage.output_tokens
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `kedge runs purge`.
pub(super) async fn purge(rt: &Runtime, args: PurgeArgs) -> anyhow::Result<ExitCode> {
    use kedge_retention::{self as retention, PurgeOptions, Purged};
    let finished_before = match &args.finished_before {
        // The journal's own timestamp format (RFC 3339).
        Some(at) => Some(
            serde_json::from_value::<kedge_core::event::Timestamp>(serde_json::json!(at)).map_err(
                |e| anyhow::anyhow!("--finished-before {at:?}: not an RFC 3339 instant ({e})"),
            )?,
        ),
        None => None,
    };
    let opts = PurgeOptions {
        finished_before,
        archive: args.archive,
        dry_run: args.dry_run,
    };
    if args.run.is_empty() {
        let report = retention::purge_finished(rt, opts).await?;
        if args.json {
            println!("{}", serde_json::to_string(&report)?);
        } else {
            println!(
                "{}{} of {} runs purged ({} journal messages); left alone: {} not finished, {} too recent; {} failed",
                if args.dry_run { "dry run: " } else { "" },
                report.purged,
                report.runs,
                report.events,
                report.not_finished,
                report.too_recent,
                report.failed
            );
        }
        return Ok(if report.failed == 0 {
            ExitCode::SUCCESS
        } else {
            ExitCode::FAILURE
        });
    }
    let mut refused = false;
    for run in &args.run {
        let outcome = retention::purge_run(rt, run, opts).await?;
        refused |= !matches!(outcome, Purged::Purged { .. } | Purged::NotFound);
        if args.json {
            println!("{}", serde_json::json!({"run_id": run, "result": outcome}));
        } else {
            println!("{run}: {}", describe_purge(&outcome));
        }
    }
    Ok(if refused {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    })
}

pub(super) fn describe_purge(p: &kedge_retention::Purged) -> String {
    use kedge_retention::Purged;
    match p {
        Purged::Purged {
            events,
            records,
            blobs,
            archive,
            dry_run,
        } => format!(
            "{}{events} journal messages, {records} other records and {blobs} blobs{}",
            if *dry_run { "would purge " } else { "purged " },
            archive
                .as_ref()
                .map_or(String::new(), |a| format!(", archived to {a}"))
        ),
        Purged::NotFinished { status } => format!("left alone: not finished ({status})"),
        Purged::TooRecent { ended_at } => {
            format!("left alone: ended at {ended_at}, after the cutoff")
        }
        Purged::NotFound => "no such run (already purged?)".into(),
    }
}

/// Prints a run's timeline; exit code 0 if it succeeded.
pub async fn watch(
    rt: &Runtime,
    run: &RunId,
    after: u64,
    follow: bool,
    output: Output,
) -> anyhow::Result<ExitCode> {
    let text = output == Output::Text;
    // A mistyped id would otherwise wait forever for a run that never comes (--follow waits
    // for one that is about to be created).
    if !follow
        && !rt
            .journal
            .has_event(run, kedge_core::EventType::RunCreated)
            .await?
    {
        bail!("no run {run} (use --follow to wait for a run that is about to be created)");
    }
    // Token deltas (core NATS, never journaled) stream into the step that is thinking.
    let mut deltas = rt
        .client
        .subscribe(kedge_core::subjects::delta(run))
        .await
        .context("subscribe to the run's token deltas")?;
    // On a terminal, a question is answered right here (as `kedge demo` does).
    let interactive = text && std::io::IsTerminal::is_terminal(&std::io::stdin());
    let (answers_tx, mut answers) = tokio::sync::mpsc::unbounded_channel::<(QuestionId, String)>();
    // Folds from the start (the state needs run.created) and prints what comes after `after`.
    let mut tail = std::pin::pin!(rt.journal.tail(run, 0));
    let mut state: Option<kedge_core::RunState> = None;
    let mut streaming = false;
    loop {
        // Biased, deltas first: a step publishes its deltas before its `step.completed` is
        // stored, and both reach this connection in that order; an unbiased pick between the two
        // once both are ready printed the end of the streamed text after the step's completion.
        let next = tokio::select! {
            biased;
            Some(d) = deltas.next(), if text => {
                if let Some(text) = serde_json::from_slice::<serde_json::Value>(&d.payload)
                    .ok()
                    .and_then(|v| v.get("text").and_then(|t| t.as_str()).map(str::to_owned))
                {
                    if !streaming {
                        print!("           … ");
                        streaming = true;
                    }
                    print!("{}", text.replace('\n', " "));
                    let _ = std::io::Write::flush(&mut std::io::stdout());
                }
                continue;
            }
            Some((question, text)) = answers.recv() => {
                send_answer(rt, run, question, text).await?;
                continue;
            }
            next = tail.next() => next,
        };
        let Some(next) = next else { break };
        let r = next?;
        if streaming {
            println!();
            streaming = false;
        }
        match &mut state {
            None => state = Some(kedge_core::RunState::created(r.seq, &r.envelope)?),
            Some(s) => s.apply(r.seq, &r.envelope)?,
        }
        if r.seq > after && !text {
            println!("{}", serde_json::json!({"seq": r.seq, "event": r.envelope}));
        } else if r.seq > after {
            // Time since the run was created, then the event.
            let elapsed = state
                .as_ref()
                .map_or(0.0, |s| (r.envelope.at.0 - s.created_at.0).as_seconds_f64());
            println!("{elapsed:>9.1}s {}", timeline::line(&r));
            if let Event::QuestionAsked(q) = &r.envelope.event
                && interactive
                && state.as_ref().is_some_and(|s| !s.status.is_terminal())
            {
                let tx = answers_tx.clone();
                let question = q.question_id.clone();
                println!("           answer (a line; empty to leave it): ");
                // A plain thread: the process may end (the run finished, answered elsewhere)
                // while it still waits for a line, and a runtime's blocking task would hold it.
                std::thread::spawn(move || {
                    let mut line = String::new();
                    if std::io::stdin().read_line(&mut line).is_ok() && !line.trim().is_empty() {
                        let _ = tx.send((question, line.trim().to_owned()));
                    }
                });
            }
        }
        if let Some(s) = &state
            && s.status.is_terminal()
            && !follow
        {
            if text {
                println!("{}", timeline::status_line(s));
            }
            return Ok(if s.status == kedge_core::RunStatus::Succeeded {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            });
        }
    }
    Ok(ExitCode::SUCCESS)
}
