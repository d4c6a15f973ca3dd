#![allow(clippy::unwrap_used)]
use std::time::Instant;

#[tokio::test]
async fn spike3() {
    let server = kedge_testkit::NatsServer::start().await;
    let client = server.client().await;
    let cfg = serde_json::json!({"name":"R","subjects":["agent.run.>"],"retention":"limits","storage":"file","allow_rollup_hdrs":false,"allow_direct":true,"allow_msg_schedules":true, "allow_atomic": true});
    let r = client.request("$JS.API.STREAM.CREATE.R", serde_json::to_vec(&cfg).unwrap().into()).await.unwrap();
    println!("create R: {}", String::from_utf8_lossy(&r.payload));
    let cfg = serde_json::json!({"name":"R2","subjects":["agent.x.>"],"retention":"limits","storage":"file","allow_direct":true});
    let r = client.request("$JS.API.STREAM.CREATE.R2", serde_json::to_vec(&cfg).unwrap().into()).await.unwrap();
    println!("create R2: {}", String::from_utf8_lossy(&r.payload));
    for i in 0..50 {
        client.request(format!("agent.run.a.d.e{i}"), vec![b'x'; 300].into()).await.unwrap();
        client.request(format!("agent.run.a.i.e{i}"), vec![b'x'; 300].into()).await.unwrap();
    }
    let r = client.request("$JS.API.STREAM.MSG.GET.R", r#"{"last_by_subj":"agent.run.a.d.>"}"#.into()).await.unwrap();
    println!("msg get: {}", String::from_utf8_lossy(&r.payload).chars().take(300).collect::<String>());
    let r = client.request("$JS.API.STREAM.MSG.GET.R", r#"{"last_by_subj":"agent.run.zz.d.>"}"#.into()).await.unwrap();
    println!("msg get none: {}", String::from_utf8_lossy(&r.payload));
    let r = client.request("$JS.API.STREAM.MSG.GET.NOPE", r#"{"last_by_subj":"agent.run.zz.d.>"}"#.into()).await;
    println!("msg get no stream: {:?}", r.map(|m| String::from_utf8_lossy(&m.payload).to_string()));
    let r = client.request("$JS.API.DIRECT.GET.NOPE", r#"{"last_by_subj":"agent.run.zz.d.>"}"#.into()).await;
    println!("direct get no stream: {:?}", r.map(|m| m.status));
    for (name, subj, body) in [
        ("direct", "$JS.API.DIRECT.GET.R", r#"{"last_by_subj":"agent.run.a.d.>"}"#),
        ("msgget", "$JS.API.STREAM.MSG.GET.R", r#"{"last_by_subj":"agent.run.a.d.>"}"#),
        ("msgget-noheaders", "$JS.API.STREAM.MSG.GET.R", r#"{"last_by_subj":"agent.run.a.d.>","no_hdr":true}"#),
    ] {
        let mut t = vec![];
        for _ in 0..1000 {
            let s = Instant::now();
            client.request(subj, body.into()).await.unwrap();
            t.push(s.elapsed());
        }
        t.sort();
        println!("{name}: p50 {:?} p99 {:?}", t[500], t[990]);
    }
}
