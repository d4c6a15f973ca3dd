//! Reading the values of variables: numbers and on/off flags (an error names the variable),
//! comma-separated lists, and blank values, which count as unset. The variables themselves are
//! read by their sections, as docs/CONFIG.md's table lists them.

use super::ConfigError;

/// `v` as a number; the error names `var`.
pub(super) fn num<T: std::str::FromStr>(var: &'static str, v: &str) -> Result<T, ConfigError> {
    v.trim().parse().map_err(|_| ConfigError::Env {
        var,
        reason: format!("`{v}` is not a number"),
    })
}

/// `v` as on (`1`, `true`, `yes`) or off (`0`, `false`, `no`, empty); the error names `var`.
pub(super) fn flag(var: &'static str, v: &str) -> Result<bool, ConfigError> {
    match v.trim() {
        "1" | "true" | "yes" => Ok(true),
        "0" | "false" | "no" | "" => Ok(false),
        other => Err(ConfigError::Env {
            var,
            reason: format!("`{other}` is not 1/0/true/false"),
        }),
    }
}

/// `v` unless it is unset or blank.
pub(super) fn non_empty(v: Option<String>) -> Option<String> {
    v.filter(|s| !s.trim().is_empty())
}

/// The items of a comma-separated list, trimmed, blanks dropped.
pub(super) fn split_urls(v: &str) -> Vec<String> {
    v.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(String::from)
        .collect()
}
