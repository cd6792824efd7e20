//! [`Health`]: whether the runtime is live and whether it is ready, with
//! the reasons when it is not, for a service's health endpoints.
//!
//! - **Live** while the runtime's actors run. A database or broker that is
//!   away never makes it fail: restarting the service would not bring them
//!   back, and restarts during an outage make it worse.
//! - **Ready** when every configured queue's consumer is connected, the
//!   database answers and the runtime is not draining. A queue an
//!   operator paused is not a reason: it is listed in `paused` (the
//!   service still serves its operators, who resume it from there).

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use crate::actors::availability::DatabaseGate;

/// One probe's verdict, and why when it fails.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Probe {
    /// Whether it passes.
    pub ok: bool,
    /// Why not, one line each (empty when it passes).
    pub reasons: Vec<String>,
    /// The queues an operator paused (readiness only).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub paused: Vec<String>,
}

impl Probe {
    fn of(reasons: Vec<String>) -> Self {
        Self {
            ok: reasons.is_empty(),
            reasons,
            paused: Vec::new(),
        }
    }
}

/// The runtime's liveness and readiness.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct Health {
    /// Live: the actors run.
    pub live: Probe,
    /// Ready: consuming every queue, database available, not draining.
    pub ready: Probe,
}

/// Whether an actor still runs (its mailbox is open).
type Running = Box<dyn Fn() -> bool + Send + Sync>;

/// A consumer as health sees it.
#[derive(Clone)]
pub(crate) struct Consumer {
    queue: String,
    connected: Arc<AtomicBool>,
    paused: Arc<AtomicBool>,
}

/// What the runtime's parts report, read by [`Monitor`](crate::Monitor).
pub(crate) struct HealthState {
    /// The queues the settings ask to consume (over a broker).
    pub(crate) queues: Vec<String>,
    /// Each consumer's queue, whether it is connected, and whether an
    /// operator paused it, once consuming.
    pub(crate) consumers: Mutex<Vec<Consumer>>,
    /// The runtime's actors, by name.
    pub(crate) actors: Mutex<Vec<(String, Running)>>,
    pub(crate) database: Arc<DatabaseGate>,
    pub(crate) draining: AtomicBool,
}

impl HealthState {
    pub(crate) fn new(queues: Vec<String>, database: Arc<DatabaseGate>) -> Self {
        Self {
            queues,
            consumers: Mutex::new(Vec::new()),
            actors: Mutex::new(Vec::new()),
            database,
            draining: AtomicBool::new(false),
        }
    }

    pub(crate) fn watch_actor(
        &self,
        name: impl Into<String>,
        running: impl Fn() -> bool + Send + Sync + 'static,
    ) {
        if let Ok(mut actors) = self.actors.lock() {
            actors.push((name.into(), Box::new(running)));
        }
    }

    pub(crate) fn watch_consumer(&self, queue: &str, connected: Arc<AtomicBool>, paused: Arc<AtomicBool>) {
        if let Ok(mut consumers) = self.consumers.lock() {
            consumers.push(Consumer {
                queue: queue.to_owned(),
                connected,
                paused,
            });
        }
    }

    /// Live: every actor of the runtime runs. Asks nothing of the database
    /// or the broker.
    pub(crate) fn live(&self) -> Probe {
        let stopped = self
            .actors
            .lock()
            .map(|actors| {
                actors
                    .iter()
                    .filter(|(_, running)| !running())
                    .map(|(name, _)| format!("the {name} has stopped"))
                    .collect()
            })
            .unwrap_or_default();
        Probe::of(stopped)
    }

    /// Ready: every configured queue's consumer is connected, the database
    /// answers (a `SELECT 1` within a second, unless an outage is being
    /// waited out or every connection is busy with messages), and the
    /// runtime is not draining.
    pub(crate) async fn ready(&self) -> Probe {
        let state = self;
        let mut reasons = Vec::new();
        if state.draining.load(Ordering::Relaxed) {
            reasons.push("draining: the runtime is shutting down".to_owned());
        }
        let consumers = state.consumers.lock().map(|c| c.clone()).unwrap_or_default();
        let mut paused = Vec::new();
        for queue in &state.queues {
            match consumers.iter().find(|consumer| &consumer.queue == queue) {
                None => reasons.push(format!("queue {queue} is not consumed yet")),
                Some(consumer) if consumer.paused.load(Ordering::Relaxed) => paused.push(queue.clone()),
                Some(consumer) if !consumer.connected.load(Ordering::Relaxed) => reasons.push(format!(
                    "the consumer of queue {queue} is not connected to the broker"
                )),
                Some(_) => {}
            }
        }
        if !state.database.is_available().await {
            reasons.push("the database is unavailable".to_owned());
        }
        Probe {
            paused,
            ..Probe::of(reasons)
        }
    }
}
