//! Acks coalesced: a delivery done before the ones ahead of it waits for
//! them, and one `multiple` ack settles the run. A `multiple` ack that
//! reached past a delivery still in flight, or an ack of a tag already
//! covered, would make the broker close the channel: the redeliveries would
//! show as duplicates and unconfirmed acks.

use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::{EventHandler, HandlerError, MessageContext, UnitOfWork};

use crate::batching::{counts, prefill_keys};
use crate::support::{Counted, TestEnv, Valid, increment, wait_until};

/// Takes a different short time per key, and long for every 50th, so that
/// messages finish out of delivery order and some runs wait past the hold.
struct OutOfOrder;

impl EventHandler<Counted> for OutOfOrder {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let pause = if event.key % 50 == 0 {
            60
        } else {
            (event.key * 7 % 5) as u64
        };
        tokio::time::sleep(Duration::from_millis(pause)).await;
        increment(uow, "counts", event.key).await
    }
}

async fn out_of_order(batch_size: u16) {
    let env = TestEnv::new(&format!("acks_out_of_order_{batch_size}")).await;
    let mut settings = env.settings();
    settings.queues[0].prefetch = 16;
    settings.queues[0].batch_size = batch_size;
    settings.queues[0].concurrent_batches = 2;
    prefill_keys(&settings, 0..300).await;
    let runtime = Runtime::builder(settings.valid())
        .handler(OutOfOrder)
        .start()
        .await
        .unwrap();
    wait_until("all 300 are acked", || async { runtime.stats().completed == 300 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!((stats.duplicates, stats.unconfirmed_acks), (0, 0), "{stats:?}");
    let counts = counts(&env, "counts").await;
    assert_eq!(counts.len(), 300);
    assert!(counts.values().all(|&n| n == 1), "{counts:?}");
    // Unacked deliveries go back to the queue when the runtime closes its
    // channel: none did.
    assert_eq!(env.ready(&env.queue).await, 0);
}

#[actix_rt::test]
async fn messages_done_out_of_order_are_each_acked_once() {
    out_of_order(1).await;
}

#[actix_rt::test]
async fn batches_done_out_of_order_are_each_acked_once() {
    out_of_order(4).await;
}
