//! The light lane of a process (docs/ARCHITECTURE.md "Fairness across tenants"): a second
//! connection to the broker and threads of its own, opened once and shared by every clone of the
//! runtime, working like the first; none when `light_lane` is off.

use kedge_runtime::{Config, Runtime};
use kedge_testkit::NatsServer;

fn config(url: String, light_lane: bool) -> Config {
    Config {
        nats_urls: vec![url],
        light_lane,
        ..Config::default()
    }
}

#[tokio::test]
async fn the_light_lane_is_a_second_connection_with_threads_of_its_own() {
    let server = NatsServer::start().await;
    let rt = Runtime::connect(config(server.url(), true))
        .await
        .expect("connects");
    let light = rt
        .light_lane()
        .await
        .expect("opens")
        .expect("on by default");
    // Another connection: the server tells them apart.
    let id = |r: &Runtime| r.client.server_info().client_id;
    assert_ne!(id(&light), id(&rt), "a connection of its own");
    // One per process: every clone of the runtime gets the same one.
    let again = rt.clone().light_lane().await.expect("opens").expect("on");
    assert_eq!(id(&again), id(&light), "opened once");
    // The lane has no lane of its own; the first runtime spawns on the caller's threads.
    assert!(light.light_lane().await.expect("answers").is_none());
    assert!(rt.executor().is_none());
    // Its work runs on its own threads.
    let thread = light
        .executor()
        .expect("threads of its own")
        .spawn(async { std::thread::current().name().map(str::to_owned) })
        .await
        .expect("ran");
    assert_eq!(thread.as_deref(), Some("kedge-light"));
    // It works like the first: what one stores, the other reads.
    let def = kedge_core::agent::AgentDefinition::parse(
        serde_json::json!({
            "name": "lane",
            "system_prompt": "Be brief.",
            "model": {"provider": "openai", "name": "gpt-mock"},
        })
        .to_string()
        .as_bytes(),
    )
    .expect("valid agent");
    let revision = rt.agents.put(&def).await.expect("stored");
    let (read, _) = light
        .agents
        .latest(&def.name)
        .await
        .expect("read over the light lane");
    assert_eq!(read, revision);

    // Off: one connection per process.
    let off = Runtime::connect(config(server.url(), false))
        .await
        .expect("connects");
    assert!(off.light_lane().await.expect("answers").is_none());
}
