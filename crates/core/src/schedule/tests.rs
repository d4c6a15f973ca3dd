use super::*;

fn at(rfc3339: &str) -> Timestamp {
    Timestamp(
        time::OffsetDateTime::parse(rfc3339, &time::format_description::well_known::Rfc3339)
            .expect("valid instant"),
    )
}

fn show(t: Timestamp) -> String {
    t.0.format(&time::format_description::well_known::Rfc3339)
        .expect("formats")
}

fn request(json: serde_json::Value) -> ScheduleRequest {
    serde_json::from_value(json).expect("request parses")
}

fn cron(expr: &str, zone: &str) -> ScheduleSpec {
    request(serde_json::json!({
        "agent": "triage", "task": {"input": "go"}, "cron": expr, "time_zone": zone,
    }))
    .validate("morning")
    .expect("valid")
}

fn every(secs: u64, catch_up: CatchUp, window: u64, max: u32) -> ScheduleSpec {
    let mut spec = request(serde_json::json!({
        "agent": "triage", "task": {"input": "go"}, "interval_secs": secs,
    }))
    .validate("tick")
    .expect("valid");
    spec.catch_up = catch_up;
    spec.catch_up_window_secs = window;
    spec.catch_up_max = max;
    spec
}

fn nexts(spec: &ScheduleSpec, from: &str, n: usize) -> Vec<String> {
    let mut t = at(from);
    let mut out = Vec::new();
    for _ in 0..n {
        t = spec.next_after(t).expect("a next instant");
        out.push(show(t));
    }
    out
}

#[test]
fn a_daily_cron_fires_at_local_wall_time_across_dst() {
    let spec = cron("0 7 * * *", "Europe/Paris");
    // Winter (UTC+1), then the spring-forward night of 2026-03-29, then summer (UTC+2).
    assert_eq!(
        nexts(&spec, "2026-03-27T12:00:00Z", 4),
        [
            "2026-03-28T06:00:00Z",
            "2026-03-29T05:00:00Z",
            "2026-03-30T05:00:00Z",
            "2026-03-31T05:00:00Z",
        ]
    );
}

#[test]
fn a_wall_time_skipped_by_spring_forward_fires_once_after_the_gap() {
    // 02:30 does not exist in Paris on 2026-03-29 (02:00 → 03:00).
    let spec = cron("30 2 * * *", "Europe/Paris");
    let got = nexts(&spec, "2026-03-28T12:00:00Z", 3);
    assert_eq!(got[0], "2026-03-29T01:00:00Z", "{got:?}"); // 03:00 CEST, the gap's end
    assert_eq!(got[1], "2026-03-30T00:30:00Z", "{got:?}"); // 02:30 CEST
    assert_eq!(got[2], "2026-03-31T00:30:00Z", "{got:?}");
}

#[test]
fn a_wall_time_repeated_by_fall_back_fires_once() {
    // 02:30 happens twice in Paris on 2026-10-25 (03:00 CEST → 02:00 CET).
    let spec = cron("30 2 * * *", "Europe/Paris");
    let got = nexts(&spec, "2026-10-24T12:00:00Z", 2);
    assert_eq!(got[0], "2026-10-25T00:30:00Z", "{got:?}"); // first 02:30 (CEST)
    assert_eq!(got[1], "2026-10-26T01:30:00Z", "{got:?}"); // next day, CET
}

#[test]
fn cron_in_utc_and_with_seconds() {
    let spec = cron("*/20 * * * * *", "UTC");
    assert_eq!(
        nexts(&spec, "2026-01-01T00:00:05Z", 3),
        [
            "2026-01-01T00:00:20Z",
            "2026-01-01T00:00:40Z",
            "2026-01-01T00:01:00Z"
        ]
    );
    // Strictly after: an instant on the pattern is not its own next.
    assert_eq!(
        nexts(&spec, "2026-01-01T00:00:20Z", 1),
        ["2026-01-01T00:00:40Z"]
    );
    let t = at("2026-01-01T00:00:39Z");
    assert_eq!(
        spec.latest_at_or_before(t).map(show).as_deref(),
        Some("2026-01-01T00:00:20Z")
    );
    assert_eq!(
        spec.latest_at_or_before(at("2026-01-01T00:00:40Z"))
            .map(show)
            .as_deref(),
        Some("2026-01-01T00:00:40Z")
    );
}

#[test]
fn intervals_align_to_the_epoch_whatever_the_zone() {
    let mut spec = every(3600, CatchUp::None, 3600, 10);
    spec.time_zone = "Asia/Kolkata".into(); // UTC+5:30: intervals ignore it
    assert_eq!(
        nexts(&spec, "2026-05-01T10:17:00Z", 2),
        ["2026-05-01T11:00:00Z", "2026-05-01T12:00:00Z"]
    );
    let spec = every(7, CatchUp::None, 3600, 10);
    let t = spec.next_after(from_unix(100)).expect("next");
    assert_eq!(secs(t), 105);
    assert_eq!(spec.next_after(from_unix(105)).map(secs), Some(112));
    assert_eq!(
        spec.latest_at_or_before(from_unix(111)).map(secs),
        Some(105)
    );
    assert_eq!(
        spec.latest_at_or_before(from_unix(105)).map(secs),
        Some(105)
    );
    // Sub-second parts do not matter.
    let t = Timestamp(from_unix(105).0 + time::Duration::milliseconds(900));
    assert_eq!(spec.next_after(t).map(secs), Some(112));
}

fn fired(spec: &ScheduleSpec, from: i64, now: i64, on_time_from: i64) -> (Vec<i64>, bool) {
    let plan = spec.plan(from_unix(from), from_unix(now), from_unix(on_time_from));
    (plan.fire.into_iter().map(secs).collect(), plan.missed)
}

#[test]
fn catch_up_none_fires_no_missed_instant_and_every_on_time_one() {
    let spec = every(10, CatchUp::None, 3600, 10);
    // Handled through 1000; the scheduler started at 1045; now 1053: 1010..1040 were missed.
    assert_eq!(fired(&spec, 1000, 1053, 1045), (vec![1050], true));
    // An instant exactly at the start is on time.
    assert_eq!(fired(&spec, 1000, 1053, 1050), (vec![1050], true));
    // Nothing missed: everything since `from` is on time.
    assert_eq!(
        fired(&spec, 1000, 1033, 990),
        (vec![1010, 1020, 1030], false)
    );
    // Nothing new.
    assert_eq!(fired(&spec, 1050, 1059, 1000), (vec![], false));
    // Missed and nothing on time yet.
    assert_eq!(fired(&spec, 1000, 1049, 1045), (vec![], true));
}

#[test]
fn catch_up_last_fires_the_most_recent_missed_instant_within_the_window() {
    let spec = every(10, CatchUp::Last, 3600, 10);
    assert_eq!(fired(&spec, 1000, 1053, 1045), (vec![1040, 1050], true));
    // Only one instant missed: nothing else was.
    assert_eq!(fired(&spec, 1030, 1053, 1045), (vec![1040, 1050], false));
    // The most recent missed instant is 1040, 13 s old: outside a 10-second window.
    let spec = every(10, CatchUp::Last, 10, 10);
    assert_eq!(fired(&spec, 1000, 1053, 1045), (vec![1050], true));
}

#[test]
fn catch_up_all_fires_every_missed_instant_within_the_window_bounded() {
    let spec = every(10, CatchUp::All, 3600, 100);
    assert_eq!(
        fired(&spec, 1000, 1053, 1045),
        (vec![1010, 1020, 1030, 1040, 1050], false)
    );
    // The window: only missed instants at most 25 s old.
    let spec = every(10, CatchUp::All, 25, 100);
    assert_eq!(
        fired(&spec, 1000, 1053, 1045),
        (vec![1030, 1040, 1050], true)
    );
    // The count: the latest `catch_up_max` missed ones.
    let spec = every(10, CatchUp::All, 3600, 2);
    assert_eq!(
        fired(&spec, 1000, 1053, 1045),
        (vec![1030, 1040, 1050], true)
    );
    // A long outage with a short interval costs a bounded walk, not one step per instant.
    let spec = every(1, CatchUp::All, 3600, 5);
    let (got, missed) = fired(&spec, 0, 10_000_000, 10_000_000);
    assert_eq!(
        got,
        [
            9_999_995, 9_999_996, 9_999_997, 9_999_998, 9_999_999, 10_000_000
        ]
    );
    assert!(missed);
    let mut spec = cron("* * * * * *", "Europe/Paris");
    spec.catch_up = CatchUp::All;
    spec.catch_up_max = 1;
    let plan = spec.plan(
        from_unix(0),
        from_unix(1_800_000_000),
        from_unix(1_800_000_000),
    );
    assert_eq!(
        plan.fire.len(),
        2,
        "one missed (the max of 1) and one on time"
    );
}

#[test]
fn plan_never_fires_at_or_before_what_was_handled_nor_after_now() {
    for catch_up in [CatchUp::None, CatchUp::Last, CatchUp::All] {
        let spec = every(10, catch_up, 3600, 100);
        for from in [1000, 1005, 1040, 1050] {
            for start in [900, 1020, 1045, 1060] {
                let (got, _) = fired(&spec, from, 1053, start);
                assert!(got.windows(2).all(|w| w[0] < w[1]), "{got:?}");
                for p in got {
                    assert!(p > from && p <= 1053, "{catch_up:?} {from} {start} {p}");
                }
            }
        }
    }
}

#[test]
fn overlap_policies() {
    for o in [
        Overlap::Skip,
        Overlap::QueueOne,
        Overlap::Allow,
        Overlap::CancelPrevious,
    ] {
        assert_eq!(on_due(o, false), OnDue::Fire);
    }
    assert_eq!(on_due(Overlap::Skip, true), OnDue::Skip);
    assert_eq!(on_due(Overlap::QueueOne, true), OnDue::Queue);
    assert_eq!(on_due(Overlap::Allow, true), OnDue::Fire);
    assert_eq!(on_due(Overlap::CancelPrevious, true), OnDue::CancelThenFire);
}

#[test]
fn hostile_requests_are_refused_naming_the_field() {
    let base = serde_json::json!({"agent": "triage", "task": {"input": "go"}, "interval_secs": 5});
    let field = |patch: serde_json::Value, name: &str| {
        let mut v = base.clone();
        for (k, x) in patch.as_object().expect("object") {
            if x.is_null() {
                v.as_object_mut().expect("object").remove(k);
            } else {
                v[k] = x.clone();
            }
        }
        match serde_json::from_value::<ScheduleRequest>(v) {
            Ok(r) => r.validate(name).expect_err("refused").field,
            Err(_) => "body".to_owned(),
        }
    };
    assert_eq!(field(serde_json::json!({}), "UPPER"), "name");
    assert_eq!(field(serde_json::json!({}), "-x"), "name");
    assert_eq!(field(serde_json::json!({}), "a.b"), "name");
    assert_eq!(field(serde_json::json!({}), &"a".repeat(65)), "name");
    assert_eq!(field(serde_json::json!({}), ""), "name");
    assert_eq!(field(serde_json::json!({"cron": "0 7 * * *"}), "x"), "cron");
    assert_eq!(
        field(serde_json::json!({"interval_secs": null}), "x"),
        "cron"
    );
    assert_eq!(
        field(
            serde_json::json!({"interval_secs": null, "cron": "61 * * * *"}),
            "x"
        ),
        "cron"
    );
    assert_eq!(
        field(
            serde_json::json!({"interval_secs": null, "cron": "0 0 30 2 *"}),
            "x"
        ),
        "cron"
    );
    assert_eq!(
        field(serde_json::json!({"interval_secs": 0}), "x"),
        "interval_secs"
    );
    assert_eq!(
        field(
            serde_json::json!({"interval_secs": MAX_INTERVAL_SECS + 1}),
            "x"
        ),
        "interval_secs"
    );
    assert_eq!(
        field(serde_json::json!({"time_zone": "Mars/Olympus"}), "x"),
        "time_zone"
    );
    assert_eq!(
        field(serde_json::json!({"agent": "bad agent"}), "x"),
        "agent"
    );
    assert_eq!(
        field(serde_json::json!({"task": {"input": 3}}), "x"),
        "task.input"
    );
    assert_eq!(field(serde_json::json!({"task": {}}), "x"), "task.input");
    assert_eq!(
        field(
            serde_json::json!({"task": {"input": "x", "run_id": "run_a"}}),
            "x"
        ),
        "task.run_id"
    );
    assert_eq!(
        field(
            serde_json::json!({"task": {"input": "x", "surprise": 1}}),
            "x"
        ),
        "task.surprise"
    );
    assert_eq!(
        field(
            serde_json::json!({"task": {"input": "x".repeat(MAX_TEMPLATE_BYTES)}}),
            "x"
        ),
        "task"
    );
    assert_eq!(
        field(
            serde_json::json!({"catch_up_window_secs": MAX_CATCH_UP_WINDOW_SECS + 1}),
            "x"
        ),
        "catch_up_window_secs"
    );
    assert_eq!(
        field(serde_json::json!({"catch_up_max": 0}), "x"),
        "catch_up_max"
    );
    assert_eq!(
        field(serde_json::json!({"overlap": "sometimes"}), "x"),
        "body"
    );
    assert_eq!(field(serde_json::json!({"extra": 1}), "x"), "body");
    assert!(ScheduleRequest::parse(b"[").is_err());
}

#[test]
fn a_valid_request_round_trips_through_its_spec() {
    let req = request(serde_json::json!({
        "agent": "triage",
        "task": {"input": "morning triage", "metadata": {"team": "ops"}, "budget": {"max_steps": 4}},
        "cron": "0 7 * * 1-5",
        "time_zone": "America/New_York",
        "overlap": "queue_one",
        "catch_up": "last",
    }));
    let spec = req.validate("weekday-triage").expect("valid");
    assert_eq!(spec.task.agent.as_str(), "triage");
    assert_eq!(spec.catch_up_window_secs, DEFAULT_CATCH_UP_WINDOW_SECS);
    let again = spec.request().validate("weekday-triage").expect("valid");
    assert_eq!(again, spec);
    let json = serde_json::to_string(&spec).expect("serializes");
    assert_eq!(
        serde_json::from_str::<ScheduleSpec>(&json).expect("parses"),
        spec
    );
}

#[test]
fn keys_and_firing_ids() {
    let tenant: TenantId = "acme".parse().expect("tenant");
    assert_eq!(record_key(&tenant, "morning"), "acme.morning");
    assert_eq!(
        parse_record_key("acme.morning"),
        Some((tenant.clone(), "morning".to_owned()))
    );
    assert_eq!(parse_record_key("acme"), None);
    assert_eq!(parse_record_key("acme.Bad"), None);
    let t = from_unix(1_700_000_000);
    assert_eq!(
        firing_key(&tenant, "morning", t),
        "schedule:acme.morning@1700000000"
    );
    assert_ne!(
        firing_key(&tenant, "morning", t),
        firing_key(&tenant, "morning", from_unix(1_700_000_001))
    );
}

#[test]
fn a_record_fires_next_after_what_it_handled_unless_paused() {
    let tenant: TenantId = "acme".parse().expect("tenant");
    let spec = every(10, CatchUp::None, 3600, 10);
    let mut record = ScheduleRecord {
        tenant,
        spec,
        paused: false,
        state: ScheduleState::new(from_unix(1003)),
    };
    assert_eq!(record.next_fire(from_unix(1004)), Some(from_unix(1010)));
    record.state.last_instant = Some(from_unix(1030));
    assert_eq!(record.next_fire(from_unix(1004)), Some(from_unix(1040)));
    assert_eq!(record.state.handled_through(), from_unix(1030));
    record.paused = true;
    assert_eq!(record.next_fire(from_unix(1004)), None);
}

#[test]
fn an_instant_just_before_a_scheduler_started_was_missed() {
    let spec = every(10, CatchUp::None, 3600, 10);
    // Started 0.3 s after 1050: 1050 fell due while no scheduler ran.
    let started = Timestamp(from_unix(1050).0 + time::Duration::milliseconds(300));
    let plan = spec.plan(from_unix(1040), from_unix(1055), started);
    assert!(plan.fire.is_empty() && plan.missed, "{plan:?}");
    let spec = every(10, CatchUp::Last, 3600, 10);
    let plan = spec.plan(from_unix(1040), from_unix(1055), started);
    assert_eq!(plan.fire, [from_unix(1050)]);
}
