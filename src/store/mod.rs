//! Inbox stores: where processed message ids are recorded.

mod noop;
mod postgres;

use std::future::Future;

use futures_util::future::BoxFuture;
use uuid::Uuid;

use crate::error::Result;
use crate::unit_of_work::UnitOfWork;

pub use noop::NoopInboxStore;
pub use postgres::PgInboxStore;

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
/// Implement the two required methods; the three provided ones build the
/// runtime's protocol on them (`try_begin` → handlers → `complete`, or
/// `abandon`), so a hand-written store works as is. Every method runs inside
/// the message's [`UnitOfWork`]: what they write commits with the handlers'
/// writes or not at all.
pub trait InboxStore: Send + Sync + 'static {
    /// Whether `key` was processed (and committed) before.
    fn already_processed(
        &self,
        uow: &mut UnitOfWork,
        key: &InboxKey,
    ) -> impl Future<Output = Result<bool>> + Send;

    /// Records `key` as processed, in `uow`. A store whose record is unique
    /// on the key turns a concurrent duplicate into an error here (or a wait,
    /// then an error), which abandons that copy: the other one committed.
    fn mark_processed(&self, uow: &mut UnitOfWork, key: &InboxKey)
    -> impl Future<Output = Result<()>> + Send;

    /// Before the handlers: skip a duplicate, or stage the record in `uow`.
    fn try_begin(&self, uow: &mut UnitOfWork, key: &InboxKey) -> impl Future<Output = Result<Claim>> + Send {
        async move {
            if self.already_processed(uow, key).await? {
                return Ok(Claim::Duplicate);
            }
            self.mark_processed(uow, key).await?;
            uow.claimed = true;
            Ok(Claim::Proceed)
        }
    }

    /// After the handlers succeeded, before commit: persist the record unless
    /// [`try_begin`](Self::try_begin) already staged it (the
    /// write-after-handlers fallback for callers that skipped it).
    fn complete(&self, uow: &mut UnitOfWork, key: &InboxKey) -> impl Future<Output = Result<()>> + Send {
        async move {
            if !uow.claimed {
                self.mark_processed(uow, key).await?;
                uow.claimed = true;
            }
            Ok(())
        }
    }

    /// The handlers failed: discard what was staged. The rollback that
    /// follows removes the row itself.
    fn abandon(&self, uow: &mut UnitOfWork, _key: &InboxKey) -> impl Future<Output = Result<()>> + Send {
        uow.claimed = false;
        std::future::ready(Ok(()))
    }
}

/// [`InboxStore`] in a form that can be stored as `dyn`; implemented for
/// every store. The runtime holds its store as `Arc<dyn DynInboxStore>`.
pub trait DynInboxStore: Send + Sync + 'static {
    /// See [`InboxStore::try_begin`].
    fn try_begin<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<Claim>>;
    /// See [`InboxStore::complete`].
    fn complete<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>>;
    /// See [`InboxStore::abandon`].
    fn abandon<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>>;
}

impl<S: InboxStore> DynInboxStore for S {
    fn try_begin<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<Claim>> {
        Box::pin(InboxStore::try_begin(self, uow, key))
    }
    fn complete<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>> {
        Box::pin(InboxStore::complete(self, uow, key))
    }
    fn abandon<'a>(&'a self, uow: &'a mut UnitOfWork, key: &'a InboxKey) -> BoxFuture<'a, Result<()>> {
        Box::pin(InboxStore::abandon(self, uow, key))
    }
}
