//! RabbitMQ: connections, the queues kept for each consumed queue, confirmed
//! publishing, and replay from the error queue.
//!
//! For a consumed queue `Q` the runtime keeps `Q` itself, one retry tier
//! `Q.retry.<n>` per `failure.delays` entry (messages wait out the delay,
//! then dead-letter back to `Q`), `Q.error` (messages that failed every
//! attempt, or can never succeed) and `Q.skipped` (no handler for their type).

use std::collections::HashSet;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use uuid::Uuid;

use crate::envelope::JSON;
use crate::error::{Error, Result};
use crate::event::{IntegrationEvent, Message};
use crate::fault;
use crate::settings::{FailureSettings, MAX_DELIVERY_LIMIT, QueueKind, QueueSettings, Settings};

/// AMQP `delivery_mode` for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

/// The longest suffix a kept queue adds to `Q` (`.retry.` and up to nine
/// digits, or `.skipped`), for the 255-byte limit on names.
pub(crate) const LONGEST_SUFFIX: usize = 16;

/// `Q.retry.<tier>`, tiers counted from 1.
pub fn retry_queue(queue: &str, tier: usize) -> String {
    format!("{queue}.retry.{tier}")
}

/// `Q.error`.
pub fn error_queue(queue: &str) -> String {
    format!("{queue}.error")
}

/// `Q.skipped`.
pub fn skipped_queue(queue: &str) -> String {
    format!("{queue}.skipped")
}

/// Connects to `message_bus.amqp_url` with lapin's automatic recovery on
/// (connection, channels, topology, consumers and QoS are replayed after a
/// network fault). `name` shows in the broker's connection list.
pub async fn connect(settings: &Settings, name: &str) -> Result<Connection> {
    let properties = ConnectionProperties::default()
        .enable_auto_recover()
        .with_connection_name(LongString::from(name));
    Ok(Connection::connect(&settings.message_bus.amqp_url, properties).await?)
}

/// Declares `Q`, its retry tiers, `Q.error` and `Q.skipped`: durable, of the
/// queue's kind. Idempotent; a queue that exists with other arguments is an
/// [`Error::Topology`] naming it and the difference.
///
/// No queue of these can drop a message on RabbitMQ 4, where a quorum queue
/// without a delivery limit gets one of 20 and drops past it:
/// - `Q` dead-letters to `Q.error`, past `queues[].delivery_limit`
///   deliveries (quorum only: classic queues count none);
/// - `Q.error` and `Q.skipped` are never consumed by the runtime, and their
///   limit is the highest the broker takes, so that inspecting them by hand
///   (get and requeue) cannot spend it;
/// - the retry tiers are never consumed at all: their messages leave by
///   expiring, dead-lettered back to `Q`.
pub async fn declare_topology(
    channel: &Channel,
    queue: &QueueSettings,
    failure: &FailureSettings,
) -> Result<()> {
    let quorum = queue.kind == QueueKind::Quorum;
    let base = || {
        let mut arguments = FieldTable::default();
        let kind = if quorum { "quorum" } else { "classic" };
        arguments.insert("x-queue-type".into(), text(kind));
        arguments
    };
    // Dead-lettering to `to`: at-least-once for quorum queues, where
    // at-most-once could drop the message on a broker fault.
    let dead_letter_to = |arguments: &mut FieldTable, to: &str| {
        arguments.insert("x-dead-letter-exchange".into(), text(""));
        arguments.insert("x-dead-letter-routing-key".into(), text(to));
        if quorum {
            arguments.insert("x-dead-letter-strategy".into(), text("at-least-once"));
            arguments.insert("x-overflow".into(), text("reject-publish"));
        }
    };
    let limit = |arguments: &mut FieldTable, limit: u32| {
        if quorum {
            arguments.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit.into()));
        }
    };

    let mut main = base();
    dead_letter_to(&mut main, &error_queue(&queue.name));
    limit(&mut main, queue.delivery_limit);
    declare(channel, &queue.name, main).await?;
    for (i, delay) in failure.delays.iter().enumerate() {
        let mut arguments = base();
        // Settings validation keeps every delay within 32 bits of milliseconds.
        arguments.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(delay.as_millis() as i64),
        );
        dead_letter_to(&mut arguments, &queue.name);
        declare(channel, &retry_queue(&queue.name, i + 1), arguments).await?;
    }
    for set_aside in [error_queue(&queue.name), skipped_queue(&queue.name)] {
        let mut arguments = base();
        limit(&mut arguments, MAX_DELIVERY_LIMIT);
        declare(channel, &set_aside, arguments).await?;
    }
    Ok(())
}

async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) -> Result<()> {
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, arguments)
        .await
        .map_err(|e| Error::Topology {
            queue: queue.to_owned(),
            reason: format!(
                "{e} (a queue that exists with other arguments must be re-declared, or the settings changed to \
                 match it: README, \"Upgrading queues\")"
            ),
        })?;
    Ok(())
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

/// Publishes with publisher confirms: every `publish` returns once the broker
/// has taken responsibility for the message, and fails otherwise.
#[derive(Clone)]
pub struct AmqpPublisher {
    channel: Channel,
    exchange: String,
}

impl AmqpPublisher {
    /// Opens a confirming channel on `connection` that publishes to `exchange`
    /// (`""` is the default exchange, where the routing key is a queue name).
    pub async fn new(connection: &Connection, exchange: impl Into<String>) -> Result<Self> {
        let channel = connection.create_channel().await?;
        channel.confirm_select(ConfirmSelectOptions::default()).await?;
        Ok(Self {
            channel,
            exchange: exchange.into(),
        })
    }

    /// Publishes `message` with its id as `message_id`, its type as `type`,
    /// JSON content and persistent delivery.
    pub async fn publish<E: IntegrationEvent>(&self, routing_key: &str, message: &Message<E>) -> Result<()> {
        let properties = BasicProperties::default()
            .with_message_id(message.id.to_string().into())
            .with_type(E::TYPE.into())
            .with_content_type(JSON.into())
            .with_delivery_mode(PERSISTENT);
        self.publish_raw(routing_key, properties, &message.to_json()?)
            .await
    }

    /// Publishes `body` with `properties` as they are. Fails unless the
    /// broker confirms it and routed it to at least one queue.
    pub async fn publish_raw(
        &self,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> Result<()> {
        let message_id = properties
            .message_id()
            .as_ref()
            .map_or_else(|| "none".to_owned(), |id| id.as_str().to_owned());
        let options = BasicPublishOptions {
            mandatory: true, // an unroutable message comes back instead of vanishing
            ..BasicPublishOptions::default()
        };
        let confirmation = self
            .channel
            .basic_publish(
                self.exchange.as_str().into(),
                routing_key.into(),
                options,
                body,
                properties,
            )
            .await?
            .await?;
        let not_confirmed = |reason: String| Error::NotConfirmed {
            message_id: message_id.clone(),
            routing_key: routing_key.to_owned(),
            reason,
        };
        if !confirmation.is_ack() {
            return Err(not_confirmed("the broker nacked it".into()));
        }
        if let Some(returned) = confirmation.take_message() {
            return Err(not_confirmed(format!(
                "unroutable: {}",
                returned.reply_text.as_str()
            )));
        }
        Ok(())
    }

    /// The channel it publishes on.
    pub fn channel(&self) -> &Channel {
        &self.channel
    }
}

/// Where [`replay`] takes messages from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SetAside {
    /// `Q.error`: messages that failed every attempt, or can never succeed.
    Error,
    /// `Q.skipped`: messages of a type no handler was registered for.
    Skipped,
}

impl SetAside {
    /// The queue's name, for consumed queue `queue`.
    pub fn queue(self, queue: &str) -> String {
        match self {
            SetAside::Error => error_queue(queue),
            SetAside::Skipped => skipped_queue(queue),
        }
    }
}

/// What [`replay`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ReplayReport {
    /// Moved back to `Q`.
    pub replayed: usize,
    /// Left where they were (not selected).
    pub left: usize,
}

/// Moves messages from `Q.error` or `Q.skipped` back to `Q`: all of them,
/// or those whose `message_id` is in `only`. Each keeps its body,
/// properties and `message_id`, so one that was processed after all is
/// skipped by the inbox (if it comes back within `retention.days`); the
/// fault headers are removed, so the failure policy starts afresh. Each
/// copy is confirmed in `Q` before the original leaves.
///
/// The messages not selected go round: each is published again at the tail
/// of the queue it came from, confirmed, then the original is acked, so
/// their order holds and none is ever handed back to the broker (on a
/// quorum queue that would spend a delivery of each).
pub async fn replay(
    connection: &Connection,
    queue: &str,
    from: SetAside,
    only: Option<&HashSet<Uuid>>,
) -> Result<ReplayReport> {
    let source = from.queue(queue);
    let channel = connection.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let waiting = channel
        .queue_declare(source.as_str().into(), passive, FieldTable::default())
        .await
        .map_err(|e| Error::Topology {
            queue: source.clone(),
            reason: e.to_string(),
        })?
        .message_count();
    let publisher = AmqpPublisher::new(connection, "").await?;
    let mut report = ReplayReport::default();
    // Only as many as were waiting: the unselected ones come round again.
    for _ in 0..waiting {
        let Some(message) = channel
            .basic_get(source.as_str().into(), BasicGetOptions { no_ack: false })
            .await?
        else {
            break;
        };
        let delivery = message.delivery;
        let id = delivery
            .properties
            .message_id()
            .as_ref()
            .and_then(|id| Uuid::try_parse(id.as_str()).ok());
        let selected = only.is_none_or(|ids| id.is_some_and(|id| ids.contains(&id)));
        if selected {
            let properties = without_headers(delivery.properties.clone(), &fault::headers::ALL);
            publisher.publish_raw(queue, properties, &delivery.data).await?;
            report.replayed += 1;
        } else {
            let properties = without_headers(delivery.properties.clone(), &[]);
            publisher.publish_raw(&source, properties, &delivery.data).await?;
            report.left += 1;
        }
        delivery.acker.ack(BasicAckOptions::default()).await?;
    }
    channel.close(200, "replay done".into()).await?;
    publisher.channel().close(200, "replay done".into()).await?;
    Ok(report)
}

/// `properties` less the headers named in `removed` and the broker's
/// delivery count, which belongs to the queue that counted it.
fn without_headers(properties: BasicProperties, removed: &[&str]) -> BasicProperties {
    let Some(headers) = properties.headers() else {
        return properties;
    };
    let mut removed = removed.to_vec();
    removed.push(fault::headers::DELIVERY_COUNT);
    let kept = fault::without(headers, &removed);
    properties.with_headers(kept)
}
