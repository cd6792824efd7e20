//! Counters of what the runtime did with each message and each retention
//! sweep, for progress logs and whatever metrics a service keeps.

use std::sync::atomic::{AtomicU64, Ordering};

/// Live counters, shared by the runtime's actors.
#[derive(Debug, Default)]
pub struct Stats {
    completed: AtomicU64,
    duplicates: AtomicU64,
    abandoned: AtomicU64,
    rejected: AtomicU64,
    skipped: AtomicU64,
    delayed: AtomicU64,
    dead_lettered: AtomicU64,
    unconfirmed_acks: AtomicU64,
    sweeps: AtomicU64,
    sweeps_skipped: AtomicU64,
    swept_rows: AtomicU64,
    longest_sweep_batch_micros: AtomicU64,
}

/// A reading of [`Stats`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Handlers ran and their writes committed with the inbox row.
    pub completed: u64,
    /// Already processed: skipped without running handlers.
    pub duplicates: u64,
    /// Attempts that failed (a handler failed or panicked, or the database
    /// did) and were rolled back; each is retried, delayed or dead-lettered.
    pub abandoned: u64,
    /// Malformed (bad properties, a body too large or not the event): sent
    /// to the error queue without retries.
    pub rejected: u64,
    /// No handler registered for the type: sent to the skipped queue.
    pub skipped: u64,
    /// Sent to a retry tier after failing their immediate retries.
    pub delayed: u64,
    /// Sent to the error queue after failing every attempt.
    pub dead_lettered: u64,
    /// Acks or nacks the broker could not take because the channel had been
    /// recovered; those messages come back and the inbox skips them.
    pub unconfirmed_acks: u64,
    /// Retention sweeps this instance ran.
    pub sweeps: u64,
    /// Retention rounds skipped because another instance was sweeping.
    pub sweeps_skipped: u64,
    /// Inbox rows the sweeps deleted.
    pub swept_rows: u64,
    /// The slowest delete batch of any sweep, in microseconds.
    pub longest_sweep_batch_micros: u64,
}

/// One of the counters.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Counter {
    Completed,
    Duplicates,
    Abandoned,
    Rejected,
    Skipped,
    Delayed,
    DeadLettered,
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
            Counter::Delayed => &self.delayed,
            Counter::DeadLettered => &self.dead_lettered,
            Counter::UnconfirmedAcks => &self.unconfirmed_acks,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_sweep(&self, report: &inbox::SweepReport) {
        if !report.swept {
            self.sweeps_skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        self.swept_rows.fetch_add(report.rows, Ordering::Relaxed);
        let micros = u64::try_from(report.longest_batch.as_micros()).unwrap_or(u64::MAX);
        self.longest_sweep_batch_micros
            .fetch_max(micros, Ordering::Relaxed);
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
            delayed: read(&self.delayed),
            dead_lettered: read(&self.dead_lettered),
            unconfirmed_acks: read(&self.unconfirmed_acks),
            sweeps: read(&self.sweeps),
            sweeps_skipped: read(&self.sweeps_skipped),
            swept_rows: read(&self.swept_rows),
            longest_sweep_batch_micros: read(&self.longest_sweep_batch_micros),
        }
    }
}
