//! The envelope: one delivery decoded per the wire-format contract, before
//! its body is read as any particular event.

use std::fmt;

use lapin::BasicProperties;
use lapin::types::FieldTable;
use uuid::Uuid;

use crate::amqp::JSON;
use crate::event::{IntegrationEvent, Message};
use crate::trace::TraceContext;

/// A delivery decoded per the wire contract: `message_id` (a UUID, the dedup
/// key) and `type` (routes to handlers) are required, the body is JSON.
#[derive(Debug, Clone)]
pub struct Envelope {
    /// The event's id, from the AMQP `message_id` property.
    pub message_id: Uuid,
    /// The event's type name, from the AMQP `type` property.
    pub event_type: String,
    /// The JSON body, not yet deserialized.
    pub body: Vec<u8>,
    /// The AMQP headers, as received.
    pub headers: FieldTable,
    /// Whether the broker says it delivered this message before.
    pub redelivered: bool,
    /// Which attempt this is, from 1: counted over every delivery of the
    /// message (its fault headers) and every immediate retry.
    pub attempt: u32,
    /// The publisher's trace context, from its `traceparent` and
    /// `tracestate` headers, if valid.
    pub trace: Option<TraceContext>,
    /// With MassTransit's wire: where the message comes from, as its
    /// envelope says (correlation, conversation, initiator, source).
    pub masstransit: Option<crate::masstransit::Context>,
    /// With MassTransit's wire: the address of the queue it was consumed
    /// from, as MassTransit writes it: the source of its follow-ups.
    pub input_address: Option<String>,
    /// The event, once decoded from `body` before its transaction, for the
    /// handler actor to take: the body is parsed once per attempt, not
    /// once to check it and again to handle it.
    pub decoded: DecodedEvent,
    /// The span all work on this message runs in, named `process {queue}`
    /// after OpenTelemetry's messaging conventions (`messaging.system`,
    /// `messaging.destination.name`, `messaging.message.id`,
    /// `messaging.operation.type`,
    /// `messaging.rabbitmq.destination.routing_key`), with `message_id`,
    /// `type`, `consumer`, `redelivered`, `attempt` and `trace_id` for logs.
    /// A child of the publisher's context (with the `opentelemetry`
    /// feature).
    pub span: tracing::Span,
}

/// The event of an [`Envelope`], decoded before its transaction and taken
/// once by the handlers' first attempt. A copy of the envelope (a retry's,
/// which carries its own attempt number) starts empty and decodes again.
#[derive(Default)]
pub struct DecodedEvent(std::sync::Mutex<Option<Box<dyn std::any::Any + Send>>>);

impl DecodedEvent {
    /// Holds `event` for the handlers.
    pub fn set(&self, event: Box<dyn std::any::Any + Send>) {
        if let Ok(mut slot) = self.0.lock() {
            *slot = Some(event);
        }
    }

    /// The event held, if it is an `E` and no one took it yet.
    pub fn take<E: 'static>(&self) -> Option<E> {
        let held = self.0.lock().ok()?.take()?;
        held.downcast::<E>().ok().map(|event| *event)
    }
}

impl Clone for DecodedEvent {
    fn clone(&self) -> Self {
        Self::default()
    }
}

impl std::fmt::Debug for DecodedEvent {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let held = self.0.lock().map(|slot| slot.is_some()).unwrap_or(false);
        f.debug_tuple("DecodedEvent").field(&held).finish()
    }
}

/// Why a delivery is not a valid envelope. Such a delivery can never succeed,
/// so it is set aside (never requeued into a loop).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DecodeError {
    /// The AMQP `message_id` property is absent.
    #[error("no message_id property (the dedup key is required)")]
    MissingMessageId,
    /// The AMQP `message_id` property is not a UUID.
    #[error("message_id `{0}` is not a UUID")]
    InvalidMessageId(String),
    /// The AMQP `type` property is absent or empty.
    #[error("no type property (it routes the message to its handlers)")]
    MissingType,
    /// The content type says the body is not JSON.
    #[error("content_type `{0}` is not application/json")]
    NotJson(String),
    /// Not a MassTransit message (with `message_bus.wire = "masstransit"`).
    #[error("{0}")]
    MassTransit(#[from] crate::masstransit::WireError),
}

impl Envelope {
    /// Decodes a delivery's properties and body, as received by `consumer`.
    /// On success the body moves into the envelope; on error it is left in
    /// `body`, to be set aside as it came.
    pub fn decode(
        properties: &BasicProperties,
        body: &mut Vec<u8>,
        redelivered: bool,
        consumer: &str,
    ) -> Result<Self, DecodeError> {
        let raw_id = properties
            .message_id()
            .as_ref()
            .ok_or(DecodeError::MissingMessageId)?;
        let message_id = Uuid::try_parse(raw_id.as_str())
            .map_err(|_| DecodeError::InvalidMessageId(raw_id.as_str().to_owned()))?;
        let event_type = match properties.kind() {
            Some(kind) if !kind.as_str().is_empty() => kind.as_str().to_owned(),
            _ => return Err(DecodeError::MissingType),
        };
        // Absent is accepted: not every publisher sets it, and the body is
        // checked as JSON anyway when it is deserialized.
        if let Some(content_type) = properties.content_type()
            && !content_type.as_str().starts_with(JSON)
        {
            return Err(DecodeError::NotJson(content_type.as_str().to_owned()));
        }
        let headers = properties.headers().clone().unwrap_or_default();
        let trace = TraceContext::from_headers(&headers);
        Ok(Self {
            span: span(message_id, &event_type, consumer, redelivered, trace.as_ref()),
            message_id,
            event_type,
            body: std::mem::take(body),
            headers,
            redelivered,
            attempt: 1,
            trace,
            masstransit: None,
            input_address: None,
            decoded: DecodedEvent::default(),
        })
    }

    /// Decodes a delivery as MassTransit 8 writes it (see
    /// [`crate::masstransit::decode`]), as received by `consumer`. Its type
    /// is the first of its message types that `handled` takes (the queue's
    /// handled types), else the first (or none): then no handler takes it,
    /// and it is skipped. Raw JSON that names no type is the queue's one
    /// type, as MassTransit hands it to the endpoint's consumers; on a
    /// queue of several types it is malformed. The body becomes the
    /// envelope's `message`. `raw_json`: `queues[].raw_json`.
    pub(crate) fn decode_masstransit(
        properties: &BasicProperties,
        body: &[u8],
        raw_json: bool,
        redelivered: bool,
        consumer: &str,
        handled: &crate::actors::HandledTypes,
    ) -> Result<Self, DecodeError> {
        let decoded = crate::masstransit::decode(properties, body, raw_json)?;
        let types = &decoded.context.message_types;
        let event_type = if types.is_empty() && decoded.context.raw {
            match handled.names().as_slice() {
                [only] => (*only).to_owned(),
                several => {
                    return Err(crate::masstransit::WireError::UntypedRaw(several.join(", ")).into());
                }
            }
        } else {
            // No type at all: none that a handler takes, so skipped, as
            // MassTransit skips it.
            types
                .iter()
                .find(|name| handled.contains(name))
                .or(types.first())
                .cloned()
                .unwrap_or_default()
        };
        let headers = properties.headers().clone().unwrap_or_default();
        let trace = crate::masstransit::trace_of(&decoded.context, &headers);
        // The body as it came stays where it was: a copy set aside must be
        // the message MassTransit sent.
        Ok(Self {
            span: span(
                decoded.message_id,
                &event_type,
                consumer,
                redelivered,
                trace.as_ref(),
            ),
            message_id: decoded.message_id,
            event_type,
            body: decoded.message,
            headers,
            redelivered,
            attempt: 1,
            trace,
            masstransit: Some(decoded.context),
            input_address: None,
            decoded: DecodedEvent::default(),
        })
    }

    /// Records where it was consumed in its span: the queue (its name is
    /// the span's) and the routing key it was published with.
    pub fn consumed_from(&self, queue: &str, routing_key: &str) {
        if self.span.is_disabled() {
            // Filtered out: no name to format, per message.
            return;
        }
        self.span.record(
            "otel.name",
            tracing::field::display(format_args!("process {queue}")),
        );
        self.span.record("messaging.destination.name", queue);
        self.span
            .record("messaging.rabbitmq.destination.routing_key", routing_key);
    }

    /// Marks it as attempt `attempt`, in its span too.
    pub fn set_attempt(&mut self, attempt: u32) {
        self.attempt = attempt;
        self.span.record("attempt", attempt);
    }

    /// The envelope of a message published in process, for `consumer`.
    pub fn from_message<E: IntegrationEvent>(message: &Message<E>, consumer: &str) -> crate::Result<Self> {
        let trace = TraceContext::current(None);
        message.own_headers()?;
        let mut headers = message.header_table();
        if let Some(trace) = &trace {
            trace.insert_into(&mut headers);
        }
        let envelope = Self {
            span: span(message.id, E::TYPE, consumer, false, trace.as_ref()),
            message_id: message.id,
            event_type: E::TYPE.to_owned(),
            body: message.to_json()?,
            headers,
            redelivered: false,
            attempt: 1,
            trace,
            masstransit: None,
            input_address: None,
            decoded: DecodedEvent::default(),
        };
        envelope.consumed_from(consumer, consumer);
        Ok(envelope)
    }
}

impl Envelope {
    /// The envelope of a message staged with
    /// [`UnitOfWork::publish`](crate::UnitOfWork::publish), delivered in
    /// process to `consumer`.
    pub fn from_outgoing(outgoing: &crate::outbox::staging::Outgoing, consumer: &str) -> Self {
        let headers = outgoing.amqp_headers();
        let trace = TraceContext::from_headers(&headers);
        let envelope = Self {
            span: span(
                outgoing.message_id,
                &outgoing.message_type,
                consumer,
                false,
                trace.as_ref(),
            ),
            message_id: outgoing.message_id,
            event_type: outgoing.message_type.clone(),
            body: outgoing.body.clone(),
            headers,
            redelivered: false,
            attempt: 1,
            trace,
            masstransit: None,
            input_address: None,
            decoded: DecodedEvent::default(),
        };
        envelope.consumed_from(consumer, &outgoing.routing_key);
        envelope
    }
}

fn span(
    message_id: Uuid,
    event_type: &str,
    consumer: &str,
    redelivered: bool,
    trace: Option<&TraceContext>,
) -> tracing::Span {
    use tracing::field::Empty;
    // The queue and routing key are recorded by `consumed_from`; `attempt`
    // by the consumer, from the message's failure history, before each
    // attempt.
    let span = tracing::info_span!(
        "process",
        otel.name = Empty,
        otel.kind = "consumer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "process",
        messaging.destination.name = Empty,
        messaging.message.id = %message_id,
        messaging.rabbitmq.destination.routing_key = Empty,
        %message_id,
        r#type = event_type,
        consumer,
        redelivered,
        attempt = Empty,
        trace_id = Empty,
    );
    if let Some(trace) = trace {
        trace.adopt(&span);
    }
    span
}

/// The properties that identify a delivery in a log line, valid or not.
#[derive(Debug)]
pub(crate) struct DeliveryLabel<'a>(pub &'a BasicProperties);

impl fmt::Display for DeliveryLabel<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let text = |v: &Option<lapin::types::ShortString>| v.as_ref().map(|s| s.as_str().to_owned());
        write!(
            f,
            "message_id={:?} type={:?} content_type={:?}",
            text(self.0.message_id()),
            text(self.0.kind()),
            text(self.0.content_type()),
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn props(id: Option<&str>, kind: Option<&str>) -> BasicProperties {
        let mut p = BasicProperties::default().with_content_type(JSON.into());
        if let Some(id) = id {
            p = p.with_message_id(id.into());
        }
        if let Some(kind) = kind {
            p = p.with_type(kind.into());
        }
        p
    }

    #[test]
    fn decodes_a_well_formed_delivery() {
        let id = Uuid::now_v7();
        let env = Envelope::decode(
            &props(Some(&id.to_string()), Some("T")),
            &mut b"{}".to_vec(),
            true,
            "c",
        )
        .unwrap();
        assert_eq!(
            (env.message_id, env.event_type.as_str(), env.redelivered),
            (id, "T", true)
        );
    }

    #[test]
    fn reads_the_publishers_trace_context_and_ignores_an_invalid_one() {
        let id = Uuid::now_v7().to_string();
        let traced = |traceparent: &str| {
            let mut headers = FieldTable::default();
            headers.insert(
                crate::trace::TRACEPARENT.into(),
                lapin::types::AMQPValue::LongString(traceparent.into()),
            );
            let properties = props(Some(&id), Some("T")).with_headers(headers);
            Envelope::decode(&properties, &mut b"{}".to_vec(), false, "c").unwrap()
        };
        let valid = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
        assert_eq!(
            traced(valid).trace.map(|t| t.trace_id().to_owned()).as_deref(),
            Some("4bf92f3577b34da6a3ce929d0e0e4736")
        );
        assert_eq!(traced("00-not-a-trace-01").trace, None);
    }

    #[test]
    fn rejects_each_malformed_kind_with_its_reason() {
        let id = Uuid::now_v7().to_string();
        let decode = |p: BasicProperties| {
            let mut body = b"kept".to_vec();
            let err = Envelope::decode(&p, &mut body, false, "c").unwrap_err();
            assert_eq!(body, b"kept", "the body stays for the error queue");
            err
        };
        assert_eq!(decode(props(None, Some("T"))), DecodeError::MissingMessageId);
        assert_eq!(
            decode(props(Some("42"), Some("T"))),
            DecodeError::InvalidMessageId("42".into())
        );
        assert_eq!(decode(props(Some(&id), None)), DecodeError::MissingType);
        assert_eq!(decode(props(Some(&id), Some(""))), DecodeError::MissingType);
        let xml = props(Some(&id), Some("T")).with_content_type("text/xml".into());
        assert_eq!(decode(xml), DecodeError::NotJson("text/xml".into()));
    }
}
