#![allow(clippy::unwrap_used)]
use async_nats::HeaderMap;
use futures::StreamExt;
use std::time::Duration;

#[tokio::test]
async fn spike() {
    let server = kedge_testkit::NatsServer::start().await;
    let client = server.client().await;
    let info: serde_json::Value = serde_json::from_slice(
        &client.request("$JS.API.INFO", "".into()).await.unwrap().payload,
    )
    .unwrap();
    println!("INFO api: {}", info["api"]);
    let cfg = serde_json::json!({"name":"R","subjects":["agent.run.>"],"retention":"limits","storage":"file","allow_atomic":true,"allow_direct":true,"allow_msg_schedules":true,"duplicate_window":3600000000000u64});
    let r = client
        .request("$JS.API.STREAM.CREATE.R", serde_json::to_vec(&cfg).unwrap().into())
        .await
        .unwrap();
    println!("create: {}", String::from_utf8_lossy(&r.payload));

    // batch of 3, middle ones as requests too
    let inbox = client.new_inbox();
    let mut sub = client.subscribe(inbox.clone()).await.unwrap();
    for i in 1..=3u32 {
        let mut h = HeaderMap::new();
        h.insert("Nats-Batch-Id", "b1");
        h.insert("Nats-Batch-Sequence", i.to_string().as_str());
        h.insert("Nats-Msg-Id", format!("m{i}").as_str());
        if i == 1 {
            h.insert("Nats-Expected-Last-Subject-Sequence", "0");
            h.insert("Nats-Expected-Last-Subject-Sequence-Subject", "agent.run.a.d.>");
        }
        if i == 3 {
            h.insert("Nats-Batch-Commit", "1");
        }
        client
            .publish_with_reply_and_headers(format!("agent.run.a.d.x{i}"), inbox.clone(), h, "x".into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
            Ok(Some(m)) => println!(
                "batch1 reply: status={:?} hdr={:?} payload={}",
                m.status,
                m.headers,
                String::from_utf8_lossy(&m.payload)
            ),
            _ => break,
        }
    }
    // stale batch
    for i in 1..=3u32 {
        let mut h = HeaderMap::new();
        h.insert("Nats-Batch-Id", "b2");
        h.insert("Nats-Batch-Sequence", i.to_string().as_str());
        h.insert("Nats-Msg-Id", format!("n{i}").as_str());
        if i == 1 {
            h.insert("Nats-Expected-Last-Subject-Sequence", "0");
            h.insert("Nats-Expected-Last-Subject-Sequence-Subject", "agent.run.a.d.>");
        }
        if i == 3 {
            h.insert("Nats-Batch-Commit", "1");
        }
        client
            .publish_with_reply_and_headers(format!("agent.run.a.d.x{i}"), inbox.clone(), h, "x".into())
            .await
            .unwrap();
    }
    client.flush().await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
            Ok(Some(m)) => println!(
                "batch2 (stale) reply: status={:?} payload={}",
                m.status,
                String::from_utf8_lossy(&m.payload)
            ),
            _ => break,
        }
    }
    // retry of batch1 exactly (same msg ids, same expected 0) but new batch id
    for (bid, first_plain) in [("b1", true), ("b3", false)] {
        for i in 1..=3u32 {
            let mut h = HeaderMap::new();
            h.insert("Nats-Batch-Id", bid);
            h.insert("Nats-Batch-Sequence", i.to_string().as_str());
            h.insert("Nats-Msg-Id", format!("m{i}").as_str());
            if i == 1 {
                h.insert("Nats-Expected-Last-Subject-Sequence", "0");
                h.insert("Nats-Expected-Last-Subject-Sequence-Subject", "agent.run.a.d.>");
            }
            if i == 3 {
                h.insert("Nats-Batch-Commit", "1");
            }
            if i < 3 && first_plain {
                client.publish_with_headers(format!("agent.run.a.d.x{i}"), h, "x".into()).await.unwrap();
            } else {
                client
                    .publish_with_reply_and_headers(format!("agent.run.a.d.x{i}"), inbox.clone(), h, "x".into())
                    .await
                    .unwrap();
            }
        }
        client.flush().await.unwrap();
        loop {
            match tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
                Ok(Some(m)) => println!(
                    "retry {bid} reply: status={:?} payload={}",
                    m.status,
                    String::from_utf8_lossy(&m.payload)
                ),
                _ => break,
            }
        }
    }
    // fresh batch with only first message as no-reply, expected 3
    for i in 1..=4u32 {
        let mut h = HeaderMap::new();
        h.insert("Nats-Batch-Id", "b4");
        h.insert("Nats-Batch-Sequence", i.to_string().as_str());
        h.insert("Nats-Msg-Id", format!("p{i}").as_str());
        if i == 1 {
            h.insert("Nats-Expected-Last-Subject-Sequence", "3");
            h.insert("Nats-Expected-Last-Subject-Sequence-Subject", "agent.run.a.d.>");
        }
        if i == 4 {
            h.insert("Nats-Batch-Commit", "1");
            client
                .publish_with_reply_and_headers(format!("agent.run.a.d.x{i}"), inbox.clone(), h, "x".into())
                .await
                .unwrap();
        } else {
            client.publish_with_headers(format!("agent.run.a.d.x{i}"), h, "x".into()).await.unwrap();
        }
    }
    client.flush().await.unwrap();
    loop {
        match tokio::time::timeout(Duration::from_millis(500), sub.next()).await {
            Ok(Some(m)) => println!("b4 reply: status={:?} payload={}", m.status, String::from_utf8_lossy(&m.payload)),
            _ => break,
        }
    }
    // single publish with expected 0 after landed (retry) -> ?
    let mut h = HeaderMap::new();
    h.insert("Nats-Msg-Id", "m1");
    h.insert("Nats-Expected-Last-Subject-Sequence", "0");
    h.insert("Nats-Expected-Last-Subject-Sequence-Subject", "agent.run.a.d.>");
    let r = client.request_with_headers("agent.run.a.d.x1", h, "x".into()).await.unwrap();
    println!("single retry: {}", String::from_utf8_lossy(&r.payload));
    // input publish twice
    for _ in 0..2 {
        let mut h = HeaderMap::new();
        h.insert("Nats-Msg-Id", "in1");
        let r = client.request_with_headers("agent.run.a.i.user", h, "x".into()).await.unwrap();
        println!("input: {}", String::from_utf8_lossy(&r.payload));
    }
    // direct get last by wildcard subject via payload
    let r = client
        .request("$JS.API.DIRECT.GET.R", r#"{"last_by_subj":"agent.run.a.d.>"}"#.into())
        .await
        .unwrap();
    println!("direct last d: status={:?} hdr={:?}", r.status, r.headers);
    let r = client
        .request("$JS.API.DIRECT.GET.R", r#"{"last_by_subj":"agent.run.zz.d.>"}"#.into())
        .await
        .unwrap();
    println!("direct last none: status={:?} desc={:?} hdr={:?}", r.status, r.description, r.headers);
    // direct batch
    let inbox2 = client.new_inbox();
    let mut sub2 = client.subscribe(inbox2.clone()).await.unwrap();
    client
        .publish_with_reply("$JS.API.DIRECT.GET.R", inbox2.clone(), r#"{"seq":2,"next_by_subj":"agent.run.a.>","batch":3}"#.into())
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(Duration::from_millis(500), sub2.next()).await {
            Ok(Some(m)) => println!("dbatch: status={:?} desc={:?} hdr={:?} len={}", m.status, m.description, m.headers, m.payload.len()),
            _ => break,
        }
    }
    client
        .publish_with_reply("$JS.API.DIRECT.GET.R", inbox2.clone(), r#"{"seq":100,"next_by_subj":"agent.run.a.>","batch":3}"#.into())
        .await
        .unwrap();
    loop {
        match tokio::time::timeout(Duration::from_millis(500), sub2.next()).await {
            Ok(Some(m)) => println!("dbatch past end: status={:?} desc={:?} hdr={:?} len={}", m.status, m.description, m.headers, m.payload.len()),
            _ => break,
        }
    }
}
