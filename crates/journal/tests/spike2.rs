#![allow(clippy::unwrap_used)]
use async_nats::HeaderMap;
use futures::StreamExt;
use std::time::{Duration, Instant};

async fn dget(client: &async_nats::Client, stream: &str, subj: &str) -> async_nats::Message {
    client
        .request(format!("$JS.API.DIRECT.GET.{stream}"), format!(r#"{{"last_by_subj":"{subj}"}}"#).into())
        .await
        .unwrap()
}

#[tokio::test]
async fn spike2() {
    let server = kedge_testkit::NatsServer::start().await;
    let client = server.client().await;
    let cfg = serde_json::json!({"name":"R","subjects":["agent.run.>"],"retention":"limits","storage":"file","allow_rollup_hdrs":false,"allow_direct":true});
    let r = client.request("$JS.API.STREAM.CREATE.R", serde_json::to_vec(&cfg).unwrap().into()).await.unwrap();
    println!("create R: {}", String::from_utf8_lossy(&r.payload));
    let kv = serde_json::json!({"name":"KV_L","subjects":["$KV.L.>"],"retention":"limits","storage":"file","max_msgs_per_subject":1,"discard":"new","allow_rollup_hdrs":true,"deny_delete":true,"allow_direct":true,"allow_msg_ttl":true,"subject_delete_marker_ttl":2_000_000_000u64, "duplicate_window":120_000_000_000u64});
    let r = client.request("$JS.API.STREAM.CREATE.KV_L", serde_json::to_vec(&kv).unwrap().into()).await.unwrap();
    println!("create KV: {}", String::from_utf8_lossy(&r.payload));
    let pubttl = |exp: u64, ttl: &str| {
        let mut h = HeaderMap::new();
        h.insert("Nats-TTL", ttl);
        h.insert("Nats-Expected-Last-Subject-Sequence", exp.to_string().as_str());
        h
    };
    let r = client.request_with_headers("$KV.L.k", pubttl(0, "1s"), "owner-a".into()).await.unwrap();
    println!("acquire: {}", String::from_utf8_lossy(&r.payload));
    let r = client.request_with_headers("$KV.L.k", pubttl(0, "1s"), "owner-b".into()).await.unwrap();
    println!("acquire b (held): {}", String::from_utf8_lossy(&r.payload));
    let t = Instant::now();
    loop {
        let m = dget(&client, "KV_L", "$KV.L.k").await;
        let h = m.headers.clone().unwrap_or_default();
        if h.get("Nats-Marker-Reason").is_some() || m.status.is_some() {
            println!("after {:?}: status={:?} hdrs={:?} payload={:?}", t.elapsed(), m.status, m.headers, m.payload);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let m = dget(&client, "KV_L", "$KV.L.k").await;
    let seq: u64 = m.headers.as_ref().unwrap().get("Nats-Sequence").unwrap().as_str().parse().unwrap();
    let r = client.request_with_headers("$KV.L.k", pubttl(seq, "1s"), "owner-b".into()).await.unwrap();
    println!("acquire over marker: {}", String::from_utf8_lossy(&r.payload));
    // wait for marker expiry: expire b (1s) then marker 2s
    tokio::time::sleep(Duration::from_millis(3500)).await;
    let m = dget(&client, "KV_L", "$KV.L.k").await;
    println!("after marker ttl: status={:?} hdrs={:?}", m.status, m.headers);
    // DEL with ttl
    let r = client.request_with_headers("$KV.L.k2", pubttl(0, "60s"), "owner-c".into()).await.unwrap();
    println!("k2: {}", String::from_utf8_lossy(&r.payload));
    let mut h = pubttl(serde_json::from_slice::<serde_json::Value>(&r.payload).unwrap()["seq"].as_u64().unwrap(), "1s");
    h.insert("KV-Operation", "DEL");
    let r = client.request_with_headers("$KV.L.k2", h, "".into()).await.unwrap();
    println!("k2 del: {}", String::from_utf8_lossy(&r.payload));
    tokio::time::sleep(Duration::from_millis(1600)).await;
    let m = dget(&client, "KV_L", "$KV.L.k2").await;
    println!("k2 after del ttl: status={:?} hdrs={:?}", m.status, m.headers);
    // ttl 0s?
    let r = client.request_with_headers("$KV.L.k3", pubttl(0, "0s"), "x".into()).await.unwrap();
    println!("ttl 0s: {}", String::from_utf8_lossy(&r.payload));

    // read perf: 50 events
    for i in 0..50 {
        let r = client.request(format!("agent.run.a.d.e{i}"), vec![b'x'; 300].into()).await.unwrap();
        assert!(!r.payload.is_empty());
    }
    for i in 0..50 {
        client.request(format!("agent.run.b.d.e{i}"), vec![b'x'; 300].into()).await.unwrap();
    }
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream("R").await.unwrap();
    let mut times = vec![];
    for _ in 0..300 {
        let t = Instant::now();
        let c = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                filter_subject: "agent.run.a.>".into(),
                deliver_policy: async_nats::jetstream::consumer::DeliverPolicy::ByStartSequence { start_sequence: 1 },
                ..Default::default()
            })
            .await
            .unwrap();
        let mut msgs = c.messages().await.unwrap();
        let mut n = 0;
        while let Some(m) = msgs.next().await {
            let m = m.unwrap();
            n += 1;
            if m.info().unwrap().pending == 0 {
                break;
            }
        }
        assert_eq!(n, 50);
        times.push(t.elapsed());
    }
    times.sort();
    println!("ordered consumer: p50 {:?} p99 {:?}", times[150], times[297]);
    let mut times = vec![];
    for _ in 0..300 {
        let t = Instant::now();
        let inbox = client.new_inbox();
        let mut sub = client.subscribe(inbox.clone()).await.unwrap();
        client
            .publish_with_reply("$JS.API.DIRECT.GET.R", inbox, r#"{"seq":1,"next_by_subj":"agent.run.a.>","batch":256}"#.into())
            .await
            .unwrap();
        let mut n = 0;
        while let Some(m) = sub.next().await {
            if m.status.is_some() {
                break;
            }
            n += 1;
        }
        assert_eq!(n, 50);
        times.push(t.elapsed());
    }
    times.sort();
    println!("direct batch: p50 {:?} p99 {:?}", times[150], times[297]);
}
