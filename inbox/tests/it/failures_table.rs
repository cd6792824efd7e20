//! The failures table: with `failures.drain`, what the queues set aside is
//! moved into `inbox_failures`, one row per message, each copy acked only
//! once its row is committed.

use rabbit_inbox::Runtime;
use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, Permanent, UnitOfWork};
use uuid::Uuid;

use crate::support::{Counted, TestEnv, Valid, increment, publish_to, wait_until};

/// Refuses keys from 100 on, for good: "key N is refused".
struct RefuseLarge;

impl EventHandler<Counted> for RefuseLarge {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key >= 100 {
            return Err(Permanent::new(format!("key {} is refused", event.key)).into());
        }
        increment(uow, "counts", event.key).await
    }

    fn name(&self) -> &'static str {
        "RefuseLarge"
    }
}

#[actix_rt::test]
async fn what_the_queues_set_aside_is_drained_into_one_row_per_message_and_a_copy_drained_twice_is_one_row() {
    let env = TestEnv::new("failures_drained").await;
    let mut settings = env.settings();
    settings.failures.drain = true;
    let runtime = Runtime::builder(settings.valid())
        .handler(RefuseLarge)
        .start()
        .await
        .unwrap();
    let refused: Vec<Message<Counted>> = (100..103).map(|key| Message::new(Counted { key })).collect();
    for message in &refused {
        runtime.publisher().publish(&env.queue, message).await.unwrap();
    }
    runtime
        .publisher()
        .publish(&env.queue, &Message::new(Counted { key: 1 }))
        .await
        .unwrap();
    let unknown = Uuid::now_v7();
    let unknown_properties = BasicProperties::default()
        .with_message_id(unknown.to_string().into())
        .with_type("NobodyHandlesThis".into())
        .with_content_type("application/json".into());
    env.publish_raw(unknown_properties, b"{}").await;
    let error_queue = rabbit_inbox::tools::error_queue(&env.queue);
    let skipped_queue = rabbit_inbox::tools::skipped_queue(&env.queue);
    wait_until("four failures in the table, none left in the queues", || async {
        env.scalar("SELECT count(*) FROM inbox_failures").await == 4
            && env.ready(&error_queue).await == 0
            && env.ready(&skipped_queue).await == 0
    })
    .await;

    let db = env.db().await;
    let rows = db
        .query(
            "SELECT message_id, kind, status, reason, handler, attempts, fingerprint, queue, set_aside_in, times_failed
             FROM inbox_failures WHERE kind = 'error' ORDER BY reason",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(rows.len(), 3);
    let fingerprints: std::collections::HashSet<String> = rows.iter().map(|r| r.get(6)).collect();
    assert_eq!(fingerprints.len(), 1, "the same cause groups the three");
    for (row, message) in rows.iter().zip(&refused) {
        let id: Uuid = row.get(0);
        assert_eq!(id, message.id);
        assert_eq!(row.get::<_, &str>(2), "open");
        assert_eq!(
            row.get::<_, String>(3),
            format!("key {} is refused", message.event.key)
        );
        assert_eq!(row.get::<_, &str>(4), "RefuseLarge");
        assert_eq!(row.get::<_, &str>(7), env.queue);
        assert_eq!(row.get::<_, &str>(8), error_queue);
        assert_eq!(row.get::<_, i32>(9), 1);
    }
    assert_eq!(
        env.scalar(
            "SELECT count(*) FROM inbox_failures
             WHERE kind = 'error' AND attempts = (headers->>'x-inbox-attempts')::int"
        )
        .await,
        3,
        "the attempts its failure headers say"
    );
    let skipped = db
        .query_one(
            "SELECT message_id, message_type, body FROM inbox_failures WHERE kind = 'skipped'",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(skipped.get::<_, Uuid>(0), unknown);
    assert_eq!(skipped.get::<_, &str>(1), "NobodyHandlesThis");
    assert_eq!(skipped.get::<_, Vec<u8>>(2), b"{}");

    // The same copy again (a crash between a row's commit and the copy's
    // ack hands it out again): the same row, nothing counted twice.
    let (properties, body): (serde_json::Value, Vec<u8>) = {
        let row = db
            .query_one(
                "SELECT headers::text, body FROM inbox_failures WHERE message_id = $1",
                &[&refused[0].id],
            )
            .await
            .unwrap();
        (serde_json::from_str(row.get(0)).unwrap(), row.get(1))
    };
    let mut headers = rabbit_inbox::tools::lapin::types::FieldTable::default();
    for (key, value) in properties.as_object().unwrap() {
        let value = match value {
            serde_json::Value::String(text) => {
                rabbit_inbox::tools::lapin::types::AMQPValue::LongString(text.as_str().into())
            }
            other => {
                rabbit_inbox::tools::lapin::types::AMQPValue::LongLongInt(other.as_i64().unwrap_or_default())
            }
        };
        headers.insert(key.as_str().into(), value);
    }
    let again = BasicProperties::default()
        .with_message_id(refused[0].id.to_string().into())
        .with_type("Counted".into())
        .with_headers(headers);
    publish_to("", &error_queue, again, &body).await;
    wait_until("the copy is drained again", || async {
        env.ready(&error_queue).await == 0
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_failures").await, 4);
    assert_eq!(
        env.scalar("SELECT sum(times_failed)::bigint FROM inbox_failures")
            .await,
        4,
        "the same copy counts once"
    );
    assert_eq!(env.count("counts", 1).await, 1);
}
