use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::internal::fault::headers;
use rabbit_inbox::tools::AmqpPublisher;
use rabbit_inbox::tools::{SetAside, error_queue, retry_queue};
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::support::{
    Count, Counted, TestEnv, Valid, amqp, crash_once_on, declare, delivered_before, header, increment,
    wait_until,
};

/// Fails while `broken` is set (or for its first `fail_first` calls), and
/// counts every call; counts like `Count` when it succeeds.
#[derive(Clone, Default)]
struct Unreliable {
    broken: Arc<AtomicBool>,
    fail_first: usize,
    calls: Arc<AtomicUsize>,
}

impl EventHandler<Counted> for Unreliable {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
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
    let runtime = Runtime::builder(settings.valid())
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
    let runtime = Runtime::builder(settings.valid())
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
    assert_eq!(
        header(&copy, headers::SET_ASIDE),
        Some(error_queue(&env.queue)),
        "marked as set aside"
    );
    for queue in [
        env.queue.clone(),
        retry_queue(&env.queue, 1),
        retry_queue(&env.queue, 2),
    ] {
        assert_eq!(env.ready(&queue).await, 0, "{queue}");
    }

    // Moved back as it lies in the error queue (the management UI, a
    // shovel): its failure headers are its past, and it walks the whole
    // path again rather than straight back.
    crate::support::publish_to("", &env.queue, copy.properties.clone(), &copy.data).await;
    wait_until("it walks the path again", || async {
        runtime.stats().dead_lettered == 2
    })
    .await;
    let again = runtime.stats();
    runtime.shutdown().await;
    assert_eq!((again.abandoned, again.delayed), (12, 4), "{again:?}");
}

#[actix_rt::test]
async fn a_message_waiting_in_a_retry_tier_outlives_the_runtime_and_its_attempts_continue() {
    let env = TestEnv::new("retry_tier_restart").await;
    let mut settings = env.settings();
    settings.failure.immediate_retries = 0;
    settings.failure.delays = vec![Duration::from_secs(1), Duration::from_millis(300)];
    let handler = Unreliable::broken();
    let first = Runtime::builder(settings.clone().valid())
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

    let second = Runtime::builder(settings.valid())
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
    let runtime = Runtime::builder(settings.valid())
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
    let report = rabbit_inbox::tools::replay(&connection, &env.queue, SetAside::Error, Some(&only))
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
    // It went round without being handed back, which on a quorum queue
    // would have spent one of its deliveries (the broker counts from 0).
    let count = header(&left, "x-delivery-count");
    assert!(matches!(count.as_deref(), None | Some("0")), "{count:?}");
    // Its reason is the one it was set aside with, untouched by the
    // replay: the first or the second failed call, whichever it was (the
    // two ran concurrently).
    let reason = header(&left, headers::REASON);
    assert!(
        matches!(
            reason.as_deref(),
            Some("the ledger is closed (call 1)" | "the ledger is closed (call 2)")
        ),
        "{reason:?}"
    );
    assert_eq!(env.ready(&error_queue(&env.queue)).await, 0);
}

#[actix_rt::test]
async fn a_queue_declared_with_other_arguments_is_one_startup_error_naming_it() {
    let env = TestEnv::new("topology_mismatch").await;
    let mut settings = env.settings();
    // The queue exists as a classic queue; the settings say quorum.
    settings.queues[0].kind = Some(rabbit_inbox::QueueKind::Classic);
    declare(&settings).await;
    settings.queues[0].kind = Some(rabbit_inbox::QueueKind::Quorum);

    let error = match Runtime::builder(settings.valid()).handler(Count).start().await {
        Ok(_) => panic!("the runtime started over a mismatched queue"),
        Err(error) => error.to_string(),
    };
    assert!(error.contains(&format!("`{}`", env.queue)), "{error}");
    assert!(error.contains("inequivalent arg"), "{error}");
}

#[actix_rt::test]
async fn a_message_delivered_past_the_delivery_limit_lands_in_the_error_queue() {
    let env = TestEnv::new("delivery_limit").await;
    let mut settings = env.settings();
    settings.queues[0].delivery_limit = 2;
    declare(&settings).await;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let message = Message::new(Counted { key: 1 });
    AmqpPublisher::new(&connection, "")
        .await
        .unwrap()
        .publish(&env.queue, &message)
        .await
        .unwrap();

    // A consumer that crashes on it every time, as far as the broker sees:
    // handed back again and again. On RabbitMQ 4 a quorum queue without
    // dead-lettering would drop it past its limit; on 3.x it would loop.
    let mut deliveries = 0;
    wait_until("the broker stops delivering it", || {
        let (channel, queue) = (channel.clone(), env.queue.clone());
        deliveries += 1;
        async move {
            let options = rabbit_inbox::tools::lapin::options::BasicGetOptions { no_ack: false };
            match channel.basic_get(queue.as_str().into(), options).await.unwrap() {
                Some(got) => {
                    let requeue = rabbit_inbox::tools::lapin::options::BasicNackOptions {
                        requeue: true,
                        ..Default::default()
                    };
                    got.delivery.acker.nack(requeue).await.unwrap();
                    false
                }
                None => true,
            }
        }
    })
    .await;
    assert!(deliveries >= 3, "delivered {deliveries} times");
    wait_until("it is dead-lettered", || async {
        env.ready(&error_queue(&env.queue)).await == 1
    })
    .await;
    let copy = env.take(&error_queue(&env.queue)).await.unwrap();
    assert_eq!(copy.data, message.to_json().unwrap());
    assert_eq!(
        death_reason(&copy).as_deref(),
        Some("delivery_limit"),
        "the broker says why"
    );
    connection.close(200, "done".into()).await.unwrap();
}

/// The reason of the newest `x-death` entry the broker stamped.
fn death_reason(delivery: &rabbit_inbox::tools::lapin::message::Delivery) -> Option<String> {
    use rabbit_inbox::tools::lapin::types::AMQPValue;
    let headers = delivery.properties.headers().as_ref()?;
    let AMQPValue::FieldArray(deaths) = headers.inner().get("x-death")? else {
        return None;
    };
    let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
        return None;
    };
    match newest.inner().get("reason")? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        _ => None,
    }
}

#[actix_rt::test]
async fn replay_from_the_skipped_queue_brings_messages_back_once_a_handler_is_registered() {
    let env = TestEnv::new("replay_skipped").await;
    let settings = env.settings();
    declare(&settings).await;
    let connection = amqp().await;
    // Set aside while no handler for its type was registered (a runtime
    // deployed without it), with the fault headers the move stamps.
    let message = Message::new(Counted { key: 9 });
    let fault = rabbit_inbox::internal::fault::Fault {
        reason: "no handler registered for type `Counted`",
        handler: "dispatch",
        history: rabbit_inbox::internal::fault::FailureHistory::default(),
        source_queue: &env.queue,
    };
    let mut stamped = rabbit_inbox::tools::lapin::types::FieldTable::default();
    fault.stamp(&mut stamped);
    let properties = rabbit_inbox::tools::lapin::BasicProperties::default()
        .with_message_id(message.id.to_string().into())
        .with_type("Counted".into())
        .with_headers(stamped);
    AmqpPublisher::new(&connection, "")
        .await
        .unwrap()
        .publish_raw(
            &rabbit_inbox::tools::skipped_queue(&env.queue),
            properties,
            &message.to_json().unwrap(),
        )
        .await
        .unwrap();

    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let report = rabbit_inbox::tools::replay(&connection, &env.queue, SetAside::Skipped, None)
        .await
        .unwrap();
    assert_eq!((report.replayed, report.left), (1, 0));
    wait_until("it is processed", || async { runtime.stats().completed == 1 }).await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 9).await, 1);
    assert_eq!(
        env.ready(&rabbit_inbox::tools::skipped_queue(&env.queue)).await,
        0
    );
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn a_message_replayed_after_its_delivery_limit_starts_with_its_deliveries_unspent() {
    let env = TestEnv::new("replay_delivery_limit").await;
    let mut settings = env.settings();
    // A classic queue: the runtime counts its deliveries itself.
    settings.queues[0].kind = Some(rabbit_inbox::QueueKind::Classic);
    settings.queues[0].delivery_limit = 3;
    declare(&settings).await;

    // Delivered twice and crashed on, and once more now: its third
    // delivery, the limit, is next.
    let message = Message::new(Counted { key: 1 });
    let connection = amqp().await;
    AmqpPublisher::new(&connection, "")
        .await
        .unwrap()
        .publish(&env.queue, &message)
        .await
        .unwrap();
    delivered_before(&settings, message.id, 2).await;
    crash_once_on(&env.queue).await;
    let start = || async {
        Runtime::builder(settings.clone().valid())
            .handler(Count)
            .start()
            .await
            .unwrap()
    };
    let runtime = start().await;
    wait_until("it is set aside at the limit", || async {
        env.ready(&error_queue(&env.queue)).await == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 1).await, 0);

    // The cause fixed, it is replayed; a consumer crashes on it once more.
    let report = rabbit_inbox::tools::replay(&connection, &env.queue, SetAside::Error, None)
        .await
        .unwrap();
    assert_eq!(report.replayed, 1);
    crash_once_on(&env.queue).await;
    let runtime = start().await;
    wait_until("it is handled, or set aside again", || async {
        env.count("counts", 1).await == 1 || env.ready(&error_queue(&env.queue)).await == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(
        env.count("counts", 1).await,
        1,
        "the replayed message went back to the error queue on its second delivery, its handlers never run"
    );
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn a_queue_with_a_failure_policy_of_its_own_gives_up_as_it_says() {
    let env = TestEnv::new("queue_policy").await;
    let mut settings = env.settings();
    // This queue: no immediate retry, no retry tier; the service's
    // (config/test.toml): two immediate retries, two tiers.
    settings.queues[0].failure.immediate_retries = Some(0);
    settings.queues[0].failure.delays = Some(Vec::new());
    let policy = settings.queues[0].failure_policy(&settings.failure);
    assert_eq!((policy.immediate_retries, policy.delays.len()), (0, 0));
    assert_eq!(
        policy.immediate_backoff, settings.failure.immediate_backoff,
        "a key left out is the service's"
    );
    let handler = Unreliable::broken();
    let runtime = Runtime::builder(settings.valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 1 });
    runtime.publisher().publish(&env.queue, &message).await.unwrap();
    let error = error_queue(&env.queue);
    wait_until("set aside", || async { env.ready(&error).await == 1 }).await;
    runtime.shutdown().await;
    assert_eq!(handler.calls(), 1, "one attempt, no retry");
    let copy = env.take(&error).await.unwrap();
    assert_eq!(header(&copy, headers::ATTEMPTS).as_deref(), Some("1"));
    assert_eq!(
        env.consumers(&retry_queue(&env.queue, 1)).await,
        None,
        "no retry tier declared"
    );
}
