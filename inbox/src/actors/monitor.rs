//! [`Monitor`]: what a service watches of its runtime, on a handle it can
//! keep.

use std::sync::Arc;
use std::time::Duration;

use crate::actors::health::{Health, HealthState, Probe};
use crate::actors::stats::{Stats, StatsSnapshot};

/// The runtime's health and stats, cheap to clone and to keep after the
/// runtime has moved into [`run_until`](crate::Runtime::run_until): hand it
/// to the HTTP server's health endpoints, or to a progress log.
#[derive(Clone)]
pub struct Monitor {
    pub(crate) health: Arc<HealthState>,
    pub(crate) stats: Arc<Stats>,
}

impl std::fmt::Debug for Monitor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Monitor").finish_non_exhaustive()
    }
}

impl Monitor {
    /// Liveness and readiness now, with the reasons (see [`Health`]).
    pub async fn health(&self) -> Health {
        Health {
            live: self.live(),
            ready: self.ready().await,
        }
    }

    /// Live: every actor of the runtime runs. Asks nothing of the database
    /// or the broker.
    pub fn live(&self) -> Probe {
        self.health.live()
    }

    /// Ready: every configured queue's consumer is connected, the database
    /// answers (a `SELECT 1` within a second, unless an outage is being
    /// waited out or every connection is busy with messages), and the
    /// runtime is not draining.
    pub async fn ready(&self) -> Probe {
        self.health.ready().await
    }

    /// What the runtime has done so far.
    pub fn stats(&self) -> StatsSnapshot {
        self.stats.snapshot()
    }

    /// The `quantile` (0.5 for the median, 0.99…) of the time from a
    /// delivery's arrival to its ack, over every message acked so far, as
    /// the upper bound of its histogram bucket (a quarter of an octave
    /// wide: within about 19%). `None` before the first ack.
    pub fn latency_quantile(&self, quantile: f64) -> Option<Duration> {
        self.stats.latency_quantile(quantile)
    }
}
