//! Failed messages, kept in the database (`inbox_failures`) for an
//! operator: what a copy set aside in an error or skipped queue says of its
//! failure, read from its headers (this library's `x-inbox-*`, or
//! MassTransit's `MT-Fault-*` for a copy a .NET consumer set aside), and
//! written as one row per message and source queue.
//!
//! The drainer (`actors/drainer.rs`) writes a copy's row and commits it
//! before it acks the copy: a crash in between ingests the copy again, into
//! the same row, changing nothing (its failure time is the same). A later
//! failure of the same message (redriven, failed again) comes back to its
//! row and opens it again.

use std::time::SystemTime;

use lapin::BasicProperties;
use lapin::types::FieldTable;
use uuid::Uuid;

use crate::db::Connections;
use crate::error::{Error, Result};
use crate::settings::Wire;

/// Where a failure comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Kind {
    /// Set aside in the error queue: it failed, or could never succeed.
    Error,
    /// Set aside in the skipped queue: no handler took it.
    Skipped,
}

impl Kind {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            Kind::Error => "error",
            Kind::Skipped => "skipped",
        }
    }
}

/// A copy set aside, as its failure row says it.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct Failure {
    /// The queue it failed on.
    pub queue: String,
    /// Its key there: its message id, or `body:<hash>` for a copy without
    /// a valid one.
    pub message_key: String,
    pub message_id: Option<Uuid>,
    pub kind: Kind,
    /// The queue it was set aside in.
    pub set_aside_in: String,
    pub message_type: Option<String>,
    /// Its AMQP properties, as JSON.
    pub properties: serde_json::Value,
    /// Its AMQP headers, as JSON.
    pub headers: serde_json::Value,
    pub body: Vec<u8>,
    pub reason: Option<String>,
    pub handler: Option<String>,
    pub attempts: i32,
    pub fingerprint: String,
    pub first_failed_at: SystemTime,
    pub last_failed_at: SystemTime,
}

impl Failure {
    /// The failure a copy set aside in `set_aside_in` (the `kind` queue of
    /// the consumed queue `queue`) says, on `wire`.
    pub(crate) fn of(
        queue: &str,
        kind: Kind,
        set_aside_in: &str,
        wire: Wire,
        properties: &BasicProperties,
        body: &[u8],
    ) -> Self {
        let empty = FieldTable::default();
        let table = properties.headers().as_ref().unwrap_or(&empty);
        let text = |key: &str| header_text(table, key);
        let message_id = properties
            .message_id()
            .as_ref()
            .and_then(|id| Uuid::try_parse(id.as_str()).ok())
            .or_else(|| (wire == Wire::Masstransit).then(|| envelope_id(body)).flatten());
        let message_type = match wire {
            Wire::Inbox => properties.kind().as_ref().map(|t| t.as_str().to_owned()),
            Wire::Masstransit => crate::masstransit::types_of(body)
                .into_iter()
                .next()
                .or_else(|| properties.kind().as_ref().map(|t| t.as_str().to_owned())),
        };
        // Who set it aside says whose headers tell why: this runtime marks
        // every copy it sets aside; MassTransit writes MT-Reason; the
        // broker dead-letters a quorum queue's message at its delivery
        // limit, keeping whatever failure headers an earlier move left on
        // it, which are not its reason.
        let by_runtime = table.inner().contains_key(crate::fault::headers::SET_ASIDE);
        let by_masstransit = !by_runtime && table.inner().contains_key(crate::masstransit::headers::REASON);
        let broker_reason = text("x-last-death-reason").filter(|_| !by_runtime && !by_masstransit);
        let (reason, handler) = match broker_reason {
            Some(why) => (
                Some(format!("dead-lettered by the broker: {why}")),
                Some("broker".to_owned()),
            ),
            None => (
                text(crate::fault::headers::REASON)
                    .or_else(|| text("MT-Fault-Message"))
                    .or_else(|| (kind == Kind::Skipped).then(|| "no handler took it".to_owned())),
                text(crate::fault::headers::HANDLER).or_else(|| text("MT-Fault-ConsumerType")),
            ),
        };
        let attempts = number(table, crate::fault::headers::ATTEMPTS)
            .or_else(|| number(table, "MT-Fault-RetryCount").map(|retries| retries.saturating_add(1)))
            .unwrap_or(0);
        let now = SystemTime::now();
        let time = |key: &str| text(key).and_then(|t| humantime::parse_rfc3339_weak(&t).ok());
        let last_failed_at = time(crate::fault::headers::LAST_FAILURE)
            .or_else(|| time("MT-Fault-Timestamp"))
            .unwrap_or(now);
        let first_failed_at = time(crate::fault::headers::FIRST_FAILURE).unwrap_or(last_failed_at);
        Self {
            queue: queue.to_owned(),
            message_key: match message_id {
                Some(id) => id.to_string(),
                None => format!("body:{:016x}", fnv1a(body)),
            },
            message_id,
            kind,
            set_aside_in: set_aside_in.to_owned(),
            fingerprint: fingerprint(message_type.as_deref(), handler.as_deref(), reason.as_deref()),
            message_type: message_type.map(storable),
            properties: storable_json(properties_json(properties)),
            headers: storable_json(crate::amqp::table_json(table)),
            body: body.to_vec(),
            reason: reason.map(storable),
            handler: handler.map(storable),
            attempts: i32::try_from(attempts).unwrap_or(i32::MAX),
            first_failed_at,
            last_failed_at,
        }
    }
}

impl Failure {
    /// The row without what it could not be written with (`why`): its
    /// properties and headers, said in its reason. A row the database
    /// refuses must not hold the drainer up: the copy is acked only once a
    /// row is written, and the next copies wait behind it. The body, bytes
    /// the database always takes, is kept.
    pub(crate) fn bare(mut self, why: &Error) -> Self {
        self.properties = serde_json::Value::Object(serde_json::Map::new());
        self.headers = serde_json::Value::Object(serde_json::Map::new());
        let cut = crate::fault::truncate(&storable(crate::error::describe(why)), 512).into_owned();
        self.reason = Some(format!(
            "{} [its headers could not be stored: {cut}]",
            self.reason.as_deref().unwrap_or("no reason")
        ));
        self
    }
}

/// `text` as PostgreSQL stores it: `text` and `jsonb` take no NUL, which a
/// header (untrusted) may hold.
fn storable(text: String) -> String {
    match text.contains('\0') {
        true => text.replace('\0', "\u{fffd}"),
        false => text,
    }
}

/// [`storable`] for every string of `value`, keys too.
fn storable_json(value: serde_json::Value) -> serde_json::Value {
    use serde_json::Value;
    match value {
        Value::String(text) => Value::String(storable(text)),
        Value::Array(items) => Value::Array(items.into_iter().map(storable_json).collect()),
        Value::Object(map) => Value::Object(
            map.into_iter()
                .map(|(key, value)| (storable(key), storable_json(value)))
                .collect(),
        ),
        other => other,
    }
}

/// Writes `failure` into its row, committed at once: a new row, or the
/// message's row brought up to date. The same copy written again changes
/// nothing; a later failure of the message counts once more and opens its
/// row again, whatever an operator did with it before. Answers whether it
/// is a redriven message that failed again (a copy written twice, after a
/// crash between its commit and its ack, answers so twice).
pub(crate) async fn record(connections: &Connections, failure: &Failure) -> Result<bool> {
    let client = connections.get().await.map_err(Error::client)?;
    let statement = client
        .prepare_cached(
            "INSERT INTO inbox_failures (id, queue, message_key, message_id, kind, set_aside_in, message_type,
                 properties, headers, body, reason, handler, attempts, fingerprint, first_failed_at, last_failed_at)
             VALUES ($1, $2, $3, $4, $5, $6, $7, $8::text::jsonb, $9::text::jsonb, $10, $11, $12, $13, $14, $15, $16)
             ON CONFLICT (queue, message_key) DO UPDATE SET
                 kind = EXCLUDED.kind,
                 set_aside_in = EXCLUDED.set_aside_in,
                 message_type = EXCLUDED.message_type,
                 properties = EXCLUDED.properties,
                 headers = EXCLUDED.headers,
                 body = EXCLUDED.body,
                 reason = EXCLUDED.reason,
                 handler = EXCLUDED.handler,
                 attempts = EXCLUDED.attempts,
                 fingerprint = EXCLUDED.fingerprint,
                 first_failed_at = LEAST(inbox_failures.first_failed_at, EXCLUDED.first_failed_at),
                 times_failed = inbox_failures.times_failed
                     + CASE WHEN EXCLUDED.last_failed_at > inbox_failures.last_failed_at THEN 1 ELSE 0 END,
                 status = CASE WHEN EXCLUDED.last_failed_at > inbox_failures.last_failed_at
                               THEN 'open' ELSE inbox_failures.status END,
                 last_failed_at = GREATEST(inbox_failures.last_failed_at, EXCLUDED.last_failed_at),
                 updated_at = now()
             RETURNING redriven_at IS NOT NULL AND status = 'open' AND last_failed_at > redriven_at
                       AND last_failed_at = $16",
        )
        .await
        .map_err(Error::client)?;
    let properties = failure.properties.to_string();
    let headers = failure.headers.to_string();
    let row = client
        .query_one(
            &statement,
            &[
                &Uuid::now_v7(),
                &failure.queue,
                &failure.message_key,
                &failure.message_id,
                &failure.kind.as_str(),
                &failure.set_aside_in,
                &failure.message_type,
                &properties,
                &headers,
                &failure.body,
                &failure.reason,
                &failure.handler,
                &failure.attempts,
                &failure.fingerprint,
                &failure.first_failed_at,
                &failure.last_failed_at,
            ],
        )
        .await
        .map_err(Error::client)?;
    row.try_get(0).map_err(Error::client)
}

/// The failure row of the outbox row `$1` (its `seq`), parked as dead in
/// the same transaction: queue `outbox`, kind `dead_outbox`, its last
/// error as the reason, `$2` a new row's id and `$3` its fingerprint. A row
/// that dies again (revived, failed again) comes back to its failure row
/// and opens it again.
pub(crate) const RECORD_DEAD_OUTBOX_ROW: &str = "
    INSERT INTO inbox_failures (id, queue, message_key, message_id, kind, set_aside_in, message_type,
        properties, headers, body, reason, handler, attempts, fingerprint, first_failed_at, last_failed_at)
    SELECT $2, 'outbox', o.message_id::text, o.message_id, 'dead_outbox', 'outbox_messages', o.message_type,
        jsonb_build_object('exchange', o.exchange, 'routing_key', o.routing_key), o.headers, o.body,
        o.last_error, 'outbox', o.attempts, $3, o.created_at, now()
    FROM outbox_messages o WHERE o.seq = $1
    ON CONFLICT (queue, message_key) DO UPDATE SET
        reason = EXCLUDED.reason,
        attempts = EXCLUDED.attempts,
        fingerprint = EXCLUDED.fingerprint,
        times_failed = inbox_failures.times_failed + 1,
        status = 'open',
        last_failed_at = EXCLUDED.last_failed_at,
        updated_at = now()";

/// What groups the same failure across messages: the type, the handler,
/// and the reason with what differs from one message to the next (numbers,
/// ids) blanked, hashed (FNV-1a, stable across builds and machines).
pub(crate) fn fingerprint(message_type: Option<&str>, handler: Option<&str>, reason: Option<&str>) -> String {
    let shape = format!(
        "{}\u{1f}{}\u{1f}{}",
        message_type.unwrap_or_default(),
        handler.unwrap_or_default(),
        blank_specifics(reason.unwrap_or_default())
    );
    format!("{:016x}", fnv1a(shape.as_bytes()))
}

/// `reason` with every run of digits, and every run of hex digits and
/// dashes that holds a digit (a UUID, a hash), as `#`.
fn blank_specifics(reason: &str) -> String {
    let mut blanked = String::with_capacity(reason.len());
    let mut run = String::new();
    let flush = |run: &mut String, blanked: &mut String| {
        if run.bytes().any(|b| b.is_ascii_digit()) {
            blanked.push('#');
        } else {
            blanked.push_str(run);
        }
        run.clear();
    };
    for c in reason.chars() {
        if c.is_ascii_hexdigit() || c == '-' {
            run.push(c);
        } else {
            flush(&mut run, &mut blanked);
            blanked.push(c);
        }
    }
    flush(&mut run, &mut blanked);
    blanked
}

/// FNV-1a, 64 bits.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// A MassTransit envelope's `messageId`, if it has a valid one.
fn envelope_id(body: &[u8]) -> Option<Uuid> {
    #[derive(serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Id<'a> {
        #[serde(borrow)]
        message_id: Option<&'a str>,
    }
    let id: Id<'_> = serde_json::from_slice(body).ok()?;
    Uuid::try_parse(id.message_id?).ok()
}

fn header_text(table: &FieldTable, key: &str) -> Option<String> {
    table.inner().get(key).and_then(crate::fault::as_text)
}

fn number(table: &FieldTable, key: &str) -> Option<u32> {
    table.inner().get(key).and_then(crate::fault::as_u32)
}

/// The AMQP properties a redrive restores, as JSON (headers apart).
fn properties_json(properties: &BasicProperties) -> serde_json::Value {
    let mut json = serde_json::Map::new();
    let mut text = |key: &str, value: Option<&str>| {
        if let Some(value) = value {
            json.insert(key.to_owned(), value.into());
        }
    };
    text(
        "content_type",
        properties.content_type().as_ref().map(|v| v.as_str()),
    );
    text(
        "content_encoding",
        properties.content_encoding().as_ref().map(|v| v.as_str()),
    );
    text(
        "correlation_id",
        properties.correlation_id().as_ref().map(|v| v.as_str()),
    );
    text("reply_to", properties.reply_to().as_ref().map(|v| v.as_str()));
    text("message_id", properties.message_id().as_ref().map(|v| v.as_str()));
    text("type", properties.kind().as_ref().map(|v| v.as_str()));
    text("app_id", properties.app_id().as_ref().map(|v| v.as_str()));
    if let Some(priority) = properties.priority() {
        json.insert("priority".into(), (*priority).into());
    }
    if let Some(timestamp) = properties.timestamp() {
        json.insert("timestamp".into(), (*timestamp).into());
    }
    serde_json::Value::Object(json)
}

#[cfg(test)]
mod tests {
    use lapin::types::AMQPValue;

    use super::*;

    #[test]
    fn the_same_cause_has_one_fingerprint_whatever_its_numbers_and_ids() {
        let a = fingerprint(
            Some("Counted"),
            Some("Count"),
            Some("key 7 is refused (order 0190a3c2-5b7e-7f00-9a2b-3c4d5e6f7a8b)"),
        );
        let b = fingerprint(
            Some("Counted"),
            Some("Count"),
            Some("key 12 is refused (order 0190a3c2-ffff-7f00-9a2b-000000000000)"),
        );
        assert_eq!(a, b);
        assert_ne!(
            a,
            fingerprint(Some("Counted"), Some("Other"), Some("key 7 is refused"))
        );
        assert_eq!(
            blank_specifics("deadline exceeded"),
            "deadline exceeded",
            "words stay"
        );
    }

    #[test]
    fn a_copy_set_aside_reads_as_its_failure_headers_say() {
        let id = Uuid::now_v7();
        let mut headers = FieldTable::default();
        let mut put = |key: &str, value: AMQPValue| {
            headers.insert(key.into(), value);
        };
        put("x-inbox-reason", AMQPValue::LongString("boom".into()));
        put("x-inbox-handler", AMQPValue::LongString("Count".into()));
        put("x-inbox-attempts", AMQPValue::LongLongInt(4));
        put(
            "x-inbox-first-failure",
            AMQPValue::LongString("2026-12-07T01:00:00.000Z".into()),
        );
        put(
            "x-inbox-last-failure",
            AMQPValue::LongString("2026-12-07T01:00:05.000Z".into()),
        );
        let properties = BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_type("Counted".into())
            .with_content_type("application/json".into())
            .with_headers(headers);
        let failure = Failure::of("q", Kind::Error, "q.error", Wire::Inbox, &properties, b"{}");
        assert_eq!(failure.message_key, id.to_string());
        assert_eq!(failure.message_type.as_deref(), Some("Counted"));
        assert_eq!(
            (
                failure.reason.as_deref(),
                failure.handler.as_deref(),
                failure.attempts
            ),
            (Some("boom"), Some("Count"), 4)
        );
        assert_eq!(
            failure.last_failed_at,
            humantime::parse_rfc3339("2026-12-07T01:00:05Z").unwrap()
        );
        assert_eq!(failure.properties["content_type"], "application/json");
        assert_eq!(failure.headers["x-inbox-attempts"], 4);

        // Dead-lettered by the broker at its delivery limit after an
        // earlier failure: the broker's reason, not the stale one.
        let mut stale = FieldTable::default();
        stale.insert(
            "x-inbox-reason".into(),
            AMQPValue::LongString("an old failure".into()),
        );
        stale.insert(
            "x-last-death-reason".into(),
            AMQPValue::LongString("delivery_limit".into()),
        );
        let dead_lettered = BasicProperties::default().with_headers(stale);
        let failure = Failure::of("q", Kind::Error, "q.error", Wire::Inbox, &dead_lettered, b"{}");
        assert_eq!(
            (failure.reason.as_deref(), failure.handler.as_deref()),
            (
                Some("dead-lettered by the broker: delivery_limit"),
                Some("broker")
            )
        );

        // A NUL in a header (PostgreSQL's text and jsonb take none).
        let mut nul = FieldTable::default();
        nul.insert("x-inbox-reason".into(), AMQPValue::LongString("a\0b".into()));
        let failure = Failure::of(
            "q",
            Kind::Error,
            "q.error",
            Wire::Inbox,
            &BasicProperties::default().with_headers(nul),
            b"{}",
        );
        assert_eq!(failure.reason.as_deref(), Some("a\u{fffd}b"));
        assert_eq!(failure.headers["x-inbox-reason"], "a\u{fffd}b");

        // No valid id: keyed by its body, the same body the same key.
        let bare = BasicProperties::default();
        let one = Failure::of("q", Kind::Error, "q.error", Wire::Inbox, &bare, b"not json");
        let again = Failure::of("q", Kind::Error, "q.error", Wire::Inbox, &bare, b"not json");
        assert_eq!(one.message_key, again.message_key);
        assert!(one.message_key.starts_with("body:"));
    }
}
