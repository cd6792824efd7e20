use std::time::Duration;

use rabbit_inbox::tools::deadpool_postgres::Pool;
use rabbit_inbox::{Settings, UnitOfWork};

use crate::support::TestEnv;

/// A pool of one connection, so the next checkout gets whatever the last
/// user left behind.
fn pool_of_one(settings: &Settings) -> Pool {
    let mut settings = settings.clone();
    settings.database.pool_size = 1;
    rabbit_inbox::tools::create_pool(&settings).unwrap()
}

/// Whether the next connection from `pool` is inside a transaction, and its
/// server process id.
async fn next_connection_state(pool: &Pool) -> (bool, i32) {
    use rabbit_inbox::tokio_postgres::SimpleQueryMessage;
    let connection = pool.get().await.unwrap();
    // In a transaction's later statements, now() (its start) is earlier than
    // the statement's own timestamp; a simple query in autocommit is its own
    // transaction, so they are the same.
    let messages = connection
        .simple_query("SELECT now() <> statement_timestamp(), pg_backend_pid()")
        .await
        .unwrap();
    let row = messages
        .iter()
        .find_map(|m| match m {
            SimpleQueryMessage::Row(row) => Some(row),
            _ => None,
        })
        .unwrap();
    (row.get(0) == Some("t"), row.get(1).unwrap().parse().unwrap())
}

/// A unit of work from `pool` that has written a row at `key` of `counts`.
async fn begin_with_a_write(pool: &Pool, key: i64) -> UnitOfWork {
    let uow = rabbit_inbox::internal::begin(pool.get().await.unwrap())
        .await
        .unwrap();
    uow.client()
        .execute("INSERT INTO counts VALUES ($1, 1)", &[&key])
        .await
        .unwrap();
    uow
}

async fn backend_pid(uow: &UnitOfWork) -> i32 {
    uow.client()
        .query_one("SELECT pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

#[actix_rt::test]
async fn a_guard_dropped_unfinished_discards_its_connection() {
    let env = TestEnv::new("guard_dropped").await;
    let pool = pool_of_one(&env.settings());
    let uow = begin_with_a_write(&pool, 1).await;
    let pid = backend_pid(&uow).await;
    drop(uow);

    let (in_transaction, next_pid) = next_connection_state(&pool).await;
    assert!(
        !in_transaction,
        "the pool handed out a connection inside the dropped transaction"
    );
    assert_ne!(next_pid, pid, "the connection was reused instead of discarded");
    assert_eq!(
        env.scalar("SELECT count(*) FROM counts").await,
        0,
        "the dropped write was committed"
    );
}

#[actix_rt::test]
async fn a_begin_cancelled_in_flight_never_pools_a_transaction() {
    let env = TestEnv::new("guard_cancelled").await;
    let pool = pool_of_one(&env.settings());
    for _ in 0..20 {
        // Polled once (BEGIN handed to the connection), then dropped.
        let begin = rabbit_inbox::internal::begin(pool.get().await.unwrap());
        let _ = tokio::time::timeout(Duration::ZERO, begin).await;
        let (in_transaction, _) = next_connection_state(&pool).await;
        assert!(
            !in_transaction,
            "a cancelled BEGIN left its transaction in the pool"
        );
    }
}

#[actix_rt::test]
async fn commit_refuses_a_transaction_with_a_failed_statement() {
    let env = TestEnv::new("guard_aborted").await;
    let pool = pool_of_one(&env.settings());
    let uow = begin_with_a_write(&pool, 1).await;
    let pid = backend_pid(&uow).await;
    // A handler that catches a failed statement and carries on.
    assert!(uow.client().execute("SELECT 1 / 0", &[]).await.is_err());

    // PostgreSQL would answer a bare COMMIT with a silent rollback. This is
    // the connection's first commit: its probe is prepared now, inside the
    // aborted transaction, and that must still read as what it is.
    let error = uow
        .commit()
        .await
        .expect_err("commit reported success for a rolled-back transaction");
    assert_eq!(error.kind(), rabbit_inbox::ErrorKind::Usage, "{error}");
    let (in_transaction, next_pid) = next_connection_state(&pool).await;
    assert!(!in_transaction);
    assert_eq!(next_pid, pid, "a rolled-back transaction cost its connection");
    assert_eq!(env.scalar("SELECT count(*) FROM counts").await, 0);
}

#[actix_rt::test]
async fn commit_and_rollback_keep_the_connection_for_reuse() {
    let env = TestEnv::new("guard_finished").await;
    let pool = pool_of_one(&env.settings());

    let uow = begin_with_a_write(&pool, 1).await;
    let pid = backend_pid(&uow).await;
    uow.rollback().await.unwrap();
    assert_eq!(next_connection_state(&pool).await, (false, pid));
    assert_eq!(env.scalar("SELECT count(*) FROM counts").await, 0);

    let uow = begin_with_a_write(&pool, 2).await;
    uow.commit().await.unwrap();
    assert_eq!(next_connection_state(&pool).await, (false, pid));
    assert_eq!(env.scalar("SELECT count(*) FROM counts").await, 1);
}
