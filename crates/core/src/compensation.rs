//! Compensation: what a run that ends early does with its effects (docs/ARCHITECTURE.md
//! "Compensation").
//!
//! A tool's policy declares how far its effect can be undone (`reversible`, `compensable` with
//! the compensating tool, `irreversible`; undeclared otherwise), and each request of it carries
//! that declaration ([`crate::event::Reversibility`]), so everything here is a pure function of
//! the journal: no definition is read.
//!
//! When a run is about to end cancelled or failed ([`intercept`], applied to the decisions that
//! end it) and its agent compensates on that end (`on_cancel` / `on_failure`: `compensate`), it
//! journals `run.compensating` instead: the plan, every completed operation of a compensable
//! tool in the run's turn, newest first, each with its compensation's operation id
//! ([`OperationId::compensation_of`]). Then [`next`] requests the compensations one at a time
//! (a `tool.requested` marked `compensates`, which the tool runners execute exactly once under
//! its id like any operation), waits for each one's result, and ends the run with the terminal
//! event it would have had, listing every operation with its level and what compensating it
//! did. A compensation that fails (or whose outcome is ambiguous) is listed so and the next one
//! runs; nothing is hidden and nothing is undone that was not declared undoable.

use serde_json::Value;

use crate::decide::{Idle, Next};
use crate::event::{
    CompensationOutcome, CompensationStatus, Decision, Digest, Draft, FailureReason, Level,
    PlannedCompensation, RunCancelled, RunCompensating, RunFailed, StopCause, ToolRequested,
};
use crate::fold::{OpStatus, RunState, ToolOp};
use crate::ids::OperationId;

/// An operation's level: as its request declares it, else [`Level::Undeclared`].
pub fn level_of(op: &ToolOp) -> Level {
    op.reversibility
        .as_ref()
        .map_or(Level::Undeclared, |r| r.level)
}

/// Checks a compensation's argument template: every `${…}` is closed and names `arguments`,
/// `arguments.<field>…`, `result` or `op`.
pub fn check_template(template: &Value) -> Result<(), String> {
    match template {
        Value::String(s) => {
            for name in placeholders(s)? {
                check_name(name)?;
            }
            Ok(())
        }
        Value::Array(items) => items.iter().try_for_each(check_template),
        Value::Object(map) => map.values().try_for_each(check_template),
        Value::Null | Value::Bool(_) | Value::Number(_) => Ok(()),
    }
}

fn check_name(name: &str) -> Result<(), String> {
    match name {
        "arguments" | "result" | "op" => Ok(()),
        n if n
            .strip_prefix("arguments.")
            .is_some_and(|path| path.split('.').all(|f| !f.is_empty())) =>
        {
            Ok(())
        }
        other => Err(format!(
            "`${{{other}}}` names nothing: use ${{arguments}}, ${{arguments.<field>}}, \
             ${{result}} or ${{op}}"
        )),
    }
}

/// The names of the `${…}` placeholders of `s`, in order.
fn placeholders(s: &str) -> Result<Vec<&str>, String> {
    let mut out = Vec::new();
    let mut rest = s;
    while let Some(start) = rest.find("${") {
        let after = &rest[start + 2..];
        let end = after
            .find('}')
            .ok_or_else(|| format!("`{s}`: a `${{` is not closed"))?;
        out.push(&after[..end]);
        rest = &after[end + 1..];
    }
    Ok(out)
}

/// The value a placeholder stands for, for operation `op`.
fn value_of(name: &str, op: &ToolOp) -> Result<Value, String> {
    match name {
        "arguments" => Ok(op.call.arguments.clone()),
        "op" => Ok(Value::String(op.op.to_string())),
        "result" => Ok(Value::String(
            op.result
                .as_ref()
                .map(|r| r.content.clone())
                .unwrap_or_default(),
        )),
        other => {
            check_name(other)?;
            let path = other.strip_prefix("arguments.").unwrap_or_default();
            let mut at = &op.call.arguments;
            for field in path.split('.') {
                at = match at {
                    Value::Object(map) => map.get(field),
                    Value::Array(items) => field.parse::<usize>().ok().and_then(|i| items.get(i)),
                    _ => None,
                }
                .ok_or_else(|| {
                    format!("`${{{other}}}`: the operation's arguments have no `{path}`")
                })?;
            }
            Ok(at.clone())
        }
    }
}

/// A compensation's arguments: `template` with each placeholder replaced for operation `op`.
pub fn resolve(template: &Value, op: &ToolOp) -> Result<Value, String> {
    match template {
        Value::String(s) => {
            let names = placeholders(s)?;
            if let [only] = names.as_slice()
                && s.len() == only.len() + 3
            {
                return value_of(only, op);
            }
            let mut out = String::with_capacity(s.len());
            let mut rest = s.as_str();
            while let Some(start) = rest.find("${") {
                out.push_str(&rest[..start]);
                let after = &rest[start + 2..];
                let end = after.find('}').unwrap_or(after.len());
                match value_of(&after[..end], op)? {
                    Value::String(text) => out.push_str(&text),
                    other => out.push_str(&other.to_string()),
                }
                rest = after.get(end + 1..).unwrap_or_default();
            }
            out.push_str(rest);
            Ok(Value::String(out))
        }
        Value::Array(items) => items
            .iter()
            .map(|v| resolve(v, op))
            .collect::<Result<_, _>>()
            .map(Value::Array),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| resolve(v, op).map(|v| (k.clone(), v)))
            .collect::<Result<_, _>>()
            .map(Value::Object),
        other => Ok(other.clone()),
    }
}

/// What a run that ends with `cause` compensates: each operation of its current turn that
/// completed (a result that is no error and was not stopped: a failed or stopped operation's
/// effect is uncertain, and undoing what did not happen can do harm), of a `compensable` tool
/// whose agent compensates on `cause`, newest first. An entry whose arguments cannot be built
/// carries the error instead of an operation.
pub fn plan(state: &RunState, cause: StopCause) -> Vec<PlannedCompensation> {
    state
        .ops
        .values()
        .rev()
        .filter(|o| o.compensates.is_none() && o.op.step() >= state.turn_first_step)
        .filter(|o| o.result.as_ref().is_some_and(|r| !r.is_error && !r.stopped))
        .filter_map(|o| {
            let r = o.reversibility.as_ref()?;
            if r.level != Level::Compensable || !r.compensate_on.contains(&cause) {
                return None;
            }
            let spec = r.compensate.as_ref()?;
            let built = resolve(&spec.arguments, o).and_then(|_| {
                o.op.compensation_of()
                    .ok_or_else(|| "the operation's id leaves no room for a compensation".into())
            });
            Some(match built {
                Ok(id) => PlannedCompensation {
                    op: o.op.clone(),
                    tool: spec.tool.clone(),
                    compensation: Some(id),
                    error: None,
                },
                Err(e) => PlannedCompensation {
                    op: o.op.clone(),
                    tool: spec.tool.clone(),
                    compensation: None,
                    error: Some(format!("cannot build the compensation: {e}")),
                },
            })
        })
        .collect()
}

/// The decisions that end a run (`drafts`, whose last is `run.cancelled` or `run.failed`), as
/// its agent's compensation policy makes them: `run.compensating` in place of the end when
/// there is something to compensate; else the end, `run.failed` listing the run's effects when
/// its agent declares reversibility. Anything else, and the end of a compensation, unchanged.
pub fn intercept(state: &RunState, mut drafts: Vec<Draft<Decision>>) -> Vec<Draft<Decision>> {
    if state.compensation.is_some()
        || drafts
            .iter()
            .any(|d| matches!(d.event, Decision::RunRevived(_)))
    {
        // The end of a compensation; or a new turn that fails before it did anything.
        return drafts;
    }
    let Some(last) = drafts.last_mut() else {
        return drafts;
    };
    let cause = match &last.event {
        Decision::RunCancelled(_) => StopCause::Cancel,
        Decision::RunFailed(_) => StopCause::Failure,
        _ => return drafts,
    };
    let plan = plan(state, cause);
    if plan.is_empty() {
        if let Decision::RunFailed(f) = &mut last.event
            && f.effects.is_empty()
            && state.declares_levels()
        {
            f.effects = state.op_summaries();
        }
        return drafts;
    }
    let failure = match &last.event {
        Decision::RunFailed(f) => Some(f.clone()),
        _ => None,
    };
    *last = Draft::new(Decision::RunCompensating(RunCompensating {
        cause,
        failure,
        plan,
    }));
    drafts
}

/// What a compensating run does next: request the first compensation of its plan that was not
/// requested (or dispatch again one found not to have happened), wait for the one out, or,
/// once each is settled, end the run listing every operation.
pub fn next(state: &RunState) -> Next {
    let Some(k) = &state.compensation else {
        // Not what the fold makes (`compensating` comes only with its plan): end the run.
        return Next::Commit(vec![Draft::new(Decision::RunFailed(RunFailed {
            reason: FailureReason::Internal,
            message: "compensating without a plan".into(),
            effects: state.op_summaries(),
        }))]);
    };
    for entry in &k.plan {
        let Some(id) = &entry.compensation else {
            continue;
        };
        match state.ops.get(id) {
            None => {
                if let Some(draft) = request(state, &entry.op, id, 0) {
                    return Next::Commit(vec![draft]);
                }
            }
            Some(o) if o.result.is_some() => {}
            Some(ToolOp {
                status: OpStatus::Ambiguous { .. },
                ..
            }) => {}
            Some(o) if o.status == OpStatus::ToRetry => {
                if let Some(draft) = request(state, &entry.op, id, o.dispatches) {
                    return Next::Commit(vec![draft]);
                }
            }
            Some(_) => return Next::Idle(Idle::WaitingTools { missing: 1 }),
        }
    }
    let end = match (k.cause, &k.failure) {
        (StopCause::Cancel, _) => Decision::RunCancelled(RunCancelled {
            operations: state.op_summaries(),
        }),
        (StopCause::Failure, failure) => {
            let f = failure.clone().unwrap_or(RunFailed {
                reason: FailureReason::Internal,
                message: "failed".into(),
                effects: Vec::new(),
            });
            Decision::RunFailed(RunFailed {
                effects: state.op_summaries(),
                ..f
            })
        }
    };
    Next::Commit(vec![Draft::new(end)])
}

/// The request of compensation `id` of operation `of` (dispatch number `redispatch`).
fn request(
    state: &RunState,
    of: &OperationId,
    id: &OperationId,
    redispatch: u32,
) -> Option<Draft<Decision>> {
    let o = state.ops.get(of)?;
    let spec = o.reversibility.as_ref()?.compensate.as_ref()?;
    let arguments = resolve(&spec.arguments, o).ok()?;
    Some(
        Draft::new(Decision::ToolRequested(ToolRequested {
            call_id: id.to_string(),
            tool: spec.tool.clone(),
            args_digest: Digest::of_json(&arguments),
            arguments,
            redispatch,
            expect_version: None,
            limits: spec.limits.clone(),
            reversibility: None,
            compensates: Some(of.clone()),
        }))
        .step(id.step())
        .op(id.clone()),
    )
}

/// What compensating `op` came to, once its compensation settled (`None`: not compensated, or
/// not yet settled).
pub fn outcome_of(state: &RunState, op: &OperationId) -> Option<CompensationOutcome> {
    let entry = state
        .compensation
        .as_ref()?
        .plan
        .iter()
        .find(|p| p.op == *op)?;
    let Some(id) = &entry.compensation else {
        return Some(CompensationOutcome {
            op: None,
            status: CompensationStatus::Failed,
            detail: entry.error.clone().unwrap_or_default(),
        });
    };
    let c = state.ops.get(id)?;
    let (status, detail) = match (&c.result, &c.status) {
        (Some(r), _) if !r.is_error && !r.stopped => {
            (CompensationStatus::Compensated, r.content.clone())
        }
        (Some(r), _) => (CompensationStatus::Failed, r.content.clone()),
        (None, OpStatus::Ambiguous { detail }) => (CompensationStatus::Ambiguous, detail.clone()),
        (None, _) => return None,
    };
    Some(CompensationOutcome {
        op: Some(id.clone()),
        status,
        detail,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::event::ToolCall;
    use crate::fold::OpResult;
    use crate::ids::{RunId, StepNo};

    fn op(args: Value, result: &str) -> ToolOp {
        let run: RunId = "run_k1".parse().expect("run");
        ToolOp {
            op: OperationId::new(&run, StepNo(2), 1),
            call: ToolCall {
                call_id: "c1".into(),
                name: "pay".into(),
                arguments: args,
            },
            args_digest: Digest::of_bytes(b"x"),
            status: OpStatus::Done,
            result: Some(OpResult {
                content: result.into(),
                is_error: false,
                stopped: false,
                seq: 9,
            }),
            dispatches: 1,
            since: crate::event::Timestamp::now(),
            target_moved: None,
            limits: crate::tools::RunLimits::default(),
            failed_attempts: 0,
            reversibility: None,
            compensates: None,
            inline: false,
        }
    }

    #[test]
    fn templates_take_the_operations_arguments_result_and_id() {
        let o = op(
            serde_json::json!({"amount": 5, "to": {"name": "bob"}, "tags": ["a", "b"]}),
            "paid 5",
        );
        let t = serde_json::json!({
            "amount": "${arguments.amount}",
            "note": "refund ${arguments.amount} to ${arguments.to.name} (${result}) for ${op}",
            "first_tag": "${arguments.tags.0}",
            "all": "${arguments}",
            "fixed": [1, true, null]
        });
        check_template(&t).expect("valid");
        let v = resolve(&t, &o).expect("resolves");
        assert_eq!(v["amount"], 5, "a whole placeholder keeps its type");
        assert_eq!(
            v["note"],
            format!("refund 5 to bob (paid 5) for {}", o.op),
            "inside a string: text"
        );
        assert_eq!(v["first_tag"], "a");
        assert_eq!(v["all"], o.call.arguments);
        assert_eq!(v["fixed"], serde_json::json!([1, true, null]));
        let missing = resolve(&serde_json::json!("${arguments.nope}"), &o).expect_err("missing");
        assert!(missing.contains("nope"), "{missing}");
        for bad in ["${argument}", "${arguments.}", "${result", "${}"] {
            assert!(
                check_template(&serde_json::json!({ "x": bad })).is_err(),
                "{bad}"
            );
        }
    }

    #[test]
    fn compensation_ids_are_derived_and_never_compensated_again() {
        let o = op(serde_json::json!({}), "");
        let c = o.op.compensation_of().expect("an id");
        assert!(c.is_compensation() && !o.op.is_compensation());
        assert_eq!(c.compensated(), Some(o.op.clone()));
        assert_eq!(c.step(), o.op.step());
        assert_eq!(
            c.compensation_of(),
            None,
            "compensations are not compensated"
        );
        let parsed: OperationId = c.to_string().parse().expect("an ordinary operation id");
        assert_eq!(parsed, c);
    }
}
