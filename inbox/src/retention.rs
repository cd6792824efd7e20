//! Retention: deleting inbox rows, dead outbox rows, redelivery counts and
//! failures older than `retention.days`, in bounded batches, one instance
//! per database at a time (ADR-005: one cleanup for every table). Where an
//! operator works from the failures table (`failures.drain`), a failure
//! nobody has resolved (redriven or discarded) stays, and so does the dead
//! outbox row it stands for, however old.

use std::time::{Duration, Instant};

use deadpool_postgres::Object;

use crate::Error;
use crate::db::{Connection, Connections, Slot};
use crate::error::Result;
use crate::settings::RetentionSettings;

/// A table the sweep keeps trimmed, the column that dates its rows (a row
/// whose column is NULL is never due), and which of the due rows stay
/// while failures are kept until resolved (`failures.drain`).
struct Swept {
    table: &'static str,
    dated_by: &'static str,
    unless_unresolved: &'static str,
}

const SWEPT: &[Swept] = &[
    Swept {
        table: "inbox_messages",
        dated_by: "processed_at",
        unless_unresolved: "",
    },
    // Dispatched rows are deleted on confirm; only the dead ones age here.
    Swept {
        table: "outbox_messages",
        dated_by: "dead_at",
        unless_unresolved: "AND NOT EXISTS (SELECT 1 FROM inbox_failures f
             WHERE f.queue = 'outbox' AND f.message_key = outbox_messages.message_id::text
               AND f.status IN ('open', 'redriving'))",
    },
    // Redeliveries counted on queues whose broker does not count them.
    Swept {
        table: "inbox_deliveries",
        dated_by: "last_delivered_at",
        unless_unresolved: "",
    },
    // Failures, by their last change.
    Swept {
        table: "inbox_failures",
        dated_by: "updated_at",
        unless_unresolved: "AND status IN ('redriven', 'discarded')",
    },
];

/// Key of the session advisory lock that lets one instance sweep a database
/// at a time ("inbox.rt" in ASCII).
const LOCK_KEY: i64 = 0x0069_6e62_6f78_2e72;

/// What one [`sweep`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SweepReport {
    /// Whether this instance swept; `false` when another one held the lock
    /// (this round is skipped, nothing was waited for).
    pub swept: bool,
    /// Rows deleted.
    pub rows: u64,
    /// Statements that deleted rows.
    pub batches: u32,
    /// The whole sweep.
    pub duration: Duration,
    /// The slowest single batch: how long a delete held its locks.
    pub longest_batch: Duration,
    /// The time its statements took, all together; the rest of `duration`
    /// it paused (`retention.busy_share`) or waited for a connection.
    pub busy: Duration,
    /// Rows of `inbox_messages` left after the sweep (the table statistics'
    /// estimate once it has been analyzed), sampled by the one instance
    /// that swept.
    pub inbox_rows: u64,
    /// See `inbox_rows`; `None` when the table is empty.
    pub oldest_inbox_row: Option<Duration>,
}

/// Deletes every row older than `retention.days`, `retention.batch_size`
/// rows per statement (each its own transaction, skipping rows locked by
/// someone else), until nothing is due. Unless another instance is sweeping
/// the same database: then it returns at once with `swept: false`. With
/// `keep_unresolved`, failures nobody resolved stay (see the module's
/// documentation).
pub(crate) async fn sweep(
    connections: &Connections,
    retention: &RetentionSettings,
    keep_unresolved: bool,
) -> Result<SweepReport> {
    let started = Instant::now();
    let Some(lock) = SweepLock::try_take(connections.get().await.map_err(Error::client)?).await? else {
        return Ok(SweepReport::default());
    };
    let mut report = SweepReport {
        swept: true,
        ..SweepReport::default()
    };
    let limit = i64::from(retention.batch_size);
    let age = retention.period();
    for swept in SWEPT {
        // ctid = ANY(ARRAY(..)) deletes by physical row address (a TID scan):
        // no second index lookup per row. SKIP LOCKED leaves a row that a
        // message's transaction holds to that transaction.
        let sql = format!(
            "DELETE FROM {table} WHERE ctid = ANY(ARRAY(
                 SELECT ctid FROM {table} WHERE {dated_by} < now() - $1::float8 * interval '1 second' {kept}
                 LIMIT $2 FOR UPDATE SKIP LOCKED))",
            table = swept.table,
            dated_by = swept.dated_by,
            kept = if keep_unresolved {
                swept.unless_unresolved
            } else {
                ""
            },
        );
        let statement = lock
            .connection()
            .prepare_cached(&sql)
            .await
            .map_err(Error::client)?;
        let age_seconds = age.as_secs_f64();
        loop {
            let batch_started = Instant::now();
            let deleted = lock
                .connection()
                .execute(&statement, &[&age_seconds, &limit])
                .await
                .map_err(Error::client)?;
            let took = batch_started.elapsed();
            report.longest_batch = report.longest_batch.max(took);
            report.busy += took;
            if deleted == 0 {
                break;
            }
            report.rows += deleted;
            report.batches += 1;
            if deleted < limit as u64 {
                break;
            }
            // Paced by what the statement took: a busy database slows
            // the sweep, not the consumers.
            tokio::time::sleep(retention.pause_after(took)).await;
        }
    }
    // Sampled by the one sweeper, under its lock: once per sweep, whatever
    // the number of instances. The count is the table's statistics'
    // estimate (kept by autovacuum), exact only while the table was never
    // analyzed: counting days of messages, billions of rows, would scan
    // them all at every sweep. The oldest row comes from the index on
    // processed_at.
    let row = lock
        .connection()
        .query_one(
            "SELECT CASE WHEN c.reltuples >= 0 THEN c.reltuples::bigint
                         ELSE (SELECT count(*) FROM inbox_messages) END,
                    (SELECT (EXTRACT(EPOCH FROM now()) - EXTRACT(EPOCH FROM min(processed_at)))::float8
                     FROM inbox_messages)
             FROM pg_class c WHERE c.oid = 'inbox_messages'::regclass",
            &[],
        )
        .await
        .map_err(Error::client)?;
    report.inbox_rows = u64::try_from(row.try_get::<_, i64>(0).map_err(Error::client)?).unwrap_or(0);
    // A row written by hand may carry any `processed_at`, even infinity.
    report.oldest_inbox_row = row
        .try_get::<_, Option<f64>>(1)
        .map_err(Error::client)?
        .map(|seconds| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX));
    lock.release().await?;
    report.duration = started.elapsed();
    Ok(report)
}

/// A pooled connection holding the sweep's session advisory lock. Dropped
/// without [`release`](Self::release) (an error, a cancelled sweep), it
/// discards the connection, which releases the lock: a pooled connection
/// still holding it would stop every other instance from sweeping.
struct SweepLock {
    connection: Option<Object>,
    /// The connection's slot in the runtime's gate: given back after it.
    _slot: Option<Slot>,
}

impl SweepLock {
    async fn try_take(connection: Connection) -> Result<Option<Self>> {
        let (connection, slot) = connection.into_parts();
        // Armed before the lock is asked for, in case the ask is cancelled.
        let lock = Self {
            connection: Some(connection),
            _slot: slot,
        };
        let row = lock
            .connection()
            .query_one("SELECT pg_try_advisory_lock($1)", &[&LOCK_KEY])
            .await
            .map_err(Error::client)?;
        if row.try_get(0).map_err(Error::client)? {
            Ok(Some(lock))
        } else {
            lock.give_back();
            Ok(None)
        }
    }

    fn connection(&self) -> &Object {
        // Only `release`, `give_back` and `Drop` take it, and they end `self`.
        self.connection
            .as_ref()
            .expect("a held sweep lock has its connection")
    }

    async fn release(mut self) -> Result<()> {
        self.connection()
            .execute("SELECT pg_advisory_unlock($1)", &[&LOCK_KEY])
            .await
            .map_err(Error::client)?;
        self.give_back_connection();
        Ok(())
    }

    /// The lock was not taken: the connection goes back to the pool as is.
    fn give_back(mut self) {
        self.give_back_connection();
    }

    fn give_back_connection(&mut self) {
        drop(self.connection.take());
    }
}

impl Drop for SweepLock {
    fn drop(&mut self) {
        if let Some(connection) = self.connection.take() {
            drop(Object::take(connection));
        }
    }
}
