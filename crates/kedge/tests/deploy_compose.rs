//! compose.yaml, checked without a container engine: it is valid against the
//! compose-spec JSON Schema (vendored as deploy/compose-spec.json); every Kedge service kind runs
//! in a container of its own, step and tool with replicas, and nothing else is served; every
//! `kedge` command in it parses with Kedge's own CLI and loads its configuration with Kedge's own
//! loader, in the environment compose gives it; every file it mounts parses (the NATS node
//! configuration with `nats-server -t`, against the accounts `kedge nats-config` generates from the
//! mounted tenants file); and its wiring holds together (health checks behind every
//! `service_healthy`, one-shots behind every `service_completed_successfully`, pinned images, a
//! non-root Dockerfile). `cluster_topology.rs` runs the same topology as processes.

use crate::compose;

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use compose::{MountSource, Service, repo_root};
use serde_json::Value;

/// Values for the variables compose.yaml requires (`${X:?…}`); every other variable is left
/// unset, so defaults apply as they would on a fresh machine.
fn vars(name: &str) -> Option<String> {
    match name {
        "KEDGE_BRIDGE_TOKENS" => Some("check-token-0123456789=acme".to_owned()),
        _ => None,
    }
}

fn kedge() -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_kedge"));
    // Only what compose would give the container: nothing of this test's environment leaks in.
    cmd.env_clear();
    if let Some(path) = std::env::var_os("PATH") {
        cmd.env("PATH", path);
    }
    cmd
}

fn nats_server() -> PathBuf {
    kedge_testkit::nats_server_binary()
}

fn text(out: &Output) -> String {
    format!(
        "status {}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// The service kinds `kedge serve` accepts, from its own help (`all` left out: it is several).
fn serve_kinds() -> BTreeSet<String> {
    let out = kedge()
        .args(["serve", "--help"])
        .output()
        .expect("run kedge serve --help");
    assert!(out.status.success(), "{}", text(&out));
    let help = String::from_utf8_lossy(&out.stdout).into_owned();
    let values = help
        .split("Possible values:")
        .nth(1)
        .expect("kedge serve --help lists the possible values");
    values
        .lines()
        .skip(1)
        .map_while(|l| l.trim().strip_prefix("- "))
        .map(|v| v.split(':').next().unwrap_or(v).trim().to_owned())
        .filter(|k| k != "all")
        .collect()
}

#[test]
fn compose_yaml_is_valid_against_the_compose_spec_schema() {
    let schema_path = repo_root().join("deploy/compose-spec.json");
    let schema: Value = serde_json::from_str(
        &std::fs::read_to_string(&schema_path).expect("read deploy/compose-spec.json"),
    )
    .expect("the schema is JSON");
    let validator = jsonschema::validator_for(&schema).expect("the compose-spec schema compiles");
    let doc = compose::load();
    let errors: Vec<String> = validator
        .iter_errors(&doc)
        .map(|e| format!("{} at {}", e, e.instance_path()))
        .collect();
    assert!(
        errors.is_empty(),
        "compose.yaml is not valid against the compose-spec:\n{}",
        errors.join("\n")
    );
    // The validator is live: the mistakes compose itself refuses are refused here too.
    let mut misspelled = doc.clone();
    misspelled["services"]["intake"]["restrat"] = "always".into();
    assert!(
        !validator.is_valid(&misspelled),
        "an unknown service key passed"
    );
    let mut condition = doc.clone();
    condition["services"]["intake"]["depends_on"]["layout"]["condition"] = "service_done".into();
    assert!(
        !validator.is_valid(&condition),
        "an unknown depends_on condition passed"
    );
    let mut replicas = doc;
    replicas["services"]["step"]["deploy"]["replicas"] = serde_json::json!({"n": 2});
    assert!(
        !validator.is_valid(&replicas),
        "replicas that are not a number passed"
    );
}

#[test]
fn every_kedge_service_kind_runs_in_its_own_container_and_nothing_else_is_served() {
    let doc = compose::load();
    let services = compose::services(&doc);
    let kinds = serve_kinds();
    assert!(
        kinds.len() >= 9,
        "kedge serve --help lists too few kinds: {kinds:?}"
    );
    let mut served: BTreeMap<String, &Service> = BTreeMap::new();
    for s in &services {
        if s.is_kedge() && s.command.first().map(String::as_str) == Some("serve") {
            let kind = s.serve_kind().unwrap_or_else(|| {
                panic!(
                    "service {}: `{}` serves several kinds in one container; give each its own",
                    s.name,
                    s.command.join(" ")
                )
            });
            assert!(
                kinds.contains(kind),
                "service {}: `kedge serve {kind}` is not a service kind ({kinds:?})",
                s.name
            );
            assert!(
                s.doc["profiles"].is_null(),
                "service {}: behind a profile, `docker compose up` would not start it",
                s.name
            );
            assert!(
                served.insert(kind.to_owned(), s).is_none(),
                "kind {kind} is served by two compose services"
            );
        } else if !s.is_kedge() {
            let image = s.image.as_deref().unwrap_or_default();
            assert!(
                image.starts_with("nats:"),
                "service {} runs `{image}`: only Kedge and NATS belong here",
                s.name
            );
        }
    }
    let missing: Vec<&String> = kinds.iter().filter(|k| !served.contains_key(*k)).collect();
    assert!(
        missing.is_empty(),
        "kinds with no container in compose.yaml: {missing:?}"
    );
    for kind in ["step", "tool"] {
        assert!(
            served[kind].replicas >= 2,
            "{kind} runs {} replica(s); a crash must leave a standby",
            served[kind].replicas
        );
    }
    let nats: Vec<&Service> = services.iter().filter(|s| !s.is_kedge()).collect();
    assert_eq!(nats.len(), 3, "a three-node NATS cluster");
}

/// Runs a kedge service's command with `--dump-config` in the environment compose gives it
/// (container paths mapped to the repository's files): Kedge's own CLI parses the command and
/// Kedge's own loader loads and checks the configuration, without connecting anywhere.
fn dump_config(s: &Service, volumes: &Path) -> Value {
    let env = s.host_env(&vars, volumes);
    let out = kedge()
        .arg("--dump-config")
        .args(&s.command)
        .envs(&env)
        .output()
        .expect("run kedge --dump-config");
    assert!(
        out.status.success(),
        "service {}: `kedge {}` does not start with the environment {env:?}:\n{}",
        s.name,
        s.command.join(" "),
        text(&out)
    );
    serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("service {}: --dump-config printed no JSON ({e})", s.name))
}

#[test]
fn every_kedge_command_parses_and_loads_its_configuration_as_its_own_user() {
    let doc = compose::load();
    let volumes = tempfile::tempdir().expect("temp dir");
    for s in compose::services(&doc).iter().filter(|s| s.is_kedge()) {
        assert!(
            !s.command.is_empty(),
            "service {}: no command (the image would print its help and exit)",
            s.name
        );
        let config = dump_config(s, volumes.path());
        let env = s.env(&vars);
        if env.contains_key("KEDGE_CONFIG") {
            // deploy/kedge.json: the cluster's three nodes, R3 streams.
            assert_eq!(
                config["replicas"], 3,
                "service {}: streams must be R3",
                s.name
            );
            assert_eq!(
                config["nats_urls"].as_array().map(Vec::len),
                Some(3),
                "service {}: all three nodes",
                s.name
            );
        }
        assert!(
            !env.contains_key("KEDGE_WORKER_ID"),
            "service {}: a fixed worker id would be shared by its replicas",
            s.name
        );
        let user = match (s.serve_kind(), s.command.first().map(String::as_str)) {
            (Some(kind), _) => Some(kind.to_owned()),
            (None, Some("layout")) => Some("admin".to_owned()),
            _ => None,
        };
        if let Some(user) = user {
            let key = config["nats"]["nkey_seed_file"]
                .as_str()
                .unwrap_or_default();
            assert!(
                key.ends_with(&format!("/keys/{user}.nk")),
                "service {} must connect as the `{user}` user (its nkey), not `{key}`",
                s.name
            );
        }
    }
}

/// Lays out a service's mounts under `root` as the container sees them (host files copied,
/// named volumes linked to their directory under `volumes`).
fn container_root(s: &Service, root: &Path, volumes: &Path) {
    for m in &s.mounts {
        let at = root.join(m.target.trim_start_matches('/'));
        std::fs::create_dir_all(at.parent().expect("a mount target has a parent")).expect("mkdir");
        match &m.source {
            MountSource::Host(p) => {
                std::fs::copy(p, &at).unwrap_or_else(|e| {
                    panic!("service {}: mounted file {}: {e}", s.name, p.display())
                });
            }
            MountSource::Volume(v) => {
                let dir = volumes.join(v);
                std::fs::create_dir_all(&dir).expect("volume dir");
                std::os::unix::fs::symlink(&dir, &at).expect("link the volume");
            }
        }
    }
}

#[test]
fn every_file_compose_mounts_exists_and_parses() {
    let doc = compose::load();
    let services = compose::services(&doc);
    let volumes = tempfile::tempdir().expect("temp dir");
    // The one-shot that writes the secured broker configuration, run as compose runs it: its
    // tenants file parses and it writes accounts.conf and the keys into the shared volume.
    let generator = services
        .iter()
        .find(|s| s.is_kedge() && s.command.first().map(String::as_str) == Some("nats-config"))
        .expect("a service runs `kedge nats-config`");
    let args: Vec<String> = generator
        .command
        .iter()
        .map(|a| {
            generator
                .host_path(a, volumes.path())
                .map_or(a.clone(), |p| p.display().to_string())
        })
        .collect();
    let out = kedge().args(&args).output().expect("run kedge nats-config");
    assert!(
        out.status.success(),
        "`kedge {}`:\n{}",
        args.join(" "),
        text(&out)
    );
    let mut checked: BTreeSet<PathBuf> = BTreeSet::new();
    // Files a command reads (the tenants file).
    for m in &generator.mounts {
        if let MountSource::Host(p) = &m.source
            && generator.command.contains(&m.target)
        {
            checked.insert(p.clone());
        }
    }
    for s in &services {
        for m in &s.mounts {
            let MountSource::Host(host) = &m.source else {
                continue;
            };
            assert!(
                host.is_file(),
                "service {}: {} is missing",
                s.name,
                host.display()
            );
            assert!(
                m.read_only,
                "service {}: mount {} should be read-only",
                s.name, m.target
            );
            let env = s.env(&vars);
            if env.get("KEDGE_CONFIG") == Some(&m.target) {
                // Kedge's loader (the commands' test loads it in each service's environment).
                let out = kedge()
                    .arg("--config")
                    .arg(host)
                    .args(["--dump-config", "layout"])
                    .output()
                    .expect("run kedge");
                assert!(out.status.success(), "{}: {}", host.display(), text(&out));
                checked.insert(host.clone());
            } else if !s.is_kedge() && m.target.ends_with(".conf") {
                // A NATS node's configuration, in the file layout of its container.
                let root = tempfile::tempdir().expect("temp dir");
                container_root(s, root.path(), volumes.path());
                let conf = root.path().join(m.target.trim_start_matches('/'));
                let out = Command::new(nats_server())
                    .arg("-t")
                    .arg("-c")
                    .arg(&conf)
                    .env_clear()
                    .envs(&env)
                    .output()
                    .expect("run nats-server -t");
                assert!(
                    out.status.success(),
                    "service {}: nats-server -t {}:\n{}",
                    s.name,
                    host.display(),
                    text(&out)
                );
                // And the check is a real one: without its server name the file does not parse.
                let out = Command::new(nats_server())
                    .arg("-t")
                    .arg("-c")
                    .arg(&conf)
                    .env_clear()
                    .output()
                    .expect("run nats-server -t");
                assert!(
                    !out.status.success(),
                    "nats-server -t accepts anything:\n{}",
                    text(&out)
                );
                checked.insert(host.clone());
            }
        }
    }
    let unchecked: Vec<String> = services
        .iter()
        .flat_map(|s| s.mounts.iter())
        .filter_map(|m| match &m.source {
            MountSource::Host(p) if !checked.contains(p) => Some(p.display().to_string()),
            _ => None,
        })
        .collect();
    assert!(
        unchecked.is_empty(),
        "mounted files this test does not know how to check (add a check): {unchecked:?}"
    );
}

#[test]
fn health_checks_start_order_restarts_and_pinned_images_hold_together() {
    let doc = compose::load();
    let services = compose::services(&doc);
    let by_name: BTreeMap<&str, &Service> = services.iter().map(|s| (s.name.as_str(), s)).collect();
    for s in &services {
        let deps = s.doc["depends_on"].as_object().cloned().unwrap_or_default();
        for (dep, how) in deps {
            let target = by_name
                .get(dep.as_str())
                .unwrap_or_else(|| panic!("{} depends on unknown {dep}", s.name));
            match how["condition"].as_str() {
                Some("service_healthy") => assert!(
                    target.doc["healthcheck"].is_object(),
                    "{} waits for {dep} to be healthy, which has no healthcheck",
                    s.name
                ),
                Some("service_completed_successfully") => assert_eq!(
                    target.doc["restart"], "no",
                    "{} waits for the one-shot {dep} to complete, which restarts",
                    s.name
                ),
                other => panic!("{} -> {dep}: condition {other:?}", s.name),
            }
        }
        let one_shot = services
            .iter()
            .any(|o| o.doc["depends_on"][&s.name]["condition"] == "service_completed_successfully");
        if one_shot {
            assert_eq!(s.doc["restart"], "no", "{}", s.name);
        } else {
            assert_eq!(
                s.doc["restart"], "unless-stopped",
                "long-running service {} must come back after a crash",
                s.name
            );
        }
        if !s.is_kedge() {
            assert!(
                s.doc["healthcheck"].is_object(),
                "NATS node {} has no healthcheck",
                s.name
            );
        }
        if s.serve_kind() == Some("bridge") {
            assert!(
                s.doc["healthcheck"].is_object(),
                "the bridge has no healthcheck"
            );
        }
        let image = s.image.as_deref().expect("every service names its image");
        let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or_default();
        assert!(
            tag.chars().next().is_some_and(|c| c.is_ascii_digit()) && tag.contains('.'),
            "service {}: image `{image}` is not pinned to a version",
            s.name
        );
        if s.is_kedge() {
            assert!(
                s.doc["build"]["dockerfile"] == "Dockerfile",
                "service {}: builds from the repository's Dockerfile",
                s.name
            );
        }
    }
    let dockerfile =
        std::fs::read_to_string(repo_root().join("Dockerfile")).expect("read Dockerfile");
    let froms: Vec<&str> = dockerfile
        .lines()
        .filter_map(|l| l.trim().strip_prefix("FROM "))
        .collect();
    assert!(froms.len() >= 2, "a multi-stage build: {froms:?}");
    for from in &froms {
        let image = from.split_whitespace().next().unwrap_or_default();
        let tag = image.rsplit_once(':').map(|(_, t)| t).unwrap_or_default();
        assert!(
            tag.chars().next().is_some_and(|c| c.is_ascii_digit()),
            "Dockerfile: base image `{image}` is not pinned to a version"
        );
    }
    let user = dockerfile
        .lines()
        .rev()
        .find_map(|l| l.trim().strip_prefix("USER "))
        .expect("the Dockerfile sets a USER");
    assert!(
        !user.starts_with("root") && !user.starts_with('0'),
        "the image runs as root ({user})"
    );
}
