//! The wiretap: every message through the server during one traced run (one core subscription
//! on `>`), classified by subject and headers, with each request's reply latency as the server
//! answered it.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use futures::StreamExt;
use kedge_core::ids::RunId;

use crate::measure::ms;

pub struct Tapped {
    t: Instant,
    subject: String,
    reply: Option<String>,
    batch_id: bool,
    batch_commit: bool,
    kv_op: Option<String>,
    expected_last: Option<String>,
    body: String,
}

pub async fn start_tap(
    url: &str,
) -> (
    async_nats::Client,
    Arc<Mutex<Vec<Tapped>>>,
    tokio::task::JoinHandle<()>,
) {
    let client = async_nats::ConnectOptions::new()
        .subscription_capacity(1 << 20)
        .connect(url)
        .await
        .expect("tap connects");
    let mut sub = client.subscribe(">").await.expect("tap subscribes");
    client.flush().await.expect("flush");
    let store: Arc<Mutex<Vec<Tapped>>> = Arc::default();
    let s = store.clone();
    let task = tokio::spawn(async move {
        while let Some(m) = sub.next().await {
            let t = Instant::now();
            let h = m.headers.as_ref();
            let get = |k: &str| h.and_then(|h| h.get(k)).map(|v| v.as_str().to_owned());
            let rec = Tapped {
                t,
                subject: m.subject.to_string(),
                reply: m.reply.as_ref().map(|r| r.to_string()),
                batch_id: get("Nats-Batch-Id").is_some(),
                batch_commit: get("Nats-Batch-Commit").is_some(),
                kv_op: get("KV-Operation"),
                expected_last: get("Nats-Expected-Last-Subject-Sequence"),
                body: String::from_utf8_lossy(&m.payload[..m.payload.len().min(160)]).into_owned(),
            };
            s.lock().unwrap().push(rec);
        }
    });
    (client, store, task)
}

/// What a tapped message is, by subject and headers.
fn classify(m: &Tapped) -> String {
    let s = m.subject.as_str();
    if let Some(r) = &m.reply
        && let Some(rest) = r.strip_prefix("$JS.ACK.")
    {
        let mut parts = rest.split('.');
        let stream = parts.next().unwrap_or("?");
        let consumer = parts.next().unwrap_or("?");
        return format!("deliver {stream}/{consumer}");
    }
    if let Some(rest) = s.strip_prefix("$JS.ACK.") {
        let mut parts = rest.split('.');
        let stream = parts.next().unwrap_or("?");
        let consumer = parts.next().unwrap_or("?");
        return format!("ack {stream}/{consumer}");
    }
    if let Some(rest) = s.strip_prefix("$JS.API.CONSUMER.MSG.NEXT.") {
        let mut p = rest.split('.');
        let stream = p.next().unwrap_or("?");
        let consumer = p.next().unwrap_or("?");
        let consumer = if consumer.len() > 12 {
            "ordered"
        } else {
            consumer
        };
        return format!("pull request {stream}/{consumer}");
    }
    if let Some(rest) = s.strip_prefix("$JS.API.DIRECT.GET.") {
        let stream = rest.split('.').next().unwrap_or("?");
        let what = if m.body.contains("\"batch\"") {
            "batch"
        } else if m.body.contains("last_by_subj") || rest.contains('.') {
            "last"
        } else {
            "seq"
        };
        return format!("direct get {stream} ({what})");
    }
    if let Some(rest) = s.strip_prefix("$JS.API.STREAM.MSG.GET.") {
        return format!("leader get {rest}");
    }
    if s.starts_with("$JS.API.") {
        let t: Vec<&str> = s.split('.').take(4).collect();
        return format!("api {}", t.join("."));
    }
    if let Some(rest) = s.strip_prefix("$KV.kedge_leases.") {
        let _ = rest;
        return if m.kv_op.as_deref() == Some("DEL") {
            "lease release (KV CAS write)".into()
        } else if m.expected_last.is_some() {
            "lease acquire/renew (KV CAS write)".into()
        } else {
            "lease write".into()
        };
    }
    if let Some(rest) = s.strip_prefix("$KV.kedge_idempotency.") {
        return if rest.starts_with("model.") {
            "KV put model response".into()
        } else if m.expected_last.as_deref() == Some("0") {
            "KV create op record (claim)".into()
        } else if m.expected_last.is_some() {
            "KV update op record (finish)".into()
        } else {
            "KV put op record".into()
        };
    }
    if let Some(p) = kedge_core::subjects::parse_event(s) {
        let kind = match p.kind {
            kedge_core::EventKind::Decision => {
                if m.batch_commit {
                    "decision batch commit"
                } else if m.batch_id {
                    "decision batch part"
                } else {
                    "decision publish"
                }
            }
            kedge_core::EventKind::Input => "input publish",
        };
        return format!("{kind} {}", p.event_type);
    }
    if s.starts_with("agent.delta.") {
        return "delta (core)".into();
    }
    if s.starts_with("agent.task.") {
        return "task publish".into();
    }
    if s.starts_with("_INBOX.") {
        return "reply".into();
    }
    let t: Vec<&str> = s.split('.').take(2).collect();
    format!("other {}", t.join("."))
}

pub struct TapReport {
    /// category → (count, reply latencies in ms)
    pub ops: BTreeMap<String, (usize, Vec<f64>)>,
    pub timeline: Vec<String>,
}

pub fn analyze_tap(recs: &[Tapped], run: &RunId) -> TapReport {
    // Replies by inbox subject: first and last arrival.
    let mut replies: HashMap<&str, (Instant, Instant)> = HashMap::new();
    for m in recs {
        if m.subject.starts_with("_INBOX.") && m.reply.is_none() {
            let e = replies.entry(m.subject.as_str()).or_insert((m.t, m.t));
            e.1 = m.t;
        }
    }
    let run_prefix = format!("agent.run.{run}.");
    let mut ops: BTreeMap<String, (usize, Vec<f64>)> = BTreeMap::new();
    let mut lines: Vec<(Instant, String)> = Vec::new();
    for m in recs {
        let cat = classify(m);
        if cat == "reply" {
            continue;
        }
        // Only count what concerns the traced run or is run-agnostic (API, KV, consumers).
        if m.subject.starts_with("agent.run.") && !m.subject.starts_with(&run_prefix) {
            continue;
        }
        let lat = m
            .reply
            .as_deref()
            .filter(|r| r.starts_with("_INBOX."))
            .and_then(|r| replies.get(r))
            .map(|(first, last)| (ms(*first - m.t), ms(*last - m.t)));
        let e = ops.entry(cat.clone()).or_insert((0, Vec::new()));
        e.0 += 1;
        if let Some((_, last)) = lat {
            e.1.push(last);
        }
        let lat_s = match lat {
            Some((_, last)) => format!("  → reply after {last:6.3} ms"),
            None => String::new(),
        };
        lines.push((m.t, format!("{cat}{lat_s}")));
    }
    // Timeline of one steady-state loop: from the publish of tool.result of step 9 to that of
    // step 10 (the n-th tool.result input publish of the run).
    let tr_publishes: Vec<Instant> = recs
        .iter()
        .filter(|m| {
            m.subject.starts_with(&run_prefix)
                && m.subject.ends_with(".i.tool.result")
                && m.reply.as_deref().is_some_and(|r| r.starts_with("_INBOX."))
        })
        .map(|m| m.t)
        .collect();
    let mut timeline = Vec::new();
    if tr_publishes.len() >= 10 {
        let (from, to) = (tr_publishes[8], tr_publishes[9]);
        for (t, line) in lines.iter().filter(|(t, _)| *t >= from && *t <= to) {
            if line.starts_with("pull request") || line.contains("KEDGE_RUNS/ordered") {
                continue;
            }
            timeline.push(format!("+{:7.3} ms  {line}", ms(*t - from)));
        }
    }
    TapReport { ops, timeline }
}

/// Whether a tapped category is per-action work (not intake's queue, the bench's terminal
/// watcher or JetStream API calls): the same filter `print_tap` applies.
pub fn per_action_op(cat: &str) -> bool {
    !(cat.contains("KEDGE_TASKS") || cat.contains("/ordered") || cat.starts_with("api "))
}
