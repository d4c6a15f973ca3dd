//! Provider trouble (docs/ARCHITECTURE.md "Provider trouble"): where a step's call goes (the
//! run's model, a fallback, or nowhere yet), its place under the rate limits of the called
//! model, and the run's wait on its provider, recorded in the fleet's list and the journal.

use std::time::Duration;

use kedge_core::agent::AgentDefinition;
use kedge_core::decide::{StepPlan, TroubleMet};
use kedge_core::event::{AttemptOutcome, Timestamp, Trouble};
use kedge_core::fold::{ChatMessage, RunState};
use kedge_core::machine::RunStatus;
use kedge_model::ModelError;
use kedge_runtime::metrics;
use kedge_runtime::provider::{
    Admit, Endpoint, Limits, ProviderError, Providers, Route, TroubleReport, Waiter,
};

use super::commit::Writing;
use super::{DriveError, Driver};

impl Driver {
    /// This process's view of the fleet's model endpoints.
    pub(super) async fn providers(&self) -> Result<Providers, DriveError> {
        self.rt
            .providers()
            .await
            .map_err(|e| DriveError::Provider(ProviderError::Unavailable(e.to_string())))
    }

    /// Puts the run to wait on its provider after the plan's attempt met trouble or was held:
    /// the wait is recorded in the fleet's list first (the releaser finds it there), with the
    /// run's own backoff (growing with the step's waits, or the provider's `retry-after`);
    /// then `model.attempt` and `provider.waiting` are journaled
    /// ([`kedge_core::decide::wait_on_provider`]). The lease is let go when the drive ends: the
    /// run holds nothing while it waits. `queue`: where it waits.
    pub(super) async fn wait_on_provider(
        &self,
        state: &mut RunState,
        w: &mut Writing<'_>,
        plan: &StepPlan,
        queue: &WaitList<'_>,
        trouble: ProviderTrouble<'_>,
    ) -> Result<(), DriveError> {
        // While the endpoint's breaker is open the fleet decides when the run goes again (its
        // probes, then the release); only a run that meets trouble on an endpoint the fleet
        // finds healthy (a request the provider chokes on) waits out its own growing backoff,
        // and a run waiting its turn under a rate limit waits for its turn alone.
        let queued = trouble.why == metrics::ProviderWait::Queued;
        let backoff = if !queued && queue.providers.breaker(trouble.called).lets(None) {
            let waits = state
                .open_step
                .as_ref()
                .map_or(0, |o| o.free)
                .saturating_add(1);
            kedge_core::decide::model_retry_delay(
                waits,
                trouble.retry_after,
                self.rt.config.timeouts.max_retry_delay(),
                kedge_runtime::jitter_draw(),
            )
        } else {
            Duration::ZERO
        };
        let now = Timestamp::now();
        let since = state
            .provider
            .as_ref()
            .filter(|p| p.step == plan.step)
            .map_or(now, |p| p.since);
        let not_before = trouble
            .not_before
            .unwrap_or_else(|| now.saturating_add(backoff));
        let waiter = queue.waiter(state, since, not_before);
        queue.providers.wait(queue.endpoint, &waiter).await?;
        // A wait for a quota's window to roll is bounded from the window's end on.
        let bound = self.rt.config.providers.wait
            + trouble.not_before.map_or(Duration::ZERO, |nb| {
                (nb.0 - now.0).try_into().unwrap_or(Duration::ZERO)
            });
        let met = trouble.met;
        let committed = self
            .commit_attempt_end(state, w, &plan.request_id, |state| {
                kedge_core::decide::wait_on_provider(
                    state,
                    &plan.request_id,
                    met.clone(),
                    now,
                    bound,
                )
            })
            .await?;
        if committed && state.status == RunStatus::WaitingProvider {
            metrics::provider_wait(trouble.why);
        } else {
            // Not waiting after all (a cancel came first): the record would only cost a probe.
            queue.providers.forget(queue.endpoint, &state.run_id).await;
        }
        Ok(())
    }

    /// Keeps the fleet's list of runs waiting on a provider true to the journal at the end of
    /// a drive: a run that waits has its record (written again if it was lost), a run that
    /// stopped waiting other than by a release (cancelled, failed, its wait's bound passed)
    /// has it removed. `waited`: the run was waiting, unreleased, when the drive began.
    pub(super) async fn tend_provider_wait(
        &self,
        state: &RunState,
        waited: bool,
    ) -> Result<(), DriveError> {
        let waiting = state.status == RunStatus::WaitingProvider;
        if !waiting && !waited {
            return Ok(());
        }
        let Ok((def, _)) = self.definition(state).await? else {
            return Ok(());
        };
        let providers = self.providers().await?;
        let primary = Called::primary(state, &def);
        match &state.provider {
            Some(wait) if waiting && wait.released.is_none() => {
                let fallbacks: Vec<Endpoint> = def
                    .fallbacks
                    .iter()
                    .map(|f| Called::fallback(f).endpoint)
                    .collect();
                let queue = WaitList {
                    providers: &providers,
                    endpoint: &primary.endpoint,
                    turn: primary.turn(&self.rt.config, &providers, &def, &[]),
                    fallbacks: &fallbacks,
                    fallback_after: (!def.fallbacks.is_empty()).then(|| def.fallback_after()),
                };
                let waiter = queue.waiter(state, wait.since, Timestamp::now());
                providers.ensure_waiting(&primary.endpoint, &waiter).await?;
            }
            _ if !waiting => providers.forget(&primary.endpoint, &state.run_id).await,
            _ => {}
        }
        Ok(())
    }
}

/// A step's model call that met provider trouble (or was held, or waits its turn), for
/// [`Driver::wait_on_provider`].
pub(super) struct ProviderTrouble<'a> {
    /// The endpoint the call went to (or would have): the run's model's, or a fallback's.
    pub(super) called: &'a Endpoint,
    pub(super) met: TroubleMet,
    pub(super) retry_after: Option<Duration>,
    pub(super) why: metrics::ProviderWait,
    /// Not released before this (a tenant over its quota of the day: the window's end).
    pub(super) not_before: Option<Timestamp>,
}

impl<'a> ProviderTrouble<'a> {
    /// A call that did not go to `called`: held by its breaker (`trouble` its endpoint's), or
    /// queued for its turn under its rate limits (`trouble` is `RateLimited`); `reason` says
    /// why, in the attempt's outcome and the wait's message.
    pub(super) fn held(
        called: &'a Endpoint,
        reason: String,
        trouble: Trouble,
        why: metrics::ProviderWait,
    ) -> Self {
        ProviderTrouble {
            called,
            met: TroubleMet {
                outcome: AttemptOutcome::Held {
                    endpoint: called.label.clone(),
                    reason: reason.clone(),
                },
                trouble,
                endpoint: called.label.clone(),
                message: reason,
            },
            retry_after: None,
            why,
            not_before: None,
        }
    }

    /// A call to `called` that failed with the provider's trouble `e`.
    pub(super) fn met(called: &'a Endpoint, e: &ModelError) -> Self {
        let trouble = e.trouble.unwrap_or(Trouble::Unavailable);
        ProviderTrouble {
            called,
            met: TroubleMet {
                outcome: e.to_attempt_outcome(),
                trouble,
                endpoint: called.label.clone(),
                message: e.message.clone(),
            },
            retry_after: e.retry_after,
            why: match trouble {
                Trouble::Unavailable => metrics::ProviderWait::Unavailable,
                Trouble::RateLimited => metrics::ProviderWait::RateLimited,
            },
            not_before: None,
        }
    }
}

/// Where a run waits on its provider: always the wait list of its own model's endpoint (the
/// releaser of that endpoint lets it go: to its own model, or to a fallback), with what its
/// release needs to know.
pub(super) struct WaitList<'a> {
    pub(super) providers: &'a Providers,
    pub(super) endpoint: &'a Endpoint,
    /// The run's place under its own model's rate limits, when it has any.
    pub(super) turn: Option<Turn>,
    pub(super) fallbacks: &'a [Endpoint],
    pub(super) fallback_after: Option<Duration>,
}

impl WaitList<'_> {
    fn waiter(&self, state: &RunState, since: Timestamp, not_before: Timestamp) -> Waiter {
        Waiter {
            run_id: state.run_id.clone(),
            tenant: state.bundle.tenant.clone(),
            since,
            not_before,
            pace: self.turn.as_ref().map(|t| t.pace.clone()),
            tokens: self.turn.as_ref().map_or(0, |t| t.tokens),
            fallbacks: self.fallbacks.iter().map(|e| e.id.clone()).collect(),
            fallback_after_ms: self
                .fallback_after
                .map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
        }
    }
}

/// A model a step may call: the run's own (frozen in `run.created`) or one of its agent's
/// fallbacks, with the variable holding its key and its endpoint.
pub(super) struct Called {
    pub(super) spec: kedge_core::event::ModelSpec,
    pub(super) key_var: String,
    pub(super) endpoint: Endpoint,
}

impl Called {
    pub(super) fn primary(state: &RunState, def: &AgentDefinition) -> Called {
        let key_var = kedge_model::api_key_env(def);
        Called {
            endpoint: Endpoint::new(&state.bundle.model, &key_var),
            spec: state.bundle.model.clone(),
            key_var,
        }
    }

    pub(super) fn fallback(f: &kedge_core::agent::FallbackModel) -> Called {
        let key_var = kedge_model::fallback_key_env(f);
        Called {
            endpoint: Endpoint::new(&f.model, &key_var),
            spec: f.model.clone(),
            key_var,
        }
    }

    /// The call's place under the model's rate limits at its endpoint (configured, or named
    /// by the provider), when it has any.
    pub(super) fn turn(
        &self,
        config: &kedge_runtime::config::Config,
        providers: &Providers,
        def: &AgentDefinition,
        context: &[ChatMessage],
    ) -> Option<Turn> {
        let configured = configured_limits(config, &self.spec, &self.key_var);
        let limits = providers.limits(&self.endpoint, &self.spec.name, configured);
        (!limits.is_none()).then(|| Turn {
            pace: self.endpoint.pace_id(&self.spec.name),
            configured,
            tokens: if limits.tokens_per_minute.is_some() {
                request_tokens(def, context)
            } else {
                0
            },
        })
    }
}

/// A call's place under the rate limits of its model at its endpoint: the pace its slot is
/// reserved on, the limits this process is configured with, and its input tokens as estimated.
#[derive(Debug, Clone)]
pub(super) struct Turn {
    pub(super) pace: String,
    pub(super) configured: Limits,
    pub(super) tokens: u64,
}

/// What a failed call tells its endpoint's breaker (`probe`: the call was the fleet's probe);
/// `None` for a failure that is not the provider's trouble.
pub(super) fn trouble_report(e: &ModelError, probe: bool) -> Option<TroubleReport> {
    e.trouble.map(|trouble| TroubleReport {
        trouble,
        message: e.message.clone(),
        retry_after: e.retry_after,
        probe,
    })
}

/// The limits this process's configuration (`providers.limits`) sets for calls to `spec`'s
/// endpoint with the key in `key_var`.
fn configured_limits(
    config: &kedge_runtime::config::Config,
    spec: &kedge_core::event::ModelSpec,
    key_var: &str,
) -> Limits {
    config
        .providers
        .limit_for(spec, key_var)
        .map(|l| Limits {
            requests_per_minute: l.requests_per_minute,
            tokens_per_minute: l.tokens_per_minute,
        })
        .unwrap_or_default()
}

/// A request's input tokens, as estimated before it is sent: the system prompt, the tools and
/// the context ([`kedge_core::context::estimate`]).
fn request_tokens(def: &AgentDefinition, context: &[ChatMessage]) -> u64 {
    kedge_model::context::overhead_tokens(&def.system_prompt, &def.tools).saturating_add(
        context
            .iter()
            .map(kedge_core::context::estimate)
            .sum::<u64>(),
    )
}

/// The model a call goes to by `route`, and whether the call is the fleet's probe of its
/// endpoint: the run's own model (`primary`) unless the route names one of its `fallbacks`.
/// A held call is waited on under the run's own model.
pub(super) fn routed<'a>(
    route: &Route,
    primary: &'a Called,
    fallbacks: &'a [Called],
) -> (&'a Called, bool) {
    match route {
        Route::Fallback(i) => match fallbacks.get(*i) {
            Some(f) => (f, false),
            None => (primary, false),
        },
        Route::Primary { probe } => (primary, *probe),
        Route::Hold { .. } => (primary, false),
    }
}

/// Whether a call to `called` waits on its provider instead of going now: held, for the run's
/// model's endpoint is failing (`route`); or queued, for the called model's rate limits have no
/// slot for it soon (`turn`: its place under them, `None` when it has none to take). A turn
/// that comes within moments is waited for here.
pub(super) async fn hold_or_admit<'a>(
    route: Route,
    primary: &'a Called,
    called: &'a Called,
    turn: Option<&Turn>,
    providers: &Providers,
) -> Option<ProviderTrouble<'a>> {
    if let Route::Hold {
        reason, trouble, ..
    } = route
    {
        tracing::debug!(endpoint = %primary.endpoint.label, "model call held: its endpoint is failing");
        let why = metrics::ProviderWait::Held;
        return Some(ProviderTrouble::held(
            &primary.endpoint,
            reason,
            trouble,
            why,
        ));
    }
    if let Some(t) = turn {
        match providers
            .admit(&called.endpoint, &called.spec.name, t.configured, t.tokens)
            .await
        {
            Admit::After(wait) => tokio::time::sleep(wait).await,
            Admit::Queue { reason } => {
                tracing::debug!(endpoint = %called.endpoint.label, %reason, "model call waits its turn");
                let (trouble, why) = (Trouble::RateLimited, metrics::ProviderWait::Queued);
                return Some(ProviderTrouble::held(
                    &called.endpoint,
                    reason,
                    trouble,
                    why,
                ));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use kedge_core::event::ModelSpec;
    use kedge_model::ModelErrorKind;

    fn spec(name: &str, base_url: &str) -> ModelSpec {
        ModelSpec {
            name: name.into(),
            base_url: Some(base_url.into()),
            ..kedge_core::fixtures::run_created("demo", "hello").model
        }
    }

    fn called(name: &str, base_url: &str) -> Called {
        let spec = spec(name, base_url);
        Called {
            endpoint: Endpoint::new(&spec, "OPENAI_API_KEY"),
            spec,
            key_var: "OPENAI_API_KEY".into(),
        }
    }

    fn error(trouble: Option<Trouble>, retry_after: Option<Duration>) -> ModelError {
        ModelError {
            class: kedge_core::event::ErrorClass::Retryable,
            kind: ModelErrorKind::Status,
            status: Some(429),
            retry_after,
            message: "slow down".into(),
            trouble,
        }
    }

    fn definition() -> AgentDefinition {
        let def = serde_json::json!({
            "name": "demo",
            "system_prompt": "You are helpful.",
            "model": {"provider": "openai", "name": "mock-demo", "base_url": "http://127.0.0.1:1/v1"},
            "tools": [{"name": "read_file", "description": "Read a file",
                       "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}],
            "policy": {"read_file": {"approval": "never"}}
        });
        AgentDefinition::parse(def.to_string().as_bytes()).expect("a valid definition")
    }

    #[test]
    fn a_route_picks_the_model_called_and_whether_the_call_probes() {
        let primary = called("own", "http://a.test/v1");
        let fallbacks = [
            called("first", "http://b.test/v1"),
            called("second", "http://c.test/v1"),
        ];
        let pick = |route: Route| {
            let (c, probe) = routed(&route, &primary, &fallbacks);
            (c.spec.name.clone(), probe)
        };
        assert_eq!(pick(Route::Primary { probe: false }), ("own".into(), false));
        assert_eq!(pick(Route::Primary { probe: true }), ("own".into(), true));
        assert_eq!(pick(Route::Fallback(0)), ("first".into(), false));
        assert_eq!(pick(Route::Fallback(1)), ("second".into(), false));
        // An index the run's fallbacks do not have: its own model.
        assert_eq!(pick(Route::Fallback(2)), ("own".into(), false));
        let hold = Route::Hold {
            reason: "failing".into(),
            trouble: Trouble::Unavailable,
        };
        assert_eq!(pick(hold), ("own".into(), false));
    }

    #[test]
    fn a_call_that_did_not_go_records_where_and_why() {
        let c = called("own", "http://a.test/v1");
        let why = metrics::ProviderWait::Queued;
        let t = ProviderTrouble::held(&c.endpoint, "no slot".into(), Trouble::RateLimited, why);
        assert_eq!(t.called.id, c.endpoint.id);
        assert_eq!(
            t.met.outcome,
            AttemptOutcome::Held {
                endpoint: c.endpoint.label.clone(),
                reason: "no slot".into(),
            }
        );
        assert_eq!(t.met.trouble, Trouble::RateLimited);
        assert_eq!(t.met.endpoint, c.endpoint.label);
        assert_eq!(t.met.message, "no slot");
        assert_eq!(t.retry_after, None);
        assert_eq!(t.why, metrics::ProviderWait::Queued);
    }

    #[test]
    fn provider_trouble_is_waited_on_as_the_trouble_it_is() {
        let c = called("own", "http://a.test/v1");
        let seven = Some(Duration::from_secs(7));
        let limited = error(Some(Trouble::RateLimited), seven);
        let t = ProviderTrouble::met(&c.endpoint, &limited);
        assert_eq!(t.why, metrics::ProviderWait::RateLimited);
        assert_eq!(t.met.trouble, Trouble::RateLimited);
        assert_eq!(t.met.outcome, limited.to_attempt_outcome());
        assert_eq!(t.met.endpoint, c.endpoint.label);
        assert_eq!(t.met.message, "slow down");
        assert_eq!(t.retry_after, seven);
        let down = error(Some(Trouble::Unavailable), None);
        let t = ProviderTrouble::met(&c.endpoint, &down);
        assert_eq!(t.why, metrics::ProviderWait::Unavailable);
        assert_eq!(t.met.trouble, Trouble::Unavailable);
        assert_eq!(t.retry_after, None);
    }

    #[test]
    fn only_the_providers_trouble_is_reported_to_its_breaker() {
        assert!(trouble_report(&error(None, None), true).is_none());
        let three = Some(Duration::from_secs(3));
        let report =
            trouble_report(&error(Some(Trouble::RateLimited), three), true).expect("a report");
        assert_eq!(report.trouble, Trouble::RateLimited);
        assert_eq!(report.message, "slow down");
        assert_eq!(report.retry_after, three);
        assert!(report.probe);
        let report =
            trouble_report(&error(Some(Trouble::Unavailable), None), false).expect("a report");
        assert!(!report.probe);
    }

    #[test]
    fn a_requests_tokens_are_its_overhead_and_its_context() {
        let def = definition();
        let overhead = kedge_model::context::overhead_tokens(&def.system_prompt, &def.tools);
        assert!(overhead > 0);
        assert_eq!(request_tokens(&def, &[]), overhead);
        let context = [
            ChatMessage::User {
                text: "hello ".repeat(200),
            },
            ChatMessage::User { text: "hi".into() },
        ];
        let expected = overhead
            + kedge_core::context::estimate(&context[0])
            + kedge_core::context::estimate(&context[1]);
        assert_eq!(request_tokens(&def, &context), expected);
        assert!(request_tokens(&def, &context) > request_tokens(&def, &context[1..]));
    }

    #[test]
    fn a_runs_own_model_is_the_one_its_run_created_froze() {
        let def = definition();
        let created = kedge_core::event::Envelope::new(
            "run_frozen1".parse().expect("a run id"),
            Timestamp::now(),
            kedge_core::event::Draft::new(kedge_core::event::Event::RunCreated(Box::new(
                kedge_core::fixtures::run_created("demo", "hello"),
            ))),
        );
        let state = kedge_core::fold::fold([(1, &created)]).expect("folds");
        let own = Called::primary(&state, &def);
        // Not the definition's model as it is now: the run keeps calling what it started on.
        assert_eq!(own.spec, state.bundle.model);
        assert_ne!(own.spec.name, def.model.name);
        assert_eq!(own.key_var, kedge_model::api_key_env(&def));
        assert_eq!(
            own.endpoint,
            Endpoint::new(&state.bundle.model, &own.key_var)
        );
    }
}
