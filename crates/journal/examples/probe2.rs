#![allow(clippy::unwrap_used)]
use kedge_journal::{LayoutOptions, ensure_layout};
#[tokio::main]
async fn main() {
    let s = kedge_testkit::NatsServer::start().await;
    let client = s.client().await;
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .unwrap();
    let js = async_nats::jetstream::new(client.clone());
    let stream = js.get_stream_no_info("KEDGE_RUNS").await.unwrap();
    for i in 0..2000 {
        let r = stream
            .create_consumer(async_nats::jetstream::consumer::pull::OrderedConfig {
                filter_subject: "agent.run.x.>".into(),
                ..Default::default()
            })
            .await;
        if let Err(e) = r {
            println!("failed at {i}: {e}");
            break;
        }
    }
    let info = client
        .request("$JS.API.STREAM.INFO.KEDGE_RUNS", "".into())
        .await
        .unwrap();
    let v: serde_json::Value = serde_json::from_slice(&info.payload).unwrap();
    println!(
        "consumers {} cfg max_consumers {}",
        v["state"]["consumer_count"], v["config"]["max_consumers"]
    );
    let acc = client.request("$JS.API.INFO", "".into()).await.unwrap();
    println!("{}", String::from_utf8_lossy(&acc.payload));
}
