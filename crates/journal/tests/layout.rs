//! The broker layout: created from the embedded files, verified, never silently changed.

#![allow(clippy::unwrap_used)]

use kedge_journal::{LAYOUT, LayoutError, LayoutOptions, ensure_layout};
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

/// KEDGE_RUNS as an operator might have created it by hand, without `flag`.
async fn precreated_runs_without(flag: &str) -> LayoutError {
    let server = NatsServer::start().await;
    let client = server.client().await;
    let (_, json) = LAYOUT.iter().find(|(n, _)| *n == "KEDGE_RUNS").unwrap();
    let mut cfg: serde_json::Value = serde_json::from_str(json).unwrap();
    cfg.as_object_mut().unwrap().remove(flag);
    let created = client
        .request(
            "$JS.API.STREAM.CREATE.KEDGE_RUNS",
            serde_json::to_vec(&cfg).unwrap().into(),
        )
        .await
        .unwrap();
    let created: serde_json::Value = serde_json::from_slice(&created.payload).unwrap();
    assert!(created.get("error").is_none(), "{created}");
    let err = ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap_err();
    // And it was not "fixed".
    let info = client
        .request("$JS.API.STREAM.INFO.KEDGE_RUNS", "".into())
        .await
        .unwrap();
    let info: serde_json::Value = serde_json::from_slice(&info.payload).unwrap();
    assert_ne!(info["config"][flag], serde_json::Value::Bool(true));
    err
}

#[tokio::test]
async fn a_journal_stream_without_atomic_batches_is_refused_naming_the_flag() {
    let err = precreated_runs_without("allow_atomic").await;
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
async fn a_journal_stream_without_schedules_is_refused_naming_the_flag() {
    let err = precreated_runs_without("allow_msg_schedules").await;
    assert!(
        matches!(&err, LayoutError::Mismatch { field, .. } if field == "allow_msg_schedules"),
        "{err:?}"
    );
    assert!(err.to_string().contains("allow_msg_schedules"), "{err}");
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
