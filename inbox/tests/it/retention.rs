use std::time::Duration;

use rabbit_inbox::Message;
use rabbit_inbox::{Runtime, Sweep};

use crate::support::{Count, Counted, TestEnv, Valid, wait_until};

/// Inserts `rows` inbox rows for consumer `old`, processed `days_ago`.
async fn backdated_rows(env: &TestEnv, consumer: &str, rows: i64, days_ago: i32) {
    env.db()
        .await
        .execute(
            "INSERT INTO inbox_messages
             SELECT $1, gen_random_uuid(), 'Counted', now() - make_interval(days => $3)
             FROM generate_series(1, $2::bigint)",
            &[&consumer, &rows, &days_ago],
        )
        .await
        .unwrap();
}

async fn rows_of(env: &TestEnv, consumer: &str) -> i64 {
    env.db()
        .await
        .query_one(
            "SELECT count(*) FROM inbox_messages WHERE consumer = $1",
            &[&consumer],
        )
        .await
        .unwrap()
        .get(0)
}

#[actix_rt::test]
async fn old_rows_go_and_recent_ones_stay_while_messages_are_processed() {
    let env = TestEnv::new("retention_live").await;
    let mut settings = env.settings();
    settings.retention.interval = Duration::from_millis(50);
    settings.retention.batch_size = 200;
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    // A run created the table; the sweeps start on a database with history.
    backdated_rows(&env, "expired", 3000, 8).await;
    backdated_rows(&env, "recent", 500, 6).await;

    let messages: Vec<_> = (0..200).map(|key| Message::new(Counted { key })).collect();
    for message in messages.iter().chain(messages.iter().step_by(4)) {
        runtime.publisher().publish(&env.queue, message).await.unwrap();
    }
    // The sweep's stats come once it ends: after its pause and the
    // statement that finds nothing left.
    wait_until("every copy is settled and the expired rows are swept", || async {
        let s = runtime.stats();
        s.completed + s.duplicates == 250 && s.swept_rows == 3000
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(
        (stats.completed, stats.duplicates),
        (200, 50),
        "nothing lost, nothing twice"
    );
    assert_eq!(rows_of(&env, "expired").await, 0);
    assert_eq!(
        rows_of(&env, "recent").await,
        500,
        "rows younger than retention.days stay"
    );
    assert_eq!(rows_of(&env, &env.queue).await, 200, "the rows just written stay");
    let counts = env.db().await.query("SELECT n FROM counts", &[]).await.unwrap();
    assert_eq!(counts.len(), 200);
    assert!(counts.iter().all(|r| r.get::<_, i64>(0) == 1));
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn two_instances_sweeping_one_database_at_once_do_not_both_delete() {
    let env = TestEnv::new("retention_two_instances").await;
    let settings = env.settings();
    // Each instance has its own pool, as two processes would.
    let (first, second) = (
        rabbit_inbox::tools::create_pool(&settings).unwrap(),
        rabbit_inbox::tools::create_pool(&settings).unwrap(),
    );
    rabbit_inbox::internal::run_migrations(&mut first.get().await.unwrap())
        .await
        .unwrap();
    let mut retention = settings.retention.clone();
    retention.batch_size = 100;
    // Back to back: this is about the lock, not the pace.
    retention.busy_share = 1.0;
    for round in 0..5 {
        backdated_rows(&env, "expired", 5000, 8).await;
        let (a, b) = tokio::join!(
            rabbit_inbox::internal::sweep(&first, &retention),
            rabbit_inbox::internal::sweep(&second, &retention)
        );
        let (a, b) = (a.unwrap(), b.unwrap());
        assert_eq!(a.rows + b.rows, 5000, "round {round}: {a:?} {b:?}");
        assert!(
            a.rows == 0 || b.rows == 0,
            "round {round}: both deleted: {a:?} {b:?}"
        );
        assert_eq!(rows_of(&env, "expired").await, 0);
    }
    // The lock is not left behind: each can sweep alone afterwards.
    backdated_rows(&env, "expired", 10, 8).await;
    assert_eq!(
        rabbit_inbox::internal::sweep(&second, &retention)
            .await
            .unwrap()
            .rows,
        10
    );
    backdated_rows(&env, "expired", 10, 8).await;
    assert_eq!(
        rabbit_inbox::internal::sweep(&first, &retention)
            .await
            .unwrap()
            .rows,
        10
    );
}

#[actix_rt::test]
async fn two_runtimes_on_one_database_sweep_without_errors() {
    let env = TestEnv::new("retention_two_runtimes").await;
    let mut settings = env.settings();
    settings.retention.interval = Duration::from_millis(20);
    settings.retention.batch_size = 50;
    // Back to back: 400 statements, and this is about the lock, not the pace.
    settings.retention.busy_share = 1.0;
    let first = Runtime::builder(settings.clone().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let second = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    backdated_rows(&env, "expired", 20_000, 8).await;
    // A sweep reports its rows when it ends, after its last batch has
    // committed: wait for the reports, not for the table.
    wait_until("both runtimes have reported their sweeps", || async {
        first.stats().swept_rows + second.stats().swept_rows >= 20_000
    })
    .await;
    let (a, b) = (first.stats(), second.stats());
    first.shutdown().await;
    second.shutdown().await;
    assert_eq!(rows_of(&env, "expired").await, 0);
    assert_eq!(
        a.swept_rows + b.swept_rows,
        20_000,
        "no row counted twice: {a:?} {b:?}"
    );
}

#[actix_rt::test]
async fn a_backlog_of_200000_due_rows_goes_in_bounded_batches() {
    let env = TestEnv::new("retention_backlog").await;
    let mut settings = env.settings();
    settings.retention.interval = Duration::from_secs(3600); // only the sweep asked for below
    settings.retention.busy_share = 1.0; // the batches are the point here, not the pace
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    backdated_rows(&env, "expired", 200_000, 30).await;
    backdated_rows(&env, "recent", 1000, 1).await;

    let report = runtime.retention().unwrap().send(Sweep).await.unwrap().unwrap();
    runtime.shutdown().await;

    assert!(report.swept);
    assert_eq!(report.rows, 200_000);
    assert_eq!(report.batches, 40, "batch_size 5000");
    assert_eq!(rows_of(&env, "expired").await, 0);
    assert_eq!(rows_of(&env, "recent").await, 1000);
    // Reported, not asserted: these machines are shared and noisy.
    println!(
        "retention backlog: {} rows in {} batches, {:?} in all, longest batch {:?}",
        report.rows, report.batches, report.duration, report.longest_batch
    );
}

#[actix_rt::test]
async fn a_sweep_samples_the_rows_left_and_the_oldest_ones_age() {
    let env = TestEnv::new("retention_sample").await;
    let settings = env.settings();
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    rabbit_inbox::internal::run_migrations(&mut pool.get().await.unwrap())
        .await
        .unwrap();
    backdated_rows(&env, "expired", 40, 8).await;
    backdated_rows(&env, "recent", 25, 2).await;
    let report = rabbit_inbox::internal::sweep(&pool, &settings.retention)
        .await
        .unwrap();
    assert_eq!(report.rows, 40);
    // Never analyzed: counted exactly.
    assert_eq!(report.inbox_rows, 25);
    let oldest = report.oldest_inbox_row.expect("rows are left");
    assert!(
        oldest > Duration::from_secs(86_400) && oldest < Duration::from_secs(3 * 86_400),
        "{oldest:?}"
    );
    // Once analyzed, PostgreSQL's estimate, no scan.
    env.db()
        .await
        .batch_execute("ANALYZE inbox_messages")
        .await
        .unwrap();
    let report = rabbit_inbox::internal::sweep(&pool, &settings.retention)
        .await
        .unwrap();
    assert_eq!(report.inbox_rows, 25);
    pool.close();
}

/// A sweep pauses after each statement in proportion to what it took
/// (`retention.busy_share`): a backlog is deleted beside consumption
/// instead of taking the database from it.
#[actix_rt::test]
async fn a_sweep_pauses_between_its_statements_in_proportion_to_them() {
    let env = TestEnv::new("retention_paced").await;
    let settings = env.settings();
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    rabbit_inbox::internal::run_migrations(&mut pool.get().await.unwrap())
        .await
        .unwrap();
    backdated_rows(&env, "expired", 2000, 8).await;
    let mut retention = settings.retention.clone();
    retention.batch_size = 200;
    retention.busy_share = 0.25;
    let report = rabbit_inbox::internal::sweep(&pool, &retention).await.unwrap();
    assert_eq!((report.rows, report.batches), (2000, 10), "{report:?}");
    assert_eq!(rows_of(&env, "expired").await, 0);
    // Three times each statement's time after each of them but the last
    // (the one that found fewer than a batch, or none): at least three
    // times the whole but the longest, whatever the machine's pace.
    let paused_at_least = report.busy.saturating_sub(report.longest_batch) * 3;
    assert!(report.duration >= report.busy + paused_at_least, "{report:?}");
}
