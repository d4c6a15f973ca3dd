//! The permissions of Kedge's users, built from the layout registry (docs/SECURITY.md, "What each
//! Kedge user may do").
//!
//! Every subject here comes from [`kedge_core::subjects`]: streams and buckets by their
//! constants, the JetStream API operations on them ([`StreamApi`], [`ConsumerApi`]), the durable
//! consumers each kind pulls ([`Durable`]), the journal's subjects by event type, the object
//! store's and the buckets' subjects. Renaming a stream, a bucket, a durable or an event type in
//! the registry renames it here. What one kind may do is its [`KindRules`] on top of [`common`],
//! minus [`deny_all_services`] (less what it lifts) and every other kind's durables;
//! [`kind_permissions`] puts them together for nats-server.
//!
//! `nats/secure/permissions.json` is [`document`]'s output, for people to read: generated, never
//! edited. A test fails when the file differs from what this module builds;
//! `KEDGE_BLESS=1 cargo test -p kedge-runtime --lib secure::permissions` writes it again.

use kedge_core::event::{EventKind, EventType};
use kedge_core::subjects::{
    self, AGENTS_BUCKET, AGENTS_STREAM, ANY_TAIL, APPROVALS_ALL, BLOBS_BUCKET, CALLBACKS_ALL,
    ConsumerApi, DELTAS_ALL, Durable, IDEMPOTENCY_BUCKET, IMPORT_REPLIES, INBOXES, JOURNAL_ALL,
    JS_API_ADMINISTRATION, JS_API_INFO, JS_FLOW_CONTROL, LEASES_BUCKET, LIVE_ALL, OBJECTS_ALL,
    ONE_TOKEN, PROVIDERS_BUCKET, PROVIDERS_STREAM, PURGED_STREAMS, QUOTAS_BUCKET, QUOTAS_STREAM,
    REJECTED_ALL, REJECTED_CALLBACK, REJECTED_JOURNAL_ALL, RUNS_BUCKET, RUNS_BUCKET_STREAM,
    RUNS_STREAM, SCHEDULES_BUCKET, SECRETS_BUCKET, SECRETS_STREAM, SLOTS_BUCKET, SLOTS_STREAM,
    SYS_ALL, StreamApi, TASKS_ALL, TIMERS_SCHEDULED_ALL, TOOL_INSPECT, TOOL_RESOLVE,
};
use serde::ser::SerializeStruct;
use serde::{Serialize, Serializer};
use serde_json::{Value, json};

use super::{KEDGE_ACCOUNT, Kind};
use kedge_core::subjects::RETENTION_CURSOR_KEY as CURSOR_KEY;

/// Subjects a user may publish to and subscribe to (or, as [`deny_all_services`], may not).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Rules {
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub publish: Vec<String>,
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub subscribe: Vec<String>,
}

/// How many replies a user may send to each request it received (nats-server's
/// `allow_responses`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Responses {
    /// One reply per request (`true`).
    One,
    /// Up to `max` replies per request within `expires` (stream replies).
    Stream { max: u32, expires: &'static str },
}

impl Serialize for Responses {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            Responses::One => serializer.serialize_bool(true),
            Responses::Stream { max, expires } => {
                let mut s = serializer.serialize_struct("Responses", 2)?;
                s.serialize_field("max", max)?;
                s.serialize_field("expires", expires)?;
                s.end()
            }
        }
    }
}

/// What one kind of Kedge user may do beyond [`common`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct KindRules {
    /// What the kind is, for the reader of the permissions file.
    pub about: String,
    /// The durable consumers it creates, pulls and acknowledges (written `STREAM/name`).
    #[serde(serialize_with = "durable_entries")]
    pub durables: Vec<Durable>,
    /// Entries of [`deny_all_services`] not denied to this kind (its `publish` says what of
    /// them it may).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub lift: Vec<String>,
    pub publish: Vec<String>,
    pub subscribe: Vec<String>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub allow_responses: Option<Responses>,
}

fn durable_entries<S: Serializer>(durables: &[Durable], serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_seq(
        durables
            .iter()
            .map(|d| format!("{}/{}", d.stream(), d.name())),
    )
}

/// Every run's events of type `t` (`agent.run.*.<d|i>.<type>`).
fn all_runs(t: EventType) -> String {
    subjects::event_all_runs(t)
}

/// What a kind whose events or records may go by reference writes: `kedge_blobs`'s chunks and
/// meta records (docs/ARCHITECTURE.md, "Large payloads by reference").
fn blobs() -> [String; 2] {
    subjects::object_writes(BLOBS_BUCKET)
}

/// Reading the run-id key (`kedge_secrets` has no direct gets, so a message get is the only
/// read): denied to every kind but the ones that derive run ids, which lift it
/// (docs/SECURITY.md, "Run ids").
fn secrets_read() -> String {
    StreamApi::MsgGet.on(SECRETS_STREAM)
}

/// Creating a consumer on `stream`: an ephemeral one (no name) or a named one.
fn consumer_create(stream: &str) -> [String; 2] {
    let create = ConsumerApi::Create.on(stream);
    let named = format!("{create}.{ANY_TAIL}");
    [create, named]
}

/// A watch of `stream` (a push consumer the client creates and deletes): a KV watch.
fn watch(stream: &str) -> Vec<String> {
    let mut v = consumer_create(stream).to_vec();
    v.push(ConsumerApi::Delete.of(stream, ONE_TOKEN));
    v
}

/// An ephemeral pull consumer on `stream` (created, pulled, deleted): reads and scans.
fn ephemeral(stream: &str) -> Vec<String> {
    let mut v = consumer_create(stream).to_vec();
    v.push(ConsumerApi::MsgNext.of(stream, ONE_TOKEN));
    v.push(ConsumerApi::Delete.of(stream, ONE_TOKEN));
    v
}

/// What every kind but admin may do: stream info, direct and leader gets, ephemeral (ordered)
/// consumers on the journal, flow control, and replies on its inboxes.
pub fn common() -> Rules {
    let mut publish = vec![
        JS_API_INFO.to_owned(),
        StreamApi::Info.on(ONE_TOKEN),
        StreamApi::MsgGet.on(ONE_TOKEN),
    ];
    publish.extend(subjects::js_direct_get(ONE_TOKEN));
    publish.extend(ephemeral(RUNS_STREAM));
    publish.push(JS_FLOW_CONTROL.to_owned());
    Rules {
        publish,
        subscribe: vec![INBOXES.to_owned()],
    }
}

/// What no kind but admin may publish (deny wins over allow), unless its [`KindRules::lift`]
/// names the entry: changing, deleting, purging, snapshotting or restoring streams, pausing
/// consumers, the account, meta-group and server APIs, writing agents, object stores, `$SYS`,
/// reading the run-id key.
pub fn deny_all_services() -> Rules {
    let mut publish: Vec<String> = [
        StreamApi::Create,
        StreamApi::Update,
        StreamApi::Delete,
        StreamApi::Purge,
        StreamApi::MsgDelete,
        StreamApi::Snapshot,
        StreamApi::Restore,
        StreamApi::Peer,
        StreamApi::Leader,
    ]
    .into_iter()
    .map(|op| op.on(ANY_TAIL))
    .collect();
    publish.push(ConsumerApi::Pause.on(ANY_TAIL));
    publish.extend(JS_API_ADMINISTRATION.map(str::to_owned));
    publish.push(subjects::kv_all(AGENTS_BUCKET));
    publish.push(OBJECTS_ALL.to_owned());
    publish.push(SYS_ALL.to_owned());
    publish.push(secrets_read());
    Rules {
        publish,
        subscribe: Vec::new(),
    }
}

/// The rules of `kind`; `None` for admin (everything) and all (the union of the services).
pub fn rules(kind: Kind) -> Option<KindRules> {
    Some(match kind {
        Kind::Admin | Kind::All => return None,
        Kind::Intake => intake(),
        Kind::Step => step(),
        Kind::Tool => tool(),
        Kind::Approval => approval(),
        Kind::Timer => timer(),
        Kind::Reconciler => reconciler(),
        Kind::Retention => retention(),
        Kind::Projector => projector(),
        Kind::Bridge => bridge(),
        Kind::Gateway => gateway(),
        Kind::Operator => operator(),
    })
}

fn intake() -> KindRules {
    let mut publish = vec![
        all_runs(EventType::RunCreated),
        all_runs(EventType::CallbackReceived),
        REJECTED_ALL.to_owned(),
        INBOXES.to_owned(),
        subjects::kv_all(QUOTAS_BUCKET),
    ];
    publish.extend(blobs());
    KindRules {
        about: format!(
            "turns tasks into runs: the one decision it writes is run.created; answers on \
             inboxes; delivers callbacks; admits runs under the tenants' quotas ({QUOTAS_BUCKET})"
        ),
        durables: vec![Durable::Intake],
        lift: vec![OBJECTS_ALL.to_owned(), secrets_read()],
        publish,
        subscribe: vec![CALLBACKS_ALL.to_owned()],
        allow_responses: Some(Responses::One),
    }
}

fn step() -> KindRules {
    let mut publish = vec![
        subjects::kind_all_runs(EventKind::Decision),
        DELTAS_ALL.to_owned(),
        subjects::kv_all(LEASES_BUCKET),
        subjects::kv_all(IDEMPOTENCY_BUCKET),
        TOOL_INSPECT.to_owned(),
        REJECTED_JOURNAL_ALL.to_owned(),
        subjects::dead_letter(Durable::Step),
        all_runs(EventType::ToolResult),
        all_runs(EventType::CancelRequested),
        all_runs(EventType::ProviderReleased),
        subjects::kv_all(PROVIDERS_BUCKET),
        subjects::kv_all(SLOTS_BUCKET),
        all_runs(EventType::SlotGranted),
        subjects::kv_all(QUOTAS_BUCKET),
        subjects::kv_all(RUNS_BUCKET),
    ];
    publish.extend(watch(PROVIDERS_STREAM));
    publish.push(LIVE_ALL.to_owned());
    publish.extend(blobs());
    KindRules {
        about: format!(
            "the single writer of a run's decisions: leases, model calls, stored responses, token \
             deltas, target checks, liveness heartbeats and pings, the fleet's view of each model \
             endpoint ({PROVIDERS_BUCKET}), the slots of concurrency keys ({SLOTS_BUCKET}), \
             the tenants' model usage and ended runs ({QUOTAS_BUCKET}), the summaries of the \
             runs it drives in the runs list ({RUNS_BUCKET}); of inputs only a run's \
             release from its wait on the provider, a slot handed to a waiting run, a child \
             run's result to its parent (and a run_agent refusal) and a cancelling parent's \
             cancel of its children"
        ),
        durables: vec![Durable::Step, Durable::StepCreated],
        lift: vec![OBJECTS_ALL.to_owned()],
        publish,
        subscribe: vec![all_runs(EventType::CancelRequested), LIVE_ALL.to_owned()],
        allow_responses: Some(Responses::One),
    }
}

fn tool() -> KindRules {
    let mut publish: Vec<String> = [
        EventType::ToolStarted,
        EventType::ToolResult,
        EventType::ToolAttempt,
        EventType::OutcomeConfirmed,
        EventType::OutcomeNotFound,
        EventType::OutcomeAmbiguous,
        EventType::TargetMoved,
    ]
    .into_iter()
    .map(all_runs)
    .collect();
    // An operation's start and result journaled by the tool code inside a step's drive
    // (docs/ARCHITECTURE.md "Inline tools"; its request is the step's decision).
    publish.push(subjects::inline_inputs_all_runs());
    publish.push(subjects::kv_all(IDEMPOTENCY_BUCKET));
    publish.push(subjects::dead_letter(Durable::Tool));
    publish.push(LIVE_ALL.to_owned());
    publish.extend(blobs());
    KindRules {
        about: "runs tool operations the journal decided (in a process that also runs the step \
                service, built-in tools inside the step's drive, on the runs' inline subjects); \
                records them; answers resolve and inspect requests; liveness heartbeats and pings"
            .to_owned(),
        durables: vec![Durable::Tool],
        lift: vec![OBJECTS_ALL.to_owned()],
        publish,
        subscribe: vec![
            TOOL_RESOLVE.to_owned(),
            TOOL_INSPECT.to_owned(),
            all_runs(EventType::CancelRequested),
            LIVE_ALL.to_owned(),
        ],
        allow_responses: Some(Responses::One),
    }
}

fn approval() -> KindRules {
    KindRules {
        about: "authenticates approvers by token and journals their decisions".to_owned(),
        durables: Vec::new(),
        lift: Vec::new(),
        publish: vec![all_runs(EventType::ApprovalDecided)],
        subscribe: vec![APPROVALS_ALL.to_owned()],
        allow_responses: Some(Responses::One),
    }
}

fn timer() -> KindRules {
    KindRules {
        about: format!(
            "schedules durable timers and journals their firings; fires schedules \
             (docs/ARCHITECTURE.md, \"Schedules\"): moves their state in {SCHEDULES_BUCKET}, \
             submits each firing's task for the schedule's tenant, cancels the previous run \
             (cancel_previous) and reads the run-id key to know the run it made"
        ),
        durables: vec![Durable::Timer, Durable::TimerFired],
        lift: vec![secrets_read()],
        publish: vec![
            TIMERS_SCHEDULED_ALL.to_owned(),
            all_runs(EventType::TimerFired),
            subjects::dead_letter(Durable::Timer),
            subjects::dead_letter(Durable::TimerFired),
            subjects::kv_all(SCHEDULES_BUCKET),
            TASKS_ALL.to_owned(),
            all_runs(EventType::CancelRequested),
        ],
        subscribe: Vec::new(),
        allow_responses: None,
    }
}

fn reconciler() -> KindRules {
    let mut publish = vec![
        all_runs(EventType::Nudge),
        TOOL_RESOLVE.to_owned(),
        subjects::kv_all(SLOTS_BUCKET),
        all_runs(EventType::SlotGranted),
        subjects::kv_all(QUOTAS_BUCKET),
    ];
    publish.extend(watch(SLOTS_STREAM));
    publish.extend(watch(QUOTAS_STREAM));
    KindRules {
        about: format!(
            "nudges stalled runs, asks tool runners to resolve stuck operations, frees the slots \
             of concurrency keys ({SLOTS_BUCKET}) that finished or vanished runs kept, counts out \
             of the tenants' quotas ({QUOTAS_BUCKET}) the runs that ended uncounted"
        ),
        durables: Vec::new(),
        lift: Vec::new(),
        publish,
        subscribe: Vec::new(),
        allow_responses: None,
    }
}

fn retention() -> KindRules {
    let mut publish: Vec<String> = PURGED_STREAMS
        .into_iter()
        .map(|stream| StreamApi::Purge.on(stream))
        .collect();
    publish.push(subjects::kv_key(LEASES_BUCKET, CURSOR_KEY));
    publish.extend(blobs());
    KindRules {
        about: format!(
            "applies the retention policy (`kedge serve retention`): reads the journal's terminal \
             events and finished runs, archives them to {BLOBS_BUCKET}, purges a finished run's \
             subjects from the journal, the idempotency records, leases, the projection, the \
             timers and the set-aside records; keeps its cursor in {LEASES_BUCKET} \
             ({CURSOR_KEY}). Not part of `all`: given only to the process that runs retention"
        ),
        durables: Vec::new(),
        lift: vec![StreamApi::Purge.on(ANY_TAIL), OBJECTS_ALL.to_owned()],
        publish,
        subscribe: Vec::new(),
        allow_responses: None,
    }
}

fn projector() -> KindRules {
    let mut publish = vec![subjects::kv_all(RUNS_BUCKET)];
    publish.extend(ephemeral(RUNS_BUCKET_STREAM));
    publish.push(subjects::dead_letter(Durable::Projector));
    KindRules {
        about: format!("keeps the {RUNS_BUCKET} projection"),
        durables: vec![Durable::Projector],
        lift: Vec::new(),
        publish,
        subscribe: Vec::new(),
        allow_responses: None,
    }
}

/// What the bridge and the gateway append for the tenant they authenticated: its tasks and its
/// runs' inputs.
fn tenant_inputs() -> Vec<String> {
    let mut publish = vec![TASKS_ALL.to_owned()];
    publish.extend(
        [
            EventType::UserMessage,
            EventType::QuestionAnswered,
            EventType::CancelRequested,
            EventType::ApprovalDecided,
            EventType::CallbackReceived,
        ]
        .map(all_runs),
    );
    // The tenant's schedules (docs/ARCHITECTURE.md, "Schedules"), by compare-and-set.
    publish.push(subjects::kv_all(SCHEDULES_BUCKET));
    publish
}

fn bridge() -> KindRules {
    let mut publish = tenant_inputs();
    publish.push(all_runs(EventType::OutcomeResolved));
    publish.push(REJECTED_CALLBACK.to_owned());
    publish.push(subjects::kv_all(QUOTAS_BUCKET));
    publish.extend(blobs());
    KindRules {
        about: format!(
            "the HTTP API: submits for the tenant its token names (admitting its runs under the \
             tenant's quotas, {QUOTAS_BUCKET}), appends that tenant's inputs, lists and follows runs"
        ),
        durables: Vec::new(),
        lift: vec![OBJECTS_ALL.to_owned(), secrets_read()],
        publish,
        subscribe: vec![DELTAS_ALL.to_owned()],
        allow_responses: None,
    }
}

fn gateway() -> KindRules {
    let mut publish = tenant_inputs();
    publish.push(REJECTED_CALLBACK.to_owned());
    publish.push(IMPORT_REPLIES.to_owned());
    publish.push(INBOXES.to_owned());
    publish.push(subjects::kv_all(QUOTAS_BUCKET));
    publish.extend(blobs());
    KindRules {
        about: format!(
            "the tenants' NATS API: forwards a tenant's tasks with its name in the subject \
             (admitting their runs under the tenant's quotas, {QUOTAS_BUCKET}), reads and follows \
             only its runs, appends its inputs"
        ),
        durables: Vec::new(),
        lift: vec![OBJECTS_ALL.to_owned(), secrets_read()],
        publish,
        subscribe: vec![subjects::gateway_requests()],
        allow_responses: Some(Responses::Stream {
            max: 100_000,
            expires: "5m",
        }),
    }
}

fn operator() -> KindRules {
    let mut publish = vec![
        TASKS_ALL.to_owned(),
        subjects::kind_all_runs(EventKind::Input),
        APPROVALS_ALL.to_owned(),
        CALLBACKS_ALL.to_owned(),
        StreamApi::Names.subject(),
        StreamApi::List.subject(),
        ConsumerApi::Info.on(ANY_TAIL),
        ConsumerApi::Names.on(ANY_TAIL),
        ConsumerApi::List.on(ANY_TAIL),
    ];
    publish.extend(ephemeral(RUNS_BUCKET_STREAM));
    publish.push(subjects::kv_all(SCHEDULES_BUCKET));
    publish.extend(consumer_create(AGENTS_STREAM));
    publish.extend(watch(PROVIDERS_STREAM));
    publish.extend(watch(QUOTAS_STREAM));
    publish.extend(blobs());
    KindRules {
        about: "a person with the kedge CLI: reads everything, submits, answers, approves, \
                cancels and resolves; cannot write decisions, change agents or delete anything \
                (agents are stored as admin)"
            .to_owned(),
        durables: Vec::new(),
        lift: vec![OBJECTS_ALL.to_owned(), secrets_read()],
        publish,
        subscribe: vec![DELTAS_ALL.to_owned(), JOURNAL_ALL.to_owned()],
        allow_responses: None,
    }
}

/// The `permissions` object of a kind's user (`None` for admin: everything).
pub fn kind_permissions(kind: Kind) -> Option<Value> {
    if kind == Kind::Admin {
        return None;
    }
    let members: Vec<Kind> = match kind {
        Kind::All => Kind::SERVICES.to_vec(),
        k => vec![k],
    };
    let Rules {
        mut publish,
        mut subscribe,
    } = common();
    let mut own_durables = Vec::new();
    let mut responses: Option<Responses> = None;
    let mut lifted: Vec<String> = Vec::new();
    for rules in members.into_iter().filter_map(rules) {
        publish.extend(rules.publish);
        subscribe.extend(rules.subscribe);
        lifted.extend(rules.lift);
        for d in rules.durables {
            publish.extend(subjects::js_durable_use(d.stream(), d.name()));
            own_durables.push(d);
        }
        if let Some(r) = rules.allow_responses {
            // The widest one wins (stream replies are wider than one reply).
            responses = match responses {
                Some(wide @ Responses::Stream { .. }) => Some(wide),
                _ => Some(r),
            };
        }
    }
    let deny_all = deny_all_services();
    let mut deny: Vec<String> = deny_all
        .publish
        .into_iter()
        .filter(|d| !lifted.contains(d))
        .collect();
    for d in Durable::ALL {
        // No kind deletes a durable consumer (only admin), not even its own; and other kinds'
        // durables are never created, changed or pulled by this kind, even where a wildcard
        // (ordered consumers on the journal) would allow it.
        deny.push(subjects::js_durable_delete(d.stream(), d.name()));
        if !own_durables.contains(&d) {
            deny.extend(subjects::js_durable_use(d.stream(), d.name()));
        }
    }
    let dedup = |mut v: Vec<String>| {
        v.sort();
        v.dedup();
        v
    };
    let mut p = json!({
        "publish": {"allow": dedup(publish), "deny": dedup(deny)},
        "subscribe": {"allow": dedup(subscribe), "deny": dedup(deny_all.subscribe)},
    });
    if let Some(r) = responses {
        p["allow_responses"] = json!(r);
    }
    Some(p)
}

/// The kinds the permissions file lists, in its order: the services, then the person.
fn listed_kinds() -> impl Iterator<Item = Kind> {
    let services = Kind::EVERY
        .iter()
        .copied()
        .filter(|k| *k != Kind::Operator && rules(*k).is_some());
    services.chain([Kind::Operator])
}

/// The permissions file's `kinds` object, in [`listed_kinds`] order.
struct Kinds;

impl Serialize for Kinds {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_map(listed_kinds().filter_map(|k| Some((k.as_str(), rules(k)?))))
    }
}

#[derive(Serialize)]
struct Document {
    description: String,
    common: Rules,
    deny_all_services: Rules,
    kinds: Kinds,
}

/// The text of `nats/secure/permissions.json`: every kind's rules, for people to read.
pub fn document() -> String {
    let document = Document {
        description: format!(
            "Generated from the layout registry (kedge_core::subjects) by \
             kedge_runtime::secure::permissions; do not edit: `KEDGE_BLESS=1 cargo test -p \
             kedge-runtime --lib secure::permissions` writes it again, and that test fails when \
             it differs. Least-privilege permissions of Kedge's own users, one per service kind, \
             in the account that owns the streams and buckets ({KEDGE_ACCOUNT}). `kedge \
             nats-config` renders them, with one account per tenant, into a nats-server \
             `accounts` block (docs/SECURITY.md). Each kind gets `common` plus its own entry; \
             `deny_all_services` is denied to every kind but `admin` (deny wins over allow), \
             except the entries a kind's `lift` names (`retention`'s says which streams it may \
             purge; the kinds that write events or records that may go by reference lift \
             `{OBJECTS_ALL}` and may write only the object store `{BLOBS_BUCKET}`; the kinds that \
             derive run ids, intake, timer (its scheduler), bridge, gateway and operator, lift the read of \
             `{SECRETS_BUCKET}`, docs/SECURITY.md \"Run ids\"). `durables` \
             are expanded per consumer: a kind may create, read and pull only its own durable \
             consumers, and no kind but admin deletes a durable consumer. Ephemeral (ordered) \
             consumers for reads are allowed on the journal."
        ),
        common: common(),
        deny_all_services: deny_all_services(),
        kinds: Kinds,
    };
    let text = serde_json::to_string_pretty(&document).expect("plain data serializes");
    format!("{text}\n")
}

#[cfg(test)]
mod tests;
