//! The test kit against a real nats-server (run `scripts/setup.sh` first, or set
//! `KEDGE_NATS_SERVER`).

use std::path::Path;
use std::time::{Duration, Instant};

use async_nats::jetstream::{self, stream};
use kedge_testkit::{NatsCluster, NatsServer, ServerOptions};

/// Whether a PID names no live process (gone, or a zombie nobody reaped yet).
fn process_gone(pid: u32) -> bool {
    match std::fs::read_to_string(format!("/proc/{pid}/stat")) {
        Err(_) => true,
        // Format: "pid (comm) state ..."; comm may contain spaces, so look after the last ')'.
        Ok(stat) => stat
            .rsplit_once(')')
            .is_some_and(|(_, rest)| rest.trim_start().starts_with(['Z', 'X'])),
    }
}

/// Polls until `pid` is gone, for at most `within`.
fn wait_gone(pid: u32, within: Duration) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if process_gone(pid) {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    process_gone(pid)
}

/// Publishes and waits for the ack, retrying (bounded) while the stream is unavailable, e.g.
/// during a leader election. Returns the stream sequence and the number of attempts.
async fn publish_with_retry(
    js: &jetstream::Context,
    subject: &str,
    payload: &'static str,
    within: Duration,
) -> (u64, usize) {
    let deadline = Instant::now() + within;
    let mut attempts = 0;
    loop {
        attempts += 1;
        let attempt = async {
            let ack = js
                .publish(subject.to_owned(), payload.into())
                .await
                .map_err(|e| e.to_string())?;
            ack.await.map_err(|e| e.to_string())
        };
        let error = match tokio::time::timeout(Duration::from_secs(2), attempt).await {
            Ok(Ok(ack)) => return (ack.sequence, attempts),
            Ok(Err(e)) => e,
            Err(_) => "timed out".to_owned(),
        };
        assert!(
            Instant::now() < deadline,
            "publish to {subject} still failing after {within:?} ({attempts} attempts): {error}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test]
async fn acked_message_survives_kill9_and_restart() {
    let mut server = NatsServer::start().await;
    let port = server.port();
    assert_eq!(server.url(), format!("nats://127.0.0.1:{port}"));

    let js = jetstream::new(server.client().await);
    js.create_stream(stream::Config {
        name: "CRASH".to_owned(),
        subjects: vec!["crash.>".to_owned()],
        storage: stream::StorageType::File,
        ..Default::default()
    })
    .await
    .expect("create stream");
    let ack = js
        .publish("crash.a", "before the crash".into())
        .await
        .expect("publish")
        .await
        .expect("publish ack");

    let pid = server.pid().expect("server is running");
    server.kill9();
    assert!(server.pid().is_none(), "kill9 forgets the process");
    assert!(process_gone(pid), "kill9 waited for pid {pid} to exit");

    server.restart().await;
    assert_eq!(server.port(), port, "restart keeps the port");
    assert!(
        server.store_dir().join("jetstream").is_dir(),
        "store kept under {}",
        server.store_dir().display()
    );

    let js = jetstream::new(server.client().await);
    let stream = js.get_stream("CRASH").await.expect("stream after restart");
    let message = stream
        .get_raw_message(ack.sequence)
        .await
        .expect("message after restart");
    assert_eq!(message.subject.as_str(), "crash.a");
    assert_eq!(&message.payload[..], b"before the crash");
}

#[tokio::test]
async fn options_reach_the_config() {
    let server = NatsServer::start_with(ServerOptions {
        extra_config: "max_payload: 2MB".to_owned(),
        sync_always: true,
        ..Default::default()
    })
    .await;
    let client = server.client().await;
    assert_eq!(client.server_info().max_payload, 2 * 1024 * 1024);

    let conf = std::fs::read_to_string(server.store_dir().with_file_name("nats.conf"))
        .expect("read generated config");
    assert!(conf.contains("sync_interval: always"), "{conf}");

    // JetStream works with sync_interval: always.
    let js = jetstream::new(client);
    js.create_stream(stream::Config {
        name: "SYNC".to_owned(),
        subjects: vec!["sync.>".to_owned()],
        ..Default::default()
    })
    .await
    .expect("create stream");
    js.publish("sync.a", "x".into())
        .await
        .expect("publish")
        .await
        .expect("publish ack");
}

#[tokio::test]
async fn drop_kills_the_process_and_removes_the_temp_dir() {
    let server = NatsServer::start().await;
    let pid = server.pid().expect("server is running");
    let port = server.port();
    let dir = server
        .store_dir()
        .parent()
        .expect("store dir is inside the temp dir")
        .to_path_buf();
    assert!(!process_gone(pid));

    drop(server);

    assert!(process_gone(pid), "pid {pid} still alive after drop");
    assert!(!dir.exists(), "{} not removed", dir.display());
    assert!(
        std::net::TcpStream::connect(("127.0.0.1", port)).is_err(),
        "port {port} still accepts connections"
    );
}

#[test]
fn a_panicking_test_keeps_the_evidence() {
    let (tx, rx) = std::sync::mpsc::channel();
    let result = std::thread::spawn(move || {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        runtime.block_on(async {
            let server = NatsServer::start().await;
            let pid = server.pid().expect("server is running");
            tx.send((
                pid,
                server.store_dir().to_path_buf(),
                server.log_path().to_path_buf(),
            ))
            .expect("send paths");
            panic!("deliberate panic to check that the evidence is kept");
        })
    })
    .join();
    assert!(result.is_err(), "the thread panicked");

    let (pid, store, log) = rx.recv().expect("paths from the panicking thread");
    assert!(
        process_gone(pid),
        "pid {pid} still alive after a panicking drop"
    );
    let dir = store.parent().expect("temp dir").to_path_buf();
    assert!(store.is_dir(), "store dir {} kept", store.display());
    assert!(log.is_file(), "log {} kept", log.display());
    std::fs::remove_dir_all(&dir).expect("clean up the kept dir");
}

/// Env var that turns [`watchdog_child`] into the helper process of
/// [`server_dies_with_the_test_process`].
const WATCHDOG_CHILD: &str = "KEDGE_TESTKIT_WATCHDOG_CHILD";

/// Does nothing in a normal run. As the helper: starts a server, prints its PID, and aborts, so
/// no destructor runs.
#[tokio::test]
async fn watchdog_child() {
    if std::env::var_os(WATCHDOG_CHILD).is_none() {
        return;
    }
    let server = NatsServer::start().await;
    println!("SERVER_PID={}", server.pid().expect("server is running"));
    println!("SERVER_DIR={}", server.store_dir().display());
    std::process::abort();
}

#[test]
fn server_dies_with_the_test_process() {
    let output = std::process::Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "--exact",
            "watchdog_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(WATCHDOG_CHILD, "1")
        .output()
        .expect("run the helper test process");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let field = |key: &str| {
        stdout
            .lines()
            // The harness may print "test watchdog_child ... " before the first line.
            .find_map(|l| l.split_once(key).map(|(_, value)| value.trim().to_owned()))
            .unwrap_or_else(|| {
                panic!(
                    "no {key} from the helper; stdout:\n{stdout}\nstderr:\n{}",
                    String::from_utf8_lossy(&output.stderr)
                )
            })
    };
    let pid: u32 = field("SERVER_PID=").parse().expect("numeric pid");
    let store = field("SERVER_DIR=");
    assert!(!output.status.success(), "the helper aborted");
    assert!(
        wait_gone(pid, Duration::from_secs(5)),
        "nats-server pid {pid} outlived its test process"
    );
    // Nothing ran Drop in the helper: clean up its temp dir.
    if let Some(dir) = Path::new(&store).parent() {
        std::fs::remove_dir_all(dir).expect("remove the helper's temp dir");
    }
}

#[tokio::test]
async fn cluster_r3_stream_survives_losing_its_leader() {
    let mut cluster = NatsCluster::start().await;
    assert_eq!(cluster.urls().len(), 3);

    let js = jetstream::new(cluster.client().await);
    let mut stream = js
        .create_stream(stream::Config {
            name: "HA".to_owned(),
            subjects: vec!["ha.>".to_owned()],
            storage: stream::StorageType::File,
            num_replicas: 3,
            ..Default::default()
        })
        .await
        .expect("create R3 stream");
    let (first, _) = publish_with_retry(&js, "ha.a", "one", Duration::from_secs(10)).await;

    let info = stream.info().await.expect("stream info");
    let leader = info
        .cluster
        .as_ref()
        .and_then(|c| c.leader.clone())
        .expect("R3 stream has a leader");
    let leader = cluster
        .node_index(&leader)
        .unwrap_or_else(|| panic!("leader {leader} is one of n1..n3"));

    let pid = cluster.pid(leader).expect("leader is running");
    cluster.kill9(leader);
    assert!(process_gone(pid));

    // A new leader is elected (measured ~5 s); publishes fail meanwhile and succeed after.
    let started = Instant::now();
    let (second, attempts) = publish_with_retry(&js, "ha.b", "two", Duration::from_secs(20)).await;
    eprintln!(
        "publish succeeded {:?} after killing {} ({attempts} attempts)",
        started.elapsed(),
        cluster.server_name(leader)
    );
    assert!(second > first);

    let stream = js.get_stream("HA").await.expect("stream after failover");
    let message = stream
        .get_raw_message(first)
        .await
        .expect("acked message survives losing the leader");
    assert_eq!(&message.payload[..], b"one");

    // The killed node comes back on its ports and store and the cluster keeps working.
    cluster.restart(leader).await;
    assert!(cluster.pid(leader).is_some());
    publish_with_retry(&js, "ha.c", "three", Duration::from_secs(10)).await;
}

#[test]
fn a_server_that_cannot_start_panics_with_its_log() {
    let result = std::thread::spawn(|| {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("tokio runtime");
        runtime.block_on(NatsServer::start_with(ServerOptions {
            extra_config: "no_such_option_in_nats: {{{".to_owned(),
            sync_always: false,
            ..Default::default()
        }))
    })
    .join();
    let payload = result.expect_err("start with a broken config panics");
    let message = payload
        .downcast_ref::<String>()
        .cloned()
        .expect("panic message is a String");
    assert!(message.contains("exited before it was ready"), "{message}");
    assert!(message.contains("--- log tail"), "{message}");
    // The failed start kept its directory as evidence; this test expected it, so clean it up.
    let config = message
        .lines()
        .find_map(|l| l.strip_prefix("config: "))
        .unwrap_or_else(|| panic!("no config path in: {message}"));
    let dir = Path::new(config)
        .parent()
        .expect("config is inside the temp dir");
    assert!(dir.is_dir(), "{} kept", dir.display());
    std::fs::remove_dir_all(dir).expect("clean up the kept dir");
}

#[tokio::test]
async fn restart_waits_for_its_port_to_be_released() {
    let mut server = NatsServer::start().await;
    let port = server.port();
    server.kill9();

    // Someone grabs the port while the server is down and lets go of it a little later.
    let squatter =
        std::net::TcpListener::bind(("127.0.0.1", port)).expect("bind the killed server's port");
    let release = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(500)).await;
        drop(squatter);
    });

    server.restart().await;
    release.await.expect("release task");
    assert_eq!(server.port(), port);
    let log = std::fs::read_to_string(server.log_path()).expect("read log");
    assert!(
        log.contains("address already in use"),
        "the first restart attempt hit the taken port"
    );
    server.client().await.flush().await.expect("flush");
}
