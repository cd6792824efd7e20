use inbox::Message;
use inbox::lapin::BasicProperties;
use inbox_actors::Runtime;

use crate::support::{Count, Counted, TestEnv, wait_until};

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
async fn malformed_deliveries_and_unknown_types_are_set_aside_without_a_loop() {
    let env = TestEnv::new("bad_input").await;
    let runtime = Runtime::builder(env.settings())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let id = || uuid::Uuid::now_v7().to_string();
    let good = br#"{"key": 1}"#;
    env.publish_raw(properties(None, Some("Counted")), good).await;
    env.publish_raw(properties(Some("not-a-uuid"), Some("Counted")), good)
        .await;
    env.publish_raw(properties(Some(&id()), None), good).await;
    env.publish_raw(properties(Some(&id()), Some("Counted")), br#"{"key": "one"}"#)
        .await;
    env.publish_raw(properties(Some(&id()), Some("Counted")), b"not json")
        .await;
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
        s.rejected == 5 && s.skipped == 1 && s.completed == 1
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
    // Nothing was requeued: a redelivery loop would leave them in the queue.
    assert_eq!(env.ready(&env.queue).await, 0);
}
