//! Op costs: the public APIs the services call (leases, journal, idempotency KV, the model
//! call, the tool), timed in a loop on the same server, one request in flight; and the pure CPU
//! of a drive (fold, decide, decoding). The appends and their alternatives: [`appends`].

mod appends;

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use futures::StreamExt;
use kedge_core::decide::{Next, decide};
use kedge_core::event::{Digest, Envelope, Event, EventType, Timestamp};
use kedge_core::ids::{ModelRequestId, OperationId, RunId};
use kedge_core::{Attempt, StepNo};
use kedge_journal::Recorded;
use kedge_runtime::Runtime;
use kedge_runtime::idempotency::{Claim, StoredResponse};

use crate::env::Env;
use crate::measure::{Stats, ms, stats};

async fn time_op<F, Fut>(n: usize, mut f: F) -> Stats
where
    F: FnMut(usize) -> Fut,
    Fut: std::future::Future<Output = ()>,
{
    // A few warm-up calls.
    for i in 0..5.min(n) {
        f(n + i).await;
    }
    let mut v = Vec::with_capacity(n);
    for i in 0..n {
        let t = Instant::now();
        f(i).await;
        v.push(ms(t.elapsed()));
    }
    stats(&v)
}

fn with_run(e: &Envelope, run: &RunId) -> Envelope {
    let mut e = e.clone();
    e.run_id = run.clone();
    e.at = Timestamp::now();
    e
}

/// A copy of the first `n` events of `src` under a new run id (raw publishes, for reading).
/// Decisions carry a writer's `Nats-Msg-Id` (readers set aside a decision without one).
async fn copy_run(rt: &Runtime, src: &[Recorded], n: usize) -> RunId {
    let run = RunId::generate();
    for (i, r) in src.iter().take(n).enumerate() {
        let e = with_run(&r.envelope, &run);
        let mut headers = async_nats::HeaderMap::new();
        if e.event_type().kind() == kedge_core::EventKind::Decision {
            headers.insert(
                "Nats-Msg-Id",
                kedge_journal::journal::decision_msg_id(
                    &run,
                    kedge_core::ids::DecisionSeq::at(0),
                    i,
                    "bench-copy",
                )
                .as_str(),
            );
        }
        rt.js
            .publish_with_headers(e.subject(), headers, e.to_json_bytes().into())
            .await
            .expect("publish")
            .await
            .expect("ack");
    }
    run
}

pub struct OpCost {
    pub name: &'static str,
    pub stats: Stats,
}

/// The events of the sample run the appends are timed with (step 5's).
struct Sample {
    src: Vec<Recorded>,
    created: Envelope,
    step_started: Envelope,
    /// The step group of a run from before gate `wait_from_step_group` (three decisions; a
    /// run of this build journals two, no `run.waiting`): the appends are timed on it.
    group: [Envelope; 3],
    tool_result: Envelope,
}

impl Sample {
    async fn read(rt: &Runtime, sample: &RunId) -> Sample {
        let src = rt.journal.read(sample, 0).await.expect("sample run");
        let by_type = |ty: EventType, step: u32| {
            src.iter()
                .find(|r| {
                    r.envelope.event_type() == ty && r.envelope.step.map_or(0, |s| s.get()) == step
                })
                .map(|r| r.envelope.clone())
                .expect("sample event")
        };
        let created = src[0].envelope.clone();
        let step_started = by_type(EventType::StepStarted, 5);
        let step_completed = by_type(EventType::StepCompleted, 5);
        let waiting = src
            .iter()
            .find(|r| r.envelope.event_type() == EventType::RunWaiting)
            .map(|r| r.envelope.clone())
            .unwrap_or_else(|| {
                kedge_core::event::Envelope::new(
                    step_completed.run_id.clone(),
                    step_completed.at,
                    kedge_core::event::Draft::new(Event::RunWaiting(
                        kedge_core::event::RunWaiting {
                            on: kedge_core::event::WaitReason::Tool,
                        },
                    ))
                    .step(StepNo(5)),
                )
            });
        let group = [
            step_completed,
            by_type(EventType::ToolRequested, 5),
            waiting,
        ];
        let tool_result = by_type(EventType::ToolResult, 5);
        Sample {
            src,
            created,
            step_started,
            group,
            tool_result,
        }
    }
}

pub async fn op_costs(env: &Env, sample: &RunId, iters: usize) -> (Vec<OpCost>, usize) {
    let rt = &env.rt;
    let s = Sample::read(rt, sample).await;
    let mut out = Vec::new();
    let ttl = Duration::from_secs(2);
    baselines(rt, iters, &mut out).await;
    let runs: Vec<RunId> = (0..iters + 10).map(|_| RunId::generate()).collect();
    leases(rt, &runs, ttl, iters, &mut out).await;
    reads(rt, &s.src, iters, &mut out).await;
    let chain = appends::decisions(rt, &s, iters, &mut out).await;
    appends::alternatives(rt, &s, &chain, iters, &mut out).await;
    appends::contended(rt, &s, &chain, &runs, ttl, iters, &mut out).await;
    appends::writers(rt, &s, &mut out).await;
    tool_run(env, iters, &mut out).await;
    idempotency(rt, &s, iters, &mut out).await;
    wake(rt, &s, iters, &mut out).await;
    let micro_model_calls = model_call(env, &s.src, iters, &mut out).await;
    cpu(&s.src, iters, &mut out);
    (out, micro_model_calls)
}

/// What everything else is measured against: a core round trip and a bare JetStream publish.
async fn baselines(rt: &Runtime, iters: usize, out: &mut Vec<OpCost>) {
    out.push(OpCost {
        name: "core round trip (flush/PING)",
        stats: time_op(iters, |_| async {
            rt.client.flush().await.expect("flush");
        })
        .await,
    });
    out.push(OpCost {
        name: "js publish+ack 256 B (no headers)",
        stats: time_op(iters, |_| async {
            rt.js
                .publish("agent.run.run_benchraw.x.y", vec![b'x'; 256].into())
                .await
                .expect("publish")
                .await
                .expect("ack");
        })
        .await,
    });
}

/// Leases: acquire, renew, release and acquire after one's own release marker.
async fn leases(rt: &Runtime, runs: &[RunId], ttl: Duration, iters: usize, out: &mut Vec<OpCost>) {
    let held: Arc<Mutex<HashMap<usize, kedge_journal::Lease>>> = Arc::default();
    out.push(OpCost {
        name: "lease acquire (direct get + CAS)",
        stats: time_op(iters, |i| {
            let held = held.clone();
            async move {
                let l = rt
                    .leases
                    .acquire(
                        &runs[i % runs.len()],
                        &"w-bench".parse().expect("worker id"),
                        ttl,
                    )
                    .await
                    .expect("acquire");
                held.lock().unwrap().insert(i, l);
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "lease renew (CAS)",
        stats: time_op(iters, |i| {
            let held = held.clone();
            async move {
                let l = held.lock().unwrap().remove(&i);
                if let Some(l) = l {
                    let l = rt.leases.renew(&l).await.expect("renew");
                    held.lock().unwrap().insert(i, l);
                }
            }
        })
        .await,
    });
    let markers: Arc<Mutex<HashMap<usize, kedge_journal::Released>>> = Arc::default();
    out.push(OpCost {
        name: "lease release (CAS delete)",
        stats: time_op(iters, |i| {
            let held = held.clone();
            let markers = markers.clone();
            async move {
                let l = held.lock().unwrap().remove(&i);
                if let Some(l) = l {
                    let m = rt.leases.release(l).await.expect("release");
                    markers.lock().unwrap().insert(i, m);
                }
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "lease acquire_after (own release marker)",
        stats: time_op(iters, |i| {
            let markers = markers.clone();
            async move {
                let hint = markers.lock().unwrap().remove(&i);
                rt.leases
                    .acquire_after(
                        &runs[i % runs.len()],
                        &"w-bench".parse().expect("worker id"),
                        ttl,
                        hint,
                    )
                    .await
                    .expect("acquire");
            }
        })
        .await,
    });
}

/// Reads of a run's journal (copies of the sample run), and the tool's cancel check.
async fn reads(rt: &Runtime, src: &[Recorded], iters: usize, out: &mut Vec<OpCost>) {
    let full_len = src.len();
    let run60 = copy_run(rt, src, 60).await;
    let run_full = copy_run(rt, src, full_len).await;
    let last_full = rt
        .journal
        .last_seq(&run_full)
        .await
        .expect("last")
        .unwrap_or(0);
    let tail3_after = {
        let all = rt.journal.read(&run_full, 0).await.expect("read");
        all[all.len().saturating_sub(4)].seq
    };
    out.push(OpCost {
        name: "journal.read(run, 0), 60 events",
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run60, 0).await.expect("read");
            assert_eq!(r.len(), 60);
        })
        .await,
    });
    let full_name: &'static str =
        Box::leak(format!("journal.read(run, 0), {full_len} events").into_boxed_str());
    out.push(OpCost {
        name: full_name,
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run_full, 0).await.expect("read");
            assert_eq!(r.len(), full_len);
        })
        .await,
    });
    out.push(OpCost {
        name: "journal.read(run, after), 3 new (refresh)",
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run_full, tail3_after).await.expect("read");
            assert_eq!(r.len(), 3);
        })
        .await,
    });
    out.push(OpCost {
        name: "journal.read(run, last), 0 new",
        stats: time_op(iters, |_| async {
            let r = rt.journal.read(&run_full, last_full).await.expect("read");
            assert!(r.is_empty());
        })
        .await,
    });

    out.push(OpCost {
        name: "direct get last of a run (cancel check)",
        stats: {
            // As the tool service checks: the last `cancel.requested` of the run (none here).
            let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("stream");
            let subject = kedge_core::subjects::event(&run_full, EventType::CancelRequested);
            time_op(iters, |_| {
                let (stream, subject) = (&stream, &subject);
                async move {
                    let _ = stream.direct_get_last_for_subject(subject.as_str()).await;
                }
            })
            .await
        },
    });
}

/// The ledger_append tool itself (open, append: one blocking-pool hop), as the tool runs it.
async fn tool_run(env: &Env, iters: usize, out: &mut Vec<OpCost>) {
    let tool_env = kedge_tool::builtin::Env {
        root: env.config.workspace_root.join("bench-tool"),
        shell_allowlist: vec![],
        timeout: Duration::from_secs(1),
        max_output: 64 * 1024,
        sandbox: std::sync::Arc::new(kedge_tool::sandbox::Unconfined),
        ledger: true,
    };
    let trun = RunId::generate();
    out.push(OpCost {
        name: "ledger_append tool run (open+append)",
        stats: time_op(iters, |i| {
            let tool_env = &tool_env;
            let trun = &trun;
            async move {
                let op = OperationId::new(trun, StepNo(i as u32 + 1), 0);
                let out = tool_env
                    .run(
                        kedge_tool::builtin::Builtin::LedgerAppend,
                        &op,
                        &serde_json::json!({"text": "x"}),
                    )
                    .await;
                assert!(!out.is_error, "{}", out.content);
            }
        })
        .await,
    });
}

/// The idempotency KV: a model response stored and read, an operation claimed and finished.
async fn idempotency(rt: &Runtime, s: &Sample, iters: usize, out: &mut Vec<OpCost>) {
    let Event::StepCompleted(sc) = &s.group[0].event else {
        unreachable!()
    };
    let stored = StoredResponse {
        context_digest: Digest::of_bytes(b"bench"),
        response: kedge_core::decide::ModelResponse {
            message: sc.message.clone(),
            usage: sc.usage,
            finish: sc.finish,
        },
    };
    let krun = RunId::generate();
    out.push(OpCost {
        name: "KV put model response (store_response)",
        stats: time_op(iters, |i| {
            let stored = &stored;
            let krun = &krun;
            async move {
                let req = ModelRequestId::new(krun, StepNo(i as u32 + 1), Attempt(1));
                rt.idempotency
                    .store_response(&req, stored)
                    .await
                    .expect("put");
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "KV get model response (stored_response)",
        stats: time_op(iters, |i| {
            let krun = &krun;
            async move {
                let req = ModelRequestId::new(krun, StepNo((i % iters) as u32 + 1), Attempt(1));
                let _ = rt.idempotency.stored_response(&req).await.expect("get");
            }
        })
        .await,
    });
    let revs: Arc<Mutex<HashMap<usize, u64>>> = Arc::default();
    let digest = Digest::of_bytes(b"args");
    out.push(OpCost {
        name: "op claim (KV create)",
        stats: time_op(iters, |i| {
            let revs = revs.clone();
            let krun = &krun;
            let digest = &digest;
            async move {
                let op = OperationId::new(krun, StepNo(i as u32 + 1), 0);
                match rt
                    .idempotency
                    .claim(
                        &op,
                        digest,
                        &"w-bench".parse().expect("worker id"),
                        0,
                        Duration::from_secs(70),
                    )
                    .await
                    .expect("claim")
                {
                    Claim::Fresh { revision } => {
                        revs.lock().unwrap().insert(i, revision);
                    }
                    other => panic!("claim: {other:?}"),
                }
            }
        })
        .await,
    });
    out.push(OpCost {
        name: "op finish (KV update, CAS)",
        stats: time_op(iters, |i| {
            let revs = revs.clone();
            let krun = &krun;
            let digest = &digest;
            async move {
                let rev = revs.lock().unwrap().get(&i).copied();
                if let Some(rev) = rev {
                    let op = OperationId::new(krun, StepNo(i as u32 + 1), 0);
                    rt.idempotency
                        .finish(
                            &op,
                            rev,
                            digest,
                            &"w-bench".parse().expect("worker id"),
                            "recorded: 5",
                            false,
                            kedge_runtime::idempotency::Finished::Ran,
                        )
                        .await
                        .expect("finish");
                }
            }
        })
        .await,
    });
}

/// Consumer wake: an input appended → delivered to a durable pull consumer (messages()).
async fn wake(rt: &Runtime, s: &Sample, iters: usize, out: &mut Vec<OpCost>) {
    let wrun = RunId::generate();
    let stream = rt.js.get_stream("KEDGE_RUNS").await.expect("stream");
    let consumer = stream
        .create_consumer(async_nats::jetstream::consumer::pull::Config {
            durable_name: Some("bench_wake".into()),
            filter_subject: format!("agent.run.{wrun}.i.>"),
            ack_policy: async_nats::jetstream::consumer::AckPolicy::Explicit,
            ..Default::default()
        })
        .await
        .expect("bench consumer");
    let mut msgs = consumer.messages().await.expect("messages");
    let msgs_ref = Arc::new(tokio::sync::Mutex::new(&mut msgs));
    out.push(OpCost {
        name: "wake: input append -> pull delivery",
        stats: time_op(iters, |i| {
            let e = with_run(&s.tool_result, &wrun);
            let msgs_ref = msgs_ref.clone();
            async move {
                rt.journal
                    .append_input(
                        &kedge_core::ids::InputId::arbitrary(format!("wake:{i}:{}", uuid_like())),
                        &kedge_core::InputEnvelope::try_from(e).expect("an input"),
                    )
                    .await
                    .expect("input");
                let mut g = msgs_ref.lock().await;
                let m = tokio::time::timeout(Duration::from_secs(5), g.next())
                    .await
                    .expect("delivered")
                    .expect("open")
                    .expect("message");
                m.ack().await.expect("ack");
            }
        })
        .await,
    });
    drop(msgs_ref);
    drop(msgs);
    let _ = stream.delete_consumer("bench_wake").await;
}

/// The model call: the HTTP round trip to the mock with a step-10 context. Returns the number
/// of calls the mock counted.
async fn model_call(env: &Env, src: &[Recorded], iters: usize, out: &mut Vec<OpCost>) -> usize {
    let rt = &env.rt;
    let upto = src
        .iter()
        .position(|r| {
            r.envelope.event_type() == EventType::ToolResult
                && r.envelope.step.map_or(0, |s| s.get()) == 9
        })
        .expect("tool.result of step 9");
    let state = kedge_core::fold(src[..=upto].iter().map(|r| (r.seq, &r.envelope))).expect("fold");
    let def = rt
        .agents
        .at_revision(&state.bundle.agent, state.bundle.agent_revision)
        .await
        .expect("agent");
    let Next::Step(plan) = decide(&state) else {
        panic!("expected a step")
    };
    let client = kedge_model::ModelClient::new();
    let other = RunId::generate();
    let request_id = ModelRequestId::new(&other, plan.step, plan.attempt);
    let model_calls_before = env.mock_handle().total_calls();
    out.push(OpCost {
        name: "model call, step-10 context (HTTP, mock)",
        stats: time_op(iters.min(200), |_| {
            let (state, def, plan, client, request_id) =
                (&state, &def, &plan, &client, &request_id);
            async move {
                let call = kedge_model::ModelCall {
                    spec: &state.bundle.model,
                    api_key: Some("bench-key"),
                    system: &def.system_prompt,
                    tools: &def.tools,
                    context: &plan.context,
                    request_id,
                    max_output_tokens: def.max_output_tokens,
                    output_schema: def.output_schema.as_ref(),
                    timeout: Duration::from_secs(10),
                };
                let mut sink = |_d: kedge_model::Delta| {};
                client.complete(&call, &mut sink).await.expect("model call");
            }
        })
        .await,
    });
    (env.mock_handle().total_calls() - model_calls_before) as usize
}

/// Pure CPU: fold + decide over a 60-event prefix (what every drive does after its read), and
/// decoding 60 envelopes.
fn cpu(src: &[Recorded], iters: usize, out: &mut Vec<OpCost>) {
    let cpu = {
        let prefix: Vec<Recorded> = src.iter().take(60).cloned().collect();
        let mut v = Vec::new();
        for _ in 0..iters {
            let t = Instant::now();
            let s = kedge_core::fold(prefix.iter().map(|r| (r.seq, &r.envelope))).expect("fold");
            let n = decide(&s);
            std::hint::black_box(n);
            v.push(ms(t.elapsed()));
        }
        stats(&v)
    };
    out.push(OpCost {
        name: "CPU: fold(60 events) + decide",
        stats: cpu,
    });
    let decode = {
        let bytes: Vec<Vec<u8>> = src
            .iter()
            .take(60)
            .map(|r| r.envelope.to_json_bytes())
            .collect();
        let mut v = Vec::new();
        for _ in 0..iters {
            let t = Instant::now();
            for b in &bytes {
                std::hint::black_box(Envelope::from_json_bytes(b).expect("decode"));
            }
            v.push(ms(t.elapsed()));
        }
        stats(&v)
    };
    out.push(OpCost {
        name: "CPU: decode 60 envelopes (JSON + digest)",
        stats: decode,
    });
}

fn uuid_like() -> String {
    RunId::generate()
        .as_str()
        .trim_start_matches("run_")
        .to_owned()
}
