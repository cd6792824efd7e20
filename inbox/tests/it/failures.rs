use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rabbit_inbox::Runtime;
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::support::{Captured, Count, Counted, TestEnv, Valid, increment, publish_keys, wait_until};

/// Counts its calls; fails (or panics) on the calls for `key` until it has
/// been called `failures` times for it.
struct Flaky {
    key: i64,
    failures: usize,
    calls: Arc<AtomicUsize>,
    panic: bool,
}

impl EventHandler<Counted> for Flaky {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == self.key && self.calls.fetch_add(1, Ordering::SeqCst) < self.failures {
            if self.panic {
                panic!("flaky handler panics on purpose");
            }
            return Err("flaky handler fails on purpose".into());
        }
        increment(uow, "second_counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_failing_second_handler_rolls_back_the_first_and_the_redelivery_runs_both() {
    let env = TestEnv::new("failing_handler").await;
    let calls = Arc::new(AtomicUsize::new(0));
    let flaky = Flaky {
        key: 5,
        failures: 1,
        calls: Arc::clone(&calls),
        panic: false,
    };
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .handler(flaky)
        .start()
        .await
        .unwrap();
    runtime
        .publisher()
        .publish(&env.queue, &Message::new(Counted { key: 5 }))
        .await
        .unwrap();

    wait_until("the redelivery completes", || async {
        runtime.stats().completed == 1
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(stats.abandoned, 1, "the first attempt was abandoned");
    assert_eq!(
        calls.load(Ordering::SeqCst),
        2,
        "the second handler ran again on redelivery"
    );
    // Count ran twice; had its first write survived the failure, it would read 2.
    assert_eq!(
        env.count("counts", 5).await,
        1,
        "the first handler's write was rolled back"
    );
    assert_eq!(env.count("second_counts", 5).await, 1);
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 1);
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_panicking_handler_fails_its_message_only_and_everything_keeps_flowing() {
    let env = TestEnv::new("panicking_handler").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let calls = Arc::new(AtomicUsize::new(0));
    let flaky = Flaky {
        key: 0,
        failures: 2,
        calls: Arc::clone(&calls),
        panic: true,
    };
    let mut settings = env.settings();
    // Each message alone: in a batch, key 0's first panic would fail the
    // batch, and its run alone would be the abandoned attempt (batching.rs).
    settings.queues[0].batch_size = 1;
    // Long enough for the restart after a panic to be done before the
    // retry reaches the actor: a Restart that arrives while the actor is
    // still stopping from the last one is no second restart.
    settings.failure.immediate_backoff = std::time::Duration::from_millis(300);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .handler(flaky)
        .start()
        .await
        .unwrap();
    for key in 0..30 {
        runtime
            .publisher()
            .publish(&env.queue, &Message::new(Counted { key }))
            .await
            .unwrap();
    }

    wait_until("all 30 complete", || async { runtime.stats().completed == 30 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(stats.abandoned, 2, "two panics, two abandoned attempts");
    assert_eq!(calls.load(Ordering::SeqCst), 3);
    let restarts = logs.text().matches("handler actor restarted").count();
    assert_eq!(restarts, 2, "the handler actor restarts after each panic");
    for key in 0..30 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}, first handler");
        assert_eq!(
            env.count("second_counts", key).await,
            1,
            "key {key}, panicking handler"
        );
    }
    assert_eq!(env.ready(&env.queue).await, 0);
}

/// Panics on its first message for key 0, and counts like `Count`
/// otherwise; says how many instances were built, and how many messages
/// an instance was given after it panicked.
struct FreshAfterPanic {
    panicked: Arc<AtomicUsize>,
    after_its_panic: Arc<AtomicUsize>,
    /// This instance panicked.
    broken: std::sync::atomic::AtomicBool,
}

impl EventHandler<Counted> for FreshAfterPanic {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if self.broken.load(Ordering::SeqCst) {
            self.after_its_panic.fetch_add(1, Ordering::SeqCst);
        }
        if event.key == 0 && self.panicked.fetch_add(1, Ordering::SeqCst) == 0 {
            self.broken.store(true, Ordering::SeqCst);
            panic!("panics once, on purpose");
        }
        increment(uow, "counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_restart_builds_the_handlers_of_a_factory_anew() {
    let env = TestEnv::new("handler_factory").await;
    let (built, panicked) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let after_its_panic = Arc::new(AtomicUsize::new(0));
    let factory = {
        let (built, panicked, after) = (
            Arc::clone(&built),
            Arc::clone(&panicked),
            Arc::clone(&after_its_panic),
        );
        move || {
            built.fetch_add(1, Ordering::SeqCst);
            FreshAfterPanic {
                panicked: Arc::clone(&panicked),
                after_its_panic: Arc::clone(&after),
                broken: Default::default(),
            }
        }
    };
    let runtime = Runtime::builder(env.settings().valid())
        .handler_factory(factory)
        .start()
        .await
        .unwrap();
    assert_eq!(built.load(Ordering::SeqCst), 1, "built once at start");
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("all 5 complete", || async { runtime.stats().completed == 5 }).await;
    runtime.shutdown().await;
    assert_eq!(panicked.load(Ordering::SeqCst), 2, "key 0 ran twice");
    assert_eq!(built.load(Ordering::SeqCst), 2, "the restart built a new one");
    assert_eq!(
        after_its_panic.load(Ordering::SeqCst),
        0,
        "no message starts on an instance that panicked"
    );
    for key in 0..5 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
}
