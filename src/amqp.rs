//! RabbitMQ: connections, the queues kept for each consumed queue, confirmed
//! publishing, and replay from the error queue.
//!
//! For a consumed queue `Q` the runtime keeps `Q` itself, one retry tier
//! `Q.retry.<n>` per `failure.delays` entry (messages wait out the delay,
//! then dead-letter back to `Q`), `Q.error` (messages that failed every
//! attempt, or can never succeed) and `Q.skipped` (no handler for their type).

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions, ExchangeBindOptions,
    ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties, ExchangeKind};
use tracing::Instrument;
use uuid::Uuid;

use crate::confirms::{Confirmed, Confirms};
use crate::envelope::JSON;
use crate::error::{Error, Result};
use crate::event::{IntegrationEvent, Message};
use crate::fault;
use crate::settings::{FailureSettings, MAX_DELIVERY_LIMIT, QueueKind, QueueSettings, Settings, Wire};
use crate::trace::TraceContext;

/// AMQP `delivery_mode` for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

pub use crate::names::{error_queue, retry_queue, skipped_queue};

/// Which of `message_bus.amqp_urls` the next connection tries first: one
/// counter for the process, so that its connections spread over the nodes
/// of a cluster, and a reconnect starts at another node than the last.
static NEXT_BROKER: AtomicUsize = AtomicUsize::new(0);

/// Connects to the broker (`message_bus.amqp_url`, or the nodes of
/// `message_bus.amqp_urls` in turn). `name` shows in the broker's
/// connection list.
///
/// Tries again for up to `message_bus.connect_timeout`: a broker that is
/// down or unreachable at start is a WARN per attempt naming its host and
/// port (never the password), then an error of kind [`Unreachable`](crate::ErrorKind::Unreachable), never a
/// silent hang. With several nodes, a failed attempt moves on to the next
/// node at once, each attempt bounded by its share of the timeout (a node
/// whose packets vanish must not take all of it), and a pause that grows
/// follows each round of them all. The connection logs the broker's
/// `connection.blocked` (a memory or disk alarm: publishing stops) and
/// `connection.unblocked`.
///
/// lapin's automatic recovery stays off: the runtime's own reconnect (a
/// consumer whose connection ended, a publisher's) comes here, with one
/// node or several (then it goes to the next node). One owner of
/// reconnection, not two: with both, a consumer that gave up waiting for
/// lapin's recovery and opened a new connection would find the old one
/// recovered behind it too, consuming deliveries nobody settles.
pub async fn connect(settings: &Settings, name: &str) -> Result<Arc<Connection>> {
    let urls = settings.amqp_urls();
    let timeout = settings.message_bus.connect_timeout;
    let per_node = match urls.len() {
        1 => timeout,
        n => (timeout / n as u32).max(MIN_NODE_ATTEMPT),
    };
    let started = std::time::Instant::now();
    let mut backoff = crate::Backoff::new(FIRST_CONNECT_PAUSE, MAX_CONNECT_PAUSE);
    let mut next = NEXT_BROKER.fetch_add(1, Ordering::Relaxed);
    let mut tried_in_round = 0;
    loop {
        let url = urls[next % urls.len()];
        next = next.wrapping_add(1);
        tried_in_round += 1;
        let endpoint = crate::settings::broker_endpoint(url);
        let left = timeout.saturating_sub(started.elapsed());
        let properties = ConnectionProperties::default().with_connection_name(LongString::from(name));
        // Reach the port first, so that each failure is seen and logged
        // here, with the host it concerns.
        let connecting = async {
            reach(url).await?;
            Connection::connect(url, properties)
                .await
                .map_err(|e| crate::describe(&e))
        };
        let limit = left.min(per_node);
        let cause = match tokio::time::timeout(limit, connecting).await {
            Ok(Ok(connection)) => {
                if urls.len() > 1 {
                    tracing::info!(broker = %endpoint, connection = name, "connected");
                }
                log_alarms(&connection, name, &endpoint);
                return Ok(Arc::new(connection));
            }
            Ok(Err(cause)) => cause,
            Err(_) => format!("no answer within {}", humantime::format_duration(limit)),
        };
        let remaining = timeout.saturating_sub(started.elapsed());
        if remaining.is_zero() {
            return Err(Error::unreachable(
                "broker",
                if urls.len() == 1 {
                    endpoint
                } else {
                    settings.broker_endpoint()
                },
                timeout,
                "message_bus.connect_timeout",
                cause,
            ));
        }
        if tried_in_round < urls.len() {
            tracing::warn!(broker = %endpoint, connection = name, %cause, "cannot connect to the broker; trying the next node");
            continue;
        }
        tried_in_round = 0;
        let pause = backoff.next_pause().min(remaining);
        tracing::warn!(broker = %endpoint, connection = name, %cause, "cannot connect to the broker; trying again in {pause:?}");
        tokio::time::sleep(pause).await;
    }
}

/// Opens (and closes) a TCP connection to the broker `url` names.
async fn reach(url: &str) -> std::result::Result<(), String> {
    let uri: lapin::uri::AMQPUri = url.parse()?;
    let address = (uri.authority.host.as_str(), uri.authority.port);
    tokio::net::TcpStream::connect(address)
        .await
        .map(drop)
        .map_err(|e| e.to_string())
}

/// The least time one attempt on one node of several may take.
const MIN_NODE_ATTEMPT: Duration = Duration::from_secs(2);

/// The first pause between connection attempts; doubled up to
/// [`MAX_CONNECT_PAUSE`].
pub(crate) const FIRST_CONNECT_PAUSE: std::time::Duration = std::time::Duration::from_millis(200);
pub(crate) const MAX_CONNECT_PAUSE: std::time::Duration = std::time::Duration::from_secs(5);

/// Logs the broker's resource alarms as they reach `connection`: while one
/// lasts, the broker takes no publishes (moves to retry tiers and the error
/// queue wait, then hand their message back).
fn log_alarms(connection: &Connection, name: &str, endpoint: &str) {
    use futures_util::StreamExt;
    use lapin::Event;
    let mut events = connection.events_listener();
    let (name, endpoint) = (name.to_owned(), endpoint.to_owned());
    tokio::spawn(async move {
        while let Some(event) = events.next().await {
            match event {
                Event::ConnectionBlocked(reason) => tracing::warn!(
                    broker = %endpoint, connection = %name, %reason,
                    "the broker blocked the connection (a resource alarm): publishing waits until it lifts"
                ),
                Event::ConnectionUnblocked => {
                    tracing::warn!(broker = %endpoint, connection = %name, "the broker unblocked the connection")
                }
                _ => {}
            }
        }
    });
}

/// Declares `Q`, its retry tiers, `Q.error` and `Q.skipped`: durable, of the
/// queue's kind. Idempotent; a queue that exists with other arguments is an
/// error of kind [`Topology`](crate::ErrorKind::Topology) naming it and the difference.
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
    declare_wire_topology(channel, queue, failure, Wire::Inbox, &[]).await
}

/// [`declare_topology`] with `wire`'s names. For [`Wire::Masstransit`],
/// also the exchanges MassTransit 8 declares for a receive endpoint
/// (RMQ/RabbitMqTransport/Configuration/RabbitMqReceiveEndpointBuilder.cs,
/// Topology/RabbitMqMessageConsumeTopology.cs at v8.5.8): a durable fanout
/// exchange named like `Q` and bound to it; one per type of
/// `message_types` (`Namespace:Type`), bound to exchange `Q`, so that a
/// MassTransit producer publishing the type reaches `Q` with no other
/// setup; and `Q_error` and `Q_skipped` each behind an exchange of its
/// name, where MassTransit's tools look.
pub async fn declare_wire_topology(
    channel: &Channel,
    queue: &QueueSettings,
    failure: &FailureSettings,
    wire: Wire,
    message_types: &[&str],
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
    dead_letter_to(&mut main, &wire.error_queue(&queue.name));
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
        declare(channel, &wire.retry_queue(&queue.name, i + 1), arguments).await?;
    }
    for set_aside in [wire.error_queue(&queue.name), wire.skipped_queue(&queue.name)] {
        let mut arguments = base();
        limit(&mut arguments, MAX_DELIVERY_LIMIT);
        declare(channel, &set_aside, arguments).await?;
        if wire == Wire::Masstransit {
            fanout_exchange(channel, &set_aside).await?;
            bind_queue(channel, &set_aside).await?;
        }
    }
    if wire == Wire::Masstransit {
        for message_type in message_types {
            crate::limits::check_name("message type", message_type).map_err(|reason| {
                Error::exchange(crate::fault::truncate(message_type, 64).into_owned(), reason)
            })?;
        }
        fanout_exchange(channel, &queue.name).await?;
        bind_queue(channel, &queue.name).await?;
        for message_type in message_types {
            fanout_exchange(channel, message_type).await?;
            bind_exchange(channel, message_type, &queue.name).await?;
        }
    }
    Ok(())
}

/// Binds `queue` to the durable fanout exchange `exchange`, declaring the
/// exchange: how a MassTransit consumer of a message type receives what is
/// published to the type's exchange (`Namespace:Type`).
pub async fn bind_to_fanout(channel: &Channel, queue: &str, exchange: &str) -> Result<()> {
    crate::limits::check_name("exchange", exchange)
        .map_err(|reason| Error::exchange(crate::fault::truncate(exchange, 64).into_owned(), reason))?;
    fanout_exchange(channel, exchange).await?;
    channel
        .queue_bind(
            queue.into(),
            exchange.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            Error::topology(
                queue.to_owned(),
                format!("binding it to exchange `{exchange}`: {}", crate::describe(&e)),
            )
        })?;
    Ok(())
}

/// Binds exchange `source` to exchange `destination`: what `source` takes,
/// `destination` takes too.
async fn bind_exchange(channel: &Channel, source: &str, destination: &str) -> Result<()> {
    channel
        .exchange_bind(
            destination.into(),
            source.into(),
            "".into(),
            ExchangeBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            Error::exchange(
                source.to_owned(),
                format!("binding it to exchange `{destination}`: {}", crate::describe(&e)),
            )
        })
}

/// Declares a durable fanout exchange named `name`, as MassTransit does
/// for its endpoints and message types.
async fn fanout_exchange(channel: &Channel, name: &str) -> Result<()> {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(name.into(), ExchangeKind::Fanout, options, FieldTable::default())
        .await
        .map_err(|e| Error::exchange(name.to_owned(), crate::describe(&e)))
}

/// Binds the queue `name` to the exchange of its name.
async fn bind_queue(channel: &Channel, name: &str) -> Result<()> {
    channel
        .queue_bind(
            name.into(),
            name.into(),
            "".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(|e| {
            Error::topology(
                name.to_owned(),
                format!("binding it to its exchange: {}", crate::describe(&e)),
            )
        })?;
    Ok(())
}

/// Declares `queue` durable, of `kind`, with no other argument: a queue the
/// service's own messages go to (the outbox's destinations, say).
/// Idempotent.
pub async fn declare_queue(channel: &Channel, queue: &str, kind: QueueKind) -> Result<()> {
    let mut arguments = FieldTable::default();
    let kind = if kind == QueueKind::Quorum {
        "quorum"
    } else {
        "classic"
    };
    arguments.insert("x-queue-type".into(), text(kind));
    declare(channel, queue, arguments).await
}

async fn declare(channel: &Channel, queue: &str, arguments: FieldTable) -> Result<()> {
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(queue.into(), options, arguments)
        .await
        .map_err(|e| Error::topology(queue.to_owned(), format!(
                "{e} (a queue that exists with other arguments must be re-declared, or the settings changed to \
                 match it: docs/operations.md, \"Upgrading queues\")"
            )))?;
    Ok(())
}

fn text(value: &str) -> AMQPValue {
    AMQPValue::LongString(value.into())
}

/// Publishes with publisher confirms: every `publish` returns once the broker
/// has taken responsibility for the message, and fails otherwise, within
/// its confirm timeout.
///
/// A channel error (publishing to an exchange that does not exist, say)
/// closes the channel on the broker's side: the publish that caused it
/// fails, and the next one opens a fresh channel, so one bad publish never
/// stops the ones after it. A publisher from [`connect`](Self::connect)
/// owns its connection and also opens a new one when it is lost, or still
/// opening past `message_bus.connect_timeout` (a network that drops
/// packets). Clones share the channel.
///
/// Before a message is sent it must fit what the broker takes
/// ([`crate::limits`]): else it fails alone, as
/// an error of kind [`Unpublishable`](crate::ErrorKind::Unpublishable), rather than close the connection for every
/// other publish on it. Nothing is sent while the broker blocks the
/// connection (a resource alarm): a publish waits for the alarm to lift
/// within its confirm timeout, then fails as an error of kind [`Blocked`](crate::ErrorKind::Blocked). A
/// returned (unroutable) message is matched to its publish by
/// `message_id`.
#[derive(Clone)]
pub struct AmqpPublisher {
    link: Arc<tokio::sync::Mutex<PublishLink>>,
    /// How to connect again, for a publisher that owns its connection.
    redial: Option<Arc<Redial>>,
    exchange: String,
    confirm_timeout: Duration,
    /// The largest body [`Sink::send`](crate::Sink::send) lets out.
    max_message_size: usize,
    /// How outbox rows go out ([`Sink::send`](crate::Sink::send)).
    wire: Wire,
    /// With MassTransit's wire, the type exchanges declared so far: each is
    /// declared before its first publish, as MassTransit does.
    declared: Arc<std::sync::Mutex<HashSet<String>>>,
}

impl std::fmt::Debug for AmqpPublisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AmqpPublisher")
            .field("exchange", &self.exchange)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("owns_its_connection", &self.redial.is_some())
            .finish_non_exhaustive()
    }
}

/// Whether `connection` is not blocked by a resource alarm, or no longer
/// within `patience`.
async fn unblocked_within(connection: &Connection, patience: Duration) -> bool {
    let started = std::time::Instant::now();
    while connection.status().blocked() {
        if started.elapsed() >= patience {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    true
}

/// What one publish goes out on.
struct Publishing {
    channel: Channel,
    confirms: Confirms,
    connection: Arc<Connection>,
}

/// A publisher's connection and channel.
struct PublishLink {
    connection: Arc<Connection>,
    channel: Channel,
    /// The channel's confirms, each read with its own return.
    confirms: Confirms,
    /// Since when the connection has been seen down.
    down_since: Option<std::time::Instant>,
}

struct Redial {
    settings: Settings,
    name: String,
}

/// How long a publish waits for the broker's confirm unless told otherwise.
const DEFAULT_CONFIRM_TIMEOUT: Duration = Duration::from_secs(30);

impl AmqpPublisher {
    /// Opens a confirming channel on `connection` that publishes to `exchange`
    /// (`""` is the default exchange, where the routing key is a queue name).
    /// Confirms are awaited for 30 s; see
    /// [`with_confirm_timeout`](Self::with_confirm_timeout).
    pub async fn new(connection: &Arc<Connection>, exchange: impl Into<String>) -> Result<Self> {
        let (channel, confirms) = confirming_channel(connection).await?;
        Ok(Self {
            link: Arc::new(tokio::sync::Mutex::new(PublishLink {
                connection: Arc::clone(connection),
                channel,
                confirms,
                down_since: None,
            })),
            redial: None,
            exchange: exchange.into(),
            confirm_timeout: DEFAULT_CONFIRM_TIMEOUT,
            max_message_size: crate::limits::DEFAULT_MAX_MESSAGE_SIZE,
            wire: Wire::Inbox,
            declared: Arc::default(),
        })
    }

    /// A publisher with a connection of its own ([`connect`]ed as `name`),
    /// to `message_bus.exchange`, confirms awaited for
    /// `message_bus.confirm_timeout`, outbox rows' bodies bounded by
    /// `message_bus.max_message_size`. It connects again by itself when its
    /// connection is lost.
    pub async fn connect(settings: &Settings, name: &str) -> Result<Self> {
        let connection = connect(settings, name).await?;
        let mut publisher = Self::new(&connection, settings.message_bus.exchange.clone())
            .await?
            .with_confirm_timeout(settings.message_bus.confirm_timeout);
        publisher.max_message_size = settings.message_bus.max_message_size;
        publisher.wire = settings.message_bus.wire;
        publisher.redial = Some(Arc::new(Redial {
            settings: settings.clone(),
            name: name.to_owned(),
        }));
        Ok(publisher)
    }

    /// Waits at most `timeout` for each publish's confirm: a broker under a
    /// resource alarm takes no publishes, and a network that drops packets
    /// answers nothing. Past it the publish fails (the message may still
    /// arrive: a caller that tries again sends a duplicate, which the
    /// receiving inbox skips).
    pub fn with_confirm_timeout(mut self, timeout: Duration) -> Self {
        self.confirm_timeout = timeout;
        self
    }

    /// Publishes in `wire`'s format and topology (see
    /// [`publish`](Self::publish)); a publisher from
    /// [`connect`](Self::connect) takes `message_bus.wire`.
    pub fn with_wire(mut self, wire: Wire) -> Self {
        self.wire = wire;
        self
    }

    /// The largest body it sends as an outbox [`Sink`](crate::Sink).
    pub(crate) fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// The wire it publishes in: how it sends messages and outbox rows.
    pub fn wire(&self) -> Wire {
        self.wire
    }

    /// Declares the durable fanout exchange of a published type, `name`,
    /// unless this publisher already did, bound to the exchanges of the
    /// types it `implements`: MassTransit's publish topology, declared
    /// before a type's first publish (RMQ/RabbitMqTransport/Topology/
    /// RabbitMqMessagePublishTopology.cs `Apply` at v8.5.8), through which
    /// a `Fault<T>` reaches `MassTransit:Fault`'s subscribers too.
    pub async fn declare_type_exchange(&self, name: &str, implements: &[&str]) -> Result<()> {
        // First: a channel replaced here forgets what was declared on it.
        let Publishing { channel, .. } = self.live_channel().await?;
        let known = self.declared.lock().map(|d| d.contains(name)).unwrap_or(false);
        if known {
            return Ok(());
        }
        for exchange in std::iter::once(&name).chain(implements) {
            // A name past 255 bytes would panic in the client.
            crate::limits::check_name("exchange", exchange).map_err(|reason| {
                Error::exchange(crate::fault::truncate(exchange, 64).into_owned(), reason)
            })?;
        }
        fanout_exchange(&channel, name).await?;
        for implemented in implements {
            fanout_exchange(&channel, implemented).await?;
            bind_exchange(&channel, name, implemented).await?;
        }
        if let Ok(mut declared) = self.declared.lock() {
            declared.insert(name.to_owned());
        }
        Ok(())
    }

    /// Why a message with `properties` would not fit one frame of this
    /// publisher's connection (see [`crate::limits::check_properties`]),
    /// if it would not.
    pub async fn check_fits(&self, properties: &BasicProperties) -> std::result::Result<(), String> {
        let frame_max = self.link.lock().await.connection.configuration().frame_max();
        crate::limits::check_properties(properties, frame_max)
    }

    /// Declares `exchange` (durable, of type topic) unless it is the default
    /// exchange `""`. An exchange that exists with another type is an
    /// error of kind [`Topology`](crate::ErrorKind::Topology) naming it.
    pub async fn declare_exchange(&self) -> Result<()> {
        if self.exchange.is_empty() {
            return Ok(());
        }
        let options = ExchangeDeclareOptions {
            durable: true,
            ..ExchangeDeclareOptions::default()
        };
        let Publishing { channel, .. } = self.live_channel().await?;
        channel
            .exchange_declare(
                self.exchange.as_str().into(),
                ExchangeKind::Topic,
                options,
                FieldTable::default(),
            )
            .await
            .map_err(|e| Error::exchange(self.exchange.clone(), crate::describe(&e)))
    }

    /// Publishes `message` with its id as `message_id`, its type as `type`,
    /// JSON content and persistent delivery, to this publisher's exchange
    /// with `routing_key`. With `message_bus.wire = "masstransit"`, as
    /// MassTransit publishes it: in its envelope (a new conversation), to
    /// the type's own exchange, for whoever subscribes (`routing_key` is
    /// not used).
    pub async fn publish<E: IntegrationEvent>(&self, routing_key: &str, message: &Message<E>) -> Result<()> {
        let json = message.to_json()?;
        match self.wire {
            Wire::Inbox => {
                let properties = message_properties(message.id, E::TYPE);
                self.publish_raw(routing_key, properties, &json).await
            }
            Wire::Masstransit => {
                let envelope = crate::masstransit::envelope_now(message.id, E::TYPE, &json, None)?;
                let properties = crate::masstransit::properties(message.id);
                self.publish_to_subscribers(E::TYPE, &[], properties, &envelope)
                    .await
            }
        }
    }

    /// Publishes `body` with `properties` as they are (with the
    /// `opentelemetry` feature, a message without a `traceparent` gets the
    /// publish span's). Fails unless the broker confirms it, within the
    /// confirm timeout, and routed it to at least one queue.
    pub async fn publish_raw(
        &self,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> Result<()> {
        self.publish_to(&self.exchange, routing_key, properties, body)
            .await
    }

    /// [`publish_raw`](Self::publish_raw) to `exchange` rather than this
    /// publisher's own, in a span named `publish {routing_key}` after
    /// OpenTelemetry's messaging conventions. A message that carries a
    /// trace context (one staged through the outbox, or moved to a retry
    /// tier) has its publish span in that trace.
    pub async fn publish_to(
        &self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
    ) -> Result<()> {
        self.traced(exchange, routing_key, properties, body, true).await
    }

    /// Publishes to the fanout exchange of a type, `exchange` (declared
    /// first, once, with the exchanges of the types it `implements`),
    /// confirmed, without `mandatory`: a message no queue is bound for is
    /// dropped by the broker, as MassTransit's publishes are. An event's
    /// subscribers are who binds a queue to its exchange, and there may be
    /// none yet.
    pub async fn publish_to_subscribers(
        &self,
        exchange: &str,
        implements: &[&str],
        properties: BasicProperties,
        body: &[u8],
    ) -> Result<()> {
        self.declare_type_exchange(exchange, implements).await?;
        self.traced(exchange, "", properties, body, false).await
    }

    /// A confirmed publish in its span (see [`publish_to`](Self::publish_to)).
    async fn traced(
        &self,
        exchange: &str,
        routing_key: &str,
        mut properties: BasicProperties,
        body: &[u8],
        mandatory: bool,
    ) -> Result<()> {
        let carried = properties.headers().as_ref().and_then(TraceContext::from_headers);
        let span = publish_span(exchange, routing_key, &properties, carried.as_ref());
        if carried.is_none()
            && let Some(trace) = span.in_scope(|| TraceContext::current(None))
        {
            let mut headers = properties.headers().clone().unwrap_or_default();
            trace.insert_into(&mut headers);
            properties = properties.with_headers(headers);
        }
        self.confirmed(exchange, routing_key, properties, body, mandatory)
            .instrument(span)
            .await
    }

    async fn confirmed(
        &self,
        exchange: &str,
        routing_key: &str,
        properties: BasicProperties,
        body: &[u8],
        mandatory: bool,
    ) -> Result<()> {
        let id = properties.message_id().as_ref().map(|id| id.as_str().to_owned());
        let message_id = id.clone().unwrap_or_else(|| "none".to_owned());
        let not_confirmed =
            |reason: String| Error::not_confirmed(message_id.clone(), routing_key.to_owned(), reason);
        let options = BasicPublishOptions {
            // With it, an unroutable message comes back instead of vanishing.
            mandatory,
            ..BasicPublishOptions::default()
        };
        let Publishing {
            channel,
            confirms,
            connection,
        } = self.live_channel().await?;
        if !unblocked_within(&connection, self.confirm_timeout).await {
            // Sent now, it would wait in the client past its confirm
            // timeout, and go out with every copy a caller tried again.
            return Err(Error::blocked(message_id, routing_key.to_owned()));
        }
        // Past a frame, the broker would close the whole connection,
        // failing every publish and ack in flight on it.
        let frame_max = connection.configuration().frame_max();
        crate::limits::check_properties(&properties, frame_max).map_err(|reason| {
            Error::unpublishable(
                message_id.clone(),
                crate::fault::truncate(routing_key, 64).into_owned(),
                reason,
            )
        })?;
        let confirmed = async {
            let confirm = channel
                .basic_publish(exchange.into(), routing_key.into(), options, body, properties)
                .await?;
            confirms.wait(id, confirm).await
        };
        let mut confirmed = std::pin::pin!(confirmed);
        let confirmed = loop {
            match tokio::time::timeout(self.confirm_timeout, &mut confirmed).await {
                Ok(confirmed) => break confirmed?,
                // Blocked after it was written: it waits in the client (or
                // the broker) and goes out when the alarm lifts. Given up
                // now, it would be sent again beside itself.
                Err(_) if connection.status().blocked() => {
                    tracing::debug!(%message_id, "the broker blocked the connection; waiting for the confirm");
                }
                Err(_) => {
                    return Err(Error::no_confirm(
                        message_id,
                        routing_key.to_owned(),
                        self.confirm_timeout,
                    ));
                }
            }
        };
        match confirmed {
            Confirmed::Acked => Ok(()),
            Confirmed::Nacked => Err(not_confirmed("the broker nacked it".into())),
            Confirmed::Returned(reply) => Err(not_confirmed(format!("unroutable: {reply}"))),
        }
    }

    /// The channel to publish on: the current one; a fresh one if the
    /// broker closed it (a channel error); on a fresh connection if this
    /// publisher owns its connection and it is lost.
    async fn live_channel(&self) -> Result<Publishing> {
        let mut link = self.link.lock().await;
        if let Some(redial) = &self.redial
            && link.given_up(redial.settings.message_bus.connect_timeout)
        {
            tracing::warn!(connection = %redial.name, "the publishing connection is lost; connecting again");
            let connection = connect(&redial.settings, &redial.name).await?;
            let (channel, confirms) = confirming_channel(&connection).await?;
            let old = std::mem::replace(
                &mut *link,
                PublishLink {
                    connection,
                    channel,
                    confirms,
                    down_since: None,
                },
            );
            tokio::spawn(async move {
                let _ = old.connection.close(320, "replaced".into()).await;
            });
            self.forget_declared();
        }
        let status = link.channel.status();
        if !status.connected() && !status.reconnecting() && link.connection.status().connected() {
            tracing::info!(exchange = %self.exchange, "the publishing channel was closed by the broker; opening another");
            (link.channel, link.confirms) = confirming_channel(&link.connection).await?;
            self.forget_declared();
        }
        Ok(Publishing {
            channel: link.channel.clone(),
            confirms: link.confirms.clone(),
            connection: Arc::clone(&link.connection),
        })
    }

    /// Forgets the type exchanges declared so far, when the channel or
    /// connection is replaced: the broker closes a channel that publishes
    /// to an exchange someone deleted, and the next publish declares it
    /// again (declaring is idempotent) rather than fail the same way
    /// until a restart.
    fn forget_declared(&self) {
        if let Ok(mut declared) = self.declared.lock() {
            declared.clear();
        }
    }

    /// A new channel on this publisher's connection, for declaring the
    /// topology and the like; close it when done.
    pub async fn open_channel(&self) -> Result<Channel> {
        let link = self.link.lock().await;
        Ok(link.connection.create_channel().await?)
    }

    /// Closes the channel, and the connection if this publisher owns it.
    pub async fn close(&self) -> Result<()> {
        let link = self.link.lock().await;
        if self.redial.is_some() {
            link.connection.close(200, "done".into()).await?;
        } else if link.channel.status().connected() {
            link.channel.close(200, "done".into()).await?;
        }
        Ok(())
    }
}

impl PublishLink {
    /// Whether the connection is lost: closed or failed, or still opening
    /// after `patience`.
    fn given_up(&mut self, patience: Duration) -> bool {
        let status = self.connection.status();
        if status.connected() {
            self.down_since = None;
            return false;
        }
        if !status.reconnecting() && !status.connecting() {
            return true;
        }
        self.down_since
            .get_or_insert_with(std::time::Instant::now)
            .elapsed()
            > patience
    }
}

async fn confirming_channel(connection: &Connection) -> Result<(Channel, Confirms)> {
    let channel = connection.create_channel().await?;
    channel.confirm_select(ConfirmSelectOptions::default()).await?;
    Ok((channel, Confirms::start()))
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
        self.queue_on(Wire::Inbox, queue)
    }

    /// The queue's name under `wire`'s names (`Q_error`, `Q_skipped` for
    /// MassTransit's).
    pub fn queue_on(self, wire: Wire, queue: &str) -> String {
        match self {
            SetAside::Error => wire.error_queue(queue),
            SetAside::Skipped => wire.skipped_queue(queue),
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
    connection: &Arc<Connection>,
    queue: &str,
    from: SetAside,
    only: Option<&HashSet<Uuid>>,
) -> Result<ReplayReport> {
    replay_on(Wire::Inbox, connection, queue, from, only).await
}

/// [`replay`] under `wire`'s names; with MassTransit's, from `Q_error` or
/// `Q_skipped`, and MassTransit's fault headers are removed too.
pub async fn replay_on(
    wire: Wire,
    connection: &Arc<Connection>,
    queue: &str,
    from: SetAside,
    only: Option<&HashSet<Uuid>>,
) -> Result<ReplayReport> {
    let source = from.queue_on(wire, queue);
    let mut removed = fault::headers::ALL.to_vec();
    if wire == Wire::Masstransit {
        removed.extend(crate::masstransit::headers::SET_ASIDE);
    }
    let channel = connection.create_channel().await?;
    let passive = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let waiting = channel
        .queue_declare(source.as_str().into(), passive, FieldTable::default())
        .await
        .map_err(|e| Error::topology(source.clone(), e.to_string()))?
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
            let properties = without_headers(delivery.properties.clone(), &removed);
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
    publisher.close().await?;
    Ok(report)
}

/// `properties` less the headers named in `removed` and those the broker
/// owns ([`fault::headers::BROKER_OWNED`]).
fn without_headers(properties: BasicProperties, removed: &[&str]) -> BasicProperties {
    let Some(headers) = properties.headers() else {
        return properties;
    };
    let mut removed = removed.to_vec();
    removed.extend(fault::headers::BROKER_OWNED);
    let kept = fault::without(headers, &removed);
    properties.with_headers(kept)
}

/// The properties of a message the runtime publishes: its id as
/// `message_id`, its type as `type`, JSON content and persistent delivery.
pub(crate) fn message_properties(message_id: Uuid, message_type: &str) -> BasicProperties {
    BasicProperties::default()
        .with_message_id(message_id.to_string().into())
        .with_type(message_type.into())
        .with_content_type(JSON.into())
        .with_delivery_mode(PERSISTENT)
}

/// The span of one publish: `publish {routing_key}`, a producer, with
/// OpenTelemetry's messaging attributes; in the trace `carried`, if the
/// message carries one.
fn publish_span(
    exchange: &str,
    routing_key: &str,
    properties: &BasicProperties,
    carried: Option<&TraceContext>,
) -> tracing::Span {
    let message_id = properties.message_id().as_ref().map_or("", |id| id.as_str());
    // The default exchange routes straight to the queue named by the key.
    let destination = if exchange.is_empty() {
        routing_key
    } else {
        exchange
    };
    let span = tracing::info_span!(
        "publish",
        otel.name = %format_args!("publish {routing_key}"),
        otel.kind = "producer",
        messaging.system = "rabbitmq",
        messaging.operation.type = "send",
        messaging.destination.name = destination,
        messaging.message.id = message_id,
        messaging.rabbitmq.destination.routing_key = routing_key,
        trace_id = tracing::field::Empty,
    );
    if let Some(trace) = carried {
        trace.adopt(&span);
    }
    span
}
