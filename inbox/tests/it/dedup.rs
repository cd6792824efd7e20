use std::collections::HashMap;

use rabbit_inbox::Message;
use rabbit_inbox::Runtime;
use rabbit_inbox::internal::Envelope;
use rabbit_inbox::internal::{Deliver, Outcome};
use rabbit_inbox::tools::lapin::options::BasicGetOptions;

use crate::support::{Count, CountAgain, Counted, TestEnv, Valid, amqp, wait_until};

#[actix_rt::test]
async fn a_duplicate_is_skipped_and_acked() {
    let env = TestEnv::new("duplicate_skipped").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 1 });
    runtime.publisher().publish(&env.queue, &message).await.unwrap();
    runtime.publisher().publish(&env.queue, &message).await.unwrap();

    wait_until("both copies are settled", || async {
        let s = runtime.stats();
        s.completed + s.duplicates == 2
    })
    .await;
    runtime.shutdown().await;

    assert_eq!(env.count("counts", 1).await, 1, "the effect happened once");
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 1);
    // Unacked messages go back to the queue when the runtime closes its
    // channel: an empty queue now means both copies were acked.
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn one_event_published_ten_times_has_one_effect() {
    let env = TestEnv::new("ten_times").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .handler(CountAgain)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 7 });
    for _ in 0..10 {
        runtime.publisher().publish(&env.queue, &message).await.unwrap();
    }
    wait_until("all ten are settled", || async {
        let s = runtime.stats();
        s.completed + s.duplicates == 10
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!((stats.completed, stats.duplicates), (1, 9));
    assert_eq!(env.count("counts", 7).await, 1);
    assert_eq!(env.count("second_counts", 7).await, 1);
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn two_runtimes_on_one_queue_give_one_effect_per_id() {
    let env = TestEnv::new("two_runtimes").await;
    let first = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let second = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();

    // 150 events, each published three times, the copies interleaved so that
    // duplicates are in flight in both runtimes at once.
    let messages: Vec<_> = (0..150).map(|key| Message::new(Counted { key })).collect();
    for round in 0..3 {
        for message in messages
            .iter()
            .skip(round * 7 % 150)
            .chain(messages.iter().take(round * 7 % 150))
        {
            first.publisher().publish(&env.queue, message).await.unwrap();
        }
    }
    wait_until("all 450 copies are settled", || async {
        let (a, b) = (first.stats(), second.stats());
        a.completed + a.duplicates + b.completed + b.duplicates == 450
    })
    .await;
    let (a, b) = (first.stats(), second.stats());
    first.shutdown().await;
    second.shutdown().await;

    assert_eq!(
        a.completed + b.completed,
        150,
        "one completion per id: {a:?} {b:?}"
    );
    let rows = env
        .db()
        .await
        .query("SELECT key, n FROM counts", &[])
        .await
        .unwrap();
    let counts: HashMap<i64, i64> = rows.iter().map(|r| (r.get(0), r.get(1))).collect();
    assert_eq!(counts.len(), 150);
    assert!(
        counts.values().all(|&n| n == 1),
        "an id took effect twice: {counts:?}"
    );
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_crash_between_commit_and_ack_is_skipped_on_redelivery() {
    let env = TestEnv::new("commit_then_crash").await;
    let settings = env.settings();
    // Another consumer takes the message before the runtime starts...
    let crashing = amqp().await;
    let channel = crashing.create_channel().await.unwrap();
    rabbit_inbox::tools::declare_topology(&channel, &settings.queues[0], &settings.failure)
        .await
        .unwrap();
    let message = Message::new(Counted { key: 3 });
    let publisher = rabbit_inbox::tools::AmqpPublisher::new(&crashing, "")
        .await
        .unwrap();
    publisher.publish(&env.queue, &message).await.unwrap();
    let taken = channel
        .basic_get(env.queue.as_str().into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("the message is there")
        .delivery;

    // ...processes it through the inbox as the consumer actor would, and
    // commits...
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let envelope = Envelope::decode(
        &taken.properties,
        &mut taken.data.clone(),
        taken.redelivered,
        &env.queue,
    )
    .unwrap();
    let outcome = rabbit_inbox::internal::dedup_of(&runtime)
        .send(Deliver {
            consumer: env.queue.as_str().into(),
            envelope: envelope.into(),
        })
        .await
        .unwrap();
    assert_eq!(outcome, Outcome::Completed);
    assert_eq!(env.count("counts", 3).await, 1, "committed before the crash");

    // ...then "crashes" before the ack: its channel goes away unacked.
    crashing.close(320, "crash".into()).await.unwrap();

    wait_until("the redelivery reaches the runtime's consumer", || async {
        runtime.stats().duplicates == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 3).await, 1, "the redelivery had no effect");
    assert_eq!(env.ready(&env.queue).await, 0, "the redelivery was acked");
}

#[actix_rt::test]
async fn a_copy_blocked_past_the_lock_timeout_is_redelivered_never_acked() {
    let env = TestEnv::new("lock_timeout").await;
    let mut settings = env.settings();
    settings.database.lock_timeout = std::time::Duration::from_millis(100);
    // A long way to the error queue: the message keeps coming back until
    // the other copy commits, however slow this machine is.
    settings.failure.delays = vec![std::time::Duration::from_millis(300); 20];
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 8 });

    // Another copy of the message is mid-transaction elsewhere: its inbox
    // row is written and not yet committed.
    let mut other = env.db().await;
    let other_copy = other.transaction().await.unwrap();
    other_copy
        .execute(
            "INSERT INTO inbox_messages VALUES ($1, $2, 'Counted', now())",
            &[&env.queue, &message.id],
        )
        .await
        .unwrap();
    runtime.publisher().publish(&env.queue, &message).await.unwrap();
    wait_until("the claim has timed out a few times", || async {
        runtime.stats().abandoned >= 3
    })
    .await;
    assert_eq!(
        runtime.stats().completed + runtime.stats().duplicates,
        0,
        "acked while blocked"
    );

    // The other copy commits: the next redelivery is a duplicate.
    other_copy.commit().await.unwrap();
    wait_until("the message is skipped", || async {
        runtime.stats().duplicates == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 8).await, 0, "the handlers never ran");
    assert_eq!(env.ready(&env.queue).await, 0);
}
