//! With the `opentelemetry` feature: spans exported through an in-memory
//! exporter show the consumer's span in the publisher's trace, across a
//! publish through the outbox. A test binary of its own, so that its
//! tracing subscriber is the process's global one and sees every span.

#[path = "it/support.rs"]
#[allow(dead_code, unreachable_pub)]
mod support;

use opentelemetry::trace::TracerProvider;
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider};
use rabbit_inbox::Message;
use rabbit_inbox::Runtime;
use tracing_subscriber::layer::SubscriberExt;

use support::{Count, Counted, TestEnv, Valid, wait_until};

#[actix_rt::test]
async fn the_consumers_span_has_the_publishers_trace_id_across_the_outbox() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());
    let subscriber = tracing_subscriber::registry()
        .with(tracing_opentelemetry::layer().with_tracer(provider.tracer("inbox-test")));
    tracing::subscriber::set_global_default(subscriber).unwrap();

    let env = TestEnv::new("trace_otel").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    // The publisher: application code staging through the outbox
    // inside a span of its own.
    let checkout = tracing::info_span!("checkout");
    let staged = async {
        let mut uow = runtime.unit_of_work().await.unwrap();
        uow.publish(&env.queue, &Message::new(Counted { key: 1 }))
            .await
            .unwrap();
        uow.commit().await.unwrap();
    };
    tracing::Instrument::instrument(staged, checkout.clone()).await;
    drop(checkout);
    wait_until("consumed", || async { runtime.stats().completed == 1 }).await;
    runtime.shutdown().await;
    provider.force_flush().unwrap();

    let spans = exporter.get_finished_spans().unwrap();
    let named = |name: &str| {
        spans.iter().find(|span| span.name == name).unwrap_or_else(|| {
            panic!(
                "no span {name} in {:?}",
                spans.iter().map(|s| &s.name).collect::<Vec<_>>()
            )
        })
    };
    let checkout = named("checkout");
    let process = named(&format!("process {}", env.queue));
    let publish = named(&format!("publish {}", env.queue));
    let trace_id = checkout.span_context.trace_id();
    assert_eq!(
        process.span_context.trace_id(),
        trace_id,
        "the consumer's span is in the publisher's trace"
    );
    assert_eq!(
        process.parent_span_id,
        checkout.span_context.span_id(),
        "a child of the staging span"
    );
    assert_eq!(
        publish.span_context.trace_id(),
        trace_id,
        "so is the dispatcher's publish"
    );
    let attribute = |key: &str| {
        process
            .attributes
            .iter()
            .find(|kv| kv.key.as_str() == key)
            .map(|kv| kv.value.to_string())
    };
    assert_eq!(attribute("messaging.system").as_deref(), Some("rabbitmq"));
    assert_eq!(attribute("messaging.destination.name"), Some(env.queue.clone()));
    assert_eq!(attribute("messaging.operation.type").as_deref(), Some("process"));
    assert!(attribute("messaging.message.id").is_some());
    assert_eq!(
        attribute("messaging.rabbitmq.destination.routing_key"),
        Some(env.queue.clone())
    );
}
