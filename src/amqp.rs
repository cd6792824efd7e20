//! RabbitMQ: connections, queue topology and confirmed publishing.

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};

use crate::envelope::JSON;
use crate::error::{Error, Result};
use crate::event::{IntegrationEvent, Message};
use crate::settings::{QueueKind, QueueSettings, Settings};

/// AMQP `delivery_mode` for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

/// Connects to `message_bus.amqp_url` with lapin's automatic recovery on
/// (connection, channels, topology, consumers and QoS are replayed after a
/// network fault). `name` shows in the broker's connection list.
pub async fn connect(settings: &Settings, name: &str) -> Result<Connection> {
    let properties = ConnectionProperties::default()
        .enable_auto_recover()
        .with_connection_name(LongString::from(name));
    Ok(Connection::connect(&settings.message_bus.amqp_url, properties).await?)
}

/// Declares a consumed queue: durable, of the configured kind. Idempotent.
pub async fn declare_queue(channel: &Channel, queue: &QueueSettings) -> Result<()> {
    let mut arguments = FieldTable::default();
    let kind = match queue.kind {
        QueueKind::Quorum => "quorum",
        QueueKind::Classic => "classic",
    };
    arguments.insert("x-queue-type".into(), AMQPValue::LongString(kind.into()));
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.name.as_str().into(), options, arguments)
        .await
        .map_err(|e| {
            Error::Runtime(format!(
                "cannot declare queue `{}` as a durable {kind} queue (does it exist with other arguments?): {e}",
                queue.name
            ))
        })?;
    Ok(())
}

/// Publishes events with publisher confirms: [`publish`](Self::publish)
/// returns once the broker has taken responsibility for the message.
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
    /// JSON content and persistent delivery. Fails unless the broker confirms
    /// it and routed it to at least one queue.
    pub async fn publish<E: IntegrationEvent>(&self, routing_key: &str, message: &Message<E>) -> Result<()> {
        let properties = BasicProperties::default()
            .with_message_id(message.id.to_string().into())
            .with_type(E::TYPE.into())
            .with_content_type(JSON.into())
            .with_delivery_mode(PERSISTENT);
        let not_confirmed = |reason: String| Error::NotConfirmed {
            message_id: message.id,
            routing_key: routing_key.to_owned(),
            reason,
        };
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
                &message.to_json()?,
                properties,
            )
            .await?
            .await?;
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
