//! Timeouts and their relations, in one place (docs/CONFIG.md, "Timeouts and their relations").
//!
//! Every timeout of the runtime is a field here; [`Timeouts::check`] refuses a configuration that
//! breaks a relation, naming the relation. Services call it when they load their configuration,
//! so a bad combination fails at startup instead of as a double-executed tool in production.
//!
//! [`mcp`]: how to reach one MCP server, plain data shared by the configuration and the MCP client.

pub mod mcp;

use std::time::Duration;

use serde::{Deserialize, Serialize};

/// All timeouts, in milliseconds on the wire (`lease_ttl_ms`, …).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct Timeouts {
    /// How long a step worker's lease on a run lives without renewal. Whole seconds (the
    /// broker's per-message TTL granularity), at least 1 s.
    pub lease_ttl_ms: u64,
    /// How often the holder renews the lease (and sends in-progress acks) while the model runs.
    pub lease_renew_ms: u64,
    /// Whole-call limit of one model call.
    pub model_timeout_ms: u64,
    /// Ack wait of the step consumer: a message not acked or marked in progress for this long is
    /// redelivered.
    pub step_ack_wait_ms: u64,
    /// Limit of one tool execution.
    pub tool_timeout_ms: u64,
    /// How long past its timeout a runner has to record an operation's outcome. An operation
    /// record still `running` after `tool_timeout + tool_grace` is abandoned: its runner is gone,
    /// and the redelivered request or the reconciler may take it over (confirm query first).
    pub tool_grace_ms: u64,
    /// Ack wait of the tool consumer.
    pub tool_ack_wait_ms: u64,
    /// A run with no lease, no pending work and no event for this long is stalled and gets
    /// nudged by the reconciler.
    pub stall_after_ms: u64,
    /// Longest wait before retrying a model call after a retryable error.
    pub max_retry_delay_ms: u64,
    /// How often each step and tool process publishes its liveness heartbeat (the failure
    /// detector, docs/ARCHITECTURE.md "Takeover").
    pub heartbeat_ms: u64,
    /// A process whose heartbeats have been silent this long is suspected; it is declared gone
    /// only when the broker answers a ping to it with "no responders" (its connection is
    /// closed). A suspect that answers, or does not answer in time, is alive.
    pub suspect_after_ms: u64,
    /// On SIGTERM, how long `kedge serve` lets work in flight finish before it exits anyway
    /// (below Kubernetes' 30 s grace period). What is unfinished then goes back at once: the
    /// process's connection closes, so the others find it gone and adopt its runs and
    /// operations (docs/ARCHITECTURE.md "Takeover").
    pub drain_ms: u64,
    /// How long a process whose connection to the broker dropped may still deliver what its
    /// model call in flight received: a step worker that takes a run over from a worker found
    /// gone waits this long (from when that worker was last heard) for the interrupted
    /// attempt's answer to be stored, before it calls the model again (docs/ARCHITECTURE.md
    /// "Takeover"). A run between steps is taken over at once.
    pub reconnect_grace_ms: u64,
}

impl Default for Timeouts {
    fn default() -> Self {
        Self {
            lease_ttl_ms: 15_000,
            lease_renew_ms: 5_000,
            model_timeout_ms: 300_000,
            step_ack_wait_ms: 30_000,
            tool_timeout_ms: 60_000,
            tool_grace_ms: 10_000,
            tool_ack_wait_ms: 90_000,
            stall_after_ms: 120_000,
            max_retry_delay_ms: 30_000,
            heartbeat_ms: 100,
            suspect_after_ms: 350,
            drain_ms: 20_000,
            reconnect_grace_ms: 15_000,
        }
    }
}

/// A relation between timeouts that a configuration breaks.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("timeout relation `{relation}` is broken: {detail}")]
pub struct RelationError {
    /// The relation, as written in docs/CONFIG.md.
    pub relation: &'static str,
    pub detail: String,
}

impl Timeouts {
    pub fn lease_ttl(&self) -> Duration {
        Duration::from_millis(self.lease_ttl_ms)
    }
    pub fn lease_renew(&self) -> Duration {
        Duration::from_millis(self.lease_renew_ms)
    }
    pub fn model_timeout(&self) -> Duration {
        Duration::from_millis(self.model_timeout_ms)
    }
    pub fn step_ack_wait(&self) -> Duration {
        Duration::from_millis(self.step_ack_wait_ms)
    }
    pub fn tool_timeout(&self) -> Duration {
        Duration::from_millis(self.tool_timeout_ms)
    }
    /// Age after which a `running` operation record is abandoned (`tool_timeout + tool_grace`).
    pub fn op_abandoned_after(&self) -> Duration {
        Duration::from_millis(self.tool_timeout_ms.saturating_add(self.tool_grace_ms))
    }
    pub fn tool_ack_wait(&self) -> Duration {
        Duration::from_millis(self.tool_ack_wait_ms)
    }
    pub fn stall_after(&self) -> Duration {
        Duration::from_millis(self.stall_after_ms)
    }
    pub fn max_retry_delay(&self) -> Duration {
        Duration::from_millis(self.max_retry_delay_ms)
    }
    pub fn heartbeat(&self) -> Duration {
        Duration::from_millis(self.heartbeat_ms)
    }
    pub fn suspect_after(&self) -> Duration {
        Duration::from_millis(self.suspect_after_ms)
    }
    pub fn drain(&self) -> Duration {
        Duration::from_millis(self.drain_ms)
    }
    /// The reconnect grace, never longer than a model call may take (its answer cannot come
    /// later than that).
    pub fn reconnect_grace(&self) -> Duration {
        Duration::from_millis(self.reconnect_grace_ms.min(self.model_timeout_ms))
    }

    /// Checks every relation; the first broken one is returned.
    pub fn check(&self) -> Result<(), RelationError> {
        let t = self;
        let rules: [(&'static str, bool, String); 8] = [
            (
                "lease_ttl >= 1s and whole seconds",
                t.lease_ttl_ms >= 1_000 && t.lease_ttl_ms.is_multiple_of(1_000),
                format!("lease_ttl_ms = {}", t.lease_ttl_ms),
            ),
            (
                "lease_renew < lease_ttl / 2",
                t.lease_renew_ms > 0 && t.lease_renew_ms.saturating_mul(2) < t.lease_ttl_ms,
                format!(
                    "lease_renew_ms = {} and lease_ttl_ms = {}: one missed renewal must not lose the lease",
                    t.lease_renew_ms, t.lease_ttl_ms
                ),
            ),
            (
                "step_ack_wait > 2 * lease_renew",
                t.step_ack_wait_ms > t.lease_renew_ms.saturating_mul(2),
                format!(
                    "step_ack_wait_ms = {} and lease_renew_ms = {}: in-progress acks are sent every renewal, \
                     so a message of a live worker must never be redelivered",
                    t.step_ack_wait_ms, t.lease_renew_ms
                ),
            ),
            (
                "step_ack_wait > lease_ttl",
                t.step_ack_wait_ms > t.lease_ttl_ms,
                format!(
                    "step_ack_wait_ms = {} and lease_ttl_ms = {}: a redelivered wake must find a dead worker's lease expired",
                    t.step_ack_wait_ms, t.lease_ttl_ms
                ),
            ),
            (
                "tool_ack_wait > tool_timeout + tool_grace",
                t.tool_ack_wait_ms > t.tool_timeout_ms.saturating_add(t.tool_grace_ms),
                format!(
                    "tool_ack_wait_ms = {}, tool_timeout_ms = {}, tool_grace_ms = {}: a redelivered \
                     request would find its operation still held by a live runner",
                    t.tool_ack_wait_ms, t.tool_timeout_ms, t.tool_grace_ms
                ),
            ),
            (
                "stall_after > step_ack_wait",
                t.stall_after_ms > t.step_ack_wait_ms,
                format!(
                    "stall_after_ms = {} and step_ack_wait_ms = {}: the reconciler would nudge runs whose wake is about to be redelivered",
                    t.stall_after_ms, t.step_ack_wait_ms
                ),
            ),
            (
                "heartbeat > 0 and suspect_after >= 3 * heartbeat",
                t.heartbeat_ms > 0 && t.suspect_after_ms >= t.heartbeat_ms.saturating_mul(3),
                format!(
                    "heartbeat_ms = {} and suspect_after_ms = {}: two late heartbeats must not make a live process a suspect",
                    t.heartbeat_ms, t.suspect_after_ms
                ),
            ),
            (
                "model_timeout > 0 and tool_timeout > 0",
                t.model_timeout_ms > 0 && t.tool_timeout_ms > 0,
                format!(
                    "model_timeout_ms = {}, tool_timeout_ms = {}",
                    t.model_timeout_ms, t.tool_timeout_ms
                ),
            ),
        ];
        for (relation, holds, detail) in rules {
            if !holds {
                return Err(RelationError { relation, detail });
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_defaults_hold() {
        assert_eq!(Timeouts::default().check(), Ok(()));
    }

    #[test]
    fn each_broken_relation_is_named() {
        let base = Timeouts::default();
        let cases: Vec<(Timeouts, &str)> = vec![
            (
                Timeouts {
                    lease_ttl_ms: 1_500,
                    ..base.clone()
                },
                "lease_ttl >= 1s and whole seconds",
            ),
            (
                Timeouts {
                    lease_renew_ms: 8_000,
                    ..base.clone()
                },
                "lease_renew < lease_ttl / 2",
            ),
            (
                Timeouts {
                    step_ack_wait_ms: 9_000,
                    ..base.clone()
                },
                "step_ack_wait > 2 * lease_renew",
            ),
            (
                Timeouts {
                    step_ack_wait_ms: 12_000,
                    ..base.clone()
                },
                "step_ack_wait > lease_ttl",
            ),
            (
                Timeouts {
                    tool_ack_wait_ms: 65_000,
                    ..base.clone()
                },
                "tool_ack_wait > tool_timeout + tool_grace",
            ),
            (
                Timeouts {
                    stall_after_ms: 30_000,
                    ..base.clone()
                },
                "stall_after > step_ack_wait",
            ),
            (
                Timeouts {
                    suspect_after_ms: 250,
                    ..base.clone()
                },
                "heartbeat > 0 and suspect_after >= 3 * heartbeat",
            ),
            (
                Timeouts {
                    model_timeout_ms: 0,
                    ..base.clone()
                },
                "model_timeout > 0 and tool_timeout > 0",
            ),
        ];
        for (t, relation) in cases {
            let err = t.check().expect_err(relation);
            assert_eq!(err.relation, relation);
            assert!(err.to_string().contains(relation));
        }
    }
}
