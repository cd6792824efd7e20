//! What a batch owes each of its members: its own message as the context of
//! `handle`, with its ids on the follow-ups staged there; and a panic that
//! charges the message that panicked, and no other.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::tools::lapin::options::BasicGetOptions;
use rabbit_inbox::tools::lapin::types::{AMQPValue, FieldTable};
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, Runtime, UnitOfWork};

use crate::batching::{batching, prefill_keys};
use crate::outbox::with_forward_queue;
use crate::support::{
    Count, Counted, TestEnv, Valid, amqp, declare, header, increment, publish_to, wait_until,
};

/// Written as the README shows, for one message: reads the message it
/// handles through its `context` argument and stages a follow-up with
/// `uow.publish`, whose body names the id it read.
struct ForwardWithContext {
    forward: String,
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Forwarded {
    key: i64,
    source_message_id: uuid::Uuid,
}

impl rabbit_inbox::IntegrationEvent for Forwarded {
    const TYPE: &'static str = "Forwarded";
}

impl EventHandler<Counted> for ForwardWithContext {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let source_message_id = context.message_id;
        let follow_up = Forwarded {
            key: event.key,
            source_message_id,
        };
        uow.publish(&self.forward, &Message::new(follow_up)).await?;
        increment(uow, "counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_handler_written_for_one_message_gets_its_own_context_in_a_batch_and_stamps_its_ids() {
    let (env, forward) = with_forward_queue("batch_context").await;
    // The default batch size (8), with a burst ready at start.
    let settings = env.settings();
    assert!(settings.queues[0].batch_size > 1, "the default batches");
    declare(&settings).await;
    let mut sent = HashMap::new();
    for key in 0..64_i64 {
        let id = uuid::Uuid::now_v7();
        let mut headers = FieldTable::default();
        headers.insert(
            rabbit_inbox::internal::CORRELATION_ID.into(),
            AMQPValue::LongString(format!("flow-{key}").into()),
        );
        let properties = BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_type("Counted".into())
            .with_content_type("application/json".into())
            .with_headers(headers);
        publish_to(
            "",
            &env.queue,
            properties,
            format!(r#"{{"key": {key}}}"#).as_bytes(),
        )
        .await;
        sent.insert(key, id);
    }
    let runtime = Runtime::builder(settings.valid())
        .handler(ForwardWithContext {
            forward: forward.clone(),
        })
        .start()
        .await
        .unwrap();
    wait_until("64 follow-ups arrive", || async {
        env.ready(&forward).await == 64
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;
    assert!(stats.batches >= 1, "no batch formed: {stats:?}");
    assert_eq!(stats.batches_split, 0, "a batch failed: {stats:?}");

    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let mut wrong = Vec::new();
    while let Some(got) = channel
        .basic_get(forward.as_str().into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let copy = got.delivery;
        let body: Forwarded = serde_json::from_slice(&copy.data).unwrap();
        let source = sent[&body.key];
        let seen = (
            body.source_message_id,
            header(&copy, rabbit_inbox::internal::CAUSATION_ID),
            header(&copy, rabbit_inbox::internal::CORRELATION_ID),
        );
        if seen
            != (
                source,
                Some(source.to_string()),
                Some(format!("flow-{}", body.key)),
            )
        {
            wrong.push((body.key, seen));
        }
    }
    connection.close(200, "done".into()).await.unwrap();
    assert!(
        wrong.is_empty(),
        "follow-ups without their own message's context or ids: {wrong:?}"
    );
}

/// Overrides `handle_batch` and stages with `publish`, which cannot know
/// which message of the batch a follow-up is caused by.
struct PublishesInBatch {
    forward: String,
}

impl EventHandler<Counted> for PublishesInBatch {
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
        for event in events {
            uow.publish(&self.forward, &Message::new(event.clone())).await?;
        }
        Ok(())
    }
}

#[actix_rt::test]
async fn publish_in_an_overridden_handle_batch_is_refused_and_names_the_way() {
    let (env, forward) = with_forward_queue("batch_publish_refused").await;
    let settings = batching(&env);
    prefill_keys(&settings, 0..16).await;
    let log = crate::support::Captured::default();
    let capturing = log.install();
    let runtime = Runtime::builder(settings.valid())
        .handler(PublishesInBatch {
            forward: forward.clone(),
        })
        .start()
        .await
        .unwrap();
    // Refused on the whole batch, then each message alone succeeds with its
    // own ids: nothing leaves without its cause.
    wait_until("16 follow-ups arrive", || async {
        env.ready(&forward).await == 16
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;
    drop(capturing);
    assert!(stats.batches_split >= 1, "{stats:?}");
    assert_eq!(stats.completed, 16, "{stats:?}");
    for _ in 0..16 {
        let copy = env.take(&forward).await.unwrap();
        assert!(header(&copy, rabbit_inbox::internal::CAUSATION_ID).is_some());
    }
    // Said once, where a user looks, with the way out.
    let text = log.text();
    let warned = text
        .lines()
        .filter(|line| line.contains("WARN") && line.contains("publish_caused_by"))
        .count();
    assert_eq!(warned, 1, "{text}");
}

/// Panics on every call for `key`; counts every other key. With `early`,
/// it panics before it returns its future.
struct PanicsOn {
    key: i64,
    early: bool,
    panics: Arc<AtomicUsize>,
}

/// Written by hand, without `async fn`, so that it can panic before its
/// future exists.
impl EventHandler<Counted> for PanicsOn {
    #[allow(clippy::manual_async_fn)]
    fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> impl std::future::Future<Output = Result<(), HandlerError>> + Send {
        let poisoned = event.key == self.key;
        if poisoned && self.early {
            self.panics.fetch_add(1, Ordering::SeqCst);
            panic!("panics before its future, on key {}", event.key);
        }
        let (key, panics) = (event.key, Arc::clone(&self.panics));
        async move {
            if poisoned {
                panics.fetch_add(1, Ordering::SeqCst);
                panic!("panics in its future, on key {key}");
            }
            increment(uow, "counts", key).await
        }
    }
}

/// Sixteen messages in batches of 8, no retry at all: key 5 panics on every
/// attempt. Only key 5 may reach the error queue, with its panic's text.
async fn only_the_panicking_message_fails(name: &str, early: bool) {
    let env = TestEnv::new(name).await;
    let mut settings = batching(&env);
    settings.failure.immediate_retries = 0;
    settings.failure.delays = Vec::new();
    prefill_keys(&settings, 0..16).await;
    let panics = Arc::new(AtomicUsize::new(0));
    let runtime = Runtime::builder(settings.valid())
        .handler(PanicsOn {
            key: 5,
            early,
            panics: Arc::clone(&panics),
        })
        .start()
        .await
        .unwrap();
    let error_queue = rabbit_inbox::Wire::Inbox.error_queue(&env.queue);
    wait_until("15 complete and one is set aside", || async {
        let stats = runtime.stats();
        stats.completed + stats.dead_lettered >= 16
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert!(stats.batches >= 1, "no batch formed: {stats:?}");
    assert_eq!(
        (stats.completed, stats.dead_lettered),
        (15, 1),
        "a panic charged its batch-mates: {stats:?}"
    );
    let set_aside = env.take(&error_queue).await.expect("key 5 in the error queue");
    let body: Counted = serde_json::from_slice(&set_aside.data).unwrap();
    assert_eq!(body.key, 5);
    let reason = header(&set_aside, rabbit_inbox::internal::fault::headers::REASON).unwrap_or_default();
    assert!(reason.contains("on key 5"), "the panic's text is lost: {reason}");
    let stage = header(&set_aside, rabbit_inbox::internal::fault::headers::HANDLER).unwrap_or_default();
    assert!(
        stage.contains("PanicsOn"),
        "recorded as `{stage}`, not the handler"
    );
    assert!(
        env.take(&error_queue).await.is_none(),
        "more than key 5 set aside"
    );
    let counts = crate::batching::counts(&env, "counts").await;
    assert_eq!(counts.len(), 15, "{counts:?}");
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
}

#[actix_rt::test]
async fn a_panic_in_a_batch_fails_its_own_message_only() {
    only_the_panicking_message_fails("batch_panic_own", false).await;
}

#[actix_rt::test]
async fn a_handle_that_panics_before_its_future_is_a_handler_panic() {
    only_the_panicking_message_fails("batch_panic_early", true).await;
}

#[actix_rt::test]
async fn a_panic_before_the_future_rebuilds_factory_handlers() {
    let env = TestEnv::new("panic_early_factory").await;
    let mut settings = env.settings();
    settings.failure.immediate_retries = 0;
    settings.failure.delays = Vec::new();
    settings.queues[0].batch_size = 1;
    let built = Arc::new(AtomicUsize::new(0));
    let panics = Arc::new(AtomicUsize::new(0));
    let runtime = {
        let (built, panics) = (Arc::clone(&built), Arc::clone(&panics));
        Runtime::builder(settings.valid())
            .handler_factory(move || {
                built.fetch_add(1, Ordering::SeqCst);
                PanicsOn {
                    key: 5,
                    early: true,
                    panics: Arc::clone(&panics),
                }
            })
            .handler(Count)
            .start()
            .await
            .unwrap()
    };
    crate::support::publish_keys(&runtime, &env.queue, [5]).await;
    wait_until("key 5 is set aside", || async {
        runtime.stats().dead_lettered == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(panics.load(Ordering::SeqCst), 1);
    assert_eq!(built.load(Ordering::SeqCst), 2, "not built anew after the panic");
}
