//! Reads of a run by the links of the broker's run-wide checks ([`Journal::read_linked`]): from
//! messages of the run a caller holds (a consumer's deliveries) back to a sequence it has folded,
//! fetching by sequence only the messages it does not hold (docs/ARCHITECTURE.md "The journal",
//! "Chained wakes").

use std::collections::{BTreeMap, BTreeSet};

use kedge_core::RunId;
use kedge_core::subjects::{self, RUNS_STREAM};

use super::Journal;
use super::append::parse_decision_msg_id;
use super::decode::{Delivered, decode};
use super::read::{ReadPage, checked_after};
use crate::error::JournalError;
use crate::wire::{self, StoredMessage};

/// Most messages [`Journal::read_linked`] fetches by sequence before it leaves the read to the
/// usual way (a run whose gap is that long is read in pages anyway).
const LINKED_FETCH_MAX: usize = 512;

/// Most steps of the walk [`Journal::read_linked`] takes to fetch what it lacks (each a round
/// trip): a tool's result and its `tool.started` lie between two decisions, the calls of a
/// step's group one after the other.
const LINKED_ROUNDS_MAX: usize = 16;

/// What a stored message of a run says of the run's message before it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Link {
    /// The run's previous message is at this sequence (0: none): the message was stored
    /// checked on the run's last message being there, or it is a decision after the first of
    /// an atomic group, which the broker stores contiguously.
    After(u64),
    /// The run's first decision (checked on the run having none): what came before it is no
    /// part of the run's fold.
    First,
    /// Nothing says (an input from outside: a message, an answer, a cancel).
    Unknown,
}

/// What a run's messages are checked on: `agent.run.<id>.d.>` (its decisions) and the prefix
/// `agent.run.<id>.d.` of a decision's subject.
struct Scope {
    decisions: String,
    prefix: String,
}

impl Scope {
    fn of(run: &RunId) -> Scope {
        let decisions = subjects::run_decisions(run);
        let prefix = decisions.trim_end_matches('>').to_owned();
        Scope { decisions, prefix }
    }
}

fn link(m: &StoredMessage, run: &RunId, scope: &Scope) -> Link {
    if let Some(prev) = checked_after(Some(&m.headers), run) {
        return Link::After(prev);
    }
    // The run's first decision, as the broker checked it when storing it: stored only if the
    // run had no decision then (a message id could say so of any decision; the check cannot).
    if m.header(wire::EXPECTED_LAST_SUBJECT_SEQ_SUBJECT) == Some(scope.decisions.as_str())
        && m.header(wire::EXPECTED_LAST_SUBJECT_SEQ) == Some("0")
    {
        return Link::First;
    }
    // A group's later decisions: stored right after the one before them (an atomic batch is
    // stored contiguously). A wrong claim costs nothing: the message at `seq - 1` is fetched
    // and must be the run's, and nothing lies between the two.
    let later_in_group = m
        .header(wire::MSG_ID)
        .and_then(parse_decision_msg_id)
        .is_some_and(|id| id.run == *run && id.index > 0 && m.subject.starts_with(&scope.prefix));
    if later_in_group {
        Link::After(m.seq.saturating_sub(1))
    } else {
        Link::Unknown
    }
}

/// Where a walk down the links from the newest held message ended.
#[derive(Debug, PartialEq, Eq)]
enum Walk {
    /// At `after` (or the run's first decision, when `after` is 0): these sequences, newest first.
    Complete(Vec<u64>),
    /// At a message not held yet.
    Missing,
    /// At a message whose link says nothing or points below `after`.
    Broken,
}

fn walk(
    held: &BTreeMap<u64, StoredMessage>,
    run: &RunId,
    scope: &Scope,
    after: u64,
    tip: u64,
) -> Walk {
    let mut chain = vec![tip];
    let mut at = tip;
    loop {
        let Some(m) = held.get(&at) else {
            return Walk::Missing;
        };
        match link(m, run, scope) {
            Link::After(prev) if prev == after => return Walk::Complete(chain),
            Link::After(prev) if prev < after || prev >= at => return Walk::Broken,
            Link::After(prev) => {
                chain.push(prev);
                at = prev;
            }
            Link::First if after == 0 => return Walk::Complete(chain),
            Link::First | Link::Unknown => return Walk::Broken,
        }
    }
}

impl Journal {
    /// The run's events in `(after, tip]`, `tip` the newest of `known` (messages of the run the
    /// caller holds, e.g. a consumer's deliveries), read by the links of the broker's run-wide
    /// checks: a decision, and a tool's `tool.started` and `tool.result`, are stored checked on
    /// the run's last message being at some sequence, and keep that sequence in their headers,
    /// so from the tip back to `after` every message is named by the one after it. What the
    /// caller does not hold is fetched by its sequence (one direct get each, those one step of
    /// the walk needs at once): no walk of the stream between the run's messages, whatever
    /// else was stored meanwhile.
    ///
    /// `None` when the links do not reach `after`: a message on the way was stored without a
    /// check (an input from outside), one is not the run's or is missing where it was asked
    /// (a replica that trails), a held message is not on the way (the broker's check passed
    /// over a message in flight on a clustered stream), or more than 512 would be fetched or in
    /// more than 16 steps (a run read from nothing, `after` 0, back to its `run.created` one
    /// link at a time: a short run's whole journal, a long one's left to a read): read the
    /// usual way. The same trust in the same check as
    /// [`Journal::read_chained`]. Messages set aside on the way are in the page's `set_aside`.
    pub async fn read_linked(
        &self,
        run: &RunId,
        after: u64,
        known: &[Delivered<'_>],
    ) -> Result<Option<ReadPage>, JournalError> {
        let mut held: BTreeMap<u64, StoredMessage> = known
            .iter()
            .filter(|d| d.seq > after)
            .map(|d| {
                (
                    d.seq,
                    StoredMessage {
                        seq: d.seq,
                        subject: d.subject.to_owned(),
                        headers: d.headers.cloned().unwrap_or_default(),
                        payload: d.payload.clone(),
                    },
                )
            })
            .collect();
        let Some(&tip) = held.keys().next_back() else {
            return Ok(Some(ReadPage::default()));
        };
        let scope = Scope::of(run);
        let tree = subjects::run_all(run);
        let tree = tree.trim_end_matches('>');
        let (mut fetched, mut rounds) = (0, 0);
        let chain = loop {
            match walk(&held, run, &scope, after, tip) {
                Walk::Complete(chain) => break chain,
                Walk::Broken => return Ok(None),
                Walk::Missing => {}
            }
            // Every link into what is not held yet, fetched at once.
            let missing: BTreeSet<u64> = held
                .values()
                .filter_map(|m| match link(m, run, &scope) {
                    Link::After(prev) if prev > after && !held.contains_key(&prev) => Some(prev),
                    _ => None,
                })
                .collect();
            fetched += missing.len();
            rounds += 1;
            if missing.is_empty() || fetched > LINKED_FETCH_MAX || rounds > LINKED_ROUNDS_MAX {
                return Ok(None);
            }
            let gets = missing
                .iter()
                .map(|&seq| wire::direct_seq(&self.client, RUNS_STREAM, seq, self.timeout));
            let got = futures::future::join_all(gets).await;
            for (&seq, got) in missing.iter().zip(got) {
                match got.map_err(|e| JournalError::from_wire("read a linked message", e))? {
                    Some(m) if m.seq == seq && m.subject.starts_with(tree) => {
                        held.insert(seq, m);
                    }
                    _ => return Ok(None),
                }
            }
        };
        if chain.len() != held.len() {
            // A message of the run held but passed over by the links.
            return Ok(None);
        }
        let mut page = ReadPage::default();
        for seq in chain.into_iter().rev() {
            if let Some(m) = held.remove(&seq) {
                page.push(run, decode(run, m));
            }
        }
        self.resolve_page(run, &mut page).await?;
        Ok(Some(page))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_nats::HeaderMap;

    fn run() -> RunId {
        "run_linked1".parse().expect("a run id")
    }

    fn checked(seq: u64, prev: u64) -> StoredMessage {
        let mut headers = HeaderMap::new();
        headers.insert(wire::EXPECTED_LAST_SUBJECT_SEQ, prev.to_string().as_str());
        headers.insert(
            wire::EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
            subjects::run_all(&run()).as_str(),
        );
        message(seq, "d.step.started", headers)
    }

    fn message(seq: u64, tail: &str, headers: HeaderMap) -> StoredMessage {
        StoredMessage {
            seq,
            subject: format!("agent.run.{}.{tail}", run()),
            headers,
            payload: Default::default(),
        }
    }

    fn decision(seq: u64, expected_last: u64, index: usize) -> StoredMessage {
        let mut headers = HeaderMap::new();
        let id = super::super::append::decision_msg_id(
            &run(),
            kedge_core::ids::DecisionSeq::at(expected_last),
            index,
            "w-a-1",
        );
        headers.insert(wire::MSG_ID, id.as_str());
        message(seq, "d.tool.requested", headers)
    }

    /// A run's first decision as `create_run` stores it: checked on the run having none.
    fn first(seq: u64) -> StoredMessage {
        let mut m = decision(seq, 0, 0);
        m.headers.insert(wire::EXPECTED_LAST_SUBJECT_SEQ, "0");
        m.headers.insert(
            wire::EXPECTED_LAST_SUBJECT_SEQ_SUBJECT,
            subjects::run_decisions(&run()).as_str(),
        );
        m
    }

    fn held(messages: Vec<StoredMessage>) -> BTreeMap<u64, StoredMessage> {
        messages.into_iter().map(|m| (m.seq, m)).collect()
    }

    #[test]
    fn a_message_names_the_one_before_it_by_its_check_or_its_place_in_a_group() {
        let (r, scope) = (run(), Scope::of(&run()));
        assert_eq!(link(&checked(9, 4), &r, &scope), Link::After(4));
        // A group's later decisions follow the first contiguously.
        assert_eq!(link(&decision(12, 3, 1), &r, &scope), Link::After(11));
        // A run's first decision, by the broker's check.
        assert_eq!(link(&first(2), &r, &scope), Link::First);
        // A message id alone does not make a decision the run's first.
        assert_eq!(link(&decision(2, 0, 0), &r, &scope), Link::Unknown);
        // An input from outside, or another run's decision id.
        assert_eq!(
            link(&message(5, "i.user.message", HeaderMap::new()), &r, &scope),
            Link::Unknown
        );
        let mut other = decision(12, 3, 1);
        other.subject = "agent.run.run_other.d.tool.requested".into();
        assert_eq!(link(&other, &r, &scope), Link::Unknown);
    }

    #[test]
    fn a_walk_reaches_after_names_what_is_missing_or_breaks() {
        let (r, scope) = (run(), Scope::of(&run()));
        let walk = |h: &BTreeMap<u64, StoredMessage>, r: &RunId, after, tip| {
            walk(h, r, &scope, after, tip)
        };
        // 10 <- 7 <- 4 (after): complete, newest first.
        let h = held(vec![checked(7, 4), checked(10, 7)]);
        assert_eq!(walk(&h, &r, 4, 10), Walk::Complete(vec![10, 7]));
        // 7 not held.
        let h = held(vec![checked(10, 7)]);
        assert_eq!(walk(&h, &r, 4, 10), Walk::Missing);
        // Below `after`, or a link that says nothing.
        let h = held(vec![checked(10, 2)]);
        assert_eq!(walk(&h, &r, 4, 10), Walk::Broken);
        let h = held(vec![message(10, "i.user.message", HeaderMap::new())]);
        assert_eq!(walk(&h, &r, 4, 10), Walk::Broken);
        // From nothing folded, the run's first decision ends the walk; past it, it breaks.
        let h = held(vec![first(3), checked(5, 3)]);
        assert_eq!(walk(&h, &r, 0, 5), Walk::Complete(vec![5, 3]));
        assert_eq!(walk(&h, &r, 1, 5), Walk::Broken);
        // A link that points forward is broken, not followed.
        let h = held(vec![checked(10, 12)]);
        assert_eq!(walk(&h, &r, 4, 10), Walk::Broken);
    }
}
