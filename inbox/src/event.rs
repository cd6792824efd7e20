//! Integration events and the messages that carry them.

use serde::Serialize;
use serde::de::DeserializeOwned;
use uuid::Uuid;

/// An event one service tells others about. Its [`TYPE`](Self::TYPE) is the
/// AMQP `type` property and routes deliveries to its handlers, so keep it
/// stable across releases; the body travels as JSON.
///
/// ```
/// #[derive(serde::Serialize, serde::Deserialize)]
/// struct AttendeeCheckedIn { attendee_id: i64, session_id: i64 }
///
/// impl rabbit_inbox::IntegrationEvent for AttendeeCheckedIn {
///     const TYPE: &'static str = "AttendeeCheckedIn";
/// }
/// ```
pub trait IntegrationEvent: Serialize + DeserializeOwned + Send + Sync + 'static {
    /// The stable type name on the wire.
    const TYPE: &'static str;

    /// On MassTransit's wire, the .NET base classes and interfaces the
    /// contract implements, by their names on the wire (`Namespace:Type`),
    /// most specific first, as MassTransit lists a message's types. A
    /// publish lists them in its `messageType` after [`TYPE`](Self::TYPE)
    /// and binds `TYPE`'s exchange to each of theirs, as MassTransit's
    /// publish topology does, so that a .NET consumer of a base type or an
    /// interface receives it. None by default; unused on this library's
    /// wire.
    ///
    /// ```
    /// #[derive(serde::Serialize, serde::Deserialize)]
    /// struct AttendeeCheckedIn { attendee_id: i64 }
    ///
    /// impl rabbit_inbox::IntegrationEvent for AttendeeCheckedIn {
    ///     const TYPE: &'static str = "Conference.Contracts:AttendeeCheckedIn";
    ///     const IMPLEMENTS: &'static [&'static str] = &["Conference.Contracts:IConferenceEvent"];
    /// }
    /// ```
    const IMPLEMENTS: &'static [&'static str] = &[];
}

/// An event with its identity: the `message_id` every copy of it carries and
/// the inbox deduplicates on. Publishing the same `Message` twice is a
/// redelivery; publishing the same event in a new `Message` is a new event.
///
/// Headers of its own travel beside the ones the library sets or carries
/// over (a tenant, say), as AMQP headers, and on MassTransit's wire in its
/// envelope's `headers` too, where a MassTransit consumer reads them:
///
/// ```
/// # use rabbit_inbox::{IntegrationEvent, Message};
/// # #[derive(serde::Serialize, serde::Deserialize)] struct OrderPlaced { id: i64 }
/// # impl IntegrationEvent for OrderPlaced { const TYPE: &'static str = "OrderPlaced"; }
/// let message = Message::new(OrderPlaced { id: 7 }).with_header("tenant", "acme");
/// assert_eq!(message.headers, [("tenant".to_owned(), "acme".to_owned())]);
/// ```
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<E> {
    /// The dedup key, a UUID v7 stamped when the message was created.
    pub id: Uuid,
    /// The event.
    pub event: E,
    /// Headers of its own, as text, in order; one set again replaces the
    /// one before it. The names the library sets for a message's flow
    /// (`correlation_id`, `causation_id`, `traceparent`, `tracestate`),
    /// its own (`x-inbox-…`), MassTransit's (`MT-…`) and the broker's
    /// (`x-death`…) are refused when it is published: they would say
    /// something of the message that is not so.
    pub headers: Vec<(String, String)>,
}

impl<E: IntegrationEvent> Message<E> {
    /// Wraps `event` in a message with a fresh UUID v7 id (time-ordered, so
    /// the inbox's primary key index stays append-mostly).
    pub fn new(event: E) -> Self {
        Self::with_id(Uuid::now_v7(), event)
    }

    /// Wraps `event` with a given id, for a message re-created from elsewhere.
    pub fn with_id(id: Uuid, event: E) -> Self {
        Self {
            id,
            event,
            headers: Vec::new(),
        }
    }

    /// The message with header `name` set to `value` (replacing one of
    /// that name set before).
    #[must_use]
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<String>) -> Self {
        let name = name.into();
        self.headers.retain(|(key, _)| *key != name);
        self.headers.push((name, value.into()));
        self
    }

    /// The event as the JSON body that goes on the wire.
    pub fn to_json(&self) -> crate::Result<Vec<u8>> {
        serde_json::to_vec(&self.event).map_err(|source| crate::Error::serialize(E::TYPE, source))
    }

    /// Its own headers, checked: none the library owns (see
    /// [`headers`](Self::headers)), none the broker would refuse.
    pub(crate) fn own_headers(&self) -> crate::Result<&[(String, String)]> {
        for (name, _) in &self.headers {
            let reserved = RESERVED.iter().any(|r| name.eq_ignore_ascii_case(r))
                || crate::fault::headers::BROKER_OWNED
                    .iter()
                    .any(|r| name.eq_ignore_ascii_case(r))
                || name.to_ascii_lowercase().starts_with("x-inbox-")
                || name.to_ascii_lowercase().starts_with("mt-");
            let why = match () {
                () if reserved => "is the library's, MassTransit's or the broker's own".to_owned(),
                () => match crate::limits::check_name("header name", name) {
                    Ok(()) => continue,
                    Err(why) => why,
                },
            };
            return Err(crate::Error::new(
                crate::ErrorKind::Usage,
                format!(
                    "message {}: header `{}` {why}",
                    self.id,
                    crate::fault::truncate(name, 64)
                ),
            ));
        }
        Ok(&self.headers)
    }
}

/// The headers the library sets for a message's flow.
const RESERVED: &[&str] = &[
    crate::context::CORRELATION_ID,
    crate::context::CAUSATION_ID,
    "traceparent",
    "tracestate",
];

impl<E> Message<E> {
    /// Its own headers as an AMQP table.
    pub(crate) fn header_table(&self) -> lapin::types::FieldTable {
        let mut table = lapin::types::FieldTable::default();
        for (name, value) in &self.headers {
            table.insert(
                name.as_str().into(),
                lapin::types::AMQPValue::LongString(value.as_str().into()),
            );
        }
        table
    }
}
