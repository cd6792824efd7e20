use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rabbit_inbox::Runtime;
use rabbit_inbox::internal::Envelope;
use rabbit_inbox::internal::{DeliverBatch, Outcome};
use rabbit_inbox::tools::AmqpPublisher;
use rabbit_inbox::tools::lapin::options::{BasicGetOptions, BasicQosOptions};
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, Settings, UnitOfWork};

use crate::hosting::HandWrittenStore;
use crate::support::{Count, Counted, TestEnv, Valid, amqp, declare, increment, wait_until};

/// Batches of up to 8 among 16 deliveries in flight.
pub(crate) fn batching(env: &TestEnv) -> Settings {
    let mut settings = env.settings();
    settings.queues[0].prefetch = 16;
    settings.queues[0].batch_size = 8;
    settings
}

/// Declares the queue and publishes `messages` before any runtime consumes,
/// so that deliveries are ready together and batches form.
pub(crate) async fn prefill(settings: &Settings, messages: &[&Message<Counted>]) {
    declare(settings).await;
    let connection = amqp().await;
    let publisher = AmqpPublisher::new(&connection, "").await.unwrap();
    for message in messages {
        publisher
            .publish(&settings.queues[0].name, message)
            .await
            .unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
}

/// [`prefill`] with one new message per key, in this order.
pub(crate) async fn prefill_keys(settings: &Settings, keys: impl IntoIterator<Item = i64>) {
    let messages: Vec<_> = keys
        .into_iter()
        .map(|key| Message::new(Counted { key }))
        .collect();
    prefill(settings, &messages.iter().collect::<Vec<_>>()).await;
}

/// Fails (or panics, with `panic`) on its first `times` calls for `key`
/// (at least one); otherwise counts in `second_counts`.
#[derive(Default)]
struct FailsOnce {
    key: i64,
    times: usize,
    calls: Arc<AtomicUsize>,
    panic: bool,
}

impl EventHandler<Counted> for FailsOnce {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == self.key && self.calls.fetch_add(1, Ordering::SeqCst) < self.times.max(1) {
            if self.panic {
                panic!("panics on purpose");
            }
            return Err("fails on purpose".into());
        }
        increment(uow, "second_counts", event.key).await
    }
}

/// Counts a whole batch in one set-based statement, and remembers the size
/// of every batch it was given. Fails a batch holding `poison`.
#[derive(Default)]
struct CountSetBased {
    poison: Option<i64>,
    batch_sizes: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl EventHandler<Counted> for CountSetBased {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        self.handle_batch(std::slice::from_ref(event), std::slice::from_ref(context), uow)
            .await
    }

    async fn handle_batch(
        &self,
        events: &[Counted],
        _contexts: &[MessageContext],
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        self.batch_sizes.lock().unwrap().push(events.len());
        if events.iter().any(|e| Some(e.key) == self.poison) {
            return Err("a poisoned key".into());
        }
        let keys: Vec<i64> = events.iter().map(|e| e.key).collect();
        uow.client()
            .execute(
                "INSERT INTO counts (key, n)
                 SELECT key, count(*) FROM unnest($1::bigint[]) AS e (key) GROUP BY key ORDER BY key
                 ON CONFLICT (key) DO UPDATE SET n = counts.n + excluded.n",
                &[&keys],
            )
            .await?;
        Ok(())
    }
}

pub(crate) async fn counts(env: &TestEnv, table: &str) -> HashMap<i64, i64> {
    let rows = env
        .db()
        .await
        .query(&format!("SELECT key, n FROM {table}"), &[])
        .await
        .unwrap();
    rows.iter().map(|r| (r.get(0), r.get(1))).collect()
}

#[actix_rt::test]
async fn a_failing_message_in_a_batch_is_rolled_back_alone_and_the_others_commit() {
    let env = TestEnv::new("batch_failing_message").await;
    let settings = batching(&env);
    prefill_keys(&settings, 0..16).await;
    // Fails on the whole batch and again alone: it is the one to fail.
    let fails_twice = FailsOnce {
        key: 5,
        times: 2,
        ..FailsOnce::default()
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .handler(fails_twice)
        .start()
        .await
        .unwrap();

    wait_until("all 16 complete", || async { runtime.stats().completed == 16 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert!(
        stats.batches >= 1 && stats.batches < 16,
        "no batches formed: {stats:?}"
    );
    assert_eq!(stats.batches_split, 1, "{stats:?}");
    assert_eq!(stats.abandoned, 1, "only the failing message failed: {stats:?}");
    let (first, second) = (counts(&env, "counts").await, counts(&env, "second_counts").await);
    // Count ran for key 5 before FailsOnce failed, on the batch and alone;
    // had either write survived its rollback, key 5 would read 2 or 3.
    assert_eq!(first.len(), 16);
    assert!(first.values().all(|&n| n == 1), "{first:?}");
    assert_eq!(second.len(), 16);
    assert!(second.values().all(|&n| n == 1), "{second:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 16);
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_panic_in_a_batch_runs_its_messages_alone_and_every_message_still_counts_once() {
    let env = TestEnv::new("batch_panic").await;
    let settings = batching(&env);
    prefill_keys(&settings, 0..16).await;
    let panics_once = FailsOnce {
        key: 5,
        panic: true,
        ..FailsOnce::default()
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .handler(panics_once)
        .start()
        .await
        .unwrap();

    wait_until("all 16 complete", || async { runtime.stats().completed == 16 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    // Which message panicked is unknown until each runs alone; key 5 does
    // not panic a second time, so no message is charged at all.
    assert!(stats.batches_split >= 1, "{stats:?}");
    assert_eq!(stats.abandoned, 0, "a message was charged for a panic: {stats:?}");
    let (first, second) = (counts(&env, "counts").await, counts(&env, "second_counts").await);
    assert_eq!(first.len(), 16);
    assert!(
        first.values().all(|&n| n == 1),
        "a batch-mate took effect twice: {first:?}"
    );
    assert_eq!(second.len(), 16);
    assert!(second.values().all(|&n| n == 1), "{second:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 16);
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_duplicate_inside_a_batch_runs_once() {
    let env = TestEnv::new("batch_duplicate").await;
    let settings = batching(&env);
    let repeated = Message::new(Counted { key: 100 });
    let others: Vec<_> = (0..5).map(|key| Message::new(Counted { key })).collect();
    let mut order = vec![&repeated, &repeated];
    order.extend(others.iter());
    order.push(&repeated);
    prefill(&settings, &order).await;
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();

    wait_until("all eight copies are settled", || async {
        let s = runtime.stats();
        s.completed + s.duplicates == 8
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!((stats.completed, stats.duplicates), (6, 2));
    assert!(stats.batches >= 1, "{stats:?}");
    assert_eq!(env.count("counts", 100).await, 1);
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn duplicates_in_flight_in_batches_of_two_runtimes_run_once() {
    let env = TestEnv::new("batch_two_runtimes").await;
    let settings = batching(&env);
    let messages: Vec<_> = (0..200).map(|key| Message::new(Counted { key })).collect();
    // Each message three times, the copies interleaved differently.
    let mut order: Vec<&Message<Counted>> = Vec::new();
    for round in 0..3 {
        order.extend(
            messages
                .iter()
                .skip(round * 11 % 200)
                .chain(messages.iter().take(round * 11 % 200)),
        );
    }
    prefill(&settings, &order).await;
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

    wait_until("all 600 copies are settled", || async {
        let (a, b) = (first.stats(), second.stats());
        a.completed + a.duplicates + b.completed + b.duplicates == 600
    })
    .await;
    let (a, b) = (first.stats(), second.stats());
    first.shutdown().await;
    second.shutdown().await;

    assert_eq!(a.completed + b.completed, 200, "{a:?} {b:?}");
    let counts = counts(&env, "counts").await;
    assert_eq!(counts.len(), 200);
    assert!(
        counts.values().all(|&n| n == 1),
        "an id took effect twice: {counts:?}"
    );
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_crash_after_a_batch_commit_before_its_acks_is_skipped_on_redelivery() {
    let env = TestEnv::new("batch_commit_then_crash").await;
    let settings = batching(&env);
    prefill_keys(&settings, 0..5).await;
    // Another consumer takes all five before the runtime starts...
    let crashing = amqp().await;
    let channel = crashing.create_channel().await.unwrap();
    channel.basic_qos(5, BasicQosOptions::default()).await.unwrap();
    let mut envelopes = Vec::new();
    for _ in 0..5 {
        let taken = channel
            .basic_get(env.queue.as_str().into(), BasicGetOptions { no_ack: false })
            .await
            .unwrap()
            .expect("a message")
            .delivery;
        let mut body = taken.data.clone();
        let envelope = Envelope::decode(&taken.properties, &mut body, false, &env.queue).unwrap();
        envelopes.push(Arc::new(envelope));
    }
    // ...runs them through the inbox as one batch, which commits...
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let outcomes = rabbit_inbox::internal::dedup_of(&runtime)
        .send(DeliverBatch {
            consumer: env.queue.as_str().into(),
            envelopes,
            concurrent_batches: 1,
        })
        .await
        .unwrap();
    assert_eq!(outcomes, vec![Outcome::Completed; 5]);
    // ...and "crashes" before acking any of them.
    crashing.close(320, "crash".into()).await.unwrap();

    wait_until("the redeliveries are skipped", || async {
        runtime.stats().duplicates == 5
    })
    .await;
    runtime.shutdown().await;
    let counts = counts(&env, "counts").await;
    assert_eq!(counts.len(), 5);
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_store_with_only_the_required_methods_works_in_batches() {
    let env = TestEnv::new("batch_hand_written_store").await;
    HandWrittenStore::create_table(&env).await;
    let settings = batching(&env);
    let repeated = Message::new(Counted { key: 1 });
    let failing = Message::new(Counted { key: 2 });
    let other = Message::new(Counted { key: 3 });
    prefill(&settings, &[&repeated, &failing, &repeated, &other, &repeated]).await;
    let fails_once = FailsOnce {
        key: 2,
        ..FailsOnce::default()
    };
    let runtime = Runtime::builder(settings.valid())
        .inbox_store(HandWrittenStore)
        .handler(fails_once)
        .start()
        .await
        .unwrap();

    wait_until("every copy is settled", || async {
        let s = runtime.stats();
        s.completed == 3 && s.duplicates == 2
    })
    .await;
    runtime.shutdown().await;

    let counts = counts(&env, "second_counts").await;
    assert_eq!(counts, HashMap::from([(1, 1), (2, 1), (3, 1)]));
    assert_eq!(env.scalar("SELECT count(*) FROM my_inbox").await, 3);
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_set_based_handler_gets_whole_batches_and_a_failure_isolates_one_message() {
    let env = TestEnv::new("batch_set_based").await;
    let settings = batching(&env);
    prefill_keys(&settings, (0..16).map(|i| i % 4)).await;
    let batch_sizes = Arc::default();
    let handler = CountSetBased {
        poison: Some(3),
        batch_sizes: Arc::clone(&batch_sizes),
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(handler)
        .start()
        .await
        .unwrap();

    // The four messages of key 3 fail alone, every attempt; the others commit.
    wait_until("the 12 others complete and key 3 is dead-lettered", || async {
        let s = runtime.stats();
        s.completed == 12 && s.dead_lettered == 4
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    let sizes = batch_sizes.lock().unwrap().clone();
    assert!(sizes.iter().any(|&n| n > 1), "never given a batch: {sizes:?}");
    assert!(stats.batches_split >= 1, "{stats:?}");
    assert_eq!(
        counts(&env, "counts").await,
        HashMap::from([(0, 4), (1, 4), (2, 4)]),
        "key 3 must have no effect, the others exactly theirs"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 12);
    assert_eq!(env.ready(&env.queue).await, 0);
    assert_eq!(env.ready(&format!("{}.error", env.queue)).await, 4);
}

#[actix_rt::test]
async fn concurrent_batches_of_set_based_handlers_count_hot_keys_exactly() {
    let env = TestEnv::new("batch_concurrent").await;
    let mut settings = batching(&env);
    settings.queues[0].batch_size = 4;
    settings.queues[0].concurrent_batches = 4;
    // 400 messages on 5 hot keys: every batch shares rows with the others.
    prefill_keys(&settings, (0..400).map(|i| i % 5)).await;
    let runtime = Runtime::builder(settings.valid())
        .handler(CountSetBased::default())
        .start()
        .await
        .unwrap();

    wait_until("all 400 complete", || async { runtime.stats().completed == 400 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert!(stats.batches > 1, "{stats:?}");
    assert_eq!(stats.abandoned, 0, "a batch failed (a deadlock?): {stats:?}");
    assert_eq!(
        counts(&env, "counts").await,
        HashMap::from([(0, 80), (1, 80), (2, 80), (3, 80), (4, 80)])
    );
    assert_eq!(env.ready(&env.queue).await, 0);
}

/// For `key`, runs a failing statement and returns Ok all the same: the
/// transaction is aborted behind the runtime's back.
struct SwallowsAnError {
    key: i64,
}

impl EventHandler<Counted> for SwallowsAnError {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == self.key {
            let _ignored = uow.client().batch_execute("SELECT 1/0").await;
        }
        Ok(())
    }
}

#[actix_rt::test]
async fn a_handler_that_swallows_a_failed_statement_in_a_batch_gets_nothing_acked_without_effect() {
    let env = TestEnv::new("batch_swallowed_error").await;
    let settings = batching(&env);
    prefill_keys(&settings, 0..8).await;
    // Failing key 7 once fails the whole batch, before key 3's turn: the
    // batch then runs one message at a time, a savepoint each.
    let fails_once = FailsOnce {
        key: 7,
        ..FailsOnce::default()
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .handler(fails_once)
        .handler(SwallowsAnError { key: 3 })
        .start()
        .await
        .unwrap();

    // After key 3 the transaction is aborted: key 4's savepoint fails and
    // so does everything after it, the commit included. Rolling back to an
    // older savepoint instead would undo key 3 and commit the rest, acking
    // key 3 without its effect. Key 3 can never commit.
    wait_until("all 8 are settled", || async {
        let s = runtime.stats();
        s.completed + s.dead_lettered == 8
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!((stats.completed, stats.dead_lettered), (7, 1), "{stats:?}");
    assert!(stats.batches_split >= 1, "{stats:?}");
    let expected: HashMap<i64, i64> = (0..8).filter(|&k| k != 3).map(|k| (k, 1)).collect();
    for table in ["counts", "second_counts"] {
        assert_eq!(
            counts(&env, table).await,
            expected,
            "{table}: an acked message lost its effect, or one took effect twice"
        );
    }
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 7);
    assert_eq!(env.ready(&env.queue).await, 0);
}

/// For `key`: takes two seconds, then fails, every time: a process that
/// dies while it handles that message.
struct StallsThenFails {
    key: i64,
}

impl EventHandler<Counted> for StallsThenFails {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == self.key {
            tokio::time::sleep(std::time::Duration::from_secs(2)).await;
            return Err("the process died".into());
        }
        increment(uow, "counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_later_batch_acked_first_never_acks_an_earlier_unfinished_one() {
    let env = TestEnv::new("batch_ack_order").await;
    let mut settings = batching(&env);
    settings.queues[0].batch_size = 4;
    settings.queues[0].concurrent_batches = 4;
    settings.runtime.shutdown_timeout = std::time::Duration::from_millis(100);
    // Key 0 is delivered first: its batch has the lowest delivery tags.
    prefill_keys(&settings, 0..16).await;
    let first = Runtime::builder(settings.clone().valid())
        .handler(StallsThenFails { key: 0 })
        .start()
        .await
        .unwrap();
    // Later batches complete and are acked while key 0's batch waits...
    wait_until("a later batch completes", || async {
        first.stats().completed >= 4
    })
    .await;
    let stats = first.stats();
    // ...then the process "dies": the shutdown gives up at once and closes
    // the connection, so what is unacked goes back to the queue, and key 0
    // never commits there. An ack with `multiple` from a later batch would
    // have settled key 0's delivery unprocessed, and lost it.
    first.shutdown().await;
    assert!(stats.batches >= 1, "{stats:?}");

    let second = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    wait_until("the queue is drained", || async {
        env.ready(&env.queue).await == 0 && counts(&env, "counts").await.len() == 16
    })
    .await;
    second.shutdown().await;
    let counts = counts(&env, "counts").await;
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

/// Fails key `key` while `stuck` is set, counts every other key in
/// `counts`; records the size of each batch it is given that holds `key`.
#[derive(Clone, Default)]
struct StuckOn {
    key: i64,
    stuck: Arc<std::sync::atomic::AtomicBool>,
    batches_holding_key: Arc<std::sync::Mutex<Vec<usize>>>,
}

impl EventHandler<Counted> for StuckOn {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == self.key && self.stuck.load(Ordering::SeqCst) {
            return Err("waits on a row lock, then times out".into());
        }
        increment(uow, "counts", event.key).await
    }

    async fn handle_batch(
        &self,
        events: &[Counted],
        contexts: &[MessageContext],
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if events.iter().any(|e| e.key == self.key) {
            self.batches_holding_key.lock().unwrap().push(events.len());
        }
        for (event, context) in events.iter().zip(contexts) {
            self.handle(event, context, uow).await?;
        }
        Ok(())
    }
}

#[actix_rt::test]
async fn a_member_that_keeps_failing_leaves_its_batch_and_holds_up_no_other_message() {
    let env = TestEnv::new("batch_leaver").await;
    let mut settings = env.settings();
    // One batch in flight at a time: a batch held by one member would
    // stop the whole queue.
    settings.queues[0].prefetch = 16;
    settings.queues[0].batch_size = 16;
    // Retries that outlast the test: 0.2 s, 0.4 s, ... doubling.
    settings.failure.immediate_retries = 10;
    settings.failure.immediate_backoff = std::time::Duration::from_millis(200);
    let others = 400;
    prefill_keys(&settings, 0..=others).await;
    let handler = StuckOn {
        key: 0,
        stuck: Arc::new(true.into()),
        ..StuckOn::default()
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();

    wait_until(
        "every other message completes while key 0 is still failing",
        || async { env.scalar("SELECT count(*) FROM counts WHERE key > 0").await == others },
    )
    .await;
    assert_eq!(env.count("counts", 0).await, 0, "key 0 is still failing");
    assert!(runtime.stats().retried >= 1, "{:?}", runtime.stats());
    handler.stuck.store(false, Ordering::SeqCst);
    wait_until("key 0 completes on its own retries", || async {
        env.count("counts", 0).await == 1
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert!(stats.batches >= 1, "no batches formed: {stats:?}");
    assert_eq!((stats.delayed, stats.dead_lettered), (0, 0), "{stats:?}");
    let counted = counts(&env, "counts").await;
    assert_eq!(counted.len() as i64, others + 1);
    assert!(counted.values().all(|&n| n == 1), "each once: {counted:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM inbox_messages").await,
        others + 1
    );
    assert_eq!(env.ready(&env.queue).await, 0);
}

/// With the default settings a message that arrives alone is processed
/// alone, as a batch of one: if it fails, it must leave that batch like any
/// member, or its retries would hold the queue's batches (a partial batch
/// waits while another is in flight) and every message after it.
#[actix_rt::test]
async fn a_lone_message_that_keeps_failing_holds_up_no_later_message_by_default() {
    let env = TestEnv::new("batch_lone_leaver").await;
    let mut settings = env.settings();
    assert!(
        settings.queues[0].batch_limit() > 1,
        "group commit is the default"
    );
    // Retries that outlast the test: 0.2 s, 0.4 s, ... doubling.
    settings.failure.immediate_retries = 10;
    settings.failure.immediate_backoff = std::time::Duration::from_millis(200);
    let handler = StuckOn {
        key: 0,
        stuck: Arc::new(true.into()),
        ..StuckOn::default()
    };
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    prefill_keys(&settings, [0]).await;
    wait_until("key 0 fails and retries", || async {
        runtime.stats().retried >= 1
    })
    .await;
    // Now one at a time, so that each is ready alone and goes alone.
    for key in 1..=20 {
        prefill_keys(&settings, [key]).await;
        wait_until(
            "the later message completes while key 0 is still failing",
            || async { env.count("counts", key).await == 1 },
        )
        .await;
    }
    assert_eq!(env.count("counts", 0).await, 0, "key 0 is still failing");
    handler.stuck.store(false, Ordering::SeqCst);
    wait_until("key 0 completes on its own retries", || async {
        env.count("counts", 0).await == 1
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!((stats.delayed, stats.dead_lettered), (0, 0), "{stats:?}");
    let counted = counts(&env, "counts").await;
    assert_eq!(counted.len(), 21);
    assert!(counted.values().all(|&n| n == 1), "each once: {counted:?}");
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_message_back_from_a_retry_tier_is_processed_alone_not_in_a_batch() {
    use rabbit_inbox::internal::fault::headers;
    use rabbit_inbox::tools::lapin::BasicProperties;
    use rabbit_inbox::tools::lapin::types::{AMQPValue, FieldTable};

    let env = TestEnv::new("batch_returning").await;
    let settings = batching(&env);
    declare(&settings).await;
    // Key 0 as a retry tier hands it back: it failed once already.
    let mut fault = FieldTable::default();
    fault.insert(headers::ATTEMPTS.into(), AMQPValue::LongLongInt(1));
    fault.insert(headers::REDELIVERIES.into(), AMQPValue::LongLongInt(1));
    let returning = BasicProperties::default()
        .with_message_id(uuid::Uuid::now_v7().to_string().into())
        .with_type("Counted".into())
        .with_content_type("application/json".into())
        .with_headers(fault);
    crate::support::publish_to("", &env.queue, returning, br#"{"key": 0}"#).await;
    prefill_keys(&settings, 1..16).await;
    let handler = StuckOn::default();
    let runtime = Runtime::builder(settings.valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();

    wait_until("all 16 complete", || async { runtime.stats().completed == 16 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert!(stats.batches >= 1, "no batches formed: {stats:?}");
    let batches = handler.batches_holding_key.lock().unwrap().clone();
    assert!(batches.is_empty(), "key 0 joined batches of {batches:?}");
    assert_eq!(env.count("counts", 0).await, 1);
}
