//! Trace context across publish and consume: W3C `traceparent` in the
//! AMQP headers, stored with outbox rows, adopted by the consumer. (With
//! the `opentelemetry` feature, tests/otel.rs checks the exported spans.)

use std::sync::{Arc, Mutex};

use rabbit_inbox::Runtime;
use rabbit_inbox::internal::trace;
use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::outbox::with_forward_queue;
use crate::support::{Counted, TestEnv, Valid, increment, wait_until};

const INCOMING: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

/// Counts, keeps each message's context, and stages one follow-up to
/// `forward`; fails every first attempt.
struct Remember {
    seen: Arc<Mutex<Vec<MessageContext>>>,
    forward: String,
}

impl EventHandler<Counted> for Remember {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let context = context.clone();
        let attempt = context.attempt;
        self.seen.lock().unwrap().push(context);
        increment(uow, "counts", event.key).await?;
        uow.publish(&self.forward, &Message::new(Counted { key: event.key + 1 }))
            .await?;
        if attempt == 1 {
            return Err("the first attempt fails".into());
        }
        Ok(())
    }
}

#[actix_rt::test]
async fn a_handler_sees_the_context_and_a_follow_up_continues_the_trace() {
    let (env, forward) = with_forward_queue("trace_propagation").await;
    let mut settings = env.settings();
    settings.failure.immediate_retries = 1;
    let seen = Arc::new(Mutex::new(Vec::new()));
    let runtime = Runtime::builder(settings.valid())
        .handler(Remember {
            seen: Arc::clone(&seen),
            forward: forward.clone(),
        })
        .start()
        .await
        .unwrap();
    // It fails its first attempt and succeeds on its immediate retry.
    let message = Message::new(Counted { key: 0 });
    let mut headers = rabbit_inbox::tools::lapin::types::FieldTable::default();
    trace::write(&trace::parse(INCOMING, Some("vendor=1")).unwrap(), &mut headers);
    headers.insert(
        "tenant".into(),
        rabbit_inbox::tools::lapin::types::AMQPValue::LongString("acme".into()),
    );
    let properties = BasicProperties::default()
        .with_message_id(message.id.to_string().into())
        .with_type("Counted".into())
        .with_headers(headers);
    env.publish_raw(properties, &message.to_json().unwrap()).await;
    wait_until("the follow-up arrives", || async {
        env.ready(&forward).await == 1
    })
    .await;
    runtime.shutdown().await;

    let seen = seen.lock().unwrap().clone();
    assert_eq!(seen.len(), 2, "two attempts");
    assert_eq!(seen.iter().map(|c| c.attempt).collect::<Vec<_>>(), vec![1, 2]);
    let context = &seen[1];
    assert_eq!(context.message_id, message.id);
    assert_eq!(context.event_type, "Counted");
    assert_eq!(context.trace.as_ref().map(|t| t.traceparent()), Some(INCOMING));
    assert_eq!(
        context.headers().get("tenant").as_ref().and_then(|v| v.as_text()),
        Some("acme"),
        "{context:?}"
    );

    let follow_up = env.take(&forward).await.unwrap();
    let carried = trace::read(follow_up.properties.headers().as_ref().unwrap())
        .expect("the follow-up carries a trace context");
    assert_eq!(
        carried.trace_id(),
        "4bf92f3577b34da6a3ce929d0e0e4736",
        "same trace"
    );
    assert_ne!(carried.parent_id(), "00f067aa0ba902b7", "a new parent");
    assert_eq!(carried.tracestate(), Some("vendor=1"));
}

#[actix_rt::test]
async fn an_invalid_traceparent_is_ignored_and_the_message_processed() {
    let env = TestEnv::new("trace_invalid").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    let message = Message::new(Counted { key: 1 });
    let mut headers = rabbit_inbox::tools::lapin::types::FieldTable::default();
    headers.insert(
        "traceparent".into(),
        rabbit_inbox::tools::lapin::types::AMQPValue::LongString(
            "00-zz-not-a-trace".repeat(100).as_str().into(),
        ),
    );
    let properties = BasicProperties::default()
        .with_message_id(message.id.to_string().into())
        .with_type("Counted".into())
        .with_headers(headers);
    env.publish_raw(properties, &message.to_json().unwrap()).await;
    wait_until("processed", || async { runtime.stats().completed == 1 }).await;
    runtime.shutdown().await;
}
