//! Counting a message's deliveries where the broker does not: on a classic
//! queue, or one another client declared (MassTransit's), no broker
//! delivery limit sets aside a message that crashes its consumer at every
//! delivery. The runtime counts the deliveries the broker marks
//! `redelivered`, in `inbox_deliveries`, and sets such a message aside
//! once it reaches `queues[].delivery_limit`.
//!
//! Only redeliveries are counted: a first delivery costs nothing, so the
//! common path pays nothing for it. The count ends when the message leaves
//! the queue (set aside, or to a retry tier): a copy that comes back (from
//! a tier, or replayed from the error queue by whatever tool) is a new
//! message to the queue, as it is to a quorum queue's own count, and starts
//! with its deliveries unspent.

use uuid::Uuid;

use crate::Error;
use crate::db::Connections;
use crate::error::Result;

/// Records one more delivery of `message_id` for `consumer`, one the
/// broker marked redelivered, and returns how many deliveries that makes,
/// the first (unmarked) one included. Committed at once, in a statement of
/// its own: a consumer that crashes while the handlers run has still
/// counted it.
pub(crate) async fn count_redelivery(
    connections: &Connections,
    consumer: &str,
    message_id: Uuid,
) -> Result<u32> {
    let client = connections.get().await.map_err(Error::client)?;
    let statement = client
        .prepare_cached(
            "INSERT INTO inbox_deliveries (consumer, message_id, deliveries) VALUES ($1, $2, 2)
             ON CONFLICT (consumer, message_id) DO UPDATE
             SET deliveries = inbox_deliveries.deliveries + 1, last_delivered_at = now()
             RETURNING deliveries",
        )
        .await
        .map_err(Error::client)?;
    let deliveries: i32 = client
        .query_one(&statement, &[&consumer, &message_id])
        .await
        .map_err(Error::client)?
        .try_get(0)
        .map_err(Error::client)?;
    Ok(u32::try_from(deliveries).unwrap_or(0))
}

/// Forgets the deliveries counted for `message_id`: it has left the queue
/// (see the module's documentation).
pub(crate) async fn forget(connections: &Connections, consumer: &str, message_id: Uuid) -> Result<()> {
    let client = connections.get().await.map_err(Error::client)?;
    let statement = client
        .prepare_cached("DELETE FROM inbox_deliveries WHERE consumer = $1 AND message_id = $2")
        .await
        .map_err(Error::client)?;
    client
        .execute(&statement, &[&consumer, &message_id])
        .await
        .map_err(Error::client)?;
    Ok(())
}
