//! Precondition queries: the target version of each approval request, asked of the tool
//! runners before the request is committed.

use kedge_core::Decision;
use std::time::Duration;

use kedge_core::answers::{TargetAnswer, TargetQuery};
use kedge_core::event::Draft;
use kedge_core::ids::RunId;
use kedge_core::subjects::TOOL_INSPECT;

use super::{DriveError, Driver};

/// How long the step waits for a tool runner's precondition check.
const PRECONDITION_TIMEOUT: Duration = Duration::from_secs(5);

impl Driver {
    /// Fills in the target version of each approval request from the tool runners' precondition
    /// check (`kedge.tool.inspect`): what the approver is shown, and what the runner checks
    /// again right before running. Without an answer nothing is committed (the wake is retried):
    /// an approval must not be asked for a target nobody looked at.
    pub(super) async fn observe_targets(
        &self,
        run: &RunId,
        drafts: &mut [Draft<Decision>],
    ) -> Result<(), DriveError> {
        for draft in drafts {
            let Decision::ApprovalRequested(req) = &mut draft.event else {
                continue;
            };
            if req.target_version.is_some() {
                continue;
            }
            let failed = |reason: String| DriveError::Precondition {
                tool: req.tool.clone(),
                reason,
            };
            let query = TargetQuery {
                run_id: run.clone(),
                tool: req.tool.clone(),
                arguments: req.arguments.clone(),
            };
            let body = serde_json::to_vec(&query).map_err(|e| failed(e.to_string()))?;
            let reply = tokio::time::timeout(
                PRECONDITION_TIMEOUT,
                self.rt.client.request(TOOL_INSPECT, body.into()),
            )
            .await
            .map_err(|_| failed("no tool runner answered in time".into()))?
            .map_err(|e| failed(e.to_string()))?;
            let answer: TargetAnswer =
                serde_json::from_slice(&reply.payload).map_err(|e| failed(e.to_string()))?;
            req.target_version = answer.version;
        }
        Ok(())
    }
}
