//! The records of `kedge_providers` and their keys (docs/ARCHITECTURE.md, "Provider trouble"):
//! the endpoint the fleet keeps them for, a run's wait, a releaser's lead, and the key of each
//! kind of record.

use kedge_core::event::{ModelSpec, Timestamp};
use kedge_core::ids::{RunId, TenantId, WorkerId};
use serde::{Deserialize, Serialize};

use super::LEAD_FOR;

/// A model endpoint: what the fleet shares a breaker and a wait list for. Two agents with the
/// same provider, base URL and key variable share it; the key itself never enters it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Endpoint {
    /// 16 hex digits of the label's SHA-256 (a KV key token).
    pub id: String,
    /// `<provider> <base URL> (<key variable>)`, for people.
    pub label: String,
}

impl Endpoint {
    pub fn new(spec: &ModelSpec, key_var: &str) -> Endpoint {
        let provider = match spec.provider {
            kedge_core::event::Provider::Openai => "openai",
            kedge_core::event::Provider::Anthropic => "anthropic",
        };
        let base = spec.base_url.as_deref().unwrap_or("default");
        let label = format!("{provider} {base} ({key_var})");
        Endpoint {
            id: key_token(&label),
            label,
        }
    }

    /// The key token of the pace of `model`'s calls to this endpoint: providers count rate
    /// limits per model.
    pub fn pace_id(&self, model: &str) -> String {
        format!("{}.{}", self.id, key_token(model))
    }
}

/// 16 hex digits of `text`'s SHA-256: a KV key token for a name that may hold any character.
fn key_token(text: &str) -> String {
    let digest = kedge_core::event::Digest::of_bytes(text.as_bytes());
    digest
        .as_str()
        .trim_start_matches("sha256:")
        .chars()
        .take(16)
        .collect()
}

/// A run waiting on an endpoint, as stored at `wait.<endpoint>.<run_id>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiter {
    pub run_id: RunId,
    pub tenant: TenantId,
    /// When the run's step began to wait (the release order: oldest first).
    pub since: Timestamp,
    /// Not released before this (the run's own backoff, or the provider's `retry-after`).
    pub not_before: Timestamp,
    /// The pace the call keeps to ([`Endpoint::pace_id`]) when it waits its turn under rate
    /// limits: its release reserves the call's slot there.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pace: Option<String>,
    /// The call's input tokens, as estimated (what its slot takes from the token limit).
    #[serde(default)]
    pub tokens: u64,
    /// The endpoints of the run's fallback models ([`Endpoint::id`]), in order: while this
    /// endpoint has been failing for `fallback_after_ms`, the run is released to the first of
    /// them that is not.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub fallbacks: Vec<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub fallback_after_ms: Option<u64>,
}

/// Who releases an endpoint's runs, as stored at `lead.<endpoint>`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Lead {
    pub worker: String,
    pub until: Timestamp,
}

/// What a releaser does about an endpoint's lead ([`Lead::step`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LeadStep {
    /// It holds the lead, with more than half of it left: nothing to write.
    Keep,
    /// Another releaser holds it, and it has not run out.
    Leave,
    /// It takes the lead, or renews it: a write over this revision (none: a new key).
    Write(Option<u64>),
}

impl Lead {
    /// What `worker` does about the lead it sees (`held`: the lead and its revision) at `now`:
    /// its own lead is renewed once less than half of [`LEAD_FOR`] is left, another's is taken
    /// once it has run out.
    pub(super) fn step(held: Option<&(Lead, u64)>, worker: &WorkerId, now: Timestamp) -> LeadStep {
        let renew_after = now.saturating_add(LEAD_FOR / 2);
        let mine = |l: &Lead| l.worker == worker.as_str();
        match held {
            Some((l, _)) if mine(l) && l.until > renew_after => LeadStep::Keep,
            Some((l, _)) if !mine(l) && l.until > now => LeadStep::Leave,
            Some((_, rev)) => LeadStep::Write(Some(*rev)),
            None => LeadStep::Write(None),
        }
    }
}

pub(super) fn breaker_key(id: &str) -> String {
    format!("breaker.{id}")
}

pub(super) fn wait_key(id: &str, run: &RunId) -> String {
    format!("wait.{id}.{run}")
}

pub(super) fn lead_key(id: &str) -> String {
    format!("lead.{id}")
}

pub(super) fn pace_key(id: &str) -> String {
    format!("pace.{id}")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_endpoint_is_its_provider_base_url_and_key_variable_never_its_key() {
        let spec: ModelSpec = serde_json::from_value(serde_json::json!({
            "provider": "openai", "name": "m", "base_url": "http://127.0.0.1:9/v1"
        }))
        .expect("spec");
        let a = Endpoint::new(&spec, "KEY_A");
        assert_eq!(a.label, "openai http://127.0.0.1:9/v1 (KEY_A)");
        assert_eq!(a.id.len(), 16);
        assert_ne!(a.id, Endpoint::new(&spec, "KEY_B").id);
        let other: ModelSpec = serde_json::from_value(serde_json::json!({
            "provider": "openai", "name": "another-model", "base_url": "http://127.0.0.1:9/v1"
        }))
        .expect("spec");
        assert_eq!(
            a,
            Endpoint::new(&other, "KEY_A"),
            "models of one endpoint share it"
        );
    }

    #[test]
    fn a_releaser_keeps_its_lead_renews_it_at_half_time_and_takes_one_run_out() {
        use crate::provider::fixtures::at;
        let w = |name: &str| name.parse::<WorkerId>().expect("worker id");
        let lead = |worker: &str, until: i64| {
            (
                Lead {
                    worker: worker.into(),
                    until: at(until),
                },
                7,
            )
        };
        assert_eq!(Lead::step(None, &w("w1"), at(0)), LeadStep::Write(None));
        // Its own: kept while more than half of it is left, then renewed over its revision.
        assert_eq!(
            Lead::step(Some(&lead("w1", 3)), &w("w1"), at(0)),
            LeadStep::Keep
        );
        assert_eq!(
            Lead::step(Some(&lead("w1", 3)), &w("w1"), at(2)),
            LeadStep::Write(Some(7))
        );
        // Another's: left alone until it runs out, then taken over its revision.
        assert_eq!(
            Lead::step(Some(&lead("w2", 3)), &w("w1"), at(2)),
            LeadStep::Leave
        );
        assert_eq!(
            Lead::step(Some(&lead("w2", 3)), &w("w1"), at(3)),
            LeadStep::Write(Some(7))
        );
    }
}
