//! The services `kedge serve` runs, by name.

/// A service `kedge serve` runs (`kedge serve all`, `kedge serve step tool`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Service {
    All,
    Intake,
    Step,
    Tool,
    Approval,
    Timer,
    Reconciler,
    /// The kedge_runs projection (part of `all`).
    Projector,
    /// The HTTP API and SSE (not part of `all`: it opens a port and needs tokens or open mode).
    Bridge,
    /// The tenants' NATS API (`kedge.t.<tenant>.>`; part of `all`).
    Gateway,
    /// The retention policy (`retention` in the config; not part of `all`: it runs with the
    /// `retention` user's credentials, the one service user allowed to purge).
    Retention,
}

impl Service {
    /// Every service, `All` first.
    pub const EVERY: [Service; 11] = [
        Service::All,
        Service::Intake,
        Service::Step,
        Service::Tool,
        Service::Approval,
        Service::Timer,
        Service::Reconciler,
        Service::Projector,
        Service::Bridge,
        Service::Gateway,
        Service::Retention,
    ];

    /// Its name on the command line (`kedge serve <name>`), in log lines and in readiness.
    pub const fn name(self) -> &'static str {
        match self {
            Service::All => "all",
            Service::Intake => "intake",
            Service::Step => "step",
            Service::Tool => "tool",
            Service::Approval => "approval",
            Service::Timer => "timer",
            Service::Reconciler => "reconciler",
            Service::Projector => "projector",
            Service::Bridge => "bridge",
            Service::Gateway => "gateway",
            Service::Retention => "retention",
        }
    }
}

impl std::fmt::Display for Service {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
