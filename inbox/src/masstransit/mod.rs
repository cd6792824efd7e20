//! MassTransit's wire format on RabbitMQ, as version 8.5 writes and reads
//! it (`message_bus.wire = "masstransit"`).
//!
//! Every fact here was read in MassTransit's source at tag v8.5.8 (commit
//! c1e5caa9; 8.5.0 to 8.5.8 do not differ in these files); each item names
//! its file. Paths are under `src/`: `MassTransit.Abstractions/` (ABS),
//! `MassTransit/` (MT), `Transports/MassTransit.RabbitMqTransport/` (RMQ).
//! Nothing is taken from MassTransit 9.
//!
//! Beside this file: `any_case.rs`, reading a message's fields in any case
//! as MassTransit's deserializer does.

mod any_case;

pub(crate) use any_case::from_slice as from_slice_any_case;

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use std::borrow::Cow;

use serde::{Deserialize, Serialize};
use serde_json::value::RawValue;
use uuid::Uuid;

/// The content type of MassTransit's default serializer, the JSON
/// envelope (MT/Serialization/SystemTextJsonMessageSerializer.cs,
/// `JsonContentType`). MassTransit sets it as the AMQP `content_type`
/// (RMQ/RabbitMqTransport/RabbitMqSendTransportContext.cs).
pub const ENVELOPE_CONTENT_TYPE: &str = "application/vnd.masstransit+json";

/// The content type of MassTransit's raw JSON serializer: the body is the
/// message alone, its metadata in headers
/// (MT/Serialization/SystemTextJsonRawMessageSerializer.cs).
pub const RAW_JSON_CONTENT_TYPE: &str = "application/json";

/// The prefix of a message type's URN (ABS/MessageUrn.cs, `Prefix`).
pub(crate) const URN_PREFIX: &str = "urn:message:";

/// The headers MassTransit reads and writes (ABS/MessageHeaders.cs).
pub mod headers {
    /// Why a message was moved: [`REASON_FAULT`] to `Q_error`,
    /// [`REASON_DEAD_LETTER`] to `Q_skipped`.
    pub(crate) const REASON: &str = "MT-Reason";
    /// `MT-Reason` of a message moved to the error queue
    /// (MT/Middleware/Rescue/RescueExceptionReceiveContext.cs via
    /// ABS/Contexts/SendContextExtensions.cs `SetExceptionHeaders`).
    pub(crate) const REASON_FAULT: &str = "fault";
    /// `MT-Reason` of a message no consumer took, moved to the skipped
    /// queue (MT/Middleware/DeadLetterTransportFilter.cs).
    pub(crate) const REASON_DEAD_LETTER: &str = "dead-letter";
    /// The exception's type name (`System.InvalidOperationException`).
    pub(crate) const FAULT_EXCEPTION_TYPE: &str = "MT-Fault-ExceptionType";
    /// The exception's message, at most 2,048 characters.
    pub(crate) const FAULT_MESSAGE: &str = "MT-Fault-Message";
    /// When it failed: `DateTime.UtcNow.ToString("O")`
    /// (`2025-06-20T13:10:25.1234567Z`).
    pub(crate) const FAULT_TIMESTAMP: &str = "MT-Fault-Timestamp";
    /// The stack trace, at most 2,048 characters (may be empty).
    pub(crate) const FAULT_STACK_TRACE: &str = "MT-Fault-StackTrace";
    /// The input address of the endpoint it failed on.
    pub(crate) const FAULT_INPUT_ADDRESS: &str = "MT-Fault-InputAddress";
    /// The consumer that failed (its dotted type name).
    pub(crate) const FAULT_CONSUMER_TYPE: &str = "MT-Fault-ConsumerType";
    /// The message type it failed as (its dotted type name).
    pub(crate) const FAULT_MESSAGE_TYPE: &str = "MT-Fault-MessageType";
    /// In-process retries before it faulted; an integer, only when above 0.
    pub(crate) const FAULT_RETRY_COUNT: &str = "MT-Fault-RetryCount";
    /// Delayed redeliveries so far (an integer), in the envelope's and the
    /// AMQP headers (ABS/Contexts/SendContextExtensions.cs
    /// `ApplyRedeliveryOptions`).
    pub(crate) const REDELIVERY_COUNT: &str = "MT-Redelivery-Count";
    /// The headers a move to `Q_error`, `Q_skipped` or a delay tier
    /// writes: what a replay removes, so that the failure policy starts
    /// afresh.
    pub(crate) const SET_ASIDE: [&str; 11] = [
        REASON,
        FAULT_EXCEPTION_TYPE,
        FAULT_MESSAGE,
        FAULT_TIMESTAMP,
        FAULT_STACK_TRACE,
        FAULT_INPUT_ADDRESS,
        FAULT_CONSUMER_TYPE,
        FAULT_MESSAGE_TYPE,
        FAULT_RETRY_COUNT,
        REDELIVERY_COUNT,
        FAULT_REDELIVERY_COUNT,
    ];
    /// The host that moved a message to `Q_error` or `Q_skipped`
    /// ([`stamp_host`](super::stamp_host)): what a replay removes too.
    pub(crate) const HOST: [&str; 8] = [
        "MT-Host-MachineName",
        "MT-Host-ProcessName",
        "MT-Host-ProcessId",
        "MT-Host-Assembly",
        "MT-Host-AssemblyVersion",
        "MT-Host-MassTransitVersion",
        "MT-Host-FrameworkVersion",
        "MT-Host-OperatingSystemVersion",
    ];
    /// Raw JSON: the message id.
    pub(crate) const MESSAGE_ID: &str = "MessageId";
    /// Raw JSON: the correlation id.
    pub(crate) const CORRELATION_ID: &str = "CorrelationId";
    /// Raw JSON: the conversation id.
    pub(crate) const CONVERSATION_ID: &str = "ConversationId";
    /// Raw JSON: the request id.
    pub(crate) const REQUEST_ID: &str = "RequestId";
    /// Raw JSON: the initiator id.
    pub(crate) const INITIATOR_ID: &str = "MT-InitiatorId";
    /// The trace context of the activity that sent it: its W3C id,
    /// `00-<trace id>-<span id>-<flags>`, in the envelope's and the AMQP
    /// headers (MT/Logging/Diagnostics/DiagnosticHeaders.cs `ActivityId`,
    /// LogContextActivityExtensions.cs).
    pub(crate) const ACTIVITY_ID: &str = "MT-Activity-Id";
    /// Raw JSON: the source address.
    pub(crate) const SOURCE_ADDRESS: &str = "MT-Source-Address";
    /// Raw JSON: where responses go.
    pub(crate) const RESPONSE_ADDRESS: &str = "MT-Response-Address";
    /// Raw JSON: where faults go.
    pub(crate) const FAULT_ADDRESS: &str = "MT-Fault-Address";
    /// On a `Fault<T>`: the delayed redeliveries of the faulted message
    /// (MT/Contexts/ConsumeContextEndpointExtensions.cs `FaultPipe`).
    pub(crate) const FAULT_REDELIVERY_COUNT: &str = "MT-Fault-RedeliveryCount";
    /// Raw JSON: the message types, URNs joined by `;`.
    pub const MESSAGE_TYPE: &str = "MT-MessageType";
}

/// The JSON envelope (MT/Serialization/JsonMessageEnvelope.cs): fields in
/// MassTransit's order, camelCase. MassTransit writes every one, `null`
/// when unset; reading, only `messageId`, `messageType` and `message`
/// matter here.
#[derive(Debug, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct JsonEnvelope {
    /// The message id: the dedup key.
    pub message_id: Option<String>,
    /// The request id, for request/response.
    #[serde(default)]
    pub request_id: Option<String>,
    /// The correlation id.
    #[serde(default)]
    pub correlation_id: Option<String>,
    /// The conversation: one per flow of messages.
    #[serde(default)]
    pub conversation_id: Option<String>,
    /// The message that caused this one.
    #[serde(default)]
    pub initiator_id: Option<String>,
    /// The address of the endpoint that sent it.
    #[serde(default)]
    pub source_address: Option<String>,
    /// Where it was sent (an exchange's address).
    #[serde(default)]
    pub destination_address: Option<String>,
    /// Where responses go.
    #[serde(default)]
    pub response_address: Option<String>,
    /// Where faults go.
    #[serde(default)]
    pub fault_address: Option<String>,
    /// The message's types as URNs, most specific first.
    #[serde(default)]
    pub message_type: Vec<String>,
    /// The message itself, as its JSON text.
    pub message: Option<Box<RawValue>>,
    /// When it expires, if it does.
    #[serde(default)]
    pub expiration_time: Option<String>,
    /// When it was sent (ISO 8601, UTC).
    #[serde(default)]
    pub sent_time: Option<String>,
    /// Headers, also written as AMQP headers.
    #[serde(default)]
    pub headers: serde_json::Map<String, serde_json::Value>,
    /// The sending host (ABS/Contracts/HostInfo.cs).
    #[serde(default)]
    pub host: Option<serde_json::Value>,
}

/// What a MassTransit delivery carries, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IncomingEnvelope {
    /// The message id (envelope `messageId`, or the raw `MessageId`).
    pub message_id: Uuid,
    /// The message's JSON: the envelope's `message`, or the raw body.
    pub message: Vec<u8>,
    /// Where it comes from, as the envelope says.
    pub context: Context,
}

/// Where a MassTransit message comes from: what a handler sees of it
/// beside the id (untrusted text, as sent).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Context {
    /// Its type names (`Namespace:Type`), most specific first: every type
    /// the producer says it is (its class, base classes, interfaces). None
    /// when it says none in the `urn:message:` form.
    pub message_types: Vec<String>,
    /// Its correlation id, if any.
    pub correlation_id: Option<String>,
    /// Its conversation id, if any.
    pub conversation_id: Option<String>,
    /// Its initiator id, if any.
    pub initiator_id: Option<String>,
    /// The address of the endpoint that sent it, if any.
    pub source_address: Option<String>,
    /// Its request id, if any.
    pub request_id: Option<String>,
    /// Where its faults go, if it says (`faultAddress`).
    pub fault_address: Option<String>,
    /// Where its responses go, if it says (`responseAddress`): its faults
    /// too, when it names no fault address.
    pub response_address: Option<String>,
    /// The envelope's `headers` object, as its JSON text: what
    /// MassTransit's consumers read as the message's headers. `None` when
    /// absent, `null` or empty, and for raw JSON, whose headers are its
    /// AMQP headers.
    pub headers: Option<String>,
    /// Whether it came as raw JSON (its metadata in AMQP headers).
    pub raw: bool,
}

/// Why a delivery is not a MassTransit message.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum WireError {
    /// The body is not a JSON envelope.
    #[error("body is not a MassTransit envelope: {0}")]
    NotAnEnvelope(String),
    /// No message id, or one that is not a GUID.
    #[error("no valid messageId (a GUID is required: it is the dedup key): {0}")]
    InvalidMessageId(String),
    /// The envelope has no `message`.
    #[error("the envelope has no message")]
    NoMessage,
    /// Raw JSON without `MT-MessageType` on a queue whose handlers take
    /// several types: which one it is cannot be told.
    #[error(
        "raw JSON without an MT-MessageType header, on a queue that handles several types ({0}): \
         name the type in MT-MessageType, or give the queue one type (queues[].event_types)"
    )]
    UntypedRaw(String),
}

/// `urn:message:{name}` for a type named `Namespace:Type`.
pub fn message_urn(name: &str) -> String {
    format!("{URN_PREFIX}{name}")
}

/// The type name in a message type URN, if it is one.
pub(crate) fn type_of_urn(urn: &str) -> Option<&str> {
    urn.strip_prefix(URN_PREFIX).filter(|name| !name.is_empty())
}

/// Decodes a delivery as MassTransit 8.5 reads it: raw JSON when the
/// endpoint reads raw JSON (`raw_json`, MassTransit's
/// `UseRawJsonDeserializer()`) and the content type is `application/json`,
/// its metadata in the `MessageId` and `MT-MessageType` headers, the AMQP
/// `message_id` standing in for a missing `MessageId`; otherwise the JSON
/// envelope, whatever the content type says or if it says nothing:
/// MassTransit falls back to its default deserializer, the envelope's, for
/// a content type it has no deserializer for
/// (MT/Configuration/Configuration/SerializationConfiguration.cs,
/// `AddDeserializer(factory, true)`).
pub fn decode(
    properties: &BasicProperties,
    body: &[u8],
    raw_json: bool,
) -> Result<IncomingEnvelope, WireError> {
    if is_raw_json(properties, raw_json) {
        decode_raw(properties, body)
    } else {
        decode_envelope(body)
    }
}

/// Whether a delivery with `properties` is read as raw JSON on an endpoint
/// that reads it (`raw_json`): its content type's media type is
/// `application/json`, in any case and whatever its parameters
/// (`application/json; charset=utf-8`), as .NET's `ContentType` compares
/// media types.
pub(crate) fn is_raw_json(properties: &BasicProperties, raw_json: bool) -> bool {
    raw_json
        && properties.content_type().as_ref().is_some_and(|content_type| {
            let media_type = content_type.as_str().split(';').next().unwrap_or_default();
            media_type.trim().eq_ignore_ascii_case(RAW_JSON_CONTENT_TYPE)
        })
}

/// An envelope's fields, found by name in any case: MassTransit reads with
/// `PropertyNameCaseInsensitive = true`
/// (MT/Serialization/SystemTextJsonMessageSerializer.cs), so an envelope
/// written with the PascalCase naming policy, or by Newtonsoft, reads the
/// same.
enum EnvelopeFields<'a> {
    /// Written as MassTransit writes it (camelCase, no other field): the
    /// common form, read in one pass with no map.
    Camel(CamelEnvelope<'a>),
    /// Any other spelling: every field by name.
    AnyCase(std::collections::BTreeMap<Cow<'a, str>, &'a RawValue>),
}

/// The fields of MassTransit's envelope (MT/Serialization/JsonMessageEnvelope.cs)
/// as it writes them, those the runtime reads as their text, borrowed from
/// the body: one pass over it, no copy but the ones kept. Any other field,
/// one in another case, or a text with an escape in it (it cannot be
/// borrowed) makes this fail, and the envelope is read by name instead.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
#[expect(
    dead_code,
    reason = "the fields the runtime does not read are named only to be allowed"
)]
struct CamelEnvelope<'a> {
    #[serde(borrow)]
    message_id: Option<&'a str>,
    #[serde(borrow)]
    correlation_id: Option<&'a str>,
    #[serde(borrow)]
    conversation_id: Option<&'a str>,
    #[serde(borrow)]
    initiator_id: Option<&'a str>,
    #[serde(borrow)]
    source_address: Option<&'a str>,
    #[serde(borrow)]
    message_type: Option<Vec<&'a str>>,
    #[serde(borrow)]
    message: Option<&'a RawValue>,
    #[serde(borrow)]
    request_id: Option<&'a str>,
    #[serde(borrow)]
    headers: Option<&'a RawValue>,
    #[serde(default)]
    destination_address: serde::de::IgnoredAny,
    #[serde(borrow)]
    response_address: Option<&'a str>,
    #[serde(borrow)]
    fault_address: Option<&'a str>,
    #[serde(default)]
    expiration_time: serde::de::IgnoredAny,
    #[serde(default)]
    sent_time: serde::de::IgnoredAny,
    #[serde(default)]
    host: serde::de::IgnoredAny,
}

impl<'a> EnvelopeFields<'a> {
    fn read(body: &'a [u8]) -> Result<Self, WireError> {
        if let Ok(camel) = serde_json::from_slice(body) {
            return Ok(Self::Camel(camel));
        }
        serde_json::from_slice(body)
            .map(Self::AnyCase)
            .map_err(|e| WireError::NotAnEnvelope(e.to_string()))
    }

    /// Text field `name` (as MassTransit spells it), `None` when absent or
    /// `null`.
    fn text(&self, name: &str) -> Result<Option<Cow<'a, str>>, WireError> {
        match self {
            Self::Camel(envelope) => Ok(match name {
                "messageId" => envelope.message_id,
                "correlationId" => envelope.correlation_id,
                "conversationId" => envelope.conversation_id,
                "initiatorId" => envelope.initiator_id,
                "sourceAddress" => envelope.source_address,
                "requestId" => envelope.request_id,
                "faultAddress" => envelope.fault_address,
                "responseAddress" => envelope.response_address,
                _ => None,
            }
            .map(Cow::Borrowed)),
            Self::AnyCase(_) => Ok(self.parse::<String>(name)?.map(Cow::Owned)),
        }
    }

    /// The type names of `messageType`'s URNs; none when it is absent or
    /// `null`, which MassTransit skips (no consumer takes it) rather than
    /// fails.
    fn message_types(&self) -> Result<Vec<String>, WireError> {
        Ok(match self {
            Self::Camel(envelope) => type_names(envelope.message_type.iter().flatten().copied()),
            Self::AnyCase(_) => {
                let urns: Vec<String> = self.parse("messageType")?.unwrap_or_default();
                type_names(urns.iter().map(String::as_str))
            }
        })
    }

    /// The message, as it is in the body.
    fn message(&self) -> Option<&'a RawValue> {
        match self {
            Self::Camel(envelope) => envelope.message,
            Self::AnyCase(_) => self.get("message"),
        }
    }

    /// The `headers` object's text, `None` when absent, `null` or empty.
    fn headers(&self) -> Option<&'a RawValue> {
        match self {
            Self::Camel(envelope) => envelope.headers.filter(|h| h.get() != "null"),
            Self::AnyCase(_) => self.get("headers"),
        }
        .filter(|h| !h.get().trim_start_matches('{').trim_start().starts_with('}'))
    }

    /// Field `name` in any case, `None` when absent or `null` (read by
    /// name only).
    fn get(&self, name: &str) -> Option<&'a RawValue> {
        let Self::AnyCase(fields) = self else {
            return None;
        };
        let value = match fields.get(name) {
            Some(value) => *value,
            None => *fields.iter().find(|(key, _)| key.eq_ignore_ascii_case(name))?.1,
        };
        (value.get() != "null").then_some(value)
    }

    /// Field `name` as `T`, `None` when absent or `null` (read by name only).
    fn parse<T: serde::de::DeserializeOwned>(&self, name: &str) -> Result<Option<T>, WireError> {
        self.get(name)
            .map(|value| serde_json::from_str(value.get()))
            .transpose()
            .map_err(|e| WireError::NotAnEnvelope(format!("`{name}`: {e}")))
    }
}

fn decode_envelope(body: &[u8]) -> Result<IncomingEnvelope, WireError> {
    let envelope = EnvelopeFields::read(body)?;
    let raw_id = envelope
        .text("messageId")
        .map_err(|e| WireError::InvalidMessageId(e.to_string()))?
        .unwrap_or_default();
    // The envelope's id, whatever the AMQP `message_id` says: MassTransit
    // reads the envelope's (MT/Serialization/EnvelopeMessageContext.cs).
    let message_id =
        Uuid::try_parse(&raw_id).map_err(|_| WireError::InvalidMessageId(raw_id.clone().into_owned()))?;
    let message_types = envelope.message_types()?;
    let message = envelope.message().ok_or(WireError::NoMessage)?;
    let owned = |text: Option<Cow<'_, str>>| text.map(Cow::into_owned);
    Ok(IncomingEnvelope {
        message_id,
        message: message.get().as_bytes().to_vec(),
        context: Context {
            message_types,
            correlation_id: owned(envelope.text("correlationId")?),
            conversation_id: owned(envelope.text("conversationId")?),
            initiator_id: owned(envelope.text("initiatorId")?),
            source_address: owned(envelope.text("sourceAddress")?),
            request_id: owned(envelope.text("requestId")?),
            fault_address: owned(envelope.text("faultAddress")?),
            response_address: owned(envelope.text("responseAddress")?),
            headers: envelope.headers().map(|h| h.get().to_owned()),
            raw: false,
        },
    })
}

fn decode_raw(properties: &BasicProperties, body: &[u8]) -> Result<IncomingEnvelope, WireError> {
    let table = properties.headers().clone().unwrap_or_default();
    let header = |key: &str| text(&table, key);
    let raw_id = header(headers::MESSAGE_ID)
        .or_else(|| properties.message_id().as_ref().map(|id| id.as_str().to_owned()))
        .unwrap_or_default();
    let message_id = Uuid::try_parse(&raw_id).map_err(|_| WireError::InvalidMessageId(raw_id.clone()))?;
    let types = header(headers::MESSAGE_TYPE).unwrap_or_default();
    Ok(IncomingEnvelope {
        message_id,
        message: body.to_vec(),
        context: Context {
            message_types: type_names(types.split(';')),
            correlation_id: header(headers::CORRELATION_ID).or_else(|| {
                properties
                    .correlation_id()
                    .as_ref()
                    .map(|c| c.as_str().to_owned())
            }),
            conversation_id: header(headers::CONVERSATION_ID),
            initiator_id: header(headers::INITIATOR_ID),
            source_address: header(headers::SOURCE_ADDRESS),
            request_id: header(headers::REQUEST_ID),
            fault_address: header(headers::FAULT_ADDRESS),
            response_address: header(headers::RESPONSE_ADDRESS),
            headers: None,
            raw: true,
        },
    })
}

/// The type names of `urns`, in order; none when no URN is in the
/// `urn:message:` form.
fn type_names<'a>(urns: impl Iterator<Item = &'a str>) -> Vec<String> {
    urns.filter_map(|urn| type_of_urn(urn.trim()))
        .map(str::to_owned)
        .collect()
}

/// A header's text, as MassTransit writes ids and addresses.
fn text(table: &FieldTable, key: &str) -> Option<String> {
    match table.inner().get(key)? {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
    .filter(|s| !s.is_empty())
}

/// The address of `entity` (a queue, or an exchange) on the broker at
/// `host`:`port`, virtual host `vhost`, as MassTransit writes it
/// (RMQ/RabbitMqEndpointAddress.cs): `rabbitmq://host/entity`, the port
/// only when not 5672, the virtual host only when not `/` (escaped).
pub(crate) fn address(host: &str, port: u16, vhost: &str, entity: &str) -> String {
    let authority = match port {
        5672 => host.to_owned(),
        port => format!("{host}:{port}"),
    };
    match vhost {
        "/" | "" => format!("rabbitmq://{authority}/{entity}"),
        vhost => format!("rabbitmq://{authority}/{}/{entity}", escape(vhost)),
    }
}

/// `Uri.EscapeDataString`: everything but RFC 3986's unreserved characters
/// percent-encoded.
fn escape(text: &str) -> String {
    crate::settings::percent_encode(text)
}

/// A failure, as MassTransit's error queue headers say it.
#[derive(Debug, Clone)]
pub(crate) struct Fault<'a> {
    /// The failure's text (`MT-Fault-Message`).
    pub message: &'a str,
    /// What failed, in MassTransit's place of an exception type
    /// (`MT-Fault-ExceptionType`).
    pub exception_type: &'a str,
    /// The handler, or the runtime's stage, that failed
    /// (`MT-Fault-ConsumerType`).
    pub consumer_type: &'a str,
    /// The message's type name (`Namespace:Type`); written dotted, as .NET
    /// names it (`MT-Fault-MessageType`).
    pub message_type: &'a str,
    /// The consumed queue's address (`MT-Fault-InputAddress`).
    pub input_address: &'a str,
    /// Attempts before the last one (`MT-Fault-RetryCount`, when above 0).
    pub retries: u32,
    /// When (`MT-Fault-Timestamp`, ISO 8601 in UTC).
    pub timestamp: &'a str,
}

/// The longest fault text MassTransit writes (2,048 characters; the
/// runtime cuts bytes, on a character boundary).
const MAX_FAULT_TEXT: usize = 2048;

/// Stamps `fault` as MassTransit's error transport does on the copy it
/// moves to `Q_error` (ABS/Contexts/SendContextExtensions.cs
/// `SetExceptionHeaders`, RMQ/RabbitMqTransport/RabbitMqErrorTransport.cs).
pub(crate) fn stamp_fault(headers: &mut FieldTable, fault: &Fault<'_>) {
    let text =
        |value: &str| AMQPValue::LongString(crate::fault::truncate(value, MAX_FAULT_TEXT).as_ref().into());
    headers.insert(headers::REASON.into(), text(headers::REASON_FAULT));
    headers.insert(headers::FAULT_EXCEPTION_TYPE.into(), text(fault.exception_type));
    headers.insert(headers::FAULT_MESSAGE.into(), text(fault.message));
    headers.insert(headers::FAULT_TIMESTAMP.into(), text(fault.timestamp));
    headers.insert(headers::FAULT_STACK_TRACE.into(), text(""));
    headers.insert(headers::FAULT_INPUT_ADDRESS.into(), text(fault.input_address));
    headers.insert(headers::FAULT_CONSUMER_TYPE.into(), text(fault.consumer_type));
    headers.insert(
        headers::FAULT_MESSAGE_TYPE.into(),
        text(&fault.message_type.replace(':', ".")),
    );
    if fault.retries > 0 {
        headers.insert(
            headers::FAULT_RETRY_COUNT.into(),
            AMQPValue::LongInt(i32::try_from(fault.retries).unwrap_or(i32::MAX)),
        );
    }
}

/// Stamps what MassTransit's dead-letter transport writes on a message no
/// consumer took, moved to `Q_skipped` (MT/Middleware/DeadLetterTransportFilter.cs,
/// RMQ/RabbitMqTransport/RabbitMqDeadLetterTransport.cs).
pub(crate) fn stamp_dead_letter(headers: &mut FieldTable) {
    headers.insert(
        headers::REASON.into(),
        AMQPValue::LongString(headers::REASON_DEAD_LETTER.into()),
    );
}

/// This process, as MassTransit describes the host that moved a message or
/// published a fault (ABS/Metadata/BusHostInfo.cs, ABS/Contracts/HostInfo.cs):
/// the machine, the process and what runs it. Read once.
#[derive(Debug, Serialize)]
#[serde(rename_all = "camelCase")]
pub(crate) struct HostInfo {
    machine_name: String,
    process_name: String,
    process_id: u32,
    assembly: String,
    assembly_version: String,
    framework_version: String,
    mass_transit_version: String,
    operating_system_version: String,
}

/// [`HostInfo`] of this process.
pub(crate) fn host_info() -> &'static HostInfo {
    static HOST: std::sync::OnceLock<HostInfo> = std::sync::OnceLock::new();
    HOST.get_or_init(|| {
        let process_name = std::env::current_exe()
            .ok()
            .and_then(|exe| exe.file_stem().map(|name| name.to_string_lossy().into_owned()))
            .unwrap_or_else(|| "unknown".into());
        let machine_name = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .ok()
            .map(|name| name.trim().to_owned())
            .or_else(|| std::env::var("HOSTNAME").ok())
            .filter(|name| !name.is_empty())
            .unwrap_or_else(|| "unknown".into());
        HostInfo {
            machine_name,
            assembly: process_name.clone(),
            process_name,
            process_id: std::process::id(),
            // The service's own version is not known to the library.
            assembly_version: "Unknown".into(),
            framework_version: "Rust".into(),
            // Not MassTransit: what its tools show in that place.
            mass_transit_version: concat!("inbox ", env!("CARGO_PKG_VERSION")).into(),
            operating_system_version: format!("{} {}", std::env::consts::OS, std::env::consts::ARCH),
        }
    })
}

/// Stamps the `MT-Host-*` headers MassTransit's move transport writes on
/// every copy it moves to `Q_error` or `Q_skipped`
/// (RMQ/RabbitMqTransport/RabbitMqMoveTransport.cs, ABS/Contexts/SendContextExtensions.cs
/// `SetHostHeaders`; names in ABS/MessageHeaders.cs): all text.
pub(crate) fn stamp_host(headers: &mut FieldTable) {
    let host = host_info();
    let process_id = host.process_id.to_string();
    let values = [
        host.machine_name.as_str(),
        host.process_name.as_str(),
        process_id.as_str(),
        host.assembly.as_str(),
        host.assembly_version.as_str(),
        host.mass_transit_version.as_str(),
        host.framework_version.as_str(),
        host.operating_system_version.as_str(),
    ];
    for (key, value) in headers::HOST.into_iter().zip(values) {
        headers.insert(key.into(), AMQPValue::LongString(value.into()));
    }
}

/// `id` if it is a GUID, else `None`: MassTransit parses every id of an
/// envelope as a GUID when it reads it, and throws on one that is not
/// (MT/Serialization/EnvelopeMessageContext.cs: "The Id was not a Guid").
fn guid(id: Option<&str>) -> Option<String> {
    id.and_then(|id| Uuid::try_parse(id).ok())
        .map(|id| id.to_string())
}

/// Stamps a delayed redelivery's count, as MassTransit's delayed
/// redelivery does (`MT-Redelivery-Count`, an integer).
pub(crate) fn stamp_redelivery(headers: &mut FieldTable, count: u32) {
    headers.insert(
        headers::REDELIVERY_COUNT.into(),
        AMQPValue::LongInt(i32::try_from(count).unwrap_or(i32::MAX)),
    );
}

/// `envelope` with `count` as its `MT-Redelivery-Count` header, where
/// MassTransit reads a message's redelivery count: the envelope's own
/// `headers` (ABS/Middleware/RetryContextExtensions.cs reads
/// `ConsumeContext.Headers`, which MT/Serialization/EnvelopeMessageContext.cs
/// takes from the envelope), as its delayed redelivery writes it
/// (ABS/Contexts/SendContextExtensions.cs, from
/// MT/Middleware/DelayedMessageRedeliveryContext.cs). Every
/// other field is kept as it was, to the byte (read as raw JSON); only
/// their order may change. Unchanged when it is no JSON object.
pub(crate) fn with_redelivery_count(envelope: &[u8], count: u32) -> std::borrow::Cow<'_, [u8]> {
    use std::borrow::Cow;
    let Ok(mut fields) =
        serde_json::from_slice::<std::collections::BTreeMap<String, Box<RawValue>>>(envelope)
    else {
        return Cow::Borrowed(envelope);
    };
    let key = fields
        .keys()
        .find(|key| key.eq_ignore_ascii_case("headers"))
        .cloned()
        .unwrap_or_else(|| "headers".to_owned());
    let mut headers: serde_json::Map<String, serde_json::Value> = fields
        .get(&key)
        .and_then(|raw| serde_json::from_str(raw.get()).ok())
        .unwrap_or_default();
    headers.insert(headers::REDELIVERY_COUNT.to_owned(), count.into());
    let Ok(raw) = serde_json::value::to_raw_value(&headers) else {
        return Cow::Borrowed(envelope);
    };
    fields.insert(key, raw);
    serde_json::to_vec(&fields).map_or(Cow::Borrowed(envelope), Cow::Owned)
}

/// The exchange every `Fault<T>` exchange is bound to, as MassTransit's
/// publish topology flattens `Fault<T>`'s hierarchy
/// (RMQ/RabbitMqTransport/Topology/RabbitMqMessagePublishTopology.cs).
pub const FAULT_EXCHANGE: &str = "MassTransit:Fault";

/// The URN of `Fault<T>` for a type named `t` (ABS/MessageUrn.cs: a generic
/// argument always carries its namespace).
pub(crate) fn fault_urn(t: &str) -> String {
    format!("{URN_PREFIX}MassTransit:Fault[[{t}]]")
}

/// The exchange `Fault<T>` is published to, for a type named `t`
/// (MT/Transports/DefaultMessageNameFormatter.cs with RabbitMQ's
/// separators: `--` around the arguments; an argument's namespace is left
/// out when it is the generic type's own, `MassTransit`).
pub fn fault_exchange(t: &str) -> String {
    let argument = t.strip_prefix("MassTransit:").unwrap_or(t);
    format!("{FAULT_EXCHANGE}--{argument}--")
}

/// A `Fault<T>` event, as MassTransit sends one when a consumer's message
/// lands in the error queue (MT/Events/FaultEvent.cs,
/// MT/Contexts/ConsumeContextEndpointExtensions.cs `GenerateFault`).
#[derive(Debug, Clone)]
pub(crate) struct FaultEvent<'a> {
    /// The fault's envelope's `messageId` (and AMQP `message_id`): a new
    /// id of its own, as MassTransit gives every message it sends
    /// (MT/Contexts/Context/MessageSendContext.cs).
    pub message_id: Uuid,
    /// The fault's own id, its `faultId`.
    pub fault_id: Uuid,
    /// The message that faulted.
    pub faulted_message_id: Uuid,
    /// The `T` of `Fault<T>`: the type whose handler failed
    /// (`Namespace:Type`).
    pub message_type: &'a str,
    /// Its JSON.
    pub message: &'a [u8],
    /// In place of the .NET exception type.
    pub exception_type: &'a str,
    /// The failure's text.
    pub reason: &'a str,
    /// When it failed, as [`timestamp_now`] writes it (also the envelope's
    /// `sentTime`).
    pub timestamp: &'a str,
    /// Where the faulted message came from: its ids, types and headers.
    pub context: &'a Context,
    /// The address of the queue it faulted on.
    pub input_address: &'a str,
    /// Immediate retries before it faulted (`MT-Fault-RetryCount`, when
    /// above 0).
    pub retries: u32,
    /// Delayed redeliveries before it faulted (`MT-Fault-RedeliveryCount`,
    /// when above 0).
    pub redeliveries: u32,
    /// Where it is sent, when not published: the faulted message's
    /// `faultAddress` or `responseAddress`.
    pub destination_address: Option<&'a str>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct FaultBody<'a> {
    fault_id: String,
    faulted_message_id: String,
    timestamp: &'a str,
    exceptions: [ExceptionInfo<'a>; 1],
    host: &'static HostInfo,
    fault_message_types: Vec<String>,
    message: Box<RawValue>,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct ExceptionInfo<'a> {
    exception_type: &'a str,
    inner_exception: Option<serde_json::Value>,
    stack_trace: &'a str,
    message: &'a str,
    source: &'a str,
    data: Option<serde_json::Value>,
}

impl FaultEvent<'_> {
    /// `T`, then the types the faulted message listed after `T`: those
    /// `T` may derive from. `Fault<T>` is covariant in .NET, so it is a
    /// `Fault<X>` of each of `T`'s base types and interfaces, which a
    /// message lists after its type (most specific first); a type listed
    /// before `T` is none of its bases.
    fn types(&self) -> impl Iterator<Item = &str> {
        let listed = &self.context.message_types;
        let after = listed
            .iter()
            .position(|name| name == self.message_type)
            .map_or(listed.len(), |at| at + 1);
        std::iter::once(self.message_type).chain(listed[after..].iter().map(String::as_str))
    }

    /// The fault exchanges it is published to, most specific first:
    /// `Fault<T>`'s, then `Fault<X>`'s for each of [`types`](Self::types),
    /// as MassTransit's publish topology binds a type's exchange to those of
    /// the types it implements
    /// (RMQ/RabbitMqTransport/Topology/RabbitMqMessagePublishTopology.cs).
    pub(crate) fn exchanges(&self) -> Vec<String> {
        self.types().map(fault_exchange).collect()
    }
}

/// The envelope of `fault`, as MassTransit writes a `Fault<T>`: its
/// `messageType` `Fault<T>`'s URN, then `Fault<X>`'s for each of `T`'s
/// possible bases (see [`FaultEvent::types`]), then `Fault`'s; `faultMessageTypes` every
/// type the faulted message listed (`SupportedMessageTypes`,
/// MT/Events/FaultEvent.cs). What MassTransit's `FaultPipe`
/// (MT/Contexts/ConsumeContextEndpointExtensions.cs) gives it: the
/// consumed message's headers but `MT-` ones, conversation, correlation
/// and request ids, its correlation (else request) id as the initiator,
/// the endpoint as the source, and `MT-Fault-RetryCount` and
/// `MT-Fault-RedeliveryCount` when above 0. Every id is a GUID or `null`:
/// an id of the faulted message that is not a GUID is left out.
pub(crate) fn encode_fault(fault: &FaultEvent<'_>) -> Result<Vec<u8>, serde_json::Error> {
    let reason = crate::fault::truncate(fault.reason, MAX_FAULT_TEXT);
    let context = fault.context;
    let body = FaultBody {
        fault_id: fault.fault_id.to_string(),
        faulted_message_id: fault.faulted_message_id.to_string(),
        timestamp: fault.timestamp,
        exceptions: [ExceptionInfo {
            exception_type: fault.exception_type,
            inner_exception: None,
            stack_trace: "",
            message: reason.as_ref(),
            source: "inbox",
            data: None,
        }],
        host: host_info(),
        fault_message_types: match context.message_types.as_slice() {
            [] => vec![message_urn(fault.message_type)],
            types => types.iter().map(|name| message_urn(name)).collect(),
        },
        message: RawValue::from_string(String::from_utf8_lossy(fault.message).into_owned())?,
    };
    let message = serde_json::value::to_raw_value(&body)?;
    let correlation = guid(context.correlation_id.as_deref());
    let request = guid(context.request_id.as_deref());
    let conversation = guid(context.conversation_id.as_deref()).or_else(|| Some(Uuid::now_v7().to_string()));
    let mut headers = match &context.headers {
        Some(json) => serde_json::from_str::<serde_json::Map<String, serde_json::Value>>(json)
            .unwrap_or_default()
            .into_iter()
            .filter(|(key, _)| transferred(key, false))
            .collect(),
        None => serde_json::Map::new(),
    };
    if fault.retries > 0 {
        headers.insert(headers::FAULT_RETRY_COUNT.into(), fault.retries.into());
    }
    if fault.redeliveries > 0 {
        headers.insert(headers::FAULT_REDELIVERY_COUNT.into(), fault.redeliveries.into());
    }
    let message_types = fault
        .types()
        .map(fault_urn)
        .chain(std::iter::once(message_urn("MassTransit:Fault")))
        .collect();
    let envelope = JsonEnvelope {
        message_id: Some(fault.message_id.to_string()),
        request_id: request.clone(),
        correlation_id: correlation.clone(),
        conversation_id: conversation,
        initiator_id: correlation.or(request),
        source_address: Some(fault.input_address.to_owned()),
        destination_address: fault.destination_address.map(str::to_owned),
        response_address: None,
        fault_address: None,
        message_type: message_types,
        message: Some(message),
        expiration_time: None,
        sent_time: Some(fault.timestamp.to_owned()),
        headers,
        host: serde_json::to_value(host_info()).ok(),
    };
    serde_json::to_vec(&envelope)
}

/// Now as .NET's `DateTime.UtcNow.ToString("O")` writes it, with seven
/// fractional digits (`2025-06-20T13:10:25.1234567Z`): MassTransit's fault
/// timestamps.
pub(crate) fn timestamp_now() -> String {
    // Nine digits, of which .NET's ticks (100 ns) keep seven.
    let nanos = humantime::format_rfc3339_nanos(std::time::SystemTime::now()).to_string();
    match nanos.strip_suffix('Z') {
        Some(digits) if digits.len() > 2 => format!("{}Z", &digits[..digits.len() - 2]),
        _ => nanos,
    }
}

/// Where a message sent to a MassTransit address goes: the exchange the
/// address names, declared as MassTransit declares it before it sends
/// (RMQ/RabbitMqEndpointAddress.cs: `rabbitmq://host/[vhost/]name`, with
/// `temporary`, `durable`, `autodelete` and `type` in its query; the short
/// forms `exchange:name` and `queue:name`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct SendAddress {
    /// The exchange: the address's name.
    pub exchange: String,
    /// Its type (`fanout` unless the address says).
    pub kind: String,
    /// Whether it is durable (unless `temporary` or `durable=false`).
    pub durable: bool,
    /// Whether it is deleted when unused (`temporary` or `autodelete=true`).
    pub auto_delete: bool,
}

impl SendAddress {
    /// The address `address` names, if it is a RabbitMQ one with a name.
    pub(crate) fn parse(address: &str) -> Option<Self> {
        let url = url::Url::parse(address).ok()?;
        // `rabbitmq://host/[vhost/]name`: the last segment; `queue:name`
        // and `exchange:name` (URLs with no authority): the path.
        let name = match url.scheme() {
            "rabbitmq" | "rabbitmqs" => url.path_segments()?.next_back()?,
            "exchange" | "queue" => url.path(),
            _ => return None,
        };
        let name = percent_encoding::percent_decode_str(name).decode_utf8().ok()?;
        if name.is_empty() {
            return None;
        }
        let mut send = Self {
            exchange: name.into_owned(),
            kind: "fanout".to_owned(),
            durable: true,
            auto_delete: false,
        };
        for (key, value) in url.query_pairs() {
            let yes = value.eq_ignore_ascii_case("true");
            match key.to_ascii_lowercase().as_str() {
                "temporary" if yes => {
                    send.durable = false;
                    send.auto_delete = true;
                }
                "durable" => send.durable = yes,
                "autodelete" => send.auto_delete = yes,
                // The address comes with the message (untrusted): a type
                // the broker does not know would close the connection the
                // queue is consumed on, so only RabbitMQ's own are taken.
                "type" => {
                    let kind = value.to_ascii_lowercase();
                    if ["direct", "topic", "headers", "fanout"].contains(&kind.as_str()) {
                        send.kind = kind;
                    }
                }
                _ => {}
            }
        }
        Some(send)
    }
}

/// What an envelope this runtime publishes says of the message.
#[derive(Debug, Clone)]
pub(crate) struct OutgoingEnvelope<'a> {
    /// Its id.
    pub message_id: Uuid,
    /// Its type name (`Namespace:Type`).
    pub message_type: &'a str,
    /// The types it implements, most specific first (`Namespace:Type`).
    pub implements: &'a [&'a str],
    /// The message's JSON.
    pub message: &'a [u8],
    /// The conversation it belongs to.
    pub conversation_id: Uuid,
    /// Its correlation id, if any.
    pub correlation_id: Option<&'a str>,
    /// What initiated it, if anything: a GUID's text.
    pub initiator_id: Option<&'a str>,
    /// The address of the endpoint sending it.
    pub source_address: Option<&'a str>,
    /// The address of the exchange it goes to.
    pub destination_address: Option<&'a str>,
    /// When it was sent, ISO 8601 in UTC.
    pub sent_time: &'a str,
    /// Its headers.
    pub headers: serde_json::Map<String, serde_json::Value>,
}

/// The JSON envelope of `outgoing`, as MassTransit writes one: every
/// field, `null` when unset, ids as lowercase hyphenated GUIDs. An id that
/// is not a GUID (a correlation id carried from an incoming
/// `correlation_id` such as `order-42`) is left out: a MassTransit consumer
/// would throw on it.
pub(crate) fn encode(outgoing: &OutgoingEnvelope<'_>) -> Result<Vec<u8>, serde_json::Error> {
    let message = RawValue::from_string(String::from_utf8_lossy(outgoing.message).into_owned())?;
    let envelope = JsonEnvelope {
        message_id: Some(outgoing.message_id.to_string()),
        request_id: None,
        correlation_id: guid(outgoing.correlation_id),
        conversation_id: Some(outgoing.conversation_id.to_string()),
        initiator_id: guid(outgoing.initiator_id),
        source_address: outgoing.source_address.map(str::to_owned),
        destination_address: outgoing.destination_address.map(str::to_owned),
        response_address: None,
        fault_address: None,
        message_type: std::iter::once(&outgoing.message_type)
            .chain(outgoing.implements)
            .map(|name| message_urn(name))
            .collect(),
        message: Some(message),
        expiration_time: None,
        sent_time: Some(outgoing.sent_time.to_owned()),
        headers: outgoing.headers.clone(),
        host: None,
    };
    serde_json::to_vec(&envelope)
}

/// The envelope of a message sent now, as a follow-up of `cause` if it is
/// one, with `headers` (see [`follow_up_headers`]). What a message sent from
/// a MassTransit consumer gets (ABS/Contexts/SendContextExtensions.cs
/// `TransferConsumeContextHeaders`): the consumed message's conversation
/// (or a new one), its correlation id as the initiator (else its request
/// id), the queue it was consumed from as the source; no correlation id,
/// which is the message's own.
pub(crate) fn envelope_now(
    message_id: Uuid,
    (message_type, implements): (&'static str, &'static [&'static str]),
    json: &[u8],
    cause: Option<&crate::MessageContext>,
    headers: serde_json::Map<String, serde_json::Value>,
) -> crate::Result<Vec<u8>> {
    let conversation_id = cause
        .and_then(|c| c.conversation_id.as_deref())
        .and_then(|id| Uuid::try_parse(id).ok())
        .unwrap_or_else(Uuid::now_v7);
    let initiator_id = cause.and_then(|c| {
        guid(c.correlation_id.as_deref())
            .or_else(|| guid(c.masstransit().and_then(|m| m.request_id.as_deref())))
    });
    let sent_time = humantime::format_rfc3339_micros(std::time::SystemTime::now()).to_string();
    let envelope = OutgoingEnvelope {
        message_id,
        message_type,
        implements,
        message: json,
        conversation_id,
        correlation_id: None,
        initiator_id: initiator_id.as_deref(),
        source_address: cause.and_then(|c| c.input_address()),
        destination_address: None,
        sent_time: &sent_time,
        headers,
    };
    encode(&envelope).map_err(|source| crate::Error::serialize(message_type, source))
}

/// The types an envelope of this runtime's says its message implements:
/// its `messageType`'s names after the first, its own, which names the
/// exchange it goes to. For a dispatcher, which may send a row another
/// process staged, to bind that exchange as the staging process's type
/// declared. None for a body that says none, or is no envelope.
pub(crate) fn implemented_types(envelope: &[u8]) -> Vec<String> {
    let mut types = types_of(envelope);
    if !types.is_empty() {
        types.remove(0);
    }
    types
}

/// The type names an envelope's `messageType` lists, most specific first;
/// none for a body that lists none, or is no envelope (read in its
/// camelCase spelling, as MassTransit and this runtime write it).
pub(crate) fn types_of(envelope: &[u8]) -> Vec<String> {
    #[derive(Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Types<'a> {
        #[serde(borrow, default)]
        message_type: Vec<&'a str>,
    }
    match serde_json::from_slice::<Types<'_>>(envelope) {
        Ok(types) => type_names(types.message_type.into_iter()),
        Err(_) => Vec::new(),
    }
}

/// The most bytes of a consumed message's headers a follow-up copies into
/// its AMQP headers (all of them go into its envelope, which MassTransit's
/// consumers read): the consumed ones came within the broker's frame, and
/// with the follow-up's own they must stay within
/// [`MAX_PROPERTIES_BYTES`](crate::limits::MAX_PROPERTIES_BYTES).
const MAX_TRANSFERRED_AMQP_BYTES: usize = 16 * 1024;

/// A follow-up's headers, in its envelope and as AMQP headers.
#[derive(Debug, Default)]
pub(crate) struct FollowUpHeaders {
    /// For the envelope's `headers`, values as they were.
    pub envelope: serde_json::Map<String, serde_json::Value>,
    /// For the AMQP headers, as text.
    pub amqp: Vec<(String, String)>,
}

/// The headers of a message published as a follow-up of `cause`, as
/// MassTransit gives them (`TransferConsumeContextHeaders`): every header
/// of the consumed message but MassTransit's own (`MT-`), then the trace,
/// as `MT-Activity-Id` and W3C's `traceparent`/`tracestate`, so that it
/// continues in .NET and in Rust. A raw message's AMQP headers are its
/// headers; of those, its metadata (ids, read into its context) and what
/// describes the consumed copy's past (this library's `x-inbox-*` failure
/// headers, the broker's `x-death`) are not carried.
pub(crate) fn follow_up_headers(
    cause: Option<&crate::MessageContext>,
    trace: Option<&crate::TraceContext>,
) -> FollowUpHeaders {
    let mut headers = FollowUpHeaders::default();
    if let Some(context) = cause.and_then(crate::MessageContext::masstransit) {
        let consumed = match (&context.headers, context.raw) {
            (Some(json), _) => serde_json::from_str(json).unwrap_or_default(),
            (None, true) => cause.map_or_else(serde_json::Map::new, |c| amqp_as_json(c.amqp_headers())),
            (None, false) => serde_json::Map::new(),
        };
        let mut budget = MAX_TRANSFERRED_AMQP_BYTES;
        for (key, value) in consumed {
            if !transferred(&key, context.raw) {
                continue;
            }
            let text = match &value {
                serde_json::Value::String(text) => text.clone(),
                other => other.to_string(),
            };
            if key.len() <= crate::limits::MAX_NAME_BYTES && key.len() + text.len() <= budget {
                budget -= key.len() + text.len();
                headers.amqp.push((key.clone(), text));
            }
            headers.envelope.insert(key, value);
        }
    }
    if let Some(trace) = trace {
        let own =
            std::iter::once((headers::ACTIVITY_ID, trace.traceparent().to_owned())).chain(trace.headers());
        for (key, value) in own {
            headers.amqp.retain(|(k, _)| k != key);
            headers.amqp.push((key.to_owned(), value.clone()));
            headers
                .envelope
                .insert(key.to_owned(), serde_json::Value::String(value));
        }
    }
    headers
}

/// Whether a consumed message's header `key` goes on to its follow-ups.
fn transferred(key: &str, raw: bool) -> bool {
    if key.starts_with("MT-") {
        return false;
    }
    if !raw {
        return true;
    }
    let metadata = [
        headers::MESSAGE_ID,
        headers::CORRELATION_ID,
        headers::CONVERSATION_ID,
        headers::REQUEST_ID,
    ];
    !(metadata.contains(&key)
        || key.starts_with("x-inbox-")
        || key == "x-death"
        || key.starts_with("x-first-death-")
        || key.starts_with("x-last-death-"))
}

/// A raw message's AMQP headers as JSON values, as
/// [`crate::amqp::amqp_json`] reads them; what JSON has no form for
/// (`null`) left out.
fn amqp_as_json(headers: &FieldTable) -> serde_json::Map<String, serde_json::Value> {
    headers
        .inner()
        .iter()
        .map(|(key, value)| (key.as_str().to_owned(), crate::amqp::amqp_json(value)))
        .filter(|(_, value)| !value.is_null())
        .collect()
}

/// The trace context a MassTransit message carries: its `MT-Activity-Id`
/// (in the AMQP headers, else the envelope's), else W3C's `traceparent`
/// (a producer of this library's). `MT-Activity-Id` first: a .NET consumer
/// carries a `traceparent` it received on to its follow-ups as any other
/// header, while its `MT-Activity-Id` is its own.
pub(crate) fn trace_of(context: &Context, amqp: &FieldTable) -> Option<crate::TraceContext> {
    let from_amqp = text(amqp, headers::ACTIVITY_ID);
    let from_envelope = || {
        let json = context.headers.as_deref()?;
        if !json.contains(headers::ACTIVITY_ID) {
            return None;
        }
        let headers: serde_json::Map<String, serde_json::Value> = serde_json::from_str(json).ok()?;
        headers.get(headers::ACTIVITY_ID)?.as_str().map(str::to_owned)
    };
    from_amqp
        .or_else(from_envelope)
        .and_then(|id| crate::TraceContext::parse(&id, None))
        .or_else(|| crate::TraceContext::from_headers(amqp))
}

/// The AMQP properties of an envelope with id `message_id`, as MassTransit
/// sets them (RMQ/RabbitMqTransport/RabbitMqSendTransportContext.cs): the
/// id as `message_id`, the envelope's content type, persistent; no `type`.
pub fn properties(message_id: Uuid) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(message_id.to_string().into())
        .with_content_type(ENVELOPE_CONTENT_TYPE.into())
        .with_delivery_mode(2)
}

#[cfg(test)]
mod tests {
    use lapin::types::LongString;

    use super::*;

    /// An envelope as MassTransit 8 wrote it, verbatim from
    /// tests/MassTransit.AmazonSqsTransport.Tests/MessageBody_Specs.cs at
    /// v8.5.8, its two addresses in their RabbitMQ form.
    const CAPTURED: &str = r#"{
  "messageId": "00ab0000-6ab3-f8b4-f78c-08db7c8365ff",
  "requestId": null,
  "correlationId": null,
  "conversationId": "00ab0000-6ab3-f8b4-739e-08db7c83660f",
  "initiatorId": null,
  "sourceAddress": "rabbitmq://localhost/MYHOST_Publisher_bus_ab1oyyrb7ecqdt3nbdpjtsbgrs?temporary=true",
  "destinationAddress": "rabbitmq://localhost/TestSerialization:TestMessage",
  "responseAddress": null,
  "faultAddress": null,
  "messageType": [
    "urn:message:TestSerialization:TestMessage"
  ],
  "message": {
    "name": "Hello world!"
  },
  "expirationTime": null,
  "sentTime": "2023-07-04T11:39:59.689102Z",
  "headers": {},
  "host": {
    "machineName": "XXXX",
    "processName": "Publisher",
    "processId": 43776,
    "assembly": "Publisher",
    "assemblyVersion": "1.0.0.0",
    "frameworkVersion": "6.0.14",
    "massTransitVersion": "8.0.16.0",
    "operatingSystemVersion": "Microsoft Windows NT 10.0.19044.0"
  }
}"#;

    fn envelope_properties(message_id: Option<&str>) -> BasicProperties {
        let properties = BasicProperties::default().with_content_type(ENVELOPE_CONTENT_TYPE.into());
        match message_id {
            Some(id) => properties.with_message_id(id.into()),
            None => properties,
        }
    }

    #[test]
    fn a_captured_envelope_decodes_to_its_id_type_message_and_context() {
        let decoded = decode(
            &envelope_properties(Some("00ab0000-6ab3-f8b4-f78c-08db7c8365ff")),
            CAPTURED.as_bytes(),
            false,
        )
        .unwrap();
        assert_eq!(
            decoded.message_id,
            Uuid::parse_str("00ab0000-6ab3-f8b4-f78c-08db7c8365ff").unwrap()
        );
        assert_eq!(decoded.context.message_types, ["TestSerialization:TestMessage"]);
        let message: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
        assert_eq!(message, serde_json::json!({"name": "Hello world!"}));
        assert_eq!(
            decoded.context.conversation_id.as_deref(),
            Some("00ab0000-6ab3-f8b4-739e-08db7c83660f")
        );
        assert_eq!(decoded.context.initiator_id, None);
        assert!(
            decoded
                .context
                .source_address
                .unwrap()
                .starts_with("rabbitmq://localhost/")
        );
        // No content type, or one MassTransit has no deserializer for, or
        // its raw one on an endpoint that does not read raw: MassTransit's
        // default deserializer, the envelope.
        for content_type in [None, Some("application/xml"), Some(RAW_JSON_CONTENT_TYPE)] {
            let mut properties = BasicProperties::default();
            if let Some(content_type) = content_type {
                properties = properties.with_content_type(content_type.into());
            }
            assert!(
                decode(&properties, CAPTURED.as_bytes(), false).is_ok(),
                "{content_type:?}"
            );
        }
    }

    #[test]
    fn the_envelopes_id_is_the_message_id_and_a_missing_or_broken_one_is_malformed() {
        // MassTransit reads the envelope's id, whatever the AMQP property.
        let other = Uuid::now_v7().to_string();
        let decoded = decode(&envelope_properties(Some(&other)), CAPTURED.as_bytes(), false).unwrap();
        assert_eq!(
            decoded.message_id.to_string(),
            "00ab0000-6ab3-f8b4-f78c-08db7c8365ff"
        );
        let bad_id = CAPTURED.replace("00ab0000-6ab3-f8b4-f78c-08db7c8365ff", "not-a-guid");
        assert!(matches!(
            decode(&envelope_properties(None), bad_id.as_bytes(), false),
            Err(WireError::InvalidMessageId(_))
        ));
        assert!(matches!(
            decode(&envelope_properties(None), b"{\"messageId\": ", false),
            Err(WireError::NotAnEnvelope(_))
        ));
        let no_message = CAPTURED.replace("\"message\":", "\"other\":");
        assert_eq!(
            decode(&envelope_properties(None), no_message.as_bytes(), false),
            Err(WireError::NoMessage)
        );
    }

    #[test]
    fn an_envelope_without_a_type_has_none_and_is_skipped_not_failed() {
        // MassTransit reads `messageType: null` (or one in no URN form) as
        // no type; no consumer takes it, and it goes to Q_skipped.
        for no_type in [
            CAPTURED.replace("\"urn:message:TestSerialization:TestMessage\"", "\"TestMessage\""),
            CAPTURED.replace(
                "[\n    \"urn:message:TestSerialization:TestMessage\"\n  ]",
                "null",
            ),
        ] {
            let decoded = decode(&envelope_properties(None), no_type.as_bytes(), false).unwrap();
            assert!(decoded.context.message_types.is_empty(), "{no_type}");
        }
    }

    #[test]
    fn envelope_names_in_any_case_and_null_headers_read_as_masstransit_reads_them() {
        let id = Uuid::now_v7();
        // The PascalCase naming policy, or Newtonsoft's defaults: PascalCase
        // names, defaults left out, `Headers: null`.
        let pascal = format!(
            r#"{{"MessageId": "{id}", "ConversationId": "{id}", "MessageType": ["urn:message:Conference.Contracts:AttendeeCheckedIn"],
               "Message": {{"AttendeeId": 5, "Nested": {{"Inner": [{{"Deep": 1}}]}}}}, "Headers": null, "Host": null}}"#
        );
        let decoded = decode(&envelope_properties(None), pascal.as_bytes(), false).unwrap();
        assert_eq!(decoded.message_id, id);
        assert_eq!(
            decoded.context.message_types,
            ["Conference.Contracts:AttendeeCheckedIn"]
        );
        assert_eq!(decoded.context.conversation_id, Some(id.to_string()));
        let message: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
        assert_eq!(
            message,
            serde_json::json!({"AttendeeId": 5, "Nested": {"Inner": [{"Deep": 1}]}}),
            "the message as it was sent: its fields are matched in any case when it is read"
        );
    }

    /// The one-pass read of MassTransit's own spelling and the read by name
    /// agree field for field, and anything else (an extra field, a
    /// duplicate) takes the read by name.
    #[test]
    fn the_one_pass_read_and_the_read_by_name_agree() {
        let forms = [
            CAPTURED.to_owned(),
            CAPTURED.replace("\"message\":", "\"extra\": [1, {\"a\": null}], \"message\":"),
            CAPTURED.replace(
                "[\n    \"urn:message:TestSerialization:TestMessage\"\n  ]",
                "null",
            ),
            CAPTURED.replace("\"messageId\":", "\"MessageId\":"),
        ];
        for (i, form) in forms.iter().enumerate() {
            let fields = EnvelopeFields::read(form.as_bytes()).unwrap();
            assert_eq!(
                matches!(fields, EnvelopeFields::Camel(_)),
                i == 0 || i == 2,
                "form {i}"
            );
            let by_name = EnvelopeFields::AnyCase(serde_json::from_str(form).unwrap());
            for name in [
                "messageId",
                "correlationId",
                "conversationId",
                "initiatorId",
                "sourceAddress",
            ] {
                assert_eq!(fields.text(name), by_name.text(name), "form {i}, {name}");
            }
            assert_eq!(fields.message_types(), by_name.message_types(), "form {i}");
            assert_eq!(
                fields.message().map(RawValue::get),
                by_name.message().map(RawValue::get),
                "form {i}"
            );
        }
        // A text with an escape cannot be borrowed: read by name, unescaped.
        let escaped = CAPTURED.replace("\"sourceAddress\": \"", "\"sourceAddress\": \"\\u0072");
        let fields = EnvelopeFields::read(escaped.as_bytes()).unwrap();
        assert!(matches!(fields, EnvelopeFields::AnyCase(_)));
        assert!(
            fields
                .text("sourceAddress")
                .unwrap()
                .unwrap()
                .starts_with("rrabbitmq://")
        );
    }

    #[test]
    fn raw_json_reads_its_metadata_from_the_headers_masstransit_writes() {
        let id = Uuid::now_v7();
        let mut table = FieldTable::default();
        table.insert(
            headers::MESSAGE_ID.into(),
            AMQPValue::LongString(LongString::from(id.to_string())),
        );
        table.insert(
            headers::MESSAGE_TYPE.into(),
            AMQPValue::LongString(
                "urn:message:Conference.Contracts:AttendeeCheckedIn;urn:message:Base:Event".into(),
            ),
        );
        table.insert(headers::CONVERSATION_ID.into(), AMQPValue::LongString("c".into()));
        let properties = BasicProperties::default()
            .with_content_type(RAW_JSON_CONTENT_TYPE.into())
            .with_headers(table);
        let body = br#"{"attendeeId": 1, "sessionId": 2}"#;
        let decoded = decode(&properties, body, true).unwrap();
        assert_eq!(decoded.message_id, id);
        assert_eq!(
            decoded.context.message_types,
            ["Conference.Contracts:AttendeeCheckedIn", "Base:Event"]
        );
        assert_eq!(decoded.message, body);
        assert_eq!(decoded.context.conversation_id.as_deref(), Some("c"));
    }

    #[test]
    fn an_encoded_envelope_has_every_field_masstransit_writes_and_decodes_back() {
        let (id, conversation, initiator) = (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7().to_string());
        let outgoing = OutgoingEnvelope {
            message_id: id,
            message_type: "Conference.Contracts:CheckinRecorded",
            implements: &["Conference.Contracts:ICheckinEvent"],
            message: br#"{"attendeeId":1,"sessionId":2}"#,
            conversation_id: conversation,
            correlation_id: None,
            initiator_id: Some(&initiator),
            source_address: Some("rabbitmq://localhost/checkins"),
            destination_address: Some("rabbitmq://localhost/Conference.Contracts:CheckinRecorded"),
            sent_time: "2026-12-04T03:00:00.000000Z",
            headers: serde_json::Map::new(),
        };
        let encoded = encode(&outgoing).unwrap();
        let json: serde_json::Value = serde_json::from_slice(&encoded).unwrap();
        let text = String::from_utf8(encoded.clone()).unwrap();
        // The fifteen of JsonMessageEnvelope, in its order, each once.
        let order = [
            "messageId",
            "requestId",
            "correlationId",
            "conversationId",
            "initiatorId",
            "sourceAddress",
            "destinationAddress",
            "responseAddress",
            "faultAddress",
            "messageType",
            "message",
            "expirationTime",
            "sentTime",
            "headers",
            "host",
        ];
        let at: Vec<usize> = order
            .iter()
            .map(|field| text.find(&format!("\"{field}\":")).expect(field))
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
        assert_eq!(json.as_object().unwrap().len(), order.len());
        assert_eq!(
            json["requestId"],
            serde_json::Value::Null,
            "unset is null, not absent"
        );
        assert_eq!(
            json["messageType"],
            serde_json::json!([
                "urn:message:Conference.Contracts:CheckinRecorded",
                "urn:message:Conference.Contracts:ICheckinEvent"
            ]),
            "its type, then those it implements"
        );
        let decoded = decode(&envelope_properties(Some(&id.to_string())), &encoded, false).unwrap();
        assert_eq!(decoded.message_id, id);
        assert_eq!(decoded.context.initiator_id, Some(initiator.to_string()));
        assert_eq!(decoded.context.conversation_id, Some(conversation.to_string()));
        assert_eq!(decoded.message, br#"{"attendeeId":1,"sessionId":2}"#);
    }

    #[test]
    fn fault_headers_are_masstransits_names_and_kinds() {
        let mut table = FieldTable::default();
        let long = "x".repeat(5_000);
        stamp_fault(
            &mut table,
            &Fault {
                message: &long,
                exception_type: "Inbox.HandlerFailed",
                consumer_type: "CountCheckins",
                message_type: "Conference.Contracts:AttendeeCheckedIn",
                input_address: "rabbitmq://localhost/checkins",
                retries: 3,
                timestamp: "2026-12-04T03:00:00.000Z",
            },
        );
        let text = |key: &str| match table.inner().get(key) {
            Some(AMQPValue::LongString(s)) => String::from_utf8(s.as_bytes().to_vec()).unwrap(),
            other => panic!("{key}: {other:?}"),
        };
        assert_eq!(text("MT-Reason"), "fault");
        assert_eq!(
            text("MT-Fault-MessageType"),
            "Conference.Contracts.AttendeeCheckedIn"
        );
        assert_eq!(text("MT-Fault-InputAddress"), "rabbitmq://localhost/checkins");
        assert!(text("MT-Fault-Message").len() <= MAX_FAULT_TEXT);
        assert_eq!(
            table.inner().get("MT-Fault-RetryCount"),
            Some(&AMQPValue::LongInt(3))
        );
        let mut skipped = FieldTable::default();
        stamp_dead_letter(&mut skipped);
        stamp_redelivery(&mut skipped, 2);
        assert_eq!(
            skipped.inner().get("MT-Reason"),
            Some(&AMQPValue::LongString("dead-letter".into()))
        );
        assert_eq!(
            skipped.inner().get("MT-Redelivery-Count"),
            Some(&AMQPValue::LongInt(2))
        );
    }

    #[test]
    fn a_fault_is_named_and_shaped_as_masstransits_fault_of_t() {
        assert_eq!(
            fault_urn("My.Contracts:OrderSubmitted"),
            "urn:message:MassTransit:Fault[[My.Contracts:OrderSubmitted]]"
        );
        assert_eq!(
            fault_exchange("My.Contracts:OrderSubmitted"),
            "MassTransit:Fault--My.Contracts:OrderSubmitted--"
        );
        assert_eq!(fault_exchange("MassTransit:Ping"), "MassTransit:Fault--Ping--");
        let (message_id, fault_id, faulted, conversation) =
            (Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7(), Uuid::now_v7());
        let context = Context {
            conversation_id: Some(conversation.to_string()),
            // Not a GUID: MassTransit would throw reading it.
            correlation_id: Some("order-42".into()),
            message_types: vec!["My.Contracts:OrderSubmitted".into(), "My.Contracts:Event".into()],
            ..Context::default()
        };
        let encoded = encode_fault(&FaultEvent {
            message_id,
            fault_id,
            faulted_message_id: faulted,
            message_type: "My.Contracts:OrderSubmitted",
            message: br#"{"orderId":1}"#,
            exception_type: "Inbox.MessageRejectedException",
            reason: "boom",
            timestamp: "2026-12-04T03:00:00.0000000Z",
            context: &context,
            input_address: "rabbitmq://localhost/orders",
            retries: 2,
            redeliveries: 1,
            destination_address: None,
        })
        .unwrap();
        let properties = envelope_properties(Some(&message_id.to_string()));
        let decoded = decode(&properties, &encoded, false).unwrap();
        assert_eq!(decoded.message_id, message_id, "an id of its own beside faultId");
        assert_eq!(
            decoded.context.message_types,
            [
                "MassTransit:Fault[[My.Contracts:OrderSubmitted]]",
                "MassTransit:Fault[[My.Contracts:Event]]",
                "MassTransit:Fault"
            ],
            "Fault<X> for every type the message listed, as Fault<T> is covariant"
        );
        let headers: serde_json::Value =
            serde_json::from_str(decoded.context.headers.as_deref().unwrap()).unwrap();
        assert_eq!(headers["MT-Fault-RetryCount"], 2);
        assert_eq!(headers["MT-Fault-RedeliveryCount"], 1);
        assert_eq!(decoded.context.conversation_id, Some(conversation.to_string()));
        assert_eq!(decoded.context.correlation_id, None, "a GUID or null");
        assert_eq!(decoded.context.initiator_id, None, "a GUID or null");
        let body: serde_json::Value = serde_json::from_slice(&decoded.message).unwrap();
        assert_eq!(body["faultId"], fault_id.to_string());
        assert_eq!(body["faultedMessageId"], faulted.to_string());
        assert_eq!(body["exceptions"][0]["message"], "boom");
        assert_eq!(
            body["faultMessageTypes"],
            serde_json::json!([
                "urn:message:My.Contracts:OrderSubmitted",
                "urn:message:My.Contracts:Event"
            ]),
            "every type the faulted message listed"
        );
        assert_eq!(body["host"]["processId"], std::process::id());
        assert_eq!(body["message"], serde_json::json!({"orderId": 1}));
        let text = String::from_utf8(decoded.message).unwrap();
        let order = [
            "faultId",
            "faultedMessageId",
            "timestamp",
            "exceptions",
            "host",
            "faultMessageTypes",
        ];
        let at: Vec<usize> = order
            .iter()
            .map(|f| text.find(&format!("\"{f}\":")).unwrap())
            .collect();
        assert!(at.windows(2).all(|w| w[0] < w[1]), "{text}");
    }

    #[test]
    fn a_dispatcher_reads_the_implemented_types_from_the_envelope_it_sends() {
        let implements = [
            "Conference.Contracts:ICheckinEvent",
            "Conference.Contracts:IEvent",
        ];
        let envelope = encode(&OutgoingEnvelope {
            message_id: Uuid::now_v7(),
            message_type: "Conference.Contracts:CheckinRecorded",
            implements: &implements,
            message: b"{}",
            conversation_id: Uuid::now_v7(),
            correlation_id: None,
            initiator_id: None,
            source_address: None,
            destination_address: None,
            sent_time: "2026-12-04T03:00:00.000000Z",
            headers: serde_json::Map::new(),
        })
        .unwrap();
        assert_eq!(implemented_types(&envelope), implements);
        assert!(implemented_types(b"not an envelope").is_empty());
    }

    #[test]
    fn fault_timestamps_have_dotnets_seven_fractional_digits() {
        let now = timestamp_now();
        let (_, fraction) = now.split_once('.').unwrap();
        assert_eq!(fraction.len(), 8, "{now}");
        assert!(
            fraction.ends_with('Z') && fraction[..7].bytes().all(|b| b.is_ascii_digit()),
            "{now}"
        );
    }

    #[test]
    fn a_send_address_names_its_exchange_as_masstransit_reads_it() {
        let parse = |address| SendAddress::parse(address);
        let durable = |exchange: &str| SendAddress {
            exchange: exchange.to_owned(),
            kind: "fanout".to_owned(),
            durable: true,
            auto_delete: false,
        };
        assert_eq!(parse("rabbitmq://localhost/orders"), Some(durable("orders")));
        assert_eq!(
            parse("rabbitmqs://broker:5671/prod/orders"),
            Some(durable("orders"))
        );
        assert_eq!(parse("queue:orders"), Some(durable("orders")));
        assert_eq!(
            parse("exchange:Contracts:OrderPlaced?type=topic").map(|a| (a.exchange, a.kind)),
            Some(("Contracts:OrderPlaced".to_owned(), "topic".to_owned()))
        );
        assert_eq!(
            parse("rabbitmq://localhost/prod/order%20events"),
            Some(durable("order events"))
        );
        assert_eq!(
            parse("rabbitmq://localhost/host_app_bus_abc?temporary=true"),
            Some(SendAddress {
                durable: false,
                auto_delete: true,
                ..durable("host_app_bus_abc")
            })
        );
        assert_eq!(
            parse("rabbitmq://localhost/orders?type=topic&durable=false").map(|a| (a.kind, a.durable)),
            Some(("topic".to_owned(), false))
        );
        assert_eq!(
            parse("rabbitmq://localhost/orders?type=x-made-up").map(|a| a.kind),
            Some("fanout".to_owned()),
            "a type the broker may not know is not declared"
        );
        assert_eq!(parse("rabbitmq://localhost/"), None);
        assert_eq!(parse("sb://azure/orders"), None);
    }

    #[test]
    fn a_follow_up_carries_only_guids_for_ids_as_masstransit_reads_them() {
        let id = Uuid::now_v7();
        let initiator = id.to_string();
        let outgoing = |correlation_id| OutgoingEnvelope {
            message_id: id,
            message_type: "Conference.Contracts:CheckinRecorded",
            implements: &[],
            message: br#"{"attendeeId": 1}"#,
            conversation_id: id,
            correlation_id,
            initiator_id: Some(&initiator),
            source_address: None,
            destination_address: None,
            sent_time: "2026-12-04T03:00:00.000000Z",
            headers: serde_json::Map::new(),
        };
        let read = |encoded: Vec<u8>| {
            decode(&envelope_properties(None), &encoded, false)
                .unwrap()
                .context
        };
        // From an incoming correlation_id such as `order-42`: left out.
        let context = read(encode(&outgoing(Some("order-42"))).unwrap());
        assert_eq!(context.correlation_id, None);
        let guid = Uuid::now_v7().to_string();
        let context = read(encode(&outgoing(Some(&guid))).unwrap());
        assert_eq!(context.correlation_id, Some(guid));
    }

    /// A consumed envelope of `headers` (a JSON object), as a handler's
    /// context sees it.
    fn consumed_with(headers: serde_json::Value) -> crate::MessageContext {
        let envelope = crate::envelope::Envelope {
            message_id: Uuid::now_v7(),
            event_type: "Conference.Contracts:AttendeeCheckedIn".into(),
            body: b"{}".to_vec(),
            headers: FieldTable::default(),
            redelivered: false,
            attempt: 1,
            trace: None,
            masstransit: Some(Context {
                headers: Some(headers.to_string()),
                ..Context::default()
            }),
            input_address: None,
            decoded: Default::default(),
            span: tracing::Span::none(),
        };
        crate::MessageContext::of(&std::sync::Arc::new(envelope))
    }

    #[test]
    fn a_follow_up_carries_every_consumed_header_in_its_envelope_and_a_bounded_few_as_amqp_headers() {
        // A hundred headers of a kilobyte each (untrusted, as sent): all in
        // the envelope, which MassTransit's consumers read; as AMQP headers
        // no more than the frame can take beside the follow-up's own.
        let big: serde_json::Map<String, serde_json::Value> = (0..100)
            .map(|i| (format!("h{i:03}"), serde_json::Value::String("x".repeat(1024))))
            .chain([("MT-Activity-Id".to_owned(), "00-a-b-01".into())])
            .collect();
        let context = consumed_with(serde_json::Value::Object(big));
        let headers = follow_up_headers(Some(&context), None);
        assert_eq!(headers.envelope.len(), 100, "every header but MassTransit's own");
        let amqp: usize = headers.amqp.iter().map(|(k, v)| k.len() + v.len()).sum();
        assert!(
            amqp <= MAX_TRANSFERRED_AMQP_BYTES && !headers.amqp.is_empty(),
            "{amqp}"
        );
        assert!(!headers.amqp.iter().any(|(k, _)| k.starts_with("MT-")));
    }

    #[test]
    fn a_follow_up_carries_every_header_but_masstransits_and_a_raw_messages_metadata() {
        for key in ["tenant", "traceparent", "x-custom", "MessageId", "x-inbox-reason"] {
            assert!(transferred(key, false), "{key} from an envelope");
        }
        for key in ["MT-Activity-Id", "MT-Redelivery-Count", "MT-Host-MachineName"] {
            assert!(!transferred(key, false), "{key}");
            assert!(!transferred(key, true), "{key}");
        }
        assert!(transferred("tenant", true));
        for key in [
            "MessageId",
            "CorrelationId",
            "ConversationId",
            "RequestId",
            "x-inbox-attempts",
            "x-death",
            "x-first-death-queue",
        ] {
            assert!(!transferred(key, true), "{key} from a raw message");
        }
    }

    #[test]
    fn a_retry_tiers_copy_carries_its_redelivery_count_in_the_envelopes_headers() {
        let copy = with_redelivery_count(CAPTURED.as_bytes(), 2);
        let fields: serde_json::Value = serde_json::from_slice(&copy).unwrap();
        assert_eq!(fields["headers"][headers::REDELIVERY_COUNT], 2);
        let original: serde_json::Value = serde_json::from_str(CAPTURED).unwrap();
        assert_eq!(fields["message"], original["message"], "the message as it was");
        assert_eq!(fields["messageId"], original["messageId"]);
        // `Headers: null` in an envelope written with PascalCase names.
        let pascal = br#"{"MessageId": "x", "Headers": null, "Message": {"n": 1.10}}"#;
        let copy = with_redelivery_count(pascal, 1);
        let text = String::from_utf8(copy.into_owned()).unwrap();
        assert!(text.contains(r#""Headers":{"MT-Redelivery-Count":1}"#), "{text}");
        assert!(
            text.contains(r#""Message":{"n": 1.10}"#),
            "kept to the byte: {text}"
        );
        // Not an envelope: unchanged.
        assert_eq!(with_redelivery_count(b"[1]", 1).as_ref(), b"[1]");
    }

    #[test]
    fn addresses_leave_out_the_default_port_and_virtual_host() {
        assert_eq!(
            address("localhost", 5672, "/", "checkins"),
            "rabbitmq://localhost/checkins"
        );
        assert_eq!(
            address("rabbit", 5673, "/", "Conference.Contracts:AttendeeCheckedIn"),
            "rabbitmq://rabbit:5673/Conference.Contracts:AttendeeCheckedIn"
        );
        assert_eq!(
            address("localhost", 5672, "my vhost", "q"),
            "rabbitmq://localhost/my%20vhost/q"
        );
        assert_eq!(message_urn("A.B:C"), "urn:message:A.B:C");
        assert_eq!(type_of_urn("urn:message:A.B:C"), Some("A.B:C"));
        assert_eq!(type_of_urn("urn:message:"), None);
        assert_eq!(type_of_urn("A.B:C"), None);
    }
}
