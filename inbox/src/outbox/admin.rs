//! Reviving rows parked as dead, for an operator (the replay example).

use deadpool_postgres::Pool;
use uuid::Uuid;

use crate::Error;
use crate::error::Result;

use super::listen::CHANNEL;

/// Gives dead rows another chance (all of them, or those whose
/// `message_id` is in `only`): their attempts start over and they are due
/// now. Returns how many. A running dispatcher is woken.
pub async fn retry_dead(pool: &Pool, only: Option<&std::collections::HashSet<Uuid>>) -> Result<u64> {
    let ids: Option<Vec<Uuid>> = only.map(|ids| ids.iter().copied().collect());
    let connection = pool.get().await.map_err(Error::client)?;
    let revived = connection
        .execute(
            "UPDATE outbox_messages
             SET dead_at = NULL, attempts = 0, next_attempt_at = now(), last_error = NULL
             WHERE dead_at IS NOT NULL AND ($1::uuid[] IS NULL OR message_id = ANY($1))",
            &[&ids],
        )
        .await
        .map_err(Error::client)?;
    connection
        .execute("SELECT pg_notify($1, '')", &[&CHANNEL])
        .await
        .map_err(Error::client)?;
    Ok(revived)
}
