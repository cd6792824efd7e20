//! What waits in the outbox, sampled through its indexes.

use std::time::Duration;

use crate::Error;
use crate::db::Connections;
use crate::error::Result;

/// What waits to be dispatched: rows that are not dead, those other
/// transactions hold included; and the dead ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// How many wait.
    pub pending: u64,
    /// How long the oldest of them has waited since it was staged.
    pub oldest_pending: Option<Duration>,
    /// Rows parked as dead (until retried or swept).
    pub dead: u64,
}

/// The most rows [`backlog`] counts of each kind: a sample taken every poll
/// interval must not scan a backlog of millions (a broker away for hours).
pub(crate) const BACKLOG_COUNT_LIMIT: i64 = 100_000;

/// Samples the `Backlog` through the pending and dead rows' indexes,
/// counting each kind up to `BACKLOG_COUNT_LIMIT` (a larger backlog
/// shows as that many); the oldest pending row is the first by `seq`.
pub(crate) async fn backlog(connections: &Connections) -> Result<Backlog> {
    let row = connections
        .get()
        .await.map_err(Error::client)?
        .query_one(
            "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox_messages WHERE dead_at IS NULL LIMIT $1) AS p),
                    (SELECT (EXTRACT(EPOCH FROM now()) - EXTRACT(EPOCH FROM created_at))::float8
                     FROM outbox_messages WHERE dead_at IS NULL ORDER BY seq LIMIT 1),
                    (SELECT count(*) FROM (SELECT 1 FROM outbox_messages WHERE dead_at IS NOT NULL LIMIT $1) AS d)",
            &[&BACKLOG_COUNT_LIMIT],
        )
        .await.map_err(Error::client)?;
    // `try_get`, as everywhere a row is read: a column of an unexpected
    // type is an error, never a panic in the dispatcher's sampler.
    let count = |column: usize| -> Result<u64> {
        Ok(u64::try_from(row.try_get::<_, i64>(column).map_err(Error::client)?).unwrap_or(0))
    };
    let oldest: Option<f64> = row.try_get(1).map_err(Error::client)?;
    Ok(Backlog {
        pending: count(0)?,
        // A row staged by hand may carry any `created_at`, even infinity.
        oldest_pending: oldest
            .map(|seconds| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)),
        dead: count(2)?,
    })
}
