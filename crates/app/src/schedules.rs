//! What a tenant may do to its schedules (docs/ARCHITECTURE.md, "Schedules"; docs/API.md,
//! "Schedules"): the one implementation the HTTP bridge, the tenant gateway and the CLI call, so
//! all three refuse the same things for the same reasons. The tenant is always the caller's, as
//! the edge authenticated it: a schedule of another tenant is not found.

use kedge_core::event::Timestamp;
use kedge_core::ids::TenantId;
use kedge_core::schedule::{ScheduleRequest, check_name};
use kedge_runtime::Runtime;
use kedge_runtime::schedules::{ScheduleError, Schedules, Stored};
use serde_json::{Value, json};

/// What a request does to one tenant's schedules.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    List,
    Get(String),
    /// Create or replace; the body is a [`ScheduleRequest`].
    Put(String),
    Pause(String),
    Resume(String),
    Delete(String),
    Trigger(String),
}

/// Performs `op` on `tenant`'s schedules; the answer's JSON.
pub async fn apply(
    rt: &Runtime,
    tenant: &TenantId,
    op: Op,
    body: &[u8],
) -> Result<Value, ScheduleError> {
    let schedules = Schedules::open(rt)
        .await
        .map_err(|e| ScheduleError::Unavailable(e.to_string()))?;
    let now = Timestamp::now();
    let stored = match op {
        Op::List => {
            let all = schedules.list(tenant).await?;
            let items: Vec<Value> = all.iter().map(|s| view(s, now)).collect();
            return Ok(json!({ "schedules": items }));
        }
        Op::Get(name) => schedules.get(tenant, &name).await?,
        Op::Put(name) => {
            check_name(&name)?;
            let request = ScheduleRequest::parse(body)?;
            let spec = request.validate(&name)?;
            let (stored, created) = schedules.put(tenant, spec, now).await?;
            let mut v = view(&stored, now);
            v["created"] = json!(created);
            return Ok(v);
        }
        Op::Pause(name) => schedules.set_paused(tenant, &name, true, now).await?,
        Op::Resume(name) => schedules.set_paused(tenant, &name, false, now).await?,
        Op::Trigger(name) => schedules.trigger(tenant, &name, now).await?,
        Op::Delete(name) => {
            schedules.delete(tenant, &name).await?;
            return Ok(json!({ "deleted": name }));
        }
    };
    Ok(view(&stored, now))
}

/// A schedule as the edges show it: its request, paused, its next fire time and its state.
pub fn view(stored: &Stored, now: Timestamp) -> Value {
    let r = &stored.record;
    json!({
        "name": r.spec.name,
        "tenant": r.tenant,
        "schedule": r.spec.request(),
        "paused": r.paused,
        "next_fire_at": r.next_fire(now),
        "state": r.state,
        "revision": stored.revision,
    })
}

/// The answer of a refused request: `{"error": {"status", "kind", "reason"[, "field"]}}`.
pub fn error_body(e: &ScheduleError) -> Value {
    let kind = match e {
        ScheduleError::Invalid(_) => "invalid",
        ScheduleError::NotFound(_) => "not_found",
        ScheduleError::TooMany { .. } => "too_many",
        ScheduleError::Conflict(_) => "conflict",
        ScheduleError::Unavailable(_) => "unavailable",
    };
    let mut error = json!({"status": e.status(), "kind": kind, "reason": e.to_string()});
    if let ScheduleError::Invalid(r) = e {
        error["field"] = json!(r.field);
        error["reason"] = json!(r.reason);
    }
    json!({ "error": error })
}
