//! A tool runner executes nothing the journal did not decide (principle 10: "nothing is
//! executed that the run's single writer did not journal, whoever asks").
//!
//! Three ways reach a tool runner, and each is checked before anything runs, is confirm-queried
//! or is taken over:
//!
//! - **The durable consumer** delivers a message stored in `KEDGE_RUNS`: the message *is* the
//!   journal entry, so no read is needed ([`delivered`], no broker round trip). It must come from
//!   the journal stream, on a decision subject `agent.run.<id>.d.tool.requested`, and it is
//!   decoded as every consumer of the journal decodes a message
//!   (`kedge_journal::Journal::decode_delivered`, the same checks a read applies): the subject's
//!   run and the envelope's agree, the envelope is stored on its own subject, and it carries the
//!   writer's `Nats-Msg-Id` (`d:<run>:<expected_last>:<index>:<writer>`, see
//!   [`kedge_journal::decision_msg_id`]) for this run, placing its group after the decision the
//!   writer expected. Then the run embedded in the operation id (`op_<run>_<step>_<i>`) must be
//!   the run, the envelope's step must be the operation's, and its `args_digest` must be the
//!   digest of its arguments (the claim compares digests, so a digest that does not describe
//!   the arguments would let other arguments pass as the operation's).
//! - **`kedge.tool.resolve`** (the reconciler's request for an operation stuck in `running`)
//!   carries a `tool.requested` anyone could have written. It is only a pointer ([`journaled`]):
//!   the runner reads the run's `tool.requested` decisions (one filtered read, not the whole
//!   journal), finds the same operation and dispatch (`redispatch`), refuses when there is none
//!   or when the request differs from it in any way, and executes the **journaled** event, never
//!   the request's.
//! - **`kedge.tool.inspect`** (the step's precondition query) runs nothing but reports where a
//!   target is. It is asked *before* the operation is journaled (the answer goes into the
//!   `approval.requested` that creates it), so there is nothing to match the query against yet;
//!   [`inspectable`] requires that the run exists (its `run.created`) and that the tool is one
//!   its agent revision declares, so nobody learns anything about the files of a run that does
//!   not exist, or through a tool the run could not call.
//!
//! What this cannot tell is who wrote a decision. The writer appends with the
//! expected-last-subject-sequence check, but a stored message does not prove its author: an
//! identity allowed to publish on `agent.run.*.d.>` can append a `tool.requested` that is
//! consistent in every way above, and the fold accepts it as the run's decision (the writer's
//! next append then fails its sequence check and re-reads). Only the step service's identity may
//! publish there (the broker's permissions). These checks make sure the resolve subject runs
//! nothing the journal does not hold, and stop deliveries that present themselves as something
//! they are not.

use async_nats::HeaderMap;
use kedge_core::EventKind;
use kedge_core::answers::TargetQuery;
use kedge_core::event::{Digest, Envelope, Event, EventType, ToolRequested};
use kedge_core::ids::{OperationId, RunId, StepNo};
use kedge_core::subjects::{self, RUNS_STREAM};
use kedge_journal::{Delivered, Delivery, Journal, JournalError, Recorded};
use kedge_runtime::agents::{AgentError, AgentStore};

/// Why a request was not acted on. Its text is the `reason` of the refusal.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum Refusal {
    #[error("not a journal message: {0}")]
    NotFromJournal(String),
    #[error("`{subject}` is not a decision subject of tool.requested")]
    NotADecisionSubject { subject: String },
    #[error("not a tool.requested with an operation id")]
    NotAToolRequest,
    #[error("operation {op} belongs to run {}, not to {run}", op.run())]
    ForeignOperation { op: OperationId, run: RunId },
    #[error("operation {op} is of step {}, the envelope says step {step}", op.step())]
    StepMismatch { op: OperationId, step: StepNo },
    #[error("not an event of its run: {0}")]
    SetAside(String),
    #[error("args_digest {claimed} is not the digest of the arguments ({actual})")]
    ArgsDigest { claimed: Digest, actual: Digest },
    #[error("run {0} does not exist")]
    NoSuchRun(RunId),
    #[error("the journal holds no tool.requested of {op} dispatch {dispatch}")]
    NotJournaled { op: OperationId, dispatch: u32 },
    #[error("the request's {what} differs from the journaled tool.requested of {op}")]
    Differs { op: OperationId, what: &'static str },
    #[error("run {run}'s agent does not declare the tool `{tool}`")]
    UndeclaredTool { run: RunId, tool: String },
}

/// Why a check could not be made (the request is neither accepted nor refused).
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    #[error(transparent)]
    Refused(#[from] Refusal),
    #[error(transparent)]
    Journal(#[from] JournalError),
    #[error(transparent)]
    Agents(#[from] AgentError),
}

/// Where the consumer says a delivered message is stored.
#[derive(Debug, Clone, Copy)]
pub struct Stored<'a> {
    pub stream: &'a str,
    pub seq: u64,
}

/// Checks a `tool.requested` the durable consumer delivered (see the module docs) and returns
/// its operation and request: decoded as every consumer of the journal decodes a message
/// ([`Journal::decode_delivered`]: the subject's run, the envelope's run and subject, the
/// writer's `Nats-Msg-Id`, data held by reference read back), then the checks of a request.
/// `stored` is `None` when the message had no JetStream metadata. Broker trouble (a blob that
/// cannot be read yet) is an error; a refusal is final.
pub async fn delivered(
    journal: &Journal,
    subject: &str,
    stored: Option<Stored<'_>>,
    headers: Option<&HeaderMap>,
    payload: &bytes::Bytes,
) -> Result<(OperationId, ToolRequested), CheckError> {
    let Some(stored) = stored else {
        return Err(Refusal::NotFromJournal("no JetStream metadata".into()).into());
    };
    if stored.stream != RUNS_STREAM {
        return Err(
            Refusal::NotFromJournal(format!("delivered from stream {}", stored.stream)).into(),
        );
    }
    subjects::parse_event(subject)
        .filter(|p| p.kind == EventKind::Decision && p.event_type == EventType::ToolRequested)
        .ok_or_else(|| Refusal::NotADecisionSubject {
            subject: subject.to_owned(),
        })?;
    let delivered = Delivered {
        seq: stored.seq,
        subject,
        headers,
        payload,
    };
    let envelope = match journal.decode_delivered(delivered).await? {
        Delivery::Event(recorded) => recorded.envelope,
        Delivery::SetAside(set_aside) => return Err(Refusal::SetAside(set_aside.reason).into()),
        Delivery::NotAnEvent => {
            return Err(Refusal::NotADecisionSubject {
                subject: subject.to_owned(),
            }
            .into());
        }
    };
    Ok(checked_request(envelope)?)
}

/// The checks of a `tool.requested` the journal holds: an operation of its run and step, and
/// an argument digest that describes its arguments.
fn checked_request(envelope: Envelope) -> Result<(OperationId, ToolRequested), Refusal> {
    let (op, req) = request_of(envelope)?;
    args_match(&req)?;
    Ok((op, req))
}

/// Checks a `kedge.tool.resolve` request against the journal and returns the journaled
/// operation and request: what runs, whatever the request said.
pub async fn journaled(
    journal: &Journal,
    claimed: Envelope,
) -> Result<(OperationId, ToolRequested), CheckError> {
    let claimed_digest = claimed.digest.clone();
    let (op, claim) = request_of(claimed)?;
    let run = op.run();
    let found = find_request(journal, &op, Some(claim.redispatch)).await?;
    let Some(Found {
        req: journaled,
        digest: journaled_digest,
    }) = found
    else {
        return Err(match journal.last_seq(run).await? {
            None => Refusal::NoSuchRun(run.clone()),
            Some(_) => Refusal::NotJournaled {
                op,
                dispatch: claim.redispatch,
            },
        }
        .into());
    };
    let differs = |what| Refusal::Differs {
        op: op.clone(),
        what,
    };
    if claim.tool != journaled.tool {
        return Err(differs("tool").into());
    }
    if claim.args_digest != journaled.args_digest
        || Digest::of_json(&claim.arguments) != journaled.args_digest
    {
        return Err(differs("arguments").into());
    }
    if claimed_digest != journaled_digest {
        return Err(differs("data").into());
    }
    // The journal entry itself was decoded by the read with the same checks as a delivered
    // one (its subject, run, envelope and writer's id).
    args_match(&journaled)?;
    Ok((op, journaled))
}

/// The journaled `tool.requested` of `op`'s latest dispatch, with the same checks as a
/// delivered request: what a runner adopting the operations of a gone runner runs (it knows
/// only their ids, from the gone runner's heartbeat).
pub async fn latest(journal: &Journal, op: &OperationId) -> Result<ToolRequested, CheckError> {
    let Some(found) = find_request(journal, op, None).await? else {
        return Err(Refusal::NotJournaled {
            op: op.clone(),
            dispatch: 0,
        }
        .into());
    };
    // Decoded by the read with the same checks as a delivered request.
    args_match(&found.req)?;
    Ok(found.req)
}

/// A journaled `tool.requested` (decoded by the read: the run writer's decision).
struct Found {
    req: ToolRequested,
    digest: Digest,
}

/// The last journaled `tool.requested` of `op` (of dispatch `dispatch` if given).
async fn find_request(
    journal: &Journal,
    op: &OperationId,
    dispatch: Option<u32>,
) -> Result<Option<Found>, CheckError> {
    let requests = journal
        .read_type(op.run(), EventType::ToolRequested)
        .await?;
    Ok(requests.into_iter().rev().find_map(|r| match r {
        Recorded {
            envelope:
                Envelope {
                    op: Some(o),
                    event: Event::ToolRequested(req),
                    digest,
                    ..
                },
            ..
        } if o == *op && dispatch.is_none_or(|d| d == req.redispatch) => {
            Some(Found { req, digest })
        }
        _ => None,
    }))
}

/// Checks a precondition query: the run exists and its agent declares the tool.
pub async fn inspectable(
    journal: &Journal,
    agents: &AgentStore,
    query: &TargetQuery,
) -> Result<(), CheckError> {
    let run = &query.run_id;
    let created = journal.read_type(run, EventType::RunCreated).await?;
    let Some(Event::RunCreated(created)) = created.into_iter().next().map(|r| r.envelope.event)
    else {
        return Err(Refusal::NoSuchRun(run.clone()).into());
    };
    let def = agents
        .at_revision(&created.agent, created.agent_revision)
        .await?;
    if !def.tools.iter().any(|t| t.name == query.tool) {
        return Err(Refusal::UndeclaredTool {
            run: run.clone(),
            tool: query.tool.clone(),
        }
        .into());
    }
    Ok(())
}

/// The operation and request of a `tool.requested` envelope whose run is the operation's, and
/// whose step (if it names one) is the operation's.
fn request_of(envelope: Envelope) -> Result<(OperationId, ToolRequested), Refusal> {
    let (Event::ToolRequested(req), Some(op)) = (envelope.event, envelope.op) else {
        return Err(Refusal::NotAToolRequest);
    };
    if *op.run() != envelope.run_id {
        return Err(Refusal::ForeignOperation {
            op,
            run: envelope.run_id,
        });
    }
    if let Some(step) = envelope.step
        && step != op.step()
    {
        return Err(Refusal::StepMismatch { op, step });
    }
    Ok((op, req))
}

/// The request's `args_digest` describes its arguments.
fn args_match(req: &ToolRequested) -> Result<(), Refusal> {
    let actual = Digest::of_json(&req.arguments);
    if actual != req.args_digest {
        return Err(Refusal::ArgsDigest {
            claimed: req.args_digest.clone(),
            actual,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::Decision;
    use kedge_core::event::{Draft, Timestamp};

    fn run(s: &str) -> RunId {
        s.parse().expect("valid run id")
    }

    fn request(run_id: &RunId, op: &OperationId, args: serde_json::Value) -> Envelope {
        Envelope::new(
            run_id.clone(),
            Timestamp::now(),
            Draft::new(Decision::ToolRequested(ToolRequested {
                call_id: "c1".into(),
                tool: "shell".into(),
                args_digest: Digest::of_json(&args),
                arguments: args,
                redispatch: 0,
                expect_version: None,
                limits: kedge_core::tools::RunLimits::default(),
                reversibility: None,
                compensates: None,
            }))
            .step(op.step())
            .op(op.clone()),
        )
    }

    /// The request checks of a decoded `tool.requested` (the journal's decoding is tested with
    /// the journal: `kedge_journal`'s decode tests, and forged deliveries end to end).
    #[test]
    fn a_journaled_request_passes() {
        let r = run("run_a");
        let op = OperationId::new(&r, StepNo(1), 0);
        let env = request(&r, &op, serde_json::json!({"command": "ls"}));
        let (got, req) = checked_request(env).expect("accepted");
        assert_eq!(got, op);
        assert_eq!(req.tool, "shell");
    }

    #[test]
    fn a_request_of_another_runs_operation_another_step_or_other_arguments_is_refused() {
        let r = run("run_a");
        let other = run("run_b");
        let op = OperationId::new(&r, StepNo(1), 0);
        let foreign = OperationId::new(&other, StepNo(1), 0);
        let env = || request(&r, &op, serde_json::json!({"command": "ls"}));
        // This run's envelope naming another run's operation.
        let e = checked_request(request(&r, &foreign, serde_json::json!({}))).expect_err("refused");
        assert!(matches!(e, Refusal::ForeignOperation { .. }), "{e}");
        // A step that is not the operation's.
        let mut stepped = env();
        stepped.step = Some(StepNo(2));
        let e = checked_request(stepped).expect_err("refused");
        assert!(matches!(e, Refusal::StepMismatch { .. }), "{e}");
        // An argument digest that does not describe the arguments.
        let mut tampered = env();
        if let Event::ToolRequested(req) = &mut tampered.event {
            req.args_digest = Digest::of_json(&serde_json::json!({"command": "echo"}));
        }
        let tampered = Envelope::new(
            r.clone(),
            tampered.at,
            Draft::new(tampered.event).step(op.step()).op(op.clone()),
        );
        let e = checked_request(tampered).expect_err("refused");
        assert!(matches!(e, Refusal::ArgsDigest { .. }), "{e}");
    }
}
