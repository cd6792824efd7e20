//! Inbox stores: where processed message ids are recorded.

mod noop;
mod postgres;

use std::future::Future;

use futures_util::future::BoxFuture;
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::unit_of_work::UnitOfWork;

pub use noop::NoopInboxStore;
pub use postgres::PgInboxStore;

/// What an [`InboxStore`]'s methods fail with: any error, boxed, so that
/// `?` takes the PostgreSQL client's as it is. The runtime reads it as a
/// failure of the inbox's database (an outage, when the connection went
/// away), never as the message's fault.
pub type StoreError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// What an [`InboxStore`]'s methods return.
pub type StoreResult<T> = std::result::Result<T, StoreError>;

/// Identifies one processed message: the dedup key `(consumer, message_id)`,
/// plus its type for the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxKey {
    /// Who processed it (the queue's consumer id). Two consumers of the same
    /// event in one database do not skip each other's work.
    pub consumer: String,
    /// The message's id.
    pub message_id: Uuid,
    /// The message's type name.
    pub event_type: String,
}

/// What [`InboxStore::try_begin`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Claim {
    /// Not processed before: run the handlers.
    Proceed,
    /// Already processed: skip the handlers and acknowledge.
    Duplicate,
}

/// Records processed messages in the consumer's own database.
///
/// Implement the two required methods; the provided ones build the
/// runtime's protocol on them, so a hand-written store works as is: one
/// message is `try_begin` → handlers → `complete` → commit (or rollback); a
/// batch is `try_begin_batch` → a savepoint → handlers on the whole batch →
/// `complete` for each, then one commit; if any of that fails, rollback to
/// the savepoint, then per message a savepoint → handlers → `complete` (or
/// rollback to the savepoint → `abandon`), then one commit. Every method
/// runs inside the message's [`UnitOfWork`]: what they write commits with
/// the handlers' writes or not at all.
pub trait InboxStore: Send + Sync + 'static {
    /// Whether `key` was processed (and committed) before.
    fn already_processed(
        &self,
        uow: &mut UnitOfWork,
        key: &InboxKey,
    ) -> impl Future<Output = StoreResult<bool>> + Send;

    /// Records `key` as processed, in `uow`. A store whose record is unique
    /// on the key turns a concurrent duplicate into an error here (or a wait,
    /// then an error), which abandons that copy: the other one committed.
    fn mark_processed(
        &self,
        uow: &mut UnitOfWork,
        key: &InboxKey,
    ) -> impl Future<Output = StoreResult<()>> + Send;

    /// Before the handlers: skip a duplicate, or stage the record in `uow`.
    fn try_begin(
        &self,
        uow: &mut UnitOfWork,
        key: &InboxKey,
    ) -> impl Future<Output = StoreResult<Claim>> + Send {
        async move {
            if self.already_processed(uow, key).await? {
                return Ok(Claim::Duplicate);
            }
            self.mark_processed(uow, key).await?;
            uow.note_recorded(key.message_id);
            Ok(Claim::Proceed)
        }
    }

    /// Before the handlers of a batch (distinct keys, one transaction): one
    /// [`Claim`] per key, in order. Whatever it stages must be undone by
    /// [`abandon`](Self::abandon) for a message that then fails alone.
    /// Default: [`already_processed`](Self::already_processed) for each key,
    /// staging nothing, so that [`complete`](Self::complete) records each
    /// message after its handlers, inside a savepoint that also undoes the
    /// record if the batch (or the message) fails.
    fn try_begin_batch(
        &self,
        uow: &mut UnitOfWork,
        keys: &[InboxKey],
    ) -> impl Future<Output = StoreResult<Vec<Claim>>> + Send {
        async move {
            let mut claims = Vec::with_capacity(keys.len());
            for key in keys {
                claims.push(match self.already_processed(uow, key).await? {
                    true => Claim::Duplicate,
                    false => Claim::Proceed,
                });
            }
            Ok(claims)
        }
    }

    /// After the handlers succeeded, before commit: persist the record unless
    /// [`try_begin`](Self::try_begin) already staged it (the
    /// write-after-handlers fallback for callers that skipped it).
    ///
    /// Its future is a few bytes when the record is staged, as it always is
    /// on the runtime's path: the write is boxed apart, so that a
    /// statement's future (over a kilobyte) is not carried, and allocated,
    /// for every message.
    fn complete(&self, uow: &mut UnitOfWork, key: &InboxKey) -> impl Future<Output = StoreResult<()>> + Send {
        use futures_util::future::Either;
        if uow.is_recorded(key.message_id) {
            return Either::Left(std::future::ready(Ok(())));
        }
        Either::Right(Box::pin(async move {
            self.mark_processed(uow, key).await?;
            uow.note_recorded(key.message_id);
            Ok(())
        }))
    }

    /// A message of a batch failed and was rolled back to its savepoint
    /// while the batch goes on: discard what was staged for `key`, or the
    /// batch's commit would record a message whose effects were undone. (A
    /// message alone in its transaction is simply rolled back whole.)
    fn abandon(&self, uow: &mut UnitOfWork, key: &InboxKey) -> impl Future<Output = StoreResult<()>> + Send {
        uow.forget_recorded(key.message_id);
        std::future::ready(Ok(()))
    }
}

/// [`InboxStore`] in a form that can be stored as `dyn`; implemented for
/// every store. The runtime holds its store as `Arc<dyn DynInboxStore>`.
pub(crate) trait DynInboxStore: Send + Sync + 'static {
    /// See [`InboxStore::try_begin`].
    fn try_begin<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<Claim>>;
    /// See [`InboxStore::try_begin_batch`].
    fn try_begin_batch<'a>(
        &'a self,
        uow: &'a mut UnitOfWork,
        keys: &'a [InboxKey],
    ) -> BoxFuture<'a, Result<Vec<Claim>>>;
    /// See [`InboxStore::complete`].
    fn complete<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>>;
    /// See [`InboxStore::abandon`].
    fn abandon<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>>;
}

impl<S: InboxStore> DynInboxStore for S {
    fn try_begin<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<Claim>> {
        Box::pin(async move { InboxStore::try_begin(self, uow, key).await.map_err(Error::store) })
    }
    fn try_begin_batch<'a>(
        &'a self,
        uow: &'a mut UnitOfWork,
        keys: &'a [InboxKey],
    ) -> BoxFuture<'a, Result<Vec<Claim>>> {
        Box::pin(async move {
            InboxStore::try_begin_batch(self, uow, keys)
                .await
                .map_err(Error::store)
        })
    }
    fn complete<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { InboxStore::complete(self, uow, key).await.map_err(Error::store) })
    }
    fn abandon<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>> {
        Box::pin(async move { InboxStore::abandon(self, uow, key).await.map_err(Error::store) })
    }
}
