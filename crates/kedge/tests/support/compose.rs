//! compose.yaml as the deployment tests read it (`deploy_compose.rs` checks it,
//! `cluster_topology.rs` runs its topology as processes): the YAML with its merge keys applied,
//! as JSON, and each service's command, environment (interpolated as compose does), replicas and
//! mounts, with container paths mapped to host paths.

#![allow(dead_code)]

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde_json::Value;

/// The repository root.
pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .canonicalize()
        .expect("repository root")
}

/// compose.yaml with its YAML merge keys (`<<: *anchor`) applied, as JSON: what compose
/// validates and runs.
pub fn load() -> Value {
    let path = repo_root().join("compose.yaml");
    let text = std::fs::read_to_string(&path).expect("read compose.yaml");
    parse(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// A compose document (YAML) as JSON, merge keys applied.
pub fn parse(text: &str) -> Result<Value, String> {
    let mut yaml: serde_yaml_ng::Value =
        serde_yaml_ng::from_str(text).map_err(|e| e.to_string())?;
    yaml.apply_merge().map_err(|e| e.to_string())?;
    serde_json::to_value(&yaml).map_err(|e| e.to_string())
}

/// One mount of a service: `source` is a host path (`./…`, resolved against the repository) or
/// a named volume.
#[derive(Debug, Clone)]
pub struct Mount {
    pub source: MountSource,
    pub target: String,
    pub read_only: bool,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MountSource {
    Host(PathBuf),
    Volume(String),
}

/// One service of compose.yaml.
#[derive(Debug, Clone)]
pub struct Service {
    pub name: String,
    pub image: Option<String>,
    pub command: Vec<String>,
    /// As written (before interpolation).
    pub environment: BTreeMap<String, String>,
    pub replicas: u64,
    pub mounts: Vec<Mount>,
    pub doc: Value,
}

impl Service {
    /// Whether it runs the kedge image.
    pub fn is_kedge(&self) -> bool {
        self.image
            .as_deref()
            .is_some_and(|i| i.starts_with("kedge:"))
    }

    /// The kind it serves (`kedge serve <kind>`), if it is a service and not a one-shot.
    pub fn serve_kind(&self) -> Option<&str> {
        match self.command.as_slice() {
            [serve, kind] if self.is_kedge() && serve == "serve" => Some(kind),
            _ => None,
        }
    }

    /// The environment, interpolated with `vars` as compose does (`${X}`, `${X:-default}`,
    /// `${X-default}`, `${X:?message}`, `${X?message}`, `$X`, `$$`).
    pub fn env(&self, vars: &dyn Fn(&str) -> Option<String>) -> BTreeMap<String, String> {
        self.environment
            .iter()
            .map(|(k, v)| {
                let value = interpolate(v, vars)
                    .unwrap_or_else(|e| panic!("service {}: {k}: {e}", self.name));
                (k.clone(), value)
            })
            .collect()
    }

    /// The environment with every value that names a path inside the container mapped to the
    /// host: a bind mount's target to its source, a named volume's target to
    /// `volumes/<name>` (under `volume_root`).
    pub fn host_env(
        &self,
        vars: &dyn Fn(&str) -> Option<String>,
        volume_root: &Path,
    ) -> BTreeMap<String, String> {
        self.env(vars)
            .into_iter()
            .map(|(k, v)| {
                let mapped = self
                    .host_path(&v, volume_root)
                    .map_or(v, |p| p.display().to_string());
                (k, mapped)
            })
            .collect()
    }

    /// The host path of a container path under one of the service's mounts.
    pub fn host_path(&self, container_path: &str, volume_root: &Path) -> Option<PathBuf> {
        self.mounts.iter().find_map(|m| {
            let rest = container_path.strip_prefix(&m.target)?;
            if !(rest.is_empty() || rest.starts_with('/')) {
                return None;
            }
            let base = match &m.source {
                MountSource::Host(p) => p.clone(),
                MountSource::Volume(v) => volume_root.join(v),
            };
            let rest = rest.trim_start_matches('/');
            Some(if rest.is_empty() {
                base
            } else {
                base.join(rest)
            })
        })
    }
}

/// Every service of the document, in file order.
pub fn services(doc: &Value) -> Vec<Service> {
    let Some(services) = doc["services"].as_object() else {
        panic!("compose.yaml has no services");
    };
    services
        .iter()
        .map(|(name, s)| Service {
            name: name.clone(),
            image: s["image"].as_str().map(str::to_owned),
            command: match &s["command"] {
                Value::Array(words) => words
                    .iter()
                    .map(|w| {
                        w.as_str()
                            .unwrap_or_else(|| panic!("{name}: command word {w} is not a string"))
                            .to_owned()
                    })
                    .collect(),
                Value::Null => Vec::new(),
                other => panic!("{name}: write the command as a list of words, not {other}"),
            },
            environment: environment(name, &s["environment"]),
            replicas: s["deploy"]["replicas"].as_u64().unwrap_or(1),
            mounts: mounts(name, &s["volumes"]),
            doc: s.clone(),
        })
        .collect()
}

fn environment(service: &str, env: &Value) -> BTreeMap<String, String> {
    match env {
        Value::Null => BTreeMap::new(),
        Value::Object(map) => map
            .iter()
            .map(|(k, v)| {
                let v = match v {
                    Value::String(s) => s.clone(),
                    Value::Null => String::new(),
                    other => other.to_string(),
                };
                (k.clone(), v)
            })
            .collect(),
        Value::Array(list) => list
            .iter()
            .map(|item| {
                let item = item.as_str().unwrap_or_default();
                let (k, v) = item.split_once('=').unwrap_or((item, ""));
                (k.to_owned(), v.to_owned())
            })
            .collect(),
        other => panic!("{service}: environment is neither a map nor a list: {other}"),
    }
}

fn mounts(service: &str, volumes: &Value) -> Vec<Mount> {
    let Some(list) = volumes.as_array() else {
        return Vec::new();
    };
    list.iter()
        .map(|v| {
            let (source, target, read_only) = match v {
                Value::String(short) => {
                    let parts: Vec<&str> = short.split(':').collect();
                    match parts.as_slice() {
                        [s, t] => (s.to_string(), t.to_string(), false),
                        [s, t, mode] => (
                            s.to_string(),
                            t.to_string(),
                            mode.split(',').any(|m| m == "ro"),
                        ),
                        _ => panic!("{service}: volume `{short}` is not source:target[:mode]"),
                    }
                }
                Value::Object(long) => (
                    long.get("source")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    long.get("target")
                        .and_then(Value::as_str)
                        .unwrap_or_default()
                        .to_owned(),
                    long.get("read_only")
                        .and_then(Value::as_bool)
                        .unwrap_or(false),
                ),
                other => panic!("{service}: volume {other} is neither a string nor a map"),
            };
            let source =
                if source.starts_with("./") || source.starts_with("../") || source.starts_with('/')
                {
                    MountSource::Host(repo_root().join(&source))
                } else {
                    MountSource::Volume(source)
                };
            Mount {
                source,
                target,
                read_only,
            }
        })
        .collect()
}

/// Compose's variable interpolation of one value.
pub fn interpolate(text: &str, vars: &dyn Fn(&str) -> Option<String>) -> Result<String, String> {
    let mut out = String::new();
    let mut rest = text;
    while let Some(at) = rest.find('$') {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        if let Some(tail) = after.strip_prefix('$') {
            out.push('$');
            rest = tail;
        } else if let Some(body) = after.strip_prefix('{') {
            let end = body
                .find('}')
                .ok_or_else(|| format!("unclosed ${{ in `{text}`"))?;
            let expr = &body[..end];
            rest = &body[end + 1..];
            let name_len = expr
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(expr.len());
            let (name, op) = expr.split_at(name_len);
            let value = vars(name);
            let set = value.as_deref().is_some_and(|v| !v.is_empty());
            let resolved = if let Some(default) = op.strip_prefix(":-") {
                if set {
                    value.unwrap_or_default()
                } else {
                    default.to_owned()
                }
            } else if let Some(default) = op.strip_prefix('-') {
                value.unwrap_or_else(|| default.to_owned())
            } else if let Some(message) = op.strip_prefix(":?") {
                if !set {
                    return Err(format!("required variable {name} is not set: {message}"));
                }
                value.unwrap_or_default()
            } else if let Some(message) = op.strip_prefix('?') {
                value.ok_or_else(|| format!("required variable {name} is not set: {message}"))?
            } else if op.is_empty() {
                value.unwrap_or_default()
            } else {
                return Err(format!(
                    "unsupported interpolation `${{{expr}}}` in `{text}`"
                ));
            };
            out.push_str(&resolved);
        } else {
            let name_len = after
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(after.len());
            let (name, tail) = after.split_at(name_len);
            out.push_str(&vars(name).unwrap_or_default());
            rest = tail;
        }
    }
    out.push_str(rest);
    Ok(out)
}
