//! The names of the queues the runtime keeps for a consumed queue `Q`:
//! `Q.retry.<n>`, `Q.error`, `Q.skipped`. Apart from the rest of `amqp`,
//! so that settings can check a name's length without the broker code.

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
