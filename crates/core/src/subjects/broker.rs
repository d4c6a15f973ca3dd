//! The broker's own subjects, as Kedge uses them (part of the registry, [`super`]): the
//! JetStream API by operation, acknowledgements and flow control, the system account, and reply
//! subjects. The permissions (`kedge_runtime::secure::permissions`) are built from these.

use super::ANY_TAIL;

/// The prefix of the JetStream API, which answers on it with no responders when JetStream is
/// off.
pub const JS_API: &str = "$JS.API";

/// The JetStream API's account information request (`$JS.API.INFO`).
pub const JS_API_INFO: &str = "$JS.API.INFO";

/// The JetStream APIs that administer the account, the meta group and the servers: nothing a
/// Kedge service asks (the permissions deny them to every kind but admin).
pub const JS_API_ADMINISTRATION: [&str; 3] =
    ["$JS.API.ACCOUNT.>", "$JS.API.META.>", "$JS.API.SERVER.>"];

/// The flow-control replies of push consumers (`$JS.FC.>`: watches, ordered consumers).
pub const JS_FLOW_CONTROL: &str = "$JS.FC.>";

/// An operation of the JetStream API on streams: `$JS.API.STREAM.<op>[.<stream>]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum StreamApi {
    /// The names of the streams (names no stream).
    Names,
    /// The streams and their configuration (names no stream).
    List,
    Info,
    /// A message by sequence, from the stream's leader.
    MsgGet,
    MsgDelete,
    Create,
    Update,
    Delete,
    Purge,
    Snapshot,
    Restore,
    /// Removing a peer (`PEER.REMOVE.<stream>`).
    Peer,
    /// Moving the leader (`LEADER.STEPDOWN.<stream>`).
    Leader,
}

impl StreamApi {
    /// The operation's tokens after `STREAM.`.
    pub const fn token(self) -> &'static str {
        match self {
            StreamApi::Names => "NAMES",
            StreamApi::List => "LIST",
            StreamApi::Info => "INFO",
            StreamApi::MsgGet => "MSG.GET",
            StreamApi::MsgDelete => "MSG.DELETE",
            StreamApi::Create => "CREATE",
            StreamApi::Update => "UPDATE",
            StreamApi::Delete => "DELETE",
            StreamApi::Purge => "PURGE",
            StreamApi::Snapshot => "SNAPSHOT",
            StreamApi::Restore => "RESTORE",
            StreamApi::Peer => "PEER",
            StreamApi::Leader => "LEADER",
        }
    }

    /// `$JS.API.STREAM.<op>`: the request of an operation that names no stream.
    pub fn subject(self) -> String {
        format!("{JS_API}.STREAM.{}", self.token())
    }

    /// `$JS.API.STREAM.<op>.<stream>`: the operation on `stream` (a stream of the layout, or a
    /// wildcard).
    pub fn on(self, stream: &str) -> String {
        format!("{}.{stream}", self.subject())
    }
}

/// An operation of the JetStream API on consumers:
/// `$JS.API.CONSUMER.<op>.<stream>[.<consumer>]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ConsumerApi {
    Names,
    List,
    Info,
    /// Creating (or updating) a consumer, ephemeral or durable.
    Create,
    /// The older request that creates a durable consumer.
    DurableCreate,
    /// A pull request for the next messages.
    MsgNext,
    Delete,
    Pause,
}

impl ConsumerApi {
    /// The operation's tokens after `CONSUMER.`.
    pub const fn token(self) -> &'static str {
        match self {
            ConsumerApi::Names => "NAMES",
            ConsumerApi::List => "LIST",
            ConsumerApi::Info => "INFO",
            ConsumerApi::Create => "CREATE",
            ConsumerApi::DurableCreate => "DURABLE.CREATE",
            ConsumerApi::MsgNext => "MSG.NEXT",
            ConsumerApi::Delete => "DELETE",
            ConsumerApi::Pause => "PAUSE",
        }
    }

    /// `$JS.API.CONSUMER.<op>.<stream>`: the operation on `stream`'s consumers (or, with a
    /// wildcard, every stream's).
    pub fn on(self, stream: &str) -> String {
        format!("{JS_API}.CONSUMER.{}.{stream}", self.token())
    }

    /// `$JS.API.CONSUMER.<op>.<stream>.<consumer>`: the operation on one consumer.
    pub fn of(self, stream: &str, consumer: &str) -> String {
        format!("{}.{consumer}", self.on(stream))
    }
}

/// `$JS.API.DIRECT.GET.<stream>` and `$JS.API.DIRECT.GET.<stream>.>`: direct gets from `stream`
/// (a stream of the layout, or a wildcard), by sequence and the last message of a subject.
pub fn js_direct_get(stream: &str) -> [String; 2] {
    let get = format!("{JS_API}.DIRECT.GET.{stream}");
    let by_subject = format!("{get}.{ANY_TAIL}");
    [get, by_subject]
}

/// `$JS.ACK.<stream>.<consumer>.>`: acknowledgements of the messages consumer `consumer` of
/// `stream` delivers.
pub fn js_ack(stream: &str, consumer: &str) -> String {
    format!("$JS.ACK.{stream}.{consumer}.{ANY_TAIL}")
}

/// The subjects of the JetStream API a user needs to create, read and pull durable consumer
/// `name` of `stream`, and to acknowledge its messages.
pub fn js_durable_use(stream: &str, name: &str) -> [String; 6] {
    [
        ConsumerApi::Create.of(stream, name),
        format!("{}.{ANY_TAIL}", ConsumerApi::Create.of(stream, name)),
        ConsumerApi::DurableCreate.of(stream, name),
        ConsumerApi::Info.of(stream, name),
        ConsumerApi::MsgNext.of(stream, name),
        js_ack(stream, name),
    ]
}

/// The JetStream API subject that deletes durable consumer `name` of `stream`.
pub fn js_durable_delete(stream: &str, name: &str) -> String {
    ConsumerApi::Delete.of(stream, name)
}

/// The system account's subjects (`$SYS.>`).
pub const SYS_ALL: &str = "$SYS.>";

/// The reply subjects of Kedge's own requests (`_INBOX.>`, the client's default inbox prefix).
pub const INBOXES: &str = "_INBOX.>";

/// The reply subjects the server gives requests that arrive through a service import (`_R_.>`):
/// how the tenant gateway answers a tenant.
pub const IMPORT_REPLIES: &str = "_R_.>";
