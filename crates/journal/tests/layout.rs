//! The broker layout: created from the embedded files, verified, never silently changed.

#![allow(clippy::unwrap_used)]

use kedge_journal::{LAYOUT, LayoutError, LayoutOptions, ensure_layout, verify_layout};
use kedge_testkit::NatsServer;

#[tokio::test]
async fn ensure_layout_twice_is_idempotent() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    let first = ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    assert_eq!(first.created.len(), LAYOUT.len(), "{first:?}");
    assert!(first.verified.is_empty());
    assert!(first.api_level >= 4);
    let second = ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    assert!(second.created.is_empty(), "{second:?}");
    assert_eq!(second.verified.len(), LAYOUT.len());

    // The buckets are usable as KV / object stores by the usual clients.
    let js = async_nats::jetstream::new(client);
    let kv = js.get_key_value("kedge_agents").await.unwrap();
    kv.put("bot", "v1".into()).await.unwrap();
    kv.put("bot", "v2".into()).await.unwrap();
    assert_eq!(kv.history("bot").await.map(|_| ()).ok(), Some(()));
    let blobs = js.get_object_store("kedge_blobs").await.unwrap();
    blobs
        .put("sha256-x", &mut &b"big payload"[..])
        .await
        .unwrap();
}

#[tokio::test]
async fn verify_layout_creates_nothing_and_names_what_is_missing() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    // A server without Kedge: refused, and left without a single stream.
    let err = verify_layout(&client, &LayoutOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, LayoutError::Missing { .. }), "{err:?}");
    assert!(err.to_string().contains("kedge layout"), "{err}");
    let names = client
        .request("$JS.API.STREAM.NAMES", "".into())
        .await
        .unwrap();
    let names: serde_json::Value = serde_json::from_slice(&names.payload).unwrap();
    assert_eq!(names["total"], 0, "{names}");
    // Once created, verified without change.
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let report = verify_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    assert!(report.created.is_empty());
    assert_eq!(report.verified.len(), LAYOUT.len());
}

async fn stream_config(client: &async_nats::Client, stream: &str) -> serde_json::Value {
    let info = client
        .request(format!("$JS.API.STREAM.INFO.{stream}"), "".into())
        .await
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.payload).unwrap();
    info["config"].clone()
}

/// `stream` as an operator might have created it by hand: its layout file changed by `edit`.
async fn precreated(stream: &str, edit: impl FnOnce(&mut serde_json::Value)) -> LayoutError {
    let server = NatsServer::start().await;
    let client = server.client().await;
    let (_, json) = LAYOUT.iter().find(|(n, _)| *n == stream).unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(json).unwrap();
    edit(&mut cfg);
    let created = client
        .request(
            format!("$JS.API.STREAM.CREATE.{stream}"),
            serde_json::to_vec(&cfg).unwrap().into(),
        )
        .await
        .unwrap();
    let created: serde_json::Value = serde_json::from_slice(&created.payload).unwrap();
    assert!(created.get("error").is_none(), "{created}");
    let before = stream_config(&client, stream).await;
    let err = ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap_err();
    // And it was not "fixed".
    assert_eq!(stream_config(&client, stream).await, before);
    err
}

/// `stream` as an operator might have created it by hand, without `flag`.
async fn precreated_without(stream: &str, flag: &str) -> LayoutError {
    precreated(stream, |cfg| {
        cfg.as_object_mut().unwrap().remove(flag);
    })
    .await
}

#[tokio::test]
async fn a_journal_stream_without_atomic_batches_is_refused_naming_the_flag() {
    let err = precreated_without("KEDGE_RUNS", "allow_atomic").await;
    match &err {
        LayoutError::Mismatch { stream, field, .. } => {
            assert_eq!(stream, "KEDGE_RUNS");
            assert_eq!(field, "allow_atomic");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    assert!(err.to_string().contains("allow_atomic"), "{err}");
}

#[tokio::test]
async fn a_timer_stream_without_schedules_is_refused_naming_the_flag() {
    let err = precreated_without("KEDGE_TIMERS", "allow_msg_schedules").await;
    match &err {
        LayoutError::Mismatch { stream, field, .. } => {
            assert_eq!(stream, "KEDGE_TIMERS");
            assert_eq!(field, "allow_msg_schedules");
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
    assert!(err.to_string().contains("allow_msg_schedules"), "{err}");
}

/// A journal created with schedules (as Kedge's own file once did) has rollups forced on by the
/// server: anyone who may publish under `agent.run.>` could purge a run with `Nats-Rollup`.
#[tokio::test]
async fn a_journal_stream_that_accepts_rollups_is_refused() {
    let err = precreated("KEDGE_RUNS", |cfg| {
        cfg["allow_msg_schedules"] = true.into();
    })
    .await;
    match &err {
        LayoutError::Mismatch {
            stream,
            field,
            expected,
            found,
        } => {
            assert_eq!(stream, "KEDGE_RUNS");
            assert_eq!(field, "allow_rollup_hdrs");
            assert_eq!((expected.as_str(), found.as_str()), ("false", "true"));
        }
        other => panic!("expected a mismatch, got {other:?}"),
    }
}

/// What the server really has after creating the layout: the flags the timers rely on are set
/// (a server that silently dropped them would fail the layout check), the journal takes no
/// rollups, and the timer stream is never trimmed.
#[tokio::test]
async fn the_created_streams_really_have_the_flags() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let timers = stream_config(&client, "KEDGE_TIMERS").await;
    assert_eq!(timers["allow_msg_schedules"], true, "{timers}");
    assert_eq!(timers["allow_msg_ttl"], true, "{timers}");
    assert_eq!(timers["max_age"], 0, "{timers}");
    assert_eq!(timers["storage"], "file", "{timers}");
    let runs = stream_config(&client, "KEDGE_RUNS").await;
    assert_ne!(runs["allow_msg_schedules"], true, "{runs}");
    assert_ne!(runs["allow_rollup_hdrs"], true, "{runs}");
    assert_eq!(runs["allow_atomic"], true, "{runs}");
    // The journal refuses a rollup: nobody can purge a run by publishing.
    let mut headers = async_nats::HeaderMap::new();
    headers.insert("Nats-Rollup", "sub");
    let answer = client
        .request_with_headers("agent.run.run_x.i.nudge", headers, "{}".into())
        .await
        .unwrap();
    let answer: serde_json::Value = serde_json::from_slice(&answer.payload).unwrap();
    assert!(answer.get("error").is_some(), "{answer}");
}

/// nats-server 2.15 caps every stream at 1000 consumers unless the stream sets its own limit
/// (-1 is replaced by the default). Every live tail is an ordered consumer on KEDGE_RUNS that
/// lingers 30 s after it is dropped, so the journal stream sets a higher limit explicitly.
#[tokio::test]
async fn the_journal_stream_allows_more_than_the_default_1000_consumers() {
    let server = NatsServer::start().await;
    let client = server.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client);
    let stream = js.get_stream_no_info("KEDGE_RUNS").await.unwrap();
    let creates = (0..1100).map(|i| {
        let stream = stream.clone();
        async move {
            stream
                .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                    filter_subject: format!("agent.run.run_{i}.>"),
                    ..Default::default()
                })
                .await
                .map(|_| ())
        }
    });
    let results = futures::future::join_all(creates).await;
    let failed: Vec<String> = results
        .into_iter()
        .filter_map(|r| r.err().map(|e| e.to_string()))
        .collect();
    assert!(
        failed.is_empty(),
        "{} failed: {:?}",
        failed.len(),
        failed.first()
    );
}
