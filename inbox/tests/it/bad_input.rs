use std::time::Duration;

use rabbit_inbox::Message;
use rabbit_inbox::MessageContext;
use rabbit_inbox::Runtime;
use rabbit_inbox::internal::fault::headers;
use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::tools::lapin::options::QueueDeleteOptions;

use crate::support::{Count, Counted, TestEnv, Valid, amqp, header, publish_keys, wait_until};

fn properties(message_id: Option<&str>, kind: Option<&str>) -> BasicProperties {
    let mut p = BasicProperties::default().with_content_type("application/json".into());
    if let Some(id) = message_id {
        p = p.with_message_id(id.into());
    }
    if let Some(kind) = kind {
        p = p.with_type(kind.into());
    }
    p
}

#[actix_rt::test]
async fn each_malformed_kind_lands_in_the_error_queue_with_its_reason_and_unknown_types_are_skipped() {
    let env = TestEnv::new("bad_input").await;
    let mut settings = env.settings();
    settings.failure.max_body_size = 64;
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let id = || uuid::Uuid::now_v7().to_string();
    let good = br#"{"key": 1}"#;
    let oversized = format!(r#"{{"key": 1, "padding": "{}"}}"#, "x".repeat(64));
    let cases: [(BasicProperties, &[u8], &str); 6] = [
        (properties(None, Some("Counted")), good, "no message_id"),
        (
            properties(Some("not-a-uuid"), Some("Counted")),
            good,
            "`not-a-uuid` is not a UUID",
        ),
        (properties(Some(&id()), None), good, "no type"),
        (
            properties(Some(&id()), Some("Counted")),
            br#"{"key": "one"}"#,
            "not a valid `Counted`",
        ),
        (
            properties(Some(&id()), Some("Counted")),
            b"not json",
            "not a valid `Counted`",
        ),
        (
            properties(Some(&id()), Some("Counted")),
            oversized.as_bytes(),
            "failure.max_body_size is 64",
        ),
    ];
    for (properties, body, _) in &cases {
        env.publish_raw(properties.clone(), body).await;
    }
    env.publish_raw(properties(Some(&id()), Some("NobodyHandlesThis")), good)
        .await;
    // A good message after them all: the consumer is alive and well.
    runtime
        .publisher()
        .publish(&env.queue, &Message::new(Counted { key: 2 }))
        .await
        .unwrap();

    wait_until("every delivery is settled", || async {
        let s = runtime.stats();
        s.rejected == 6 && s.skipped == 1 && s.completed == 1
    })
    .await;
    runtime.shutdown().await;

    assert_eq!(env.count("counts", 2).await, 1);
    assert_eq!(
        env.count("counts", 1).await,
        0,
        "no malformed message took effect"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM inbox_messages").await,
        1,
        "set-aside messages are not recorded"
    );
    // Never requeued, so never looped: the main queue is empty.
    assert_eq!(env.ready(&env.queue).await, 0);

    for (properties, body, reason) in &cases {
        let copy = env
            .take(&rabbit_inbox::tools::error_queue(&env.queue))
            .await
            .expect("an error copy per malformed kind");
        assert_eq!(&copy.data, body, "the body is kept as it came");
        assert_eq!(
            copy.properties.message_id(),
            properties.message_id(),
            "the properties are kept"
        );
        let said = header(&copy, headers::REASON).unwrap();
        assert!(said.contains(reason), "reason `{said}` does not say `{reason}`");
        assert_eq!(
            header(&copy, headers::SOURCE_QUEUE).as_deref(),
            Some(env.queue.as_str())
        );
        assert_eq!(
            header(&copy, headers::ATTEMPTS).as_deref(),
            Some("0"),
            "no retries for malformed input"
        );
    }
    let skipped = env
        .take(&rabbit_inbox::tools::skipped_queue(&env.queue))
        .await
        .expect("the unknown type is skipped");
    let said = header(&skipped, headers::REASON).unwrap();
    assert!(
        said.contains("no handler registered for type `NobodyHandlesThis`"),
        "{said}"
    );
    assert_eq!(
        env.ready(&rabbit_inbox::tools::error_queue(&env.queue)).await,
        0,
        "nothing else was set aside"
    );
}

#[actix_rt::test]
async fn a_malformed_message_is_not_acked_before_its_error_copy_is_confirmed() {
    let env = TestEnv::new("error_copy_unconfirmed").await;
    let settings = env.settings();
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    // The error queue disappears: no copy can be routed there.
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let error_queue = rabbit_inbox::tools::error_queue(&env.queue);
    channel
        .queue_delete(error_queue.as_str().into(), QueueDeleteOptions::default())
        .await
        .unwrap();
    env.publish_raw(properties(None, Some("Counted")), b"{}").await;

    wait_until("the move has been tried", || async {
        runtime.stats().moves_handed_back >= 1
    })
    .await;
    // One more second: a move that failed hands the message back after a pause.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    runtime.shutdown().await;
    // Back in the queue once the broker has applied the last nack or the
    // channel's close (a quorum queue does so a moment later); acked
    // without its error copy, it would never come back.
    wait_until("the original is back in the queue, not acked", || async {
        env.ready(&env.queue).await == 1
    })
    .await;

    // With the topology back (a new runtime declares it), the move succeeds.
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    wait_until("the copy reaches the error queue", || async {
        env.ready(&error_queue).await == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_body_quoted_whole_in_its_error_still_reaches_the_error_queue_with_the_reason_cut() {
    let env = TestEnv::new("huge_reason").await;
    let settings = env.settings();
    let max = settings.failure.max_body_size;
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    // serde quotes the offending string whole: 200 KB, and just under the
    // body limit, are both past the broker's 128 KiB frame.
    let body = |len: usize| format!(r#"{{"key": "{}"}}"#, "x".repeat(len)).into_bytes();
    let bodies = [body(200_000), body(max - 16)];
    for body in &bodies {
        assert!(body.len() <= max);
        let id = uuid::Uuid::now_v7().to_string();
        env.publish_raw(properties(Some(&id), Some("Counted")), body)
            .await;
    }
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("both are set aside and the others complete", || async {
        let s = runtime.stats();
        s.rejected == 2 && s.completed == 5
    })
    .await;
    runtime.shutdown().await;
    for body in &bodies {
        let copy = env
            .take(&rabbit_inbox::tools::error_queue(&env.queue))
            .await
            .expect("in the error queue");
        assert_eq!(&copy.data, body, "the body is kept whole");
        let reason = header(&copy, headers::REASON).unwrap();
        assert!(
            reason.len() <= rabbit_inbox::internal::fault::MAX_REASON_BYTES,
            "{}",
            reason.len()
        );
        assert!(reason.starts_with("body is not a valid `Counted`"), "{reason}");
        assert!(reason.ends_with("[truncated]"), "{reason}");
    }
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn a_body_that_is_not_its_event_is_set_aside_before_any_transaction_even_without_the_database() {
    for batch_size in [1, 8] {
        let env = TestEnv::new(&format!("decode_first_{batch_size}")).await;
        let mut settings = env.settings();
        settings.queues[0].batch_size = batch_size;
        let proxy = crate::proxy::database_through_proxy(&mut settings).await;
        let runtime = Runtime::builder(settings.valid())
            .handler(Count)
            .start()
            .await
            .unwrap();
        // With the database gone, a message that needs a transaction is
        // held; one that is not its event needs none.
        proxy.cut();
        let id = uuid::Uuid::now_v7().to_string();
        env.publish_raw(properties(Some(&id), Some("Counted")), br#"{"key": "one"}"#)
            .await;
        let error_queue = rabbit_inbox::tools::error_queue(&env.queue);
        wait_until("it is in the error queue while the database is down", || async {
            env.ready(&error_queue).await == 1
        })
        .await;
        let stats = runtime.stats();
        assert_eq!(
            (stats.rejected, stats.held),
            (1, 0),
            "batch size {batch_size}: {stats:?}"
        );
        proxy.restore();
        runtime.shutdown().await;
        let copy = env.take(&error_queue).await.unwrap();
        let reason = header(&copy, headers::REASON).unwrap();
        assert!(reason.starts_with("body is not a valid `Counted`"), "{reason}");
    }
}

#[actix_rt::test]
async fn a_consumed_body_is_parsed_once_per_message_in_batches_and_alone() {
    use std::sync::atomic::{AtomicUsize, Ordering};
    /// Bodies parsed into `Parsed`, by this test alone.
    static PARSES: AtomicUsize = AtomicUsize::new(0);
    fn counted<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<i64, D::Error> {
        PARSES.fetch_add(1, Ordering::SeqCst);
        <i64 as serde::Deserialize>::deserialize(deserializer)
    }
    #[derive(Debug, serde::Serialize, serde::Deserialize)]
    struct Parsed {
        #[serde(deserialize_with = "counted")]
        key: i64,
    }
    impl rabbit_inbox::IntegrationEvent for Parsed {
        const TYPE: &'static str = "Parsed";
    }
    struct CountParsed;
    impl rabbit_inbox::EventHandler<Parsed> for CountParsed {
        async fn handle(
            &self,
            event: &Parsed,
            _context: &MessageContext,
            uow: &mut rabbit_inbox::UnitOfWork,
        ) -> Result<(), rabbit_inbox::HandlerError> {
            crate::support::increment(uow, "counts", event.key).await
        }
    }
    for (batch_size, keys) in [(1, 0..10), (8, 10..26)] {
        let env = TestEnv::new(&format!("parsed_once_{batch_size}")).await;
        let mut settings = env.settings();
        settings.queues[0].batch_size = batch_size;
        let runtime = Runtime::builder(settings.valid())
            .handler(CountParsed)
            .start()
            .await
            .unwrap();
        let before = PARSES.load(Ordering::SeqCst);
        let publisher = runtime.publisher().clone();
        let count = keys.clone().count();
        for key in keys {
            publisher
                .publish(&env.queue, &Message::new(Parsed { key }))
                .await
                .unwrap();
        }
        wait_until("all are processed", || async {
            runtime.stats().completed == count as u64
        })
        .await;
        runtime.shutdown().await;
        // Decoded before the transaction, and the handler takes that event.
        assert_eq!(
            PARSES.load(Ordering::SeqCst) - before,
            count,
            "batch size {batch_size}: one parse per message"
        );
    }
}
