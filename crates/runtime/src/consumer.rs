//! Durable pull consumers, configured from `nats/consumers/<STREAM>/<name>.json` (the form
//! `nats consumer add --config` takes), embedded in the binary. The ack wait comes from the
//! checked [`kedge_core::config::Timeouts`], so the file and the timeout relations cannot
//! disagree.

use std::time::Duration;

use async_nats::jetstream::Context;
use async_nats::jetstream::consumer::{PullConsumer, pull};

use crate::RuntimeError;

/// The consumers Kedge runs: (stream, file contents).
pub const CONSUMERS: &[(&str, &str, &str)] = &[
    (
        "KEDGE_TASKS",
        "intake",
        include_str!("../../../nats/consumers/KEDGE_TASKS/intake.json"),
    ),
    (
        "KEDGE_RUNS",
        "step",
        include_str!("../../../nats/consumers/KEDGE_RUNS/step.json"),
    ),
    (
        "KEDGE_RUNS",
        "tool",
        include_str!("../../../nats/consumers/KEDGE_RUNS/tool.json"),
    ),
    (
        "KEDGE_RUNS",
        "projector",
        include_str!("../../../nats/consumers/KEDGE_RUNS/projector.json"),
    ),
    (
        "KEDGE_RUNS",
        "timer",
        include_str!("../../../nats/consumers/KEDGE_RUNS/timer.json"),
    ),
    (
        "KEDGE_TIMERS",
        "timer-fired",
        include_str!("../../../nats/consumers/KEDGE_TIMERS/timer-fired.json"),
    ),
];

/// The parsed configuration of a named consumer, with `ack_wait` set.
pub fn config(
    name: &str,
    ack_wait: Duration,
) -> Result<(&'static str, pull::Config), RuntimeError> {
    let (stream, _, text) = CONSUMERS
        .iter()
        .find(|(_, n, _)| *n == name)
        .ok_or_else(|| RuntimeError::broker(format!("consumer {name}"), "no such consumer file"))?;
    let mut config: pull::Config = serde_json::from_str(text)
        .map_err(|e| RuntimeError::broker(format!("nats/consumers/{stream}/{name}.json"), e))?;
    config.ack_wait = ack_wait;
    Ok((stream, config))
}

/// Gets or creates the durable consumer `name`; an existing one is updated to the file's
/// configuration (consumers hold no data, so updating is safe).
pub async fn durable(
    js: &Context,
    name: &str,
    ack_wait: Duration,
) -> Result<PullConsumer, RuntimeError> {
    let (stream, config) = config(name, ack_wait)?;
    let stream_handle = js
        .get_stream(stream)
        .await
        .map_err(|e| RuntimeError::broker(format!("stream {stream}"), e))?;
    stream_handle
        .create_consumer(config)
        .await
        .map_err(|e| RuntimeError::broker(format!("consumer {stream}/{name}"), e))
}

/// The next message a consumer delivers; hiccups (missed heartbeats, a reconnect) are logged
/// and skipped. `None` once the stream has ended. Cancel-safe (for `select!`).
pub async fn next_message(
    messages: &mut pull::Stream,
    consumer: &str,
) -> Option<async_nats::jetstream::Message> {
    use futures::StreamExt as _;
    loop {
        match messages.next().await {
            Some(Ok(msg)) => return Some(msg),
            Some(Err(e)) => tracing::warn!(consumer, error = %e, "consumer hiccup"),
            None => return None,
        }
    }
}

/// Runs handlers with at most `n` at once; [`Workers::drain`] waits for those in flight (a
/// service's graceful stop).
#[derive(Debug, Clone)]
pub struct Workers {
    permits: std::sync::Arc<tokio::sync::Semaphore>,
    n: u32,
}

impl Workers {
    pub fn new(n: usize) -> Self {
        let n = u32::try_from(n.max(1)).unwrap_or(u32::MAX);
        Self {
            permits: std::sync::Arc::new(tokio::sync::Semaphore::new(n as usize)),
            n,
        }
    }

    /// Waits for a free slot and runs `task` on it.
    pub async fn spawn(&self, task: impl std::future::Future<Output = ()> + Send + 'static) {
        let permit = self.permits.clone().acquire_owned().await;
        tokio::spawn(async move {
            task.await;
            drop(permit);
        });
    }

    /// Waits until every running handler has finished.
    pub async fn drain(&self) {
        let _ = self.permits.acquire_many(self.n).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_step_consumer_wakes_on_every_input_but_tool_started() {
        use kedge_core::event::{EventKind, EventType};
        let (_, c) = config("step", Duration::from_secs(30)).expect("parses");
        let mut expected = vec!["agent.run.*.d.run.created".to_owned()];
        for t in EventType::ALL {
            if t.kind() == EventKind::Input && *t != EventType::ToolStarted {
                expected.push(format!("agent.run.*.i.{}", t.as_str()));
            }
        }
        let mut got = c.filter_subjects.clone();
        got.sort();
        expected.sort();
        assert_eq!(
            got, expected,
            "a new input type must wake the step (or be excluded here)"
        );
    }

    #[test]
    fn every_consumer_file_parses() {
        for (_, name, _) in CONSUMERS {
            let (_, c) = config(name, Duration::from_secs(7)).expect("parses");
            assert_eq!(c.durable_name.as_deref(), Some(*name));
            assert_eq!(c.ack_wait, Duration::from_secs(7));
        }
    }
}
