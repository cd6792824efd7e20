use rabbit_inbox::Runtime;
use rabbit_inbox::store::{InboxKey, InboxStore, StoreResult};
use rabbit_inbox::{Message, MessageContext, Provider, UnitOfWork};

use crate::support::{Captured, Count, Counted, TestEnv, Valid, wait_until};

#[actix_rt::test]
async fn migrations_create_the_inbox_table_with_the_inbox_off() {
    let env = TestEnv::new("migrations_inbox_off").await;
    let mut settings = env.settings();
    settings.message_bus.provider = Provider::InProcess;
    settings.message_bus.enable_inbox = Some(false);
    // Twice: the second run finds everything in place.
    for _ in 0..2 {
        Runtime::builder(settings.clone().valid())
            .start()
            .await
            .unwrap()
            .shutdown()
            .await;
    }

    let db = env.db().await;
    let columns: Vec<(String, String, String)> = db
        .query(
            "SELECT column_name::text, data_type::text, is_nullable::text FROM information_schema.columns
             WHERE table_name = 'inbox_messages' ORDER BY ordinal_position",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| (r.get(0), r.get(1), r.get(2)))
        .collect();
    let expected = [
        ("consumer", "text"),
        ("message_id", "uuid"),
        ("event_type", "text"),
        ("processed_at", "timestamp with time zone"),
    ];
    let expected: Vec<_> = expected
        .iter()
        .map(|(c, t)| (c.to_string(), t.to_string(), "NO".to_string()))
        .collect();
    assert_eq!(columns, expected);
    let key: Vec<String> = db
        .query(
            "SELECT a.attname::text FROM pg_index i
             JOIN pg_attribute a ON a.attrelid = i.indrelid AND a.attnum = ANY(i.indkey)
             WHERE i.indrelid = 'inbox_messages'::regclass AND i.indisprimary
             ORDER BY array_position(i.indkey, a.attnum)",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    assert_eq!(key, ["consumer", "message_id"]);
    let indexed: i64 = db
        .query_one(
            "SELECT count(*) FROM pg_indexes WHERE tablename = 'inbox_messages' AND indexdef LIKE '%(processed_at)%'",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(indexed, 1, "no index on processed_at");
}

#[actix_rt::test]
async fn a_rabbitmq_host_with_the_inbox_off_warns_once_and_no_other_host_does() {
    let env = TestEnv::new("startup_warning").await;
    let cases = [
        (Provider::Rabbitmq, Some(false), 1),
        (Provider::Rabbitmq, None, 0),
        (Provider::Rabbitmq, Some(true), 0),
        (Provider::InProcess, None, 0),
        (Provider::InProcess, Some(false), 0),
    ];
    for (provider, enable_inbox, expected) in cases {
        let captured = Captured::default();
        let guard = captured.install();
        let mut settings = env.settings();
        settings.message_bus.provider = provider;
        settings.message_bus.enable_inbox = enable_inbox;
        Runtime::builder(settings.valid())
            .handler(Count)
            .start()
            .await
            .unwrap()
            .shutdown()
            .await;
        drop(guard);

        let text = captured.text();
        let warnings: Vec<_> = text
            .lines()
            .filter(|l| l.contains("WARN") && l.contains("enable_inbox"))
            .collect();
        assert_eq!(
            warnings.len(),
            expected,
            "{provider:?} enable_inbox={enable_inbox:?}:\n{text}"
        );
        if let Some(warning) = warnings.first() {
            for words in [
                "redelivery",
                "reach the handlers again",
                "already exists",
                "restart",
            ] {
                assert!(
                    warning.contains(words),
                    "the warning does not say `{words}`: {warning}"
                );
            }
        }
    }
}

#[actix_rt::test]
async fn in_process_dispatches_without_a_broker_through_the_same_inbox() {
    let env = TestEnv::new("in_process").await;
    let mut settings = env.settings();
    settings.message_bus.provider = Provider::InProcess;
    // Nothing listens there: connecting would fail the start.
    settings.message_bus.amqp_urls = vec!["amqp://guest:guest@127.0.0.1:1/%2f".into()];

    let runtime = Runtime::builder(settings.clone().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 1 });
    runtime.publisher().publish("ignored", &message).await.unwrap();
    assert_eq!(
        env.count("counts", 1).await,
        1,
        "handlers ran before publish returned"
    );
    runtime.publisher().publish("ignored", &message).await.unwrap();
    assert_eq!(
        env.count("counts", 1).await,
        2,
        "in_process leaves the inbox off by default"
    );
    runtime.shutdown().await;

    settings.message_bus.enable_inbox = Some(true);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .handler(RefusesNegativeKeys)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 2 });
    runtime.publisher().publish("ignored", &message).await.unwrap();
    runtime.publisher().publish("ignored", &message).await.unwrap();
    assert_eq!(runtime.stats().duplicates, 1);
    // The caller is the consumer here: a failure comes back to it, and
    // nothing of the message is committed.
    let refused = runtime
        .publisher()
        .publish("ignored", &Message::new(Counted { key: -3 }))
        .await;
    assert!(
        matches!(&refused, Err(e) if e.kind() == rabbit_inbox::ErrorKind::Abandoned),
        "{refused:?}"
    );
    runtime.shutdown().await;
    assert_eq!(
        env.count("counts", 2).await,
        1,
        "explicitly on, the inbox deduplicates in process too"
    );
    assert_eq!(
        env.count("counts", -3).await,
        0,
        "the refused message was rolled back"
    );
}

/// Refuses events with a negative key.
struct RefusesNegativeKeys;

impl rabbit_inbox::EventHandler<Counted> for RefusesNegativeKeys {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        _uow: &mut UnitOfWork,
    ) -> std::result::Result<(), rabbit_inbox::HandlerError> {
        if event.key < 0 {
            return Err("negative keys are refused".into());
        }
        Ok(())
    }
}

#[actix_rt::test]
async fn two_consumers_of_one_event_in_one_database_each_process_it_once() {
    let mut env = TestEnv::new("two_consumers").await;
    let other_queue = env.another_queue("billing");
    let mut settings = env.settings();
    settings
        .queues
        .push(rabbit_inbox::QueueSettings::new(&other_queue));
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 1 });
    for _ in 0..2 {
        runtime.publisher().publish(&env.queue, &message).await.unwrap();
        runtime.publisher().publish(&other_queue, &message).await.unwrap();
    }
    wait_until("all four copies are settled", || async {
        let s = runtime.stats();
        s.completed + s.duplicates == 4
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(
        (stats.completed, stats.duplicates),
        (2, 2),
        "once per consumer, then skipped"
    );
    assert_eq!(
        env.count("counts", 1).await,
        2,
        "each consumer's handlers ran once"
    );
    let consumers: Vec<String> = env
        .db()
        .await
        .query("SELECT consumer FROM inbox_messages ORDER BY consumer", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get(0))
        .collect();
    let mut expected = vec![env.queue.clone(), other_queue];
    expected.sort();
    assert_eq!(consumers, expected, "one inbox row per (consumer, message_id)");
}

#[actix_rt::test]
async fn with_the_inbox_off_a_duplicate_runs_twice() {
    let env = TestEnv::new("opt_out").await;
    let mut settings = env.settings();
    settings.message_bus.enable_inbox = Some(false);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    assert!(
        runtime.retention().is_none(),
        "no cleanup runs with the inbox off"
    );
    let message = Message::new(Counted { key: 4 });
    runtime.publisher().publish(&env.queue, &message).await.unwrap();
    runtime.publisher().publish(&env.queue, &message).await.unwrap();
    wait_until("both copies complete", || async {
        runtime.stats().completed == 2
    })
    .await;
    runtime.shutdown().await;

    assert_eq!(env.count("counts", 4).await, 2, "the opt-out is real");
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 0);
}

/// A store written against the trait's two required methods only, over a
/// table of its own, with a plain INSERT (no ON CONFLICT).
pub(crate) struct HandWrittenStore;

impl InboxStore for HandWrittenStore {
    async fn already_processed(&self, uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<bool> {
        let row = uow
            .client()
            .query_one(
                "SELECT EXISTS (SELECT 1 FROM my_inbox WHERE consumer = $1 AND id = $2)",
                &[&key.consumer, &key.message_id],
            )
            .await?;
        Ok(row.get(0))
    }

    async fn mark_processed(&self, uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<()> {
        uow.client()
            .execute(
                "INSERT INTO my_inbox (consumer, id) VALUES ($1, $2)",
                &[&key.consumer, &key.message_id],
            )
            .await?;
        Ok(())
    }
}

impl HandWrittenStore {
    /// Creates the store's table in the test's database.
    pub(crate) async fn create_table(env: &TestEnv) {
        env.db()
            .await
            .batch_execute("CREATE TABLE my_inbox (consumer text, id uuid, PRIMARY KEY (consumer, id))")
            .await
            .unwrap();
    }
}

#[actix_rt::test]
async fn a_store_with_only_the_two_required_methods_works_end_to_end() {
    let env = TestEnv::new("hand_written_store").await;
    HandWrittenStore::create_table(&env).await;
    let runtime = Runtime::builder(env.settings().valid())
        .inbox_store(HandWrittenStore)
        .handler(Count)
        .start()
        .await
        .unwrap();
    let repeated = Message::new(Counted { key: 1 });
    for _ in 0..3 {
        runtime.publisher().publish(&env.queue, &repeated).await.unwrap();
    }
    runtime
        .publisher()
        .publish(&env.queue, &Message::new(Counted { key: 2 }))
        .await
        .unwrap();

    // Copies in flight together race on the primary key: the losers are
    // abandoned (23505), redelivered, and then found processed.
    wait_until("every copy is settled", || async {
        let s = runtime.stats();
        s.completed == 2 && s.duplicates == 2
    })
    .await;
    runtime.shutdown().await;

    assert_eq!(env.count("counts", 1).await, 1);
    assert_eq!(env.count("counts", 2).await, 1);
    assert_eq!(env.scalar("SELECT count(*) FROM my_inbox").await, 2);
    assert_eq!(
        env.scalar("SELECT count(*) FROM inbox_messages").await,
        0,
        "the built-in store was not used"
    );
    assert_eq!(env.ready(&env.queue).await, 0);
}

/// The advisory lock every instance's migrations hold ("inbox" in ASCII):
/// a contract between versions, named in docs/operations.md.
const MIGRATION_LOCK: i64 = 0x0069_6e62_6f78;

/// A session of "another replica" holding the migration lock until it is
/// released or dropped.
async fn hold_migration_lock(env: &TestEnv) -> rabbit_inbox::tokio_postgres::Client {
    let holder = env.db().await;
    holder
        .batch_execute(&format!(
            "SET application_name = 'other-replica'; BEGIN; SELECT pg_advisory_xact_lock({MIGRATION_LOCK})"
        ))
        .await
        .unwrap();
    holder
}

/// The settings of a start whose per-message timeouts are short: a second.
fn impatient(env: &TestEnv) -> rabbit_inbox::Settings {
    let mut settings = env.settings();
    settings.message_bus.provider = Provider::InProcess;
    settings.database.transaction_timeout = std::time::Duration::from_secs(1);
    settings.database.lock_timeout = std::time::Duration::from_millis(200);
    settings
}

#[actix_rt::test]
async fn a_start_waits_out_another_instances_migrations_past_the_per_message_timeouts() {
    let env = TestEnv::new("migration_lock_wait").await;
    let holder = hold_migration_lock(&env).await;
    // Released after three times the transaction timeout.
    let release = actix_rt::spawn(async move {
        tokio::time::sleep(std::time::Duration::from_secs(3)).await;
        holder.batch_execute("COMMIT").await.unwrap();
    });
    // A migration of the service's that takes longer than the timeout too.
    let slow = [rabbit_inbox::Migration::new(
        1,
        "slow_backfill",
        "SELECT pg_sleep(1.5); CREATE TABLE backfilled (id bigint PRIMARY KEY)",
    )];
    let log = Captured::default();
    let capturing = log.install();
    let runtime = Runtime::builder(impatient(&env).valid())
        .migrations(&slow)
        .start()
        .await
        .expect("the start waits for the lock and runs the slow migration");
    drop(capturing);
    runtime.shutdown().await;
    release.await.unwrap();

    let text = log.text();
    assert!(
        text.contains("waiting for the migration lock") && text.contains("other-replica"),
        "the wait names who holds the lock: {text}"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM information_schema.tables WHERE table_name = 'backfilled'")
            .await,
        1
    );
}

#[actix_rt::test]
async fn a_start_gives_up_on_the_migration_lock_after_its_own_bound_naming_the_holder() {
    let env = TestEnv::new("migration_lock_bound").await;
    let _holder = hold_migration_lock(&env).await;
    let mut settings = impatient(&env);
    settings.database.migration_lock_timeout = std::time::Duration::from_secs(2);
    let error = Runtime::builder(settings.valid())
        .start()
        .await
        .expect_err("the lock is never released")
        .to_string();
    assert!(
        error.contains("database.migration_lock_timeout") && error.contains("other-replica"),
        "{error}"
    );
}
