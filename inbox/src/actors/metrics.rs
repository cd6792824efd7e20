//! The runtime's metrics, through the [`metrics`] facade: the runtime
//! records, the service installs the recorder it likes (Prometheus in the
//! examples) before it builds the runtime. Without one, recording costs
//! next to nothing.
//!
//! Names and labels follow Prometheus' conventions and are kept as they
//! are: dashboards and alerts rely on them. docs/operations.md lists them.
//!
//! Handles are registered once (per queue, per event type) and then
//! updated with an atomic operation: no label is built per message.

use std::time::Duration;

use metrics::{
    Counter, Gauge, Histogram, Unit, counter, describe_counter, describe_gauge, describe_histogram, gauge,
    histogram,
};

use crate::actors::tally::Tally;

/// Messages settled, by `queue` and `outcome`.
pub const MESSAGES_TOTAL: &str = "inbox_messages_total";
/// From a delivery's arrival to its ack, by `queue`, for deliveries acked
/// after processing (completed or duplicate; moved ones are counted in
/// `inbox_messages_total`).
pub const PROCESS_DURATION: &str = "inbox_process_duration_seconds";
/// The handlers of one message (or batch), by `event_type`.
pub const HANDLER_DURATION: &str = "inbox_handler_duration_seconds";
/// How long the inbox claim took, by `queue`: the wait on a concurrent
/// copy's lock, when another instance holds the same message.
pub const CLAIM_WAIT: &str = "inbox_claim_wait_seconds";
/// Deliveries being processed, by `queue`.
pub const IN_FLIGHT: &str = "inbox_in_flight";
/// Whether the queue's consumer is connected (1) or not (0), by `queue`.
pub const CONSUMER_CONNECTED: &str = "inbox_consumer_connected";
/// Whether the database answers (1) or is away (0).
pub const DATABASE_AVAILABLE: &str = "inbox_database_available";
/// The connections the runtime may hold at once: `database.pool_size`,
/// less while the server refuses more (53300).
pub const DATABASE_CONNECTION_LIMIT: &str = "inbox_database_connection_limit";
/// Copies set aside that the failures drainer wrote into `inbox_failures`,
/// by `queue` and `kind` (error, skipped).
pub const FAILURES_INGESTED_TOTAL: &str = "inbox_failures_ingested_total";
/// Redriven messages that came back to their failure row, failed again,
/// by `queue`.
pub const FAILURES_FAILED_AGAIN_TOTAL: &str = "inbox_failures_failed_again_total";
/// Failures a redrive staged through the outbox, by `queue`.
pub const FAILURES_REDRIVEN_TOTAL: &str = "inbox_failures_redriven_total";
/// Open failures, by `queue` and `kind` (error, skipped, dead_outbox),
/// sampled by the operator actor.
pub const FAILURES_OPEN: &str = "inbox_failures_open";
/// How long ago the oldest open failure last failed.
pub const FAILURES_OLDEST_OPEN: &str = "inbox_failures_oldest_open_seconds";
/// Operator actions, by `action` and `outcome` (done, refused, forbidden).
pub const OPERATOR_ACTIONS_TOTAL: &str = "inbox_operator_actions_total";
/// Redrive jobs running (not paused, not finished).
pub const OPERATOR_JOBS_RUNNING: &str = "inbox_operator_jobs_running";
/// Outbox rows waiting to be dispatched.
pub const OUTBOX_PENDING: &str = "inbox_outbox_pending";
/// How long the oldest of them has waited.
pub const OUTBOX_OLDEST_PENDING: &str = "inbox_outbox_oldest_pending_seconds";
/// Outbox rows published, confirmed and deleted.
pub const OUTBOX_DISPATCHED_TOTAL: &str = "inbox_outbox_dispatched_total";
/// Outbox rows parked as dead.
pub const OUTBOX_DEAD: &str = "inbox_outbox_dead";
/// Rows of `inbox_messages`, sampled by the sweeper at each sweep (the
/// table statistics' estimate once analyzed).
pub const INBOX_ROWS: &str = "inbox_rows";
/// The age of the oldest of them, sampled likewise.
pub const OLDEST_ROW: &str = "inbox_oldest_row_seconds";
/// Inbox rows the retention sweeps deleted.
pub const SWEPT_ROWS_TOTAL: &str = "inbox_swept_rows_total";

/// Describes every metric to the installed recorder (Prometheus' `# HELP`
/// lines), once per runtime built.
pub(crate) fn describe() {
    describe_counter!(
        MESSAGES_TOTAL,
        "Messages settled, by queue and outcome (completed, duplicate, rejected, skipped, retried, delayed, dead_lettered)."
    );
    describe_histogram!(
        PROCESS_DURATION,
        Unit::Seconds,
        "From a delivery's arrival to its ack, completed or duplicate."
    );
    describe_histogram!(
        HANDLER_DURATION,
        Unit::Seconds,
        "The handlers of one message or batch, by event type."
    );
    describe_histogram!(
        CLAIM_WAIT,
        Unit::Seconds,
        "The inbox claim: the wait on a concurrent copy's row lock, round trip included."
    );
    describe_gauge!(IN_FLIGHT, "Deliveries being processed.");
    describe_gauge!(
        CONSUMER_CONNECTED,
        "Whether the queue's consumer is connected (1) or not (0)."
    );
    describe_gauge!(
        DATABASE_AVAILABLE,
        "Whether the database answers (1) or is away (0)."
    );
    describe_gauge!(
        DATABASE_CONNECTION_LIMIT,
        "The database connections the runtime may hold at once: database.pool_size, or fewer while the server refuses more (53300)."
    );
    describe_counter!(
        FAILURES_INGESTED_TOTAL,
        "Copies set aside that the failures drainer wrote into inbox_failures, by queue and kind."
    );
    describe_counter!(
        FAILURES_FAILED_AGAIN_TOTAL,
        "Redriven messages set aside again, by queue."
    );
    describe_counter!(
        FAILURES_REDRIVEN_TOTAL,
        "Failures a redrive staged through the outbox, by queue."
    );
    describe_gauge!(
        FAILURES_OPEN,
        "Open failures in inbox_failures, by queue and kind (error, skipped, dead_outbox)."
    );
    describe_gauge!(
        FAILURES_OLDEST_OPEN,
        Unit::Seconds,
        "How long ago the oldest open failure last failed."
    );
    describe_counter!(
        OPERATOR_ACTIONS_TOTAL,
        "Operator actions, by action and outcome (done, refused, forbidden)."
    );
    describe_gauge!(OPERATOR_JOBS_RUNNING, "Redrive jobs running.");
    describe_gauge!(
        OUTBOX_PENDING,
        "Outbox rows waiting to be dispatched, sampled every outbox.poll_interval."
    );
    describe_gauge!(
        OUTBOX_OLDEST_PENDING,
        Unit::Seconds,
        "How long the oldest pending outbox row has waited."
    );
    describe_counter!(
        OUTBOX_DISPATCHED_TOTAL,
        "Outbox rows published, confirmed and deleted."
    );
    describe_gauge!(
        OUTBOX_DEAD,
        "Outbox rows parked as dead after their last attempt."
    );
    describe_gauge!(
        INBOX_ROWS,
        "Rows of inbox_messages, sampled by the single sweeper at each sweep (PostgreSQL's estimate once the table has been analyzed)."
    );
    describe_gauge!(
        OLDEST_ROW,
        Unit::Seconds,
        "The age of the oldest inbox row, sampled at each sweep."
    );
    describe_counter!(SWEPT_ROWS_TOTAL, "Inbox rows the retention sweeps deleted.");
}

/// One queue's handles.
#[derive(Debug)]
pub(crate) struct QueueMetrics {
    completed: Counter,
    duplicate: Counter,
    rejected: Counter,
    skipped: Counter,
    retried: Counter,
    delayed: Counter,
    dead_lettered: Counter,
    process_duration: Histogram,
    pub(crate) in_flight: Gauge,
    pub(crate) connected: Gauge,
}

impl QueueMetrics {
    pub(crate) fn new(queue: &str) -> Self {
        let outcome = |outcome: &'static str| counter!(MESSAGES_TOTAL, "queue" => queue.to_owned(), "outcome" => outcome);
        Self {
            completed: outcome("completed"),
            duplicate: outcome("duplicate"),
            rejected: outcome("rejected"),
            skipped: outcome("skipped"),
            retried: outcome("retried"),
            delayed: outcome("delayed"),
            dead_lettered: outcome("dead_lettered"),
            process_duration: histogram!(PROCESS_DURATION, "queue" => queue.to_owned()),
            in_flight: gauge!(IN_FLIGHT, "queue" => queue.to_owned()),
            connected: gauge!(CONSUMER_CONNECTED, "queue" => queue.to_owned()),
        }
    }

    /// Counts what the stats count under `outcome`, if it is one of the
    /// outcomes this metric knows.
    pub(crate) fn outcome(&self, outcome: Tally) {
        let counter = match outcome {
            Tally::Completed => &self.completed,
            Tally::Duplicates => &self.duplicate,
            Tally::Rejected => &self.rejected,
            Tally::Skipped => &self.skipped,
            Tally::Retried => &self.retried,
            Tally::Delayed => &self.delayed,
            Tally::DeadLettered => &self.dead_lettered,
            _ => return,
        };
        counter.increment(1);
    }

    pub(crate) fn processed_in(&self, duration: Duration) {
        self.process_duration.record(duration.as_secs_f64());
    }
}

/// The claim's duration histogram of `queue`.
pub(crate) fn claim_wait(queue: &str) -> Histogram {
    histogram!(CLAIM_WAIT, "queue" => queue.to_owned())
}

/// The handler duration histogram of `event_type`.
pub(crate) fn handler_duration(event_type: &'static str) -> Histogram {
    histogram!(HANDLER_DURATION, "event_type" => event_type)
}

pub(crate) fn database_available(available: bool) {
    gauge!(DATABASE_AVAILABLE).set(if available { 1.0 } else { 0.0 });
}

pub(crate) fn database_connection_limit(limit: usize) {
    gauge!(DATABASE_CONNECTION_LIMIT).set(limit as f64);
}

pub(crate) fn failure_ingested(queue: &str, kind: crate::failures::Kind) {
    counter!(FAILURES_INGESTED_TOTAL, "queue" => queue.to_owned(), "kind" => kind.as_str()).increment(1);
}

pub(crate) fn failure_failed_again(queue: &str) {
    counter!(FAILURES_FAILED_AGAIN_TOTAL, "queue" => queue.to_owned()).increment(1);
}

pub(crate) fn failure_redriven(queue: &str) {
    counter!(FAILURES_REDRIVEN_TOTAL, "queue" => queue.to_owned()).increment(1);
}

pub(crate) fn operator_action(action: &str, outcome: &'static str) {
    counter!(OPERATOR_ACTIONS_TOTAL, "action" => action.to_owned(), "outcome" => outcome).increment(1);
}

/// The operator plane's sample: open failures by queue and kind, the age
/// of the oldest, and the jobs running.
pub(crate) fn failures_sampled(open: &[(String, String, i64)], oldest_open: Option<f64>, jobs_running: i64) {
    for (queue, kind, count) in open {
        gauge!(FAILURES_OPEN, "queue" => queue.clone(), "kind" => kind.clone()).set(*count as f64);
    }
    gauge!(FAILURES_OLDEST_OPEN).set(oldest_open.unwrap_or(0.0));
    gauge!(OPERATOR_JOBS_RUNNING).set(jobs_running as f64);
}

pub(crate) fn outbox_dispatched(rows: usize) {
    counter!(OUTBOX_DISPATCHED_TOTAL).increment(u64::try_from(rows).unwrap_or(u64::MAX));
}

pub(crate) fn outbox_backlog(backlog: &crate::outbox::Backlog) {
    gauge!(OUTBOX_PENDING).set(backlog.pending as f64);
    gauge!(OUTBOX_OLDEST_PENDING).set(backlog.oldest_pending.map_or(0.0, |age| age.as_secs_f64()));
    gauge!(OUTBOX_DEAD).set(backlog.dead as f64);
}

pub(crate) fn swept(rows: u64) {
    counter!(SWEPT_ROWS_TOTAL).increment(rows);
}

pub(crate) fn inbox_rows(rows: u64, oldest: Option<Duration>) {
    gauge!(INBOX_ROWS).set(rows as f64);
    gauge!(OLDEST_ROW).set(oldest.map_or(0.0, |age| age.as_secs_f64()));
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use metrics::{Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit};

    /// Keeps what [`super::describe`] describes: each series' name and kind.
    #[derive(Default)]
    struct Described(Mutex<Vec<(String, &'static str)>>);

    impl Described {
        fn add(&self, name: KeyName, kind: &'static str) {
            self.0.lock().unwrap().push((name.as_str().to_owned(), kind));
        }
    }

    impl Recorder for Described {
        fn describe_counter(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key, "counter");
        }
        fn describe_gauge(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key, "gauge");
        }
        fn describe_histogram(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            self.add(key, "histogram");
        }
        fn register_counter(&self, _: &Key, _: &Metadata<'_>) -> Counter {
            Counter::noop()
        }
        fn register_gauge(&self, _: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::noop()
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }

    /// The metrics table users build dashboards from and the series the
    /// runtime describes cannot drift apart: the same names, of the same
    /// kinds.
    #[test]
    fn the_operations_metrics_table_lists_every_series_the_runtime_describes() {
        let described = Described::default();
        metrics::with_local_recorder(&described, super::describe);
        let mut described = described.0.into_inner().unwrap();
        let mut table: Vec<(String, &str)> = include_str!("../../../docs/operations.md")
            .lines()
            .filter_map(|line| {
                let mut cells = line.strip_prefix("| `inbox_")?.split(" | ");
                let name = format!("inbox_{}", cells.next()?.strip_suffix('`')?);
                let cell = cells.next()?;
                let kind = ["counter", "gauge", "histogram"]
                    .into_iter()
                    .find(|kind| *kind == cell)?;
                Some((name, kind))
            })
            .collect();
        described.sort();
        table.sort();
        assert!(described.len() >= 14, "{described:?}");
        assert_eq!(
            table, described,
            "docs/operations.md's metrics table against describe()"
        );
    }
}
