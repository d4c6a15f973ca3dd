//! An agent revision read back carries what every step of its runs checks and uses: its digests
//! and its tool contract, computed once per revision, and an older revision keeps its own after
//! the agent is edited; the latest revision, asked for every task, is parsed once as well.

use std::sync::Arc;

use kedge_core::agent::AgentDefinition;
use kedge_core::tools::Contract;
use kedge_journal::{LayoutOptions, ensure_layout};
use kedge_runtime::agents::AgentStore;
use kedge_testkit::NatsServer;

fn definition(prompt: &str, tools: &[&str]) -> AgentDefinition {
    let def = serde_json::json!({
        "name": "rev",
        "system_prompt": prompt,
        "model": {"provider": "openai", "name": "gpt-mock"},
        "tools": tools,
    });
    AgentDefinition::parse(def.to_string().as_bytes()).expect("valid agent")
}

#[tokio::test]
async fn a_revision_carries_its_digests_and_one_contract() {
    let server = NatsServer::start().await;
    let client = async_nats::connect(server.url()).await.expect("connects");
    ensure_layout(&client, &LayoutOptions::default())
        .await
        .expect("layout");
    let js = async_nats::jetstream::new(client.clone());
    let store = AgentStore::new(js.get_key_value("kedge_agents").await.expect("bucket"));
    let first = definition("Be brief.", &["read_file"]);
    let second = definition("Be thorough.", &["read_file", "write_file"]);
    let r1 = store.put(&first).await.expect("stored");
    let r2 = store.put(&second).await.expect("stored");
    // A fresh store reads them from the bucket; the first read of each is cached.
    let fresh = AgentStore::new(js.get_key_value("kedge_agents").await.expect("bucket"));
    for (revision, def) in [(r1, &first), (r2, &second)] {
        let got = fresh.revision(&def.name, revision).await.expect("revision");
        assert_eq!(*got.def, *def);
        assert_eq!(*got.prompt_digest(), def.prompt_digest());
        assert_eq!(*got.tools_digest(), def.tools_digest());
        let again = fresh.revision(&def.name, revision).await.expect("revision");
        assert!(Arc::ptr_eq(&got, &again), "read once");
        assert!(Arc::ptr_eq(&got.contract(), &again.contract()));
        assert!(Arc::ptr_eq(&got.contract(), &Contract::of(def)));
    }
    let old = fresh.revision(&first.name, r1).await.expect("r1");
    let new = fresh.revision(&first.name, r2).await.expect("r2");
    assert_ne!(old.tools_digest(), new.tools_digest());
    // The latest revision, asked per task, is parsed once too: the same definition back while
    // the agent is not edited, the new one once it is.
    let latest = AgentStore::new(js.get_key_value("kedge_agents").await.expect("bucket"));
    let (rev, a) = latest.latest(&first.name).await.expect("latest");
    let (again, b) = latest.latest(&first.name).await.expect("latest");
    assert_eq!((rev, again), (r2, r2));
    assert!(Arc::ptr_eq(&a, &b), "parsed once");
    let third = definition("Be kind.", &["read_file"]);
    let r3 = store.put(&third).await.expect("stored");
    let (rev, c) = latest.latest(&first.name).await.expect("latest");
    assert_eq!(rev, r3);
    assert_eq!(*c, third);
    drop(server);
}
