use super::{Claim, InboxKey, InboxStore};
use crate::error::Result;
use crate::unit_of_work::UnitOfWork;

/// Records processed messages in `inbox_messages`, inside the message's own
/// transaction.
///
/// [`try_begin`](InboxStore::try_begin) claims with one
/// `INSERT .. ON CONFLICT DO NOTHING`: a committed duplicate inserts nothing
/// (skip), a duplicate in flight in another transaction makes it wait for
/// that one's outcome (bounded by `database.lock_timeout`), and the row it
/// inserts commits with the handlers' writes.
#[derive(Debug, Clone, Copy, Default)]
pub struct PgInboxStore;

const CLAIM: &str = "INSERT INTO inbox_messages (consumer, message_id, event_type, processed_at) \
                     VALUES ($1, $2, $3, now()) ON CONFLICT DO NOTHING";

impl InboxStore for PgInboxStore {
    async fn already_processed(&self, uow: &mut UnitOfWork, key: &InboxKey) -> Result<bool> {
        let client = uow.client();
        let statement = client
            .prepare_cached(
                "SELECT EXISTS (SELECT 1 FROM inbox_messages WHERE consumer = $1 AND message_id = $2)",
            )
            .await?;
        let row = client
            .query_one(&statement, &[&key.consumer, &key.message_id])
            .await?;
        Ok(row.try_get(0)?)
    }

    async fn mark_processed(&self, uow: &mut UnitOfWork, key: &InboxKey) -> Result<()> {
        claim(uow, key).await?;
        Ok(())
    }

    async fn try_begin(&self, uow: &mut UnitOfWork, key: &InboxKey) -> Result<Claim> {
        if claim(uow, key).await? {
            uow.claimed = true;
            Ok(Claim::Proceed)
        } else {
            Ok(Claim::Duplicate)
        }
    }
}

/// Inserts the row; `false` when it existed (committed by someone else).
async fn claim(uow: &mut UnitOfWork, key: &InboxKey) -> Result<bool> {
    let client = uow.client();
    let statement = client.prepare_cached(CLAIM).await?;
    let inserted = client
        .execute(&statement, &[&key.consumer, &key.message_id, &key.event_type])
        .await?;
    Ok(inserted == 1)
}
