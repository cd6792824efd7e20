//! [`AmqpPublisher`]: confirmed publishing, bounded by the broker's limits
//! and its alarms, on a connection it connects again by itself.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use lapin::options::{BasicPublishOptions, ConfirmSelectOptions, ExchangeDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Channel, Connection, ExchangeKind};
use tracing::Instrument;

use crate::confirms::{Confirmed, Confirms};
use crate::error::{Error, Result};
use crate::event::{IntegrationEvent, Message};
use crate::settings::{Settings, Wire};
use crate::trace::TraceContext;

use super::topology::{bind_exchange, fanout_exchange};
use super::{connect, message_properties};

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
/// (the frame size it negotiated, the header sizes it allows): else it fails alone, as
/// an error of kind [`Unpublishable`](crate::ErrorKind::Unpublishable), rather than close the connection for every
/// other publish on it. Nothing is sent while the broker blocks the
/// connection (a resource alarm): a publish waits for the alarm to lift
/// within its confirm timeout, then fails as an error of kind [`Blocked`](crate::ErrorKind::Blocked); one
/// the broker blocked after it was written waits for its confirm until the
/// alarm lifts, and its confirm timeout more. A returned (unroutable)
/// message is matched to its publish by `message_id`.
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
        tokio::time::sleep(ALARM_SAMPLE).await;
    }
    true
}

/// How often a publish that waits looks whether the broker blocks its
/// connection: the client's status is all there is to look at (the
/// connection's events go to one listener, the log's).
const ALARM_SAMPLE: Duration = Duration::from_millis(50);

/// What `confirmed` gives, unless the broker stays silent for `timeout`
/// while `blocked` says no alarm holds the connection.
///
/// The timeout counts from the write, or from the last time the connection
/// was seen blocked: a message blocked after it was written waits in the
/// client (or the broker) and goes out when the alarm lifts, behind every
/// other publish held with it. Given up while blocked, or before its turn
/// came after the alarm lifted, it would be sent again beside itself.
async fn confirmed_unless_silent<T>(
    confirmed: impl Future<Output = T>,
    blocked: impl Fn() -> bool,
    timeout: Duration,
) -> Option<T> {
    let mut confirmed = std::pin::pin!(confirmed);
    let mut silent_since = tokio::time::Instant::now();
    let mut seen_blocked = false;
    loop {
        match tokio::time::timeout(ALARM_SAMPLE.min(timeout), &mut confirmed).await {
            Ok(confirmed) => return Some(confirmed),
            Err(_) if blocked() => {
                if !seen_blocked {
                    tracing::debug!("the broker blocked the connection; waiting for the confirm");
                    seen_blocked = true;
                }
                silent_since = tokio::time::Instant::now();
            }
            Err(_) if silent_since.elapsed() < timeout => {}
            Err(_) => return None,
        }
    }
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
    /// receiving inbox skips). A publish the broker blocked after it was
    /// written has `timeout` after the alarm lifts.
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

    /// The largest body it sends as the outbox's sink.
    pub(crate) fn max_message_size(&self) -> usize {
        self.max_message_size
    }

    /// The wire it publishes in: how it sends messages and outbox rows.
    pub fn wire(&self) -> Wire {
        self.wire
    }

    /// Whether the type exchange `name` is declared on the channel in use
    /// (see [`declare_type_exchange`](Self::declare_type_exchange)).
    pub(crate) fn knows_type_exchange(&self, name: &str) -> bool {
        self.declared.lock().map(|d| d.contains(name)).unwrap_or(false)
    }

    /// Declares the durable fanout exchange of a published type, `name`,
    /// unless this publisher already did, bound to the exchanges of the
    /// types it `implements`: MassTransit's publish topology, declared
    /// before a type's first publish (RMQ/RabbitMqTransport/Topology/
    /// RabbitMqMessagePublishTopology.cs `Apply` at v8.5.8), through which
    /// a .NET consumer of a base type or interface gets it, and a
    /// `Fault<T>` reaches `MassTransit:Fault`'s subscribers too.
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
        // Bounded like a confirm: a broker whose packets vanish answers no
        // declare either, and an outbox round or a move waits on this.
        let declaring = async {
            fanout_exchange(&channel, name).await?;
            for implemented in implements {
                fanout_exchange(&channel, implemented).await?;
                bind_exchange(&channel, name, implemented).await?;
            }
            Ok::<(), Error>(())
        };
        tokio::time::timeout(self.confirm_timeout, declaring)
            .await
            .map_err(|_| {
                Error::unreachable(
                    "broker",
                    format!("exchange `{}`", crate::fault::truncate(name, 64)),
                    self.confirm_timeout,
                    "message_bus.confirm_timeout",
                    "no answer to declaring it".into(),
                )
            })??;
        if let Ok(mut declared) = self.declared.lock() {
            declared.insert(name.to_owned());
        }
        Ok(())
    }

    /// Sends to the exchange a MassTransit address names (declared first
    /// as MassTransit declares it before sending: its type, durable or
    /// temporary), confirmed, without `mandatory`: as MassTransit sends a
    /// fault to the `faultAddress` of the message that faulted.
    pub(crate) async fn send_to_address(
        &self,
        address: &crate::masstransit::SendAddress,
        properties: BasicProperties,
        body: &[u8],
    ) -> Result<()> {
        let exchange = address.exchange.as_str();
        crate::limits::check_name("exchange", exchange)
            .map_err(|reason| Error::exchange(crate::fault::truncate(exchange, 64).into_owned(), reason))?;
        let Publishing { channel, .. } = self.live_channel().await?;
        let options = ExchangeDeclareOptions {
            durable: address.durable,
            auto_delete: address.auto_delete,
            ..ExchangeDeclareOptions::default()
        };
        let kind = match address.kind.as_str() {
            "direct" => ExchangeKind::Direct,
            "topic" => ExchangeKind::Topic,
            "headers" => ExchangeKind::Headers,
            _ => ExchangeKind::Fanout,
        };
        let declaring = channel.exchange_declare(exchange.into(), kind, options, FieldTable::default());
        tokio::time::timeout(self.confirm_timeout, declaring)
            .await
            .map_err(|_| {
                Error::unreachable(
                    "broker",
                    format!("exchange `{}`", crate::fault::truncate(exchange, 64)),
                    self.confirm_timeout,
                    "message_bus.confirm_timeout",
                    "no answer to declaring it".into(),
                )
            })?
            .map_err(|e| Error::exchange(exchange.to_owned(), crate::error::describe(&e)))?;
        self.traced(exchange, "", properties, body, false).await
    }

    /// Why a message with `properties` would not fit one frame of this
    /// publisher's connection (see `limits::check_properties`),
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
            .map_err(|e| Error::exchange(self.exchange.clone(), crate::error::describe(&e)))
    }

    /// Publishes `message` with its id as `message_id`, its type as `type`,
    /// JSON content and persistent delivery, to this publisher's exchange
    /// with `routing_key`. With `message_bus.wire = "masstransit"`, as
    /// MassTransit publishes it: in its envelope (a new conversation), to
    /// the type's own exchange, for whoever subscribes (`routing_key` is
    /// not used).
    pub async fn publish<E: IntegrationEvent>(&self, routing_key: &str, message: &Message<E>) -> Result<()> {
        let json = message.to_json()?;
        let own = message.own_headers()?;
        match self.wire {
            Wire::Inbox => {
                let properties = message_properties(message.id, E::TYPE).with_headers(message.header_table());
                self.publish_raw(routing_key, properties, &json).await
            }
            Wire::Masstransit => {
                let envelope = crate::masstransit::envelope_now(
                    message.id,
                    (E::TYPE, E::IMPLEMENTS),
                    &json,
                    None,
                    own.iter()
                        .map(|(name, value)| (name.clone(), value.as_str().into()))
                        .collect(),
                )?;
                let properties =
                    crate::masstransit::properties(message.id).with_headers(message.header_table());
                self.publish_to_subscribers(E::TYPE, E::IMPLEMENTS, properties, &envelope)
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
        let message_id = properties
            .message_id()
            .as_ref()
            .map_or_else(|| "none".to_owned(), |id| id.as_str().to_owned());
        let refused = |reason: String| Error::refused(message_id.clone(), routing_key.to_owned(), reason);
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
        let confirmed = confirms.publish(&channel, (exchange, routing_key), options, body, properties);
        let Some(confirmed) =
            confirmed_unless_silent(confirmed, || connection.status().blocked(), self.confirm_timeout).await
        else {
            return Err(Error::confirm_timeout(
                message_id,
                routing_key.to_owned(),
                self.confirm_timeout,
            ));
        };
        let confirmed = confirmed.map_err(Error::client)?;
        match confirmed {
            Confirmed::Acked => Ok(()),
            Confirmed::Nacked => Err(refused("the broker nacked it".into())),
            Confirmed::Returned(reply) => Err(refused(format!("unroutable: {reply}"))),
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

    /// This publisher's connection as it is now, for declaring the
    /// topology on channels of one's own.
    pub async fn connection(&self) -> Arc<Connection> {
        Arc::clone(&self.link.lock().await.connection)
    }

    /// Closes the channel, and the connection if this publisher owns it.
    pub async fn close(&self) -> Result<()> {
        let link = self.link.lock().await;
        if self.redial.is_some() {
            link.connection
                .close(200, "done".into())
                .await
                .map_err(Error::client)?;
        } else if link.channel.status().connected() {
            link.channel
                .close(200, "done".into())
                .await
                .map_err(Error::client)?;
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
    let channel = connection.create_channel().await.map_err(Error::client)?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(Error::client)?;
    Ok((channel, Confirms::start()))
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A confirm that arrives at `at`, in paused time.
    async fn confirm_at(at: Duration) -> &'static str {
        tokio::time::sleep(at).await;
        "confirmed"
    }

    /// Blocked from the start until `until`, in paused time.
    fn blocked_until(until: Duration) -> impl Fn() -> bool {
        let start = tokio::time::Instant::now();
        move || start.elapsed() < until
    }

    #[tokio::test(start_paused = true)]
    async fn a_confirm_held_by_an_alarm_has_the_whole_timeout_after_it_lifts() {
        // Blocked until 2.9 s, confirmed at 3.2 s, a timeout of 1 s: the
        // confirm comes 0.3 s after the alarm lifted, well within it. (A
        // timeout counted in whole periods from the write gave up at 3 s.)
        let timeout = Duration::from_secs(1);
        let confirmed = confirmed_unless_silent(
            confirm_at(Duration::from_millis(3200)),
            blocked_until(Duration::from_millis(2900)),
            timeout,
        )
        .await;
        assert_eq!(confirmed, Some("confirmed"));
    }

    #[tokio::test(start_paused = true)]
    async fn a_silent_broker_without_an_alarm_is_given_up_after_the_timeout() {
        let started = tokio::time::Instant::now();
        let confirmed =
            confirmed_unless_silent(std::future::pending::<()>(), || false, Duration::from_secs(1)).await;
        assert_eq!(confirmed, None);
        let waited = started.elapsed();
        assert!(
            waited >= Duration::from_secs(1) && waited <= Duration::from_secs(1) + ALARM_SAMPLE,
            "{waited:?}"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn silence_after_an_alarm_is_given_up_one_timeout_after_it_lifted() {
        let started = tokio::time::Instant::now();
        let confirmed = confirmed_unless_silent(
            std::future::pending::<()>(),
            blocked_until(Duration::from_secs(5)),
            Duration::from_secs(1),
        )
        .await;
        assert_eq!(confirmed, None);
        // The alarm is seen lifted within a sample.
        let lifted_plus_timeout = Duration::from_secs(6);
        let waited = started.elapsed();
        assert!(
            waited + ALARM_SAMPLE >= lifted_plus_timeout && waited <= lifted_plus_timeout + ALARM_SAMPLE,
            "{waited:?}"
        );
    }
}
