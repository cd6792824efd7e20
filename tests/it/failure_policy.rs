use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use inbox::amqp::{error_queue, retry_queue};
use inbox::fault::headers;
use inbox::{AmqpPublisher, EventHandler, HandlerError, Message, UnitOfWork};
use inbox_actors::Runtime;

use crate::support::{Counted, TestEnv, amqp, header, increment, wait_until};

/// Fails while `broken` is set (or for its first `fail_first` calls), and
/// counts every call; counts like `Count` when it succeeds.
#[derive(Clone, Default)]
struct Unreliable {
    broken: Arc<AtomicBool>,
    fail_first: usize,
    calls: Arc<AtomicUsize>,
}

impl EventHandler<Counted> for Unreliable {
    async fn handle(&self, event: &Counted, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
        let call = self.calls.fetch_add(1, Ordering::SeqCst);
        if self.broken.load(Ordering::SeqCst) || call < self.fail_first {
            return Err(format!("the ledger is closed (call {})", call + 1).into());
        }
        increment(uow, "counts", event.key).await
    }

    fn name(&self) -> &'static str {
        "Unreliable"
    }
}

impl Unreliable {
    fn broken() -> Self {
        Self {
            broken: Arc::new(AtomicBool::new(true)),
            ..Self::default()
        }
    }

    fn calls(&self) -> usize {
        self.calls.load(Ordering::SeqCst)
    }
}

#[actix_rt::test]
async fn a_handler_failing_twice_then_succeeding_commits_once_within_the_immediate_retries() {
    let env = TestEnv::new("fails_twice").await;
    let settings = env.settings();
    assert_eq!(settings.failure.immediate_retries, 2, "config/test.toml");
    let handler = Unreliable {
        fail_first: 2,
        ..Unreliable::default()
    };
    let runtime = Runtime::builder(settings)
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    runtime
        .publisher()
        .publish(&env.queue, &Message::new(Counted { key: 1 }))
        .await
        .unwrap();

    wait_until("it completes", || async { runtime.stats().completed == 1 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(handler.calls(), 3);
    assert_eq!((stats.abandoned, stats.delayed, stats.dead_lettered), (2, 0, 0));
    assert_eq!(env.count("counts", 1).await, 1, "committed once");
    for queue in [
        env.queue.clone(),
        retry_queue(&env.queue, 1),
        error_queue(&env.queue),
    ] {
        assert_eq!(env.ready(&queue).await, 0, "{queue}");
    }
}

#[actix_rt::test]
async fn an_always_failing_handler_ends_in_the_error_queue_after_exactly_the_configured_attempts() {
    let env = TestEnv::new("always_fails").await;
    let mut settings = env.settings();
    settings.failure.immediate_retries = 1;
    settings.failure.delays = vec![Duration::from_millis(200), Duration::from_millis(300)];
    let handler = Unreliable::broken();
    let runtime = Runtime::builder(settings)
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 3 });
    runtime.publisher().publish(&env.queue, &message).await.unwrap();

    wait_until("it is dead-lettered", || async {
        runtime.stats().dead_lettered == 1
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    // Two attempts (one immediate retry) on each of three deliveries (the
    // first, then one per tier).
    assert_eq!(handler.calls(), 6);
    assert_eq!((stats.abandoned, stats.delayed), (6, 2));
    assert_eq!(env.count("counts", 3).await, 0);
    let copy = env
        .take(&error_queue(&env.queue))
        .await
        .expect("the message is in the error queue");
    assert_eq!(copy.data, message.to_json().unwrap(), "the body is kept");
    assert_eq!(
        copy.properties
            .message_id()
            .as_ref()
            .map(|id| id.as_str().to_owned()),
        Some(message.id.to_string())
    );
    assert_eq!(
        copy.properties.kind().as_ref().map(|t| t.as_str()),
        Some("Counted")
    );
    assert_eq!(
        header(&copy, headers::REASON).as_deref(),
        Some("the ledger is closed (call 6)")
    );
    assert_eq!(header(&copy, headers::HANDLER).as_deref(), Some("Unreliable"));
    assert_eq!(header(&copy, headers::ATTEMPTS).as_deref(), Some("6"));
    assert_eq!(header(&copy, headers::REDELIVERIES).as_deref(), Some("2"));
    assert_eq!(
        header(&copy, headers::SOURCE_QUEUE).as_deref(),
        Some(env.queue.as_str())
    );
    let time = |key| humantime::parse_rfc3339(&header(&copy, key).unwrap()).unwrap();
    let (first, last) = (time(headers::FIRST_FAILURE), time(headers::LAST_FAILURE));
    assert!(
        last.duration_since(first).unwrap() >= Duration::from_millis(500),
        "first and last failure are the whole path apart"
    );
    for queue in [
        env.queue.clone(),
        retry_queue(&env.queue, 1),
        retry_queue(&env.queue, 2),
    ] {
        assert_eq!(env.ready(&queue).await, 0, "{queue}");
    }
}

#[actix_rt::test]
async fn a_message_waiting_in_a_retry_tier_outlives_the_runtime_and_its_attempts_continue() {
    let env = TestEnv::new("retry_tier_restart").await;
    let mut settings = env.settings();
    settings.failure.immediate_retries = 0;
    settings.failure.delays = vec![Duration::from_secs(1), Duration::from_millis(300)];
    let handler = Unreliable::broken();
    let first = Runtime::builder(settings.clone())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    first
        .publisher()
        .publish(&env.queue, &Message::new(Counted { key: 4 }))
        .await
        .unwrap();
    wait_until("it waits in the first tier", || async {
        first.stats().delayed == 1
    })
    .await;
    // The runtime goes away; the message waits in the broker alone.
    first.shutdown().await;

    let second = Runtime::builder(settings)
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    wait_until("it is dead-lettered", || async {
        second.stats().dead_lettered == 1
    })
    .await;
    second.shutdown().await;

    assert_eq!(
        handler.calls(),
        3,
        "one attempt per delivery, across both runtimes"
    );
    let copy = env
        .take(&error_queue(&env.queue))
        .await
        .expect("the message is in the error queue");
    assert_eq!(
        header(&copy, headers::ATTEMPTS).as_deref(),
        Some("3"),
        "the count went on from the header"
    );
    assert_eq!(header(&copy, headers::REDELIVERIES).as_deref(), Some("2"));
}

#[actix_rt::test]
async fn replay_moves_messages_back_and_a_processed_one_is_skipped() {
    let env = TestEnv::new("replay").await;
    let mut settings = env.settings();
    settings.failure.immediate_retries = 0;
    settings.failure.delays = Vec::new();
    let handler = Unreliable::broken();
    let runtime = Runtime::builder(settings)
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    let failed = Message::new(Counted { key: 1 });
    let also_failed = Message::new(Counted { key: 3 });
    runtime.publisher().publish(&env.queue, &failed).await.unwrap();
    runtime
        .publisher()
        .publish(&env.queue, &also_failed)
        .await
        .unwrap();
    wait_until("both are dead-lettered", || async {
        runtime.stats().dead_lettered == 2
    })
    .await;

    // The fault is fixed. A message is processed, and a stray copy of it
    // lands in the error queue as well.
    handler.broken.store(false, Ordering::SeqCst);
    let processed = Message::new(Counted { key: 2 });
    runtime.publisher().publish(&env.queue, &processed).await.unwrap();
    wait_until("it is processed", || async { runtime.stats().completed == 1 }).await;
    let connection = amqp().await;
    AmqpPublisher::new(&connection, "")
        .await
        .unwrap()
        .publish(&error_queue(&env.queue), &processed)
        .await
        .unwrap();

    let only: HashSet<_> = [failed.id, processed.id].into();
    let report = inbox::amqp::replay(&connection, &env.queue, Some(&only))
        .await
        .unwrap();
    assert_eq!((report.replayed, report.left), (2, 1));
    wait_until("the replayed ones are settled", || async {
        let s = runtime.stats();
        s.completed == 2 && s.duplicates == 1
    })
    .await;
    runtime.shutdown().await;

    assert_eq!(
        env.count("counts", 1).await,
        1,
        "the failed message ran after its replay"
    );
    assert_eq!(env.count("counts", 2).await, 1, "the processed one was skipped");
    assert_eq!(env.count("counts", 3).await, 0, "the one not selected stayed");
    let left = env.take(&error_queue(&env.queue)).await.expect("one is left");
    assert_eq!(
        left.properties.message_id().as_ref().unwrap().as_str(),
        also_failed.id.to_string()
    );
    assert_eq!(env.ready(&error_queue(&env.queue)).await, 0);
}

#[actix_rt::test]
async fn a_queue_declared_with_other_arguments_is_one_startup_error_naming_it() {
    let env = TestEnv::new("topology_mismatch").await;
    let mut settings = env.settings();
    // The queue exists as a classic queue; the settings say quorum.
    settings.queues[0].kind = inbox::QueueKind::Classic;
    let connection = amqp().await;
    inbox::amqp::declare_topology(
        &connection.create_channel().await.unwrap(),
        &settings.queues[0],
        &settings.failure,
    )
    .await
    .unwrap();
    settings.queues[0].kind = inbox::QueueKind::Quorum;

    let error = match Runtime::builder(settings).start().await {
        Ok(_) => panic!("the runtime started over a mismatched queue"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains(&format!("`{}`", env.queue)), "{error}");
    assert!(error.contains("x-queue-type"), "{error}");
}
