//! Database failover: a primary that turns read-only, and one that is
//! replaced by another server. Messages are held (no attempt spent, no
//! retry tier walked) until a writable server answers, then processed
//! there once each.

use std::collections::HashMap;
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rabbit_inbox::tokio_postgres::{Client, NoTls};
use rabbit_inbox::{EventHandler, HandlerError, MessageContext, UnitOfWork};
use rabbit_inbox::{Runtime, StatsSnapshot};

use crate::support::{Count, Counted, TestEnv, Valid, increment, publish_keys, wait_until};

/// [`Count`], taking a while inside its transaction: messages are in flight
/// when the server goes. The first message of key [`HELD_OPEN`] waits
/// inside its transaction until the servers are swapped, so that one
/// transaction is certainly open on the old primary when it goes.
struct SlowCount {
    swap: Arc<Swap>,
}

/// The key whose first attempt waits for the swap.
const HELD_OPEN: i64 = 20;

/// A handler waits in its transaction (`waiting`) until the test has
/// swapped the servers (`done`).
#[derive(Default)]
struct Swap {
    waiting: AtomicBool,
    done: AtomicBool,
}

impl EventHandler<Counted> for SlowCount {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, "counts", event.key).await?;
        if event.key == HELD_OPEN {
            self.swap.waiting.store(true, Ordering::SeqCst);
            // Bounded: a test that failed before the swap must not leave
            // the handler waiting until the transaction's timeout.
            for _ in 0..2_000 {
                if self.swap.done.load(Ordering::SeqCst) {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
        Ok(())
    }
}

/// Where tests/second_postgres.sh runs the second server.
const SECOND_PORT: u16 = 5433;

/// Makes `database` on the server behind `admin` read-only for new
/// sessions, and ends the sessions it has, as a primary being failed over
/// does: its clients must reconnect, and find it read-only.
async fn turn_read_only(admin: &Client, database: &str) {
    admin
        .batch_execute(&format!(
            "ALTER DATABASE {database} SET default_transaction_read_only = on"
        ))
        .await
        .unwrap();
    admin
        .execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            &[&database],
        )
        .await
        .unwrap();
}

async fn connect(port: u16, database: &str) -> Client {
    let url = format!("postgres://postgres@127.0.0.1:{port}/{database}");
    let (client, connection) = url
        .parse::<rabbit_inbox::tokio_postgres::Config>()
        .unwrap()
        .connect(NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// Whether a session of `database` other than the caller's has a
/// transaction open.
async fn in_transaction(admin: &Client, database: &str) -> bool {
    let row = admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE datname = $1 AND xact_start IS NOT NULL AND pid <> pg_backend_pid()",
            &[&database],
        )
        .await
        .unwrap();
    row.get::<_, i64>(0) > 0
}

async fn counts(client: &Client) -> HashMap<i64, i64> {
    client
        .query("SELECT key, n FROM counts", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

/// Messages were held, and the retry path stayed untouched: nothing failed
/// an attempt.
fn held_without_attempts(stats: &StatsSnapshot) {
    assert_eq!(
        (
            stats.retried,
            stats.delayed,
            stats.dead_lettered,
            stats.duplicates
        ),
        (0, 0, 0, 0),
        "{stats:?}"
    );
    assert!(stats.held > 0, "nothing was held: {stats:?}");
}

#[actix_rt::test]
async fn a_read_only_primary_holds_messages_until_it_takes_writes_again() {
    let env = TestEnv::new("read_only_primary").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("the first five complete", || async {
        runtime.stats().completed == 5
    })
    .await;

    let admin = connect(5432, "postgres").await;
    turn_read_only(&admin, &env.database).await;
    publish_keys(&runtime, &env.queue, 5..10).await;
    // Each new connection is read-only: every claim fails with 25006.
    wait_until("the next ones are held", || async { runtime.stats().held >= 5 }).await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(
        runtime.stats().completed,
        5,
        "a claim went through on a read-only server"
    );

    admin
        .batch_execute(&format!(
            "ALTER DATABASE {} RESET default_transaction_read_only",
            env.database
        ))
        .await
        .unwrap();
    wait_until("the held ones complete", || async {
        runtime.stats().completed == 10
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    held_without_attempts(&stats);
    let counts = counts(&env.db().await).await;
    assert_eq!(counts, (0..10).map(|key| (key, 1)).collect());
    assert_eq!(env.ready(&env.queue).await, 0);
}

/// The second server of tests/second_postgres.sh, with `database` made
/// afresh as the test's own, holding the same tables.
async fn second_server(database: &str) -> Client {
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/second_postgres.sh");
    let status = Command::new("bash").arg(script).arg("start").status().unwrap();
    assert!(
        status.success(),
        "tests/second_postgres.sh could not start the second PostgreSQL"
    );
    let admin = connect(SECOND_PORT, "postgres").await;
    for sql in [
        format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"),
        format!("CREATE DATABASE {database}"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    let mut client = connect(SECOND_PORT, database).await;
    client
        .batch_execute("CREATE TABLE counts (key bigint PRIMARY KEY, n bigint NOT NULL)")
        .await
        .unwrap();
    rabbit_inbox::internal::run_migrations(&mut client).await.unwrap();
    client
}

#[actix_rt::test]
async fn on_failover_messages_are_held_then_processed_once_on_the_new_primary() {
    let env = TestEnv::new("failover").await;
    let second = second_server(&env.database).await;
    let mut settings = env.settings();
    // Both servers; a session must be able to write.
    settings.database.url = format!(
        "postgres://postgres@127.0.0.1:5432,127.0.0.1:{SECOND_PORT}/{}?target_session_attrs=read-write",
        env.database
    );
    settings.queues[0].prefetch = 8;
    let swap = Arc::new(Swap::default());
    let runtime = Runtime::builder(settings.valid())
        .handler(SlowCount {
            swap: Arc::clone(&swap),
        })
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..40).await;

    // The failover: the first server turns read-only and drops its sessions
    // while messages are in flight. The handler of key HELD_OPEN keeps its
    // transaction open until the swap is done, so "in flight" is certain
    // rather than likely (waiting for any open transaction raced with its
    // commit: a server swapped between two batches holds nothing).
    let admin = connect(5432, "postgres").await;
    wait_until(
        "some complete on the first server and a transaction waits open there",
        || async {
            runtime.stats().completed >= 5
                && swap.waiting.load(Ordering::SeqCst)
                && in_transaction(&admin, &env.database).await
        },
    )
    .await;
    turn_read_only(&admin, &env.database).await;
    swap.done.store(true, Ordering::SeqCst);
    publish_keys(&runtime, &env.queue, 40..60).await;
    wait_until("all complete", || async { runtime.stats().completed == 60 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    held_without_attempts(&stats);
    let first = env.db().await;
    let (on_first, on_second) = (counts(&first).await, counts(&second).await);
    assert!(
        on_second.len() >= 20,
        "the second server took {} messages",
        on_second.len()
    );
    for key in 0..60 {
        let n = on_first.get(&key).unwrap_or(&0) + on_second.get(&key).unwrap_or(&0);
        assert_eq!(n, 1, "key {key}: {n} effects");
    }
    assert_eq!(env.ready(&env.queue).await, 0);
    drop(second);
    connect(SECOND_PORT, "postgres")
        .await
        .batch_execute(&format!("DROP DATABASE IF EXISTS {} WITH (FORCE)", env.database))
        .await
        .unwrap();
    // The first server's database goes with `env`: writable again for that.
    connect(5432, "postgres")
        .await
        .batch_execute(&format!(
            "ALTER DATABASE {} RESET default_transaction_read_only",
            env.database
        ))
        .await
        .unwrap();
}
