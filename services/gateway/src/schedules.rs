//! A tenant's schedules over NATS (`kedge.schedules.list`, `kedge.schedules.<name>.<verb>`;
//! docs/API.md, "Schedules"): the tenant is the one the server put in the subject, and the work is
//! `kedge_app::schedules`, the same the HTTP bridge and the CLI call.

use kedge_app::schedules::{self, Op};
use kedge_core::ids::TenantId;
use kedge_core::subjects::ScheduleVerb;
use kedge_runtime::{Runtime, responder};

pub(crate) async fn handle(
    rt: &Runtime,
    msg: &async_nats::Message,
    tenant: &TenantId,
    verb: ScheduleVerb,
    name: String,
) {
    let op = match verb {
        ScheduleVerb::List => Op::List,
        ScheduleVerb::Get => Op::Get(name),
        ScheduleVerb::Put => Op::Put(name),
        ScheduleVerb::Pause => Op::Pause(name),
        ScheduleVerb::Resume => Op::Resume(name),
        ScheduleVerb::Delete => Op::Delete(name),
        ScheduleVerb::Trigger => Op::Trigger(name),
    };
    let body = match schedules::apply(rt, tenant, op, &msg.payload).await {
        Ok(v) => v,
        Err(e) => {
            tracing::info!(refusal = %e, "schedule request refused");
            schedules::error_body(&e)
        }
    };
    responder::reply(&rt.client, msg, &body).await;
}
