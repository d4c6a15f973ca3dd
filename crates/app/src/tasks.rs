//! The client side of the task protocol (what intake answers on): submitting a task over NATS
//! with its idempotency key and reading intake's answer, and the run id a task without one gets.
//! Used by the CLI, the bridge and tests. Intake makes run ids with [`kedge_runtime::run_ids`]; a client
//! derives one only when the broker answers its task as a duplicate (intake then does not).

use std::time::Duration;

use async_nats::HeaderMap;
use kedge_core::ids::{RunId, TenantId};
use kedge_core::task::{TaskRejection, TaskSubmission};

/// Header naming who submitted the task (informational: recorded as the bundle's `caller`; set
/// by the bridge from the caller's token and by the tenant gateway from the authenticated user).
pub const CALLER_HEADER: &str = "Kedge-Caller";
/// Header naming where intake should answer: an inbox subject (`_INBOX.…` or the configured
/// inbox prefix); intake publishes nowhere else.
pub const REPLY_HEADER: &str = "Kedge-Reply-To";
/// The tenant of tasks whose subject names none. The tenant is never read from a header: it is
/// the subject's fifth token (`agent.task.<agent>.<tenant>`, see
/// [`kedge_core::subjects::task_for`]).
pub use kedge_core::subjects::DEFAULT_TENANT;

/// What intake answers a task with.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(untagged)]
pub enum Answer {
    Accepted { run_id: RunId },
    Rejected { error: TaskRejection },
}

/// Why [`submit`] got no answer.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("cannot publish the task: {0}")]
    Publish(String),
    #[error("no answer from intake within {0:?} (is the intake service running?)")]
    NoAnswer(std::time::Duration),
    #[error("intake's answer does not parse: {0}")]
    BadAnswer(String),
    #[error(
        "the broker saw this idempotency key before, but no run {0} exists: the first task with \
         this key was rejected (see stream KEDGE_REJECTIONS) or is still being processed"
    )]
    DuplicateWithoutRun(RunId),
}

/// A task as a client submits it over NATS.
#[derive(Debug, Clone)]
pub struct Submission<'a> {
    pub task: &'a TaskSubmission,
    /// The idempotency key (`Nats-Msg-Id`).
    pub key: &'a str,
    pub tenant: &'a str,
    pub caller: Option<&'a str>,
}

/// Publishes a task to `agent.task.<agent>[.<tenant>]` with the idempotency key and waits up to
/// `wait` for intake's answer (the client side of the protocol in the module docs).
pub async fn submit(
    client: &async_nats::Client,
    submission: &Submission<'_>,
    wait: Duration,
) -> Result<Answer, SubmitError> {
    let body =
        serde_json::to_vec(submission.task).map_err(|e| SubmitError::Publish(e.to_string()))?;
    let tenant: TenantId = submission
        .tenant
        .parse()
        .map_err(|e: kedge_core::ids::IdError| SubmitError::Publish(e.to_string()))?;
    submit_raw(
        client,
        &kedge_core::subjects::task_for(&submission.task.agent, &tenant),
        body.into(),
        submission,
        wait,
    )
    .await
}

/// Like [`submit`] with an arbitrary body and subject (tests use it to send malformed tasks).
pub async fn submit_raw(
    client: &async_nats::Client,
    subject: &str,
    body: bytes::Bytes,
    submission: &Submission<'_>,
    wait: Duration,
) -> Result<Answer, SubmitError> {
    submit_traced(client, subject, body, submission, None, wait).await
}

/// [`submit_raw`] with the W3C `traceparent` the run joins (the `traceparent` header; see
/// [`kedge_runtime::trace`]).
pub async fn submit_traced(
    client: &async_nats::Client,
    subject: &str,
    body: bytes::Bytes,
    submission: &Submission<'_>,
    traceparent: Option<&str>,
    wait: Duration,
) -> Result<Answer, SubmitError> {
    use futures::StreamExt as _;
    let js = async_nats::jetstream::new(client.clone());
    let inbox = client.new_inbox();
    let mut answers = client
        .subscribe(inbox.clone())
        .await
        .map_err(|e| SubmitError::Publish(e.to_string()))?;
    let mut headers = HeaderMap::new();
    headers.insert(REPLY_HEADER, inbox.as_str());
    headers.insert("Nats-Msg-Id", submission.key);
    if let Some(caller) = submission.caller {
        headers.insert(CALLER_HEADER, caller);
    }
    if let Some(traceparent) = traceparent {
        headers.insert(kedge_runtime::trace::TRACEPARENT_HEADER, traceparent);
    }
    let ack = js
        .publish_with_headers(subject.to_owned(), headers, body.clone())
        .await
        .map_err(|e| SubmitError::Publish(e.to_string()))?;
    let ack = ack.await.map_err(|e| SubmitError::Publish(e.to_string()))?;
    if ack.duplicate {
        // The stream dropped it as a repeat of an earlier task with this key, so intake will not
        // answer. The run is the one the first task made: derived, as intake does, from the
        // tenant and the client's run id or key (docs/SECURITY.md, "Run ids").
        return duplicate_answer(client, submission, &body, wait).await;
    }
    let msg = tokio::time::timeout(wait, answers.next())
        .await
        .map_err(|_| SubmitError::NoAnswer(wait))?
        .ok_or(SubmitError::NoAnswer(wait))?;
    serde_json::from_slice(&msg.payload).map_err(|e| SubmitError::BadAnswer(e.to_string()))
}

async fn duplicate_answer(
    client: &async_nats::Client,
    submission: &Submission<'_>,
    body: &[u8],
    wait: Duration,
) -> Result<Answer, SubmitError> {
    let chosen = serde_json::from_slice::<serde_json::Value>(body)
        .ok()
        .and_then(|v| v.get("run_id").and_then(|r| r.as_str()).map(str::to_owned))
        .and_then(|r| r.parse::<RunId>().ok());
    let tenant: TenantId = submission
        .tenant
        .parse()
        .map_err(|e: kedge_core::ids::IdError| SubmitError::Publish(e.to_string()))?;
    let js = async_nats::jetstream::new(client.clone());
    let ids = kedge_runtime::run_ids::load(&js, None)
        .await
        .map_err(|e| SubmitError::Publish(e.to_string()))?;
    let run_id = ids.run_of(&tenant, chosen.as_ref(), Some(submission.key), 0);
    let journal = kedge_journal::Journal::new(client.clone());
    let deadline = tokio::time::Instant::now() + wait;
    loop {
        if let Ok(Some(_)) = journal.last_seq(&run_id).await {
            return Ok(Answer::Accepted { run_id });
        }
        if tokio::time::Instant::now() >= deadline {
            return Err(SubmitError::DuplicateWithoutRun(run_id));
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}
