//! Statistics over measured values, and CPU accounting: utime + stime of nats-server and of this
//! process per phase, from /proc, with the mock model's thread counted apart.

use std::sync::Mutex;
use std::time::Duration;

use kedge_mock_llm::{MockHandle, Scripts};
use time::OffsetDateTime;

#[derive(Debug, Clone, Copy, Default)]
pub struct Stats {
    pub n: usize,
    pub p50: f64,
    pub p99: f64,
    pub mean: f64,
    pub max: f64,
}

pub fn stats(values: &[f64]) -> Stats {
    if values.is_empty() {
        return Stats::default();
    }
    let mut v = values.to_vec();
    v.sort_by(|a, b| a.total_cmp(b));
    let pick = |p: f64| {
        let idx = ((p * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1;
        v[idx]
    };
    Stats {
        n: v.len(),
        p50: pick(0.50),
        p99: pick(0.99),
        mean: v.iter().sum::<f64>() / v.len() as f64,
        max: v[v.len() - 1],
    }
}

pub fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

pub fn dt_ms(later: OffsetDateTime, earlier: OffsetDateTime) -> f64 {
    (later - earlier).as_seconds_f64() * 1e3
}

// ---------------------------------------------------------------------------------------------
// CPU accounting (/proc/<pid>/stat, utime + stime, in clock ticks)

/// Milliseconds per clock tick.
fn tick_ms() -> f64 {
    1e3 / kedge_testkit::clock_ticks()
}

fn cpu_ticks(pid: u32) -> Option<u64> {
    kedge_testkit::cpu_ticks(&format!("/proc/{pid}/stat"))
}

/// The threads serving the mock model ([`start_mock`]): their CPU is the model's, counted
/// apart from the runtime's (the Restate peer's `llm` step is a canned answer in its own process).
static MOCK_THREADS: Mutex<Vec<u32>> = Mutex::new(Vec::new());

fn thread_ticks(tid: u32) -> Option<u64> {
    kedge_testkit::cpu_ticks(&format!("/proc/self/task/{tid}/stat"))
}

fn mock_ticks() -> u64 {
    MOCK_THREADS
        .lock()
        .unwrap()
        .iter()
        .filter_map(|&tid| thread_ticks(tid))
        .sum()
}

/// Serves the mock model on a thread of its own (a single-threaded runtime that lives as long
/// as the process), so that [`cpu_since`] leaves its CPU out of the runtime's.
pub fn start_mock(scripts: Scripts) -> MockHandle {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name("mock-model".into())
        .spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("mock runtime");
            rt.block_on(async move {
                let handle = MockHandle::start(scripts).await;
                let tid = std::fs::read_link("/proc/thread-self")
                    .ok()
                    .and_then(|p| p.file_name()?.to_str()?.parse::<u32>().ok());
                let _ = tx.send((handle, tid));
                std::future::pending::<()>().await
            })
        })
        .expect("mock thread");
    let (handle, tid) = rx.recv().expect("mock model started");
    if let Some(tid) = tid {
        MOCK_THREADS.lock().unwrap().push(tid);
    }
    handle
}

#[derive(Clone, Copy)]
pub struct CpuMark {
    server: u64,
    me: u64,
    mock: u64,
}

pub fn cpu_mark(server_pids: &[u32]) -> CpuMark {
    CpuMark {
        server: server_pids.iter().filter_map(|p| cpu_ticks(*p)).sum(),
        me: cpu_ticks(std::process::id()).unwrap_or(0),
        mock: mock_ticks(),
    }
}

/// CPU milliseconds (server, this process without the mock model's thread) since `from`.
pub fn cpu_since(from: CpuMark, server_pids: &[u32]) -> (f64, f64) {
    let now = cpu_mark(server_pids);
    let me = now.me.saturating_sub(from.me);
    let mock = now.mock.saturating_sub(from.mock);
    (
        (now.server.saturating_sub(from.server)) as f64 * tick_ms(),
        me.saturating_sub(mock) as f64 * tick_ms(),
    )
}

/// CPU milliseconds of the mock model's thread since `from`.
pub fn mock_cpu_since(from: CpuMark) -> f64 {
    mock_ticks().saturating_sub(from.mock) as f64 * tick_ms()
}

/// The machine's load (other processes share these cores: read the numbers with it).
pub fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}
