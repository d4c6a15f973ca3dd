//! The trust boundary on the broker, against a server running the secured configuration
//! (`kedge_runtime::secure`, what `kedge nats-config` writes): tenants in accounts of their own,
//! every Kedge service as its least-privilege user.
//!
//! A tenant's connection can do everything its runs need over NATS alone (submit, follow live and
//! from the start, answer, cancel, approve as an approver), and each thing it must not do is
//! refused by the server: proven both by the failed request and by the server's own permission
//! error naming the subject.

use crate::common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use async_nats::{Client, HeaderMap};
use common::{Harness, Svc, TENANTS, secured, tenant_password};
use futures::StreamExt;
use kedge_core::RunStatus;
use kedge_core::ids::RunId;
use kedge_core::subjects::SECRETS_STREAM;
use kedge_runtime::secure::Kind;
use serde_json::{Value, json};

const WAIT: Duration = Duration::from_secs(30);

/// A tenant's connection, with the server errors it received.
struct Tenant {
    client: Client,
    errors: Arc<Mutex<Vec<String>>>,
}

impl Tenant {
    async fn connect(h: &Harness, user: &str) -> Tenant {
        Self::login(h, user.to_owned(), tenant_password(user)).await
    }

    /// Connects as `user`, keeping the server errors the connection receives.
    async fn login(h: &Harness, user: String, password: String) -> Tenant {
        let errors = Arc::new(Mutex::new(Vec::new()));
        let seen = errors.clone();
        let client = async_nats::ConnectOptions::with_user_and_password(user, password)
            .request_timeout(Some(Duration::from_secs(2)))
            .event_callback(move |event| {
                let seen = seen.clone();
                async move {
                    if let async_nats::Event::ServerError(e) = event
                        && let Ok(mut v) = seen.lock()
                    {
                        v.push(e.to_string());
                    }
                }
            })
            .connect(h.nats.url())
            .await
            .expect("connects");
        Tenant { client, errors }
    }

    /// Waits until the server reported a permission violation naming `subject`.
    async fn refused(&self, subject: &str) -> bool {
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            let found = self.errors.lock().is_ok_and(|v| {
                v.iter()
                    .any(|e| e.contains("Permissions Violation") && e.contains(subject))
            });
            if found {
                return true;
            }
            let _ = self.client.flush().await;
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        false
    }

    /// A request that must be refused by the server: no answer, and a violation naming it.
    async fn assert_refused(&self, subject: &str, body: &str) {
        let answer = tokio::time::timeout(
            Duration::from_millis(300),
            self.client
                .request(subject.to_owned(), body.to_owned().into()),
        )
        .await;
        assert!(
            !matches!(answer, Ok(Ok(_))),
            "{subject} answered: {answer:?}"
        );
        assert!(
            self.refused(subject).await,
            "no permission violation for {subject}: {:?}",
            self.errors.lock().map(|v| v.clone())
        );
    }

    /// A gateway request; the JSON answer.
    async fn ask(&self, subject: &str, body: Value) -> Value {
        let reply = self
            .client
            .request(subject.to_owned(), body.to_string().into())
            .await
            .unwrap_or_else(|e| panic!("{subject}: {e}"));
        serde_json::from_slice(&reply.payload).expect("JSON answer")
    }

    /// Submits a task as a JetStream publish to `agent.task.<agent>`; the gateway's PubAck.
    async fn submit(&self, agent: &str, input: &str, key: &str) -> Value {
        self.submit_task(json!({"agent": agent, "input": input}), key)
            .await
    }

    /// Submits `task` (its `agent` names the subject) as a JetStream publish; the gateway's PubAck.
    async fn submit_task(&self, task: Value, key: &str) -> Value {
        let agent = task["agent"].as_str().expect("the task names its agent");
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", key);
        let body = task.to_string();
        let reply = self
            .client
            .request_with_headers(format!("agent.task.{agent}"), headers, body.into())
            .await
            .expect("the task is acknowledged");
        serde_json::from_slice(&reply.payload).expect("a PubAck")
    }

    /// For [`Tenant::follow`]: answers "yes" to each question `run` asks, as it is asked.
    fn answering(&self, run: &str) -> impl FnMut(&Value) + use<> {
        let (client, run) = (self.client.clone(), run.to_owned());
        move |e| {
            if e["type"] == "question.asked" {
                let q = e["data"]["question_id"]
                    .as_str()
                    .expect("question id")
                    .to_owned();
                let client = client.clone();
                let run = run.clone();
                tokio::spawn(async move {
                    client
                        .request(
                            format!("kedge.runs.{run}.answer.{q}"),
                            json!({"answer": "yes"}).to_string().into(),
                        )
                        .await
                        .expect("answered")
                });
            }
        }
    }

    /// Follows a run from `after` until the gateway ends the stream; the events and why it ended.
    async fn follow(
        &self,
        run: &str,
        after: u64,
        mut each: impl FnMut(&Value),
    ) -> (Vec<Value>, String) {
        let inbox = self.client.new_inbox();
        let mut sub = self
            .client
            .subscribe(inbox.clone())
            .await
            .expect("subscribe");
        self.client
            .publish_with_reply(
                format!("kedge.runs.{run}.follow"),
                inbox,
                json!({"after": after}).to_string().into(),
            )
            .await
            .expect("follow");
        let mut events = Vec::new();
        loop {
            let msg = tokio::time::timeout(WAIT, sub.next())
                .await
                .expect("the follow goes on")
                .expect("subscription open");
            if let Some(end) = msg.headers.as_ref().and_then(|h| h.get("Kedge-End")) {
                return (events, end.to_string());
            }
            let v: Value = serde_json::from_slice(&msg.payload).expect("event JSON");
            if let Some(status) = v["error"]["status"].as_u64() {
                return (events, format!("error {status}"));
            }
            each(&v);
            events.push(v);
        }
    }
}

fn script() -> Value {
    json!({"models": {
        "asker": {"steps": [
            {"text": "asking", "tool_calls": [{"name": "ask_user", "arguments": {"question": "Proceed?"}}]},
            {"text": "done"}
        ]},
        "payer": {"steps": [
            {"text": "paying", "tool_calls": [{"name": "ledger_append", "arguments": {"text": "pay 7"}}]},
            {"text": "paid"}
        ]}
    }})
}

async fn harness() -> Option<Harness> {
    if !secured() {
        eprintln!("KEDGE_TEST_OPEN is set: the boundary tests need the secured server; skipped");
        return None;
    }
    let h = Harness::start(script(), &[Svc::Intake, Svc::Step, Svc::Tool, Svc::Gateway]).await;
    h.agent("asker", "asker").await;
    h.agent_with_policy(
        "payer",
        "payer",
        json!({"ledger_append": {"approval": "always"}}),
    )
    .await;
    // The gateway subscribes in the background: wait until it answers.
    let probe = Tenant::connect(&h, TENANTS[0].1).await;
    let deadline = Instant::now() + WAIT;
    while probe
        .client
        .request("kedge.runs.run_probe", "{}".into())
        .await
        .is_err()
    {
        assert!(Instant::now() < deadline, "the gateway never answered");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    Some(h)
}

fn run_id(ack: &Value) -> String {
    ack["run_id"]
        .as_str()
        .expect("run id in the ack")
        .to_owned()
}

#[tokio::test]
async fn a_tenant_runs_an_agent_end_to_end_over_nats_alone() {
    let Some(h) = harness().await else { return };
    let (tenant, user, approver) = TENANTS[0];
    let acme = Tenant::connect(&h, user).await;

    let ack = acme.submit("asker", "go", "acme-key-1").await;
    assert_eq!(ack["stream"], "KEDGE_TASKS", "{ack}");
    assert_eq!(ack["duplicate"], false);
    let run = run_id(&ack);
    // The same key again: the same run, acknowledged as a duplicate.
    let again = acme.submit("asker", "go", "acme-key-1").await;
    assert_eq!(run_id(&again), run);
    assert_eq!(again["duplicate"], true);

    // Follow live: answer the question as soon as it is asked; the stream ends when the run does.
    let (live, why) = acme.follow(&run, 0, acme.answering(&run)).await;
    assert_eq!(why, "finished");
    let types: Vec<&str> = live.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(types.first(), Some(&"run.created"));
    assert!(types.contains(&"question.answered"), "{types:?}");
    assert_eq!(types.last(), Some(&"run.succeeded"), "{types:?}");
    let run_parsed: RunId = run.parse().expect("run id");
    let state = h.state(&run_parsed).await;
    assert_eq!(state.status, RunStatus::Succeeded);
    assert_eq!(
        state.bundle.tenant.as_str(),
        tenant,
        "the tenant is the account's"
    );
    assert_eq!(state.bundle.caller.as_deref(), Some("acme/acme-app"));

    // From the start again, and as history pages: the same events in the same order.
    let (replayed, why) = acme.follow(&run, 0, |_| {}).await;
    assert_eq!(why, "finished");
    let seqs = |v: &[Value]| {
        v.iter()
            .map(|e| e["seq"].as_u64().unwrap_or(0))
            .collect::<Vec<_>>()
    };
    assert_eq!(seqs(&replayed), seqs(&live));
    let page = acme
        .ask(
            &format!("kedge.runs.{run}.history"),
            json!({"after": 0, "limit": 3}),
        )
        .await;
    assert_eq!(page["more"], true);
    assert_eq!(
        seqs(page["events"].as_array().expect("events")),
        seqs(&live[..3])
    );
    let view = acme.ask(&format!("kedge.runs.{run}"), json!({})).await;
    assert_eq!(view["status"], "succeeded", "{view}");

    // Cancel a second run while it waits for the user.
    let second = run_id(&acme.submit("asker", "go", "acme-key-2").await);
    let second_id: RunId = second.parse().expect("run id");
    h.wait_for(&second_id, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let cancelled = acme
        .ask(
            &format!("kedge.runs.{second}.cancel"),
            json!({"reason": "enough"}),
        )
        .await;
    assert!(cancelled["seq"].as_u64().is_some(), "{cancelled}");
    assert_eq!(
        h.wait_terminal(&second_id, WAIT).await.status,
        RunStatus::Cancelled
    );

    // An approval: the tenant's user may not decide it; its approver may.
    let payer = run_id(&acme.submit("payer", "pay", "acme-key-3").await);
    let payer_id: RunId = payer.parse().expect("run id");
    let state = h
        .wait_for(&payer_id, WAIT, |s| s.status == RunStatus::WaitingApproval)
        .await;
    let (approval, a) = state.approvals.iter().next().expect("an approval");
    let decision = json!({"verdict": "approve", "args_digest": a.request.args_digest});
    let subject = format!("kedge.approve.{user}.{payer}.{approval}");
    acme.assert_refused(&subject, &decision.to_string()).await;
    let alice = Tenant::connect(&h, approver).await;
    let forged = format!("kedge.approve.{user}.{payer}.{approval}");
    alice.assert_refused(&forged, &decision.to_string()).await;
    let decided = alice
        .ask(
            &format!("kedge.approve.{approver}.{payer}.{approval}"),
            decision,
        )
        .await;
    assert!(decided["seq"].as_u64().is_some(), "{decided}");
    assert_eq!(
        h.wait_terminal(&payer_id, WAIT).await.status,
        RunStatus::Succeeded
    );
    let events = h.events(&payer_id).await;
    let approver_name = events.iter().find_map(|r| match &r.envelope.event {
        kedge_core::Event::ApprovalDecided(d) => Some(d.approver.clone()),
        _ => None,
    });
    assert_eq!(approver_name.as_deref(), Some("acme/acme-alice"));
    assert_eq!(h.ledger().len(), 1);
}

/// A client that follows its run at once may be early: the gateway's answer to a task says it is
/// stored, and intake makes the run a moment later. The follow waits for the run, then streams it
/// to its end; a run that never comes is refused as not found.
#[tokio::test]
async fn a_follow_sent_before_intake_made_the_run_waits_for_it() {
    let Some(h) = harness().await else { return };
    let acme = Tenant::connect(&h, TENANTS[0].1).await;
    // The tenant chooses a run id and knows the run it makes (the id within its tenant).
    let chosen = RunId::generate();
    let run =
        kedge_runtime::run_ids::chosen(&TENANTS[0].0.parse().expect("tenant"), &chosen).to_string();
    let ((live, why), ack) = tokio::join!(acme.follow(&run, 0, acme.answering(&run)), async {
        // The follow goes out first.
        tokio::time::sleep(Duration::from_millis(300)).await;
        acme.submit_task(
            json!({"agent": "asker", "input": "go", "run_id": chosen}),
            "acme-early-1",
        )
        .await
    });
    assert_eq!(run_id(&ack), run, "{ack}");
    assert_eq!(why, "finished", "{live:?}");
    let types: Vec<&str> = live.iter().filter_map(|e| e["type"].as_str()).collect();
    assert_eq!(types.first(), Some(&"run.created"), "{types:?}");
    assert_eq!(types.last(), Some(&"run.succeeded"), "{types:?}");

    let (events, why) = acme.follow(&RunId::generate().to_string(), 0, |_| {}).await;
    assert!(events.is_empty());
    assert_eq!(why, "error 404", "a run that never comes");
}

#[tokio::test]
async fn a_tenant_is_refused_everything_else_and_cannot_see_other_tenants() {
    let Some(h) = harness().await else { return };
    let acme = Tenant::connect(&h, TENANTS[0].1).await;
    let globex = Tenant::connect(&h, TENANTS[1].1).await;
    let theirs = run_id(&globex.submit("asker", "secret plans", "g-1").await);
    let theirs_id: RunId = theirs.parse().expect("run id");
    h.wait_for(&theirs_id, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let state = h.state(&theirs_id).await;
    let question = state.questions.keys().next().expect("a question").clone();
    let journal_before = h.events(&theirs_id).await.len();

    // Writing into the journal: a decision, an input to another tenant's run.
    for subject in [
        format!("agent.run.{theirs}.d.run.failed"),
        format!("agent.run.{theirs}.i.user.message"),
        format!("agent.run.{theirs}.i.question.answered"),
    ] {
        acme.assert_refused(&subject, r#"{"forged": true}"#).await;
    }
    // Reading another tenant's run by any means of the JetStream API, and the KV buckets.
    for subject in [
        "$JS.API.INFO".to_owned(),
        "$JS.API.STREAM.INFO.KEDGE_RUNS".to_owned(),
        "$JS.API.STREAM.NAMES".to_owned(),
        "$JS.API.DIRECT.GET.KEDGE_RUNS".to_owned(),
        format!("$JS.API.DIRECT.GET.KEDGE_RUNS.agent.run.{theirs}.d.run.created"),
        "$JS.API.STREAM.MSG.GET.KEDGE_RUNS".to_owned(),
        "$JS.API.CONSUMER.CREATE.KEDGE_RUNS".to_owned(),
        format!("$JS.API.CONSUMER.CREATE.KEDGE_RUNS.spy.agent.run.{theirs}.>"),
        "$JS.API.DIRECT.GET.KV_kedge_runs".to_owned(),
        "$JS.API.DIRECT.GET.KV_kedge_agents.$KV.kedge_agents.asker".to_owned(),
        format!("$JS.API.STREAM.MSG.GET.{SECRETS_STREAM}"),
    ] {
        acme.assert_refused(&subject, r#"{"seq": 1}"#).await;
    }
    // The tool runners' and the reconciler's subjects.
    for subject in [
        "kedge.tool.resolve",
        "kedge.tool.inspect",
        "agent.approval.x",
    ] {
        acme.assert_refused(subject, "{}").await;
    }
    // Deleting or purging anything; writing any bucket.
    for subject in [
        "$JS.API.STREAM.DELETE.KEDGE_RUNS",
        "$JS.API.STREAM.PURGE.KEDGE_RUNS",
        "$JS.API.STREAM.PURGE.KEDGE_TASKS",
        "$JS.API.STREAM.DELETE.KV_kedge_agents",
        "$KV.kedge_leases.x",
        "$KV.kedge_idempotency.x",
        "$KV.kedge_agents.asker",
        "$KV.kedge_runs.acme.x",
    ] {
        acme.assert_refused(subject, "{}").await;
    }
    // Listening in on the journal or another tenant's deltas.
    let sub = acme
        .client
        .subscribe(format!("agent.delta.{theirs}"))
        .await
        .expect("the subscribe call itself returns");
    assert!(acme.refused(&format!("agent.delta.{theirs}")).await);
    drop(sub);

    // Through the gateway another tenant's run does not exist, word for word like a made-up one.
    let unknown = "run_doesnotexist0000";
    for (suffix, body) in [
        ("", json!({})),
        (".history", json!({})),
        (".message", json!({"text": "hi"})),
        (".cancel", json!({})),
        (&format!(".answer.{question}"), json!({"answer": "no"})),
    ] {
        let mine = acme
            .ask(&format!("kedge.runs.{theirs}{suffix}"), body.clone())
            .await;
        let none = acme
            .ask(&format!("kedge.runs.{unknown}{suffix}"), body)
            .await;
        assert_eq!(mine["error"]["status"], 404, "{suffix}: {mine}");
        assert_eq!(
            mine["error"]["reason"]
                .as_str()
                .map(|r| r.replace(&theirs, "X")),
            none["error"]["reason"]
                .as_str()
                .map(|r| r.replace(unknown, "X")),
            "{suffix}"
        );
    }
    let (events, why) = acme.follow(&theirs, 0, |_| {}).await;
    assert!(events.is_empty());
    assert_eq!(why, "error 404", "another tenant's run cannot be followed");
    assert_eq!(
        h.events(&theirs_id).await.len(),
        journal_before,
        "nothing reached the other tenant's journal"
    );
    assert_eq!(h.state(&theirs_id).await.status, RunStatus::WaitingUser);
}

#[tokio::test]
async fn two_tenants_with_the_same_key_get_a_run_each() {
    let Some(h) = harness().await else { return };
    let acme = Tenant::connect(&h, TENANTS[0].1).await;
    let globex = Tenant::connect(&h, TENANTS[1].1).await;
    let a = acme.submit("asker", "from acme", "shared-key").await;
    let g = globex.submit("asker", "from globex", "shared-key").await;
    assert_eq!(a["duplicate"], false, "{a}");
    assert_eq!(g["duplicate"], false, "{g}");
    assert_ne!(run_id(&a), run_id(&g));
    for (ack, tenant, input) in [(a, "acme", "from acme"), (g, "globex", "from globex")] {
        let run: RunId = run_id(&ack).parse().expect("run id");
        let state = h
            .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
            .await;
        assert_eq!(state.bundle.tenant.as_str(), tenant);
        assert_eq!(state.bundle.input, input);
    }
}

/// A run id as Kedge made it before ids were keyed (an unkeyed hash anyone could compute).
fn unkeyed_run_id(basis: &str) -> String {
    let d = kedge_core::event::Digest::of_bytes(basis.as_bytes());
    format!("run_{}", &d.as_str().trim_start_matches("sha256:")[..32])
}

/// A tenant computes the run ids another tenant's next tasks would have had under the old,
/// unkeyed scheme (docs/SECURITY.md, "Run ids") and takes them first: tasks naming those ids
/// and one with the same key. The other tenant's tasks are accepted and run as if nothing
/// happened, the attacker gets runs of its own, and no answer tells it anything.
#[tokio::test]
async fn a_tenant_cannot_take_or_probe_another_tenants_run_ids() {
    let Some(h) = harness().await else { return };
    let acme = Tenant::connect(&h, TENANTS[0].1).await;
    let evil = Tenant::connect(&h, TENANTS[1].1).await;
    let key = "order-42";
    // acme's next keyed task (Nats-Msg-Id `acme/<key>` once the gateway forwards it).
    let acme_keyed = unkeyed_run_id(&format!("key\u{0}acme\u{0}acme/{key}"));
    let squat = |id: &str| json!({"agent": "asker", "input": "squat", "run_id": id});
    let mut evil_acks = vec![
        evil.submit_task(squat(&acme_keyed), "evil-1").await,
        // The same key: its own run, not acme's, and not a duplicate (nothing said about acme).
        evil.submit("asker", "same key", key).await,
    ];
    // acme's next keyless task: the sequence after evil's own tasks, read from its PubAck.
    let seq = evil_acks[1]["seq"].as_u64().expect("seq in the PubAck");
    for n in 0..3u64 {
        let id = unkeyed_run_id(&format!("seq\u{0}{}", seq + 4 + n));
        evil_acks.push(evil.submit_task(squat(&id), &format!("evil-seq-{n}")).await);
    }
    for ack in &evil_acks {
        assert!(ack.get("error").is_none(), "{ack}");
        assert_eq!(ack["duplicate"], false, "{ack}");
    }
    // Now acme: a keyless task (the next sequence) and the keyed one.
    let keyless = {
        let reply = acme
            .client
            .request(
                "agent.task.asker",
                json!({"agent": "asker", "input": "keyless"})
                    .to_string()
                    .into(),
            )
            .await
            .expect("the task is acknowledged");
        serde_json::from_slice::<Value>(&reply.payload).expect("a PubAck")
    };
    assert_eq!(keyless["seq"].as_u64(), Some(seq + 4), "{keyless}");
    let keyed = acme.submit("asker", "keyed", key).await;
    let acme_runs = [(run_id(&keyless), "keyless"), (run_id(&keyed), "keyed")];
    let evil_runs: Vec<String> = evil_acks.iter().map(run_id).collect();
    for (run, input) in &acme_runs {
        assert!(!evil_runs.contains(run), "{run} is one of evil's runs");
        // Accepted, run, answered and succeeded: acme's own run, with acme's input.
        let (events, why) = acme.follow(run, 0, acme.answering(run)).await;
        assert_eq!(why, "finished", "{run}: {events:?}");
        let state = h.state(&run.parse().expect("run id")).await;
        assert_eq!(state.status, RunStatus::Succeeded, "{run}");
        assert_eq!(state.bundle.tenant.as_str(), TENANTS[0].0);
        assert_eq!(state.bundle.input, *input);
        // And evil cannot see it.
        let view = evil.ask(&format!("kedge.runs.{run}"), json!({})).await;
        assert_eq!(view["error"]["status"], 404, "{view}");
    }
    assert_ne!(run_id(&keyed), acme_keyed, "not the old, computable id");
    // evil's tasks made runs of evil's own, none at an id it named.
    for (ack, named) in evil_runs.iter().zip(
        std::iter::once(acme_keyed.clone())
            .chain(std::iter::once(String::new()))
            .chain((0..3).map(|n| unkeyed_run_id(&format!("seq\u{0}{}", seq + 4 + n)))),
    ) {
        assert_ne!(ack, &named);
        let run: RunId = ack.parse().expect("run id");
        let state = h
            .wait_for(&run, WAIT, |s| s.status == RunStatus::WaitingUser)
            .await;
        assert_eq!(state.bundle.tenant.as_str(), TENANTS[1].0);
    }
}

#[tokio::test]
async fn each_kind_of_service_user_is_refused_what_is_not_its_job() {
    let Some(h) = harness().await else { return };
    let run = run_id(
        &Tenant::connect(&h, TENANTS[0].1)
            .await
            .submit("asker", "go", "k")
            .await,
    );
    let run_parsed: RunId = run.parse().expect("run id");
    h.wait_for(&run_parsed, WAIT, |s| s.status == RunStatus::WaitingUser)
        .await;
    let before = h.events(&run_parsed).await.len();
    // (kind, a subject it must not publish)
    let cases = [
        (Kind::Tool, format!("agent.run.{run}.d.run.failed")),
        (Kind::Bridge, format!("agent.run.{run}.d.run.failed")),
        (Kind::Gateway, format!("agent.run.{run}.d.run.failed")),
        (Kind::Intake, format!("agent.run.{run}.d.run.failed")),
        (Kind::Step, "kedge.tool.resolve".to_owned()),
        (Kind::Bridge, "kedge.tool.resolve".to_owned()),
        (Kind::Step, "$JS.API.STREAM.PURGE.KEDGE_RUNS".to_owned()),
        (
            Kind::Operator,
            "$JS.API.STREAM.DELETE.KEDGE_RUNS".to_owned(),
        ),
        (Kind::All, "$JS.API.STREAM.PURGE.KEDGE_RUNS".to_owned()),
        (Kind::All, "$KV.kedge_agents.asker".to_owned()),
        // The run-id key: only the kinds that derive run ids may read it.
        (
            Kind::Step,
            format!("$JS.API.STREAM.MSG.GET.{SECRETS_STREAM}"),
        ),
        (
            Kind::Tool,
            format!("$JS.API.STREAM.MSG.GET.{SECRETS_STREAM}"),
        ),
        (
            Kind::Step,
            "$JS.API.CONSUMER.DELETE.KEDGE_RUNS.step".to_owned(),
        ),
        (
            Kind::Step,
            "$JS.API.CONSUMER.MSG.NEXT.KEDGE_RUNS.tool".to_owned(),
        ),
    ];
    for (kind, subject) in cases {
        let t = Tenant::login(&h, kind.user(), common::kind_password(kind)).await;
        t.client
            .publish(subject.clone(), r#"{"forged": true}"#.into())
            .await
            .expect("publish call");
        assert!(t.refused(&subject).await, "{kind} may publish {subject}");
    }
    assert_eq!(
        h.events(&run_parsed).await.len(),
        before,
        "nothing was journaled"
    );
    // The subscriptions only tool runners hold.
    let t = Tenant::login(&h, Kind::Step.user(), common::kind_password(Kind::Step)).await;
    let _sub = t
        .client
        .subscribe("kedge.tool.resolve")
        .await
        .expect("subscribe call");
    assert!(t.refused("kedge.tool.resolve").await);
}

#[tokio::test]
async fn an_agent_is_started_only_by_the_tenants_it_allows() {
    let Some(h) = harness().await else { return };
    let name: kedge_core::ids::AgentName = "acme-only".parse().expect("name");
    h.agent("acme-only", "asker").await;
    let (_, stored) = h.rt.agents.latest(&name).await.expect("stored");
    let mut def = (*stored).clone();
    def.tenants = Some(vec!["acme".parse().expect("tenant")]);
    h.rt.agents.put(&def).await.expect("stored again");
    let task = kedge_core::task::TaskSubmission::new(name.clone(), "hi");
    let as_tenant = |tenant: &'static str, key: &'static str| {
        let client = h.rt.client.clone();
        let task = task.clone();
        async move {
            let submission = kedge_intake::Submission {
                task: &task,
                key,
                tenant,
                caller: None,
            };
            kedge_intake::submit(&client, &submission, WAIT)
                .await
                .expect("intake answers")
        }
    };
    match as_tenant("globex", "g-only-1").await {
        kedge_intake::Answer::Rejected { error } => {
            assert_eq!(error.field, "agent");
            assert!(error.reason.contains("no agent named"), "{}", error.reason);
        }
        other => panic!("globex started acme's agent: {other:?}"),
    }
    assert!(matches!(
        as_tenant("acme", "a-only-1").await,
        kedge_intake::Answer::Accepted { .. }
    ));
    // Over the tenant gateway: globex's task is stored, but no run is ever made of it.
    let globex = Tenant::connect(&h, TENANTS[1].1).await;
    let ack = globex.submit("acme-only", "hi", "g-only-2").await;
    let run = run_id(&ack);
    tokio::time::sleep(Duration::from_millis(500)).await;
    let view = globex.ask(&format!("kedge.runs.{run}"), json!({})).await;
    assert_eq!(view["error"]["status"], 404, "{view}");
}

/// Kills the server it holds when dropped.
struct Child(std::process::Child);

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test]
async fn nats_config_writes_a_configuration_a_real_server_runs() {
    let dir = tempfile::tempdir().expect("dir");
    let out = dir.path().join("nats");
    let example = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../nats/secure/tenants.example.json"
    );
    let port = kedge_testkit::free_port();
    let url = format!("nats://127.0.0.1:{port}");
    let kedge = |args: &[&str]| {
        std::process::Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(args)
            .env("KEDGE_LOG", "warn")
            .env_remove("KEDGE_NATS_URL")
            .output()
            .expect("kedge runs")
    };
    let generate = || {
        let done = kedge(&[
            "nats-config",
            "--tenants",
            example,
            "--out",
            out.to_str().expect("utf-8 path"),
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--http",
            "none",
        ]);
        assert!(
            done.status.success(),
            "{}",
            String::from_utf8_lossy(&done.stderr)
        );
    };
    generate();
    let admin_key = out.join("keys/admin.nk");
    let seed = std::fs::read_to_string(&admin_key).expect("admin seed");
    generate();
    assert_eq!(
        std::fs::read_to_string(&admin_key).expect("admin seed"),
        seed,
        "running it again keeps the keys"
    );
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt as _;
        let mode = std::fs::metadata(&admin_key)
            .expect("meta")
            .permissions()
            .mode();
        assert_eq!(mode & 0o077, 0, "seeds are private: {mode:o}");
    }
    let log = std::fs::File::create(dir.path().join("nats.log")).expect("log");
    let _server = Child(
        std::process::Command::new(kedge_testkit::nats_server_binary())
            .args(["-c", "server.conf"])
            .current_dir(&out)
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("nats-server starts"),
    );
    let key = |kind: &str| out.join(format!("keys/{kind}.nk")).display().to_string();
    // Only admin creates the layout; then the step's user can verify it.
    let deadline = Instant::now() + WAIT;
    loop {
        let done = kedge(&["--nats-url", &url, "--nkey", &key("admin"), "layout"]);
        if done.status.success() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "admin cannot create the layout: {}",
            String::from_utf8_lossy(&done.stderr)
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let done = kedge(&["--nats-url", &url, "--nkey", &key("step"), "layout"]);
    assert!(
        done.status.success(),
        "{}",
        String::from_utf8_lossy(&done.stderr)
    );
    // The example's approver logs in with the example password (bcrypt in the file); a wrong
    // one is refused; a tenant has no JetStream.
    let alice = async_nats::ConnectOptions::with_user_and_password(
        "acme-alice".into(),
        "alice-example-password".into(),
    )
    .connect(url.as_str())
    .await
    .expect("the approver logs in");
    let info = tokio::time::timeout(
        Duration::from_secs(1),
        alice.request("$JS.API.INFO", "".into()),
    )
    .await;
    assert!(
        !matches!(info, Ok(Ok(_))),
        "a tenant reached the JetStream API"
    );
    let wrong = async_nats::ConnectOptions::with_user_and_password(
        "acme-alice".into(),
        "not-her-password".into(),
    )
    .connect(url.as_str())
    .await;
    assert!(wrong.is_err(), "a wrong password is refused");
}

#[tokio::test]
async fn agents_put_refuses_keys_and_endpoints_the_operator_did_not_allow() {
    let Some(h) = harness().await else { return };
    let dir = tempfile::tempdir().expect("dir");
    let put = |name: &str, extra: Value| {
        let mut def = json!({
            "name": name,
            "system_prompt": "x",
            "model": {"provider": "openai", "name": "m"},
        });
        if let (Some(d), Some(e)) = (def.as_object_mut(), extra.as_object()) {
            for (k, v) in e {
                d.insert(k.clone(), v.clone());
            }
        }
        let file = dir.path().join(format!("{name}.json"));
        std::fs::write(&file, def.to_string()).expect("write");
        std::process::Command::new(env!("CARGO_BIN_EXE_kedge"))
            .args(["agents", "put"])
            .arg(&file)
            .env("KEDGE_NATS_URL", h.nats.url())
            .envs(common::kind_env(&h.config, Kind::Admin))
            .env("KEDGE_LOG", "warn")
            .output()
            .expect("kedge runs")
    };
    let ok = put("fine", json!({}));
    assert!(
        ok.status.success(),
        "{}",
        String::from_utf8_lossy(&ok.stderr)
    );
    for (name, extra, says) in [
        ("home", json!({"api_key_env": "HOME"}), "api_key_env"),
        (
            "exfil",
            json!({"model": {"provider": "openai", "name": "m", "base_url": "https://evil.example/v1"}}),
            "base_url",
        ),
        (
            "plain",
            json!({"model": {"provider": "openai", "name": "m", "base_url": "http://10.1.2.3/v1"}}),
            "base_url",
        ),
    ] {
        let out = put(name, extra);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{name} was stored");
        assert!(err.contains(says), "{name}: {err}");
    }
}

#[tokio::test]
async fn a_stored_agent_outside_the_model_policy_fails_its_run_without_calling_anyone() {
    let Some(h) = harness().await else { return };
    let name: kedge_core::ids::AgentName = "elsewhere".parse().expect("name");
    h.agent("elsewhere", "asker").await;
    let (_, stored) = h.rt.agents.latest(&name).await.expect("stored");
    let mut def = (*stored).clone();
    // Stored around `kedge agents put` (straight into the bucket, as admin).
    def.model.base_url = Some("https://model.evil.example/v1".into());
    h.rt.agents.put(&def).await.expect("stored again");
    let run = h.submit("elsewhere", "hi", "elsewhere-1").await;
    let state = h.wait_terminal(&run, WAIT).await;
    assert_eq!(state.status, RunStatus::Failed);
    let reason = format!("{:?}", state.failure);
    assert!(reason.contains("base_url"), "{reason}");
    assert_eq!(h.mock.total_calls(), 0, "nobody was called");
}
