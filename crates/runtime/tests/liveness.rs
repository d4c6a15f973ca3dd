//! The failure detector against a real nats-server: what is held is announced, a process whose
//! connection closes is found gone with what it held, and two processes wrongly sharing a
//! worker id notice it.

use std::time::Duration;

use kedge_core::ids::RunId;
use kedge_runtime::liveness::{Liveness, Verdict, ping};
use kedge_testkit::NatsServer;

const BEAT: Duration = Duration::from_millis(50);
const SUSPECT: Duration = Duration::from_millis(150);

async fn client(server: &NatsServer) -> async_nats::Client {
    async_nats::connect(server.url()).await.expect("connects")
}

fn worker(name: &str) -> kedge_core::ids::WorkerId {
    name.parse().expect("worker id")
}

#[tokio::test]
async fn a_closed_connection_is_gone_with_what_it_held() {
    let server = NatsServer::start().await;
    let watcher = Liveness::start(client(&server).await, &worker("w-watch"), BEAT, SUSPECT)
        .await
        .expect("starts");
    let mut deaths = watcher.deaths();
    let doomed_client = client(&server).await;
    let doomed = Liveness::start(doomed_client.clone(), &worker("w-doomed"), BEAT, SUSPECT)
        .await
        .expect("starts");
    let run = RunId::generate();
    let _hold = doomed.hold_run(&run).await;
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(
        ping(&doomed_client, &worker("w-doomed"), SUSPECT).await,
        Verdict::Alive
    );
    // The process's connection closes (what a kill -9 does to it): the server drops its
    // subscriptions, and its heartbeats stop.
    doomed_client.drain().await.expect("drained");
    std::mem::forget(_hold);
    std::mem::forget(doomed);
    let death = tokio::time::timeout(Duration::from_secs(10), deaths.recv())
        .await
        .expect("found gone in time")
        .expect("a death");
    assert_eq!(death.worker.as_str(), "w-doomed");
    assert_eq!(death.held.runs, vec![run]);
    assert!(watcher.id_is_unique());
}

#[tokio::test]
async fn two_live_processes_sharing_a_worker_id_notice_it() {
    let server = NatsServer::start().await;
    let alone = Liveness::start(client(&server).await, &worker("w-alone"), BEAT, SUSPECT)
        .await
        .expect("starts");
    let a = Liveness::start(client(&server).await, &worker("w-same"), BEAT, SUSPECT)
        .await
        .expect("starts");
    let b = Liveness::start(client(&server).await, &worker("w-same"), BEAT, SUSPECT)
        .await
        .expect("starts");
    tokio::time::sleep(Duration::from_millis(400)).await;
    assert!(!a.id_is_unique() && !b.id_is_unique());
    assert!(alone.id_is_unique(), "its own heartbeats are not another's");
    // The other one goes away (a rolling restart that overlapped): once it has been silent long
    // enough, the id is this process's alone again.
    drop(b);
    let silence = SUSPECT * kedge_runtime::liveness::SHARED_ID_SILENCE;
    tokio::time::sleep(silence + Duration::from_millis(500)).await;
    assert!(
        a.id_is_unique(),
        "the other has been silent for {silence:?}"
    );
}

/// A run held again within a heartbeat interval of its release is not announced again (every
/// heartbeat since still lists it); a run not held lately is, at once.
#[tokio::test]
async fn a_run_held_again_right_after_its_release_is_not_announced_again() {
    let server = NatsServer::start().await;
    let watch = client(&server).await;
    let mut beats = watch.subscribe("kedge.live.hb.w-again").await.expect("sub");
    watch.flush().await.expect("flush");
    let live = Liveness::start(
        client(&server).await,
        &worker("w-again"),
        Duration::from_secs(30),
        Duration::from_secs(60),
    )
    .await
    .expect("starts");
    let first = next_beat(&mut beats).await.expect("the first full beat");
    assert!(first.get("added").is_none(), "{first}");
    let run = RunId::generate();
    let hold = live.hold_run(&run).await;
    let added = next_beat(&mut beats).await.expect("announced");
    assert_eq!(added["added"], true);
    assert_eq!(added["runs"][0], run.as_str());
    drop(hold);
    let _again = live.hold_run(&run).await;
    assert_eq!(next_beat(&mut beats).await, None, "not announced twice");
    let other = RunId::generate();
    let _other = live.hold_run(&other).await;
    let added = next_beat(&mut beats).await.expect("another run is");
    assert_eq!(added["runs"][0], other.as_str());
}

/// The next message on a heartbeat subscription within half a second, parsed.
async fn next_beat(beats: &mut async_nats::Subscriber) -> Option<serde_json::Value> {
    tokio::time::timeout(Duration::from_millis(500), futures::StreamExt::next(beats))
        .await
        .ok()
        .flatten()
        .map(|m| serde_json::from_slice(&m.payload).expect("JSON"))
}
