//! The inbox's connection pool, and the gate every connection the runtime
//! takes goes through (`gate.rs`).

mod connect;
mod gate;

use std::time::Instant;

use deadpool_postgres::{Manager, ManagerConfig, Object, Pool, RecyclingMethod, Runtime};

pub(crate) use connect::Connector;
pub(crate) use gate::{Connection, Connections, Slot};

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
    let manager = Manager::from_connect(
        config,
        Connector::of(settings)?,
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
