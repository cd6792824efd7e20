//! MassTransit on the wire (`message_bus.wire = "masstransit"`): what a
//! MassTransit 8 producer publishes is processed once, and what fails or
//! has no handler is set aside where MassTransit's tools look, with its
//! headers.

use std::sync::{Arc, Mutex};

use rabbit_inbox::Runtime;
use rabbit_inbox::internal::masstransit::ENVELOPE_CONTENT_TYPE;
use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::{
    EventHandler, HandlerError, IntegrationEvent, MessageContext, Permanent, UnitOfWork, Wire,
};
use serde::{Deserialize, Serialize};
use uuid::Uuid;

use crate::support::{
    TestEnv, Valid, amqp, consumes, crash_once_on, delivered_before, header, increment, publish_to,
    start_service, wait_until,
};

/// The test event as a MassTransit contract names it.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Counted {
    key: i64,
}

impl IntegrationEvent for Counted {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:Counted";
}

/// Counts each key; refuses key 7 for good, fails key 9 every time; keeps
/// the contexts it saw.
#[derive(Default)]
struct CountAndRemember {
    seen: Arc<Mutex<Vec<MessageContext>>>,
}

impl EventHandler<Counted> for CountAndRemember {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        self.seen.lock().unwrap().push(context.clone());
        if event.key == 7 {
            return Err(Permanent::new("key 7 is refused").into());
        }
        if event.key == 9 {
            return Err("key 9 fails every time".into());
        }
        increment(uow, "counts", event.key).await
    }

    fn name(&self) -> &'static str {
        "CountAndRemember"
    }
}

/// An envelope in the shape MassTransit 8.5 writes (the captured one of
/// `rabbit_inbox::internal::masstransit`'s tests), for `message_type` with `message`.
fn envelope(id: Uuid, conversation: Uuid, message_type: &str, message: &str) -> String {
    envelope_with(id, conversation, message_type, message, None, "{}")
}

/// [`envelope`] with a `correlationId` and `headers` (a JSON object).
fn envelope_with(
    id: Uuid,
    conversation: Uuid,
    message_type: &str,
    message: &str,
    correlation: Option<Uuid>,
    headers: &str,
) -> String {
    let correlation = correlation.map_or_else(|| "null".to_owned(), |c| format!(r#""{c}""#));
    format!(
        r#"{{
  "messageId": "{id}",
  "requestId": null,
  "correlationId": {correlation},
  "conversationId": "{conversation}",
  "initiatorId": "00ab0000-6ab3-f8b4-0000-08db7c836600",
  "sourceAddress": "rabbitmq://localhost/orders",
  "destinationAddress": "rabbitmq://localhost/{message_type}",
  "responseAddress": null,
  "faultAddress": null,
  "messageType": [
    "urn:message:{message_type}"
  ],
  "message": {message},
  "expirationTime": null,
  "sentTime": "2026-12-04T03:00:00.000000Z",
  "headers": {headers},
  "host": {{ "machineName": "orders-1", "processName": "Orders", "processId": 1 }}
}}"#
    )
}

/// Publishes `body` as MassTransit does: to `exchange`, routing key empty,
/// the AMQP `message_id` the envelope's, its content type, persistent, no
/// `type` property.
async fn publish_as_masstransit(exchange: &str, id: Uuid, body: &str) {
    let properties = BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_content_type(ENVELOPE_CONTENT_TYPE.into())
        .with_delivery_mode(2);
    publish_to(exchange, "", properties, body.as_bytes()).await;
}

fn masstransit(env: &TestEnv) -> rabbit_inbox::Settings {
    let mut settings = env.settings();
    settings.message_bus.wire = Wire::Masstransit;
    settings
}

#[actix_rt::test]
async fn a_masstransit_message_is_processed_once_and_its_context_reaches_the_handler() {
    let env = TestEnv::new("mt_once").await;
    let handler = CountAndRemember::default();
    let seen = Arc::clone(&handler.seen);
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(handler)
        .start()
        .await
        .unwrap();
    let (id, conversation) = (Uuid::now_v7(), Uuid::now_v7());
    let body = envelope(id, conversation, Counted::TYPE, r#"{"key": 1}"#);
    // Sent to the endpoint's exchange, as MassTransit sends to a queue; and
    // again, as a redelivery would.
    publish_as_masstransit(&env.queue, id, &body).await;
    publish_as_masstransit(&env.queue, id, &body).await;
    wait_until("processed once and skipped once", || async {
        let s = runtime.stats();
        s.completed == 1 && s.duplicates == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 1).await, 1);
    let seen = seen.lock().unwrap();
    let context = &seen[0];
    assert_eq!(context.message_id, id);
    assert_eq!(context.event_type, Counted::TYPE);
    assert_eq!(context.conversation_id, Some(conversation.to_string()));
    assert_eq!(
        context.initiator_id.as_deref(),
        Some("00ab0000-6ab3-f8b4-0000-08db7c836600")
    );
    assert_eq!(
        context.source_address.as_deref(),
        Some("rabbitmq://localhost/orders")
    );
}

#[actix_rt::test]
async fn a_producer_publishing_the_type_reaches_the_queue_through_masstransits_exchanges() {
    /// A type of this test's alone: its exchange is shared by whoever binds it.
    #[derive(Debug, Serialize, Deserialize)]
    struct Routed {
        key: i64,
    }
    impl IntegrationEvent for Routed {
        const TYPE: &'static str = "Inbox.Tests.MassTransit:Routed";
    }
    struct CountRouted;
    impl EventHandler<Routed> for CountRouted {
        async fn handle(
            &self,
            event: &Routed,
            _context: &MessageContext,
            uow: &mut UnitOfWork,
        ) -> Result<(), HandlerError> {
            increment(uow, "counts", event.key).await
        }
    }
    let env = TestEnv::new("mt_routed").await;
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(CountRouted)
        .start()
        .await
        .unwrap();
    let id = Uuid::now_v7();
    let body = envelope(id, Uuid::now_v7(), Routed::TYPE, r#"{"key": 5}"#);
    publish_as_masstransit(Routed::TYPE, id, &body).await;
    wait_until(
        "the message published to its type's exchange is processed",
        || async { env.count("counts", 5).await == 1 },
    )
    .await;
    runtime.shutdown().await;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_delete(Routed::TYPE.into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn the_runtimes_publisher_publishes_as_masstransit_does_to_the_types_exchange() {
    /// Types of this test's alone: their exchanges are shared by whoever
    /// binds them.
    #[derive(Debug, Serialize, Deserialize)]
    struct Announced {
        key: i64,
    }
    impl IntegrationEvent for Announced {
        const TYPE: &'static str = "Inbox.Tests.MassTransit:Announced";
    }
    #[derive(Debug, Serialize, Deserialize)]
    struct Unheard {
        key: i64,
    }
    impl IntegrationEvent for Unheard {
        const TYPE: &'static str = "Inbox.Tests.MassTransit:Unheard";
    }
    struct CountAnnounced;
    impl EventHandler<Announced> for CountAnnounced {
        async fn handle(
            &self,
            event: &Announced,
            _context: &MessageContext,
            uow: &mut UnitOfWork,
        ) -> Result<(), HandlerError> {
            increment(uow, "counts", event.key).await
        }
    }
    let mut env = TestEnv::new("mt_publisher").await;
    // A MassTransit subscriber of the type, beside the runtime's queue.
    let subscriber = env.another_queue("subscriber");
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    rabbit_inbox::tools::declare_queue(&channel, &subscriber, rabbit_inbox::QueueKind::Quorum)
        .await
        .unwrap();
    rabbit_inbox::tools::bind_to_fanout(&channel, &subscriber, Announced::TYPE)
        .await
        .unwrap();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(CountAnnounced)
        .start()
        .await
        .unwrap();
    let message = rabbit_inbox::Message::new(Announced { key: 3 });
    // The routing key means nothing to a type's fanout exchange; twice, as
    // a publisher that lost the first confirm would.
    runtime.publisher().publish("ignored", &message).await.unwrap();
    runtime.publisher().publish("ignored", &message).await.unwrap();
    wait_until("processed once and skipped once", || async {
        let s = runtime.stats();
        s.completed == 1 && s.duplicates == 1
    })
    .await;
    // A type nobody subscribes to: the broker drops it, as it drops
    // MassTransit's publishes; the publish is not an error.
    runtime
        .publisher()
        .publish("", &rabbit_inbox::Message::new(Unheard { key: 4 }))
        .await
        .expect("a publish no queue takes");
    // Someone deletes the type's exchange: the broker closes the channel
    // of the next publish, and the one after declares it again.
    channel
        .exchange_delete(Unheard::TYPE.into(), Default::default())
        .await
        .unwrap();
    let mut failed = 0;
    while let Err(e) = runtime
        .publisher()
        .publish("", &rabbit_inbox::Message::new(Unheard { key: 5 }))
        .await
    {
        failed += 1;
        assert!(failed < 2, "still failing after the exchange was deleted: {e}");
    }
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 3).await, 1);

    let sent = env.take(&subscriber).await.expect("the subscriber's copy");
    assert_eq!(
        sent.properties.message_id().as_ref().map(|id| id.as_str()),
        Some(message.id.to_string().as_str())
    );
    assert_eq!(
        sent.properties.content_type().as_ref().map(|t| t.as_str()),
        Some(ENVELOPE_CONTENT_TYPE)
    );
    assert_eq!(sent.properties.kind(), &None, "MassTransit sets no `type`");
    let decoded = rabbit_inbox::internal::masstransit::decode(&sent.properties, &sent.data, false).unwrap();
    assert_eq!(decoded.context.message_types, [Announced::TYPE]);
    assert_eq!(decoded.message_id, message.id);
    assert!(decoded.context.conversation_id.is_some(), "a new conversation");
    let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
    assert_eq!(body, serde_json::json!({"key": 3}));
    for exchange in [Announced::TYPE, Unheard::TYPE] {
        channel
            .exchange_delete(exchange.into(), Default::default())
            .await
            .unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn a_row_staged_to_the_default_exchange_is_sent_to_the_queue_its_routing_key_names() {
    let env = TestEnv::new("mt_default_exchange").await;
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(CountAndRemember::default())
        .start()
        .await
        .unwrap();
    // Staged as another process would: a MassTransit envelope sent to the
    // queue itself.
    let id = Uuid::now_v7();
    let body = envelope(id, Uuid::now_v7(), Counted::TYPE, r#"{"key": 11}"#);
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body)
             VALUES ($1, '', $2, $3, $4)",
            &[&id, &env.queue, &Counted::TYPE, &body.as_bytes()],
        )
        .await
        .unwrap();
    wait_until("the row is sent to its queue and processed", || async {
        runtime.stats().completed == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 11).await, 1);
    assert_eq!(env.scalar("SELECT count(*) FROM outbox_messages").await, 0);
}

#[actix_rt::test]
async fn failures_and_unknown_types_are_set_aside_in_masstransits_queues_with_its_headers() {
    let env = TestEnv::new("mt_set_aside").await;
    let handler = CountAndRemember::default();
    let seen = Arc::clone(&handler.seen);
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(handler)
        .start()
        .await
        .unwrap();
    let (refused, unknown, other_id) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let refused_body = envelope(refused, Uuid::now_v7(), Counted::TYPE, r#"{"key": 7}"#);
    publish_as_masstransit(&env.queue, refused, &refused_body).await;
    let unknown_body = envelope(unknown, Uuid::now_v7(), "Inbox.Tests.MassTransit:Unknown", "{}");
    publish_as_masstransit(&env.queue, unknown, &unknown_body).await;
    // The AMQP message_id is not the envelope's: MassTransit reads the
    // envelope's, and processes it.
    let enveloped = Uuid::now_v7();
    let other_id_body = envelope(enveloped, Uuid::now_v7(), Counted::TYPE, r#"{"key": 2}"#);
    publish_as_masstransit(&env.queue, other_id, &other_id_body).await;
    // A message that is no `Counted`: malformed.
    let malformed = Uuid::now_v7();
    let malformed_body = envelope(malformed, Uuid::now_v7(), Counted::TYPE, "[1, 2]");
    publish_as_masstransit(&env.queue, malformed, &malformed_body).await;
    wait_until("two set aside, one skipped, one processed", || async {
        let s = runtime.stats();
        s.rejected == 2 && s.skipped == 1 && s.completed == 1
    })
    .await;
    runtime.shutdown().await;

    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    assert_eq!(error_queue, format!("{}_error", env.queue));
    let mut errors = Vec::new();
    while let Some(copy) = env.take(&error_queue).await {
        errors.push(copy);
    }
    assert_eq!(errors.len(), 2);
    let copy = errors
        .iter()
        .find(|c| c.properties.message_id().as_ref().map(|i| i.as_str()) == Some(&refused.to_string()))
        .expect("the refused one is in Q_error");
    assert_eq!(copy.data, refused_body.as_bytes(), "the envelope as it was sent");
    assert_eq!(header(copy, "MT-Reason").as_deref(), Some("fault"));
    assert_eq!(
        header(copy, "MT-Fault-Message").as_deref(),
        Some("key 7 is refused")
    );
    assert_eq!(
        header(copy, "MT-Fault-MessageType").as_deref(),
        Some("Inbox.Tests.MassTransit.Counted")
    );
    assert_eq!(
        header(copy, "MT-Fault-ConsumerType").as_deref(),
        Some("CountAndRemember")
    );
    assert_eq!(
        header(copy, "MT-Fault-InputAddress"),
        Some(format!("rabbitmq://127.0.0.1/{}", env.queue))
    );
    assert!(header(copy, "MT-Fault-Timestamp").is_some());
    assert_eq!(
        header(copy, "MT-Host-ProcessId"),
        Some(std::process::id().to_string()),
        "the host that moved it, as MassTransit's move transport writes it"
    );
    assert!(header(copy, "MT-Host-MachineName").is_some_and(|name| !name.is_empty()));
    assert_eq!(
        header(copy, "x-inbox-reason").as_deref(),
        Some("key 7 is refused")
    );
    let malformed = errors
        .iter()
        .find(|c| c.properties.message_id().as_ref().map(|i| i.as_str()) == Some(&malformed.to_string()))
        .expect("the malformed one is in Q_error");
    assert!(
        header(malformed, "MT-Fault-Message").is_some_and(|m| m.contains("not a valid")),
        "{:?}",
        header(malformed, "MT-Fault-Message")
    );
    assert_eq!(env.count("counts", 2).await, 1, "under the envelope's id");
    let seen: Vec<Uuid> = seen.lock().unwrap().iter().map(|c| c.message_id).collect();
    assert!(seen.contains(&enveloped), "{seen:?}");

    let skipped = env
        .take(&Wire::Masstransit.skipped_queue(&env.queue))
        .await
        .expect("the unknown type is in Q_skipped");
    assert_eq!(skipped.data, unknown_body.as_bytes());
    assert_eq!(header(&skipped, "MT-Reason").as_deref(), Some("dead-letter"));
    assert_eq!(
        header(&skipped, "MT-Host-ProcessId"),
        Some(std::process::id().to_string())
    );
    assert_eq!(env.count("counts", 7).await, 0);
}

#[actix_rt::test]
async fn a_failing_message_walks_the_delay_tiers_and_lands_in_q_error_with_its_counts() {
    let env = TestEnv::new("mt_exhausted").await;
    let mut settings = masstransit(&env);
    settings.failure.immediate_retries = 1;
    settings.failure.delays = vec![std::time::Duration::from_millis(100)];
    let runtime = Runtime::builder(settings.valid())
        .handler(CountAndRemember::default())
        .start()
        .await
        .unwrap();
    let id = Uuid::now_v7();
    let body = envelope(id, Uuid::now_v7(), Counted::TYPE, r#"{"key": 9}"#);
    publish_as_masstransit(&env.queue, id, &body).await;
    wait_until("it is dead-lettered after its tier", || async {
        let s = runtime.stats();
        s.delayed == 1 && s.dead_lettered == 1
    })
    .await;
    runtime.shutdown().await;
    let copy = env
        .take(&Wire::Masstransit.error_queue(&env.queue))
        .await
        .expect("in Q_error");
    // The envelope came back from its tier as sent, but for the
    // redelivery count in its headers, where MassTransit reads it.
    let sent: serde_json::Value = serde_json::from_str(&body).unwrap();
    let mut came_back: serde_json::Value = serde_json::from_slice(&copy.data).unwrap();
    assert_eq!(came_back["headers"]["MT-Redelivery-Count"], 1);
    came_back["headers"] = serde_json::json!({});
    assert_eq!(came_back, sent);
    assert_eq!(header(&copy, "MT-Reason").as_deref(), Some("fault"));
    assert_eq!(
        header(&copy, "MT-Fault-ExceptionType").as_deref(),
        Some("Inbox.AttemptsExhaustedException")
    );
    // Two attempts on each of two deliveries: three before the last.
    assert_eq!(
        header(&copy, "MT-Fault-RetryCount").as_deref(),
        Some("LongInt(3)")
    );
    assert_eq!(
        header(&copy, "MT-Redelivery-Count").as_deref(),
        Some("LongInt(1)")
    );
}

/// A follow-up as a MassTransit contract names it.
#[derive(Debug, Serialize, Deserialize, PartialEq)]
#[serde(rename_all = "camelCase")]
struct Recorded {
    key: i64,
    source_message_id: Uuid,
}

impl IntegrationEvent for Recorded {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:Recorded";
}

/// Stages one `Recorded` per event, through the outbox.
struct Forward;

impl EventHandler<Counted> for Forward {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let source_message_id = context.message_id;
        let recorded = Recorded {
            key: event.key,
            source_message_id,
        };
        uow.publish("", &rabbit_inbox::Message::new(recorded)).await?;
        Ok(())
    }
}

#[actix_rt::test]
async fn a_follow_up_goes_out_in_masstransits_envelope_to_its_types_exchange() {
    let mut env = TestEnv::new("mt_follow_up").await;
    // A MassTransit consumer of Recorded: its queue behind the type's
    // fanout exchange.
    let forward = env.another_queue("recorded");
    let connection = amqp().await;
    rabbit_inbox::tools::declare_wire_topology(
        &connection,
        &rabbit_inbox::QueueSettings::new(&forward),
        &Default::default(),
        Wire::Masstransit,
        &[Recorded::TYPE],
    )
    .await
    .unwrap();
    connection.close(200, "declared".into()).await.unwrap();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(Forward)
        .start()
        .await
        .unwrap();
    let (id, conversation, correlation) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let body = envelope_with(
        id,
        conversation,
        Counted::TYPE,
        r#"{"key": 3}"#,
        Some(correlation),
        "{}",
    );
    publish_as_masstransit(&env.queue, id, &body).await;
    wait_until("the follow-up arrives", || async {
        env.ready(&forward).await == 1
    })
    .await;
    runtime.shutdown().await;

    let arrived = env.take(&forward).await.expect("the follow-up");
    let properties = &arrived.properties;
    assert_eq!(
        properties.content_type().as_ref().map(|c| c.as_str()),
        Some(ENVELOPE_CONTENT_TYPE)
    );
    assert_eq!(properties.kind(), &None, "MassTransit sets no AMQP type");
    assert_eq!(properties.delivery_mode(), &Some(2));
    // What a MassTransit consumer reads of it.
    let decoded = rabbit_inbox::internal::masstransit::decode(properties, &arrived.data, false).unwrap();
    assert_eq!(
        properties.message_id().as_ref().map(|i| i.as_str().to_owned()),
        Some(decoded.message_id.to_string())
    );
    assert_eq!(decoded.context.message_types, [Recorded::TYPE]);
    assert_eq!(decoded.context.conversation_id, Some(conversation.to_string()));
    // As MassTransit's TransferConsumeContextHeaders: the consumed
    // correlation id initiates it; its own correlation id is not carried.
    assert_eq!(decoded.context.initiator_id, Some(correlation.to_string()));
    assert_eq!(decoded.context.correlation_id, None);
    assert_eq!(
        decoded.context.source_address,
        Some(format!("rabbitmq://127.0.0.1/{}", env.queue))
    );
    let message: Recorded = serde_json::from_slice(&decoded.message).unwrap();
    assert_eq!(
        message,
        Recorded {
            key: 3,
            source_message_id: id
        }
    );
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_delete(Recorded::TYPE.into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// [`Recorded`] under a type of its own, so that its exchange is this
/// test's alone (exchanges of a type are shared by every queue of it).
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct RecordedInBatch(Recorded);

impl IntegrationEvent for RecordedInBatch {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:RecordedInBatch";
}

/// [`Forward`], staging [`RecordedInBatch`]: written for one message, as
/// README shows, and run in batches.
struct ForwardInBatch;

impl EventHandler<Counted> for ForwardInBatch {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let source_message_id = context.message_id;
        let recorded = RecordedInBatch(Recorded {
            key: event.key,
            source_message_id,
        });
        uow.publish("", &rabbit_inbox::Message::new(recorded)).await?;
        Ok(())
    }
}

#[actix_rt::test]
async fn in_a_batch_each_follow_up_carries_its_own_messages_conversation_and_initiator() {
    let mut env = TestEnv::new("mt_follow_up_batch").await;
    let forward = env.another_queue("recorded");
    let connection = amqp().await;
    // The follow-ups' consumer, and the endpoint the check-ins wait on, as
    // the runtime declares it.
    let settings = masstransit(&env);
    for (queue, failure, message_type) in [
        (
            &rabbit_inbox::QueueSettings::new(&forward),
            &Default::default(),
            RecordedInBatch::TYPE,
        ),
        (&settings.queues[0], &settings.failure, Counted::TYPE),
    ] {
        rabbit_inbox::tools::declare_wire_topology(
            &connection,
            queue,
            failure,
            Wire::Masstransit,
            &[message_type],
        )
        .await
        .unwrap();
    }
    connection.close(200, "declared".into()).await.unwrap();
    // Waiting before the runtime starts, so that batches (8 by default)
    // form: each of its own conversation.
    let mut sent = std::collections::HashMap::new();
    for key in 0..16_i64 {
        let (id, conversation, correlation) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let body = envelope_with(
            id,
            conversation,
            Counted::TYPE,
            &format!(r#"{{"key": {key}}}"#),
            Some(correlation),
            &format!(r#"{{"tenant": "t{key}"}}"#),
        );
        publish_as_masstransit(&env.queue, id, &body).await;
        sent.insert(key, (id, conversation, correlation));
    }
    let runtime = Runtime::builder(settings.valid())
        .handler(ForwardInBatch)
        .start()
        .await
        .unwrap();
    wait_until("16 follow-ups arrive", || async {
        env.ready(&forward).await == 16
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;
    assert!(stats.batches >= 1, "no batch formed: {stats:?}");

    for _ in 0..16 {
        let arrived = env.take(&forward).await.expect("a follow-up");
        let decoded =
            rabbit_inbox::internal::masstransit::decode(&arrived.properties, &arrived.data, false).unwrap();
        let RecordedInBatch(message) = serde_json::from_slice(&decoded.message).unwrap();
        let (id, conversation, correlation) = sent[&message.key];
        assert_eq!(message.source_message_id, id, "key {}", message.key);
        assert_eq!(decoded.context.conversation_id, Some(conversation.to_string()));
        assert_eq!(decoded.context.initiator_id, Some(correlation.to_string()));
        let headers: serde_json::Value =
            serde_json::from_str(decoded.context.headers.as_deref().unwrap_or("{}")).unwrap();
        assert_eq!(
            headers["tenant"],
            format!("t{}", message.key),
            "its own message's headers"
        );
    }
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_delete(RecordedInBatch::TYPE.into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// Held by the tests of the example service on MassTransit's wire: their
/// queues are bound to the one exchange of its check-in type, shared
/// across the broker, so that each would take the others' check-ins.
static CHECK_IN_EXCHANGE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

#[actix_rt::test]
async fn the_example_service_speaks_masstransit_with_wire_masstransit() {
    const CHECKED_IN: &str = "Conference.Contracts:AttendeeCheckedIn";
    const RECORDED: &str = "Conference.Contracts:CheckinRecorded";
    let _exchange = CHECK_IN_EXCHANGE.lock().await;
    let mut env = TestEnv::new("mt_example").await;
    let forward = env.another_queue("recorded");
    let mut service = start_service(
        &env.database,
        &env.queue,
        &["--wire", "masstransit", "--forward-to", &forward],
    );
    let (started, log) = consumes(&mut service);
    assert!(started, "the service did not start:\n{log}");

    // A MassTransit producer publishes the type, twice (a redelivery),
    // and a type the service has no handler for. Its check-in carries a
    // correlation id, a header of the estate's and the trace of the .NET
    // activity that sent it.
    let (id, conversation, correlation) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let trace_id = "4bf92f3577b34da6a3ce929d0e0e4736";
    let body = envelope_with(
        id,
        conversation,
        CHECKED_IN,
        r#"{"attendeeId": 5, "sessionId": 9}"#,
        Some(correlation),
        &format!(r#"{{"tenant": "acme", "MT-Activity-Id": "00-{trace_id}-00f067aa0ba902b7-01"}}"#),
    );
    publish_as_masstransit(CHECKED_IN, id, &body).await;
    publish_as_masstransit(CHECKED_IN, id, &body).await;
    let unknown = Uuid::now_v7();
    let unknown_body = envelope(unknown, Uuid::now_v7(), "Conference.Contracts:Unknown", "{}");
    publish_as_masstransit(&env.queue, unknown, &unknown_body).await;
    let skipped = Wire::Masstransit.skipped_queue(&env.queue);
    wait_until(
        "the follow-up arrives and the unknown type is skipped",
        || async { env.ready(&forward).await == 1 && env.ready(&skipped).await == 1 },
    )
    .await;
    let _ = service.kill();
    let _ = service.wait();

    let checkins: i64 = env
        .db()
        .await
        .query_one(
            "SELECT checkins FROM attendee_checkins WHERE attendee_id = 5",
            &[],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(checkins, 1, "once, the redelivery skipped");
    let arrived = env.take(&forward).await.expect("the follow-up");
    let decoded =
        rabbit_inbox::internal::masstransit::decode(&arrived.properties, &arrived.data, false).unwrap();
    assert_eq!(decoded.context.message_types, [RECORDED]);
    // What MassTransit's TransferConsumeContextHeaders gives a follow-up.
    assert_eq!(decoded.context.initiator_id, Some(correlation.to_string()));
    assert_eq!(decoded.context.correlation_id, None);
    assert_eq!(decoded.context.conversation_id, Some(conversation.to_string()));
    assert_eq!(
        decoded.context.source_address,
        Some(format!("rabbitmq://127.0.0.1/{}", env.queue))
    );
    let headers: serde_json::Value =
        serde_json::from_str(decoded.context.headers.as_deref().unwrap_or("{}")).unwrap();
    assert_eq!(headers["tenant"], "acme");
    assert_eq!(header(&arrived, "tenant").as_deref(), Some("acme"));
    // The trace goes on, in a span of its own, for .NET and for W3C.
    let activity = headers["MT-Activity-Id"].as_str().unwrap_or_default();
    assert!(
        activity.starts_with(&format!("00-{trace_id}-")) && !activity.contains("00f067aa0ba902b7"),
        "{activity}"
    );
    assert_eq!(header(&arrived, "MT-Activity-Id").as_deref(), Some(activity));
    assert_eq!(header(&arrived, "traceparent").as_deref(), Some(activity));
    let message: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
    assert_eq!(
        message,
        serde_json::json!({"attendeeId": 5, "sessionId": 9, "sourceMessageId": id.to_string()})
    );

    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for exchange in [CHECKED_IN, RECORDED] {
        channel
            .exchange_delete(exchange.into(), Default::default())
            .await
            .unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn the_publish_example_speaks_masstransit_with_wire_masstransit() {
    const CHECKED_IN: &str = "Conference.Contracts:AttendeeCheckedIn";
    let _exchange = CHECK_IN_EXCHANGE.lock().await;
    let env = TestEnv::new("mt_publish_example").await;
    // `publish --wire masstransit` before the service ever ran (it declares
    // the endpoint), then again while the service consumes the queue it
    // declared: both as a MassTransit producer publishes, to the type's
    // exchange, and none set aside.
    let publish = |count: &str| {
        let output = std::process::Command::new(crate::support::example("publish"))
            .args(["--queue", &env.queue, "--wire", "masstransit", "--count", count])
            .current_dir(crate::support::REPOSITORY)
            .output()
            .expect("the publish example runs");
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        assert!(
            output.status.success(),
            "publish --wire masstransit failed: {stdout}{}",
            String::from_utf8_lossy(&output.stderr)
        );
        stdout
            .split_whitespace()
            .find_map(|field| field.strip_prefix("expected_checkins="))
            .and_then(|n| n.parse::<i64>().ok())
            .unwrap_or_else(|| panic!("no expected_checkins in: {stdout}"))
    };
    let before = publish("40");
    let mut service = start_service(&env.database, &env.queue, &["--wire", "masstransit"]);
    let (started, log) = consumes(&mut service);
    assert!(started, "the service did not start:\n{log}");
    let expected = before + publish("30");
    let checkins = || async {
        env.db()
            .await
            .query_one(
                "SELECT coalesce(sum(checkins), 0)::bigint FROM attendee_checkins",
                &[],
            )
            .await
            .unwrap()
            .get::<_, i64>(0)
    };
    wait_until("every published check-in is counted", || async {
        checkins().await >= expected
    })
    .await;
    let _ = service.kill();
    let _ = service.wait();
    assert_eq!(checkins().await, expected, "each unique check-in once");
    let error = Wire::Masstransit.error_queue(&env.queue);
    assert_eq!(env.ready(&error).await, 0, "nothing set aside");

    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_delete(CHECKED_IN.into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// Refuses key 7 the first time only; counts; keeps the headers of each
/// call for key 7.
#[derive(Default)]
struct RefusesOnce {
    calls: Arc<Mutex<Vec<Vec<String>>>>,
}

impl EventHandler<Counted> for RefusesOnce {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == 7 {
            let headers = context
                .headers()
                .iter()
                .map(|(name, _)| name.to_owned())
                .collect();
            let first = {
                let mut calls = self.calls.lock().unwrap();
                calls.push(headers);
                calls.len() == 1
            };
            if first {
                return Err(Permanent::new("not yet").into());
            }
        }
        increment(uow, "counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_message_replayed_from_q_error_runs_again_without_masstransits_fault_headers() {
    let env = TestEnv::new("mt_replay").await;
    let settings = masstransit(&env);
    let handler = RefusesOnce::default();
    let calls = Arc::clone(&handler.calls);
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(handler)
        .start()
        .await
        .unwrap();
    let id = Uuid::now_v7();
    let body = envelope(id, Uuid::now_v7(), Counted::TYPE, r#"{"key": 7}"#);
    publish_as_masstransit(&env.queue, id, &body).await;
    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    wait_until("it is in Q_error", || async {
        env.ready(&error_queue).await == 1
    })
    .await;

    let connection = rabbit_inbox::tools::connect(&settings, "test replay")
        .await
        .unwrap();
    let report = rabbit_inbox::tools::replay_on(
        Wire::Masstransit,
        &connection,
        &env.queue,
        rabbit_inbox::tools::SetAside::Error,
        None,
    )
    .await
    .unwrap();
    connection.close(200, "done".into()).await.unwrap();
    assert_eq!(report.replayed, 1);
    wait_until("the replayed message is counted", || async {
        env.count("counts", 7).await == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.ready(&error_queue).await, 0);
    let calls = calls.lock().unwrap();
    assert_eq!(calls.len(), 2);
    let replayed = &calls[1];
    for removed in ["MT-Reason", "MT-Fault-Message", "x-inbox-reason"] {
        assert!(
            !replayed.iter().any(|name| name == removed),
            "{removed} was left on the replayed copy"
        );
    }
}

#[actix_rt::test]
async fn a_message_that_lands_in_q_error_publishes_masstransits_fault_of_its_type() {
    /// A type of this test's alone: its fault exchange is shared by
    /// whoever binds it.
    #[derive(Debug, Serialize, Deserialize)]
    struct Faulted {
        key: i64,
    }
    impl IntegrationEvent for Faulted {
        const TYPE: &'static str = "Inbox.Tests.MassTransit:Faulted";
    }
    struct Refuse;
    impl EventHandler<Faulted> for Refuse {
        async fn handle(
            &self,
            _: &Faulted,
            _context: &MessageContext,
            _: &mut UnitOfWork,
        ) -> Result<(), HandlerError> {
            Err(Permanent::new("refused").into())
        }
    }
    let mut env = TestEnv::new("mt_fault").await;
    // A MassTransit subscriber of Fault<Faulted>, and one of every Fault
    // (shared with any other test's faults).
    let faults = env.another_queue("faults");
    let all_faults = env.another_queue("all_faults");
    let exchange = rabbit_inbox::internal::masstransit::fault_exchange(Faulted::TYPE);
    assert_eq!(exchange, "MassTransit:Fault--Inbox.Tests.MassTransit:Faulted--");
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    rabbit_inbox::tools::declare_queue(&channel, &faults, rabbit_inbox::QueueKind::Quorum)
        .await
        .unwrap();
    rabbit_inbox::tools::bind_to_fanout(&channel, &faults, &exchange)
        .await
        .unwrap();
    rabbit_inbox::tools::declare_queue(&channel, &all_faults, rabbit_inbox::QueueKind::Quorum)
        .await
        .unwrap();
    rabbit_inbox::tools::bind_to_fanout(
        &channel,
        &all_faults,
        rabbit_inbox::internal::masstransit::FAULT_EXCHANGE,
    )
    .await
    .unwrap();
    connection.close(200, "declared".into()).await.unwrap();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(Refuse)
        .start()
        .await
        .unwrap();
    let (id, conversation) = (Uuid::now_v7(), Uuid::now_v7());
    let body = envelope(id, conversation, Faulted::TYPE, r#"{"key": 1}"#);
    publish_as_masstransit(&env.queue, id, &body).await;
    wait_until("the fault is published", || async {
        env.ready(&faults).await == 1
    })
    .await;
    runtime.shutdown().await;

    let fault = env.take(&faults).await.expect("the fault");
    let decoded = rabbit_inbox::internal::masstransit::decode(&fault.properties, &fault.data, false).unwrap();
    assert_eq!(
        decoded.context.message_types,
        [
            "MassTransit:Fault[[Inbox.Tests.MassTransit:Faulted]]",
            "MassTransit:Fault"
        ]
    );
    assert_eq!(decoded.context.conversation_id, Some(conversation.to_string()));
    let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
    assert_eq!(body["faultedMessageId"], id.to_string());
    assert_eq!(body["exceptions"][0]["message"], "refused");
    assert_eq!(
        body["faultMessageTypes"][0],
        "urn:message:Inbox.Tests.MassTransit:Faulted"
    );
    assert_eq!(body["message"], serde_json::json!({"key": 1}));
    assert_eq!(env.ready(&Wire::Masstransit.error_queue(&env.queue)).await, 1);

    // As MassTransit binds them, `Fault<T>`'s exchange feeds `Fault`'s.
    let mut faulted_ids = Vec::new();
    while let Some(fault) = env.take(&all_faults).await {
        let decoded =
            rabbit_inbox::internal::masstransit::decode(&fault.properties, &fault.data, false).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
        faulted_ids.push(body["faultedMessageId"].as_str().unwrap_or_default().to_owned());
    }
    assert!(
        faulted_ids.contains(&id.to_string()),
        "a subscriber of MassTransit:Fault got {faulted_ids:?}"
    );
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// Declares receive endpoint `queue` exactly as MassTransit 8.5 does with
/// its defaults (RabbitMqReceiveEndpointBuilder.cs, RabbitMqErrorSettings.cs):
/// a classic durable queue with no arguments behind a fanout exchange of
/// its name, each consumed type's fanout exchange bound to that one, and
/// `Q_error` behind its own exchange, as a first fault leaves it. No
/// `Q_skipped`: MassTransit declares it at the first message it skips.
async fn declare_as_masstransit(queue: &str, types: &[&str]) {
    declare_as_masstransit_with(queue, types, Default::default()).await;
}

/// [`declare_as_masstransit`], `queue` and its `Q_error` declared with
/// `arguments` (MassTransit copies the queue's to its error queue).
async fn declare_as_masstransit_with(
    queue: &str,
    types: &[&str],
    arguments: rabbit_inbox::tools::lapin::types::FieldTable,
) {
    use rabbit_inbox::tools::lapin::ExchangeKind;
    use rabbit_inbox::tools::lapin::options::{ExchangeDeclareOptions, QueueDeclareOptions};
    use rabbit_inbox::tools::lapin::types::FieldTable;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let fanout = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    let error = Wire::Masstransit.error_queue(queue);
    for name in [queue, error.as_str()] {
        channel
            .queue_declare(name.into(), durable, arguments.clone())
            .await
            .unwrap();
        channel
            .exchange_declare(name.into(), ExchangeKind::Fanout, fanout, FieldTable::default())
            .await
            .unwrap();
        channel
            .queue_bind(
                name.into(),
                name.into(),
                "".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    for message_type in types {
        channel
            .exchange_declare(
                (*message_type).into(),
                ExchangeKind::Fanout,
                fanout,
                FieldTable::default(),
            )
            .await
            .unwrap();
        channel
            .exchange_bind(
                queue.into(),
                (*message_type).into(),
                "".into(),
                Default::default(),
                FieldTable::default(),
            )
            .await
            .unwrap();
    }
    connection.close(200, "declared".into()).await.unwrap();
}

/// Whether `queue` is still as MassTransit declared it: classic, with no
/// arguments (declaring it so again is no change).
async fn still_without_arguments(queue: &str) -> bool {
    use rabbit_inbox::tools::lapin::options::QueueDeclareOptions;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    let same = channel
        .queue_declare(queue.into(), durable, Default::default())
        .await
        .is_ok();
    let _ = connection.close(200, "looked".into()).await;
    same
}

#[actix_rt::test]
async fn an_endpoint_masstransit_declared_is_taken_over_as_it_is_and_its_waiting_messages_processed_once() {
    let env = TestEnv::new("mt_take_over").await;
    declare_as_masstransit(&env.queue, &[]).await;
    // Waiting before the runtime starts: seven (the keys the handler takes),
    // and one of them twice.
    let mut ids = Vec::new();
    for key in 0..7 {
        let id = Uuid::now_v7();
        let body = envelope(id, Uuid::now_v7(), Counted::TYPE, &format!(r#"{{"key": {key}}}"#));
        publish_as_masstransit(&env.queue, id, &body).await;
        ids.push((id, body));
    }
    publish_as_masstransit(&env.queue, ids[0].0, &ids[0].1).await;
    let log = crate::support::Captured::default();
    let capturing = log.install();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(CountAndRemember::default())
        .start()
        .await
        .expect("the runtime starts on MassTransit's queues");
    wait_until("the waiting messages are processed", || async {
        let s = runtime.stats();
        s.completed == 7 && s.duplicates == 1
    })
    .await;
    runtime.shutdown().await;
    drop(capturing);

    for key in 0..7 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
    let text = log.text();
    assert!(
        text.contains("in MassTransit's form") && text.contains("classic queue without arguments"),
        "the start says what it took over and what guards it: {text}"
    );
    for queue in [
        env.queue.clone(),
        Wire::Masstransit.error_queue(&env.queue),
        Wire::Masstransit.skipped_queue(&env.queue),
    ] {
        assert!(
            still_without_arguments(&queue).await,
            "{queue} is as MassTransit declares it"
        );
    }
}

#[actix_rt::test]
async fn the_example_takes_over_a_masstransit_endpoint_and_sets_a_crash_looping_message_aside() {
    const CHECKED_IN: &str = "Conference.Contracts:AttendeeCheckedIn";
    let _exchange = CHECK_IN_EXCHANGE.lock().await;
    const POISON: i64 = 4_660_001;
    let env = TestEnv::new("mt_take_over_example").await;
    declare_as_masstransit(&env.queue, &[CHECKED_IN]).await;
    let checkin = |attendee: i64| {
        let id = Uuid::now_v7();
        let body = envelope(
            id,
            Uuid::now_v7(),
            CHECKED_IN,
            &format!(r#"{{"attendeeId": {attendee}, "sessionId": 1}}"#),
        );
        (id, body)
    };
    // Waiting before the service first starts (sent to the endpoint's
    // exchange, not the type's, which other tests' services bind too).
    for attendee in 4_660_010..4_660_015 {
        let (id, body) = checkin(attendee);
        publish_as_masstransit(&env.queue, id, &body).await;
    }
    // From a producer on the PascalCase naming policy, and one on
    // Newtonsoft, which leaves a default value (`sessionId: 0`) out.
    let pascal = Uuid::now_v7();
    let body = format!(
        r#"{{"MessageId": "{pascal}", "MessageType": ["urn:message:{CHECKED_IN}"], "Message": {{"AttendeeId": 4660015, "SessionId": 1}}}}"#
    );
    publish_as_masstransit(&env.queue, pascal, &body).await;
    let newtonsoft = Uuid::now_v7();
    let body = format!(
        r#"{{"messageId": "{newtonsoft}", "messageType": ["urn:message:{CHECKED_IN}"], "message": {{"attendeeId": 4660016}}}}"#
    );
    publish_as_masstransit(&env.queue, newtonsoft, &body).await;
    let abort = POISON.to_string();
    let args = ["--wire", "masstransit", "--abort-on-attendee", &abort];
    let mut service = start_service(&env.database, &env.queue, &args);
    let (started, log) = consumes(&mut service);
    assert!(
        started,
        "the service did not start on MassTransit's queues:\n{log}"
    );
    wait_until("the waiting check-ins are processed", || async {
        env.scalar("SELECT count(*) FROM attendee_checkins WHERE attendee_id >= 4660010")
            .await
            == 7
    })
    .await;
    let _ = service.kill();
    let _ = service.wait();

    // A message that kills the service at every delivery, on a classic
    // queue the broker never limits: set aside after the delivery limit.
    let (poison, body) = checkin(POISON);
    publish_as_masstransit(&env.queue, poison, &body).await;
    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    let limit = rabbit_inbox::QueueSettings::new("q").delivery_limit;
    let mut starts = 0;
    while env.ready(&error_queue).await == 0 {
        starts += 1;
        assert!(starts <= limit, "still looping after {starts} starts");
        let mut service = start_service(&env.database, &env.queue, &args);
        // Either it aborts on the message, or it sets it aside and goes on.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        loop {
            if service.try_wait().unwrap().is_some() || env.ready(&error_queue).await > 0 {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "the service neither aborted nor moved it"
            );
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        }
        let _ = service.kill();
        let _ = service.wait();
    }
    assert_eq!(starts, limit, "set aside at its delivery number {limit}");
    let copy = env.take(&error_queue).await.expect("the poison message");
    assert_eq!(
        copy.properties.message_id().as_ref().map(|id| id.to_string()),
        Some(poison.to_string())
    );
    assert_eq!(
        header(&copy, "x-inbox-handler").as_deref(),
        Some("delivery limit")
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM attendee_checkins WHERE attendee_id >= 4660010")
            .await,
        7,
        "the others once each"
    );
    // The Newtonsoft form's left-out session read as 0.
    assert_eq!(
        env.scalar("SELECT count(*) FROM session_attendance WHERE session_id = 0")
            .await,
        1
    );
    assert!(still_without_arguments(&env.queue).await);
}

/// A contract as docs/masstransit.md recommends it: camelCase, and every
/// field defaulted, since Newtonsoft leaves default values out.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct CheckedIn {
    attendee_id: i64,
    session_id: i64,
}

impl IntegrationEvent for CheckedIn {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:CheckedIn";
}

/// Counts `attendee_id * 100 + session_id`: both fields read.
struct CountCheckIn;

impl EventHandler<CheckedIn> for CountCheckIn {
    async fn handle(
        &self,
        event: &CheckedIn,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, "counts", event.attendee_id * 100 + event.session_id).await
    }
}

#[actix_rt::test]
async fn every_message_form_masstransit_reads_is_consumed_or_set_aside_where_masstransit_sets_it() {
    use rabbit_inbox::internal::masstransit::{RAW_JSON_CONTENT_TYPE, headers as mt};
    let mut env = TestEnv::new("mt_forms").await;
    let raw_queue = env.another_queue("raw");
    let raw_of_two = env.another_queue("raw_of_two");
    let mut settings = masstransit(&env);
    settings.queues[0].event_types = vec![CheckedIn::TYPE.to_owned()];
    let mut raw = rabbit_inbox::QueueSettings::new(&raw_queue);
    raw.raw_json = true;
    raw.event_types = vec![CheckedIn::TYPE.to_owned()];
    settings.queues.push(raw);
    let mut of_two = rabbit_inbox::QueueSettings::new(&raw_of_two);
    of_two.raw_json = true;
    settings.queues.push(of_two);
    let runtime = Runtime::builder(settings.valid())
        .handler(CountCheckIn)
        .handler(CountAndRemember::default())
        .start()
        .await
        .unwrap();
    let typed = format!("urn:message:{}", CheckedIn::TYPE);
    let send = |queue: &str, content_type: Option<&str>, id: Uuid, body: String| {
        let mut properties = BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_delivery_mode(2);
        if let Some(content_type) = content_type {
            properties = properties.with_content_type(content_type.into());
        }
        let queue = queue.to_owned();
        async move { publish_to(&queue, "", properties, body.as_bytes()).await }
    };
    let camel = |message: &str| {
        let id = Uuid::now_v7();
        let body = format!(r#"{{"messageId": "{id}", "messageType": ["{typed}"], "message": {message}}}"#);
        (id, body)
    };
    let pascal_id = Uuid::now_v7();
    let pascal = format!(
        r#"{{"MessageId": "{pascal_id}", "MessageType": ["{typed}"], "Message": {{"AttendeeId": 2, "SessionId": 2}}, "Headers": null}}"#
    );
    // Consumed, each as its own key: (form, content type, key, message).
    type Form<'a> = (&'a str, Option<&'a str>, i64, (Uuid, String));
    let forms: Vec<Form> = vec![
        (
            "camelCase envelope",
            Some(ENVELOPE_CONTENT_TYPE),
            101,
            camel(r#"{"attendeeId": 1, "sessionId": 1}"#),
        ),
        (
            "PascalCase envelope",
            Some(ENVELOPE_CONTENT_TYPE),
            202,
            (pascal_id, pascal),
        ),
        (
            "Newtonsoft, a default left out",
            Some(ENVELOPE_CONTENT_TYPE),
            300,
            camel(r#"{"attendeeId": 3}"#),
        ),
        (
            "an envelope as application/json",
            Some(RAW_JSON_CONTENT_TYPE),
            404,
            camel(r#"{"attendeeId": 4, "sessionId": 4}"#),
        ),
        (
            "an envelope with no content type",
            None,
            505,
            camel(r#"{"attendeeId": 5, "sessionId": 5}"#),
        ),
    ];
    for (_, content_type, _, (id, body)) in &forms {
        send(&env.queue, *content_type, *id, body.clone()).await;
    }
    // Raw JSON where the endpoint reads raw: its type in a header.
    let raw_id = Uuid::now_v7();
    let mut table = rabbit_inbox::tools::lapin::types::FieldTable::default();
    table.insert(
        mt::MESSAGE_TYPE.into(),
        rabbit_inbox::tools::lapin::types::AMQPValue::LongString(typed.as_str().into()),
    );
    let raw_properties = BasicProperties::default()
        .with_message_id(raw_id.to_string().into())
        .with_content_type(RAW_JSON_CONTENT_TYPE.into())
        .with_headers(table);
    publish_to(
        "",
        &raw_queue,
        raw_properties,
        br#"{"attendeeId": 6, "sessionId": 6}"#,
    )
    .await;
    // Raw JSON naming no type, its media type with a parameter: the
    // endpoint's one type, as MassTransit hands it to its consumers; on a
    // queue of two types, which one cannot be told.
    let untyped = |id: Uuid| {
        BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_content_type("Application/JSON; charset=utf-8".into())
    };
    publish_to(
        "",
        &raw_queue,
        untyped(Uuid::now_v7()),
        br#"{"attendeeId": 7, "sessionId": 7}"#,
    )
    .await;
    let ambiguous = Uuid::now_v7();
    publish_to("", &raw_of_two, untyped(ambiguous), br#"{"key": 1}"#).await;
    // Set aside where MassTransit sets them aside: no type and an unknown
    // type to Q_skipped, no message to Q_error.
    let no_type = Uuid::now_v7();
    send(
        &env.queue,
        Some(ENVELOPE_CONTENT_TYPE),
        no_type,
        format!(r#"{{"messageId": "{no_type}", "messageType": null, "message": {{}}}}"#),
    )
    .await;
    let unknown = Uuid::now_v7();
    send(
        &env.queue,
        Some(ENVELOPE_CONTENT_TYPE),
        unknown,
        format!(
            r#"{{"messageId": "{unknown}", "messageType": ["urn:message:Other:Type"], "message": {{}}}}"#
        ),
    )
    .await;
    let no_message = Uuid::now_v7();
    send(
        &env.queue,
        Some(ENVELOPE_CONTENT_TYPE),
        no_message,
        format!(r#"{{"messageId": "{no_message}", "messageType": ["{typed}"]}}"#),
    )
    .await;

    wait_until("every form is consumed or set aside", || async {
        let s = runtime.stats();
        s.completed == 7 && s.skipped == 2 && s.rejected == 2
    })
    .await;
    runtime.shutdown().await;
    for (form, _, key, _) in &forms {
        assert_eq!(env.count("counts", *key).await, 1, "{form}");
    }
    assert_eq!(env.count("counts", 606).await, 1, "raw JSON");
    assert_eq!(env.count("counts", 707).await, 1, "raw JSON naming no type");
    let refused = env
        .take(&Wire::Masstransit.error_queue(&raw_of_two))
        .await
        .expect("raw JSON naming no type, on a queue of two types: in its Q_error");
    let reason = header(&refused, "x-inbox-reason").unwrap_or_default();
    assert!(
        reason.contains("MT-MessageType")
            && reason.contains(Counted::TYPE)
            && reason.contains(CheckedIn::TYPE),
        "{reason}"
    );
    let skipped = Wire::Masstransit.skipped_queue(&env.queue);
    let mut set_aside = Vec::new();
    while let Some(copy) = env.take(&skipped).await {
        assert_eq!(header(&copy, "MT-Reason").as_deref(), Some("dead-letter"));
        set_aside.push(copy.properties.message_id().as_ref().map(|id| id.to_string()));
    }
    let error = env
        .take(&Wire::Masstransit.error_queue(&env.queue))
        .await
        .expect("no message: in Q_error");
    assert_eq!(header(&error, "MT-Reason").as_deref(), Some("fault"));
    assert_eq!(
        error.properties.message_id().as_ref().map(|id| id.to_string()),
        Some(no_message.to_string())
    );
    set_aside.sort();
    let mut expected = vec![Some(no_type.to_string()), Some(unknown.to_string())];
    expected.sort();
    assert_eq!(set_aside, expected);
}

/// A message's class, as a MassTransit producer publishes it...
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct OrderShipped {
    order_id: i64,
    carrier: String,
}

impl IntegrationEvent for OrderShipped {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:OrderShipped";
}

/// ...and an interface it implements, read from the same JSON.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct OrderEvent {
    order_id: i64,
}

impl IntegrationEvent for OrderEvent {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:IOrderEvent";
}

/// Counts shipments at `order_id`; fails order 13.
struct CountShipped;

impl EventHandler<OrderShipped> for CountShipped {
    async fn handle(
        &self,
        event: &OrderShipped,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        assert_eq!(event.carrier, "post", "read as its own type");
        increment(uow, "counts", event.order_id).await
    }
}

/// Counts order events at `order_id` in `second_counts`; refuses order 13.
struct CountOrderEvents;

impl EventHandler<OrderEvent> for CountOrderEvents {
    async fn handle(
        &self,
        event: &OrderEvent,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if context.event_type != OrderEvent::TYPE {
            return Err("the context names another type".into());
        }
        if event.order_id == 13 {
            return Err(Permanent::new("order 13 is refused").into());
        }
        increment(uow, "second_counts", event.order_id).await
    }
}

#[actix_rt::test]
async fn every_handler_of_every_type_a_message_lists_runs_once_in_its_one_transaction() {
    for batch_size in [1, 8] {
        let env = TestEnv::new(&format!("mt_every_type_{batch_size}")).await;
        let mut settings = masstransit(&env);
        settings.queues[0].batch_size = batch_size;
        let runtime = Runtime::builder(settings.valid())
            .handler(CountShipped)
            .handler(CountOrderEvents)
            .start()
            .await
            .unwrap();
        let types = format!(
            r#"["urn:message:{}", "urn:message:Inbox.Tests.MassTransit:Unhandled", "urn:message:{}"]"#,
            OrderShipped::TYPE,
            OrderEvent::TYPE
        );
        for order in [1, 2, 13, 3] {
            let id = Uuid::now_v7();
            let body = format!(
                r#"{{"messageId": "{id}", "messageType": {types}, "message": {{"orderId": {order}, "carrier": "post"}}}}"#
            );
            publish_as_masstransit(&env.queue, id, &body).await;
        }
        wait_until("three complete and order 13 is refused", || async {
            let s = runtime.stats();
            s.completed == 3 && s.rejected == 1
        })
        .await;
        runtime.shutdown().await;
        for order in [1, 2, 3] {
            assert_eq!(
                env.count("counts", order).await,
                1,
                "batch {batch_size}, order {order}"
            );
            assert_eq!(
                env.count("second_counts", order).await,
                1,
                "batch {batch_size}, order {order}"
            );
        }
        assert_eq!(
            (
                env.count("counts", 13).await,
                env.count("second_counts", 13).await
            ),
            (0, 0),
            "a failure of one type's handler undoes the other's"
        );
        assert_eq!(
            env.scalar("SELECT count(*) FROM inbox_messages").await,
            3,
            "recorded once each"
        );
    }
}

/// Three contracts of the per-queue test's own, so that no other test's
/// queue is bound to their exchanges.
macro_rules! keyed_event {
    ($name:ident, $type_name:literal) => {
        #[derive(Debug, Clone, Serialize, Deserialize)]
        struct $name {
            key: i64,
        }

        impl IntegrationEvent for $name {
            const TYPE: &'static str = $type_name;
        }
    };
}
keyed_event!(PerQueueA, "Inbox.Tests.PerQueue:A");
keyed_event!(PerQueueB, "Inbox.Tests.PerQueue:B");
keyed_event!(PerQueueBoth, "Inbox.Tests.PerQueue:Both");

/// Counts each event in `table` at its key.
struct CountIn(&'static str);

impl EventHandler<PerQueueA> for CountIn {
    async fn handle(
        &self,
        event: &PerQueueA,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, self.0, event.key).await
    }
}

impl EventHandler<PerQueueB> for CountIn {
    async fn handle(
        &self,
        event: &PerQueueB,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, self.0, event.key).await
    }
}

impl EventHandler<PerQueueBoth> for CountIn {
    async fn handle(
        &self,
        event: &PerQueueBoth,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, self.0, event.key).await
    }
}

#[actix_rt::test]
async fn each_queue_takes_the_types_it_names_and_a_type_named_on_two_is_processed_on_both() {
    let mut env = TestEnv::new("mt_per_queue").await;
    let second = env.another_queue("b");
    let mut settings = masstransit(&env);
    settings.queues[0].event_types = vec![PerQueueA::TYPE.into(), PerQueueBoth::TYPE.into()];
    let mut b = rabbit_inbox::QueueSettings::new(&second);
    b.event_types = vec![PerQueueB::TYPE.into(), PerQueueBoth::TYPE.into()];
    settings.queues.push(b);
    let runtime = Runtime::builder(settings.clone().valid())
        .handler::<PerQueueA, _>(CountIn("counts"))
        .handler::<PerQueueB, _>(CountIn("second_counts"))
        .handler::<PerQueueBoth, _>(CountIn("counts"))
        .start()
        .await
        .unwrap();
    let publish = |message_type: &'static str, key: i64| async move {
        let id = Uuid::now_v7();
        let body = envelope(id, Uuid::now_v7(), message_type, &format!(r#"{{"key": {key}}}"#));
        publish_as_masstransit(message_type, id, &body).await;
    };
    publish(PerQueueA::TYPE, 1).await;
    publish(PerQueueB::TYPE, 2).await;
    publish(PerQueueBoth::TYPE, 900).await;
    wait_until("A on the first queue, B on the second, Both on both", || async {
        env.scalar("SELECT count(*) FROM inbox_messages").await == 4
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(
        counted_per_type(&env).await,
        (1, 1, 2),
        "(A, B, Both): once each, Both once on each queue"
    );
    let consumers: Vec<(String, String)> = env
        .db()
        .await
        .query(
            "SELECT consumer, event_type FROM inbox_messages ORDER BY consumer, event_type",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect();
    let mut expected = vec![
        (env.queue.clone(), PerQueueA::TYPE.to_owned()),
        (env.queue.clone(), PerQueueBoth::TYPE.to_owned()),
        (second.clone(), PerQueueB::TYPE.to_owned()),
        (second.clone(), PerQueueBoth::TYPE.to_owned()),
    ];
    expected.sort();
    assert_eq!(consumers, expected);

    // A queue that names a type without a handler: refused at start.
    settings.queues[0]
        .event_types
        .push("Inbox.Tests.PerQueue:Nobody".into());
    let error = Runtime::builder(settings.valid())
        .handler::<PerQueueA, _>(CountIn("counts"))
        .handler::<PerQueueB, _>(CountIn("second_counts"))
        .handler::<PerQueueBoth, _>(CountIn("counts"))
        .start()
        .await
        .expect_err("a type without a handler")
        .to_string();
    assert!(
        error.contains("queues[0].event_types") && error.contains("Inbox.Tests.PerQueue:Nobody"),
        "{error}"
    );

    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for exchange in [PerQueueA::TYPE, PerQueueB::TYPE, PerQueueBoth::TYPE] {
        let _ = channel.exchange_delete(exchange.into(), Default::default()).await;
    }
    let _ = connection.close(200, "done".into()).await;
}

/// (A's count at 1, B's at 2, Both's at 900), as the handlers wrote them.
async fn counted_per_type(env: &TestEnv) -> (i64, i64, i64) {
    (
        env.count("counts", 1).await,
        env.count("second_counts", 2).await,
        env.count("counts", 900).await,
    )
}

#[actix_rt::test]
async fn an_error_queue_masstransit_left_is_used_as_it_is_beside_a_new_queue() {
    use rabbit_inbox::tools::lapin::options::QueueDeclareOptions;
    let env = TestEnv::new("mt_error_left").await;
    // The endpoint's queue is gone, its error queue kept (as an operator
    // leaves it to look at): classic, without arguments.
    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let durable = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(error_queue.as_str().into(), durable, Default::default())
        .await
        .unwrap();
    connection.close(200, "declared".into()).await.unwrap();

    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(CountAndRemember::default())
        .start()
        .await
        .expect("starts beside the error queue MassTransit left");
    let refused = Uuid::now_v7();
    let body = envelope(refused, Uuid::now_v7(), Counted::TYPE, r#"{"key": 7}"#);
    publish_as_masstransit(&env.queue, refused, &body).await;
    wait_until("the refused one is set aside", || async {
        runtime.stats().rejected == 1
    })
    .await;
    runtime.shutdown().await;
    assert!(still_without_arguments(&error_queue).await, "used as it is");
    assert!(env.take(&error_queue).await.is_some(), "and the copy is in it");
}

/// Declares `queue` as MassTransit's `SetQuorumQueue()` does: durable,
/// `x-queue-type: quorum` and nothing more (no delivery limit, no
/// dead-lettering), behind a fanout exchange of its name.
async fn declare_as_masstransit_quorum(queue: &str) {
    use rabbit_inbox::tools::lapin::types::{AMQPValue, FieldTable};
    let mut quorum = FieldTable::default();
    quorum.insert("x-queue-type".into(), AMQPValue::LongString("quorum".into()));
    declare_as_masstransit_with(queue, &[], quorum).await;
}

#[actix_rt::test]
async fn on_an_adopted_quorum_queue_a_crash_loop_is_set_aside_before_rabbitmq_4_would_drop_it() {
    let env = TestEnv::new("mt_quorum_limit").await;
    declare_as_masstransit_quorum(&env.queue).await;
    let mut settings = masstransit(&env);
    // Far above what RabbitMQ 4 lets a quorum queue without its own limit
    // deliver (20) before it drops the message.
    settings.queues[0].delivery_limit = 1000;

    // A message the consumers have crashed on 18 times already, and once
    // more now: its 20th delivery is next.
    let id = Uuid::now_v7();
    let body = envelope(id, Uuid::now_v7(), Counted::TYPE, r#"{"key": 1}"#);
    publish_as_masstransit(&env.queue, id, &body).await;
    crash_once_on(&env.queue).await;
    delivered_before(&settings, id, 19).await;

    let log = crate::support::Captured::default();
    let capturing = log.install();
    let runtime = Runtime::builder(settings.valid())
        .handler(CountAndRemember::default())
        .start()
        .await
        .unwrap();
    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    wait_until("it is set aside or handled", || async {
        env.ready(&error_queue).await == 1 || env.count("counts", 1).await == 1
    })
    .await;
    runtime.shutdown().await;
    drop(capturing);

    assert_eq!(env.count("counts", 1).await, 0, "its handlers ran on delivery 20");
    let copy = env.take(&error_queue).await.expect("set aside");
    assert_eq!(
        header(&copy, "x-inbox-handler").as_deref(),
        Some("delivery limit")
    );
    let text = log.text();
    assert!(
        text.contains("on its delivery number 20 (RabbitMQ 4's default limit"),
        "the start says which limit applies: {text}"
    );
}

/// A contract with a dictionary and an id MassTransit's PascalCase
/// producers spell `ID`.
#[derive(Debug, Default, Clone, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase", default)]
struct Tagged {
    id: i64,
    tags: std::collections::BTreeMap<String, serde_json::Value>,
}

impl IntegrationEvent for Tagged {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:Tagged";
}

/// [`Tagged`], forwarded: a type of its own, so its exchange is this
/// test's alone.
#[derive(Debug, Serialize, Deserialize)]
#[serde(transparent)]
struct TaggedCopy(Tagged);

impl IntegrationEvent for TaggedCopy {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:TaggedCopy";
}

/// Keeps what it read; forwards it, or refuses id 7.
#[derive(Default)]
struct ForwardTagged {
    read: Arc<Mutex<Vec<Tagged>>>,
}

impl EventHandler<Tagged> for ForwardTagged {
    async fn handle(
        &self,
        event: &Tagged,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        self.read.lock().unwrap().push(event.clone());
        if event.id == 7 {
            return Err(Permanent::new("seven is refused").into());
        }
        uow.publish("", &rabbit_inbox::Message::new(TaggedCopy(event.clone())))
            .await?;
        Ok(())
    }
}

/// MassTransit matches a property to a field in any case and never
/// changes a key or a value: the handler reads `ID` into `id`, a
/// dictionary's keys stay as they were sent, and so does everything the
/// message says in the `Fault<T>` and a follow-up.
#[actix_rt::test]
async fn a_messages_keys_reach_its_handler_fault_and_follow_up_as_they_were_sent() {
    let mut env = TestEnv::new("mt_keys").await;
    let (faults, copies) = (env.another_queue("faults"), env.another_queue("copies"));
    let fault_exchange = rabbit_inbox::internal::masstransit::fault_exchange(Tagged::TYPE);
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for (queue, exchange) in [(&faults, fault_exchange.as_str()), (&copies, TaggedCopy::TYPE)] {
        rabbit_inbox::tools::declare_queue(&channel, queue, rabbit_inbox::QueueKind::Quorum)
            .await
            .unwrap();
        rabbit_inbox::tools::bind_to_fanout(&channel, queue, exchange)
            .await
            .unwrap();
    }
    connection.close(200, "declared".into()).await.unwrap();
    let handler = ForwardTagged::default();
    let read = Arc::clone(&handler.read);
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(handler)
        .start()
        .await
        .unwrap();
    let message = |id: i64| format!(r#"{{"ID": {id}, "tags": {{"VIP": "yes", "EU": 1, "lower": "Keep"}}}}"#);
    for key in [7, 8] {
        let id = Uuid::now_v7();
        publish_as_masstransit(
            &env.queue,
            id,
            &envelope(id, Uuid::now_v7(), Tagged::TYPE, &message(key)),
        )
        .await;
    }
    wait_until("the fault and the follow-up", || async {
        env.ready(&faults).await == 1 && env.ready(&copies).await == 1
    })
    .await;
    runtime.shutdown().await;

    let tags: std::collections::BTreeMap<String, serde_json::Value> =
        serde_json::from_value(serde_json::json!({"VIP": "yes", "EU": 1, "lower": "Keep"})).unwrap();
    let mut seen = read.lock().unwrap().clone();
    seen.sort_by_key(|tagged| tagged.id);
    assert_eq!(
        seen,
        [7, 8].map(|id| Tagged {
            id,
            tags: tags.clone()
        }),
        "`ID` read into `id`, the dictionary's keys as sent"
    );
    let fault = env.take(&faults).await.expect("the fault");
    let decoded = rabbit_inbox::internal::masstransit::decode(&fault.properties, &fault.data, false).unwrap();
    let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
    assert_eq!(
        body["message"],
        serde_json::from_str::<serde_json::Value>(&message(7)).unwrap(),
        "the faulted message as it was sent"
    );
    let copy = env.take(&copies).await.expect("the follow-up");
    let decoded = rabbit_inbox::internal::masstransit::decode(&copy.properties, &copy.data, false).unwrap();
    let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
    assert_eq!(
        body,
        serde_json::json!({"id": 8, "tags": {"VIP": "yes", "EU": 1, "lower": "Keep"}})
    );
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for exchange in [fault_exchange.as_str(), TaggedCopy::TYPE] {
        channel
            .exchange_delete(exchange.into(), Default::default())
            .await
            .unwrap();
    }
    connection.close(200, "done".into()).await.unwrap();
}

/// The way back: on an empty vhost the service declares what a default
/// MassTransit endpoint declares, so that a MassTransit consumer of the
/// queue starts on it after the service (a rollback) or beside it; and
/// what it sets aside reaches whatever is bound to the exchanges `Q_error`
/// and `Q_skipped`, as MassTransit's error transport publishes there.
#[actix_rt::test]
async fn a_masstransit_endpoint_starts_on_the_queues_the_service_declared_and_monitors_get_every_copy() {
    /// A type of this test's alone: its exchange is shared by whoever
    /// binds it.
    #[derive(Debug, Serialize, Deserialize)]
    struct Returned {
        key: i64,
    }
    impl IntegrationEvent for Returned {
        const TYPE: &'static str = "Inbox.Tests.MassTransit:Returned";
    }
    /// Counts each key; refuses 7.
    struct CountReturned;
    impl EventHandler<Returned> for CountReturned {
        async fn handle(
            &self,
            event: &Returned,
            _context: &MessageContext,
            uow: &mut UnitOfWork,
        ) -> Result<(), HandlerError> {
            if event.key == 7 {
                return Err(Permanent::new("key 7 is refused").into());
            }
            increment(uow, "counts", event.key).await
        }
    }
    let mut env = TestEnv::new("mt_way_back").await;
    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    let skipped_queue = Wire::Masstransit.skipped_queue(&env.queue);
    // A central error monitor, bound before any failure.
    let (error_monitor, skipped_monitor) = (
        env.another_queue("error_monitor"),
        env.another_queue("skipped_monitor"),
    );
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for (monitor, exchange) in [(&error_monitor, &error_queue), (&skipped_monitor, &skipped_queue)] {
        rabbit_inbox::tools::declare_queue(&channel, monitor, rabbit_inbox::QueueKind::Classic)
            .await
            .unwrap();
        rabbit_inbox::tools::bind_to_fanout(&channel, monitor, exchange)
            .await
            .unwrap();
    }
    connection.close(200, "declared".into()).await.unwrap();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(CountReturned)
        .start()
        .await
        .unwrap();
    let (done, refused, unknown) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    let refused_body = envelope(refused, Uuid::now_v7(), Returned::TYPE, r#"{"key": 7}"#);
    let unknown_body = envelope(unknown, Uuid::now_v7(), "Inbox.Tests.MassTransit:Unknown", "{}");
    publish_as_masstransit(
        Returned::TYPE,
        done,
        &envelope(done, Uuid::now_v7(), Returned::TYPE, r#"{"key": 1}"#),
    )
    .await;
    publish_as_masstransit(&env.queue, refused, &refused_body).await;
    publish_as_masstransit(&env.queue, unknown, &unknown_body).await;
    wait_until("one done, one refused, one skipped", || async {
        let s = runtime.stats();
        s.completed == 1 && s.rejected == 1 && s.skipped == 1
    })
    .await;
    runtime.shutdown().await;

    // Each copy in its queue, and in the monitor bound to its exchange.
    for (queue, monitor, body) in [
        (&error_queue, &error_monitor, &refused_body),
        (&skipped_queue, &skipped_monitor, &unknown_body),
    ] {
        for from in [queue, monitor] {
            let copy = env.take(from).await.unwrap_or_else(|| panic!("a copy in {from}"));
            assert_eq!(copy.data, body.as_bytes(), "{from}");
            assert_eq!(
                copy.routing_key.as_str(),
                "",
                "the original routing key, in {from}"
            );
        }
    }

    // The rollback: MassTransit's endpoint declares its queues, exchanges
    // and bindings with its defaults, and every declaration is taken.
    declare_as_masstransit(&env.queue, &[Returned::TYPE]).await;
    for queue in [&env.queue, &error_queue, &skipped_queue] {
        assert!(
            still_without_arguments(queue).await,
            "{queue} is as a MassTransit endpoint declares it"
        );
    }
    // Its consumer gets what producers publish from now on.
    let next = Uuid::now_v7();
    publish_as_masstransit(
        Returned::TYPE,
        next,
        &envelope(next, Uuid::now_v7(), Returned::TYPE, r#"{"key": 2}"#),
    )
    .await;
    wait_until("the next message waits in Q for the .NET consumer", || async {
        env.ready(&env.queue).await == 1
    })
    .await;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_delete(Returned::TYPE.into(), Default::default())
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// Retries counted as MassTransit counts them: a message a .NET consumer
/// redelivered twice (`MT-Redelivery-Count: 2`) has spent two retry tiers;
/// a copy moved back from `Q_error` as it lies there (by the management
/// UI, a shovel) starts with a fresh budget, its failure headers its past.
#[actix_rt::test]
async fn redeliveries_count_as_masstransit_counts_them_and_a_copy_moved_back_starts_afresh() {
    let env = TestEnv::new("mt_redelivery_count").await;
    let mut settings = masstransit(&env);
    settings.failure.immediate_retries = 0;
    settings.failure.delays = vec![std::time::Duration::from_millis(100); 2];
    let runtime = Runtime::builder(settings.valid())
        .handler(CountAndRemember::default())
        .start()
        .await
        .unwrap();
    let id = Uuid::now_v7();
    let body = envelope_with(
        id,
        Uuid::now_v7(),
        Counted::TYPE,
        r#"{"key": 9}"#,
        None,
        r#"{"MT-Redelivery-Count": 2}"#,
    );
    let mut headers = rabbit_inbox::tools::lapin::types::FieldTable::default();
    headers.insert(
        "MT-Redelivery-Count".into(),
        rabbit_inbox::tools::lapin::types::AMQPValue::LongInt(2),
    );
    let properties = BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_content_type(ENVELOPE_CONTENT_TYPE.into())
        .with_delivery_mode(2)
        .with_headers(headers);
    publish_to(&env.queue, "", properties, body.as_bytes()).await;
    wait_until("straight to Q_error: both tiers spent in .NET", || async {
        runtime.stats().dead_lettered == 1
    })
    .await;
    assert_eq!(runtime.stats().delayed, 0, "no tier left to walk");
    let error_queue = Wire::Masstransit.error_queue(&env.queue);
    let copy = env.take(&error_queue).await.expect("in Q_error");
    assert_eq!(header(&copy, "x-inbox-redeliveries").as_deref(), Some("2"));

    // Moved back as it lies in Q_error: the tiers are walked anew.
    publish_to(&env.queue, "", copy.properties.clone(), &copy.data).await;
    wait_until("it walks both tiers again, then lands in Q_error", || async {
        let s = runtime.stats();
        s.delayed == 2 && s.dead_lettered == 2
    })
    .await;
    runtime.shutdown().await;
    let again = env.take(&error_queue).await.expect("in Q_error again");
    assert_eq!(header(&again, "x-inbox-redeliveries").as_deref(), Some("2"));
    assert_eq!(
        header(&again, "MT-Redelivery-Count").as_deref(),
        Some("LongInt(2)")
    );
}

/// A contract and the interface it implements, as a .NET producer lists
/// them: this test's alone (their fault exchanges are shared).
#[derive(Debug, Serialize, Deserialize)]
struct Seated {
    key: i64,
}

impl IntegrationEvent for Seated {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:Seated";
}

#[derive(Debug, Serialize, Deserialize)]
struct SeatEvent {
    key: i64,
}

impl IntegrationEvent for SeatEvent {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:ISeatEvent";
}

/// Takes every `Seated` but key 2.
struct TakeSeated;

impl EventHandler<Seated> for TakeSeated {
    async fn handle(
        &self,
        event: &Seated,
        _context: &MessageContext,
        _: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        match event.key {
            2 => Err(Permanent::new("seat 2 is broken").into()),
            _ => Ok(()),
        }
    }
}

/// Refuses every `ISeatEvent`.
struct RefuseSeatEvents;

impl EventHandler<SeatEvent> for RefuseSeatEvents {
    async fn handle(
        &self,
        _: &SeatEvent,
        _context: &MessageContext,
        _: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        Err(Permanent::new("no seats today").into())
    }
}

/// Faults a .NET estate consumes: `Fault<T>` of the type whose handler
/// failed, listed as `Fault<X>` for the types the message declared after
/// it (its bases) and reaching a subscriber of `Fault<X>`'s exchange; sent
/// to the envelope's `faultAddress` instead when it has one; MassTransit's
/// forms for its exception type and timestamp.
#[actix_rt::test]
async fn faults_go_where_masstransit_sends_them_as_every_type_the_message_declared() {
    let mut env = TestEnv::new("mt_fault_types").await;
    let (of_base, of_concrete, replies) = (
        env.another_queue("fault_of_base"),
        env.another_queue("fault_of_concrete"),
        env.another_queue("replies"),
    );
    let fault_of = rabbit_inbox::internal::masstransit::fault_exchange;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    // Exchanges outlive a run that failed before it cleaned up, and their
    // bindings with them.
    for exchange in [fault_of(Seated::TYPE), fault_of(SeatEvent::TYPE)] {
        let _ = channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
    }
    for (queue, exchange) in [
        (&of_base, fault_of(SeatEvent::TYPE)),
        (&of_concrete, fault_of(Seated::TYPE)),
        (&replies, replies.clone()),
    ] {
        rabbit_inbox::tools::declare_queue(&channel, queue, rabbit_inbox::QueueKind::Classic)
            .await
            .unwrap();
        rabbit_inbox::tools::bind_to_fanout(&channel, queue, &exchange)
            .await
            .unwrap();
    }
    connection.close(200, "declared".into()).await.unwrap();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(TakeSeated)
        .handler(RefuseSeatEvents)
        .start()
        .await
        .unwrap();
    let both = format!(
        r#""urn:message:{}", "urn:message:{}""#,
        Seated::TYPE,
        SeatEvent::TYPE
    );
    let with_types = |id: Uuid, key: i64, fault_address: Option<&str>| {
        let body = envelope(id, Uuid::now_v7(), Seated::TYPE, &format!(r#"{{"key": {key}}}"#))
            .replace(&format!(r#""urn:message:{}""#, Seated::TYPE), &both);
        match fault_address {
            Some(address) => body.replace(
                r#""faultAddress": null"#,
                &format!(r#""faultAddress": "{address}""#),
            ),
            None => body,
        }
    };
    // Key 1: Seated's handler takes it, ISeatEvent's refuses it. Key 2:
    // Seated's refuses it, and ISeatEvent's never runs.
    let (published, concrete, sent) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
    publish_as_masstransit(&env.queue, published, &with_types(published, 1, None)).await;
    publish_as_masstransit(&env.queue, concrete, &with_types(concrete, 2, None)).await;
    let address = format!("rabbitmq://127.0.0.1/{replies}");
    publish_as_masstransit(&env.queue, sent, &with_types(sent, 1, Some(&address))).await;
    wait_until(
        "the faults reach their subscribers and the fault address",
        || async {
            env.ready(&of_base).await == 2
                && env.ready(&of_concrete).await == 1
                && env.ready(&replies).await == 1
        },
    )
    .await;
    runtime.shutdown().await;

    let read = |delivery: &rabbit_inbox::tools::lapin::message::Delivery| {
        let decoded =
            rabbit_inbox::internal::masstransit::decode(&delivery.properties, &delivery.data, false).unwrap();
        let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
        (decoded, body)
    };
    let mut of_base_faults = std::collections::HashMap::new();
    while let Some(fault) = env.take(&of_base).await {
        let (decoded, body) = read(&fault);
        let faulted = body["faultedMessageId"].as_str().unwrap_or_default().to_owned();
        of_base_faults.insert(faulted, (decoded, body));
    }
    // Key 1: Fault<ISeatEvent> (the handler that failed), and no Fault<X>
    // of a type listed before it, which is none of its bases.
    let (decoded, body) = &of_base_faults[&published.to_string()];
    assert_eq!(
        decoded.context.message_types,
        [
            format!("MassTransit:Fault[[{}]]", SeatEvent::TYPE),
            "MassTransit:Fault".to_owned()
        ],
        "Fault<T> of the type whose handler failed"
    );
    assert_eq!(
        body["exceptions"][0]["exceptionType"],
        "Inbox.MessageRejectedException"
    );
    let timestamp = body["timestamp"].as_str().unwrap_or_default();
    assert_eq!(
        timestamp.split_once('.').map(|(_, f)| f.len()),
        Some(8),
        "seven fractional digits and Z: {timestamp}"
    );
    // Key 2: Fault<Seated>, listed as Fault<ISeatEvent> too, which a
    // subscriber of Fault<ISeatEvent> gets, as .NET's covariance gives it.
    let (decoded, _) = &of_base_faults[&concrete.to_string()];
    assert_eq!(
        decoded.context.message_types,
        [
            format!("MassTransit:Fault[[{}]]", Seated::TYPE),
            format!("MassTransit:Fault[[{}]]", SeatEvent::TYPE),
            "MassTransit:Fault".to_owned()
        ]
    );
    let concrete_fault = env.take(&of_concrete).await.expect("Fault<Seated>");
    assert_eq!(read(&concrete_fault).1["faultedMessageId"], concrete.to_string());
    assert_eq!(
        env.ready(&of_concrete).await,
        0,
        "Fault<ISeatEvent> does not reach Fault<Seated>'s subscribers"
    );

    let reply = env.take(&replies).await.expect("the fault at the fault address");
    let (decoded, body) = read(&reply);
    assert_eq!(body["faultedMessageId"], sent.to_string());
    assert_eq!(
        decoded.context.message_types[0],
        format!("MassTransit:Fault[[{}]]", SeatEvent::TYPE)
    );
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for exchange in [
        Seated::TYPE.to_owned(),
        SeatEvent::TYPE.to_owned(),
        fault_of(Seated::TYPE),
        fault_of(SeatEvent::TYPE),
        replies.clone(),
    ] {
        let _ = channel
            .exchange_delete(exchange.as_str().into(), Default::default())
            .await;
    }
    connection.close(200, "done".into()).await.unwrap();
}

/// A follow-up contract that implements a .NET interface, as its
/// `IMPLEMENTS` says: this test's alone.
#[derive(Debug, Serialize, Deserialize)]
struct Boarded {
    key: i64,
}

impl IntegrationEvent for Boarded {
    const TYPE: &'static str = "Inbox.Tests.MassTransit:Boarded";
    const IMPLEMENTS: &'static [&'static str] = &["Inbox.Tests.MassTransit:IBoardingEvent"];
}

/// Stages a `Boarded` per `Counted`.
struct Board;

impl EventHandler<Counted> for Board {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        uow.publish("", &rabbit_inbox::Message::new(Boarded { key: event.key }))
            .await?;
        Ok(())
    }
}

/// A .NET consumer of an interface receives what is published as a type
/// that implements it: the publish lists both types, and the type's
/// exchange is bound to the interface's, through the outbox and from
/// `runtime.publisher()` alike.
#[actix_rt::test]
async fn a_publish_reaches_the_consumers_of_the_types_its_contract_implements() {
    const BASE: &str = "Inbox.Tests.MassTransit:IBoardingEvent";
    let mut env = TestEnv::new("mt_implements").await;
    let of_base = env.another_queue("of_base");
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    // Exchanges and their bindings outlive a run that failed before it
    // cleaned up.
    for exchange in [Boarded::TYPE, BASE] {
        let _ = channel.exchange_delete(exchange.into(), Default::default()).await;
    }
    rabbit_inbox::tools::declare_queue(&channel, &of_base, rabbit_inbox::QueueKind::Classic)
        .await
        .unwrap();
    rabbit_inbox::tools::bind_to_fanout(&channel, &of_base, BASE)
        .await
        .unwrap();
    connection.close(200, "declared".into()).await.unwrap();
    let runtime = Runtime::builder(masstransit(&env).valid())
        .handler(Board)
        .start()
        .await
        .unwrap();
    let id = Uuid::now_v7();
    publish_as_masstransit(
        &env.queue,
        id,
        &envelope(id, Uuid::now_v7(), Counted::TYPE, r#"{"key": 1}"#),
    )
    .await;
    runtime
        .publisher()
        .publish("", &rabbit_inbox::Message::new(Boarded { key: 2 }))
        .await
        .unwrap();
    wait_until("both reach the interface's consumer", || async {
        env.ready(&of_base).await == 2
    })
    .await;
    runtime.shutdown().await;
    let mut keys = Vec::new();
    while let Some(delivery) = env.take(&of_base).await {
        let decoded =
            rabbit_inbox::internal::masstransit::decode(&delivery.properties, &delivery.data, false).unwrap();
        assert_eq!(decoded.context.message_types, [Boarded::TYPE, BASE]);
        let message: Boarded = serde_json::from_slice(&decoded.message).unwrap();
        keys.push(message.key);
    }
    keys.sort_unstable();
    assert_eq!(keys, [1, 2]);
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for exchange in [Boarded::TYPE, BASE] {
        let _ = channel.exchange_delete(exchange.into(), Default::default()).await;
    }
    connection.close(200, "done".into()).await.unwrap();
}
