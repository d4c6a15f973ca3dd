//! The permissions built from the registry: each kind's rules, and the generated file.

use super::*;

fn allowed(kind: Kind, dir: &str) -> Vec<String> {
    let p = kind_permissions(kind).expect("not admin");
    serde_json::from_value(p[dir]["allow"].clone()).expect("list")
}

fn denied(kind: Kind) -> Vec<String> {
    let p = kind_permissions(kind).expect("not admin");
    serde_json::from_value(p["publish"]["deny"].clone()).expect("list")
}

#[test]
fn only_step_and_intake_write_decisions_and_intake_only_run_created() {
    for kind in Kind::EVERY.iter().copied().filter(|k| *k != Kind::Admin) {
        let publish = allowed(kind, "publish");
        let decides = publish.iter().any(|s| s == "agent.run.*.d.>");
        assert_eq!(
            decides,
            matches!(kind, Kind::Step | Kind::All),
            "{kind}: {publish:?}"
        );
        let creates = publish.iter().any(|s| s == "agent.run.*.d.run.created");
        assert_eq!(creates, matches!(kind, Kind::Intake | Kind::All), "{kind}");
        assert!(
            !publish
                .iter()
                .any(|s| s == ">" || s == "agent.>" || s == "agent.run.>"),
            "{kind}"
        );
    }
}

#[test]
fn each_kind_appends_only_the_inputs_it_makes() {
    let may = |kind: Kind, subject: &str| {
        allowed(kind, "publish")
            .iter()
            .any(|s| s == subject || s == "agent.run.*.i.>")
    };
    for kind in Kind::EVERY.iter().copied().filter(|k| *k != Kind::Admin) {
        assert_eq!(
            may(kind, "agent.run.*.i.approval.decided"),
            matches!(
                kind,
                Kind::Approval | Kind::Bridge | Kind::Gateway | Kind::Operator | Kind::All
            ),
            "{kind}"
        );
        // The step gives a parent its child run's result (and a refused run_agent call its
        // refusal): it writes any decision of any run already, so this adds no power.
        assert_eq!(
            may(kind, "agent.run.*.i.tool.result"),
            matches!(kind, Kind::Tool | Kind::Step | Kind::Operator | Kind::All),
            "{kind}"
        );
    }
    // Of inputs, the step appends only these four: a child's result, the cancel a
    // cancelling parent sends its children, the fleet's release of a run waiting on its
    // model provider, and a slot of a concurrency key handed to a waiting run.
    let step_inputs: Vec<String> = allowed(Kind::Step, "publish")
        .into_iter()
        .filter(|s| s.contains(".i."))
        .collect();
    assert_eq!(
        step_inputs,
        vec![
            "agent.run.*.i.cancel.requested".to_owned(),
            "agent.run.*.i.provider.released".to_owned(),
            "agent.run.*.i.slot.granted".to_owned(),
            "agent.run.*.i.tool.result".to_owned()
        ]
    );
    // Slots are handed on by the run that gives one back (the step) or by the reconciler's
    // recovery (docs/ARCHITECTURE.md "Concurrency keys and priorities").
    for kind in Kind::EVERY.iter().copied().filter(|k| *k != Kind::Admin) {
        assert_eq!(
            may(kind, "agent.run.*.i.slot.granted"),
            matches!(
                kind,
                Kind::Step | Kind::Reconciler | Kind::Operator | Kind::All
            ),
            "{kind}"
        );
    }
    for kind in Kind::EVERY.iter().copied().filter(|k| *k != Kind::Admin) {
        assert_eq!(
            may(kind, "agent.run.*.i.provider.released"),
            matches!(kind, Kind::Step | Kind::Operator | Kind::All),
            "{kind}"
        );
    }
}

#[test]
fn only_tool_runners_hear_tool_requests_and_only_the_reconciler_asks_to_resolve() {
    for kind in Kind::EVERY.iter().copied().filter(|k| *k != Kind::Admin) {
        let subscribe = allowed(kind, "subscribe");
        let hears = subscribe.iter().any(|s| s.starts_with("kedge.tool."));
        assert_eq!(hears, matches!(kind, Kind::Tool | Kind::All), "{kind}");
        let publish = allowed(kind, "publish");
        let resolves = publish.iter().any(|s| s == "kedge.tool.resolve");
        assert_eq!(
            resolves,
            matches!(kind, Kind::Reconciler | Kind::All),
            "{kind}"
        );
    }
}

#[test]
fn only_retention_purges_and_only_the_streams_a_finished_run_has_data_in() {
    let publish = allowed(Kind::Retention, "publish");
    let purges: Vec<&String> = publish
        .iter()
        .filter(|s| s.starts_with("$JS.API.STREAM.PURGE."))
        .collect();
    assert_eq!(purges.len(), 7, "{purges:?}");
    assert!(purges.iter().all(|s| !s.contains('>') && !s.contains('*')));
    assert!(
        !purges
            .iter()
            .any(|s| s.ends_with("KEDGE_TASKS") || s.ends_with("KV_kedge_agents"))
    );
    let deny = denied(Kind::Retention);
    assert!(!deny.iter().any(|d| d == "$JS.API.STREAM.PURGE.>"));
    for must in [
        "$JS.API.STREAM.DELETE.>",
        "$JS.API.STREAM.UPDATE.>",
        "$JS.API.STREAM.MSG.DELETE.>",
        "$KV.kedge_agents.>",
    ] {
        assert!(deny.iter().any(|d| d == must), "retention may {must}");
    }
    // Nothing that writes a run: no decisions, no inputs, no task.
    assert!(
        !publish
            .iter()
            .any(|s| s.starts_with("agent.") || s.starts_with("kedge.tool"))
    );
    assert!(
        !Kind::SERVICES.contains(&Kind::Retention),
        "not part of all"
    );
}

#[test]
fn nobody_but_admin_deletes_purges_or_changes_agents_or_others_consumers() {
    for kind in Kind::EVERY
        .iter()
        .copied()
        .filter(|k| !matches!(k, Kind::Admin | Kind::Retention))
    {
        let deny = denied(kind);
        for must in [
            "$JS.API.STREAM.DELETE.>",
            "$JS.API.STREAM.PURGE.>",
            "$JS.API.STREAM.CREATE.>",
            "$JS.API.STREAM.UPDATE.>",
            "$JS.API.CONSUMER.DELETE.KEDGE_RUNS.step",
            "$JS.API.CONSUMER.DELETE.KEDGE_TASKS.intake",
            "$KV.kedge_agents.>",
        ] {
            assert!(deny.iter().any(|d| d == must), "{kind} may {must}");
        }
    }
    // The step user may not touch the tool runners' durable, though ordered consumers on
    // KEDGE_RUNS are allowed to it.
    let deny = denied(Kind::Step);
    assert!(
        deny.iter()
            .any(|d| d == "$JS.API.CONSUMER.CREATE.KEDGE_RUNS.tool.>")
    );
    assert!(deny.iter().any(|d| d == "$JS.ACK.KEDGE_RUNS.tool.>"));
    assert!(!deny.iter().any(|d| d == "$JS.ACK.KEDGE_RUNS.step.>"));
    assert!(
        allowed(Kind::Step, "publish")
            .iter()
            .any(|d| d == "$JS.ACK.KEDGE_RUNS.step.>")
    );
    assert_eq!(kind_permissions(Kind::Admin), None);
}

#[test]
fn every_durable_is_pulled_by_exactly_one_kind() {
    for d in Durable::ALL {
        let owners: Vec<Kind> = Kind::EVERY
            .iter()
            .copied()
            .filter(|k| rules(*k).is_some_and(|r| r.durables.contains(&d)))
            .collect();
        assert_eq!(owners.len(), 1, "{d}: {owners:?}");
    }
}

#[test]
fn every_service_of_all_has_rules_and_all_unites_them() {
    let all = allowed(Kind::All, "publish");
    for kind in Kind::SERVICES {
        let rules = rules(*kind).expect("a service kind has rules");
        for s in &rules.publish {
            assert!(all.contains(s), "all lacks {kind}'s {s}");
        }
    }
    // The subjects come from the registry: a durable's name follows its `Durable`.
    assert!(all.contains(&"$JS.ACK.KEDGE_TIMERS.timer-fired.>".to_owned()));
    assert!(
        allowed(Kind::Retention, "publish")
            .contains(&"$KV.kedge_leases.retention.cursor".to_owned())
    );
}

/// `nats/secure/permissions.json` is this module's output; `KEDGE_BLESS=1` writes it again.
#[test]
fn the_permissions_file_is_what_the_registry_builds() {
    let file =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../nats/secure/permissions.json");
    let built = document();
    if std::env::var_os("KEDGE_BLESS").is_some() {
        std::fs::write(&file, &built).expect("write the permissions file");
        return;
    }
    let on_disk = std::fs::read_to_string(&file).unwrap_or_default();
    assert!(
        on_disk == built,
        "nats/secure/permissions.json differs from what kedge_runtime::secure::permissions \
         builds; regenerate it with `KEDGE_BLESS=1 cargo test -p kedge-runtime --lib \
         secure::permissions` and review the diff"
    );
    // It parses, and names every kind's rules.
    let v: Value = serde_json::from_str(&on_disk).expect("JSON");
    for kind in listed_kinds() {
        assert!(v["kinds"][kind.as_str()].is_object(), "{kind}");
    }
}
