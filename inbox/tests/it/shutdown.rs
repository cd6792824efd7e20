use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::support::{Count, Counted, TestEnv, Valid, increment, publish_keys, wait_until};

/// Counts after a pause, and says when the first call began.
struct Slow {
    started: Arc<AtomicBool>,
    pause: Duration,
}

impl EventHandler<Counted> for Slow {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        self.started.store(true, Ordering::SeqCst);
        tokio::time::sleep(self.pause).await;
        increment(uow, "counts", event.key).await
    }
}

/// A runtime consuming one message at a time with a handler that takes
/// 300 ms, five messages published, the first in its handler.
async fn first_of_five_in_flight(env: &TestEnv) -> Runtime {
    let mut settings = env.settings();
    settings.queues[0].prefetch = 1;
    let started = Arc::new(AtomicBool::new(false));
    let slow = Slow {
        started: Arc::clone(&started),
        pause: Duration::from_millis(300),
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(slow)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("the first message is in its handler", || async {
        started.load(Ordering::SeqCst)
    })
    .await;
    runtime
}

#[actix_rt::test]
async fn shutdown_finishes_the_message_in_flight_and_leaves_the_rest_queued() {
    let env = TestEnv::new("shutdown_drains").await;
    let runtime = first_of_five_in_flight(&env).await;
    let monitor = runtime.monitor();
    runtime.shutdown().await;

    assert_eq!(monitor.stats().completed, 1, "the message in flight finished");
    assert_eq!(env.count("counts", 0).await, 1);
    assert_eq!(
        env.ready(&env.queue).await,
        4,
        "it was acked, and the rest wait in the queue"
    );
}

#[actix_rt::test]
async fn shutdown_gives_up_at_its_timeout_and_the_unfinished_message_is_not_lost() {
    let env = TestEnv::new("shutdown_times_out").await;
    let mut settings = env.settings();
    settings.queues[0].prefetch = 1;
    settings.runtime.shutdown_timeout = Duration::from_millis(200);
    let started = Arc::new(AtomicBool::new(false));
    let slow = Slow {
        started: Arc::clone(&started),
        pause: Duration::from_secs(3),
    };
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(slow)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 9 });
    runtime.publisher().publish(&env.queue, &message).await.unwrap();
    wait_until("the message is in its handler", || async {
        started.load(Ordering::SeqCst)
    })
    .await;
    runtime.shutdown().await;

    // Its ack can no longer reach the broker: the message is back in the
    // queue, and a new runtime skips it once the old transaction commits.
    wait_until("the message is back in the queue", || async {
        env.ready(&env.queue).await == 1
    })
    .await;
    let slow = Slow {
        started: Arc::new(AtomicBool::new(false)),
        pause: Duration::ZERO,
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(slow)
        .start()
        .await
        .unwrap();
    wait_until("the redelivery is settled", || async {
        let s = runtime.stats();
        s.completed + s.duplicates == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 9).await, 1, "one effect across both runtimes");
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn run_until_consumes_until_its_future_resolves_then_drains() {
    let env = TestEnv::new("lifecycle").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..3).await;
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = actix_rt::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    wait_until("all three are counted", || async {
        env.scalar("SELECT count(*) FROM counts").await == 3
    })
    .await;
    let _ = stop.send(());
    running.await.unwrap();
    assert_eq!(env.consumers(&env.queue).await, Some(0), "it stopped consuming");
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_runtime_dropped_without_shutdown_drains_in_the_background() {
    let env = TestEnv::new("shutdown_on_drop").await;
    let runtime = first_of_five_in_flight(&env).await;
    let monitor = runtime.monitor();
    drop(runtime);

    wait_until("the consumer is gone and the rest wait in the queue", || async {
        env.consumers(&env.queue).await == Some(0) && env.ready(&env.queue).await == 4
    })
    .await;
    assert_eq!(monitor.stats().completed, 1, "the message in flight finished");
    assert_eq!(env.count("counts", 0).await, 1);
}

/// With the default settings, deliveries wait in a batch or in the buffer
/// for the next one: a shutdown finishes or hands back every one of them,
/// and each message has its effect once or is back in the queue, never
/// acked without it.
#[actix_rt::test]
async fn shutdown_with_batches_in_flight_and_buffered_loses_and_doubles_nothing() {
    let env = TestEnv::new("shutdown_batches").await;
    let settings = env.settings();
    assert!(
        settings.queues[0].batch_limit() > 1,
        "group commit is the default"
    );
    let slow = Slow {
        started: Arc::new(AtomicBool::new(false)),
        pause: Duration::from_millis(50),
    };
    let runtime = Runtime::builder(settings.valid())
        .handler(slow)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..40).await;
    let monitor = runtime.monitor();
    wait_until("a few complete", || async { monitor.stats().completed >= 3 }).await;
    runtime.shutdown().await;

    let stats = monitor.stats();
    assert!(stats.batches >= 1, "no batch formed: {stats:?}");
    let effects = env.scalar("SELECT count(*) FROM counts").await;
    assert_eq!(
        env.scalar("SELECT coalesce(max(n), 0) FROM counts").await,
        1,
        "no message counted twice"
    );
    assert_eq!(
        effects as u64, stats.completed,
        "every completed message was counted, and only those"
    );
    wait_until("the rest are back in the queue", || async {
        env.ready(&env.queue).await as i64 + effects == 40
    })
    .await;
}
