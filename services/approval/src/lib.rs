//! The approval service: authenticates approvers and journals their decisions.
//!
//! A decision is a NATS request on `agent.approval.<run_id>` with the header
//! `Authorization: Bearer <token>` and the body
//! `{"approval_id": "apr_…", "verdict": "approve" | "deny", "args_digest": "sha256:…",
//! "comment": "…"}` — `args_digest` is the digest the approver was **shown**. The token names
//! the approver (configuration `approvers`, `KEDGE_APPROVER_TOKENS`). The service checks that the
//! run exists and the approval is open, and journals `approval.decided` (one per approval: its
//! `Nats-Msg-Id` is `approval.decided:<approval_id>`). Whether the decision authorises anything
//! is the step's call on resume: expired → `approval.expired`; a digest that is not the
//! operation's → `approval.invalidated` and a fresh request; approve → the operation is
//! dispatched; deny → the model is told.
//!
//! Answers (JSON): `{"status": "journaled", "seq": N}` or
//! `{"status": "refused", "code": 401 | 404 | 409 | 422, "reason": "…"}`.

use std::future::Future;

use kedge_core::ids::RunId;
use kedge_core::subjects;
use kedge_runtime::responder::{self, Busy, Listen};
use kedge_runtime::{Runtime, RuntimeError};
use serde::{Deserialize, Serialize};

pub use kedge_app::approvals::DecisionRequest;

/// The answer to a decision request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "status", rename_all = "snake_case")]
pub enum DecisionAnswer {
    Journaled { seq: u64 },
    Refused { code: u16, reason: String },
}

fn refused(code: u16, reason: impl Into<String>) -> DecisionAnswer {
    DecisionAnswer::Refused {
        code,
        reason: reason.into(),
    }
}

/// Decisions handled at once by one approval process (more wait in its subscription).
const MAX_IN_FLIGHT: usize = 64;

/// Runs the approval service until `shutdown` resolves.
pub async fn run(rt: Runtime, shutdown: impl Future<Output = ()>) -> Result<(), RuntimeError> {
    if rt.config.approvers.is_empty() {
        tracing::warn!("no approver tokens configured: every approval decision will be refused");
    }
    tracing::info!(worker = %rt.config.worker_id, "approval service started");
    let listen = Listen {
        what: "approval decisions",
        subject: subjects::APPROVALS_ALL.to_owned(),
        queue: subjects::APPROVALS_QUEUE,
        bound: MAX_IN_FLIGHT,
        busy: Busy::Wait,
    };
    responder::serve(&rt.client, listen, shutdown, |msg| {
        let rt = rt.clone();
        async move {
            let run = subjects::parse_approval(msg.subject.as_str()).unwrap_or_default();
            let token = msg
                .headers
                .as_ref()
                .and_then(|h| h.get("Authorization"))
                .map(|v| v.as_str().trim_start_matches("Bearer ").trim().to_owned());
            let answer = decide(&rt, run, token.as_deref(), &msg.payload).await;
            responder::reply(&rt.client, &msg, &answer).await;
        }
    })
    .await?;
    tracing::info!("approval service stopped");
    Ok(())
}

/// The approver a token names. Every configured token is compared, each by its SHA-256 digest
/// and in constant time, so neither the comparison nor the lookup leaks how much of a token was
/// right.
fn approver_of<'a>(
    approvers: &'a std::collections::BTreeMap<String, String>,
    token: &str,
) -> Option<&'a String> {
    use sha2::{Digest, Sha256};
    let presented: [u8; 32] = Sha256::digest(token.as_bytes()).into();
    let mut found = None;
    for (known, name) in approvers {
        let digest: [u8; 32] = Sha256::digest(known.as_bytes()).into();
        let diff = digest
            .iter()
            .zip(presented.iter())
            .fold(0u8, |acc, (a, b)| acc | (a ^ b));
        if diff == 0 {
            found = Some(name);
        }
    }
    found
}

/// Authenticates and journals one decision.
pub async fn decide(rt: &Runtime, run: &str, token: Option<&str>, body: &[u8]) -> DecisionAnswer {
    let Some(approver) = token.and_then(|t| approver_of(&rt.config.approvers, t)) else {
        return refused(
            401,
            "a valid approver token is required (Authorization: Bearer …)",
        );
    };
    let Ok(run) = run.parse::<RunId>() else {
        return refused(404, format!("`{run}` is not a run id"));
    };
    let request: DecisionRequest = match serde_json::from_slice(body) {
        Ok(r) => r,
        Err(e) => return refused(422, format!("invalid decision: {e}")),
    };
    match kedge_app::approvals::record_decision(rt, &run, approver, request).await {
        Ok(seq) => DecisionAnswer::Journaled { seq },
        Err(r) => refused(r.code, r.reason),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tokens_name_their_approver_and_nothing_else() {
        let mut approvers = std::collections::BTreeMap::new();
        approvers.insert("tok-alice-0123456789".to_owned(), "alice".to_owned());
        approvers.insert("tok-bob-0123456789".to_owned(), "bob".to_owned());
        assert_eq!(
            approver_of(&approvers, "tok-alice-0123456789").map(String::as_str),
            Some("alice")
        );
        assert_eq!(
            approver_of(&approvers, "tok-bob-0123456789").map(String::as_str),
            Some("bob")
        );
        for wrong in [
            "",
            "tok-alice-012345678",
            "tok-alice-0123456789 ",
            "TOK-ALICE-0123456789",
        ] {
            assert_eq!(approver_of(&approvers, wrong), None, "{wrong:?}");
        }
    }
}
