//! The fair order of work across tenants (`fairness.*`): per-tenant weights, their checks and
//! their `KEDGE_FAIRNESS_WEIGHTS` variable. docs/CONFIG.md "Fairness across tenants
//! (`fairness.*`)", docs/ARCHITECTURE.md "Fairness across tenants".

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use kedge_core::fairness::Weights;
use kedge_core::ids::TenantId;

use super::ConfigError;

/// How intake, the step and the tool service share their work among tenants.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct FairnessConfig {
    /// Weight by tenant (`KEDGE_FAIRNESS_WEIGHTS`, a JSON object, e.g. `{"acme": 3}`): a tenant
    /// of weight `w` gets up to `w` pieces of work per turn when tenants compete; a tenant not
    /// named has weight 1. Each weight is 1 to 1000.
    pub weights: BTreeMap<TenantId, u32>,
}

impl FairnessConfig {
    /// The checked weights.
    pub fn weights(&self) -> Weights {
        // Checked at load ([`FairnessConfig::check`]); an unchecked config gets equal weights.
        Weights::new(self.weights.clone()).unwrap_or_default()
    }

    pub(super) fn check(&self) -> Result<(), ConfigError> {
        Weights::new(self.weights.clone())
            .map(|_| ())
            .map_err(|reason| ConfigError::Invalid {
                field: "fairness.weights",
                reason,
            })
    }

    /// Applies `KEDGE_FAIRNESS_WEIGHTS`.
    pub(super) fn apply_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = super::env::non_empty(get("KEDGE_FAIRNESS_WEIGHTS")) {
            self.weights = serde_json::from_str(&v).map_err(|e| ConfigError::Env {
                var: "KEDGE_FAIRNESS_WEIGHTS",
                reason: format!("not a JSON object of tenant weights: {e}"),
            })?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn weights_come_from_the_file_or_the_environment_and_are_checked() {
        let c: FairnessConfig =
            serde_json::from_str(r#"{"weights": {"acme": 3}}"#).expect("parses");
        assert!(c.check().is_ok());
        let acme = kedge_core::fairness::Lane::Tenant("acme".parse().expect("tenant"));
        assert_eq!(c.weights().of(&acme), 3);
        let mut c = FairnessConfig::default();
        c.apply_env(&|_| Some(r#"{"b": 2}"#.to_owned()))
            .expect("applies");
        assert_eq!(c.weights.len(), 1);
        assert!(
            c.apply_env(&|_| Some("acme=3".to_owned())).is_err(),
            "not JSON"
        );
        assert!(
            c.apply_env(&|_| Some(r#"{"bad tenant": 2}"#.to_owned()))
                .is_err(),
            "not a tenant"
        );
        c.weights.insert("z".parse().expect("tenant"), 0);
        assert!(c.check().is_err(), "weight 0");
    }
}
