//! The retention policy (`retention.*`): what `kedge serve retention` purges and how often, and
//! how often a tool host sweeps purged runs' workspaces; its checks and its `KEDGE_RETENTION*`
//! variables. docs/CONFIG.md "Retention (`retention.*`)".

use serde::{Deserialize, Serialize};

use super::ConfigError;
use super::duration::{duration_text, parse_duration};
use super::env::flag;

/// The retention policy: what `kedge serve retention` purges, and how often (the service and the
/// purge are `kedge_retention`).
///
/// Durations are written with a unit: `"30d"`, `"12h"`, `"15m"`, `"90s"`, `"500ms"`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct RetentionConfig {
    /// Whether the retention service purges anything (`KEDGE_RETENTION=1`). Off by default:
    /// a purge cannot be undone, and how long a journal must be kept (audit, disputes) is the
    /// operator's decision, not a default's.
    pub enabled: bool,
    /// A finished run is purged once it has been finished this long
    /// (`KEDGE_RETENTION_FINISHED_AFTER`; default `30d`, at least `1s`).
    #[serde(with = "duration_text")]
    pub finished_after: std::time::Duration,
    /// Archive each journal as JSON Lines to `kedge_blobs` before purging it
    /// (`KEDGE_RETENTION_ARCHIVE`; default on).
    pub archive: bool,
    /// How often the retention service looks for runs past the horizon
    /// (`KEDGE_RETENTION_INTERVAL`; default `10m`).
    #[serde(with = "duration_text")]
    pub interval: std::time::Duration,
    /// How often a tool service removes the workspaces of purged runs from its workspace root
    /// (`KEDGE_RETENTION_WORKSPACE_SWEEP`; default `10m`). Runs whether or not `enabled` is set
    /// here: `kedge runs purge` purges too.
    #[serde(with = "duration_text")]
    pub workspace_sweep: std::time::Duration,
    /// Run-level decisions scanned between two saves of the retention cursor, the runs that
    /// ended among them purged (default 256).
    pub batch: usize,
}

impl Default for RetentionConfig {
    fn default() -> Self {
        Self {
            enabled: false,
            finished_after: std::time::Duration::from_secs(30 * 24 * 3600),
            archive: true,
            interval: std::time::Duration::from_secs(600),
            workspace_sweep: std::time::Duration::from_secs(600),
            batch: 256,
        }
    }
}

impl RetentionConfig {
    pub(super) fn check(&self) -> Result<(), ConfigError> {
        let invalid = |reason: String| {
            Err(ConfigError::Invalid {
                field: "retention",
                reason,
            })
        };
        if self.finished_after < std::time::Duration::from_secs(1) {
            return invalid("finished_after must be at least 1s".into());
        }
        if self.interval < std::time::Duration::from_millis(100)
            || self.workspace_sweep < std::time::Duration::from_millis(100)
        {
            return invalid("interval and workspace_sweep must be at least 100ms".into());
        }
        if !(1..=10_000).contains(&self.batch) {
            return invalid(format!("batch {} is not between 1 and 10000", self.batch));
        }
        Ok(())
    }

    /// Applies the `KEDGE_RETENTION*` variables.
    pub(super) fn apply_env(
        &mut self,
        get: &impl Fn(&'static str) -> Option<String>,
    ) -> Result<(), ConfigError> {
        if let Some(v) = get("KEDGE_RETENTION") {
            self.enabled = flag("KEDGE_RETENTION", &v)?;
        }
        if let Some(v) = get("KEDGE_RETENTION_ARCHIVE") {
            self.archive = flag("KEDGE_RETENTION_ARCHIVE", &v)?;
        }
        for (var, field) in [
            ("KEDGE_RETENTION_FINISHED_AFTER", &mut self.finished_after),
            ("KEDGE_RETENTION_INTERVAL", &mut self.interval),
            ("KEDGE_RETENTION_WORKSPACE_SWEEP", &mut self.workspace_sweep),
        ] {
            if let Some(v) = get(var) {
                *field = parse_duration(&v).map_err(|reason| ConfigError::Env { var, reason })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Config, format_duration};

    #[test]
    fn retention_is_off_by_default_and_reads_durations_with_units() {
        let c = Config::default();
        assert!(!c.retention.enabled);
        assert_eq!(
            c.retention.finished_after,
            std::time::Duration::from_secs(30 * 86_400)
        );
        assert!(c.retention.archive);
        let v: serde_json::Value = serde_json::to_value(&c).expect("serializes");
        assert_eq!(v["retention"]["finished_after"], "30d");
        assert_eq!(v["retention"]["interval"], "10m");
        let parsed: Config = serde_json::from_value(serde_json::json!({
            "retention": {"enabled": true, "finished_after": "12h", "interval": "90s", "archive": false}
        }))
        .expect("parses");
        assert!(parsed.retention.enabled && !parsed.retention.archive);
        assert_eq!(
            parsed.retention.finished_after,
            std::time::Duration::from_secs(12 * 3600)
        );
        assert_eq!(
            parsed.retention.interval,
            std::time::Duration::from_secs(90)
        );
        let mut e = Config::default();
        e.apply_env(|k| match k {
            "KEDGE_RETENTION" => Some("1".into()),
            "KEDGE_RETENTION_FINISHED_AFTER" => Some("2s".into()),
            "KEDGE_RETENTION_WORKSPACE_SWEEP" => Some("500ms".into()),
            _ => None,
        })
        .expect("applies");
        assert!(e.retention.enabled);
        assert_eq!(
            e.retention.finished_after,
            std::time::Duration::from_secs(2)
        );
        assert_eq!(
            e.retention.workspace_sweep,
            std::time::Duration::from_millis(500)
        );
        for bad in ["30", "3w", "d", "-1s", ""] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert!(
            Config::default()
                .apply_env(|k| (k == "KEDGE_RETENTION_INTERVAL").then(|| "soon".into()))
                .is_err()
        );
        let mut short = Config::default();
        short.retention.finished_after = std::time::Duration::from_millis(10);
        assert!(
            short
                .check()
                .expect_err("too short")
                .to_string()
                .contains("retention")
        );
        assert_eq!(
            format_duration(std::time::Duration::from_millis(1500)),
            "1500ms"
        );
    }
}
