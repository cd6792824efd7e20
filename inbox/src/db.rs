//! The inbox's connection pool.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use deadpool_postgres::{
    Manager, ManagerConfig, Object, Pool, PoolError, RecyclingMethod, Runtime, TimeoutType,
};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};

use crate::error::{Error, Result};
use crate::settings::Settings;

/// Builds the pool from `[database]`. No connection is made until first use.
///
/// Recycling is `Fast` (no query per checkout): [`UnitOfWork`](crate::UnitOfWork)
/// never returns a connection inside a transaction, so a `ROLLBACK` on every
/// recycle would be a round trip per message for nothing.
pub fn create_pool(settings: &Settings) -> Result<Pool> {
    build_pool(settings, settings.pg_config()?)
}

/// [`create_pool`] for a process that runs its own outbox dispatcher and
/// wakes it in process after every commit that staged messages: its
/// sessions say so (`inbox.outbox_notify=off`), and their commits skip the
/// `NOTIFY` meant for dispatchers elsewhere. A notifying commit holds a
/// database-wide lock through its flush to disk, so commits that notify go
/// one at a time; without it they are flushed together. Rows the process
/// commits are still found by any other instance's poll.
pub(crate) fn create_dispatching_pool(settings: &Settings) -> Result<Pool> {
    let mut config = settings.pg_config()?;
    let options = format!(
        "{} -c inbox.outbox_notify=off",
        config.get_options().unwrap_or_default()
    );
    config.options(options.trim_start());
    build_pool(settings, config)
}

fn build_pool(settings: &Settings, config: tokio_postgres::Config) -> Result<Pool> {
    let manager = Manager::from_config(
        config,
        settings.pg_tls()?,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(settings.database.pool_size)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(settings.database.connect_timeout))
        // Connections free up as transactions end, each within its bound.
        .wait_timeout(Some(settings.database.transaction_timeout))
        .recycle_timeout(Some(settings.database.connect_timeout))
        .build()
        .map_err(|e| {
            Error::new(
                crate::ErrorKind::Settings,
                format!("cannot build the database pool: {e}"),
            )
        })
}

/// The connections a message's unit of work may hold at once: the pool's
/// `database.pool_size` until the server refuses a new connection for want
/// of slots (53300: its `max_connections`, or the role's limit) while the
/// pool holds others. The pool has then outgrown what the server grants:
/// no outage, and nothing the message did. Failing the checkout would hold
/// the message as for an outage, the database would answer at once, and
/// after a few such holds the message would spend its attempts and walk
/// the retry tiers for a setting's fault; asking again would cost the
/// server a refused connection at each turn. So the limit comes down to
/// the connections the pool holds, and messages wait for one of them, as
/// for a full pool. It stays down until the runtime restarts.
pub(crate) struct Slots {
    permits: Arc<Semaphore>,
    /// The permits there are, taken or not.
    granted: Mutex<usize>,
}

impl Slots {
    pub(crate) fn new(pool: &Pool) -> Self {
        let size = pool.status().max_size;
        Self {
            permits: Arc::new(Semaphore::new(size)),
            granted: Mutex::new(size),
        }
    }

    /// A connection from `pool` and the slot it takes, which goes with the
    /// unit of work. Waits for a slot no longer than the pool waits for a
    /// connection (`database.transaction_timeout`).
    pub(crate) async fn checkout(
        &self,
        pool: &Pool,
    ) -> std::result::Result<(Object, OwnedSemaphorePermit), PoolError> {
        loop {
            // A free slot is the rule: taken without a timer, which would
            // cost every message a registration.
            let slot = match Arc::clone(&self.permits).try_acquire_owned() {
                Ok(slot) => slot,
                Err(_) => {
                    let acquire = Arc::clone(&self.permits).acquire_owned();
                    match pool.timeouts().wait {
                        Some(wait) => tokio::time::timeout(wait, acquire)
                            .await
                            .map_err(|_| PoolError::Timeout(TimeoutType::Wait))?,
                        None => acquire.await,
                    }
                    .map_err(|_| PoolError::Closed)?
                }
            };
            match pool.get().await {
                Ok(connection) => return Ok((connection, slot)),
                Err(PoolError::Backend(e)) if crate::error::no_slot_left(&e) && pool.status().size > 0 => {
                    // This slot is given up with the others above what the
                    // pool holds: wait for a taken one to come back.
                    drop(slot);
                    self.shrink_to(pool.status().size);
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Lowers the limit to `open` connections, as far as the free permits
    /// allow (the taken ones come back as they are, and a next refusal
    /// lowers it further).
    fn shrink_to(&self, open: usize) {
        let Ok(mut granted) = self.granted.lock() else {
            return;
        };
        if open == 0 || open >= *granted {
            return;
        }
        let pool_size = *granted;
        *granted -= self.permits.forget_permits(*granted - open);
        tracing::warn!(
            open,
            limit = *granted,
            pool_size,
            "the database refused a new connection for want of slots (53300): messages now share the connections open, until a restart; {}",
            crate::error::NO_SLOT_LEFT_HINT
        );
    }
}

/// A connection from `pool`, waiting for the database the way a start
/// should: a database that is down or unreachable is tried again with a
/// growing pause for up to `database.connect_timeout`, each failed attempt a
/// WARN naming it (host, port and database, never the password), then an
/// error of kind [`Unreachable`](crate::ErrorKind::Unreachable). A database that answers but refuses (it does not
/// exist, a wrong password) fails at once, with the server's own words.
pub async fn wait_for_database(pool: &Pool, settings: &Settings) -> Result<Object> {
    let endpoint = settings.database_endpoint();
    let timeout = settings.database.connect_timeout;
    let started = Instant::now();
    let mut backoff =
        crate::backoff::Backoff::new(crate::amqp::FIRST_CONNECT_PAUSE, crate::amqp::MAX_CONNECT_PAUSE);
    loop {
        let error = match pool.get().await {
            Ok(connection) => return Ok(connection),
            Err(e) => Error::client(e),
        };
        if let Some(tls) = crate::error::tls_failure(&error) {
            return Err(Error::new(
                crate::ErrorKind::Database,
                format!(
                    "cannot connect to the database {endpoint} over TLS: {}",
                    crate::tls::explain(tls)
                ),
            ));
        }
        if !error.is_unavailable() {
            return Err(Error::new(
                crate::ErrorKind::Database,
                format!("database {endpoint}: {error}{}", tls_hint(&error, settings)),
            ));
        }
        let cause = crate::error::describe(&error);
        let remaining = timeout.saturating_sub(started.elapsed());
        if remaining.is_zero() {
            return Err(Error::unreachable(
                "database",
                endpoint,
                timeout,
                "database.connect_timeout",
                cause,
            ));
        }
        let pause = backoff.next_pause().min(remaining);
        tracing::warn!(database = %endpoint, %cause, "cannot connect to the database; trying again in {pause:?}");
        tokio::time::sleep(pause).await;
    }
}

/// What to change when the server refused a connection for want of TLS:
/// PostgreSQL says "no encryption" in the 28000 it answers a clear-text
/// connection that only `hostssl` lines would let in.
fn tls_hint(error: &Error, settings: &Settings) -> &'static str {
    let clear_text = settings
        .pg_config()
        .is_ok_and(|config| config.get_ssl_mode() == tokio_postgres::config::SslMode::Disable);
    if clear_text && crate::error::describe(error).contains("no encryption") {
        " (the server takes TLS connections only: set sslmode in database.url to verify-full, with \
         sslrootcert for a private CA)"
    } else {
        ""
    }
}
