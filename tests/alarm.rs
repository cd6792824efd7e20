//! A broker resource alarm, in a test binary of its own: an alarm blocks
//! every publishing connection of the broker, and cargo runs test binaries
//! one after the other, so no other test sees it.

#[path = "it/support.rs"]
#[allow(dead_code)]
mod support;

use std::time::Duration;

use inbox::Message;
use inbox_actors::Runtime;
use support::{Count, Counted, TestEnv, Valid, amqp, wait_until};

/// Raises a memory alarm on the broker's node; clears it when dropped,
/// pass or fail.
struct MemoryAlarm;

impl MemoryAlarm {
    fn raise() -> Self {
        alarm("set_alarm({{resource_limit, memory, node()}, []})");
        Self
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        alarm("clear_alarm({resource_limit, memory, node()})");
    }
}

fn alarm(call: &str) {
    let output = std::process::Command::new("rabbitmqctl")
        .args(["eval", &format!("rabbit_alarm:{call}.")])
        .output()
        .expect("rabbitmqctl runs");
    assert!(output.status.success(), "rabbitmqctl eval: {output:?}");
}

#[actix_rt::test]
async fn while_the_broker_blocks_publishing_the_outbox_waits_and_sends_each_row_once() {
    let mut env = TestEnv::new("alarm").await;
    let forward = env.another_queue("forward");
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    inbox::internal::amqp::declare_queue(&channel, &forward, inbox::QueueKind::Quorum)
        .await
        .unwrap();
    connection.close(200, "declared".into()).await.unwrap();
    let mut settings = env.settings();
    settings.message_bus.confirm_timeout = Duration::from_secs(1);
    settings.outbox.poll_interval = Duration::from_millis(200);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();

    let alarm = MemoryAlarm::raise();
    let mut uow = runtime.unit_of_work().await.unwrap();
    for key in 0..20 {
        uow.publish(&forward, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    uow.commit().await.unwrap();
    // Many polls and confirm timeouts: before, each queued another copy of
    // every row in the client, all sent once the alarm lifted.
    tokio::time::sleep(Duration::from_secs(6)).await;
    assert_eq!(env.ready(&forward).await, 0, "nothing passes an alarm");
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox_messages WHERE attempts > 0")
            .await,
        0
    );
    drop(alarm);

    wait_until("the rows arrive once the alarm lifts", || async {
        env.ready(&forward).await >= 20 && env.scalar("SELECT count(*) FROM outbox_messages").await == 0
    })
    .await;
    // Room for any copy still on its way.
    tokio::time::sleep(Duration::from_secs(2)).await;
    runtime.shutdown().await;
    assert_eq!(env.ready(&forward).await, 20, "each row once");
}
