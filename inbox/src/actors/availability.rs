//! Waiting out a database outage.
//!
//! When the database cannot be reached, every message in flight fails the
//! same way, and none of them is to blame. The consumers hold such messages
//! (unacked: the prefetch then keeps the broker from sending more, so
//! consumption pauses) and wait here until the database answers again. One
//! waiter at a time probes it, with a growing pause; the outage is logged
//! once when it starts and once when it ends, not once per message.
//!
//! Available means writable: a primary that turned read-only (a failover
//! under way, a standby promoted elsewhere) answers queries but takes no
//! claim, so the probe asks whether the server is in recovery or read-only.
//! If it is, the pool's idle connections to it are closed: new ones follow
//! `database.url`'s host list (`target_session_attrs=read-write` picks the
//! writable server).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use tokio::sync::Mutex;
use tokio_postgres::SimpleQueryMessage;

use crate::Settings;
use crate::backoff::Backoff;
use crate::db::Connections;

/// The first pause between probes; doubled up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const MAX_PAUSE: Duration = Duration::from_secs(5);

/// `t` when the server takes writes: a primary, not read-only.
const WRITABLE: &str = "SELECT NOT pg_catalog.pg_is_in_recovery() AND pg_catalog.current_setting('transaction_read_only') = 'off'";

/// Whether a simple query's one row has `value` in its first column.
fn answer_is(answer: &[SimpleQueryMessage], value: &str) -> bool {
    answer.iter().any(|message| match message {
        SimpleQueryMessage::Row(row) => row.get(0) == Some(value),
        _ => false,
    })
}

/// The longest a readiness probe waits for the database: health endpoints
/// are asked with a timeout of a second or so.
const READY_PROBE_TIMEOUT: Duration = Duration::from_secs(1);

/// Shared by a runtime's consumers.
pub(crate) struct DatabaseGate {
    /// The runtime's connections: a probe takes its connection through
    /// their gate like any other work, so a database that is only full
    /// (every connection the server grants taken) is not taken for away.
    connections: Connections,
    /// Where the database is, for the log.
    endpoint: String,
    /// The longest a probe may take (`database.connect_timeout`): a network
    /// that drops packets answers nothing.
    probe_timeout: Duration,
    /// Held by the waiter that probes; the others queue behind it.
    probing: Mutex<()>,
    /// An outage has been logged and not yet its end.
    down: AtomicBool,
    /// Outages seen so far.
    outages: AtomicU64,
}

impl DatabaseGate {
    /// A gate over `connections`, whose database the start has reached.
    pub(crate) fn new(connections: Connections, settings: &Settings) -> Self {
        crate::actors::metrics::database_available(true);
        Self {
            connections,
            endpoint: settings.database_endpoint(),
            probe_timeout: settings.database.connect_timeout,
            probing: Mutex::new(()),
            down: AtomicBool::new(false),
            outages: AtomicU64::new(0),
        }
    }

    /// Returns once a connection from the pool answers a query. `reason` is
    /// the failure that sent the caller here, for the log. Returns whether
    /// an outage was seen while waiting: `false` means the database answered
    /// at once, and the failure that sent the caller here may have been the
    /// message's own doing after all (a handler that kills its connection).
    pub(crate) async fn wait_until_available(&self, reason: &str) -> bool {
        let outages = self.outages.load(Ordering::SeqCst);
        let _probing = self.probing.lock().await;
        if self.probe().await {
            // Another waiter may have seen an outage through meanwhile.
            return self.outages.load(Ordering::SeqCst) != outages;
        }
        if !self.down.swap(true, Ordering::SeqCst) {
            self.outages.fetch_add(1, Ordering::SeqCst);
            crate::actors::metrics::database_available(false);
            tracing::warn!(database = %self.endpoint, %reason, "database unavailable: holding messages in flight and pausing consumption until it answers");
        }
        let started = Instant::now();
        let mut backoff = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
        loop {
            tokio::time::sleep(backoff.next_pause()).await;
            if self.probe().await {
                break;
            }
        }
        if self.down.swap(false, Ordering::SeqCst) {
            crate::actors::metrics::database_available(true);
            tracing::warn!(after = ?started.elapsed(), "database available again: resuming");
        }
        true
    }

    /// Whether the database answers now, for readiness: not while an
    /// outage is being waited out; else a `SELECT 1` on an idle pooled
    /// connection, within [`READY_PROBE_TIMEOUT`]. When every connection
    /// the runtime may hold now is busy (the pool's size, or fewer where the
    /// server grants fewer), the database is evidently answering, and the
    /// probe would only queue behind them. Sets `inbox_database_available`.
    pub(crate) async fn is_available(&self) -> bool {
        let available = if self.down.load(Ordering::SeqCst) {
            false
        } else if self.connections.is_full() {
            true
        } else {
            tokio::time::timeout(READY_PROBE_TIMEOUT, self.probe())
                .await
                .unwrap_or(false)
        };
        crate::actors::metrics::database_available(available);
        available
    }

    /// Whether a pooled connection's server answers and takes writes.
    async fn probe(&self) -> bool {
        let limit = self.probe_timeout;
        let Ok(Ok(connection)) = tokio::time::timeout(limit, self.connections.get()).await else {
            return false;
        };
        match tokio::time::timeout(limit, connection.simple_query(WRITABLE)).await {
            Ok(Ok(answer)) if answer_is(&answer, "t") => true,
            Ok(Ok(_)) => {
                // Read-only: neither this connection nor the idle others
                // (most likely to the same server) are of use.
                connection.discard();
                let closed = self.connections.pool().retain(|_, _| false).removed.len();
                tracing::debug!(
                    closed,
                    "the database is read-only; closed the idle connections to it"
                );
                false
            }
            Ok(Err(_)) => false,
            Err(_) => {
                // No answer: a connection stuck like this one is no use to
                // the next message.
                connection.discard();
                false
            }
        }
    }
}
