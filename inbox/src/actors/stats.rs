//! Counters of what the runtime did with each message and each retention
//! sweep, for progress logs and whatever metrics a service keeps.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use crate::actors::tally::Tally;

/// Latency buckets: four per power of two of microseconds, up to about
/// 2^40 µs (12 days).
const LATENCY_BUCKETS: usize = 4 * 40;

/// Live counters, shared by the runtime's actors.
#[derive(Debug)]
pub struct Stats {
    completed: AtomicU64,
    duplicates: AtomicU64,
    abandoned: AtomicU64,
    retried: AtomicU64,
    rejected: AtomicU64,
    skipped: AtomicU64,
    delayed: AtomicU64,
    dead_lettered: AtomicU64,
    unconfirmed_acks: AtomicU64,
    held: AtomicU64,
    moves_handed_back: AtomicU64,
    batches: AtomicU64,
    batches_split: AtomicU64,
    sweeps: AtomicU64,
    sweeps_skipped: AtomicU64,
    swept_rows: AtomicU64,
    longest_sweep_batch_micros: AtomicU64,
    outbox_dispatched: AtomicU64,
    outbox_failed: AtomicU64,
    outbox_dead: AtomicU64,
    outbox_pending: AtomicU64,
    outbox_oldest_pending_millis: AtomicU64,
    latency: [AtomicU64; LATENCY_BUCKETS],
}

/// A reading of [`Stats`]; serializes as a flat object of counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
#[non_exhaustive]
pub struct StatsSnapshot {
    /// Handlers ran and their writes committed with the inbox row.
    pub completed: u64,
    /// Already processed: skipped without running handlers.
    pub duplicates: u64,
    /// Attempts that failed (a handler failed or panicked, or the database
    /// did) and were rolled back; each is retried, delayed or dead-lettered.
    pub abandoned: u64,
    /// Failed attempts run again at once (immediate retries, after their
    /// short pause).
    pub retried: u64,
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
    /// Times a message was held while the database was unavailable (each
    /// costs none of its attempts).
    pub held: u64,
    /// Moves (to a retry tier, `Q.error` or `Q.skipped`) whose copy the
    /// broker did not confirm: the message went back to its queue instead.
    pub moves_handed_back: u64,
    /// Batches processed (consumers with `batch_size` above 1).
    pub batches: u64,
    /// Batches whose handlers failed on the batch as a whole, which then ran
    /// again one message at a time.
    pub batches_split: u64,
    /// Retention sweeps this instance ran.
    pub sweeps: u64,
    /// Retention rounds skipped because another instance was sweeping.
    pub sweeps_skipped: u64,
    /// Inbox rows the sweeps deleted.
    pub swept_rows: u64,
    /// The slowest delete batch of any sweep, in microseconds.
    pub longest_sweep_batch_micros: u64,
    /// Staged messages the outbox published, confirmed and deleted.
    pub outbox_dispatched: u64,
    /// Publishes of staged messages that failed (each is tried again later).
    pub outbox_failed: u64,
    /// Staged messages parked as dead after their last attempt.
    pub outbox_dead: u64,
    /// Staged messages waiting to be dispatched (dead ones aside), sampled
    /// every `outbox.poll_interval`.
    pub outbox_pending: u64,
    /// How long the oldest of them had waited when sampled, in milliseconds
    /// (0 when none waits).
    pub outbox_oldest_pending_millis: u64,
}

impl Default for Stats {
    fn default() -> Self {
        Self {
            completed: AtomicU64::new(0),
            duplicates: AtomicU64::new(0),
            abandoned: AtomicU64::new(0),
            retried: AtomicU64::new(0),
            rejected: AtomicU64::new(0),
            skipped: AtomicU64::new(0),
            delayed: AtomicU64::new(0),
            dead_lettered: AtomicU64::new(0),
            unconfirmed_acks: AtomicU64::new(0),
            held: AtomicU64::new(0),
            moves_handed_back: AtomicU64::new(0),
            batches: AtomicU64::new(0),
            batches_split: AtomicU64::new(0),
            sweeps: AtomicU64::new(0),
            sweeps_skipped: AtomicU64::new(0),
            swept_rows: AtomicU64::new(0),
            longest_sweep_batch_micros: AtomicU64::new(0),
            outbox_dispatched: AtomicU64::new(0),
            outbox_failed: AtomicU64::new(0),
            outbox_dead: AtomicU64::new(0),
            outbox_pending: AtomicU64::new(0),
            outbox_oldest_pending_millis: AtomicU64::new(0),
            latency: std::array::from_fn(|_| AtomicU64::new(0)),
        }
    }
}

impl Stats {
    /// Records how long a delivery took from its arrival to its ack.
    pub(crate) fn record_latency(&self, latency: Duration) {
        let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
        self.latency[latency_bucket(micros)].fetch_add(1, Ordering::Relaxed);
    }

    /// The `quantile` (0.5 for the median, 0.99…) of the time from a
    /// delivery's arrival to its ack, over every message acked so far; within
    /// about 19% (the bucket's upper bound). `None` before the first ack.
    pub fn latency_quantile(&self, quantile: f64) -> Option<Duration> {
        let counts: Vec<u64> = self.latency.iter().map(|b| b.load(Ordering::Relaxed)).collect();
        let total: u64 = counts.iter().sum();
        if total == 0 {
            return None;
        }
        let rank = ((quantile.clamp(0.0, 1.0) * total as f64).ceil() as u64).max(1);
        let mut seen = 0;
        for (bucket, count) in counts.iter().enumerate() {
            seen += count;
            if seen >= rank {
                return Some(Duration::from_micros(bucket_upper_bound(bucket)));
            }
        }
        Some(Duration::from_micros(bucket_upper_bound(LATENCY_BUCKETS - 1)))
    }

    pub(crate) fn add(&self, tally: Tally) {
        let cell = match tally {
            Tally::Completed => &self.completed,
            Tally::Duplicates => &self.duplicates,
            Tally::Abandoned => &self.abandoned,
            Tally::Retried => &self.retried,
            Tally::Rejected => &self.rejected,
            Tally::Skipped => &self.skipped,
            Tally::Delayed => &self.delayed,
            Tally::DeadLettered => &self.dead_lettered,
            Tally::UnconfirmedAcks => &self.unconfirmed_acks,
            Tally::Held => &self.held,
            Tally::MovesHandedBack => &self.moves_handed_back,
            Tally::Batches => &self.batches,
            Tally::BatchesSplit => &self.batches_split,
        };
        cell.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn record_sweep(&self, report: &crate::retention::SweepReport) {
        if !report.swept {
            self.sweeps_skipped.fetch_add(1, Ordering::Relaxed);
            return;
        }
        self.sweeps.fetch_add(1, Ordering::Relaxed);
        self.swept_rows.fetch_add(report.rows, Ordering::Relaxed);
        crate::actors::metrics::swept(report.rows);
        crate::actors::metrics::inbox_rows(report.inbox_rows, report.oldest_inbox_row);
        let micros = u64::try_from(report.longest_batch.as_micros()).unwrap_or(u64::MAX);
        self.longest_sweep_batch_micros
            .fetch_max(micros, Ordering::Relaxed);
    }

    pub(crate) fn record_dispatch(&self, report: &crate::outbox::DispatchReport) {
        let count = |n: usize| u64::try_from(n).unwrap_or(u64::MAX);
        self.outbox_dispatched
            .fetch_add(count(report.dispatched), Ordering::Relaxed);
        crate::actors::metrics::outbox_dispatched(report.dispatched);
        self.outbox_failed
            .fetch_add(count(report.failed + report.dead), Ordering::Relaxed);
        self.outbox_dead.fetch_add(count(report.dead), Ordering::Relaxed);
    }

    pub(crate) fn record_backlog(&self, backlog: &crate::outbox::Backlog) {
        crate::actors::metrics::outbox_backlog(backlog);
        self.outbox_pending.store(backlog.pending, Ordering::Relaxed);
        let oldest = backlog
            .oldest_pending
            .map_or(0, |age| u64::try_from(age.as_millis()).unwrap_or(u64::MAX));
        self.outbox_oldest_pending_millis.store(oldest, Ordering::Relaxed);
    }

    /// The counters now.
    pub fn snapshot(&self) -> StatsSnapshot {
        let read = |cell: &AtomicU64| cell.load(Ordering::Relaxed);
        StatsSnapshot {
            completed: read(&self.completed),
            duplicates: read(&self.duplicates),
            abandoned: read(&self.abandoned),
            retried: read(&self.retried),
            rejected: read(&self.rejected),
            skipped: read(&self.skipped),
            delayed: read(&self.delayed),
            dead_lettered: read(&self.dead_lettered),
            unconfirmed_acks: read(&self.unconfirmed_acks),
            held: read(&self.held),
            moves_handed_back: read(&self.moves_handed_back),
            batches: read(&self.batches),
            batches_split: read(&self.batches_split),
            sweeps: read(&self.sweeps),
            sweeps_skipped: read(&self.sweeps_skipped),
            swept_rows: read(&self.swept_rows),
            longest_sweep_batch_micros: read(&self.longest_sweep_batch_micros),
            outbox_dispatched: read(&self.outbox_dispatched),
            outbox_failed: read(&self.outbox_failed),
            outbox_dead: read(&self.outbox_dead),
            outbox_pending: read(&self.outbox_pending),
            outbox_oldest_pending_millis: read(&self.outbox_oldest_pending_millis),
        }
    }
}

/// What [`Stats::latency_quantile`] reports for a quantile that falls on
/// `latency`: the upper bound of its bucket (at most a quarter above it).
/// Latencies measured outside the runtime go through this to be compared
/// with the runtime's on the same scale.
pub fn latency_bound(latency: Duration) -> Duration {
    let micros = u64::try_from(latency.as_micros()).unwrap_or(u64::MAX);
    Duration::from_micros(bucket_upper_bound(latency_bucket(micros)))
}

/// Values 0 to 3 µs have a bucket each; above, each power of two is split in
/// four by the two bits after the leading one.
fn latency_bucket(micros: u64) -> usize {
    if micros < 4 {
        return micros as usize;
    }
    let exponent = 63 - micros.leading_zeros() as usize; // floor(log2), at least 2
    let quarter = ((micros >> (exponent - 2)) & 3) as usize;
    (4 * (exponent - 1) + quarter).min(LATENCY_BUCKETS - 1)
}

fn bucket_upper_bound(bucket: usize) -> u64 {
    if bucket < 4 {
        return bucket as u64 + 1;
    }
    let exponent = bucket / 4 + 1;
    let quarter = (bucket % 4) as u64;
    (4 + quarter + 1) << (exponent - 2)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_latency_falls_in_a_bucket_whose_bound_is_at_most_a_quarter_above_it() {
        for micros in (0..5000).chain([65_535, 1 << 20, 123_456_789]) {
            let upper = bucket_upper_bound(latency_bucket(micros));
            assert!(upper > micros, "{micros} µs: bound {upper}");
            assert!(
                upper as f64 <= (micros as f64 * 1.25).max(micros as f64 + 1.0),
                "{micros} µs: bound {upper}"
            );
        }
    }

    #[test]
    fn quantiles_read_from_the_buckets() {
        let stats = Stats::default();
        assert_eq!(stats.latency_quantile(0.5), None);
        for ms in 1..=100 {
            stats.record_latency(Duration::from_millis(ms));
        }
        let p50 = stats.latency_quantile(0.5).unwrap();
        let p99 = stats.latency_quantile(0.99).unwrap();
        assert!(
            p50 >= Duration::from_millis(50) && p50 <= Duration::from_micros(62_500),
            "{p50:?}"
        );
        assert!(
            p99 >= Duration::from_millis(99) && p99 <= Duration::from_micros(123_750),
            "{p99:?}"
        );
        // A latency measured elsewhere maps to what these quantiles report.
        assert_eq!(latency_bound(Duration::from_millis(50)), p50);
        assert_eq!(latency_bound(Duration::from_millis(99)), p99);
    }
}
