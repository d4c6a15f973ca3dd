//! Unit tests of the projection's fold and the projector's bookkeeping.

use super::projector::{Inbox, Projected};
use super::summary::Folded;
use super::*;
use kedge_app::view;
use kedge_core::RunStatus;
use kedge_core::ids::{RunId, TenantId};
use kedge_journal::Recorded;
use kedge_runtime::projection::Known;

fn run() -> RunId {
    RunId::generate()
}

/// The recorded journals every build replays (crates/core/tests/fixtures): a fold kept
/// after any prefix of one and then given the rest gives the summary of the whole journal,
/// as a fold of the whole journal does (what the projector relies on to read only what is
/// new).
#[test]
fn a_fold_kept_and_given_the_rest_summarizes_the_whole_journal() {
    let mut journals = 0;
    for (path, journal) in kedge_core::fixtures::recorded_journals() {
        let events: Vec<Recorded> = journal
            .into_iter()
            .map(|(seq, envelope)| Recorded {
                seq,
                envelope,
                msg_id: None,
            })
            .collect();
        let whole = summarize(&events).expect("folds").expect("has events");
        let validated = match whole.status {
            RunStatus::Succeeded => view::result_validation(&events),
            _ => None,
        };
        assert_eq!(
            whole.validation,
            validated,
            "{}: the last success's validation",
            path.display()
        );
        let whole = serde_json::to_value(&whole).expect("serializes");
        for k in 1..events.len() {
            let Ok(Some(mut kept)) = Folded::of(&events[..k]) else {
                continue; // no decision yet: nothing the projector would keep
            };
            kept.apply(&events[k..]).expect("the rest folds in");
            assert_eq!(
                serde_json::to_value(kept.summary()).expect("serializes"),
                whole,
                "{} kept after {k} of {} events",
                path.display(),
                events.len()
            );
        }
        journals += 1;
    }
    assert!(journals >= 10, "the fixtures were read ({journals})");
}

#[test]
fn a_run_has_one_handler_that_takes_every_delivery_once() {
    let inbox: Inbox<u64> = Inbox::default();
    let (a, b) = (run(), run());
    assert!(inbox.add(&a, 1), "the first delivery starts a handler");
    assert!(!inbox.add(&a, 2), "a second one joins it");
    assert!(inbox.add(&b, 3), "another run has its own");
    assert_eq!(inbox.take(&a), Some(vec![1, 2]), "one pass takes both");
    assert!(!inbox.add(&a, 4), "the handler is still on the run");
    assert_eq!(inbox.take(&a), Some(vec![4]));
    assert_eq!(inbox.take(&a), None, "nothing left: the handler ends");
    assert!(inbox.add(&a, 5), "so the next delivery starts a new one");
    assert_eq!(inbox.take(&b), Some(vec![3]));
    assert_eq!(inbox.take(&b), None);
    assert_eq!(inbox.take(&a), Some(vec![5]));
    assert!(!inbox.add(&a, 6), "a resting run still has its handler");
    assert!(
        !inbox.release_if_empty(&a),
        "which is not released with a delivery"
    );
    assert_eq!(inbox.take(&a), Some(vec![6]));
    assert!(inbox.release_if_empty(&a), "but is released without one");
    assert!(inbox.add(&a, 7), "so the next delivery starts a new one");
    assert_eq!(inbox.take(&a), Some(vec![7]));
    assert_eq!(inbox.take(&a), None);
    assert!(inbox.lock().is_empty());
}

#[test]
fn what_is_known_of_a_run_only_moves_forward() {
    let projected = Projected::default();
    let a = run();
    let tenant: TenantId = "acme".parse().expect("tenant");
    let known = |seq, revision| Known {
        seq,
        revision,
        tenant: tenant.clone(),
    };
    assert!(!projected.covers(&a, 1));
    projected.note(&a, known(10, 3));
    assert!(projected.covers(&a, 10) && !projected.covers(&a, 11));
    projected.note(&a, known(7, 2));
    assert_eq!(
        projected.get(&a),
        Some(known(10, 3)),
        "an older fold is ignored"
    );
    projected.note(&a, known(12, 5));
    assert_eq!(projected.get(&a), Some(known(12, 5)));
}
