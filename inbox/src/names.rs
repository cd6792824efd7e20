//! The names of the queues the runtime keeps for a consumed queue `Q`:
//! `Q.retry.<n>`, `Q.error`, `Q.skipped`, or with MassTransit's wire
//! `Q_retry_<n>`, `Q_error`, `Q_skipped`. Apart from the rest of `amqp`,
//! so that settings can check a name's length without the broker code.

use crate::settings::Wire;

/// The longest suffix a kept queue adds to `Q` (`.retry.` and up to nine
/// digits, or `.skipped`), for the 255-byte limit on names.
pub(crate) const LONGEST_SUFFIX: usize = 16;

/// `Q.retry.<tier>`, tiers counted from 1.
pub fn retry_queue(queue: &str, tier: usize) -> String {
    format!("{queue}.retry.{tier}")
}

/// `Q.error`.
pub fn error_queue(queue: &str) -> String {
    format!("{queue}.error")
}

/// `Q.skipped`.
pub fn skipped_queue(queue: &str) -> String {
    format!("{queue}.skipped")
}

impl Wire {
    /// The retry tier `tier` (from 1) of `queue`.
    pub fn retry_queue(self, queue: &str, tier: usize) -> String {
        match self {
            Wire::Inbox => retry_queue(queue, tier),
            Wire::Masstransit => format!("{queue}_retry_{tier}"),
        }
    }

    /// The error queue of `queue` (MassTransit's: ABS/Topology/Topology/
    /// DefaultErrorQueueNameFormatter.cs, `_error`).
    pub fn error_queue(self, queue: &str) -> String {
        match self {
            Wire::Inbox => error_queue(queue),
            Wire::Masstransit => format!("{queue}_error"),
        }
    }

    /// The skipped queue of `queue` (MassTransit's:
    /// DefaultDeadLetterQueueNameFormatter.cs, `_skipped`).
    pub fn skipped_queue(self, queue: &str) -> String {
        match self {
            Wire::Inbox => skipped_queue(queue),
            Wire::Masstransit => format!("{queue}_skipped"),
        }
    }
}
