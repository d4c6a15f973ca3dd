//! A nats-server the demo starts for itself: a free loopback port, data under a local directory,
//! stopped (and waited for) on drop.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};

/// The nats-server to run: `$KEDGE_NATS_SERVER`, else the one `scripts/setup.sh` installs in the
/// repository's `.tools/bin`, else `nats-server` from `PATH`.
pub fn binary() -> PathBuf {
    if let Some(p) = std::env::var_os("KEDGE_NATS_SERVER").filter(|p| !p.is_empty()) {
        return PathBuf::from(p);
    }
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../.tools/bin/nats-server");
    if repo.exists() {
        return repo;
    }
    PathBuf::from("nats-server")
}

#[derive(Debug)]
pub struct LocalNats {
    child: Child,
    pub url: String,
    pub log: PathBuf,
}

impl LocalNats {
    /// Starts nats-server with JetStream storing under `dir/store` and waits until JetStream
    /// answers.
    pub async fn start(dir: &Path) -> anyhow::Result<LocalNats> {
        std::fs::create_dir_all(dir).with_context(|| format!("create {}", dir.display()))?;
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let store = dir.join("store");
        let log = dir.join("nats.log");
        let conf = dir.join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{port}\nserver_name: kedge-demo\nlog_file: \"{}\"\njetstream {{ store_dir: \"{}\" }}\n",
                log.display(),
                store.display()
            ),
        )?;
        let bin = binary();
        let child = Command::new(&bin)
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .with_context(|| {
                format!(
                    "cannot start {} (run scripts/setup.sh to install nats-server >= 2.14)",
                    bin.display()
                )
            })?;
        let server = LocalNats {
            child,
            url: format!("nats://127.0.0.1:{port}"),
            log,
        };
        // Its own server: no credentials, whatever the caller's NATS settings are; one attempt
        // per round of this loop.
        let mut probe = kedge_runtime::Config {
            nats_urls: vec![server.url.clone()],
            ..Default::default()
        };
        probe.nats.connect_wait_ms = 0;
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok(client) = kedge_runtime::connect_client(&probe).await
                && async_nats::jetstream::new(client)
                    .query_account()
                    .await
                    .is_ok()
            {
                return Ok(server);
            }
            if Instant::now() > deadline {
                bail!(
                    "nats-server did not become ready in 15 s; see {}",
                    server.log.display()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for LocalNats {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
