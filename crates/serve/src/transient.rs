//! Kedge's services in a process that is not `kedge serve`: the end-to-end tests, the benches and
//! `kedge demo` start them here, through [`serve`] like the binary (docs/ARCHITECTURE.md
//! "Tests"), so they are supervised, restarted, registered and drained the same way.

use std::sync::{Arc, Mutex};

use kedge_runtime::{Config, Runtime};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::{Service, serve};

/// Sets of Kedge's services running in this process. Each [`TransientKedge::start`] is one
/// `kedge serve` process's worth: its own configuration (worker id, credentials), connection and
/// services, run by [`serve`] until it is stopped (drained, as at SIGTERM), killed (dropped where
/// it is, as when a process dies) or ends by itself (a service that cannot start). Several sets
/// side by side are several processes; one set per service lets a test stop one service alone.
///
/// It starts no broker: the configuration names one (the test kit starts nats-server for the
/// tests). Dropped, it kills what still runs.
#[derive(Debug, Default)]
pub struct TransientKedge {
    sets: Vec<Set>,
}

/// One set of services a [`TransientKedge`] started: what [`TransientKedge::stop`],
/// [`TransientKedge::kill`] and [`TransientKedge::wait`] take.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Started(usize);

#[derive(Debug)]
struct Set {
    services: Vec<Service>,
    state: State,
    /// The set's own connection, once made (none for [`TransientKedge::start_on`]: the caller's).
    connection: Connection,
}

/// Where a set started by [`TransientKedge::start`] keeps its runtime, to close its connection
/// when it ends however it ends: readiness keeps a handle on the last connection a [`serve`]
/// registered, so dropping the set's handles alone would leave that one open.
type Connection = Arc<Mutex<Option<Runtime>>>;

#[derive(Debug)]
enum State {
    Running {
        /// Sent (or dropped): the set's services drain and [`serve`] returns.
        stop: Option<oneshot::Sender<()>>,
        task: JoinHandle<Result<(), String>>,
    },
    /// How it ended: `Err` when it could not connect or a service could not start.
    Ended(Result<(), String>),
}

impl TransientKedge {
    /// Nothing running yet.
    pub fn new() -> TransientKedge {
        TransientKedge::default()
    }

    /// Connects with `config` (the broker layout checked, as `kedge serve` does) and runs
    /// `services` through [`serve`] until stopped. Returns at once: the connection is made in
    /// the set's own task (so this must be called within a Tokio runtime), and one that fails
    /// ends the set with that error ([`TransientKedge::wait`], [`TransientKedge::stop`]). The
    /// connection is the set's own, closed when it ends (stopped, killed, or by itself).
    pub fn start(&mut self, config: Config, services: &[Service]) -> Started {
        let connection = Connection::default();
        let slot = connection.clone();
        self.launch(services, connection, |services, stop| async move {
            let rt = Runtime::connect(config)
                .await
                .map_err(|e| format!("connect: {e}"))?;
            if let Ok(mut slot) = slot.lock() {
                *slot = Some(rt.clone());
            }
            let outcome = serve(rt, &services, stop)
                .await
                .map_err(|e| format!("{e:#}"));
            close(&slot).await;
            outcome
        })
    }

    /// [`TransientKedge::start`] on a runtime already connected (its connection is shared with
    /// whoever else holds it).
    pub fn start_on(&mut self, rt: Runtime, services: &[Service]) -> Started {
        self.launch(
            services,
            Connection::default(),
            |services, stop| async move {
                serve(rt, &services, stop)
                    .await
                    .map_err(|e| format!("{e:#}"))
            },
        )
    }

    fn launch<F>(
        &mut self,
        services: &[Service],
        connection: Connection,
        run: impl FnOnce(Vec<Service>, Stopped) -> F,
    ) -> Started
    where
        F: std::future::Future<Output = Result<(), String>> + Send + 'static,
    {
        let (stop, stopped) = oneshot::channel::<()>();
        let stopped: Stopped = Box::pin(async move {
            let _ = stopped.await;
        });
        let names: Vec<&str> = services.iter().map(|s| s.name()).collect();
        let names = names.join(" ");
        let run = run(services.to_vec(), stopped);
        let task = tokio::spawn(async move {
            let outcome = run.await;
            if let Err(e) = &outcome {
                tracing::error!(services = %names, error = %e, "in-process services ended");
            }
            outcome
        });
        self.sets.push(Set {
            services: services.to_vec(),
            state: State::Running {
                stop: Some(stop),
                task,
            },
            connection,
        });
        Started(self.sets.len() - 1)
    }

    /// The services of a set, as started.
    pub fn services(&self, which: Started) -> &[Service] {
        &self.sets[which.0].services
    }

    /// Whether a set still runs (not stopped, killed or ended by itself).
    pub fn is_running(&self, which: Started) -> bool {
        match &self.sets[which.0].state {
            State::Running { task, .. } => !task.is_finished(),
            State::Ended(_) => false,
        }
    }

    /// Waits until a set ends by itself (it could not connect, or a service could not start:
    /// the error), without stopping it; at once for one that ended.
    pub async fn wait(&mut self, which: Started) -> anyhow::Result<()> {
        let set = &mut self.sets[which.0];
        if let State::Running { task, .. } = &mut set.state {
            let outcome = task.await.unwrap_or_else(|e| Err(e.to_string()));
            set.state = State::Ended(outcome);
        }
        outcome(&set.state)
    }

    /// Stops a set: its services drain as at SIGTERM (bounded by the configuration's drain
    /// time); returns once [`serve`] returned, with how it ended.
    pub async fn stop(&mut self, which: Started) -> anyhow::Result<()> {
        self.signal(which);
        self.wait(which).await
    }

    /// Kills a set: its services' runs are dropped where they are, with no drain, as when the
    /// process dies, and its own connection is closed (a [`TransientKedge::start_on`] runtime
    /// is the caller's, and stays). Returns once its [`serve`] is gone; its runs are cancelled
    /// at their next await.
    pub async fn kill(&mut self, which: Started) {
        let set = &mut self.sets[which.0];
        if let State::Running { task, .. } = &mut set.state {
            task.abort();
            let _ = task.await;
            set.state = State::Ended(Ok(()));
        }
        close(&set.connection).await;
    }

    /// Stops every set still running, all draining together, and waits for them; the first
    /// error of any set (stopped now or ended before).
    pub async fn shutdown(&mut self) -> anyhow::Result<()> {
        let all: Vec<Started> = (0..self.sets.len()).map(Started).collect();
        for which in &all {
            self.signal(*which);
        }
        let mut first = Ok(());
        for which in all {
            let outcome = self.wait(which).await;
            if first.is_ok() {
                first = outcome;
            }
        }
        first
    }

    fn signal(&mut self, which: Started) {
        if let State::Running { stop, .. } = &mut self.sets[which.0].state
            && let Some(stop) = stop.take()
        {
            let _ = stop.send(());
        }
    }
}

/// The stop future [`serve`] gets.
type Stopped = std::pin::Pin<Box<dyn std::future::Future<Output = ()> + Send>>;

/// Closes a set's own connection, if it has one still open.
async fn close(connection: &Connection) {
    if let Some(rt) = take(connection) {
        let _ = rt.client.drain().await;
    }
}

fn take(connection: &Connection) -> Option<Runtime> {
    connection.lock().ok().and_then(|mut rt| rt.take())
}

fn outcome(state: &State) -> anyhow::Result<()> {
    match state {
        State::Ended(Ok(())) => Ok(()),
        State::Ended(Err(e)) => Err(anyhow::anyhow!(e.clone())),
        State::Running { .. } => Ok(()),
    }
}

impl Drop for TransientKedge {
    fn drop(&mut self) {
        for set in &self.sets {
            if let State::Running { task, .. } = &set.state {
                task.abort();
            }
            // Closing a connection only sends a command to its handler: a task of a moment,
            // spawned while there is a runtime to spawn on.
            if let Some(rt) = take(&set.connection)
                && let Ok(handle) = tokio::runtime::Handle::try_current()
            {
                handle.spawn(async move {
                    let _ = rt.client.drain().await;
                });
            }
        }
    }
}
