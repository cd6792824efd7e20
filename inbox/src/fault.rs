//! Fault headers: a message's failure history, carried in its own AMQP
//! headers so that it survives a consumer crash, and the reason it was set
//! aside, for whoever reads `Q.error` or `Q.skipped`.

use std::time::SystemTime;

use lapin::BasicProperties;
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

    /// Set on a copy the runtime sets aside (in `Q.error` or `Q.skipped`),
    /// naming that queue: the failure headers beside it describe the
    /// message's past. A copy that comes back to a queue with it (moved by
    /// the management UI, a shovel, any tool but this library's replay,
    /// which removes it) starts with a fresh budget of attempts.
    pub const SET_ASIDE: &str = "x-inbox-set-aside";

    /// Every header above: what a replay removes.
    pub const ALL: [&str; 8] = [
        REASON,
        HANDLER,
        ATTEMPTS,
        REDELIVERIES,
        FIRST_FAILURE,
        LAST_FAILURE,
        SOURCE_QUEUE,
        SET_ASIDE,
    ];

    /// Set on a copy (in a retry tier, `Q.error`, `Q.skipped`) whose
    /// incoming headers were dropped because, with the fault headers, they
    /// would not fit one AMQP frame: how many, and how large. Kept by a
    /// replay: the headers are gone for good.
    pub const DROPPED_HEADERS: &str = "x-inbox-dropped-headers";

    /// The producer's per-message TTL (the `expiration` property) of a copy
    /// the runtime republished without it (`copy_properties`),
    /// as the broker keeps it in `x-death`'s `original-expiration` when it
    /// dead-letters. Kept by a replay, which does not restore it.
    pub const ORIGINAL_EXPIRATION: &str = "x-inbox-original-expiration";
    /// The producer's `user_id` property of a copy the runtime republished
    /// without it (`copy_properties`). Kept by a
    /// replay, which does not restore it.
    pub const ORIGINAL_USER_ID: &str = "x-inbox-original-user-id";

    /// The broker's count of a quorum queue's deliveries of the message. It
    /// belongs to the queue that delivered it, so a copy published
    /// elsewhere (a move, a replay) goes without it.
    pub const DELIVERY_COUNT: &str = "x-delivery-count";

    /// The headers the broker writes about a message's path through its
    /// queues: the delivery count, and the dead-lettering history. A copy
    /// the runtime publishes (a move, a replay) goes without them: they
    /// describe the original's path, the runtime counts nothing from them,
    /// and a client-set `x-death` that is not what the broker writes stalls
    /// RabbitMQ 3.x's at-least-once dead-lettering of the whole queue it
    /// sits in ("Cannot forward any dead-letter messages"; 4.x ignores a
    /// client's `x-death`).
    pub const BROKER_OWNED: [&str; 8] = [
        DELIVERY_COUNT,
        "x-death",
        "x-first-death-exchange",
        "x-first-death-queue",
        "x-first-death-reason",
        "x-last-death-exchange",
        "x-last-death-queue",
        "x-last-death-reason",
    ];
}

/// The longest `x-inbox-reason` the runtime writes, in bytes. A reason can
/// quote the message itself (serde quotes the offending string), and a
/// header frame larger than the broker's `frame_max` (128 KiB by default)
/// makes the broker close the connection: the message would never reach
/// `Q.error`.
pub const MAX_REASON_BYTES: usize = 2048;

/// The longest value of any other text header the runtime writes, in bytes.
pub(crate) const MAX_VALUE_BYTES: usize = 256;

/// What marks a value the runtime cut short.
const CUT: &str = "… [truncated]";

/// A message's failures: what its headers say of the past, and what
/// happened to it in this delivery.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct FailureHistory {
    /// Failed attempts so far, over all deliveries.
    pub attempts: u32,
    /// Delayed redeliveries (retry tiers) so far.
    pub redeliveries: u32,
    /// When it first failed, if it has.
    pub first_failure: Option<String>,
    /// Immediate retries in this delivery (not carried in headers).
    pub retries: u32,
    /// Holds in a row in this delivery while the database answered at
    /// once (not carried in headers).
    pub holds_in_vain: u32,
}

impl FailureHistory {
    /// Reads the history from `headers`; absent or unreadable values read as
    /// none (a message from another publisher has no history). The headers
    /// are untrusted: any value, however large, reads without panicking, and
    /// the counts only ever grow with [`record_failure`](Self::record_failure)
    /// and [`record_redelivery`](Self::record_redelivery), which saturate.
    ///
    /// A copy that was set aside and came back by another way than this
    /// library's replay (the management UI's move, a shovel) has none
    /// either: its failure headers describe its past, not its future. Set
    /// aside means: by this runtime ([`headers::SET_ASIDE`]), by
    /// MassTransit (`MT-Reason`), or by the broker at a quorum queue's
    /// delivery limit (the newest dead-lettering's reason).
    ///
    /// MassTransit counts delayed redeliveries in `MT-Redelivery-Count`
    /// (ABS/Contexts/SendContextExtensions.cs `ApplyRedeliveryOptions`): a
    /// message a .NET consumer redelivered has spent as many of the retry
    /// tiers.
    pub fn read(headers: &FieldTable) -> Self {
        let map = headers.inner();
        if set_aside_before(headers) {
            return Self::default();
        }
        let number = |key: &str| map.get(key).and_then(as_u32).unwrap_or(0);
        Self {
            attempts: number(headers::ATTEMPTS),
            redeliveries: number(headers::REDELIVERIES)
                .max(number(crate::masstransit::headers::REDELIVERY_COUNT)),
            first_failure: map
                .get(headers::FIRST_FAILURE)
                .and_then(as_text)
                .map(|t| truncate(&t, MAX_VALUE_BYTES).into_owned()),
            retries: 0,
            holds_in_vain: 0,
        }
    }

    /// Counts a hold for an outage that ended: one in vain when no outage
    /// was seen while holding (the database answered at once).
    pub fn record_hold(&mut self, outage_seen: bool) {
        self.holds_in_vain = if outage_seen {
            0
        } else {
            self.holds_in_vain.saturating_add(1)
        };
    }

    /// Counts one more failed attempt, now.
    pub fn record_failure(&mut self) {
        self.attempts = self.attempts.saturating_add(1);
        self.first_failure.get_or_insert_with(now);
    }

    /// Counts one more delayed redelivery.
    pub fn record_redelivery(&mut self) {
        self.redeliveries = self.redeliveries.saturating_add(1);
    }

    /// The number of the attempt about to be made (from 1).
    pub fn next_attempt(&self) -> u32 {
        self.attempts.saturating_add(1)
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
    /// Writes the fault into `headers`, keeping every other header but the
    /// broker's delivery count. Every value is bounded
    /// ([`MAX_REASON_BYTES`] for the reason, [`MAX_VALUE_BYTES`] for the
    /// others), so the headers it adds stay under 4 KiB whatever the
    /// message or its error says.
    pub fn stamp(&self, headers: &mut FieldTable) {
        let now = now();
        let text = |s: &str, max| AMQPValue::LongString(LongString::from(truncate(s, max).as_ref()));
        // A copy set aside before and come back (its past) is set aside,
        // or sent to a tier, anew: the mark goes, and the move says again
        // if it is one.
        *headers = without(headers, &headers::BROKER_OWNED);
        // Every sign that reads as "set aside before" (see
        // `set_aside_before`) goes, on both wires: a producer's `MT-Reason`
        // left on a retry tier's copy would read as fresh again when it
        // comes back, and walk the first tier without end.
        *headers = without(
            headers,
            &[headers::SET_ASIDE, crate::masstransit::headers::REASON],
        );
        headers.insert(headers::REASON.into(), text(self.reason, MAX_REASON_BYTES));
        headers.insert(headers::HANDLER.into(), text(self.handler, MAX_VALUE_BYTES));
        headers.insert(
            headers::ATTEMPTS.into(),
            AMQPValue::LongLongInt(self.history.attempts.into()),
        );
        headers.insert(
            headers::REDELIVERIES.into(),
            AMQPValue::LongLongInt(self.history.redeliveries.into()),
        );
        let first = self.history.first_failure.as_deref().unwrap_or(&now);
        headers.insert(headers::FIRST_FAILURE.into(), text(first, MAX_VALUE_BYTES));
        headers.insert(headers::LAST_FAILURE.into(), text(&now, MAX_VALUE_BYTES));
        headers.insert(
            headers::SOURCE_QUEUE.into(),
            text(self.source_queue, MAX_VALUE_BYTES),
        );
    }
}

/// AMQP `delivery_mode` 2: the message survives a broker restart. Every
/// message the runtime sends has it, the events it publishes as well as
/// the copies it sets aside; here, below the broker code, so that both
/// read it without a circle.
pub(crate) const PERSISTENT: u8 = 2;

/// The properties of a copy the runtime publishes of a delivery (a move to
/// a retry tier, `Q.error` or `Q.skipped`, or a replay): the original's,
/// with `headers`, less the two that belong to the producer's own publish.
/// Each goes into a header of its own when the original had it, so that
/// whoever reads the copy sees it:
///
/// - `expiration`, a per-message TTL: the broker drops a message whose TTL
///   ran out while it waited in a queue. A copy set aside stays until
///   someone acts on it, and a copy in a retry tier waits the tier's delay,
///   not less. RabbitMQ drops it likewise when it dead-letters, and so does
///   MassTransit's error transport. Kept in
///   [`x-inbox-original-expiration`](headers::ORIGINAL_EXPIRATION).
/// - `user_id`: the broker refuses a publish whose `user_id` is not the
///   publishing connection's user (`PRECONDITION_FAILED`, closing the
///   channel), and the runtime publishes as itself. Kept in
///   [`x-inbox-original-user-id`](headers::ORIGINAL_USER_ID).
///
/// A copy of a copy keeps the first one's record. And every copy is
/// persistent, whatever the original was: a classic queue (one another
/// client declared, taken over as it is) drops a transient message when
/// the broker restarts, and a copy set aside stays until someone acts on
/// it.
pub(crate) fn copy_properties(original: &BasicProperties, mut headers: FieldTable) -> BasicProperties {
    let keep = |headers: &mut FieldTable, key: &str, value: &Option<lapin::types::ShortString>| {
        if let Some(value) = value
            && !headers.contains_key(key)
        {
            headers.insert(key.into(), AMQPValue::LongString(value.as_str().into()));
        }
    };
    keep(&mut headers, headers::ORIGINAL_EXPIRATION, original.expiration());
    keep(&mut headers, headers::ORIGINAL_USER_ID, original.user_id());
    // lapin can set a property but not unset one: the copy is built anew
    // with every property but those two.
    let mut copy = BasicProperties::default()
        .with_headers(headers)
        .with_delivery_mode(PERSISTENT);
    if let Some(v) = original.content_type() {
        copy = copy.with_content_type(v.clone());
    }
    if let Some(v) = original.content_encoding() {
        copy = copy.with_content_encoding(v.clone());
    }
    if let Some(v) = original.priority() {
        copy = copy.with_priority(*v);
    }
    if let Some(v) = original.correlation_id() {
        copy = copy.with_correlation_id(v.clone());
    }
    if let Some(v) = original.reply_to() {
        copy = copy.with_reply_to(v.clone());
    }
    if let Some(v) = original.message_id() {
        copy = copy.with_message_id(v.clone());
    }
    if let Some(v) = original.timestamp() {
        copy = copy.with_timestamp(*v);
    }
    if let Some(v) = original.kind() {
        copy = copy.with_type(v.clone());
    }
    if let Some(v) = original.app_id() {
        copy = copy.with_app_id(v.clone());
    }
    if let Some(v) = original.cluster_id() {
        copy = copy.with_cluster_id(v.clone());
    }
    copy
}

/// `headers` less the `keys`.
/// Whether `headers` are those of a copy set aside before (see
/// [`FailureHistory::read`]).
fn set_aside_before(headers: &FieldTable) -> bool {
    let map = headers.inner();
    if map.contains_key(headers::SET_ASIDE) || map.contains_key(crate::masstransit::headers::REASON) {
        return true;
    }
    // RabbitMQ 3.13 and later write the newest reason on its own; older
    // ones only in `x-death`, newest first.
    let newest = map.get("x-last-death-reason").and_then(as_text).or_else(|| {
        let AMQPValue::FieldArray(deaths) = map.get("x-death")? else {
            return None;
        };
        let AMQPValue::FieldTable(newest) = deaths.as_slice().first()? else {
            return None;
        };
        newest.inner().get("reason").and_then(as_text)
    });
    newest.as_deref() == Some("delivery_limit")
}

pub(crate) fn without(headers: &FieldTable, keys: &[&str]) -> FieldTable {
    let kept: std::collections::BTreeMap<_, _> = headers
        .inner()
        .iter()
        .filter(|(key, _)| !keys.contains(&key.as_str()))
        .map(|(key, value)| (key.clone(), value.clone()))
        .collect();
    kept.into()
}

/// `text` cut to at most `max` bytes on a character boundary, marked as cut
/// when it was.
pub(crate) fn truncate(text: &str, max: usize) -> std::borrow::Cow<'_, str> {
    if text.len() <= max {
        return text.into();
    }
    let mut end = max.saturating_sub(CUT.len());
    while !text.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}{CUT}", &text[..end]).into()
}

/// The time now, as the fault headers write it.
pub(crate) fn now() -> String {
    humantime::format_rfc3339_millis(SystemTime::now()).to_string()
}

pub(crate) fn as_u32(value: &AMQPValue) -> Option<u32> {
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

pub(crate) fn as_text(value: &AMQPValue) -> Option<String> {
    match value {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn a_copy_stamped_for_a_move_no_longer_reads_as_set_aside_before() {
        let mut headers = FieldTable::default();
        headers.insert("MT-Reason".into(), AMQPValue::LongString("fault".into()));
        headers.insert(headers::SET_ASIDE.into(), AMQPValue::LongString("q.error".into()));
        headers.insert(headers::ATTEMPTS.into(), AMQPValue::LongLongInt(3));
        assert_eq!(
            FailureHistory::read(&headers).attempts,
            0,
            "came back: a fresh budget"
        );
        let history = FailureHistory {
            attempts: 4,
            redeliveries: 1,
            ..FailureHistory::default()
        };
        let fault = Fault {
            reason: "boom",
            handler: "H",
            history: history.clone(),
            source_queue: "q",
        };
        fault.stamp(&mut headers);
        let read = FailureHistory::read(&headers);
        assert_eq!(
            (read.attempts, read.redeliveries),
            (4, 1),
            "back from its tier, it goes on from where it was"
        );
    }

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
            ..FailureHistory::default()
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

    #[test]
    fn a_copy_goes_without_the_producers_ttl_and_user_id_and_keeps_them_in_headers() {
        let produced = || {
            BasicProperties::default()
                .with_message_id("m".into())
                .with_type("T".into())
                .with_content_type("application/json".into())
                .with_content_encoding("identity".into())
                .with_correlation_id("c".into())
                .with_delivery_mode(2)
                .with_priority(3)
                .with_timestamp(42)
                .with_app_id("app".into())
                .with_cluster_id("cluster".into())
                .with_reply_to("r".into())
        };
        let original = produced()
            .with_expiration("8000".into())
            .with_user_id("alice".into());
        let mut headers = FieldTable::default();
        headers.insert("x-custom".into(), AMQPValue::LongInt(5));
        let copy = copy_properties(&original, headers);
        // Everything else is the original's.
        let expected = produced().with_headers(copy.headers().clone().unwrap_or_default());
        assert_eq!(copy, expected);
        let headers = copy.headers().clone().unwrap_or_default();
        let text = |key: &str| match headers.inner().get(key) {
            Some(AMQPValue::LongString(s)) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            _ => None,
        };
        assert_eq!(text(headers::ORIGINAL_EXPIRATION).as_deref(), Some("8000"));
        assert_eq!(text(headers::ORIGINAL_USER_ID).as_deref(), Some("alice"));
        assert!(headers.contains_key("x-custom"));

        // A copy of the copy keeps the first record; a message without
        // either property gets no such header.
        let again = copy_properties(&copy.clone().with_expiration("5".into()), headers.clone());
        let again_headers = again.headers().clone().unwrap_or_default();
        assert_eq!(
            again_headers.inner().get(headers::ORIGINAL_EXPIRATION),
            headers.inner().get(headers::ORIGINAL_EXPIRATION)
        );
        let plain = copy_properties(&BasicProperties::default(), FieldTable::default());
        assert_eq!(plain.headers().clone().unwrap_or_default().inner().len(), 0);
        assert_eq!(
            plain.delivery_mode(),
            &Some(2),
            "a transient original's copy is persistent"
        );
    }

    #[test]
    fn producer_set_counts_at_the_limit_saturate_instead_of_overflowing() {
        let mut headers = FieldTable::default();
        headers.insert(headers::ATTEMPTS.into(), AMQPValue::LongLongInt(u32::MAX.into()));
        headers.insert(headers::REDELIVERIES.into(), AMQPValue::LongUInt(u32::MAX));
        let mut history = FailureHistory::read(&headers);
        assert_eq!(history.next_attempt(), u32::MAX);
        history.record_failure();
        history.record_redelivery();
        assert_eq!((history.attempts, history.redeliveries), (u32::MAX, u32::MAX));
        // Out of range, negative or not a number: no history.
        for value in [
            AMQPValue::LongLongInt(i64::MAX),
            AMQPValue::LongLongInt(-1),
            AMQPValue::LongString("7".into()),
        ] {
            headers.insert(headers::ATTEMPTS.into(), value);
            assert_eq!(FailureHistory::read(&headers).attempts, 0);
        }
    }

    #[test]
    fn every_value_written_is_bounded_and_a_cut_is_marked() {
        let huge = "é".repeat(100_000); // two bytes each: cuts must respect them
        let history = FailureHistory {
            first_failure: Some(huge.clone()),
            ..FailureHistory::default()
        };
        let fault = Fault {
            reason: &huge,
            handler: &huge,
            history,
            source_queue: "q",
        };
        let mut headers = FieldTable::default();
        headers.insert(headers::DELIVERY_COUNT.into(), AMQPValue::LongLongInt(3));
        fault.stamp(&mut headers);
        let text = |key: &str| match headers.inner().get(key) {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{key}: {other:?}"),
        };
        let reason = text(headers::REASON);
        assert!(
            reason.len() <= MAX_REASON_BYTES && reason.ends_with(CUT),
            "{}",
            reason.len()
        );
        assert!(text(headers::HANDLER).len() <= MAX_VALUE_BYTES);
        assert!(text(headers::FIRST_FAILURE).len() <= MAX_VALUE_BYTES);
        assert!(!headers.contains_key(headers::DELIVERY_COUNT));
        assert_eq!(truncate("short", 10), "short");
    }
}
