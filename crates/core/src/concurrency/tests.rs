use super::*;

fn agent() -> AgentName {
    "support".parse().expect("an agent name")
}

fn meta(json: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    json.as_object().expect("an object").clone()
}

fn spec(key: &str, limit: u32) -> ConcurrencySpec {
    ConcurrencySpec {
        key: key.into(),
        limit,
    }
}

fn run(n: u32) -> RunId {
    format!("run_{n:032x}").parse().expect("a run id")
}

fn at(secs: i64) -> Timestamp {
    Timestamp(time::OffsetDateTime::from_unix_timestamp(1_700_000_000 + secs).expect("a time"))
}

fn claim(n: u32, priority: i32, secs: i64) -> Claim {
    Claim {
        run: run(n),
        priority,
        arrival: at(secs),
    }
}

fn record(limit: u32) -> SlotRecord {
    SlotRecord::new("acme".parse().expect("a tenant"), "k".into(), limit)
}

#[test]
fn templates_expand_over_the_task() {
    let m = meta(serde_json::json!({
        "customer": "c-42", "ticket": 7, "vip": true, "org": {"id": "o1"}
    }));
    let cases = [
        ("{metadata.customer}", "c-42"),
        ("ticket-{metadata.ticket}", "ticket-7"),
        ("{agent}/{metadata.vip}", "support/true"),
        ("{metadata.org.id}:{metadata.customer}", "o1:c-42"),
        ("global", "global"),
    ];
    for (template, key) in cases {
        let r = spec(template, 3)
            .resolve("concurrency", &agent(), &m, 0)
            .expect(template);
        assert_eq!(r.key, key, "{template}");
        assert_eq!(r.limit, 3);
    }
}

#[test]
fn bad_templates_and_limits_are_refused_naming_the_field() {
    let m = meta(serde_json::json!({"customer": "c", "list": [1], "none": null, "obj": {}}));
    let long = "x".repeat(MAX_KEY_BYTES + 1);
    let cases: Vec<(String, u32, &str)> = vec![
        (String::new(), 1, "concurrency.key"),
        ("{metadata.customer".into(), 1, "concurrency.key"),
        ("metadata.customer}".into(), 1, "concurrency.key"),
        ("{customer}".into(), 1, "concurrency.key"),
        ("{metadata.}".into(), 1, "concurrency.key"),
        ("{metadata.a b}".into(), 1, "concurrency.key"),
        ("{metadata.missing}".into(), 1, "concurrency.key"),
        ("{metadata.list}".into(), 1, "concurrency.key"),
        ("{metadata.none}".into(), 1, "concurrency.key"),
        ("{metadata.obj}".into(), 1, "concurrency.key"),
        ("{metadata.customer.deeper}".into(), 1, "concurrency.key"),
        ("a\nb".into(), 1, "concurrency.key"),
        (long, 1, "concurrency.key"),
        ("{metadata.customer}".into(), 0, "concurrency.limit"),
        (
            "{metadata.customer}".into(),
            MAX_LIMIT + 1,
            "concurrency.limit",
        ),
    ];
    for (template, limit, field) in cases {
        let err = spec(&template, limit)
            .resolve("concurrency", &agent(), &m, 0)
            .expect_err(&template);
        assert_eq!(err.field, field, "{template:?}: {err}");
    }
    // An expansion past the limit is refused too, though the template is short.
    let big = meta(serde_json::json!({"customer": "y".repeat(MAX_KEY_BYTES)}));
    let err = spec("k-{metadata.customer}", 1)
        .resolve("concurrency", &agent(), &big, 0)
        .expect_err("too long");
    assert_eq!(err.field, "concurrency.key");
    // Validation alone checks syntax, not values.
    spec("{metadata.missing}", 1)
        .validate("concurrency")
        .expect("syntax is fine");
}

#[test]
fn priorities_are_bounded() {
    for p in [MIN_PRIORITY, 0, MAX_PRIORITY] {
        check_priority("priority", p).expect("in range");
    }
    for p in [MIN_PRIORITY - 1, MAX_PRIORITY + 1, i32::MIN, i32::MAX] {
        assert_eq!(
            check_priority("priority", p).expect_err("out").field,
            "priority"
        );
    }
}

#[test]
fn the_waiting_order_is_priority_then_arrival_then_run() {
    let low_early = claim(1, 0, 0);
    let low_late = claim(2, 0, 5);
    let high_late = claim(3, 10, 9);
    let negative = claim(4, -5, -100);
    assert!(high_late.before(&low_early));
    assert!(low_early.before(&low_late));
    assert!(low_late.before(&negative));
    let same_time = claim(5, 0, 0);
    assert!(low_early.before(&same_time), "the run id breaks ties");
    assert!(!low_early.before(&low_early), "strict");
}

#[test]
fn a_key_grants_up_to_its_limit_then_queues_in_order() {
    let mut r = record(2);
    assert_eq!(r.take(&claim(1, 0, 0), 2), Admission::Granted);
    assert_eq!(r.take(&claim(2, 0, 1), 2), Admission::Granted);
    assert_eq!(r.take(&claim(3, 0, 2), 2), Admission::Queued { place: 1 });
    assert_eq!(r.take(&claim(4, 0, 3), 2), Admission::Queued { place: 2 });
    // A later, higher-priority run goes ahead of both.
    assert_eq!(r.take(&claim(5, 5, 4), 2), Admission::Queued { place: 1 });
    assert_eq!(r.place_of(&run(3)), Some(2));
    // Asking again is idempotent: a holder keeps its slot, a waiter its place.
    assert_eq!(r.take(&claim(1, 0, 0), 2), Admission::Granted);
    assert_eq!(r.take(&claim(4, 0, 3), 2), Admission::Queued { place: 3 });
    assert_eq!(r.holders, vec![run(1), run(2)]);
    assert_eq!(r.waiting.len(), 3);
}

#[test]
fn a_release_hands_the_slot_to_the_next_waiting_run() {
    let mut r = record(1);
    assert_eq!(r.take(&claim(1, 0, 0), 1), Admission::Granted);
    for (n, p) in [(2, 0), (3, 0), (4, 9)] {
        assert!(matches!(
            r.take(&claim(n, p, i64::from(n)), 1),
            Admission::Queued { .. }
        ));
    }
    assert_eq!(r.release(&run(1)), vec![run(4)], "the high priority first");
    assert_eq!(r.holders, vec![run(4)]);
    // The promoted run's own ask finds its slot.
    assert_eq!(r.take(&claim(4, 9, 4), 1), Admission::Granted);
    assert_eq!(r.release(&run(4)), vec![run(2)]);
    // Releasing a run that holds nothing frees nothing; a waiter leaves its place.
    assert_eq!(r.release(&run(99)), Vec::<RunId>::new());
    assert_eq!(r.release(&run(3)), Vec::<RunId>::new());
    assert!(r.waiting.is_empty());
    assert_eq!(r.release(&run(2)), Vec::<RunId>::new());
    assert!(r.is_idle());
}

#[test]
fn a_newcomer_does_not_jump_runs_already_waiting() {
    let mut r = record(1);
    assert_eq!(r.take(&claim(1, 0, 0), 1), Admission::Granted);
    assert_eq!(r.take(&claim(2, 0, 1), 1), Admission::Queued { place: 1 });
    // The holder left without handing on (a crash before its release wrote): the slot is free,
    // but run 2 waits before the newcomer, which must not take it.
    r.holders.clear();
    assert_eq!(r.take(&claim(3, 0, 2), 1), Admission::Queued { place: 2 });
    assert_eq!(r.promote(), vec![run(2)]);
    // With room for both, a newcomer behind a waiter goes at once.
    let mut r = record(2);
    r.waiting.push(claim(2, 0, 1));
    assert_eq!(r.take(&claim(3, 0, 2), 2), Admission::Granted);
    assert_eq!(r.promote(), vec![run(2)]);
}

#[test]
fn forgetting_gone_runs_frees_their_slots() {
    let mut r = record(2);
    for n in 1..=5 {
        r.take(&claim(n, 0, i64::from(n)), 2);
    }
    assert_eq!(r.holders, vec![run(1), run(2)]);
    let promoted = r.forget(|x| *x == run(1) || *x == run(3));
    assert_eq!(promoted, vec![run(4)]);
    assert_eq!(r.holders, vec![run(2), run(4)]);
    assert_eq!(r.place_of(&run(5)), Some(1));
    assert_eq!(r.forget(|_| false), Vec::<RunId>::new());
}

#[test]
fn a_lower_limit_holds_back_until_enough_slots_are_free() {
    let mut r = record(3);
    for n in 1..=3 {
        assert_eq!(r.take(&claim(n, 0, i64::from(n)), 3), Admission::Granted);
    }
    // The key's limit drops to 1: nobody is granted until two slots were given back.
    assert_eq!(r.take(&claim(4, 0, 4), 1), Admission::Queued { place: 1 });
    assert_eq!(r.release(&run(1)), Vec::<RunId>::new());
    assert_eq!(r.release(&run(2)), Vec::<RunId>::new());
    assert_eq!(r.release(&run(3)), vec![run(4)]);
}

#[test]
fn a_record_lists_a_bounded_number_of_runs() {
    let mut r = record(1);
    r.take(&claim(0, 0, 0), 1);
    for n in 1..MAX_LISTED as u32 {
        assert!(matches!(
            r.take(&claim(n, 0, i64::from(n)), 1),
            Admission::Queued { .. }
        ));
    }
    assert_eq!(r.take(&claim(u32::MAX, 0, 0), 1), Admission::Full);
    // A run already listed still gets its answer.
    assert_eq!(r.take(&claim(0, 0, 0), 1), Admission::Granted);
}

#[test]
fn key_digests_are_fixed_length_tokens() {
    let a = key_digest("customer-1");
    assert_eq!(a.len(), 32);
    assert!(a.chars().all(|c| c.is_ascii_hexdigit()));
    assert_ne!(a, key_digest("customer-2"));
    assert_eq!(a, key_digest("customer-1"));
    assert_eq!(key_digest("a.b *>").len(), 32);
}

#[test]
fn a_slot_record_round_trips_as_json() {
    let mut r = record(2);
    r.take(&claim(1, 0, 0), 2);
    r.take(&claim(2, 3, 1), 2);
    r.take(&claim(3, 3, 1), 2);
    let json = serde_json::to_vec(&r).expect("serializes");
    let back: SlotRecord = serde_json::from_slice(&json).expect("parses");
    assert_eq!(back, r);
}

#[test]
fn a_task_key_wins_over_the_agents_and_priorities_fall_back() {
    let task = |json: serde_json::Value| {
        crate::task::TaskSubmission::parse(json.to_string().as_bytes()).expect("valid task")
    };
    let agent_key = spec("{metadata.customer}", 3);
    let t = task(serde_json::json!({"agent": "support", "input": "hi",
        "metadata": {"customer": "c1", "ticket": 9}}));
    let r = for_task(&t, Some(&agent_key), Some(4), &[])
        .expect("ok")
        .expect("the agent's key");
    assert_eq!((r.key.as_str(), r.limit, r.priority), ("c1", 3, 4));
    let t = task(
        serde_json::json!({"agent": "support", "input": "hi", "priority": -2,
        "metadata": {"customer": "c1", "ticket": 9},
        "concurrency": {"key": "ticket-{metadata.ticket}", "limit": 1}}),
    );
    let r = for_task(&t, Some(&agent_key), Some(4), &[])
        .expect("ok")
        .expect("the task's key");
    assert_eq!((r.key.as_str(), r.limit, r.priority), ("ticket-9", 1, -2));
    assert_eq!(
        for_task(&t, None, None, &[]).expect("ok").map(|r| r.limit),
        Some(1)
    );
    let plain = task(serde_json::json!({"agent": "support", "input": "hi"}));
    assert_eq!(for_task(&plain, None, Some(7), &[]).expect("ok"), None);
    // The agent's key over metadata the task lacks refuses the task, naming the key.
    assert_eq!(
        for_task(&plain, Some(&agent_key), None, &[])
            .expect_err("missing")
            .field,
        "concurrency.key"
    );
    // A sensitive field never becomes a key stored in clear.
    let sensitive = vec!["metadata.customer".to_owned()];
    assert_eq!(
        for_task(&t, Some(&agent_key), None, &sensitive)
            .map(|r| r.map(|r| r.key))
            .expect("the task's key does not use it"),
        Some("ticket-9".into())
    );
    let t = task(serde_json::json!({"agent": "support", "input": "hi",
        "metadata": {"customer": "c1"}}));
    assert_eq!(
        for_task(&t, Some(&agent_key), None, &sensitive)
            .expect_err("sensitive")
            .field,
        "concurrency.key"
    );
}

#[test]
fn a_queued_run_journals_its_wait_once_and_starting_clears_it() {
    use crate::event::{Decision, Draft, Envelope, Event, Input, RunStarted};
    let created = crate::fixtures::run_created("support", "hi");
    let conc = RunConcurrency {
        key: "ticket-7".into(),
        limit: 1,
        priority: 2,
    };
    let run = run(1);
    let env = |e: Event| Envelope::new(run.clone(), at(0), Draft::new(e));
    let mut state = crate::fold::RunState::created(
        1,
        &env(Event::RunCreated(Box::new(created_with(
            created,
            conc.clone(),
        )))),
    )
    .expect("created");
    assert_eq!(claim_of(&state, &conc).priority, 2);
    let first = queued(&state, &conc, 3).expect("journaled once");
    let Decision::RunQueued(q) = &first.event else {
        panic!("not run.queued: {first:?}");
    };
    assert_eq!(
        (q.key.as_str(), q.limit, q.place, q.priority),
        ("ticket-7", 1, 3, 2)
    );
    state
        .apply(2, &env(Event::from(first.event.clone())))
        .expect("run.queued keeps queued");
    assert_eq!(state.status, crate::machine::RunStatus::Queued);
    assert!(queued(&state, &conc, 1).is_none(), "not journaled again");
    // The grant is a wake that counts while the run waits.
    state
        .apply(
            3,
            &env(Event::from(Input::SlotGranted(crate::event::SlotGranted {
                key: "ticket-7".into(),
            }))),
        )
        .expect("an input");
    assert_eq!(state.ignored_inputs, 0);
    assert!(starts_work(&[Draft::new(Decision::RunStarted(
        RunStarted {}
    ))]));
    state
        .apply(4, &env(Event::RunStarted(RunStarted {})))
        .expect("started");
    assert_eq!(state.queued, None);
}

fn created_with(
    created: crate::event::RunCreated,
    conc: RunConcurrency,
) -> crate::event::RunCreated {
    crate::event::RunCreated {
        concurrency: Some(conc),
        ..created
    }
}
