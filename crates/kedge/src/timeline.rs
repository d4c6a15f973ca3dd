//! A run's events as a readable timeline (`kedge watch`, `kedge demo`).

use kedge_core::event::{AttemptOutcome, Event, OutputValidation};
use kedge_core::fold::RunState;
use kedge_journal::Recorded;

fn clip(s: &str, max: usize) -> String {
    let one_line = s.replace('\n', " ⏎ ");
    if one_line.chars().count() <= max {
        one_line
    } else {
        let cut: String = one_line.chars().take(max).collect();
        format!("{cut}…")
    }
}

/// One line per event: sequence, time, type, and what matters in its data.
pub fn line(r: &Recorded) -> String {
    let e = &r.envelope;
    let t = e.at.0.time();
    let time = format!(
        "{:02}:{:02}:{:02}.{:03}",
        t.hour(),
        t.minute(),
        t.second(),
        t.millisecond()
    );
    let what = match &e.event {
        Event::RunCreated(c) => format!(
            "agent {} rev {} · model {} · input “{}”{}",
            c.agent,
            c.agent_revision,
            c.model.name,
            clip(&c.input, 60),
            c.parent
                .as_ref()
                .map(|p| format!(" · child of {} [{}]", p.run_id, p.op))
                .unwrap_or_default()
        ),
        Event::RunStarted(_) => String::new(),
        Event::StepStarted(s) => format!(
            "step {} attempt {} · request {}",
            e.step.map(|s| s.get()).unwrap_or(0),
            e.attempt.map(|a| a.get()).unwrap_or(0),
            s.request_id
        ),
        Event::ModelAttempt(a) => match &a.outcome {
            AttemptOutcome::Error {
                trouble: Some(trouble),
                message,
                ..
            } => format!("provider {trouble} (not spent): {}", clip(message, 80)),
            AttemptOutcome::Error { class, message, .. } => {
                format!("{class:?} error: {}", clip(message, 80))
            }
            AttemptOutcome::Held { endpoint, .. } => {
                format!("not sent: {endpoint} is failing (not spent)")
            }
            AttemptOutcome::LeaseLost => "lease lost; call aborted".into(),
            AttemptOutcome::Cancelled => "cancel requested; call aborted".into(),
        },
        Event::StepCompleted(c) => {
            let calls: Vec<&str> = c
                .message
                .tool_calls
                .iter()
                .map(|t| t.name.as_str())
                .collect();
            let mut s = format!(
                "{} tokens{}",
                c.usage.total(),
                if c.reused {
                    " · REUSED stored response (model not called again)"
                } else {
                    ""
                }
            );
            if !c.message.text.is_empty() {
                s.push_str(&format!(" · “{}”", clip(&c.message.text, 70)));
            }
            if !calls.is_empty() {
                s.push_str(&format!(" · calls {}", calls.join(", ")));
            }
            s
        }
        Event::ToolRequested(t) => format!("{} {}", t.tool, clip(&t.arguments.to_string(), 60)),
        Event::ToolStarted(t) => format!("runner {}", t.runner),
        Event::ToolResult(t) => format!(
            "{}“{}”",
            if t.is_error { "ERROR " } else { "" },
            clip(&t.content, 70)
        ),
        Event::QuestionAsked(q) => format!("{} “{}”", q.question_id, q.prompt),
        Event::ChildStarted(c) => format!("child run {} of {}", c.child, c.agent),
        Event::QuestionAnswered(a) => format!("{} “{}”", a.question_id, a.answer),
        Event::RunWaiting(w) => format!("on {:?}", w.on).to_lowercase(),
        Event::ProviderWaiting(w) => format!(
            "on {} ({}) since {}, gives up at {}: {}",
            w.endpoint,
            w.trouble,
            w.since,
            w.give_up_at,
            clip(&w.message, 60)
        ),
        Event::ContextCompacted(c) => format!(
            "for the model's window ({:?}): kept from message {}, {} result(s) elided; ~{} tokens for {}",
            c.cause,
            c.keep_from,
            c.elided.len(),
            c.estimated_tokens,
            c.budget_tokens
        ),
        Event::ProviderReleased(r) if r.probe => "released as the fleet's probe".into(),
        Event::ProviderReleased(_) => "released: the provider is back".into(),
        // A version gate's marker: this run takes the gate's new branch from here on.
        Event::RunGated(g) => format!(
            "gate {} taken",
            serde_json::to_value(g.gate)
                .ok()
                .and_then(|v| v.as_str().map(str::to_owned))
                .unwrap_or_default()
        ),
        Event::RunSucceeded(s) => format!("“{}”", clip(&s.output, 90)),
        Event::OutputRejected(r) => format!(
            "answer sent back, retry {} of {}: {}",
            r.retry,
            r.max_retries,
            clip(&r.errors.join("; "), 80)
        ),
        Event::RunFailed(f) => format!("{:?}: {}", f.reason, f.message),
        Event::UserMessage(m) => format!("“{}”", clip(&m.text, 80)),
        Event::CancelRequested(c) => c.reason.clone(),
        other => clip(&other.data_json().to_string(), 80),
    };
    let op = e.op.as_ref().map(|o| format!(" [{o}]")).unwrap_or_default();
    format!(
        "{:>6}  {}  {:<20}{}  {}",
        r.seq,
        time,
        e.event_type().as_str(),
        op,
        what
    )
}

/// The result's check against the agent's `output_schema`, in one line (the run's result
/// reported apart from its status).
pub fn validation_line(v: &OutputValidation) -> String {
    match v {
        OutputValidation::NotChecked => {
            "result: not checked (the agent declares no output_schema)".to_owned()
        }
        OutputValidation::Valid => "result: valid against the agent's output_schema".to_owned(),
        OutputValidation::Invalid { errors } => format!(
            "result: invalid against the agent's output_schema: {}",
            errors.join("; ")
        ),
    }
}

/// The run's status in one line.
pub fn status_line(s: &RunState) -> String {
    let mut line = format!(
        "run {} is {} after {} step(s), {} tokens",
        s.run_id,
        s.status,
        s.step,
        s.usage.total()
    );
    if let Some(cost) = s.usage.cost {
        let currency = s.bundle.model.currency().unwrap_or_default();
        line.push_str(&format!(", cost {cost:.4} {currency}"));
    }
    if let Some(out) = &s.output {
        line.push_str(&format!(" · output “{}”", clip(out, 100)));
    }
    if let Some(f) = &s.failure {
        line.push_str(&format!(" · failed: {}", f.message));
    }
    line
}

/// The effects of a run whose agent declares reversibility, one line each with its level and
/// fate and what compensating it did: irreversible and undeclared effects are listed as
/// plainly as the compensated ones.
pub fn effect_lines(effects: &[kedge_core::event::OpSummary]) -> Vec<String> {
    use kedge_core::event::CompensationStatus;
    let mut lines = Vec::new();
    if effects.is_empty() {
        return lines;
    }
    lines.push("effects:".to_owned());
    for e in effects {
        let level = e.level.map_or("undeclared", level_name);
        let mut line = format!("  {} {} ({level})", e.op, fate_name(e.fate));
        match &e.compensation {
            Some(c) => {
                let what = match c.status {
                    CompensationStatus::Compensated => "compensated",
                    CompensationStatus::Failed => "compensation FAILED",
                    CompensationStatus::Ambiguous => "compensation AMBIGUOUS",
                };
                line.push_str(&format!(" · {what}"));
                if let Some(op) = &c.op {
                    line.push_str(&format!(" by {op}"));
                }
                if !c.detail.is_empty() {
                    line.push_str(&format!(": {}", clip(&c.detail, 100)));
                }
            }
            None => line.push_str(" · not compensated"),
        }
        lines.push(line);
    }
    lines
}

fn level_name(l: kedge_core::event::Level) -> &'static str {
    use kedge_core::event::Level;
    match l {
        Level::Reversible => "reversible",
        Level::Compensable => "compensable",
        Level::Irreversible => "irreversible",
        Level::Undeclared => "undeclared",
    }
}

fn fate_name(f: kedge_core::event::OpFate) -> &'static str {
    use kedge_core::event::OpFate;
    match f {
        OpFate::Completed => "completed",
        OpFate::Failed => "failed",
        OpFate::Stopped => "stopped",
        OpFate::NeverStarted => "never started",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_version_gate_marker_names_its_gate() {
        use kedge_core::event::{Draft, Envelope, Gate, RunGated, Timestamp};
        let envelope = Envelope::new(
            "run_t1".parse().expect("run id"),
            Timestamp::now(),
            Draft::new(Event::RunGated(RunGated {
                gate: Gate::WaitFromStepGroup,
            }))
            .step(kedge_core::ids::StepNo(1)),
        );
        let l = line(&Recorded {
            seq: 5,
            envelope,
            msg_id: None,
        });
        assert!(
            l.contains("run.gated") && l.contains("gate wait_from_step_group taken"),
            "{l}"
        );
    }

    #[test]
    fn the_result_is_reported_with_its_validation() {
        assert!(validation_line(&OutputValidation::NotChecked).contains("not checked"));
        assert!(validation_line(&OutputValidation::Valid).contains("valid against"));
        let invalid = validation_line(&OutputValidation::Invalid {
            errors: vec!["at /answer: 42 is not of type \"string\"".into()],
        });
        assert!(
            invalid.contains("invalid") && invalid.contains("/answer"),
            "{invalid}"
        );
    }

    #[test]
    fn a_rejected_answer_shows_its_retry_and_errors() {
        use kedge_core::event::{Draft, Envelope, OutputRejected, Timestamp};
        let envelope = Envelope::new(
            "run_t1".parse().expect("run id"),
            Timestamp::now(),
            Draft::new(Event::OutputRejected(OutputRejected {
                errors: vec!["at /answer: 42 is not of type \"string\"".into()],
                retry: 1,
                max_retries: 2,
            }))
            .step(kedge_core::ids::StepNo(1)),
        );
        let l = line(&Recorded {
            seq: 7,
            envelope,
            msg_id: None,
        });
        assert!(l.contains("output.rejected"), "{l}");
        assert!(
            l.contains("retry 1 of 2") && l.contains("at /answer"),
            "{l}"
        );
    }

    #[test]
    fn effects_are_listed_with_their_level_and_compensation() {
        use kedge_core::event::{
            CompensationOutcome, CompensationStatus, Level, OpFate, OpSummary,
        };
        let run: kedge_core::ids::RunId = "run_t1".parse().expect("run id");
        let op = |i| kedge_core::ids::OperationId::new(&run, kedge_core::ids::StepNo(1), i);
        let lines = effect_lines(&[
            OpSummary {
                op: op(0),
                fate: OpFate::Completed,
                level: Some(Level::Compensable),
                compensation: Some(CompensationOutcome {
                    op: op(0).compensation_of(),
                    status: CompensationStatus::Failed,
                    detail: "card expired".into(),
                }),
            },
            OpSummary {
                op: op(1),
                fate: OpFate::Completed,
                level: Some(Level::Irreversible),
                compensation: None,
            },
        ]);
        assert_eq!(lines.len(), 3, "{lines:?}");
        assert!(lines[1].contains("compensation FAILED") && lines[1].contains("card expired"));
        assert!(lines[2].contains("(irreversible)") && lines[2].contains("not compensated"));
        assert!(effect_lines(&[]).is_empty());
    }
}
