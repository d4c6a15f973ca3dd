//! The live view of `kedge_providers`: one KV watch per process, each entry folded into the
//! [`View`] as it comes.

use std::collections::{BTreeMap, HashMap};
use std::time::Duration;

use async_nats::jetstream::kv;
use futures::StreamExt;
use kedge_core::ids::RunId;
use kedge_core::subjects::PROVIDERS_BUCKET;

use super::{Breaker, Lead, Providers, Waiter, pace};

/// This process's view of the bucket: each record with its revision, by endpoint (paces by
/// [`super::Endpoint::pace_id`]).
#[derive(Debug, Default)]
pub(super) struct View {
    pub(super) breakers: HashMap<String, (Breaker, u64)>,
    pub(super) waiters: HashMap<String, BTreeMap<RunId, (Waiter, u64)>>,
    pub(super) leads: HashMap<String, (Lead, u64)>,
    pub(super) paces: HashMap<String, (pace::Pace, u64)>,
}

impl Providers {
    /// Keeps the view up to date; a watch that ends (the broker restarted) is made again, and
    /// the view rebuilt from what it delivers.
    pub(super) async fn watch(self, ready: tokio::sync::oneshot::Sender<()>) {
        let mut ready = Some(ready);
        let mut backoff = Duration::from_millis(100);
        loop {
            match self.inner.kv.watch_with_history(">").await {
                Ok(mut entries) => {
                    backoff = Duration::from_millis(100);
                    let mut fresh = View::default();
                    let mut current = false;
                    loop {
                        let next = if current {
                            entries.next().await
                        } else {
                            // Nothing in the bucket: a watch delivers nothing until a write.
                            match tokio::time::timeout(Duration::from_millis(500), entries.next())
                                .await
                            {
                                Ok(next) => next,
                                Err(_) => {
                                    current = true;
                                    *self.lock() = std::mem::take(&mut fresh);
                                    if let Some(r) = ready.take() {
                                        let _ = r.send(());
                                    }
                                    continue;
                                }
                            }
                        };
                        let Some(Ok(entry)) = next else { break };
                        let seen_current = entry.seen_current || entry.delta == 0;
                        if current {
                            apply_entry(&mut self.lock(), entry);
                        } else {
                            apply_entry(&mut fresh, entry);
                            if seen_current {
                                current = true;
                                *self.lock() = std::mem::take(&mut fresh);
                                if let Some(r) = ready.take() {
                                    let _ = r.send(());
                                }
                            }
                        }
                    }
                    tracing::debug!(bucket = PROVIDERS_BUCKET, "watch ended; watching again");
                }
                Err(e) => {
                    tracing::warn!(bucket = PROVIDERS_BUCKET, error = %e, "cannot watch; trying again");
                }
            }
            tokio::time::sleep(backoff).await;
            backoff = next_backoff(backoff);
        }
    }
}

/// The wait before the next try to watch after one that waited `backoff`: doubled, up to 5 s.
fn next_backoff(backoff: Duration) -> Duration {
    (backoff * 2).min(Duration::from_secs(5))
}

/// Folds one watched entry into the view (entries that do not parse are skipped: the bucket is
/// written by Kedge's own services, but nothing read from the network is trusted to parse).
fn apply_entry(view: &mut View, entry: kv::Entry) {
    let put = entry.operation == kv::Operation::Put;
    let mut parts = entry.key.splitn(3, '.');
    match (parts.next(), parts.next(), parts.next()) {
        (Some("breaker"), Some(id), None) => {
            match put
                .then(|| serde_json::from_slice::<Breaker>(&entry.value).ok())
                .flatten()
            {
                Some(b) => {
                    view.breakers.insert(id.to_owned(), (b, entry.revision));
                }
                None => {
                    view.breakers.remove(id);
                }
            }
        }
        (Some("pace"), Some(endpoint), Some(model)) => {
            let id = format!("{endpoint}.{model}");
            match put
                .then(|| serde_json::from_slice::<pace::Pace>(&entry.value).ok())
                .flatten()
            {
                Some(p) => {
                    view.paces.insert(id, (p, entry.revision));
                }
                None => {
                    view.paces.remove(&id);
                }
            }
        }
        (Some("lead"), Some(id), None) => {
            match put
                .then(|| serde_json::from_slice::<Lead>(&entry.value).ok())
                .flatten()
            {
                Some(l) => {
                    view.leads.insert(id.to_owned(), (l, entry.revision));
                }
                None => {
                    view.leads.remove(id);
                }
            }
        }
        (Some("wait"), Some(id), Some(run)) => {
            let Ok(run) = run.parse::<RunId>() else {
                return;
            };
            let waiters = view.waiters.entry(id.to_owned()).or_default();
            match put
                .then(|| serde_json::from_slice::<Waiter>(&entry.value).ok())
                .flatten()
            {
                Some(w) if w.run_id == run => {
                    waiters.insert(run, (w, entry.revision));
                }
                _ => {
                    waiters.remove(&run);
                }
            }
        }
        _ => {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::provider::fixtures::{at, endpoint, waiter};
    use crate::provider::{Pace, breaker_key, wait_key};

    #[test]
    fn the_view_holds_every_kind_of_record_the_bucket_has() {
        let entry = |key: &str, value: Vec<u8>, put: bool| kv::Entry {
            bucket: PROVIDERS_BUCKET.into(),
            key: key.into(),
            value: value.into(),
            revision: 7,
            delta: 0,
            created: time::OffsetDateTime::UNIX_EPOCH,
            operation: if put {
                kv::Operation::Put
            } else {
                kv::Operation::Delete
            },
            seen_current: true,
        };
        let e = endpoint();
        let pid = e.pace_id("gpt-x");
        assert_eq!(pid.split('.').count(), 2, "endpoint, then model");
        let mut pace = Pace::new(&e.label, "gpt-x", at(0));
        pace.learned.requests_per_minute = Some(60);
        let mut view = View::default();
        apply_entry(
            &mut view,
            entry(
                &format!("pace.{pid}"),
                serde_json::to_vec(&pace).expect("json"),
                true,
            ),
        );
        apply_entry(
            &mut view,
            entry(
                &breaker_key(&e.id),
                serde_json::to_vec(&Breaker::closed(&e, at(0))).expect("json"),
                true,
            ),
        );
        let w = waiter("run_a", "t", 0, 0);
        apply_entry(
            &mut view,
            entry(
                &wait_key(&e.id, &w.run_id),
                serde_json::to_vec(&w).expect("json"),
                true,
            ),
        );
        assert_eq!(view.paces.get(&pid).map(|(p, r)| (p, *r)), Some((&pace, 7)));
        assert!(view.breakers.contains_key(&e.id));
        assert_eq!(view.waiters.get(&e.id).map(BTreeMap::len), Some(1));
        // A record that does not parse, or a delete, leaves nothing behind.
        apply_entry(
            &mut view,
            entry(&format!("pace.{pid}"), b"{".to_vec(), true),
        );
        apply_entry(
            &mut view,
            entry(&wait_key(&e.id, &w.run_id), Vec::new(), false),
        );
        assert!(view.paces.is_empty());
        assert_eq!(view.waiters.get(&e.id).map(BTreeMap::len), Some(0));
    }

    #[test]
    fn a_watch_that_fails_is_tried_again_after_a_doubling_wait_up_to_five_seconds() {
        let mut backoff = Duration::from_millis(100);
        let mut waits = Vec::new();
        for _ in 0..8 {
            backoff = next_backoff(backoff);
            waits.push(backoff.as_millis());
        }
        assert_eq!(waits, [200, 400, 800, 1600, 3200, 5000, 5000, 5000]);
    }
}
