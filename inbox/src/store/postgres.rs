use std::collections::HashSet;

use uuid::Uuid;

use crate::unit_of_work::UnitOfWork;

use super::{Claim, InboxKey, InboxStore, StoreResult};

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
    async fn already_processed(&self, uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<bool> {
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

    async fn mark_processed(&self, uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<()> {
        claim(uow, key).await?;
        Ok(())
    }

    async fn try_begin(&self, uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<Claim> {
        if claim(uow, key).await? {
            uow.note_recorded(key.message_id);
            Ok(Claim::Proceed)
        } else {
            Ok(Claim::Duplicate)
        }
    }

    /// The whole batch in one statement, rows inserted in key order so that
    /// two batches claiming overlapping messages wait for each other instead
    /// of deadlocking.
    async fn try_begin_batch(&self, uow: &mut UnitOfWork, keys: &[InboxKey]) -> StoreResult<Vec<Claim>> {
        let mut sorted: Vec<&InboxKey> = keys.iter().collect();
        sorted.sort_by(|a, b| (&a.consumer, a.message_id).cmp(&(&b.consumer, b.message_id)));
        let consumers: Vec<&str> = sorted.iter().map(|k| k.consumer.as_str()).collect();
        let ids: Vec<Uuid> = sorted.iter().map(|k| k.message_id).collect();
        let types: Vec<&str> = sorted.iter().map(|k| k.event_type.as_str()).collect();
        let client = uow.client();
        let statement = client.prepare_cached(CLAIM_BATCH).await?;
        let claimed: HashSet<(String, Uuid)> = client
            .query(&statement, &[&consumers, &ids, &types])
            .await?
            .iter()
            .map(|row| Ok((row.try_get(0)?, row.try_get(1)?)))
            .collect::<std::result::Result<_, tokio_postgres::Error>>()?;
        let mut claims = Vec::with_capacity(keys.len());
        for key in keys {
            if claimed.contains(&(key.consumer.clone(), key.message_id)) {
                uow.note_recorded(key.message_id);
                claims.push(Claim::Proceed);
            } else {
                claims.push(Claim::Duplicate);
            }
        }
        Ok(claims)
    }

    /// Deletes the row staged for `key`: in a batch it was written before
    /// the message's savepoint, so rolling back to that savepoint kept it.
    async fn abandon(&self, uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<()> {
        if uow.forget_recorded(key.message_id) {
            let client = uow.client();
            let statement = client
                .prepare_cached("DELETE FROM inbox_messages WHERE consumer = $1 AND message_id = $2")
                .await?;
            client
                .execute(&statement, &[&key.consumer, &key.message_id])
                .await?;
        }
        Ok(())
    }
}

const CLAIM_BATCH: &str = "INSERT INTO inbox_messages (consumer, message_id, event_type, processed_at) \
                           SELECT consumer, message_id, event_type, now() \
                           FROM unnest($1::text[], $2::uuid[], $3::text[]) AS k (consumer, message_id, event_type) \
                           ORDER BY consumer, message_id \
                           ON CONFLICT DO NOTHING RETURNING consumer, message_id";

/// Inserts the row; `false` when it existed (committed by someone else).
async fn claim(uow: &mut UnitOfWork, key: &InboxKey) -> StoreResult<bool> {
    let client = uow.client();
    let statement = client.prepare_cached(CLAIM).await?;
    let inserted = client
        .execute(&statement, &[&key.consumer, &key.message_id, &key.event_type])
        .await?;
    Ok(inserted == 1)
}
