//! SSE end to end: a client that drops its connection every k events and resumes with
//! Last-Event-ID gets every public event exactly once, in order, while the step worker is killed
//! and the bridge itself is killed and restarted; 200 clients on one run get the same sequence
//! and a client that stops reading delays none of them (and, when it reads again, catches up
//! with nothing missing).

use crate::bridge_support;
use crate::common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use bridge_support::{ACME, Api, Sse, SseStream, TestBridge, bridge_config};
use common::{Harness, Svc};
use kedge_core::EventType;
use kedge_core::event::{Event, UserMessage};
use reqwest::StatusCode;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn call(name: &str, args: Value) -> Value {
    json!({"name": name, "arguments": args})
}

/// Six steps with a tool call each, streamed in chunks (token deltas), then a final answer.
fn long_script(model: &str) -> Value {
    let step = |i: usize| {
        json!({"text": format!("step {i} is thinking about the tide tables"), "delay_ms": 250, "chunk_delay_ms": 20,
               "tool_calls": [call("write_file", json!({"path": format!("f{i}.txt"), "content": "x"}))]})
    };
    let mut steps: Vec<Value> = (1..=6).map(step).collect();
    steps.push(json!({"text": "all done, tides logged", "chunk_delay_ms": 20}));
    json!({"models": {model: {"steps": steps}}})
}

/// What the reconnecting client saw.
#[derive(Debug, Default)]
struct Seen {
    ids: Vec<u64>,
    types: Vec<String>,
    deltas: usize,
    connections: usize,
    failed_connects: usize,
    ended_with_204: bool,
}

/// Reads the run's events, dropping the connection after every `k` events and reconnecting with
/// the last id, until a reconnect answers 204 (the run is finished, nothing left).
async fn reconnecting_client(url: String, k: usize, progress: Arc<AtomicUsize>) -> Seen {
    let http = reqwest::Client::new();
    let mut seen = Seen::default();
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut last: Option<u64> = None;
    while Instant::now() < deadline {
        let mut stream = match SseStream::open(&http, &url, Some(ACME), last).await {
            Ok(s) => s,
            Err(_) => {
                seen.failed_connects += 1;
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        match stream.status {
            StatusCode::NO_CONTENT => {
                seen.ended_with_204 = true;
                return seen;
            }
            StatusCode::OK => {}
            other => panic!("unexpected status {other}"),
        }
        seen.connections += 1;
        let mut here = 0;
        while let Some(item) = stream.next().await {
            match item {
                Sse::Event {
                    id: Some(id),
                    event,
                    data,
                } => {
                    assert_eq!(data["seq"], id, "id is the journal sequence");
                    assert_eq!(data["type"], event.as_str());
                    seen.ids.push(id);
                    seen.types.push(event);
                    last = Some(id);
                    progress.fetch_add(1, Ordering::Relaxed);
                    here += 1;
                    if here == k {
                        break;
                    }
                }
                Sse::Event {
                    id: None, event, ..
                } => {
                    assert_eq!(event, "delta", "only deltas come without an id");
                    seen.deltas += 1;
                }
                Sse::Comment | Sse::Retry(_) => {}
            }
        }
    }
    panic!("the client did not finish: {seen:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_reconnecting_every_k_events_gets_each_event_once_across_a_worker_kill_and_a_bridge_restart()
 {
    let mut h = Harness::start(long_script("tides"), &[Svc::Intake, Svc::Tool]).await;
    h.agent("tides", "tides").await;
    let port = kedge_testkit::free_port();
    let listen = format!("127.0.0.1:{port}");
    let bridge_env = vec![
        ("KEDGE_BRIDGE_LISTEN", listen.clone()),
        (
            "KEDGE_BRIDGE_TOKENS",
            format!("{ACME}=acme,{}=globex", bridge_support::GLOBEX),
        ),
    ];
    let bridge = h.spawn_process_with_env("bridge", "w-bridge-1", "", &bridge_env);
    let crashing_step = h.spawn_process("step", "w-step-1", "step.after_answer_committed");
    let base = format!("http://{listen}");
    let api = Api::new(&base, Some(ACME));
    // Wait for the bridge process to serve.
    let t0 = Instant::now();
    while api.http.get(format!("{base}/readyz")).send().await.is_err() {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "bridge never came up"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let (s, sub) = api.submit("tides", "log the tides", "tides-1").await;
    assert_eq!(s, StatusCode::ACCEPTED, "{sub}");
    let run = sub["run_id"].as_str().expect("run").to_owned();

    let progress = Arc::new(AtomicUsize::new(0));
    let client = tokio::spawn(reconnecting_client(
        format!("{base}/v1/runs/{run}/events"),
        3,
        progress.clone(),
    ));

    // The step worker dies right after step 1's answer is journaled, before its tool is
    // requested; a new one takes over.
    assert!(
        h.wait_exit(crashing_step, Duration::from_secs(20)).await,
        "the step worker did not reach its failpoint"
    );
    h.spawn_process("step", "w-step-2", "");
    // Mid-run (a few steps on), the bridge is killed and started again on the same port.
    let run_id: kedge_core::ids::RunId = run.parse().expect("run id");
    h.wait_for(&run_id, Duration::from_secs(30), |s| s.step.get() >= 3)
        .await;
    h.kill9(bridge);
    let killed_at = progress.load(Ordering::Relaxed);
    tokio::time::sleep(Duration::from_millis(300)).await;
    h.spawn_process_with_env("bridge", "w-bridge-2", "", &bridge_env);

    let seen = tokio::time::timeout(Duration::from_secs(60), client)
        .await
        .expect("client finished in time")
        .expect("client task");
    let state = h.wait_terminal(&run_id, Duration::from_secs(5)).await;
    assert_eq!(state.status, kedge_core::RunStatus::Succeeded);

    // Exactly once, in order, and exactly the public events of the journal.
    let journal: Vec<u64> = h
        .events(&run_id)
        .await
        .iter()
        .filter(|r| r.envelope.event_type() != EventType::Nudge)
        .map(|r| r.seq)
        .collect();
    assert!(
        seen.ids.windows(2).all(|w| w[0] < w[1]),
        "ids out of order or repeated: {:?}",
        seen.ids
    );
    assert_eq!(seen.ids, journal, "SSE ids vs the journal");
    assert_eq!(api.history_ids(&run).await, seen.ids, "SSE ids vs /history");
    assert_eq!(seen.types.last().map(String::as_str), Some("run.succeeded"));
    assert!(
        seen.ended_with_204,
        "a finished run answers 204 to a reconnect"
    );
    // The faults really happened in the middle of the run.
    let events = h.events(&run_id).await;
    // The killed worker had journaled step 1's answer; the new one requested its tool from it.
    let calls = h.mock.calls();
    assert_eq!(calls.total, 7, "one model call per step: {calls:?}");
    assert!(calls.by_request_id.values().all(|n| *n == 1), "{calls:?}");
    assert_eq!(
        events
            .iter()
            .filter(|r| matches!(&r.envelope.event, Event::StepCompleted(_)))
            .count(),
        7
    );
    assert!(
        killed_at > 0 && killed_at < seen.ids.len(),
        "the bridge was killed mid-stream ({killed_at} of {})",
        seen.ids.len()
    );
    assert!(seen.failed_connects > 0, "a reconnect hit the dead bridge");
    assert!(
        seen.connections >= seen.ids.len() / 3,
        "{} connections for {} events",
        seen.connections,
        seen.ids.len()
    );
    assert!(seen.deltas > 0, "token deltas were forwarded");
    h.shutdown().await;
}

/// A raw HTTP/1.1 SSE request on a socket with a small receive buffer, that the test does not
/// read from until it chooses to.
async fn stalled_client(addr: std::net::SocketAddr, run: &str) -> tokio::net::TcpStream {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket.set_recv_buffer_size(4096).expect("rcvbuf");
    let mut stream = socket.connect(addr).await.expect("connect");
    let req = format!(
        "GET /v1/runs/{run}/events HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {ACME}\r\nAccept: text/event-stream\r\n\r\n"
    );
    stream.write_all(req.as_bytes()).await.expect("request");
    stream
}

/// Decodes an HTTP/1.1 chunked body (after the headers) as far as it is complete.
fn dechunk(raw: &[u8]) -> Vec<u8> {
    let Some(start) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
        return Vec::new();
    };
    let mut rest = &raw[start + 4..];
    let mut out = Vec::new();
    while let Some(eol) = rest.windows(2).position(|w| w == b"\r\n") {
        let size = usize::from_str_radix(std::str::from_utf8(&rest[..eol]).unwrap_or("x"), 16);
        let Ok(size) = size else { break };
        if size == 0 || rest.len() < eol + 2 + size + 2 {
            break;
        }
        out.extend_from_slice(&rest[eol + 2..eol + 2 + size]);
        rest = &rest[eol + 2 + size + 2..];
    }
    out
}

/// The ids of the journal events in an SSE text, in order.
fn sse_ids(text: &str) -> Vec<u64> {
    text.split("\n\n")
        .filter_map(|block| {
            block
                .lines()
                .find_map(|l| l.strip_prefix("id: "))
                .and_then(|id| id.parse().ok())
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_clients_get_the_same_sequence_and_a_stalled_one_delays_none() {
    // No step service: the run stays queued and the test appends its inputs itself.
    let h = Harness::start(json!({"models": {}}), &[Svc::Intake]).await;
    h.agent("fan", "fan").await;
    let mut config = bridge_config(&h.config, "127.0.0.1:0");
    config.bridge.sse_ring = 64;
    let bridge = TestBridge::start(config, "127.0.0.1:0").await;
    let run = h.submit("fan", "hello", "fan-1").await;
    let url = format!("{}/v1/runs/{run}/events", bridge.url());

    const CLIENTS: usize = 200;
    const MESSAGES: usize = 1000;
    let pad = "w".repeat(400);
    // One client that never reads.
    let mut stalled = stalled_client(bridge.addr, run.as_str()).await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .expect("client");
    let connected = Arc::new(AtomicUsize::new(0));
    let mut clients = Vec::new();
    for _ in 0..CLIENTS {
        let (http, url, connected) = (http.clone(), url.clone(), connected.clone());
        clients.push(tokio::spawn(async move {
            let mut s = SseStream::open(&http, &url, Some(ACME), None)
                .await
                .expect("open");
            assert_eq!(s.status, StatusCode::OK);
            connected.fetch_add(1, Ordering::Relaxed);
            let mut ids = Vec::new();
            while let Some(item) = s.next().await {
                if let Sse::Event {
                    id: Some(id), data, ..
                } = item
                {
                    ids.push(id);
                    if data["data"]["text"] == "END" {
                        return (ids, Instant::now());
                    }
                }
            }
            panic!("stream ended early after {} events", ids.len());
        }));
    }
    let t0 = Instant::now();
    while connected.load(Ordering::Relaxed) < CLIENTS {
        assert!(
            t0.elapsed() < Duration::from_secs(30),
            "clients did not connect"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let start = Instant::now();
    for i in 0..MESSAGES {
        let text = if i + 1 == MESSAGES {
            "END".to_owned()
        } else {
            format!("{i} {pad}")
        };
        h.input(
            &run,
            Event::UserMessage(UserMessage { text }),
            &format!("fan-{i}"),
        )
        .await;
    }
    let appended = start.elapsed();
    let mut sequences = Vec::new();
    let mut last_done = start;
    for c in clients {
        let (ids, done) = tokio::time::timeout(Duration::from_secs(60), c)
            .await
            .expect("a client was held up")
            .expect("client task");
        last_done = last_done.max(done);
        sequences.push(ids);
    }
    let all_done = last_done - start;
    let journal: Vec<u64> = h.events(&run).await.iter().map(|r| r.seq).collect();
    assert_eq!(journal.len(), MESSAGES + 1);
    for (i, ids) in sequences.iter().enumerate() {
        assert_eq!(ids, &journal, "client {i}");
    }
    eprintln!(
        "{CLIENTS} clients × {} events: appended in {appended:?}, all delivered {all_done:?} after the first append",
        journal.len()
    );

    // The stalled client held nobody up: everyone finished while it read nothing. Now a burst of
    // large events, more than the kernel's socket buffers and the ring hold, goes by it…
    let big = "B".repeat(16 * 1024);
    for i in 0..500 {
        let text = if i == 499 {
            "END2".to_owned()
        } else {
            format!("{i} {big}")
        };
        h.input(
            &run,
            Event::UserMessage(UserMessage { text }),
            &format!("big-{i}"),
        )
        .await;
    }
    let journal: Vec<u64> = h.events(&run).await.iter().map(|r| r.seq).collect();
    // …and when it reads again, it lags the ring, catches up from the journal, and has every
    // event exactly once, in order.
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 256 * 1024];
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut seen_end = false;
    loop {
        let n = tokio::time::timeout(Duration::from_secs(10), stalled.read(&mut buf))
            .await
            .expect("stalled client reads")
            .expect("read");
        assert!(n > 0, "connection closed");
        raw.extend_from_slice(&buf[..n]);
        // The last event's text can arrive before the end of its chunk: only a whole chunk
        // counts, or the last events would be missing from what is compared.
        let tail = &raw[raw.len().saturating_sub(n + 64)..];
        seen_end |= tail.windows(13).any(|w| w == br#""text":"END2""#);
        if seen_end && sse_ids(&String::from_utf8_lossy(&dechunk(&raw))).last() == journal.last() {
            break;
        }
        assert!(Instant::now() < deadline, "stalled client never caught up");
    }
    let text = String::from_utf8_lossy(&dechunk(&raw)).into_owned();
    assert_eq!(sse_ids(&text), journal, "the stalled client's sequence");
    assert!(
        bridge.bridge.hub.lagged() >= 1,
        "the stalled client fell behind the ring (lagged {} times)",
        bridge.bridge.hub.lagged()
    );
    bridge.stop().await;
    h.shutdown().await;
}
