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
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message<E> {
    /// The dedup key, a UUID v7 stamped when the message was created.
    pub id: Uuid,
    /// The event.
    pub event: E,
}

impl<E: IntegrationEvent> Message<E> {
    /// Wraps `event` in a message with a fresh UUID v7 id (time-ordered, so
    /// the inbox's primary key index stays append-mostly).
    pub fn new(event: E) -> Self {
        Self {
            id: Uuid::now_v7(),
            event,
        }
    }

    /// Wraps `event` with a given id, for a message re-created from elsewhere.
    pub fn with_id(id: Uuid, event: E) -> Self {
        Self { id, event }
    }

    /// The event as the JSON body that goes on the wire.
    pub fn to_json(&self) -> crate::Result<Vec<u8>> {
        serde_json::to_vec(&self.event).map_err(|source| crate::Error::serialize(E::TYPE, source))
    }
}
