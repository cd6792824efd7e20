//! The crate's schema, created and updated at startup.
//!
//! Hand-rolled rather than refinery: the whole run holds a transaction-level
//! advisory lock, so instances starting together do not race, and the
//! history table has a name of its own, so it cannot collide with the
//! service's own migration tool.

use std::time::{Duration, Instant};

use crate::error::{Error, Result};

/// Versioned SQL, applied in order, each once.
const MIGRATIONS: &[(i32, &str, &str)] = &[
    (
        1,
        "inbox_messages",
        include_str!("migrations/0001_inbox_messages.sql"),
    ),
    (
        2,
        "outbox_messages",
        include_str!("migrations/0002_outbox_messages.sql"),
    ),
    (
        3,
        "outbox_notify",
        include_str!("migrations/0003_outbox_notify.sql"),
    ),
    (
        4,
        "outbox_pending_by_seq",
        include_str!("migrations/0004_outbox_pending_by_seq.sql"),
    ),
    (
        5,
        "outbox_notify_unless_local",
        include_str!("migrations/0005_outbox_notify_unless_local.sql"),
    ),
    (
        6,
        "outbox_dead_rows",
        include_str!("migrations/0006_outbox_dead_rows.sql"),
    ),
    (
        7,
        "outbox_room_to_lease",
        include_str!("migrations/0007_outbox_room_to_lease.sql"),
    ),
    (
        8,
        "inbox_deliveries",
        include_str!("migrations/0008_inbox_deliveries.sql"),
    ),
    (
        9,
        "outbox_lease_token",
        include_str!("migrations/0009_outbox_lease_token.sql"),
    ),
    (
        10,
        "inbox_failures",
        include_str!("migrations/0010_inbox_failures.sql"),
    ),
    (
        11,
        "inbox_operations",
        include_str!("migrations/0011_inbox_operations.sql"),
    ),
    (
        12,
        "inbox_ops_job_resumed",
        include_str!("migrations/0012_inbox_ops_job_resumed.sql"),
    ),
];

/// Key of the advisory lock held while migrating ("inbox" in ASCII).
const LOCK_KEY: i64 = 0x0069_6e62_6f78;

/// One step of a service's own schema, for `rabbit_inbox::RuntimeBuilder::migrations`
/// or [`migrate`]: applied once, in version order, under the same advisory
/// lock and in the same transaction as the inbox's own migrations.
///
/// Why not `CREATE TABLE IF NOT EXISTS` at start: two replicas starting
/// together on a fresh database both try to create the table, and one
/// fails (`duplicate key value violates unique constraint
/// "pg_type_typname_nsp_index"`): PostgreSQL does not make concurrent
/// `IF NOT EXISTS` safe. Under the lock, the second waits for the first and
/// then finds the version applied.
///
/// ```
/// use rabbit_inbox::Migration;
///
/// const SCHEMA: &[Migration] = &[
///     Migration::new(1, "orders", "CREATE TABLE orders (id bigint PRIMARY KEY)"),
///     Migration::new(2, "orders_total", "ALTER TABLE orders ADD COLUMN total bigint"),
/// ];
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Migration {
    /// Its version: positive, unique, and higher than the one before it.
    /// A version once applied is never applied again.
    pub version: i32,
    /// A name, recorded with the version (a version applied under another
    /// name is an error: versions must not be reused).
    pub name: &'static str,
    /// The SQL, one or more statements.
    pub sql: &'static str,
}

impl Migration {
    /// A migration: `version`, `name`, `sql`.
    pub const fn new(version: i32, name: &'static str, sql: &'static str) -> Self {
        Self { version, name, sql }
    }
}

/// Brings the inbox's schema up to date on `client`'s database. Runs whether
/// or not the inbox is enabled: turning it on later is a settings change
/// and a restart, no schema work. Waits for another instance's migrations
/// as [`migrate`] does, at most the default `database.migration_lock_timeout`.
pub async fn run_migrations(client: &mut tokio_postgres::Client) -> Result<()> {
    let lock_wait = crate::settings::DatabaseSettings::default().migration_lock_timeout;
    migrate(client, true, &[], lock_wait).await
}

/// Brings the schema up to date on `client`'s database, in one transaction
/// holding the inbox's advisory lock, so that instances starting together
/// take turns: the inbox's own migrations if `inbox_tables`, then the
/// service's `service` ones (recorded in `inbox_service_migrations`).
///
/// Waits at most `lock_wait` (`database.migration_lock_timeout`) for
/// another instance that holds the lock, saying every
/// 10 s who it is, then fails naming the setting and the
/// holder. Neither the wait nor the migrations are cut by the pool's
/// per-message timeouts (`database.lock_timeout`,
/// `database.transaction_timeout`): an index build or a backfill may take
/// longer than any message, and cutting it would fail every replica's
/// start, again and again.
pub async fn migrate(
    client: &mut tokio_postgres::Client,
    inbox_tables: bool,
    service: &[Migration],
    lock_wait: Duration,
) -> Result<()> {
    check_order(service)?;
    let tx = client.transaction().await.map_err(Error::client)?;
    tx.batch_execute(
        "SET LOCAL lock_timeout = 0; SET LOCAL statement_timeout = 0;
         SET LOCAL idle_in_transaction_session_timeout = 0",
    )
    .await
    .map_err(Error::client)?;
    take_lock(&tx, lock_wait).await?;
    if inbox_tables {
        let inbox: Vec<Migration> = MIGRATIONS
            .iter()
            .map(|&(version, name, sql)| Migration { version, name, sql })
            .collect();
        apply(&tx, "inbox_schema_migrations", "inbox", &inbox).await?;
    }
    if !service.is_empty() {
        apply(&tx, "inbox_service_migrations", "service", service).await?;
    }
    tx.commit().await.map_err(Error::client)?;
    Ok(())
}

/// How often a start waiting for the migration lock says who holds it.
const HOLDER_REPORT_EVERY: Duration = Duration::from_secs(10);

/// The pauses between two tries of the lock: short, since a lock held for
/// a moment (a replica finding nothing to do) is the common case.
const LOCK_PAUSES: (Duration, Duration) = (Duration::from_millis(50), Duration::from_secs(1));

/// Takes the migration lock for `tx`, trying again until `wait` is over.
/// Polled rather than waited for in the server, so that the wait can say
/// who holds the lock while it lasts.
async fn take_lock(tx: &tokio_postgres::Transaction<'_>, wait: Duration) -> Result<()> {
    let started = Instant::now();
    let mut backoff = crate::backoff::Backoff::new(LOCK_PAUSES.0, LOCK_PAUSES.1);
    let mut next_report = started;
    loop {
        let taken: bool = tx
            .query_one("SELECT pg_try_advisory_xact_lock($1)", &[&LOCK_KEY])
            .await
            .map_err(Error::client)?
            .try_get(0)
            .map_err(Error::client)?;
        if taken {
            if started.elapsed() >= LOCK_PAUSES.1 {
                tracing::info!(waited = ?started.elapsed(), "took the migration lock");
            }
            return Ok(());
        }
        let now = Instant::now();
        if now.duration_since(started) >= wait {
            let holder = lock_holder(tx).await?;
            return Err(Error::new(
                crate::ErrorKind::Database,
                format!(
                    "the migration lock is still held after {wait:?} (database.migration_lock_timeout), by {holder}"
                ),
            ));
        }
        if now >= next_report {
            let holder = lock_holder(tx).await?;
            tracing::info!(
                waited = ?now.duration_since(started),
                limit = ?wait,
                "waiting for the migration lock (database.migration_lock_timeout), held by {holder}"
            );
            next_report = now + HOLDER_REPORT_EVERY;
        }
        let remaining = wait.saturating_sub(now.duration_since(started));
        tokio::time::sleep(backoff.next_pause().min(remaining)).await;
    }
}

/// Who holds the migration lock, as `pg_stat_activity` tells it: enough
/// for an operator to find the instance (or a DBA's session). Not what it
/// runs: a statement can quote a secret.
async fn lock_holder(tx: &tokio_postgres::Transaction<'_>) -> Result<String> {
    let row = tx
        .query_opt(
            "SELECT a.pid, a.application_name, a.client_addr::text, a.usename::text,
                    date_trunc('second', now() - a.xact_start)::text, a.state
             FROM pg_locks l JOIN pg_stat_activity a ON a.pid = l.pid
             WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1
               AND l.classid = ($1::bigint >> 32)::oid AND l.objid = ($1::bigint & 4294967295)::oid
             LIMIT 1",
            &[&LOCK_KEY],
        )
        .await
        .map_err(Error::client)?;
    let Some(row) = row else {
        return Ok("a session that has just released it".into());
    };
    let text = |i: usize| {
        row.try_get::<_, Option<String>>(i)
            .ok()
            .flatten()
            .unwrap_or_default()
    };
    let pid: i32 = row.try_get(0).map_err(Error::client)?;
    Ok(format!(
        "pid {pid} (application_name `{}`, client {}, user {}, in its transaction for {}, {})",
        text(1),
        match text(2) {
            addr if addr.is_empty() => "local".to_owned(),
            addr => addr,
        },
        text(3),
        text(4),
        text(5)
    ))
}

/// Versions must rise: a list out of order is a mistake to report, not to
/// sort silently.
fn check_order(migrations: &[Migration]) -> Result<()> {
    for pair in migrations.windows(2) {
        if pair[0].version >= pair[1].version {
            return Err(Error::new(
                crate::ErrorKind::Usage,
                format!(
                    "service migrations must be in rising version order: {} (`{}`) comes before {} (`{}`)",
                    pair[0].version, pair[0].name, pair[1].version, pair[1].name
                ),
            ));
        }
    }
    match migrations.first() {
        Some(first) if first.version < 1 => Err(Error::new(
            crate::ErrorKind::Usage,
            format!(
                "service migration `{}` has version {}; versions start at 1",
                first.name, first.version
            ),
        )),
        _ => Ok(()),
    }
}

/// Applies those of `migrations` that `history` does not list, and lists
/// them there.
async fn apply(
    tx: &tokio_postgres::Transaction<'_>,
    history: &str,
    whose: &str,
    migrations: &[Migration],
) -> Result<()> {
    tx.batch_execute(&format!(
        "CREATE TABLE IF NOT EXISTS {history} (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         )"
    ))
    .await
    .map_err(Error::client)?;
    let mut applied = std::collections::HashMap::new();
    for row in tx
        .query(&format!("SELECT version, name FROM {history}"), &[])
        .await
        .map_err(Error::client)?
    {
        applied.insert(
            row.try_get::<_, i32>(0).map_err(Error::client)?,
            row.try_get::<_, String>(1).map_err(Error::client)?,
        );
    }
    for migration in migrations {
        match applied.get(&migration.version) {
            Some(name) if name == migration.name => continue,
            Some(name) => {
                return Err(Error::new(
                    crate::ErrorKind::Usage,
                    format!(
                        "{whose} migration {} is named `{}`, but version {} was applied as `{name}` ({history}): \
                     a version must never be reused",
                        migration.version, migration.name, migration.version
                    ),
                ));
            }
            None => {}
        }
        tx.batch_execute(migration.sql).await.map_err(Error::client)?;
        tx.execute(
            &format!("INSERT INTO {history} (version, name) VALUES ($1, $2)"),
            &[&migration.version, &migration.name],
        )
        .await
        .map_err(Error::client)?;
        tracing::info!(
            version = migration.version,
            name = migration.name,
            "applied {whose} migration"
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn service_migrations_must_rise_from_one() {
        let one = Migration::new(1, "a", "SELECT 1");
        let two = Migration::new(2, "b", "SELECT 1");
        assert!(check_order(&[]).is_ok());
        assert!(check_order(&[one, two]).is_ok());
        let error = check_order(&[two, one]).unwrap_err().to_string();
        assert!(error.contains("rising version order"), "{error}");
        assert!(check_order(&[Migration::new(0, "zero", "SELECT 1")]).is_err());
    }
}
