//! The inbox's connection pool.

use deadpool_postgres::{Manager, ManagerConfig, Pool, RecyclingMethod, Runtime};
use tokio_postgres::NoTls;

use crate::error::{Error, Result};
use crate::settings::Settings;

/// Builds the pool from `[database]`. No connection is made until first use.
///
/// Recycling is `Fast` (no query per checkout): [`UnitOfWork`](crate::UnitOfWork)
/// never returns a connection inside a transaction, so a `ROLLBACK` on every
/// recycle would be a round trip per message for nothing.
pub fn create_pool(settings: &Settings) -> Result<Pool> {
    let manager = Manager::from_config(
        settings.pg_config()?,
        NoTls,
        ManagerConfig {
            recycling_method: RecyclingMethod::Fast,
        },
    );
    Pool::builder(manager)
        .max_size(settings.database.pool_size)
        .runtime(Runtime::Tokio1)
        .create_timeout(Some(settings.database.connect_timeout))
        .build()
        .map_err(|e| Error::Runtime(format!("cannot build the database pool: {e}")))
}
