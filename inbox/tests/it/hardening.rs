//! Hostile input and handler errors: every delivery settles, none loops hot,
//! crashes the consumer or is dropped.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rabbit_inbox::internal::fault::headers;
use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::tools::lapin::types::{AMQPValue, FieldTable};
use rabbit_inbox::tools::{error_queue, retry_queue};
use rabbit_inbox::{EventHandler, HandlerError, MessageContext, Permanent, UnitOfWork};
use rabbit_inbox::{Runtime, StatsSnapshot};

use crate::batching::{batching, counts, prefill_keys};
use crate::support::{Counted, TestEnv, Valid, header, increment, publish_keys, rabbitmqctl, wait_until};

/// How [`FailsFor`] fails.
#[derive(Clone, Copy)]
enum How {
    /// An error that is not the handler's to classify: a plain string.
    Plainly,
    /// A refused HTTP call, say: an io::Error, which is not the inbox's
    /// database going away.
    WithIoError,
    /// Kills its own database connection, while the database stays up.
    KillingItsConnection,
    /// A business rejection no retry can fix.
    Permanently,
}

/// Fails every call for `key` the way `how` says, counting those calls;
/// counts every other key like `Count`.
struct FailsFor {
    key: i64,
    how: How,
    calls: Arc<AtomicUsize>,
}

impl FailsFor {
    fn new(key: i64, how: How) -> Self {
        Self {
            key,
            how,
            calls: Arc::default(),
        }
    }
}

impl EventHandler<Counted> for FailsFor {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key != self.key {
            return increment(uow, "counts", event.key).await;
        }
        self.calls.fetch_add(1, Ordering::SeqCst);
        Err(match self.how {
            How::Plainly => "fails".into(),
            How::WithIoError => {
                std::io::Error::new(std::io::ErrorKind::ConnectionRefused, "payments API refused").into()
            }
            How::KillingItsConnection => {
                let killed = uow
                    .client()
                    .batch_execute("SELECT pg_terminate_backend(pg_backend_pid())")
                    .await;
                match killed {
                    Ok(()) => "the backend survived".into(),
                    Err(e) => e.into(),
                }
            }
            How::Permanently => Permanent::new("attendee 7 is banned").into(),
        })
    }

    fn name(&self) -> &'static str {
        "FailsFor"
    }
}

/// What became of key 7 when it failed `how` among keys 0..5.
struct Failed {
    /// Its copy in the error queue.
    copy: rabbit_inbox::tools::lapin::message::Delivery,
    /// The handler's calls for it.
    calls: usize,
    stats: StatsSnapshot,
}

/// Runs a runtime whose handler fails key 7 `how`, with one immediate retry
/// and one short retry tier, until the other keys complete and key 7 is set
/// aside. Key 7 arrives with `headers`, as another client could send it.
async fn fail_key_7(env: &TestEnv, how: How, headers: FieldTable) -> Failed {
    let mut settings = env.settings();
    settings.failure.immediate_retries = 1;
    settings.failure.delays = vec![std::time::Duration::from_millis(100)];
    // Each message alone, so that an attempt is one call: key 7 arriving
    // with the others (a runtime still starting when they are published)
    // would fail its batch first and run again alone (batching.rs).
    settings.queues[0].batch_size = 1;
    let handler = FailsFor::new(7, how);
    let calls = Arc::clone(&handler.calls);
    let runtime = Runtime::builder(settings.valid())
        .handler(handler)
        .start()
        .await
        .unwrap();
    let properties = BasicProperties::default()
        .with_message_id(uuid::Uuid::now_v7().to_string().into())
        .with_type("Counted".into())
        .with_headers(headers);
    env.publish_raw(properties, br#"{"key": 7}"#).await;
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("the others complete and key 7 is set aside", || async {
        let s = runtime.stats();
        s.completed == 5 && s.dead_lettered + s.rejected == 1
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;
    let copy = env
        .take(&error_queue(&env.queue))
        .await
        .expect("key 7 is in the error queue");
    Failed {
        copy,
        calls: calls.load(Ordering::SeqCst),
        stats,
    }
}

#[actix_rt::test]
async fn a_handler_io_error_walks_the_failure_policy_to_the_error_queue() {
    let env = TestEnv::new("handler_io_error").await;
    let Failed { copy, calls, stats } = fail_key_7(&env, How::WithIoError, FieldTable::default()).await;

    // Two attempts on each of two deliveries: the policy, not a hot loop.
    assert_eq!(calls, 4);
    assert_eq!((stats.delayed, stats.dead_lettered), (1, 1), "{stats:?}");
    assert_eq!(header(&copy, headers::ATTEMPTS).as_deref(), Some("4"));
    assert_eq!(
        header(&copy, headers::REASON).as_deref(),
        Some("payments API refused")
    );
}

#[actix_rt::test]
async fn a_handler_that_kills_its_own_connection_ends_in_the_error_queue_without_looping() {
    let env = TestEnv::new("handler_kills_connection").await;
    // The runtime's own connection is lost, yet the database answers at
    // once: held a few times, then counted as the message's failure.
    let Failed { copy, calls, .. } = fail_key_7(&env, How::KillingItsConnection, FieldTable::default()).await;

    // Three holds in vain, then two attempts, on each of two deliveries.
    assert_eq!(calls, 10);
    assert_eq!(header(&copy, headers::ATTEMPTS).as_deref(), Some("4"));
}

#[actix_rt::test]
async fn a_permanent_failure_goes_straight_to_the_error_queue_with_its_reason() {
    let env = TestEnv::new("permanent_failure").await;
    let Failed { copy, calls, stats } = fail_key_7(&env, How::Permanently, FieldTable::default()).await;

    assert_eq!(calls, 1, "no retries");
    assert_eq!((stats.abandoned, stats.delayed), (0, 0), "{stats:?}");
    assert_eq!(
        header(&copy, headers::REASON).as_deref(),
        Some("attendee 7 is banned")
    );
    assert_eq!(header(&copy, headers::HANDLER).as_deref(), Some("FailsFor"));
    assert_eq!(env.ready(&retry_queue(&env.queue, 1)).await, 0);
}

#[actix_rt::test]
async fn a_producer_set_attempt_count_at_the_limit_neither_crashes_nor_stops_the_consumer() {
    let env = TestEnv::new("hostile_attempts").await;
    let mut hostile = FieldTable::default();
    hostile.insert(headers::ATTEMPTS.into(), AMQPValue::LongLongInt(4_294_967_295));
    hostile.insert(
        headers::REDELIVERIES.into(),
        AMQPValue::LongLongInt(4_294_967_295),
    );
    let Failed { copy, stats, .. } = fail_key_7(&env, How::Plainly, hostile).await;
    assert_eq!(stats.dead_lettered, 1, "past the last tier at once: {stats:?}");
    assert_eq!(header(&copy, headers::ATTEMPTS).as_deref(), Some("4294967295"));
}

/// Counts each event; in a nested scope of its own it also counts it in
/// `second_counts`, and undoes that for odd keys after a failed statement.
/// Fails the whole batch (its first call for key 5).
struct CountWithOptionalPart {
    calls_for_5: AtomicUsize,
}

impl EventHandler<Counted> for CountWithOptionalPart {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let scope = uow.nested().await?;
        let key = event.key;
        let sql = "INSERT INTO second_counts (key, n) VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET n = second_counts.n + 1";
        scope.client().execute(sql, &[&key]).await?;
        if key % 2 == 1 {
            assert!(scope.client().batch_execute("SELECT 1 / 0").await.is_err());
            scope.rollback().await?;
        } else {
            scope.release().await?;
        }
        increment(uow, "counts", key).await?;
        if key == 5 && self.calls_for_5.fetch_add(1, Ordering::SeqCst) == 0 {
            return Err("fails the batch once".into());
        }
        Ok(())
    }
}

#[actix_rt::test]
async fn a_handlers_nested_scopes_leave_a_split_batch_exactly_once() {
    let env = TestEnv::new("nested_scopes").await;
    let settings = batching(&env);
    prefill_keys(&settings, 0..16).await;
    let handler = CountWithOptionalPart {
        calls_for_5: AtomicUsize::new(0),
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(handler)
        .start()
        .await
        .unwrap();
    wait_until("all 16 complete", || async { runtime.stats().completed == 16 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(stats.batches_split, 1, "{stats:?}");
    let (first, second) = (counts(&env, "counts").await, counts(&env, "second_counts").await);
    assert_eq!(first.len(), 16);
    assert!(first.values().all(|&n| n == 1), "{first:?}");
    let even: Vec<i64> = (0..16).filter(|k| k % 2 == 0).collect();
    let mut kept: Vec<i64> = second.keys().copied().collect();
    kept.sort();
    assert_eq!(kept, even, "odd keys rolled back their scope");
    assert!(second.values().all(|&n| n == 1), "{second:?}");
}

#[actix_rt::test]
async fn a_consuming_runtime_without_handlers_refuses_to_start() {
    let env = TestEnv::new("no_handlers").await;
    let error = match Runtime::builder(env.settings().valid()).start().await {
        Ok(_) => panic!("a runtime without handlers started consuming"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains("no handler"), "{error}");
    assert!(error.contains(&env.queue), "{error}");
    // Nothing was consumed, nothing was declared.
    assert_eq!(env.consumers(&env.queue).await, None);
}

#[actix_rt::test]
async fn a_forged_x_death_or_delivery_count_changes_no_count() {
    // RabbitMQ 4 ignores an `x-death` a client sets; the runtime counts
    // nothing from it, nor from a client's `x-delivery-count`, on any
    // version.
    let env = TestEnv::new("forged_x_death").await;
    let mut death = FieldTable::default();
    death.insert("count".into(), AMQPValue::LongLongInt(1_000));
    death.insert("reason".into(), AMQPValue::LongString("delivery_limit".into()));
    death.insert("queue".into(), AMQPValue::LongString(env.queue.as_str().into()));
    let mut forged = FieldTable::default();
    forged.insert(
        "x-death".into(),
        AMQPValue::FieldArray(vec![AMQPValue::FieldTable(death)].into()),
    );
    forged.insert("x-delivery-count".into(), AMQPValue::LongLongInt(1_000));
    let Failed { copy, calls, stats } = fail_key_7(&env, How::Plainly, forged).await;
    // The same walk as a message without them: two attempts on each of two
    // deliveries, then the error queue.
    assert_eq!(calls, 4);
    assert_eq!((stats.delayed, stats.dead_lettered), (1, 1), "{stats:?}");
    assert_eq!(header(&copy, headers::ATTEMPTS).as_deref(), Some("4"));
}

#[actix_rt::test]
async fn every_queue_that_dead_letters_on_a_quorum_queue_does_so_at_least_once() {
    // Retry tiers dead-letter by TTL back to Q, and Q to Q.error: on a
    // quorum queue at-most-once unless declared so (RabbitMQ's
    // dead-lettering docs), on 3.x as on 4.x.
    let env = TestEnv::new("at_least_once_tiers").await;
    crate::support::declare(&env.settings()).await;
    let listed = rabbitmqctl(&["-q", "list_queues", "name", "arguments"]).await;
    let mut dead_lettering = 0;
    let (main, tiers) = (format!("{}\t", env.queue), format!("{}.retry.", env.queue));
    for line in listed
        .lines()
        .filter(|l| l.starts_with(&main) || l.starts_with(&tiers))
    {
        dead_lettering += 1;
        assert!(
            line.contains(r#"{"x-dead-letter-strategy","at-least-once"}"#),
            "{line}"
        );
        assert!(line.contains(r#"{"x-overflow","reject-publish"}"#), "{line}");
    }
    assert_eq!(dead_lettering, 3, "Q and its two tiers:\n{listed}");
}
