//! A broker resource alarm, in a test binary of its own: an alarm blocks
//! every publishing connection of the broker, and cargo runs test binaries
//! one after the other, so no other test sees it.

#[path = "it/support.rs"]
#[allow(dead_code)]
mod support;

use std::time::Duration;

use rabbit_inbox::Message;
use rabbit_inbox::Runtime;
use support::{Count, Counted, TestEnv, Valid, amqp, rabbitmqctl, rabbitmqctl_now, wait_until};

/// Raises a memory alarm on the broker's node; clears it when lifted or
/// dropped, pass or fail.
struct MemoryAlarm;

const RAISE: &str = "rabbit_alarm:set_alarm({{resource_limit, memory, node()}, []}).";
const CLEAR: &str = "rabbit_alarm:clear_alarm({resource_limit, memory, node()}).";

impl MemoryAlarm {
    async fn raise() -> Self {
        rabbitmqctl(&["eval", RAISE]).await;
        Self
    }

    async fn lift(self) {
        rabbitmqctl(&["eval", CLEAR]).await;
        std::mem::forget(self);
    }
}

impl Drop for MemoryAlarm {
    fn drop(&mut self) {
        if let Err(failed) = rabbitmqctl_now(&["eval".to_owned(), CLEAR.to_owned()]) {
            eprintln!("the memory alarm may still be raised: {failed}");
        }
    }
}

#[actix_rt::test]
async fn while_the_broker_blocks_publishing_the_outbox_waits_and_sends_each_row_once() {
    let mut env = TestEnv::new("alarm").await;
    let forward = env.another_queue("forward");
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    rabbit_inbox::tools::declare_queue(&channel, &forward, rabbit_inbox::QueueKind::Quorum)
        .await
        .unwrap();
    connection.close(200, "declared".into()).await.unwrap();
    let mut settings = env.settings();
    settings.message_bus.confirm_timeout = Duration::from_secs(1);
    settings.outbox.poll_interval = Duration::from_millis(200);
    // The server ends a session idle in a transaction after half a second,
    // well within the alarm: no round may hold one across its publish.
    settings.database.transaction_timeout = Duration::from_millis(500);
    // All in one round: every publish is held by the alarm, and once it
    // lifts each waits for those before it.
    const ROWS: u16 = 2000;
    settings.outbox.batch_size = ROWS.into();
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();

    let alarm = MemoryAlarm::raise().await;
    let mut uow = runtime.unit_of_work().await.unwrap();
    for key in 0..ROWS {
        uow.publish(&forward, &Message::new(Counted { key: key.into() }))
            .await
            .unwrap();
    }
    uow.commit().await.unwrap();
    // Many polls and confirm timeouts: before, each queued another copy of
    // every row in the client, all sent once the alarm lifted.
    tokio::time::sleep(Duration::from_secs(4)).await;
    assert_eq!(env.ready(&forward).await, 0, "nothing passes an alarm");
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox_messages WHERE attempts > 0")
            .await,
        0
    );
    alarm.lift().await;

    wait_until("the rows arrive once the alarm lifts", || async {
        env.ready(&forward).await >= u32::from(ROWS)
            && env.scalar("SELECT count(*) FROM outbox_messages").await == 0
    })
    .await;
    // Room for any copy still on its way.
    tokio::time::sleep(Duration::from_secs(2)).await;
    runtime.shutdown().await;
    assert_eq!(env.ready(&forward).await, u32::from(ROWS), "each row once");
}
