//! Real `nats-server` processes for Kedge's tests and benches.
//!
//! Every test that talks to NATS gets a broker of its own: [`NatsServer::start`] spawns a
//! single JetStream node on a free loopback port with a fresh temporary store, and
//! [`NatsCluster::start`] spawns a three-node JetStream cluster. Both can [`kill -9`] a node and
//! restart it on the same port and store, which is how crash-recovery tests are written:
//!
//! ```no_run
//! # async fn demo() {
//! use kedge_testkit::NatsServer;
//!
//! let mut server = NatsServer::start().await;
//! let client = server.client().await;
//! // ... publish, then crash the broker and bring it back on the same port and store:
//! server.kill9();
//! server.restart().await;
//! # drop(client);
//! # }
//! ```
//!
//! Readiness is found by polling (connect, then a JetStream account-info request) every 50 ms,
//! never by sleeping a fixed time. A server that fails to come up makes the test panic with the
//! tail of its log.
//!
//! The binary comes from [`nats_server_binary`]: `$KEDGE_NATS_SERVER`, else the repo's
//! `.tools/bin/nats-server` (installed by `scripts/setup.sh`), else `nats-server` on `PATH`.
//!
//! Cleanup: dropping a [`NatsServer`] or [`NatsCluster`] kills its processes and deletes its
//! temporary directory, except while the thread is panicking (a failed test): then the directory,
//! with the config, the store and the server log, is kept and its path printed. If the test process
//! itself dies without running `Drop` (SIGKILL, abort), a small watchdog process per server kills
//! the server when the test process's end of a pipe closes.
//!
//! Network faults between one process and its server (a reset, a few seconds of loss, a silent
//! partition) come from [`proxy::TcpProxy`], a TCP proxy the process connects through.
//!
//! [`kill -9`]: NatsServer::kill9

pub mod fixtures;
pub mod proxy;
pub mod tls;

use std::fs::{File, OpenOptions};
use std::io::{Read, Seek, SeekFrom};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use tempfile::TempDir;

/// How often readiness is polled.
const POLL_INTERVAL: Duration = Duration::from_millis(50);
/// How long a single server may take to answer JetStream requests.
const READY_TIMEOUT: Duration = Duration::from_secs(15);
/// How long a cluster may take to form and elect a JetStream meta leader.
const CLUSTER_READY_TIMEOUT: Duration = Duration::from_secs(30);
/// How many times a start is retried with fresh ports when a port turned out to be taken.
const START_ATTEMPTS: usize = 5;
/// Bound of one readiness probe (connect + account info), so a hung server cannot stall the poll.
const PROBE_TIMEOUT: Duration = Duration::from_secs(2);
/// How much of the end of a log file a failure report shows.
const LOG_TAIL_BYTES: u64 = 8 * 1024;

/// Path of the nats-server binary: `$KEDGE_NATS_SERVER` if set, else
/// `<repo>/.tools/bin/nats-server` if it exists, else `nats-server` from `PATH`.
pub fn nats_server_binary() -> PathBuf {
    if let Some(path) = std::env::var_os("KEDGE_NATS_SERVER")
        && !path.is_empty()
    {
        return PathBuf::from(path);
    }
    let repo_root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let local = repo_root.join(".tools/bin/nats-server");
    if local.exists() {
        return local.canonicalize().unwrap_or(local);
    }
    PathBuf::from("nats-server")
}

/// CPU time (user + system) a process or thread has spent, in clock ticks (`getconf CLK_TCK`,
/// 100 on Linux), from its `stat` file: `/proc/<pid>/stat`, `/proc/self/stat`,
/// `/proc/self/task/<tid>/stat`. `None` when it cannot be read (another OS, a process gone).
/// For the benches' CPU accounting.
pub fn cpu_ticks(stat_path: &str) -> Option<u64> {
    let text = std::fs::read_to_string(stat_path).ok()?;
    // The fields after the command name (which may hold spaces and parentheses) start at field
    // 3; utime is field 14 and stime 15.
    let rest = &text[text.rfind(')')? + 1..];
    let fields: Vec<&str> = rest.split_whitespace().collect();
    Some(fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?)
}

/// Clock ticks per second (`getconf CLK_TCK`; 100 when it cannot be asked), asked once: the unit
/// of [`cpu_ticks`].
pub fn clock_ticks() -> f64 {
    static TICKS: std::sync::OnceLock<f64> = std::sync::OnceLock::new();
    *TICKS.get_or_init(|| {
        Command::new("getconf")
            .arg("CLK_TCK")
            .output()
            .ok()
            .and_then(|o| String::from_utf8(o.stdout).ok())
            .and_then(|s| s.trim().parse().ok())
            .filter(|t: &f64| *t > 0.0)
            .unwrap_or(100.0)
    })
}

/// [`cpu_ticks`] in milliseconds.
pub fn cpu_ms(stat_path: &str) -> Option<f64> {
    cpu_ticks(stat_path).map(|ticks| ticks as f64 * 1e3 / clock_ticks())
}

/// A free TCP port on 127.0.0.1 (bind `:0`, read the port, drop the listener).
///
/// Someone else may take the port before the server binds it; the start functions notice and
/// retry with a new port.
pub fn free_port() -> u16 {
    free_ports(1)[0]
}

/// `n` distinct free ports: all listeners are held until every port is chosen.
fn free_ports(n: usize) -> Vec<u16> {
    let listeners: Vec<TcpListener> = (0..n)
        .map(|_| TcpListener::bind("127.0.0.1:0").expect("bind 127.0.0.1:0 to find a free port"))
        .collect();
    listeners
        .iter()
        .map(|l| {
            l.local_addr()
                .expect("local address of a freshly bound listener")
                .port()
        })
        .collect()
}

/// Options for [`NatsServer::start_with`].
#[derive(Debug, Clone, Default)]
pub struct ServerOptions {
    /// Extra lines appended, at top level, to the end of the generated config file (for example
    /// `max_payload: 8MB`). Do not repeat the `jetstream { }` block here: the generated one sets
    /// the store dir; use [`ServerOptions::sync_always`] for `sync_interval`.
    pub extra_config: String,
    /// Set `jetstream { sync_interval: always }`: fsync every write before acknowledging it.
    pub sync_always: bool,
    /// User and password of a user that may ask for JetStream account info, for a server whose
    /// `extra_config` defines accounts (no anonymous connections): the readiness probe and
    /// [`NatsServer::client`] connect as this user.
    pub probe_user: Option<(String, String)>,
    /// The nkey seed (`SU…`) of such a user, for accounts whose users authenticate by nkey (as
    /// `kedge nats-config` writes them); used when `probe_user` is not set.
    pub probe_nkey_seed: Option<String>,
}

/// A single JetStream-enabled `nats-server` process on a loopback port, with a temporary store.
///
/// Killed on drop; the temporary directory is deleted unless the thread is panicking.
#[derive(Debug)]
pub struct NatsServer {
    node: Node,
    /// Holds config, logs and store; `None` once kept for a failed test.
    tmp: Option<TempDir>,
}

impl NatsServer {
    /// Spawns `nats-server -c <generated conf>` on a free loopback port with JetStream and a fresh
    /// temporary store, and waits until it answers JetStream requests.
    ///
    /// # Panics
    /// If the server does not become ready within 15 s (the panic shows its log tail), or the
    /// binary cannot be run.
    pub async fn start() -> NatsServer {
        Self::start_with(ServerOptions::default()).await
    }

    /// Like [`NatsServer::start`], with options.
    ///
    /// # Panics
    /// As [`NatsServer::start`].
    pub async fn start_with(opts: ServerOptions) -> NatsServer {
        let tmp = tempfile::Builder::new()
            .prefix("kedge-nats-")
            .tempdir()
            .expect("create a temporary directory for nats-server");
        let node = Node::new(
            "kedge-test".to_owned(),
            tmp.path().to_path_buf(),
            0,
            None,
            opts,
        );
        // Built before spawning, so that a panic below still kills the process and keeps the dir.
        let mut server = NatsServer {
            node,
            tmp: Some(tmp),
        };
        let mut attempt = 1;
        loop {
            server.node.port = free_port();
            server.node.spawn();
            match wait_ready(vec![&mut server.node], READY_TIMEOUT).await {
                Ok(()) => return server,
                Err(failure) if failure.port_in_use && attempt < START_ATTEMPTS => {
                    server.node.kill9();
                    attempt += 1;
                }
                Err(failure) => panic!("NatsServer::start failed: {}", failure.report),
            }
        }
    }

    /// `nats://127.0.0.1:<port>`.
    pub fn url(&self) -> String {
        self.node.url()
    }

    /// The client port.
    pub fn port(&self) -> u16 {
        self.node.port
    }

    /// The JetStream `store_dir` of the config (the server keeps its data in `jetstream/` under it).
    pub fn store_dir(&self) -> &Path {
        &self.node.store_dir
    }

    /// The server's log file (kept across restarts).
    pub fn log_path(&self) -> &Path {
        &self.node.log_path
    }

    /// PID of the running process; `None` after [`NatsServer::kill9`].
    pub fn pid(&self) -> Option<u32> {
        self.node.pid()
    }

    /// A client connected to this server.
    ///
    /// # Panics
    /// If the connection fails.
    pub async fn client(&self) -> async_nats::Client {
        let url = self.url();
        connect_options(&self.node.opts)
            .connect(url.as_str())
            .await
            .unwrap_or_else(|e| panic!("connect to test nats-server at {url}: {e}"))
    }

    /// SIGKILLs the process and waits for it to exit. The store dir is kept, so
    /// [`NatsServer::restart`] recovers from it. No-op when not running.
    pub fn kill9(&mut self) {
        self.node.kill9();
    }

    /// Starts the server again on the same port and the same store dir, and waits until it
    /// answers JetStream requests. Kills the running process first, if any.
    ///
    /// # Panics
    /// If it does not become ready within 15 s.
    pub async fn restart(&mut self) {
        self.node.kill9();
        restart_node(&mut self.node, READY_TIMEOUT).await;
    }
}

impl Drop for NatsServer {
    fn drop(&mut self) {
        self.node.kill9();
        keep_evidence_if_panicking(&mut self.tmp, "nats-server", &[&self.node]);
    }
}

/// A three-node JetStream cluster of `nats-server` processes on loopback.
///
/// Nodes are numbered 0, 1, 2 (server names `n1`, `n2`, `n3`). Killed on drop; the temporary
/// directory is deleted unless the thread is panicking.
pub struct NatsCluster {
    nodes: Vec<Node>,
    tmp: Option<TempDir>,
    /// With [`NatsCluster::start_cuttable`]: the proxy each route connection from node `from`
    /// to node `to` goes through, as `((from, to), proxy)`. Empty otherwise.
    links: Vec<((usize, usize), proxy::TcpProxy)>,
}

impl std::fmt::Debug for NatsCluster {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsCluster")
            .field("nodes", &self.nodes)
            .field("links", &self.links.len())
            .finish()
    }
}

impl NatsCluster {
    /// Number of nodes.
    pub const SIZE: usize = 3;

    /// Starts a three-node JetStream cluster on loopback: free ports for the client and cluster
    /// listeners, routes between all, server names `n1`..`n3`. Returns once every node answers
    /// JetStream requests through its own connection, which needs a JetStream meta leader.
    ///
    /// # Panics
    /// If the cluster is not ready within 30 s (the panic shows the nodes' log tails).
    pub async fn start() -> NatsCluster {
        Self::start_with(ServerOptions::default()).await
    }

    /// Like [`NatsCluster::start`], with options applied to every node (for example the secured
    /// accounts in `extra_config`, and the `probe_user` that may ask for JetStream account info).
    ///
    /// # Panics
    /// As [`NatsCluster::start`].
    pub async fn start_with(opts: ServerOptions) -> NatsCluster {
        Self::start_inner(opts, false).await
    }

    /// Like [`NatsCluster::start_with`], with every route connection between two nodes going
    /// through a [`proxy::TcpProxy`] of its own (one per direction a route is dialed in), so a
    /// node can be cut from the other two ([`NatsCluster::cut_off`], [`NatsCluster::isolate`])
    /// while its clients stay connected to it: the minority side of a partition. Each node
    /// dials the others only through those proxies, and advertises a route address nothing
    /// listens on, so no node learns a direct way to another by gossip.
    ///
    /// # Panics
    /// As [`NatsCluster::start`].
    pub async fn start_cuttable(opts: ServerOptions) -> NatsCluster {
        Self::start_inner(opts, true).await
    }

    /// Resets every route connection of `node` and refuses new ones for `d`: the node is cut
    /// from the other two (which stay connected to each other) and rejoins after `d`.
    ///
    /// # Panics
    /// If the cluster was not started with [`NatsCluster::start_cuttable`].
    pub fn cut_off(&self, node: usize, d: Duration) {
        for proxy in self.links_of(node) {
            proxy.reset_for(d);
        }
    }

    /// Turns a silent partition of `node` from the other two on or off (route bytes held, the
    /// connections kept: [`proxy::TcpProxy::blackhole`]).
    ///
    /// # Panics
    /// As [`NatsCluster::cut_off`].
    pub fn isolate(&self, node: usize, on: bool) {
        for proxy in self.links_of(node) {
            proxy.blackhole(on);
        }
    }

    fn links_of(&self, node: usize) -> Vec<&proxy::TcpProxy> {
        assert!(
            !self.links.is_empty(),
            "the cluster's routes are not cuttable: start it with NatsCluster::start_cuttable"
        );
        self.links
            .iter()
            .filter(|((from, to), _)| *from == node || *to == node)
            .map(|(_, proxy)| proxy)
            .collect()
    }

    async fn start_inner(opts: ServerOptions, cuttable: bool) -> NatsCluster {
        let tmp = tempfile::Builder::new()
            .prefix("kedge-nats-cluster-")
            .tempdir()
            .expect("create a temporary directory for the nats-server cluster");
        let nodes = (0..Self::SIZE)
            .map(|i| {
                let dir = tmp.path().join(format!("n{}", i + 1));
                std::fs::create_dir_all(&dir)
                    .unwrap_or_else(|e| panic!("create {}: {e}", dir.display()));
                Node::new(
                    format!("n{}", i + 1),
                    dir,
                    0,
                    Some(ClusterPorts::default()),
                    opts.clone(),
                )
            })
            .collect();
        let mut cluster = NatsCluster {
            nodes,
            tmp: Some(tmp),
            links: Vec::new(),
        };
        let mut attempt = 1;
        loop {
            let ports = free_ports(3 * Self::SIZE);
            let routes: Vec<u16> = ports[Self::SIZE..2 * Self::SIZE].to_vec();
            // Route addresses nothing listens on, advertised by the cuttable cluster's nodes.
            let nowhere: Vec<u16> = ports[2 * Self::SIZE..].to_vec();
            cluster.links.clear();
            if cuttable {
                for from in 0..Self::SIZE {
                    for to in (0..Self::SIZE).filter(|to| *to != from) {
                        let upstream = std::net::SocketAddr::from(([127, 0, 0, 1], routes[to]));
                        let proxy = proxy::TcpProxy::start(upstream)
                            .await
                            .expect("a route proxy");
                        cluster.links.push(((from, to), proxy));
                    }
                }
            }
            for (i, node) in cluster.nodes.iter_mut().enumerate() {
                node.port = ports[i];
                node.cluster = Some(if cuttable {
                    ClusterPorts {
                        listen: routes[i],
                        routes: cluster
                            .links
                            .iter()
                            .filter(|((from, _), _)| *from == i)
                            .map(|(_, proxy)| proxy.addr().port())
                            .collect(),
                        advertise: Some(nowhere[i]),
                    }
                } else {
                    ClusterPorts {
                        listen: routes[i],
                        routes: routes.clone(),
                        advertise: None,
                    }
                });
            }
            for node in &mut cluster.nodes {
                node.spawn();
            }
            match wait_ready(cluster.nodes.iter_mut().collect(), CLUSTER_READY_TIMEOUT).await {
                Ok(()) => return cluster,
                Err(failure) if failure.port_in_use && attempt < START_ATTEMPTS => {
                    // Every node's routes name the others' ports: start all over with new ones.
                    for node in &mut cluster.nodes {
                        node.kill9();
                    }
                    attempt += 1;
                }
                Err(failure) => panic!("NatsCluster::start failed: {}", failure.report),
            }
        }
    }

    /// Client URLs of all nodes, in node order.
    pub fn urls(&self) -> Vec<String> {
        self.nodes.iter().map(Node::url).collect()
    }

    /// Client URL of one node.
    ///
    /// # Panics
    /// If `node >= 3`.
    pub fn url(&self, node: usize) -> String {
        self.node(node).url()
    }

    /// Server name of one node (`n1`, `n2` or `n3`), as reported in stream cluster info.
    ///
    /// # Panics
    /// If `node >= 3`.
    pub fn server_name(&self, node: usize) -> &str {
        &self.node(node).name
    }

    /// Index of the node with this server name, if any.
    pub fn node_index(&self, server_name: &str) -> Option<usize> {
        self.nodes.iter().position(|n| n.name == server_name)
    }

    /// PID of a node's running process; `None` after [`NatsCluster::kill9`].
    ///
    /// # Panics
    /// If `node >= 3`.
    pub fn pid(&self, node: usize) -> Option<u32> {
        self.node(node).pid()
    }

    /// A client connected with all three URLs (it fails over between them).
    ///
    /// # Panics
    /// If the connection fails.
    pub async fn client(&self) -> async_nats::Client {
        let urls = self.urls();
        async_nats::connect(urls.clone())
            .await
            .unwrap_or_else(|e| panic!("connect to test nats-server cluster at {urls:?}: {e}"))
    }

    /// A client connected with all three URLs, as the options' probe user (`probe_user` or
    /// `probe_nkey_seed`) if there is one: the client to use on a cluster started with accounts.
    ///
    /// # Panics
    /// If the connection fails.
    pub async fn probe_client(&self) -> async_nats::Client {
        let urls = self.urls();
        connect_options(&self.node(0).opts)
            .connect(urls.clone())
            .await
            .unwrap_or_else(|e| panic!("connect to test nats-server cluster at {urls:?}: {e}"))
    }

    /// A node's log file (kept across restarts).
    ///
    /// # Panics
    /// If `node >= 3`.
    pub fn log_path(&self, node: usize) -> &Path {
        &self.node(node).log_path
    }

    /// SIGKILLs one node and waits for it to exit; its store is kept. No-op when not running.
    ///
    /// # Panics
    /// If `node >= 3`.
    pub fn kill9(&mut self, node: usize) {
        self.node_mut(node).kill9();
    }

    /// Starts one node again on the same ports and store, and waits until it answers JetStream
    /// requests through its own connection. Kills it first if it is running.
    ///
    /// # Panics
    /// If `node >= 3`, or it is not ready within 30 s.
    pub async fn restart(&mut self, node: usize) {
        let n = self.node_mut(node);
        n.kill9();
        restart_node(n, CLUSTER_READY_TIMEOUT).await;
    }

    fn node(&self, node: usize) -> &Node {
        self.nodes
            .get(node)
            .unwrap_or_else(|| panic!("cluster node index {node} out of range 0..3"))
    }

    fn node_mut(&mut self, node: usize) -> &mut Node {
        self.nodes
            .get_mut(node)
            .unwrap_or_else(|| panic!("cluster node index {node} out of range 0..3"))
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for node in &mut self.nodes {
            node.kill9();
        }
        let nodes: Vec<&Node> = self.nodes.iter().collect();
        keep_evidence_if_panicking(&mut self.tmp, "nats-server cluster", &nodes);
    }
}

/// On a panicking thread, keeps the temporary directory (config, store, logs) and says where.
fn keep_evidence_if_panicking(tmp: &mut Option<TempDir>, what: &str, nodes: &[&Node]) {
    if !std::thread::panicking() {
        return; // `tmp` drops with its owner and removes the directory.
    }
    if let Some(tmp) = tmp.take() {
        let dir = tmp.keep();
        eprintln!(
            "kedge-testkit: test panicked; keeping the {what} directory {}",
            dir.display()
        );
        for node in nodes {
            eprintln!(
                "kedge-testkit:   {} log: {}",
                node.name,
                node.log_path.display()
            );
        }
    }
}

/// Cluster listener of a node and the route URLs it dials.
#[derive(Debug, Clone, Default)]
struct ClusterPorts {
    listen: u16,
    routes: Vec<u16>,
    /// The route address the node tells the others about (`cluster.advertise`), if not its own.
    advertise: Option<u16>,
}

/// One nats-server: its config inputs, files, and running process if any.
///
/// Processes are spawned with `std::process::Command` rather than tokio's: killing and reaping
/// must happen in `Drop` and in the synchronous `kill9`, where nothing can be awaited. std's
/// `Child::kill` sends SIGKILL and `Child::wait` reaps it at once, with no runtime needed, and
/// the readiness polling (the only part that waits long) is async anyway.
#[derive(Debug)]
struct Node {
    name: String,
    port: u16,
    cluster: Option<ClusterPorts>,
    opts: ServerOptions,
    config_path: PathBuf,
    store_dir: PathBuf,
    log_path: PathBuf,
    stderr_path: PathBuf,
    process: Option<Process>,
}

#[derive(Debug)]
struct Process {
    server: Child,
    /// Kills `server` if the test process dies without running `Drop`; see [`spawn_watchdog`].
    watchdog: Option<Child>,
    /// Sizes of the log files when this process was spawned, to read only its own lines.
    log_offset: u64,
    stderr_offset: u64,
}

/// Why a wait for readiness failed.
#[derive(Debug)]
struct StartFailure {
    /// The process exited saying its address was already in use: retry with other ports.
    port_in_use: bool,
    report: String,
}

impl Node {
    fn new(
        name: String,
        dir: PathBuf,
        port: u16,
        cluster: Option<ClusterPorts>,
        opts: ServerOptions,
    ) -> Node {
        Node {
            name,
            port,
            cluster,
            opts,
            config_path: dir.join("nats.conf"),
            store_dir: dir.join("js"),
            log_path: dir.join("nats.log"),
            stderr_path: dir.join("stderr.log"),
            process: None,
        }
    }

    fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    fn pid(&self) -> Option<u32> {
        self.process.as_ref().map(|p| p.server.id())
    }

    fn config_text(&self) -> String {
        let mut conf = format!(
            "# Generated by kedge-testkit.\n\
             server_name: {name}\n\
             listen: 127.0.0.1:{port}\n\
             log_file: {log}\n\
             jetstream {{\n  store_dir: {store}\n",
            name = quote(&self.name),
            port = self.port,
            log = quote(&self.log_path.to_string_lossy()),
            store = quote(&self.store_dir.to_string_lossy()),
        );
        if self.opts.sync_always {
            conf.push_str("  sync_interval: always\n");
        }
        conf.push_str("}\n");
        if let Some(cluster) = &self.cluster {
            conf.push_str(&format!(
                "cluster {{\n  name: kedge-test\n  listen: 127.0.0.1:{}\n",
                cluster.listen
            ));
            if let Some(advertise) = cluster.advertise {
                conf.push_str(&format!("  advertise: 127.0.0.1:{advertise}\n"));
            }
            conf.push_str("  routes: [\n");
            for port in &cluster.routes {
                conf.push_str(&format!("    nats-route://127.0.0.1:{port}\n"));
            }
            conf.push_str("  ]\n}\n");
        }
        if !self.opts.extra_config.is_empty() {
            conf.push_str(&self.opts.extra_config);
            conf.push('\n');
        }
        conf
    }

    /// Writes the config and spawns the server (not waiting for it). Kills a running one first.
    fn spawn(&mut self) {
        self.kill9();
        std::fs::write(&self.config_path, self.config_text()).unwrap_or_else(|e| {
            panic!(
                "write nats-server config {}: {e}",
                self.config_path.display()
            )
        });
        let log_offset = file_len(&self.log_path);
        let stderr_offset = file_len(&self.stderr_path);
        let stderr = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.stderr_path)
            .unwrap_or_else(|e| panic!("open {}: {e}", self.stderr_path.display()));
        let stdout = stderr
            .try_clone()
            .unwrap_or_else(|e| panic!("clone handle of {}: {e}", self.stderr_path.display()));
        let binary = nats_server_binary();
        let server = Command::new(&binary)
            .arg("-c")
            .arg(&self.config_path)
            .stdin(Stdio::null())
            .stdout(stdout)
            .stderr(stderr)
            .spawn()
            .unwrap_or_else(|e| {
                panic!(
                    "spawn {} (set KEDGE_NATS_SERVER or run scripts/setup.sh): {e}",
                    binary.display()
                )
            });
        let watchdog = spawn_watchdog(server.id());
        self.process = Some(Process {
            server,
            watchdog,
            log_offset,
            stderr_offset,
        });
    }

    /// SIGKILL and reap the server (and its watchdog). No-op when not running.
    fn kill9(&mut self) {
        let Some(mut process) = self.process.take() else {
            return;
        };
        // The watchdog goes first: once the server is reaped its PID may be reused, and the
        // watchdog must not kill -9 a stranger when its pipe closes.
        if let Some(mut watchdog) = process.watchdog.take() {
            let _ = watchdog.kill(); // Err only if it already exited.
            let _ = watchdog.wait();
        }
        let _ = process.server.kill(); // Err only if it already exited; `wait` reaps it either way.
        if let Err(e) = process.server.wait() {
            eprintln!(
                "kedge-testkit: waiting for nats-server {} (pid {}) failed: {e}",
                self.name,
                process.server.id()
            );
        }
    }

    /// `Some(status)` if the process was spawned and has exited.
    fn exited(&mut self) -> Option<ExitStatus> {
        let process = self.process.as_mut()?;
        process.server.try_wait().ok().flatten()
    }

    /// Whether the current process's own log lines say a listener's address was taken.
    fn says_port_in_use(&self) -> bool {
        let Some(p) = &self.process else { return false };
        [
            (&self.log_path, p.log_offset),
            (&self.stderr_path, p.stderr_offset),
        ]
        .iter()
        .any(|(path, offset)| read_from(path, *offset).contains("address already in use"))
    }

    /// A human-readable account of this node for a failure message: ports, files, log tails.
    fn report(&self, headline: &str) -> String {
        let cluster = match &self.cluster {
            Some(c) => format!(", cluster port {}", c.listen),
            None => String::new(),
        };
        format!(
            "nats-server {name} ({binary}, client port {port}{cluster}): {headline}\n\
             config: {config}\n\
             --- log tail: {log} ---\n{log_tail}\n\
             --- stdout/stderr tail: {stderr} ---\n{stderr_tail}\n---",
            name = self.name,
            binary = nats_server_binary().display(),
            port = self.port,
            config = self.config_path.display(),
            log = self.log_path.display(),
            log_tail = tail(&self.log_path),
            stderr = self.stderr_path.display(),
            stderr_tail = tail(&self.stderr_path),
        )
    }
}

/// Starts a killed node again on its own ports and store. The port may still be briefly held by
/// someone else, so an "address already in use" exit is retried until `timeout`.
async fn restart_node(node: &mut Node, timeout: Duration) {
    let deadline = Instant::now() + timeout;
    loop {
        node.spawn();
        match wait_ready(vec![&mut *node], timeout).await {
            Ok(()) => return,
            Err(failure) if failure.port_in_use && Instant::now() < deadline => {
                node.kill9();
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
            Err(failure) => panic!("restart of nats-server failed: {}", failure.report),
        }
    }
}

/// Polls every node until each answers a JetStream account-info request on its own connection,
/// checking every round that none has exited.
async fn wait_ready(mut nodes: Vec<&mut Node>, timeout: Duration) -> Result<(), StartFailure> {
    let start = Instant::now();
    let mut ready = vec![false; nodes.len()];
    loop {
        for node in nodes.iter_mut() {
            if let Some(status) = node.exited() {
                return Err(StartFailure {
                    port_in_use: node.says_port_in_use(),
                    report: node.report(&format!("exited before it was ready ({status})")),
                });
            }
        }
        for (node, ready) in nodes.iter().zip(ready.iter_mut()) {
            if !*ready {
                *ready = probe(&node.url(), &node.opts).await;
            }
        }
        if ready.iter().all(|r| *r) {
            return Ok(());
        }
        if start.elapsed() > timeout {
            let report = nodes
                .iter()
                .zip(&ready)
                .map(|(node, ready)| {
                    let state = if *ready {
                        "ready".to_owned()
                    } else {
                        format!("not ready after {timeout:?}")
                    };
                    node.report(&state)
                })
                .collect::<Vec<_>>()
                .join("\n");
            return Err(StartFailure {
                port_in_use: false,
                report,
            });
        }
        tokio::time::sleep(POLL_INTERVAL).await;
    }
}

/// One readiness probe: connect and ask JetStream for the account info (this needs JetStream up
/// and, in a cluster, a meta leader).
/// Connect options with the probe user's credentials (password, else nkey), if any.
fn connect_options(opts: &ServerOptions) -> async_nats::ConnectOptions {
    match (&opts.probe_user, &opts.probe_nkey_seed) {
        (Some((u, p)), _) => {
            async_nats::ConnectOptions::with_user_and_password(u.clone(), p.clone())
        }
        (None, Some(seed)) => async_nats::ConnectOptions::with_nkey(seed.clone()),
        (None, None) => async_nats::ConnectOptions::new(),
    }
}

async fn probe(url: &str, opts: &ServerOptions) -> bool {
    let attempt = async {
        let client = connect_options(opts)
            .connection_timeout(PROBE_TIMEOUT)
            .connect(url)
            .await
            .ok()?;
        async_nats::jetstream::new(client)
            .query_account()
            .await
            .ok()
    };
    matches!(
        tokio::time::timeout(PROBE_TIMEOUT, attempt).await,
        Ok(Some(_))
    )
}

/// Spawns `sh`, which blocks reading a pipe whose write end only this (test) process holds; when
/// the test process dies in any way, the kernel closes that end, `read` returns, and the shell
/// SIGKILLs the server. The pipe is created close-on-exec, so no other child inherits it.
///
/// (A `PR_SET_PDEATHSIG` would need `unsafe` `pre_exec`, which the workspace forbids.) Best
/// effort: without `sh` the server still dies on `Drop`.
fn spawn_watchdog(server_pid: u32) -> Option<Child> {
    Command::new("sh")
        .arg("-c")
        .arg(r#"read -r _; kill -9 "$1" 2>/dev/null"#)
        .arg("kedge-nats-watchdog")
        .arg(server_pid.to_string())
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .map_err(|e| eprintln!("kedge-testkit: no watchdog for nats-server pid {server_pid}: {e}"))
        .ok()
}

/// A NATS config string literal.
fn quote(s: &str) -> String {
    format!("\"{}\"", s.replace('\\', "\\\\").replace('"', "\\\""))
}

fn file_len(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

/// The file's contents from `offset` on (lossy UTF-8); empty if unreadable.
fn read_from(path: &Path, offset: u64) -> String {
    let mut buf = Vec::new();
    if let Ok(mut file) = File::open(path)
        && file.seek(SeekFrom::Start(offset)).is_ok()
    {
        let _ = file.read_to_end(&mut buf);
    }
    String::from_utf8_lossy(&buf).into_owned()
}

/// The last few KiB of a file, for failure messages.
fn tail(path: &Path) -> String {
    let offset = file_len(path).saturating_sub(LOG_TAIL_BYTES);
    let text = read_from(path, offset);
    if text.is_empty() {
        "(empty or missing)".to_owned()
    } else {
        text.trim_end().to_owned()
    }
}

#[cfg(test)]
mod tests {
    use super::cpu_ticks;

    #[test]
    fn cpu_ticks_are_utime_plus_stime_whatever_the_command_name() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("stat");
        // Fields 4..=13, then utime (14) = 7 and stime (15) = 5, then more.
        std::fs::write(
            &path,
            "4242 (a (weird) name) S 1 2 3 4 5 6 7 8 9 10 7 5 0 0 20 0 1\n",
        )
        .expect("write");
        assert_eq!(cpu_ticks(path.to_str().expect("utf-8 path")), Some(12));
        std::fs::write(&path, "4242 (short) S 1 2").expect("write");
        assert_eq!(cpu_ticks(path.to_str().expect("utf-8 path")), None);
        assert_eq!(cpu_ticks("/nonexistent/stat"), None);
    }
}
