use std::time::Duration;

use rabbit_inbox::Message;
use rabbit_inbox::MessageContext;
use rabbit_inbox::Runtime;

use crate::proxy::{broker_through_proxy, database_through_proxy};
use crate::support::{Captured, Count, Counted, TestEnv, Valid, publish_keys, rabbitmqctl, wait_until};

#[actix_rt::test]
async fn a_database_outage_pauses_consumption_and_loses_nothing() {
    let env = TestEnv::new("database_outage").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    let proxy = database_through_proxy(&mut settings).await;
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let publisher = runtime.publisher().clone();
    for key in 0..20 {
        publisher
            .publish(&env.queue, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    wait_until("the first 20 complete", || async {
        runtime.stats().completed == 20
    })
    .await;

    proxy.cut();
    for key in 20..60 {
        publisher
            .publish(&env.queue, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    // An outage is an absence of progress: watch it for a while.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    let during = runtime.stats();
    assert_eq!(during.completed, 20, "nothing completes without the database");
    assert_eq!(
        (during.delayed, during.dead_lettered),
        (0, 0),
        "the outage burned retry tiers: {during:?}"
    );
    assert!(
        during.abandoned <= 16,
        "more failed attempts than messages in flight: {during:?}"
    );

    proxy.restore();
    wait_until("all 60 complete once the database is back", || async {
        runtime.stats().completed == 60
    })
    .await;
    // The probe that saw it back logs before the held messages go on, but
    // under load its line may reach the writer a moment after them.
    wait_until("the outage's end is logged", || async {
        logs.text().contains("database available again")
    })
    .await;
    runtime.shutdown().await;
    let text = logs.text();
    let said = |words: &str| text.lines().filter(|l| l.contains(words)).count();
    assert_eq!(
        said("database unavailable"),
        1,
        "the outage's start is logged once:\n{text}"
    );
    assert_eq!(
        said("database available again"),
        1,
        "its end is logged once:\n{text}"
    );
    for key in 0..60 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_consumer_the_broker_ends_reconnects_and_consumption_resumes() {
    let env = TestEnv::new("consumer_ended").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    publish_and_complete(&env, &runtime, 0..5).await;

    // Someone deletes the queue: the broker cancels the consumer.
    let connection = crate::support::amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .queue_delete(env.queue.as_str().into(), Default::default())
        .await
        .unwrap();
    // The consumer declares its topology again and consumes from it: the
    // queue comes back, and what is published to it is consumed. (Waiting
    // for the queue alone races with the broker still starting it.)
    wait_until("the queue is declared and consumed again", || async {
        env.consumers(&env.queue).await == Some(1)
    })
    .await;
    publish_and_complete(&env, &runtime, 5..10).await;
    runtime.shutdown().await;
    for key in 0..10 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
}

/// Publishes a message for each of `keys` through the runtime and waits
/// until it has completed them.
async fn publish_and_complete(env: &TestEnv, runtime: &Runtime, keys: std::ops::Range<i64>) {
    let total = runtime.stats().completed + u64::try_from(keys.end - keys.start).unwrap();
    for key in keys {
        runtime
            .publisher()
            .publish(&env.queue, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    wait_until("the messages complete", || async {
        runtime.stats().completed == total
    })
    .await;
}

/// Has the broker close every channel consuming from `queue` with a
/// channel error (PRECONDITION_FAILED), as RabbitMQ does to a consumer that
/// holds a delivery past its `consumer_timeout`: the channel process is
/// handed an ack of a delivery tag it never sent. (Through the broker's
/// internals, as RabbitMQ 3.10 has them: nothing outside can close another
/// client's channel.)
async fn broker_closes_the_consumer_channels(queue: &str) {
    let erlang = format!(
        r#"[rabbit_channel:do(proplists:get_value(channel_pid, C), {{'basic.ack', 999999, false}})
            || C <- rabbit_amqqueue:consumers_all(<<"/">>),
               element(4, proplists:get_value(queue_name, C)) =:= <<"{queue}">>]."#
    );
    rabbitmqctl(&["eval", &erlang]).await;
}

/// The broker's channels consuming `queue`.
async fn consumer_channels(queue: &str) -> Vec<String> {
    rabbitmqctl(&["-q", "list_consumers", "queue_name", "channel_pid"])
        .await
        .lines()
        .filter_map(|line| line.split_once('\t'))
        .filter(|(name, _)| *name == queue)
        .map(|(_, channel)| channel.trim().to_owned())
        .collect()
}

#[actix_rt::test]
async fn a_consumer_whose_channel_the_broker_closes_reconnects() {
    let env = TestEnv::new("channel_closed").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    assert_eq!(env.consumers(&env.queue).await, Some(1));
    let before = consumer_channels(&env.queue).await;
    assert_eq!(before.len(), 1, "{before:?}");

    broker_closes_the_consumer_channels(&env.queue).await;
    // lapin does not reopen a channel the broker closed; the actor must.
    // (It does so at once: the window with no consumer is too short to
    // watch for, so the consumer is told apart by its channel.)
    wait_until("one consumer is back, on another channel", || async {
        let now = consumer_channels(&env.queue).await;
        now.len() == 1 && now != before
    })
    .await;
    publish_and_complete(&env, &runtime, 0..5).await;
    runtime.shutdown().await;
    for key in 0..5 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
}

/// Counts every key but `key`, on which it always fails.
struct CountAllBut {
    key: i64,
}

impl rabbit_inbox::EventHandler<Counted> for CountAllBut {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut rabbit_inbox::UnitOfWork,
    ) -> Result<(), rabbit_inbox::HandlerError> {
        if event.key == self.key {
            return Err("fails on purpose".into());
        }
        crate::support::increment(uow, "counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_reconnect_while_batches_are_held_and_buffered_acks_nothing_before_its_commit() {
    let env = TestEnv::new("reconnect_with_buffer").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    let proxy = database_through_proxy(&mut settings).await;
    settings.queues[0].prefetch = 8;
    settings.queues[0].batch_size = 4;
    settings.failure.delays = Vec::new();
    let runtime = Runtime::builder(settings.valid())
        .handler(CountAllBut { key: 5 })
        .start()
        .await
        .unwrap();

    // The database goes away: the first batch is held, the deliveries that
    // arrive after it wait in the buffer.
    proxy.cut();
    publish_keys(&runtime, &env.queue, 0..8).await;
    wait_until("a batch is held", || async { runtime.stats().held > 0 }).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Meanwhile the broker closes the consumer's channel: the consumer
    // reconnects and the broker redelivers all eight on the new channel,
    // whose delivery tags start at 1 again.
    broker_closes_the_consumer_channels(&env.queue).await;
    wait_until("the consumer is back", || async {
        logs.text().contains("consuming again")
    })
    .await;
    proxy.restore();
    // More messages after the failing one, acked while it is still retried.
    publish_keys(&runtime, &env.queue, 8..24).await;
    wait_until("all but key 5 complete and key 5 is dead-lettered", || async {
        let s = runtime.stats();
        s.dead_lettered >= 1 && env.scalar("SELECT count(*) FROM counts").await == 23
    })
    .await;
    tokio::time::sleep(Duration::from_millis(500)).await;
    runtime.shutdown().await;

    let text = logs.text();
    // One reconnect, for the one channel the test had the broker close:
    // seen as the end of the consumer's stream, or, if the stream stays
    // open, as the closed channel.
    let reconnects = text.matches("the broker closed the consumer's channel").count()
        + text.matches("the broker ended the consumer").count();
    assert_eq!(
        reconnects, 1,
        "an ack reached the broker for a delivery it had already settled (a `multiple` ack passed it):\n{text}"
    );
    for key in (0..24).filter(|&k| k != 5) {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
    assert_eq!(env.ready(&env.queue).await, 0);
    assert_eq!(
        env.ready(&rabbit_inbox::tools::error_queue(&env.queue)).await,
        1,
        "key 5 was set aside once: the stale copy was not processed"
    );
}

#[actix_rt::test]
async fn a_database_network_that_drops_packets_holds_messages_and_loses_nothing() {
    let env = TestEnv::new("database_blackhole").await;
    let mut settings = env.settings();
    let proxy = database_through_proxy(&mut settings).await;
    settings.database.transaction_timeout = Duration::from_secs(2);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..10).await;
    wait_until("the first 10 complete", || async {
        runtime.stats().completed == 10
    })
    .await;

    // Nothing gets through, and nothing closes: without bounds, every
    // transaction and the availability probe would wait forever.
    proxy.blackhole();
    publish_keys(&runtime, &env.queue, 10..30).await;
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(runtime.stats().completed, 10, "nothing commits in a blackhole");

    // The connections open during it never answer again.
    proxy.restore_for_new_connections();
    wait_until("every key is counted once the network is back", || async {
        env.scalar("SELECT count(*) FROM counts").await == 30
    })
    .await;
    runtime.shutdown().await;
    let stats = runtime_stats_after(&env).await;
    assert_eq!(stats, 30, "one inbox row each");
    for key in 0..30 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
    assert_eq!(env.ready(&env.queue).await, 0);
    assert_eq!(env.ready(&rabbit_inbox::tools::error_queue(&env.queue)).await, 0);
}

#[actix_rt::test]
async fn a_broker_network_that_drops_packets_holds_messages_and_loses_nothing() {
    let env = TestEnv::new("broker_blackhole").await;
    let mut settings = env.settings();
    let proxy = broker_through_proxy(&mut settings).await;
    settings.message_bus.confirm_timeout = Duration::from_secs(2);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let publish = |keys: std::ops::Range<i64>| {
        let env = &env;
        async move {
            for key in keys {
                let message = Message::new(Counted { key });
                let properties = rabbit_inbox::tools::lapin::BasicProperties::default()
                    .with_message_id(message.id.to_string().into())
                    .with_type("Counted".into());
                env.publish_raw(properties, &message.to_json().unwrap()).await;
            }
        }
    };
    publish(0..10).await;
    wait_until("the first 10 are counted", || async {
        env.scalar("SELECT count(*) FROM counts").await == 10
    })
    .await;

    proxy.blackhole();
    publish(10..30).await;
    tokio::time::sleep(Duration::from_secs(6)).await;
    proxy.restore_for_new_connections();
    // The runtime's own publisher was cut off as well: it connects again
    // (a publish or two may fail meanwhile, past its confirm timeout).
    let late = Message::new(Counted { key: 30 });
    wait_until("the runtime's publisher publishes again", || async {
        runtime.publisher().publish(&env.queue, &late).await.is_ok()
    })
    .await;
    wait_until("every key is counted once the network is back", || async {
        env.scalar("SELECT count(*) FROM counts").await == 31
    })
    .await;
    wait_until("nothing is left in the queue", || async {
        env.ready(&env.queue).await == 0
    })
    .await;
    runtime.shutdown().await;
    for key in 0..=30 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
    assert_eq!(runtime_stats_after(&env).await, 31);
}

/// Inbox rows: one per message processed.
async fn runtime_stats_after(env: &TestEnv) -> i64 {
    env.scalar("SELECT count(*) FROM inbox_messages").await
}
