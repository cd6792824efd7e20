//! What the runtime sets aside stays set aside: a copy it publishes (to a
//! retry tier, the error or skipped queue, or back with a replay) carries
//! nothing of the producer's publish that makes the broker drop it (a
//! per-message TTL) or refuse it (a `user_id` not the runtime's).

use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::Wire;
use rabbit_inbox::internal::fault::headers;
use rabbit_inbox::tools::SetAside;
use rabbit_inbox::tools::lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use rabbit_inbox::tools::lapin::uri::{AMQPUri, AMQPUserInfo};
use rabbit_inbox::tools::lapin::{BasicProperties, Connection, ConnectionProperties};
use uuid::Uuid;

use crate::support::{
    Count, TestEnv, Valid, amqp, amqp_url, header, rabbitmqctl, rabbitmqctl_now, wait_until,
};

/// The TTL the producer gives its messages: short, so that a copy that kept
/// it would be gone by the time the test looks.
const TTL_MILLIS: u64 = 500;

/// A message of the check-in service's kind that is not well formed: its
/// `message_id` is no UUID.
fn malformed() -> BasicProperties {
    BasicProperties::default()
        .with_message_id("not-a-uuid".into())
        .with_type("Counted".into())
        .with_content_type("application/json".into())
}

/// A message of a type nobody handles.
fn unknown() -> BasicProperties {
    BasicProperties::default()
        .with_message_id(Uuid::now_v7().to_string().into())
        .with_type("NobodyHandlesThis".into())
        .with_content_type("application/json".into())
}

/// Waits past the producer's TTL, then takes the one message of `queue`: a
/// queue drops an expired message at the latest when it would deliver it.
async fn take_after_the_ttl(env: &TestEnv, queue: &str) -> rabbit_inbox::tools::lapin::message::Delivery {
    // A fixed wait, on purpose: what is asserted is that nothing expires.
    tokio::time::sleep(Duration::from_millis(TTL_MILLIS * 3)).await;
    env.take(queue)
        .await
        .unwrap_or_else(|| panic!("the copy in {queue} expired with its producer's TTL"))
}

#[actix_rt::test]
async fn a_copy_set_aside_outlives_its_producers_ttl_and_records_it() {
    let env = TestEnv::new("set_aside_ttl").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let ttl = TTL_MILLIS.to_string();
    env.publish_raw(malformed().with_expiration(ttl.as_str().into()), br#"{"key": 1}"#)
        .await;
    env.publish_raw(unknown().with_expiration(ttl.as_str().into()), b"{}")
        .await;
    wait_until("both are set aside", || async {
        let s = runtime.stats();
        s.rejected == 1 && s.skipped == 1
    })
    .await;
    runtime.shutdown().await;

    for queue in [
        Wire::Inbox.error_queue(&env.queue),
        Wire::Inbox.skipped_queue(&env.queue),
    ] {
        let copy = take_after_the_ttl(&env, &queue).await;
        assert_eq!(copy.properties.expiration(), &None, "{queue}");
        assert_eq!(
            header(&copy, headers::ORIGINAL_EXPIRATION),
            Some(ttl.clone()),
            "{queue}"
        );
    }
}

#[actix_rt::test]
async fn a_copy_set_aside_on_the_masstransit_wire_outlives_its_producers_ttl() {
    let env = TestEnv::new("set_aside_ttl_mt").await;
    let mut settings = env.settings();
    settings.message_bus.wire = Wire::Masstransit;
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let ttl = TTL_MILLIS.to_string();
    // Not an envelope: malformed on this wire.
    let properties = BasicProperties::default()
        .with_message_id(Uuid::now_v7().to_string().into())
        .with_content_type(rabbit_inbox::internal::masstransit::ENVELOPE_CONTENT_TYPE.into())
        .with_expiration(ttl.as_str().into());
    env.publish_raw(properties, b"not an envelope").await;
    wait_until("it is set aside", || async { runtime.stats().rejected == 1 }).await;
    runtime.shutdown().await;

    let copy = take_after_the_ttl(&env, &Wire::Masstransit.error_queue(&env.queue)).await;
    assert_eq!(copy.properties.expiration(), &None);
    assert_eq!(header(&copy, headers::ORIGINAL_EXPIRATION), Some(ttl));
}

/// A broker user of the test's own, with every permission on `/`, deleted
/// when it drops.
struct BrokerUser {
    name: String,
}

impl BrokerUser {
    const PASSWORD: &str = "inbox-test";

    async fn new(test: &str) -> Self {
        let name = format!("inbox-test-{test}-{}", Uuid::now_v7());
        rabbitmqctl(&["add_user", &name, Self::PASSWORD]).await;
        rabbitmqctl(&["set_permissions", "-p", "/", &name, ".*", ".*", ".*"]).await;
        Self { name }
    }

    /// Publishes as this user, with `user_id` saying so, as a producer that
    /// stamps its identity does.
    async fn publish(&self, routing_key: &str, properties: BasicProperties, body: &[u8]) {
        let mut uri: AMQPUri = amqp_url().parse().unwrap();
        uri.authority.userinfo = AMQPUserInfo {
            username: self.name.clone(),
            password: Self::PASSWORD.into(),
        };
        let connection = Connection::connect_uri(uri, ConnectionProperties::default())
            .await
            .expect("connect as the test's user");
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let confirm = channel
            .basic_publish(
                "".into(),
                routing_key.into(),
                BasicPublishOptions::default(),
                body,
                properties.with_user_id(self.name.as_str().into()),
            )
            .await
            .unwrap()
            .await
            .unwrap();
        assert!(confirm.is_ack(), "the broker takes the user's own user_id");
        connection.close(200, "done".into()).await.unwrap();
    }
}

impl Drop for BrokerUser {
    fn drop(&mut self) {
        let _ = rabbitmqctl_now(&["delete_user".into(), self.name.clone()]);
    }
}

#[actix_rt::test]
async fn a_message_carrying_its_producers_user_id_is_set_aside_at_once_and_replayed() {
    let env = TestEnv::new("set_aside_user_id").await;
    let alice = BrokerUser::new("alice").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    alice.publish(&env.queue, malformed(), br#"{"key": 1}"#).await;
    alice.publish(&env.queue, unknown(), b"{}").await;
    wait_until("both are set aside", || async {
        let s = runtime.stats();
        s.rejected == 1 && s.skipped == 1
    })
    .await;
    let stats = runtime.stats();
    assert_eq!(
        stats.moves_handed_back, 0,
        "every move went through the first time"
    );
    for queue in [
        Wire::Inbox.error_queue(&env.queue),
        Wire::Inbox.skipped_queue(&env.queue),
    ] {
        let copy = env.take(&queue).await.expect("the copy is set aside");
        assert_eq!(copy.properties.user_id(), &None, "{queue}");
        assert_eq!(
            header(&copy, headers::ORIGINAL_USER_ID),
            Some(alice.name.clone()),
            "{queue}"
        );
    }

    // The broker keeps `user_id` when it dead-letters (a quorum queue's
    // delivery limit): such a copy in Q.error is replayed all the same.
    let id = Uuid::now_v7();
    let good = BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_type("Counted".into())
        .with_content_type("application/json".into());
    alice
        .publish(&Wire::Inbox.error_queue(&env.queue), good, br#"{"key": 2}"#)
        .await;
    let connection = amqp().await;
    let report = rabbit_inbox::tools::replay(&connection, &env.queue, SetAside::Error, None)
        .await
        .expect("the replay publishes as itself");
    assert_eq!(report.replayed, 1);
    wait_until("the replayed one is processed", || async {
        runtime.stats().completed == 1
    })
    .await;
    runtime.shutdown().await;
    assert_eq!(env.count("counts", 2).await, 1);
}
