use crate::unit_of_work::UnitOfWork;

use super::{InboxKey, InboxStore, StoreResult};

/// Never deduplicates: every delivery, redeliveries included, reaches the
/// handlers. What `message_bus.enable_inbox = false` runs.
#[derive(Debug, Clone, Copy, Default)]
pub struct NoopInboxStore;

impl InboxStore for NoopInboxStore {
    async fn already_processed(&self, _uow: &mut UnitOfWork, _key: &InboxKey) -> StoreResult<bool> {
        Ok(false)
    }

    async fn mark_processed(&self, _uow: &mut UnitOfWork, _key: &InboxKey) -> StoreResult<()> {
        Ok(())
    }
}
