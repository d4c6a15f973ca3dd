//! Statistics over measured values, and CPU accounting: utime + stime per phase, from /proc, of
//! nats-server and of this process, the mock model's thread counted apart (in process), or of
//! each process of the deployment (deployed: nats-server, every `kedge serve`, `kedge mock-llm`
//! and this process, the client).

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
        server: crate::support::cpu_ticks_of(server_pids),
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

/// CPU ms of a phase (or per action: [`Cpu::per`]) by process.
#[derive(Debug, Clone, Default)]
pub struct Cpu {
    /// nats-server (the three nodes with `--cluster`).
    pub server: f64,
    /// Kedge: in process, this process without the mock model's thread (services + client);
    /// deployed, the `kedge serve` processes.
    pub kedge: f64,
    /// The mock model: its thread in process, the `kedge mock-llm` process deployed.
    pub mock: f64,
    /// Deployed only: this process, the client (submits, the terminal watcher).
    pub client: Option<f64>,
    /// Deployed only: each `kedge serve` process by the services it runs (`all`, or one
    /// service each with `--split`); they add up to `kedge`.
    pub by_process: Vec<(String, f64)>,
}

impl Cpu {
    /// Every figure divided by `n` (actions).
    pub fn per(&self, n: f64) -> Cpu {
        Cpu {
            server: self.server / n,
            kedge: self.kedge / n,
            mock: self.mock / n,
            client: self.client.map(|c| c / n),
            by_process: self
                .by_process
                .iter()
                .map(|(name, v)| (name.clone(), v / n))
                .collect(),
        }
    }

    /// Every process together.
    pub fn total(&self) -> f64 {
        self.server + self.kedge + self.mock + self.client.unwrap_or(0.0)
    }

    /// One line: each process's figure (ms per action when so divided).
    pub fn describe(&self) -> String {
        match self.client {
            None => format!(
                "nats-server {:.3}, kedge process (services + client) {:.3}, mock model (its own thread) {:.3}",
                self.server, self.kedge, self.mock
            ),
            Some(client) => {
                let split = if self.by_process.len() > 1 {
                    let parts: Vec<String> = self
                        .by_process
                        .iter()
                        .map(|(name, v)| format!("{name} {v:.3}"))
                        .collect();
                    format!(" ({})", parts.join(", "))
                } else {
                    String::new()
                };
                format!(
                    "nats-server {:.3}, kedge serve {:.3}{split}, kedge mock-llm {:.3}, client (this process) {:.3}",
                    self.server, self.kedge, self.mock, client
                )
            }
        }
    }

    /// The short form of a table cell: server / kedge (/ client, deployed).
    pub fn cell(&self) -> String {
        match self.client {
            None => format!("{:.3} / {:.3}", self.server, self.kedge),
            Some(c) => format!("{:.3} / {:.3} / {:.3}", self.server, self.kedge, c),
        }
    }

    /// The JSON object of the `--json` file: `nats_server`, `kedge`, `mock_model` and, deployed,
    /// `client` (their sum is every process's CPU).
    pub fn json(&self) -> serde_json::Value {
        let mut v = serde_json::json!({
            "nats_server": self.server,
            "kedge": self.kedge,
            "mock_model": self.mock,
        });
        if let Some(c) = self.client {
            v["client"] = serde_json::json!(c);
        }
        v
    }

    /// Deployed: the `kedge serve` processes by the services they run (JSON); else null.
    pub fn json_by_process(&self) -> serde_json::Value {
        if self.by_process.is_empty() {
            return serde_json::Value::Null;
        }
        self.by_process
            .iter()
            .map(|(name, v)| (name.clone(), serde_json::json!(v)))
            .collect::<serde_json::Map<_, _>>()
            .into()
    }
}

/// The CPU ticks of a set of processes at one moment ([`ProcsMark::since`]).
#[derive(Clone)]
pub struct ProcsMark {
    base: CpuMark,
    procs: Vec<u64>,
}

impl ProcsMark {
    /// Now: the server's, this process's, the mock thread's and each of `procs`'s ticks.
    pub fn now(server_pids: &[u32], procs: &[u32]) -> ProcsMark {
        ProcsMark {
            base: cpu_mark(server_pids),
            procs: procs.iter().map(|p| cpu_ticks(*p).unwrap_or(0)).collect(),
        }
    }

    /// CPU ms of each of `procs` (as given to [`ProcsMark::now`]) since this mark.
    pub fn procs_since(&self, procs: &[u32]) -> Vec<f64> {
        procs
            .iter()
            .zip(&self.procs)
            .map(|(p, before)| {
                cpu_ticks(*p).unwrap_or(0).saturating_sub(*before) as f64 * tick_ms()
            })
            .collect()
    }

    /// (server, this process without the mock thread, the mock thread) CPU ms since this mark.
    pub fn base_since(&self, server_pids: &[u32]) -> (f64, f64, f64) {
        let (server, me) = cpu_since(self.base, server_pids);
        (server, me, mock_cpu_since(self.base))
    }
}

/// CPU milliseconds of the mock model's thread since `from`.
pub fn mock_cpu_since(from: CpuMark) -> f64 {
    mock_ticks().saturating_sub(from.mock) as f64 * tick_ms()
}

pub use crate::support::loadavg;
