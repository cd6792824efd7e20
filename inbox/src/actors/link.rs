//! [`Link`]: a queue's link to the broker, and opening it again.

use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use lapin::{Channel, Connection, Consumer};

use crate::Error;
use crate::actors::handler::HandledTypes;
use crate::amqp::AmqpPublisher;
use crate::backoff::Backoff;
use crate::{QueueSettings, Settings, amqp};

/// The first pause before reconnecting; doubled up to [`MAX_RECONNECT_PAUSE`].
const FIRST_RECONNECT_PAUSE: Duration = Duration::from_millis(100);
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(30);

/// A queue's link to the broker: a connection of its own, the consuming
/// channel and its stream, and a confirming channel for moving messages to
/// the retry tiers, `Q.error` and `Q.skipped`.
pub(crate) struct Link {
    pub(crate) connection: Arc<Connection>,
    pub(crate) channel: Channel,
    pub(crate) stream: Consumer,
    pub(crate) forwarder: AmqpPublisher,
    /// The event types handlers are registered for, whose exchanges
    /// MassTransit's wire binds to the queue's.
    pub(crate) handled: HandledTypes,
    /// Whether the broker sets aside a message redelivered past the
    /// queue's delivery limit; if not, the runtime does.
    pub(crate) broker_limits_deliveries: bool,
    /// Where it does not, the delivery number on which the runtime sets a
    /// message aside (see `Declared::delivery_limit`).
    pub(crate) delivery_limit: u32,
}

impl Link {
    /// Connects, declares the queue's topology, sets its prefetch and starts
    /// consuming.
    pub(crate) async fn open(
        settings: &Settings,
        queue: &QueueSettings,
        handled: HandledTypes,
    ) -> crate::Result<Self> {
        let connection = amqp::connect(settings, &format!("inbox {}", queue.name)).await?;
        let types = handled.names();
        let wire = settings.message_bus.wire;
        let failure = queue.failure_policy(&settings.failure);
        let declared = amqp::declare_wire_topology(&connection, queue, &failure, wire, &types).await?;
        let channel = connection.create_channel().await.map_err(Error::client)?;
        channel
            .basic_qos(queue.prefetch, BasicQosOptions { global: false })
            .await
            .map_err(Error::client)?;
        let stream = channel
            .basic_consume(
                queue.name.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(Error::client)?;
        let forwarder = AmqpPublisher::new(&connection, "")
            .await?
            .with_confirm_timeout(settings.message_bus.confirm_timeout);
        Ok(Self {
            connection,
            channel,
            stream,
            forwarder,
            handled,
            broker_limits_deliveries: declared.broker_limits_deliveries,
            delivery_limit: declared.delivery_limit(queue.delivery_limit),
        })
    }

    /// Closes `old` (within `message_bus.connect_timeout`: a connection
    /// whose packets vanish never answers) and opens a new link, trying
    /// again with a growing pause until it is open.
    pub(crate) async fn reopen(
        settings: &Settings,
        queue: &QueueSettings,
        handled: HandledTypes,
        old: &Connection,
    ) -> Self {
        let closing = old.close(320, "reconnecting".into());
        let _ = tokio::time::timeout(settings.message_bus.connect_timeout, closing).await;
        let mut backoff = Backoff::new(FIRST_RECONNECT_PAUSE, MAX_RECONNECT_PAUSE);
        loop {
            match Link::open(settings, queue, handled.clone()).await {
                Ok(link) => return link,
                Err(e) => {
                    let pause = backoff.next_pause();
                    tracing::warn!(queue = %queue.name, error = %e, "reconnecting failed; trying again in {pause:?}");
                    tokio::time::sleep(pause).await;
                }
            }
        }
    }
}
