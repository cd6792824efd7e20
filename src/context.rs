//! [`MessageContext`]: what a handler knows of the message it handles,
//! through its unit of work.

use std::sync::Arc;

use lapin::types::FieldTable;
use uuid::Uuid;

use crate::envelope::Envelope;
use crate::fault::{MAX_VALUE_BYTES, truncate};
use crate::trace::TraceContext;

/// The header that ties together every message of one flow: copied from
/// the message a follow-up is staged for, or that message's own id.
pub const CORRELATION_ID: &str = "correlation_id";
/// The header that names the message a follow-up was staged for.
pub const CAUSATION_ID: &str = "causation_id";

/// One message being handled: its identity and where it came from. Read it
/// in a handler with [`UnitOfWork::context`](crate::UnitOfWork::context)
/// (one message) or [`UnitOfWork::contexts`](crate::UnitOfWork::contexts)
/// (a batch, in the order of its events).
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
    pub fn of(envelope: &Arc<Envelope>) -> Self {
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
    pub fn headers(&self) -> &FieldTable {
        &self.envelope.headers
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
