//! The pool against server-everything over Streamable HTTP, on loopback.

#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeMap;
use std::net::{Ipv4Addr, SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use common::{PATIENT, echo_args, launcher, never, obj};
use kedge_mcp::{Outcome, Pool, ServerConfig};
use serde_json::json;

/// server-everything listens on all interfaces and has no host option; this preload makes a
/// port-only `listen()` bind 127.0.0.1 instead, so the test server is reachable from loopback only.
const BIND_LOOPBACK_JS: &str = r#"
const net = require('net');
const listen = net.Server.prototype.listen;
net.Server.prototype.listen = function (...args) {
  const port = args[0];
  if ((typeof port === 'number' || (typeof port === 'string' && /^\d+$/.test(port))) && typeof args[1] !== 'string') {
    args.splice(1, 0, '127.0.0.1');
  }
  return listen.apply(this, args);
};
"#;

/// A running `mcp-server-everything streamableHttp`, killed by pid on drop.
struct HttpServer {
    child: Child,
    port: u16,
    /// Holds the server's log; kept when the test fails.
    dir: Option<tempfile::TempDir>,
}

impl HttpServer {
    fn start() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let preload = dir.path().join("bind-loopback.cjs");
        std::fs::write(&preload, BIND_LOOPBACK_JS).unwrap();
        let port = TcpListener::bind((Ipv4Addr::LOCALHOST, 0))
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let log = std::fs::File::create(dir.path().join("server.log")).unwrap();
        let child = Command::new(launcher("mcp-server-everything"))
            .arg("streamableHttp")
            .env("PORT", port.to_string())
            .env("NODE_OPTIONS", format!("--require {}", preload.display()))
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap();
        let server = Self {
            child,
            port,
            dir: Some(dir),
        };
        server.wait_until_accepting();
        server
    }

    fn wait_until_accepting(&self) {
        let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, self.port));
        let give_up = Instant::now() + Duration::from_secs(20);
        while TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_err() {
            assert!(
                Instant::now() < give_up,
                "server-everything did not listen on {addr}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn url(&self) -> String {
        format!("http://127.0.0.1:{}/mcp", self.port)
    }
}

impl Drop for HttpServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        common::keep_if_wanted(self.dir.take());
    }
}

#[tokio::test]
async fn streamable_http_tools_echo_and_stop() {
    let server = HttpServer::start();
    // The configuration as it would appear in a file.
    let servers: BTreeMap<String, ServerConfig> =
        serde_json::from_value(json!({ "everything": { "url": server.url() } })).unwrap();
    assert_eq!(servers["everything"], ServerConfig::http(server.url()));
    let pool = Pool::new(servers);

    let tools = pool.tools("everything").await.unwrap();
    assert!(tools.iter().any(|t| t.name == "echo"), "{tools:?}");

    let outcome = pool
        .call(
            "everything",
            "echo",
            echo_args("over http"),
            "op-http",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert_eq!(
        outcome,
        Outcome::Completed {
            content: "Echo: over http".into(),
            is_error: false
        }
    );

    let started = Instant::now();
    let stopped = pool
        .call(
            "everything",
            "trigger-long-running-operation",
            obj(json!({"duration": 15, "steps": 15})),
            "op-http-stop",
            PATIENT,
            tokio::time::sleep(Duration::from_millis(300)),
        )
        .await
        .unwrap();
    assert_eq!(stopped, Outcome::Stopped);
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "took {:?}",
        started.elapsed()
    );

    let again = pool
        .call(
            "everything",
            "echo",
            echo_args("again"),
            "op-http-2",
            PATIENT,
            never(),
        )
        .await
        .unwrap();
    assert!(
        matches!(again, Outcome::Completed { ref content, .. } if content == "Echo: again"),
        "{again:?}"
    );

    pool.close().await;
    drop(server);
}
