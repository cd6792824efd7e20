//! Fault headers: a message's failure history, carried in its own AMQP
//! headers so that it survives a consumer crash, and the reason it was set
//! aside, for whoever reads `Q.error` or `Q.skipped`.

use std::time::SystemTime;

use lapin::types::{AMQPValue, FieldTable, LongString};

/// The header names.
pub mod headers {
    /// Why the message failed or was set aside: the handler's error text, the
    /// decode error, or "no handler registered".
    pub const REASON: &str = "x-inbox-reason";
    /// The handler (or runtime stage: `decode`, `inbox claim`, `commit`…)
    /// that failed.
    pub const HANDLER: &str = "x-inbox-handler";
    /// How many times its handlers have run and failed, over all deliveries.
    pub const ATTEMPTS: &str = "x-inbox-attempts";
    /// How many delayed redeliveries (retry tiers) it has been through.
    pub const REDELIVERIES: &str = "x-inbox-redeliveries";
    /// When it first failed (RFC 3339, UTC).
    pub const FIRST_FAILURE: &str = "x-inbox-first-failure";
    /// When it last failed (RFC 3339, UTC).
    pub const LAST_FAILURE: &str = "x-inbox-last-failure";
    /// The queue it was consumed from.
    pub const SOURCE_QUEUE: &str = "x-inbox-source-queue";

    /// Every header above: what a replay removes.
    pub const ALL: [&str; 7] = [
        REASON,
        HANDLER,
        ATTEMPTS,
        REDELIVERIES,
        FIRST_FAILURE,
        LAST_FAILURE,
        SOURCE_QUEUE,
    ];
}

/// What a message's headers say of its past failures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailureHistory {
    /// Failed attempts so far.
    pub attempts: u32,
    /// Delayed redeliveries so far.
    pub redeliveries: u32,
    /// When it first failed, if it has.
    pub first_failure: Option<String>,
}

impl FailureHistory {
    /// Reads the history from `headers`; absent or unreadable values read as
    /// none (a message from another publisher has no history).
    pub fn read(headers: &FieldTable) -> Self {
        let map = headers.inner();
        let number = |key: &str| map.get(key).and_then(as_u32).unwrap_or(0);
        Self {
            attempts: number(headers::ATTEMPTS),
            redeliveries: number(headers::REDELIVERIES),
            first_failure: map.get(headers::FIRST_FAILURE).and_then(as_text),
        }
    }
}

/// One failure to record on the copy of a message that moves on.
#[derive(Debug, Clone)]
pub struct Fault<'a> {
    /// Why.
    pub reason: &'a str,
    /// Which handler or stage.
    pub handler: &'a str,
    /// The history including this failure.
    pub history: FailureHistory,
    /// The queue it was consumed from.
    pub source_queue: &'a str,
}

impl Fault<'_> {
    /// Writes the fault into `headers`, keeping every other header.
    pub fn stamp(&self, headers: &mut FieldTable) {
        let now = now();
        let text = |s: &str| AMQPValue::LongString(LongString::from(s));
        headers.insert(headers::REASON.into(), text(self.reason));
        headers.insert(headers::HANDLER.into(), text(self.handler));
        headers.insert(
            headers::ATTEMPTS.into(),
            AMQPValue::LongLongInt(self.history.attempts.into()),
        );
        headers.insert(
            headers::REDELIVERIES.into(),
            AMQPValue::LongLongInt(self.history.redeliveries.into()),
        );
        let first = self.history.first_failure.as_deref().unwrap_or(&now);
        headers.insert(headers::FIRST_FAILURE.into(), text(first));
        headers.insert(headers::LAST_FAILURE.into(), text(&now));
        headers.insert(headers::SOURCE_QUEUE.into(), text(self.source_queue));
    }
}

/// The time now, as the fault headers write it.
pub fn now() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

fn as_u32(value: &AMQPValue) -> Option<u32> {
    let n: i64 = match value {
        AMQPValue::ShortShortInt(n) => (*n).into(),
        AMQPValue::ShortShortUInt(n) => (*n).into(),
        AMQPValue::ShortInt(n) => (*n).into(),
        AMQPValue::ShortUInt(n) => (*n).into(),
        AMQPValue::LongInt(n) => (*n).into(),
        AMQPValue::LongUInt(n) => (*n).into(),
        AMQPValue::LongLongInt(n) => *n,
        _ => return None,
    };
    u32::try_from(n).ok()
}

fn as_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_stamped_history_reads_back() {
        let mut headers = FieldTable::default();
        headers.insert("x-custom".into(), AMQPValue::LongInt(5));
        assert_eq!(FailureHistory::read(&headers), FailureHistory::default());
        let history = FailureHistory {
            attempts: 8,
            redeliveries: 2,
            first_failure: Some("2026-01-01T00:00:00.000Z".into()),
        };
        let fault = Fault {
            reason: "boom",
            handler: "H",
            history: history.clone(),
            source_queue: "q",
        };
        fault.stamp(&mut headers);
        assert_eq!(FailureHistory::read(&headers), history);
        assert!(headers.contains_key("x-custom"), "other headers are kept");
        assert!(headers.contains_key(headers::LAST_FAILURE));
    }
}
