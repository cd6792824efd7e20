//! [`MessageContext`]: what a handler knows of the message it handles,
//! given to it beside the event.

use std::borrow::Cow;
use std::sync::Arc;

use lapin::types::{AMQPValue, FieldTable};
use uuid::Uuid;

use crate::envelope::Envelope;
use crate::fault::{MAX_VALUE_BYTES, truncate};
use crate::trace::TraceContext;

/// The header that ties together every message of one flow: copied from
/// the message a follow-up is staged for, or that message's own id.
pub const CORRELATION_ID: &str = "correlation_id";
/// The header that names the message a follow-up was staged for.
pub const CAUSATION_ID: &str = "causation_id";

/// One message being handled: its identity and where it came from. A
/// handler is given it beside its event
/// ([`EventHandler::handle`](crate::EventHandler::handle)), or one per
/// event in a batch
/// ([`EventHandler::handle_batch`](crate::EventHandler::handle_batch)).
#[derive(Debug, Clone)]
#[non_exhaustive]
pub struct MessageContext {
    /// The message's id.
    pub message_id: Uuid,
    /// Its type name.
    pub event_type: String,
    /// Whether the broker delivered it before.
    pub redelivered: bool,
    /// Its `correlation_id` header, if it had one (with MassTransit's
    /// wire, the envelope's `correlationId`; untrusted, bounded).
    pub correlation_id: Option<String>,
    /// With MassTransit's wire, the envelope's `conversationId`
    /// (untrusted, bounded).
    pub conversation_id: Option<String>,
    /// With MassTransit's wire, the envelope's `initiatorId` (untrusted,
    /// bounded).
    pub initiator_id: Option<String>,
    /// With MassTransit's wire, the envelope's `sourceAddress` (untrusted,
    /// bounded).
    pub source_address: Option<String>,
    /// Its `causation_id` header, if it had one (untrusted, bounded).
    pub causation_id: Option<String>,
    /// Which attempt this is, from 1: every delivery of the message and
    /// every immediate retry counts.
    pub attempt: u32,
    /// Its publisher's trace context (`traceparent`, `tracestate`), if
    /// valid. Follow-ups staged for it carry a child of it.
    pub trace: Option<TraceContext>,
    /// The envelope, shared: its headers are read from it, not copied for
    /// every message.
    envelope: Arc<Envelope>,
}

impl MessageContext {
    /// The context of `envelope`.
    pub(crate) fn of(envelope: &Arc<Envelope>) -> Self {
        let text = |key: &str| {
            use lapin::types::AMQPValue;
            match envelope.headers.inner().get(key)? {
                AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
                AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
                _ => None,
            }
            .map(|t| truncate(&t, MAX_VALUE_BYTES).into_owned())
        };
        // Read where they are: the envelope is shared, and copied only cut.
        let masstransit = envelope.masstransit.as_ref();
        let cut = |field: fn(&crate::masstransit::Context) -> &Option<String>| {
            masstransit
                .and_then(|m| field(m).as_deref())
                .map(|t| truncate(t, MAX_VALUE_BYTES).into_owned())
        };
        Self {
            message_id: envelope.message_id,
            event_type: envelope.event_type.clone(),
            redelivered: envelope.redelivered,
            correlation_id: cut(|m| &m.correlation_id).or_else(|| text(CORRELATION_ID)),
            conversation_id: cut(|m| &m.conversation_id),
            initiator_id: cut(|m| &m.initiator_id),
            source_address: cut(|m| &m.source_address),
            causation_id: text(CAUSATION_ID),
            attempt: envelope.attempt,
            trace: envelope.trace.clone(),
            envelope: Arc::clone(envelope),
        }
    }

    /// With MassTransit's wire, the address of the queue it was consumed
    /// from (`rabbitmq://host/queue`): the source of its follow-ups.
    pub(crate) fn input_address(&self) -> Option<&str> {
        self.envelope.input_address.as_deref()
    }

    /// Every AMQP header, as received (untrusted).
    pub fn headers(&self) -> Headers<'_> {
        Headers(&self.envelope.headers)
    }

    /// The AMQP headers, as the runtime reads them.
    pub(crate) fn amqp_headers(&self) -> &FieldTable {
        &self.envelope.headers
    }

    /// With MassTransit's wire, what its envelope (or raw headers) said.
    pub(crate) fn masstransit(&self) -> Option<&crate::masstransit::Context> {
        self.envelope.masstransit.as_ref()
    }

    /// The headers a follow-up of this message carries: its correlation id
    /// (or, for the first message of a flow, its own id) and its id as the
    /// causation id.
    pub fn follow_up_headers(&self) -> [(&'static str, String); 2] {
        let correlation = self
            .correlation_id
            .clone()
            .unwrap_or_else(|| self.message_id.to_string());
        [
            (CORRELATION_ID, correlation),
            (CAUSATION_ID, self.message_id.to_string()),
        ]
    }
}

/// A message's AMQP headers, as received: untrusted, read as
/// [`HeaderValue`]s.
#[derive(Clone, Copy)]
pub struct Headers<'a>(&'a FieldTable);

impl<'a> Headers<'a> {
    /// The value of header `name`, if the message has it.
    pub fn get(&self, name: &str) -> Option<HeaderValue<'a>> {
        self.0.inner().get(name).map(HeaderValue::of)
    }

    /// Whether the message has header `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.0.inner().contains_key(name)
    }

    /// The headers' names and values, in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&'a str, HeaderValue<'a>)> + 'a {
        self.0
            .inner()
            .iter()
            .map(|(name, value)| (name.as_str(), HeaderValue::of(value)))
    }

    /// How many headers the message has.
    pub fn len(&self) -> usize {
        self.0.inner().len()
    }

    /// Whether the message has no headers.
    pub fn is_empty(&self) -> bool {
        self.0.inner().is_empty()
    }
}

impl std::fmt::Debug for Headers<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_map().entries(self.iter()).finish()
    }
}

/// One header's value. AMQP has more types than a handler usually needs:
/// strings and numbers come as themselves, the rest as [`Other`](Self::Other).
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum HeaderValue<'a> {
    /// A string (long or short); bytes that are not UTF-8 are replaced.
    Text(Cow<'a, str>),
    /// An integer of any width, signed or not.
    Integer(i64),
    /// A floating-point number.
    Float(f64),
    /// A boolean.
    Bool(bool),
    /// A timestamp, in seconds since the Unix epoch.
    Timestamp(u64),
    /// A table, an array, raw bytes, a decimal or void.
    Other,
}

impl<'a> HeaderValue<'a> {
    fn of(value: &'a AMQPValue) -> Self {
        match value {
            AMQPValue::LongString(s) => HeaderValue::Text(String::from_utf8_lossy(s.as_bytes())),
            AMQPValue::ShortString(s) => HeaderValue::Text(Cow::Borrowed(s.as_str())),
            AMQPValue::ShortShortInt(n) => HeaderValue::Integer((*n).into()),
            AMQPValue::ShortShortUInt(n) => HeaderValue::Integer((*n).into()),
            AMQPValue::ShortInt(n) => HeaderValue::Integer((*n).into()),
            AMQPValue::ShortUInt(n) => HeaderValue::Integer((*n).into()),
            AMQPValue::LongInt(n) => HeaderValue::Integer((*n).into()),
            AMQPValue::LongUInt(n) => HeaderValue::Integer((*n).into()),
            AMQPValue::LongLongInt(n) => HeaderValue::Integer(*n),
            AMQPValue::Float(x) => HeaderValue::Float((*x).into()),
            AMQPValue::Double(x) => HeaderValue::Float(*x),
            AMQPValue::Boolean(b) => HeaderValue::Bool(*b),
            AMQPValue::Timestamp(t) => HeaderValue::Timestamp(*t),
            _ => HeaderValue::Other,
        }
    }

    /// The value as text, when it is a string.
    pub fn as_text(&self) -> Option<&str> {
        match self {
            HeaderValue::Text(text) => Some(text),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_read_as_this_librarys_values_whatever_their_amqp_type() {
        let mut table = FieldTable::default();
        table.insert("tenant".into(), AMQPValue::LongString("acme".into()));
        table.insert("short".into(), AMQPValue::ShortString("s".into()));
        table.insert("count".into(), AMQPValue::ShortUInt(7));
        table.insert("big".into(), AMQPValue::LongLongInt(-1 << 40));
        table.insert("ratio".into(), AMQPValue::Double(0.5));
        table.insert("flag".into(), AMQPValue::Boolean(true));
        table.insert("at".into(), AMQPValue::Timestamp(1_700_000_000));
        table.insert("nested".into(), AMQPValue::FieldTable(FieldTable::default()));
        table.insert("bytes".into(), AMQPValue::LongString(vec![0xff, b'a'].into()));
        let headers = Headers(&table);
        assert_eq!(
            headers.get("tenant").as_ref().and_then(HeaderValue::as_text),
            Some("acme")
        );
        assert_eq!(headers.get("short"), Some(HeaderValue::Text("s".into())));
        assert_eq!(headers.get("count"), Some(HeaderValue::Integer(7)));
        assert_eq!(headers.get("big"), Some(HeaderValue::Integer(-1 << 40)));
        assert_eq!(headers.get("ratio"), Some(HeaderValue::Float(0.5)));
        assert_eq!(headers.get("flag"), Some(HeaderValue::Bool(true)));
        assert_eq!(headers.get("at"), Some(HeaderValue::Timestamp(1_700_000_000)));
        assert_eq!(headers.get("nested"), Some(HeaderValue::Other));
        // Bytes that are not UTF-8 are replaced, not refused: headers are
        // untrusted, and reading one must not fail the message.
        assert_eq!(headers.get("bytes"), Some(HeaderValue::Text("\u{fffd}a".into())));
        assert_eq!(headers.get("missing"), None);
        assert!(headers.contains("flag") && !headers.contains("missing"));
        assert_eq!(headers.len(), 9);
        assert_eq!(headers.iter().count(), 9);
    }
}
