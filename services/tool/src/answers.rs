//! Answers to the other services' requests on core NATS: the reconciler's request to resolve
//! an operation stuck in `running` (`kedge.tool.resolve`, handled like a redelivered request of
//! the operation's journaled `tool.requested`) and the precondition query asked before an
//! approval (`kedge.tool.inspect`: the target's current version) (docs/ARCHITECTURE.md "The tool
//! service", "Waiting and stopping").

use kedge_core::answers::{InspectReply, ResolveReply, TargetAnswer, TargetQuery};
use kedge_core::event::Envelope;
use kedge_core::fold::handled_by_step;
use tracing::Instrument;

use crate::Handled;
use crate::running::{execute, open_arguments};
use crate::service::Ctx;
use crate::target::Target;
use crate::verify::{self, CheckError};

/// Answers the reconciler's request to resolve an operation stuck in `running`: the same
/// handling as a redelivered request, of the operation's journaled `tool.requested` (the
/// request only names it); the reply says what it came to ([`ResolveReply`]).
pub(crate) async fn answer_resolve(ctx: &Ctx, request: async_nats::Message) {
    let reply = match ctx.rt.journal.open(&request.payload).await {
        Ok(claimed) => {
            let span = tracing::info_span!(
                "resolve",
                run_id = %claimed.run_id,
                op = claimed.op.as_ref().map(tracing::field::display),
                tool = tracing::field::Empty,
            );
            resolve(ctx, claimed).instrument(span).await
        }
        Err(e) => ResolveReply::Failed {
            error: e.to_string(),
        },
    };
    if let (Some(to), Ok(body)) = (request.reply, serde_json::to_vec(&reply))
        && let Err(e) = ctx.rt.client.publish(to, body.into()).await
    {
        tracing::warn!(error = %e, "cannot answer a resolve request");
    }
}

async fn resolve(ctx: &Ctx, claimed: Envelope) -> ResolveReply {
    let failed = |error: String| ResolveReply::Failed { error };
    let (op, req) = match verify::journaled(&ctx.rt.journal, claimed).await {
        Ok(checked) => checked,
        Err(CheckError::Refused(refusal)) => {
            tracing::warn!(reason = %refusal, "resolve request refused: not what the journal decided");
            return ResolveReply::Handled(Handled::Refused {
                reason: refusal.to_string(),
            });
        }
        Err(e) => {
            tracing::warn!(error = %e, "cannot check a resolve request against the journal");
            return failed(e.to_string());
        }
    };
    if handled_by_step(&req.tool) {
        return failed("handled by the step service, not a tool runner".into());
    }
    tracing::Span::current().record("tool", req.tool.as_str());
    match execute(ctx, &op, &req, None, None, None).await {
        Ok(handled) => {
            tracing::info!(?handled, "resolved at the reconciler's request");
            ResolveReply::Handled(handled)
        }
        Err(e) => failed(e.to_string()),
    }
}

/// Answers a precondition query (`kedge.tool.inspect`) with the target's current version, for a
/// run that exists and a tool its agent declares (else a refusal). When that cannot be checked
/// (broker trouble) there is no answer: the asker's timeout makes it ask again, where an error
/// answer could be taken for "no version".
pub(crate) async fn answer_inspect(ctx: &Ctx, request: async_nats::Message) {
    let reply = match serde_json::from_slice::<TargetQuery>(&request.payload) {
        Ok(q) => {
            let span = tracing::info_span!("inspect", run_id = %q.run_id, tool = %q.tool);
            match verify::inspectable(&ctx.rt.journal, &ctx.rt.agents, &q)
                .instrument(span.clone())
                .await
            {
                Ok(()) => {
                    let version = match open_arguments(&ctx.rt, &q.run_id, &q.arguments) {
                        Ok(arguments) => {
                            Target::of(&q.tool, &ctx.mcp)
                                .version(&ctx.env, &q.run_id, &arguments)
                                .await
                        }
                        Err(_) => None,
                    };
                    InspectReply::Version(TargetAnswer { version })
                }
                Err(CheckError::Refused(refusal)) => {
                    span.in_scope(|| {
                        tracing::warn!(reason = %refusal, "precondition query refused");
                    });
                    InspectReply::Refused {
                        refused: refusal.to_string(),
                    }
                }
                Err(e) => {
                    span.in_scope(|| {
                        tracing::warn!(error = %e, "cannot check a precondition query; not answering");
                    });
                    return;
                }
            }
        }
        Err(e) => InspectReply::Invalid {
            error: e.to_string(),
        },
    };
    kedge_runtime::responder::reply(&ctx.rt.client, &request, &reply).await;
}
