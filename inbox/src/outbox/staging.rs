//! Staging: a message on its way out, and the rows of `outbox_messages` a
//! unit of work writes for it with its `COMMIT`. Below the unit of work
//! and the dispatcher alike, which both read it.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use tokio_postgres::types::ToSql;
use uuid::Uuid;

/// A message on its way out: staged by a unit of work until its commit,
/// then a row of `outbox_messages` (or, with the outbox off, handed to the
/// publisher).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Its id: the receiving inbox's dedup key.
    pub message_id: Uuid,
    /// Where: the exchange…
    pub exchange: String,
    /// …and the routing key.
    pub routing_key: String,
    /// The AMQP `type`.
    pub message_type: String,
    /// Headers (`correlation_id`, `causation_id`, `traceparent`,
    /// `tracestate`), as text.
    pub headers: Vec<(String, String)>,
    /// The event as JSON.
    pub body: Vec<u8>,
    /// AMQP properties to publish it with as they are, headers included
    /// (JSON: `content_type`, `correlation_id`, `type`... and `headers`):
    /// a failure redriven as it was set aside. `None` for what a handler
    /// stages: the wire's properties, with `headers`.
    pub properties: Option<serde_json::Value>,
}

impl Outgoing {
    /// Its headers as AMQP headers.
    pub fn amqp_headers(&self) -> FieldTable {
        let mut table = FieldTable::default();
        for (key, value) in &self.headers {
            table.insert(key.as_str().into(), AMQPValue::LongString(value.as_str().into()));
        }
        table
    }

    /// Its AMQP properties: id, type, JSON, persistent, headers. Only for
    /// a message that passed [`check`](Self::check): a name past 255 bytes
    /// panics in the client.
    pub fn properties(&self) -> BasicProperties {
        if let Some(restored) = &self.properties {
            return crate::amqp::restored_properties(self.message_id, restored);
        }
        crate::amqp::message_properties(self.message_id, &self.message_type).with_headers(self.amqp_headers())
    }

    /// Its AMQP properties as MassTransit sets them
    /// (RMQ/RabbitMqTransport/RabbitMqSendTransportContext.cs at v8.5.8):
    /// its id as `message_id`, the envelope's content type, persistent, its
    /// headers; no `type`.
    pub fn masstransit_properties(&self) -> BasicProperties {
        if let Some(restored) = &self.properties {
            return crate::amqp::restored_properties(self.message_id, restored);
        }
        crate::masstransit::properties(self.message_id).with_headers(self.amqp_headers())
    }

    /// Why the broker would not take it, if it would not: a name (exchange,
    /// routing key, type, a header's key) past 255 bytes, properties past
    /// [`MAX_PROPERTIES_BYTES`](crate::limits::MAX_PROPERTIES_BYTES)
    /// encoded, or a body past `max_body` bytes. Checked at staging, and
    /// again at dispatch, since a row may come from any process.
    pub fn check(&self, max_body: usize) -> std::result::Result<(), String> {
        self.check_names_and_body(max_body)?;
        crate::limits::check_properties(&self.properties(), 0)
    }

    /// [`check`](Self::check) less the properties' encoded size, which the
    /// publisher measures as it sends, against its connection's frame: at
    /// dispatch, once per row.
    pub(super) fn check_names_and_body(&self, max_body: usize) -> std::result::Result<(), String> {
        use crate::limits::{check_body, check_name};
        check_name("exchange", &self.exchange)?;
        check_name("routing key", &self.routing_key)?;
        check_name("type", &self.message_type)?;
        for (key, _) in &self.headers {
            check_name("header key", key)?;
        }
        check_body(self.body.len(), max_body)
    }
}

/// Messages a unit of work staged, as `outbox_messages`' columns, for an
/// `INSERT` that writes them: [`UnitOfWork::commit`] sends the last (and
/// nearly always only) one with its `COMMIT`.
pub(crate) struct OutboxRows<'a> {
    message_ids: Vec<Uuid>,
    exchanges: Vec<&'a str>,
    routing_keys: Vec<&'a str>,
    message_types: Vec<&'a str>,
    headers: Vec<String>,
    bodies: Vec<&'a [u8]>,
}

/// One row (a message's one follow-up, the common case).
const INSERT_ONE: &str =
    "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
     VALUES ($1, $2, $3, $4, $5::text::jsonb, $6)";

/// Several rows, numbered in staging order: `seq` follows it.
const INSERT_MANY: &str =
    "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
     SELECT m, e, r, t, h::jsonb, b
     FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[])
          WITH ORDINALITY AS s (m, e, r, t, h, b, n)
     ORDER BY n";

/// The most rows one `INSERT` writes…
const ROWS_PER_INSERT: usize = 1000;
/// …and about the most bytes of headers and bodies: PostgreSQL refuses a
/// protocol message past 1 GB, and a transaction may stage many large
/// messages.
const BYTES_PER_INSERT: usize = 64 * 1024 * 1024;

impl<'a> OutboxRows<'a> {
    /// `messages` in staging order, in chunks of at most
    /// [`ROWS_PER_INSERT`] rows and about [`BYTES_PER_INSERT`] bytes (a
    /// larger message goes alone); none for none.
    pub(crate) fn chunks(messages: &'a [Outgoing]) -> Vec<Self> {
        let mut chunks = Vec::new();
        let (mut start, mut bytes) = (0, 0);
        for (i, message) in messages.iter().enumerate() {
            let size = message.body.len()
                + message
                    .headers
                    .iter()
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>();
            if i > start && (i - start == ROWS_PER_INSERT || bytes + size > BYTES_PER_INSERT) {
                chunks.push(Self::new(&messages[start..i]));
                (start, bytes) = (i, 0);
            }
            bytes += size;
        }
        if start < messages.len() {
            chunks.push(Self::new(&messages[start..]));
        }
        chunks
    }

    fn new(messages: &'a [Outgoing]) -> Self {
        Self {
            message_ids: messages.iter().map(|m| m.message_id).collect(),
            exchanges: messages.iter().map(|m| m.exchange.as_str()).collect(),
            routing_keys: messages.iter().map(|m| m.routing_key.as_str()).collect(),
            message_types: messages.iter().map(|m| m.message_type.as_str()).collect(),
            headers: messages.iter().map(|m| headers_json(&m.headers)).collect(),
            bodies: messages.iter().map(|m| m.body.as_slice()).collect(),
        }
    }

    pub(crate) fn sql(&self) -> &'static str {
        if self.message_ids.len() == 1 {
            INSERT_ONE
        } else {
            INSERT_MANY
        }
    }

    /// The parameters of [`sql`](Self::sql).
    pub(crate) fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        if let ([id], [exchange], [routing_key], [message_type], [headers], [body]) = (
            self.message_ids.as_slice(),
            self.exchanges.as_slice(),
            self.routing_keys.as_slice(),
            self.message_types.as_slice(),
            self.headers.as_slice(),
            self.bodies.as_slice(),
        ) {
            return vec![id, exchange, routing_key, message_type, headers, body];
        }
        vec![
            &self.message_ids,
            &self.exchanges,
            &self.routing_keys,
            &self.message_types,
            &self.headers,
            &self.bodies,
        ]
    }
}

/// Headers as the JSON object `outbox_messages.headers` holds.
fn headers_json(headers: &[(String, String)]) -> String {
    let object: serde_json::Map<String, serde_json::Value> = headers
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().into()))
        .collect();
    serde_json::Value::Object(object).to_string()
}

/// The headers of row `message_id`: a JSON object of strings, as staging
/// writes them. A row another process wrote may hold anything: what is not
/// a string (a number, a nested object) is not sent, with a WARN naming
/// the row and the keys, rather than guessed into an AMQP type.
pub(super) fn headers(json: &str, message_id: Uuid) -> Vec<(String, String)> {
    let map = match serde_json::from_str(json) {
        Ok(serde_json::Value::Object(map)) => map,
        _ => {
            tracing::warn!(%message_id, "outbox row's headers are not a JSON object: sent without headers");
            return Vec::new();
        }
    };
    // The WARN names a few of the keys, each cut: the row is untrusted.
    const NAMED: usize = 10;
    let mut headers = Vec::with_capacity(map.len());
    let (mut dropped, mut named) = (0, Vec::new());
    for (key, value) in map {
        match value {
            serde_json::Value::String(text) => headers.push((key, text)),
            _ => {
                dropped += 1;
                if named.len() < NAMED {
                    named.push(crate::fault::truncate(&key, 64).into_owned());
                }
            }
        }
    }
    if dropped > 0 {
        tracing::warn!(
            %message_id,
            dropped,
            keys = %named.join(", "),
            "outbox row's headers that are not strings are not sent"
        );
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body_bytes: usize) -> Outgoing {
        Outgoing {
            message_id: Uuid::now_v7(),
            exchange: String::new(),
            routing_key: "q".into(),
            message_type: "T".into(),
            headers: vec![("correlation_id".into(), "c".into())],
            body: vec![b'x'; body_bytes],
            properties: None,
        }
    }

    fn sizes(messages: &[Outgoing]) -> Vec<usize> {
        OutboxRows::chunks(messages)
            .iter()
            .map(|c| c.message_ids.len())
            .collect()
    }

    #[test]
    fn headers_go_into_the_row_as_json_and_come_back_as_they_were() {
        let staged = message(1).headers;
        let id = Uuid::now_v7();
        assert_eq!(headers(&headers_json(&staged), id), staged);
        assert!(headers("not json", id).is_empty());
        // What another process may write: only the strings go.
        let written = r#"{"a": "x", "n": 1, "nested": {"k": "v"}}"#;
        assert_eq!(headers(written, id), [("a".to_owned(), "x".to_owned())]);
    }

    #[test]
    fn staged_rows_go_in_chunks_of_a_thousand_in_staging_order() {
        assert!(OutboxRows::chunks(&[]).is_empty());
        let messages: Vec<Outgoing> = (0..2_345).map(|_| message(10)).collect();
        assert_eq!(sizes(&messages), [1_000, 1_000, 345]);
        let ids: Vec<Uuid> = OutboxRows::chunks(&messages)
            .iter()
            .flat_map(|c| c.message_ids.clone())
            .collect();
        assert_eq!(ids, messages.iter().map(|m| m.message_id).collect::<Vec<_>>());
    }

    #[test]
    fn large_messages_split_a_chunk_and_one_larger_than_a_chunk_goes_alone() {
        let mb = 1024 * 1024;
        let messages = [
            message(40 * mb),
            message(20 * mb),
            message(10 * mb),
            message(100 * mb),
            message(1),
        ];
        // 40 + 20 fit; 10 does not join them; 100 goes alone; 1 follows it.
        assert_eq!(sizes(&messages), [2, 1, 1, 1]);
        assert_eq!(OutboxRows::chunks(&messages[..1])[0].sql(), INSERT_ONE);
        assert_eq!(OutboxRows::chunks(&messages[1..3])[0].sql(), INSERT_MANY);
    }
}
