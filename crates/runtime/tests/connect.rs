//! Connecting with credentials, against real nats-servers that require them: user + password
//! (also as URL user info, through `Runtime::connect`), a token, an nkey seed file, TLS with a
//! client certificate; the inbox prefix; and that no error shows a secret.
//!
//! The testkit's readiness probe connects without credentials, so the servers started with it
//! let credential-less clients in as a `probe` user (`no_auth_user`) or accept plain connections
//! next to TLS (`allow_non_tls`); the clients under test authenticate as other users, and a
//! wrong credential is refused (a client that sends credentials never falls back to the
//! no-auth user). The token server is spawned here: a token server has no users to fall back to.

use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use kedge_runtime::{Config, ConnectFailure, Runtime, RuntimeError, Secret, connect_client};
use kedge_testkit::{NatsServer, ServerOptions};

/// A config for `url` that gives up on an unreachable server quickly.
fn config(url: String) -> Config {
    let mut c = Config {
        nats_urls: vec![url],
        ..Config::default()
    };
    c.nats.connect_wait_ms = 2_000;
    c
}

fn failure(e: &RuntimeError) -> Option<ConnectFailure> {
    match e {
        RuntimeError::Connect { kind, .. } => Some(*kind),
        _ => None,
    }
}

/// A server with users `kedge` (password) and `nkey` (an nkey), and `probe` for the testkit.
async fn server_with_users(password: &str, nkey_public: &str) -> NatsServer {
    NatsServer::start_with(ServerOptions {
        extra_config: format!(
            "authorization {{\n  users = [\n    {{user: probe, password: probe-pass}}\n    \
             {{user: kedge, password: \"{password}\"}}\n    {{nkey: {nkey_public}}}\n  ]\n}}\n\
             no_auth_user: probe\n"
        ),
        ..Default::default()
    })
    .await
}

#[tokio::test]
async fn user_and_password_connect_and_a_wrong_password_is_refused_without_showing_it() {
    let nkey = nkeys::KeyPair::new_user();
    let server = server_with_users("right-pass-123", &nkey.public_key()).await;

    let mut c = config(server.url());
    c.nats.user = Some("kedge".into());
    c.nats.password = Some(Secret::new("right-pass-123"));
    let client = connect_client(&c).await.expect("connects");
    client.flush().await.expect("flush");

    c.nats.password = Some(Secret::new("wrong-pass-456"));
    let started = Instant::now();
    let err = connect_client(&c).await.expect_err("wrong password");
    let text = format!("{err} {err:?}");
    assert_eq!(failure(&err), Some(ConnectFailure::Refused), "{text}");
    assert!(
        started.elapsed() < Duration::from_secs(2),
        "a refusal is not retried"
    );
    assert!(text.contains("authorization violation"), "{text}");
    assert!(!text.contains("wrong-pass-456"), "{text}");

    // The same credentials as URL user info, through the whole runtime (layout included); the
    // error of a wrong one shows the URL redacted.
    let port = server.port();
    let rt = Runtime::connect(config(format!(
        "nats://kedge:right-pass-123@127.0.0.1:{port}"
    )))
    .await
    .expect("runtime connects with URL user info");
    rt.client.flush().await.expect("flush");
    let err = Runtime::connect(config(format!(
        "nats://kedge:wrong-pass-456@127.0.0.1:{port}"
    )))
    .await
    .expect_err("wrong URL password");
    let text = format!("{err} {err:?}");
    assert!(!text.contains("wrong-pass-456"), "{text}");
    assert!(
        text.contains(&format!("nats://<redacted>@127.0.0.1:{port}")),
        "{text}"
    );
}

#[tokio::test]
async fn an_nkey_seed_file_authenticates() {
    let nkey = nkeys::KeyPair::new_user();
    let server = server_with_users("unused-pass-1", &nkey.public_key()).await;
    let dir = tempfile::tempdir().expect("tempdir");
    let seed_file = dir.path().join("user.nk");
    std::fs::write(&seed_file, nkey.seed().expect("seed")).expect("write seed");

    let mut c = config(server.url());
    c.nats.nkey_seed_file = Some(seed_file.clone());
    let client = connect_client(&c).await.expect("connects with the nkey");
    client.flush().await.expect("flush");

    // Another user's key is refused.
    let stranger = nkeys::KeyPair::new_user();
    std::fs::write(&seed_file, stranger.seed().expect("seed")).expect("write seed");
    let err = connect_client(&c).await.expect_err("unknown nkey");
    assert_eq!(failure(&err), Some(ConnectFailure::Refused), "{err}");
}

#[tokio::test]
async fn the_inbox_prefix_carries_replies() {
    let server = NatsServer::start().await;
    let mut c = config(server.url());
    c.nats.inbox_prefix = "_KEDGE_INBOX.w1".into();
    let client = connect_client(&c).await.expect("connects");
    let mut requests = client.subscribe("svc.echo").await.expect("subscribe");
    let responder = client.clone();
    let serve = tokio::spawn(async move {
        use futures::StreamExt;
        let msg = requests.next().await.expect("a request");
        let reply = msg.reply.expect("a reply subject");
        responder
            .publish(reply.clone(), reply.as_str().to_owned().into())
            .await
            .expect("reply");
    });
    let answer = client
        .request("svc.echo", "hi".into())
        .await
        .expect("answered");
    let reply_subject = String::from_utf8_lossy(&answer.payload).into_owned();
    assert!(
        reply_subject.starts_with(&format!("{}.", c.inbox_prefix())),
        "{reply_subject}"
    );
    serve.await.expect("responder");
}

#[tokio::test]
async fn an_unreachable_server_is_retried_then_reported() {
    let port = kedge_testkit::free_port();
    let mut c = config(format!("nats://kedge:secret-pass-9@127.0.0.1:{port}"));
    c.nats.connect_wait_ms = 600;
    let started = Instant::now();
    let err = connect_client(&c).await.expect_err("nobody listens");
    assert!(started.elapsed() >= Duration::from_millis(300), "retried");
    assert_eq!(failure(&err), Some(ConnectFailure::Unreachable), "{err}");
    let text = err.to_string();
    assert!(!text.contains("secret-pass-9"), "{text}");
    assert!(text.contains("<redacted>@127.0.0.1"), "{text}");
}

/// A nats-server that requires a token, spawned here (see the module doc); killed on drop.
struct TokenServer {
    child: Child,
    _dir: tempfile::TempDir,
    port: u16,
}

impl TokenServer {
    fn start(token: &str) -> TokenServer {
        let dir = tempfile::tempdir().expect("tempdir");
        let port = kedge_testkit::free_port();
        let conf = dir.path().join("nats.conf");
        std::fs::write(
            &conf,
            format!(
                "listen: 127.0.0.1:{port}\nlog_file: \"{}\"\nauthorization {{ token: \"{token}\" }}\n",
                dir.path().join("nats.log").display()
            ),
        )
        .expect("write conf");
        let child = Command::new(kedge_testkit::nats_server_binary())
            .arg("-c")
            .arg(&conf)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn nats-server");
        TokenServer {
            child,
            _dir: dir,
            port,
        }
    }
}

impl Drop for TokenServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test]
async fn a_token_authenticates_and_a_wrong_one_is_refused() {
    let server = TokenServer::start("the-token-0123");
    let mut c = config(format!("nats://127.0.0.1:{}", server.port));
    // Retried while the server starts.
    c.nats.connect_wait_ms = 15_000;
    c.nats.token = Some(Secret::new("the-token-0123"));
    let client = connect_client(&c).await.expect("connects with the token");
    client.flush().await.expect("flush");

    c.nats.token = Some(Secret::new("not-the-token"));
    let err = connect_client(&c).await.expect_err("wrong token");
    assert_eq!(failure(&err), Some(ConnectFailure::Refused), "{err}");
    assert!(!format!("{err} {err:?}").contains("not-the-token"));

    // As URL user info.
    let c = config(format!("nats://the-token-0123@127.0.0.1:{}", server.port));
    connect_client(&c)
        .await
        .expect("connects with the URL token");
}

use kedge_testkit::tls::Pki;

#[tokio::test]
async fn tls_with_a_client_certificate_connects_and_without_one_is_refused() {
    let dir = tempfile::tempdir().expect("tempdir");
    let pki = Pki::generate(dir.path());
    let quote = |p: &Path| format!("\"{}\"", p.display());
    // allow_non_tls: the testkit's readiness probe connects in plain text; every client below
    // requires TLS, which the server then verifies (client certificate required).
    let server = NatsServer::start_with(ServerOptions {
        extra_config: format!(
            "tls {{\n  cert_file: {}\n  key_file: {}\n  ca_file: {}\n  verify: true\n}}\n\
             allow_non_tls: true\n",
            quote(&pki.server_cert),
            quote(&pki.server_key),
            quote(&pki.ca),
        ),
        ..Default::default()
    })
    .await;

    let mut c = config(server.url());
    c.nats.tls_ca = Some(pki.ca.clone());
    c.nats.tls_cert = Some(pki.client_cert.clone());
    c.nats.tls_key = Some(pki.client_key.clone());
    let client = connect_client(&c).await.expect("connects over TLS");
    client.flush().await.expect("flush");

    // Without a client certificate the server ends the handshake.
    c.nats.tls_cert = None;
    c.nats.tls_key = None;
    c.nats.connect_wait_ms = 500;
    let err = connect_client(&c).await.expect_err("no client certificate");
    assert_eq!(failure(&err), Some(ConnectFailure::Tls), "{err}");

    // A server certificate from an unknown CA is not trusted.
    let other = tempfile::tempdir().expect("tempdir");
    let stranger = Pki::generate(other.path());
    let mut c = config(server.url());
    c.nats.tls_ca = Some(stranger.ca);
    c.nats.tls_cert = Some(pki.client_cert);
    c.nats.tls_key = Some(pki.client_key);
    let err = connect_client(&c).await.expect_err("untrusted server");
    assert_eq!(failure(&err), Some(ConnectFailure::Tls), "{err}");
}
