//! Per-tenant limits of one bridge process: open SSE connections and runs started per minute
//! (a token bucket), answered 429 with `Retry-After` when exceeded. The limits are per process
//! (N bridges allow N times as much): they protect a bridge and its broker from one tenant, they
//! are not billing. Unfinished runs per tenant are counted from the runs projection
//! (`max_active_runs`, see `api::submit`).
//!
//! The tenant's own quotas, counted once for the fleet (`quotas.*`, docs/ARCHITECTURE.md
//! "Quotas"), are checked here too ([`admit_in_fleet`]), before the task is published.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use axum::http::StatusCode;
use kedge_core::ids::TenantId;

use crate::problem::Problem;

/// Admits the run of `task` under `tenant`'s quotas counted once for the fleet
/// (docs/ARCHITECTURE.md "Quotas"), before the task is published: a refusal is a 429 with
/// `Retry-After` and the task never reaches the broker (so the client's retry with the same
/// `Idempotency-Key` is a new task, not a duplicate). Intake admits the same run again without
/// counting it twice.
pub async fn admit_in_fleet(
    rt: &kedge_runtime::Runtime,
    tenant: &TenantId,
    task: &kedge_core::task::TaskSubmission,
    msg_id: &str,
) -> Result<(), Problem> {
    let Some(quotas) = rt
        .quotas_if_any()
        .await
        .map_err(|e| Problem::unavailable(e.to_string(), 1))?
    else {
        return Ok(());
    };
    let ids = rt
        .run_ids()
        .await
        .map_err(|e| Problem::unavailable(e.to_string(), 1))?;
    let run = ids.run_of(tenant, task.run_id.as_ref(), Some(msg_id), 0);
    match quotas.admit(tenant, &run).await {
        Ok(Ok(())) => Ok(()),
        Ok(Err(e)) => Err(too_many(e.reason(), e.retry_after_secs)),
        Err(e) => Err(Problem::unavailable(e.to_string(), 1)),
    }
}

/// The answer to a task intake rejected: 429 with `Retry-After` for a quota, else 422 naming
/// the field.
pub fn rejected(error: kedge_core::task::TaskRejection) -> Problem {
    match error.retry_after_secs {
        Some(secs) => too_many(error.reason, secs),
        None => Problem::invalid(error.field, error.reason),
    }
}

/// 429 with a `Retry-After`.
pub fn too_many(detail: impl Into<String>, retry_after: u64) -> Problem {
    let mut p = Problem::new(
        StatusCode::TOO_MANY_REQUESTS,
        "quota-exceeded",
        "Too many requests",
        detail,
    );
    p.retry_after = Some(retry_after.max(1));
    p
}

#[derive(Debug)]
struct Bucket {
    tokens: f64,
    last: Instant,
}

/// The per-tenant counters of one bridge.
#[derive(Debug)]
pub struct Quotas {
    max_sse: usize,
    runs_per_minute: u32,
    sse: Mutex<HashMap<TenantId, usize>>,
    starts: Mutex<HashMap<TenantId, Bucket>>,
}

/// One tenant's open SSE connection; the count goes down when it is dropped.
#[derive(Debug)]
pub struct SseSlot {
    quotas: Arc<Quotas>,
    tenant: TenantId,
}

impl Drop for SseSlot {
    fn drop(&mut self) {
        if let Ok(mut open) = self.quotas.sse.lock()
            && let Some(n) = open.get_mut(&self.tenant)
        {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.remove(&self.tenant);
            }
        }
    }
}

impl Quotas {
    pub fn new(max_sse: usize, runs_per_minute: u32) -> Arc<Quotas> {
        Arc::new(Quotas {
            max_sse,
            runs_per_minute,
            sse: Mutex::default(),
            starts: Mutex::default(),
        })
    }

    /// A slot for one more SSE connection of `tenant`, or 429.
    pub fn open_stream(self: &Arc<Self>, tenant: &TenantId) -> Result<SseSlot, Problem> {
        let mut open = self
            .sse
            .lock()
            .map_err(|_| Problem::internal("quota table poisoned"))?;
        let n = open.entry(tenant.clone()).or_insert(0);
        if *n >= self.max_sse {
            return Err(too_many(
                format!(
                    "tenant {tenant} has {} open event streams on this bridge, its limit",
                    self.max_sse
                ),
                5,
            ));
        }
        *n += 1;
        Ok(SseSlot {
            quotas: self.clone(),
            tenant: tenant.clone(),
        })
    }

    /// Takes one run start of `tenant` from its bucket (`runs_per_minute` a minute, bursts up to
    /// that many), or 429 saying when the next one is allowed.
    pub fn start_run(&self, tenant: &TenantId) -> Result<(), Problem> {
        self.start_run_at(tenant, Instant::now())
    }

    fn start_run_at(&self, tenant: &TenantId, now: Instant) -> Result<(), Problem> {
        if self.runs_per_minute == 0 {
            return Ok(());
        }
        let capacity = f64::from(self.runs_per_minute);
        let per_second = capacity / 60.0;
        let mut starts = self
            .starts
            .lock()
            .map_err(|_| Problem::internal("quota table poisoned"))?;
        let bucket = starts.entry(tenant.clone()).or_insert(Bucket {
            tokens: capacity,
            last: now,
        });
        let refill = now.saturating_duration_since(bucket.last).as_secs_f64() * per_second;
        bucket.tokens = (bucket.tokens + refill).min(capacity);
        bucket.last = now;
        if bucket.tokens >= 1.0 {
            bucket.tokens -= 1.0;
            return Ok(());
        }
        let wait = ((1.0 - bucket.tokens) / per_second).ceil();
        Err(too_many(
            format!(
                "tenant {tenant} may start {} runs a minute through this bridge",
                self.runs_per_minute
            ),
            // A finite, small number of seconds (at most a minute).
            if wait.is_finite() && wait > 0.0 {
                wait.min(60.0) as u64
            } else {
                1
            },
        ))
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    fn tenant(t: &str) -> TenantId {
        t.parse().expect("tenant")
    }

    #[test]
    fn stream_slots_are_counted_per_tenant_and_given_back() {
        let q = Quotas::new(2, 0);
        let a1 = q.open_stream(&tenant("acme")).expect("1");
        let _a2 = q.open_stream(&tenant("acme")).expect("2");
        let over = q.open_stream(&tenant("acme")).expect_err("3 > 2");
        assert_eq!(over.status, 429);
        assert!(over.retry_after.is_some());
        let _g = q.open_stream(&tenant("globex")).expect("another tenant");
        drop(a1);
        q.open_stream(&tenant("acme")).expect("a slot came back");
    }

    #[test]
    fn run_starts_refill_at_the_configured_rate() {
        let q = Quotas::new(1, 60);
        let t0 = Instant::now();
        let acme = tenant("acme");
        for _ in 0..60 {
            q.start_run_at(&acme, t0).expect("the burst");
        }
        let over = q.start_run_at(&acme, t0).expect_err("61st");
        assert_eq!((over.status, over.retry_after), (429, Some(1)));
        q.start_run_at(&tenant("globex"), t0)
            .expect("another tenant");
        q.start_run_at(&acme, t0 + Duration::from_millis(1100))
            .expect("one a second comes back");
        assert!(
            q.start_run_at(&acme, t0 + Duration::from_millis(1200))
                .is_err()
        );
        assert!(Quotas::new(1, 0).start_run(&acme).is_ok(), "0: no limit");
    }
}
