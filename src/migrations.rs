//! The crate's schema, created and updated at startup.
//!
//! Hand-rolled rather than refinery: the whole run holds a transaction-level
//! advisory lock, so instances starting together do not race, and the
//! history table has a name of its own, so it cannot collide with the
//! service's own migration tool.

use crate::error::Result;

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
];

/// Key of the advisory lock held while migrating ("inbox" in ASCII).
const LOCK_KEY: i64 = 0x0069_6e62_6f78;

/// Brings the schema up to date on `client`'s database. Runs whether or not
/// the inbox is enabled: turning it on later is a settings change and a
/// restart, no schema work.
pub async fn run_migrations(client: &mut tokio_postgres::Client) -> Result<()> {
    let tx = client.transaction().await?;
    // Wait as long as another instance takes to migrate: the pool's
    // connections carry database.lock_timeout, meant for messages.
    tx.batch_execute("SET LOCAL lock_timeout = 0").await?;
    tx.execute("SELECT pg_advisory_xact_lock($1)", &[&LOCK_KEY])
        .await?;
    tx.batch_execute(
        "CREATE TABLE IF NOT EXISTS inbox_schema_migrations (
             version    integer     PRIMARY KEY,
             name       text        NOT NULL,
             applied_at timestamptz NOT NULL DEFAULT now()
         )",
    )
    .await?;
    let applied: Vec<i32> = tx
        .query("SELECT version FROM inbox_schema_migrations", &[])
        .await?
        .iter()
        .map(|row| row.get(0))
        .collect();
    for (version, name, sql) in MIGRATIONS {
        if applied.contains(version) {
            continue;
        }
        tx.batch_execute(sql).await?;
        tx.execute(
            "INSERT INTO inbox_schema_migrations (version, name) VALUES ($1, $2)",
            &[version, name],
        )
        .await?;
        tracing::info!(version, name, "applied inbox migration");
    }
    tx.commit().await?;
    Ok(())
}
