//! Counters of what the runtime did with each message, for progress logs and
//! whatever metrics a service keeps.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters, shared by the runtime's actors.
#[derive(Debug, Default)]
pub struct Stats {
    completed: AtomicU64,
    duplicates: AtomicU64,
    abandoned: AtomicU64,
    rejected: AtomicU64,
    skipped: AtomicU64,
    unconfirmed_acks: AtomicU64,
}

/// A reading of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Handlers ran and their writes committed with the inbox row.
    pub completed: u64,
    /// Already processed: skipped without running handlers.
    pub duplicates: u64,
    /// Handlers failed or panicked, or the database did: rolled back and
    /// handed back for redelivery.
    pub abandoned: u64,
    /// Malformed (bad properties or a body that is not the event): set aside.
    pub rejected: u64,
    /// No handler registered for the type: set aside.
    pub skipped: u64,
    /// Acks or nacks the broker could not take because the channel had been
    /// recovered; those messages come back and the inbox skips them.
    pub unconfirmed_acks: u64,
}

/// One of the counters.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Completed,
    Duplicates,
    Abandoned,
    Rejected,
    Skipped,
    UnconfirmedAcks,
}

impl Stats {
    pub(crate) fn add(&self, counter: Counter) {
        let cell = match counter {
            Counter::Completed => &self.completed,
            Counter::Duplicates => &self.duplicates,
            Counter::Abandoned => &self.abandoned,
            Counter::Rejected => &self.rejected,
            Counter::Skipped => &self.skipped,
            Counter::UnconfirmedAcks => &self.unconfirmed_acks,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let read = |cell: &AtomicU64| cell.load(Ordering::Relaxed);
        StatsSnapshot {
            completed: read(&self.completed),
            duplicates: read(&self.duplicates),
            abandoned: read(&self.abandoned),
            rejected: read(&self.rejected),
            skipped: read(&self.skipped),
            unconfirmed_acks: read(&self.unconfirmed_acks),
        }
    }
}
