//! The queues and exchanges kept for a consumed queue, as this library
//! declares them and as MassTransit does (`message_bus.wire`).

use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::protocol::{AMQPErrorKind, AMQPSoftError};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Connection, ExchangeKind};

use crate::error::{Error, Result};
use crate::settings::{FailureSettings, MAX_DELIVERY_LIMIT, QueueKind, QueueSettings, Wire};

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
    declare_queues(channel, queue, failure, Wire::Inbox, &[]).await
}

/// What guards a consumed queue against a message that crashes its
/// consumer at every delivery, as [`declare_wire_topology`] found it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Declared {
    /// Whether the broker dead-letters such a message to the error queue
    /// past `queues[].delivery_limit` deliveries: a quorum queue with the
    /// runtime's arguments. Otherwise (a classic queue, or one in
    /// MassTransit's form) the runtime counts the deliveries the broker
    /// marks redelivered and sets the message aside itself.
    pub broker_limits_deliveries: bool,
    /// On MassTransit's wire, `Q` in the form a MassTransit endpoint
    /// declares it (declared so now, or found so, and used as it is): which
    /// form. `None` for the runtime's own arguments (this library's wire, or
    /// a `Q` an earlier version declared on MassTransit's).
    pub endpoint: Option<EndpointForm>,
}

/// The delivery limit RabbitMQ 4.0 to 4.2 give a quorum queue declared
/// without `x-delivery-limit`: past it, a message is dead-lettered, or,
/// with no dead-letter exchange (as MassTransit declares its queues),
/// dropped. RabbitMQ 3.x has no default; a policy may set a lower one,
/// which AMQP gives no way to read.
pub(crate) const RABBITMQ_4_QUORUM_DELIVERY_LIMIT: u32 = 20;

impl Declared {
    /// The delivery number on which the runtime sets a message aside
    /// itself, when the broker does not ([`broker_limits_deliveries`]
    /// false): `configured` (`queues[].delivery_limit`), but never past the
    /// limit the broker may apply to the queue without dead-lettering, so
    /// that the runtime sets a crash-looping message aside before the
    /// broker drops it.
    ///
    /// [`broker_limits_deliveries`]: Self::broker_limits_deliveries
    pub fn delivery_limit(&self, configured: u32) -> u32 {
        match self.endpoint.and_then(EndpointForm::broker_delivery_limit) {
            Some(broker) => configured.min(broker),
            None => configured,
        }
    }
}

/// `Q` as a MassTransit 8.5 receive endpoint declares it (AMQP has no way
/// to read a queue's arguments: the runtime tells an existing queue's form
/// by declaring it as MassTransit would).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EndpointForm {
    /// Classic, no arguments: MassTransit's default receive endpoint
    /// (RMQ/RabbitMqTransport/Configuration/RabbitMqReceiveEndpointBuilder.cs,
    /// RabbitMqQueueConfigurator.cs: an empty argument table).
    Classic,
    /// `x-queue-type: quorum` alone: MassTransit's `SetQuorumQueue()`
    /// (RabbitMqQueueConfigurator.cs `SetQuorumQueue`).
    Quorum,
    /// An existing queue with some other arguments, unknown to the runtime.
    Other,
}

impl EndpointForm {
    /// The form MassTransit declares a queue of `kind` in.
    fn of(kind: QueueKind) -> Self {
        match kind {
            QueueKind::Classic => Self::Classic,
            QueueKind::Quorum => Self::Quorum,
        }
    }

    /// The queue arguments MassTransit declares this form with; `None`
    /// when unknown.
    fn arguments(self) -> Option<FieldTable> {
        match self {
            Self::Classic => Some(FieldTable::default()),
            Self::Quorum => Some(quorum_type()),
            Self::Other => None,
        }
    }

    /// The delivery limit the broker may apply to such a queue without
    /// dead-lettering: RabbitMQ 4's default for a quorum queue (which an
    /// unknown queue may be); none for a classic queue, on any version.
    fn broker_delivery_limit(self) -> Option<u32> {
        match self {
            Self::Classic => None,
            Self::Quorum | Self::Other => Some(RABBITMQ_4_QUORUM_DELIVERY_LIMIT),
        }
    }

    /// What the queue's form leaves unguarded, for the start's log.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Classic => {
                "a classic queue without arguments (as MassTransit declares one): the broker neither limits \
                 a message's deliveries nor dead-letters it"
            }
            Self::Quorum => {
                "a quorum queue without a delivery limit or dead-lettering (as MassTransit's SetQuorumQueue \
                 declares one): RabbitMQ 3.x redelivers a message without end, and RabbitMQ 4.x drops it \
                 after 20 deliveries"
            }
            Self::Other => {
                "a queue with arguments the runtime does not know: whether the broker limits a message's \
                 deliveries is unknown (a quorum queue on RabbitMQ 4.x without its own limit drops a \
                 message after 20 deliveries)"
            }
        }
    }
}

/// Declares the topology of `queue` for `wire` over `connection`, and says
/// what guards the queue.
///
/// On this library's wire, as [`declare_topology`] does.
///
/// On MassTransit's, what a MassTransit 8.5 receive endpoint with the same
/// settings declares, so that a MassTransit consumer can start on the
/// queue beside the service, or after it (a rollback): `Q` classic and
/// durable without arguments (quorum, as `SetQuorumQueue()` declares it,
/// only when `queues[].kind` asks for it), `Q_error` and `Q_skipped` with a
/// copy of `Q`'s arguments, and their exchanges and bindings. A `Q`, `Q_error`
/// or `Q_skipped` that exists already (a MassTransit consumer declared it,
/// as a team moving one consumer to Rust finds it) is used as it is, never
/// declared again with other arguments: the broker would refuse
/// (`PRECONDITION_FAILED`). The retry tiers are the runtime's own.
pub async fn declare_wire_topology(
    connection: &Connection,
    queue: &QueueSettings,
    failure: &FailureSettings,
    wire: Wire,
    message_types: &[&str],
) -> Result<Declared> {
    let channel = connection.create_channel().await.map_err(Error::client)?;
    let declared = match wire {
        Wire::Inbox => {
            declare_queues(&channel, queue, failure, wire, message_types).await?;
            Declared {
                broker_limits_deliveries: queue.kind_on(wire) == QueueKind::Quorum,
                endpoint: None,
            }
        }
        Wire::Masstransit => {
            let endpoint = declare_endpoint(connection, queue).await?;
            let kind = match endpoint {
                Some(EndpointForm::Classic) => QueueKind::Classic,
                Some(EndpointForm::Quorum) => QueueKind::Quorum,
                Some(EndpointForm::Other) => queue.kind_on(wire),
                None => legacy_kind(queue),
            };
            declare_tiers_as_found(connection, queue, failure, kind).await?;
            for set_aside in [wire.error_queue(&queue.name), wire.skipped_queue(&queue.name)] {
                declare_set_aside(connection, queue, &set_aside, endpoint).await?;
            }
            declare_masstransit_exchanges(&channel, queue, wire, message_types).await?;
            Declared {
                broker_limits_deliveries: endpoint.is_none() && kind == QueueKind::Quorum,
                endpoint,
            }
        }
    };
    let _ = channel.close(200, "declared".into()).await;
    Ok(declared)
}

/// On MassTransit's wire, `Q` declared as a MassTransit endpoint declares
/// it, or, when it exists, found: its form, or `None` for the runtime's own
/// arguments (an earlier version declared it so). Each try is a declare on
/// a channel of its own, since the broker closes the channel of a declare
/// it refuses.
async fn declare_endpoint(connection: &Connection, queue: &QueueSettings) -> Result<Option<EndpointForm>> {
    if !exists(connection, &queue.name).await? {
        let form = EndpointForm::of(queue.kind_on(Wire::Masstransit));
        let arguments = form.arguments().unwrap_or_default();
        if equivalent(connection, &queue.name, arguments).await? {
            return Ok(Some(form));
        }
        // Declared meanwhile by another client, with other arguments:
        // told apart below like any that existed.
    }
    // The quorum form first: RabbitMQ 4 takes a declare without
    // `x-queue-type` for a quorum queue, which would pass it for classic.
    if equivalent(connection, &queue.name, quorum_type()).await? {
        return Ok(Some(EndpointForm::Quorum));
    }
    let legacy = QueueSettings {
        kind: Some(legacy_kind(queue)),
        ..queue.clone()
    };
    if equivalent(
        connection,
        &queue.name,
        main_arguments(&legacy, Wire::Masstransit),
    )
    .await?
    {
        return Ok(None);
    }
    if equivalent(connection, &queue.name, FieldTable::default()).await? {
        return Ok(Some(EndpointForm::Classic));
    }
    Ok(Some(EndpointForm::Other))
}

/// The kind earlier versions declared a `Q` of their own in on
/// MassTransit's wire: this library's wire's default, unless set.
fn legacy_kind(queue: &QueueSettings) -> QueueKind {
    queue.kind_on(Wire::Inbox)
}

/// `Q_error` or `Q_skipped` on MassTransit's wire: used as it is when it
/// exists; otherwise declared as MassTransit would for `Q`'s `endpoint`
/// form (a copy of its arguments: RMQ/RabbitMqTransport/Topology/
/// RabbitMqErrorSettings.cs, RabbitMqDeadLetterSettings.cs), or, beside a
/// `Q` of the runtime's own arguments, with the runtime's.
async fn declare_set_aside(
    connection: &Connection,
    queue: &QueueSettings,
    set_aside: &str,
    endpoint: Option<EndpointForm>,
) -> Result<()> {
    if exists(connection, set_aside).await? {
        return Ok(());
    }
    let arguments = match endpoint {
        None => set_aside_arguments(legacy_kind(queue)),
        Some(form) => form.arguments().ok_or_else(|| {
            Error::topology(
                set_aside.to_owned(),
                format!(
                    "it does not exist, and `{}` has arguments the runtime does not know, so it cannot be \
                     declared as MassTransit would: declare it as MassTransit does (a copy of the queue's \
                     arguments) before starting",
                    queue.name
                ),
            )
        })?,
    };
    // Another client may declare it meanwhile, with its own arguments.
    if !equivalent(connection, set_aside, arguments).await? {
        tracing::info!(queue = %set_aside, "exists with another client's arguments; used as it is");
    }
    Ok(())
}

/// Declares `queue` with `arguments` on a channel of its own: `true` if it
/// is declared (or exists with the same ones), `false` if it exists with
/// others.
async fn equivalent(connection: &Connection, queue: &str, arguments: FieldTable) -> Result<bool> {
    let channel = connection.create_channel().await.map_err(Error::client)?;
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    match channel.queue_declare(queue.into(), options, arguments).await {
        Ok(_) => {
            let _ = channel.close(200, "declared".into()).await;
            Ok(true)
        }
        Err(e) if is_soft(&e, AMQPSoftError::PRECONDITIONFAILED) => Ok(false),
        Err(e) => Err(Error::topology(queue.to_owned(), crate::error::describe(&e))),
    }
}

/// Whether `queue` exists (a passive declare on a channel of its own).
async fn exists(connection: &Connection, queue: &str) -> Result<bool> {
    let channel = connection.create_channel().await.map_err(Error::client)?;
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    match channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
    {
        Ok(_) => {
            let _ = channel.close(200, "looked".into()).await;
            Ok(true)
        }
        Err(e) if is_soft(&e, AMQPSoftError::NOTFOUND) => Ok(false),
        Err(e) => Err(Error::topology(queue.to_owned(), crate::error::describe(&e))),
    }
}

/// Whether `error` is the broker closing the channel with `soft`.
fn is_soft(error: &lapin::Error, soft: AMQPSoftError) -> bool {
    matches!(error.kind(), lapin::ErrorKind::ProtocolError(amqp) if amqp.kind() == &AMQPErrorKind::Soft(soft))
}

fn quorum_type() -> FieldTable {
    let mut arguments = FieldTable::default();
    arguments.insert("x-queue-type".into(), text("quorum"));
    arguments
}

/// `Q`'s arguments as the runtime declares it: its kind, dead-lettering to
/// the error queue and, on a quorum queue, the delivery limit.
fn main_arguments(queue: &QueueSettings, wire: Wire) -> FieldTable {
    let kind = queue.kind_on(wire);
    let mut main = base_arguments(kind);
    dead_letter_to(&mut main, kind, &wire.error_queue(&queue.name));
    limit(&mut main, kind, queue.delivery_limit);
    main
}

/// The arguments of the runtime's `Q.error` and `Q.skipped`: never consumed
/// by the runtime, their limit the highest the broker takes, so that
/// inspecting them by hand (get and requeue) cannot spend it.
fn set_aside_arguments(kind: QueueKind) -> FieldTable {
    let mut arguments = base_arguments(kind);
    limit(&mut arguments, kind, MAX_DELIVERY_LIMIT);
    arguments
}

fn base_arguments(kind: QueueKind) -> FieldTable {
    let mut arguments = FieldTable::default();
    let kind = if kind == QueueKind::Quorum {
        "quorum"
    } else {
        "classic"
    };
    arguments.insert("x-queue-type".into(), text(kind));
    arguments
}

/// Dead-lettering to `to`: at-least-once for quorum queues, where
/// at-most-once could drop the message on a broker fault.
fn dead_letter_to(arguments: &mut FieldTable, kind: QueueKind, to: &str) {
    arguments.insert("x-dead-letter-exchange".into(), text(""));
    arguments.insert("x-dead-letter-routing-key".into(), text(to));
    if kind == QueueKind::Quorum {
        arguments.insert("x-dead-letter-strategy".into(), text("at-least-once"));
        arguments.insert("x-overflow".into(), text("reject-publish"));
    }
}

fn limit(arguments: &mut FieldTable, kind: QueueKind, limit: u32) {
    if kind == QueueKind::Quorum {
        arguments.insert("x-delivery-limit".into(), AMQPValue::LongLongInt(limit.into()));
    }
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
async fn declare_queues(
    channel: &Channel,
    queue: &QueueSettings,
    failure: &FailureSettings,
    wire: Wire,
    message_types: &[&str],
) -> Result<()> {
    let kind = queue.kind_on(wire);
    declare(channel, &queue.name, main_arguments(queue, wire)).await?;
    for (i, delay) in failure.delays.iter().enumerate() {
        declare(
            channel,
            &wire.retry_queue(&queue.name, i + 1),
            tier_arguments(queue, *delay, kind),
        )
        .await?;
    }
    for set_aside in [wire.error_queue(&queue.name), wire.skipped_queue(&queue.name)] {
        declare(channel, &set_aside, set_aside_arguments(kind)).await?;
    }
    declare_masstransit_exchanges(channel, queue, wire, message_types).await
}

/// A retry tier's arguments (`Q.retry.<n>`, `Q_retry_<n>`): the runtime's
/// own queue, of `kind`, expiring its messages back to `Q` after `delay`.
fn tier_arguments(queue: &QueueSettings, delay: std::time::Duration, kind: QueueKind) -> FieldTable {
    let mut arguments = base_arguments(kind);
    // Settings validation keeps every delay within 32 bits of milliseconds.
    arguments.insert(
        "x-message-ttl".into(),
        AMQPValue::LongLongInt(delay.as_millis() as i64),
    );
    dead_letter_to(&mut arguments, kind, &queue.name);
    arguments
}

/// The retry tiers on MassTransit's wire, of `kind` (`Q`'s), or of the
/// other kind where an earlier version declared them so (beside a `Q`
/// MassTransit declared, earlier versions gave the tiers the settings'
/// kind): each the runtime's own, whatever its kind.
async fn declare_tiers_as_found(
    connection: &Connection,
    queue: &QueueSettings,
    failure: &FailureSettings,
    kind: QueueKind,
) -> Result<()> {
    let other = match kind {
        QueueKind::Classic => QueueKind::Quorum,
        QueueKind::Quorum => QueueKind::Classic,
    };
    for (i, delay) in failure.delays.iter().enumerate() {
        let tier = Wire::Masstransit.retry_queue(&queue.name, i + 1);
        if !equivalent(connection, &tier, tier_arguments(queue, *delay, kind)).await?
            && !equivalent(connection, &tier, tier_arguments(queue, *delay, other)).await?
        {
            return Err(Error::topology(
                tier,
                "exists with other arguments than a retry tier of these settings (its delay changed?): delete \
                 it while the service is stopped (a retry tier holds only messages waiting out their delay: \
                 move them to the queue first), and the start declares it anew"
                    .to_owned(),
            ));
        }
    }
    Ok(())
}

/// On MassTransit's wire, the exchanges of its receive endpoint: `Q`'s,
/// `Q_error`'s and `Q_skipped`'s, each bound to its queue, and one per
/// message type bound to `Q`'s. Declared as MassTransit declares them, so
/// declaring them again where MassTransit did is no change.
async fn declare_masstransit_exchanges(
    channel: &Channel,
    queue: &QueueSettings,
    wire: Wire,
    message_types: &[&str],
) -> Result<()> {
    if wire != Wire::Masstransit {
        return Ok(());
    }
    for message_type in message_types {
        crate::limits::check_name("message type", message_type).map_err(|reason| {
            Error::exchange(crate::fault::truncate(message_type, 64).into_owned(), reason)
        })?;
    }
    for set_aside in [wire.error_queue(&queue.name), wire.skipped_queue(&queue.name)] {
        fanout_exchange(channel, &set_aside).await?;
        bind_queue(channel, &set_aside, &set_aside).await?;
    }
    fanout_exchange(channel, &queue.name).await?;
    bind_queue(channel, &queue.name, &queue.name).await?;
    for message_type in message_types {
        fanout_exchange(channel, message_type).await?;
        bind_exchange(channel, message_type, &queue.name).await?;
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
    bind_queue(channel, queue, exchange).await
}

/// Binds exchange `source` to exchange `destination`: what `source` takes,
/// `destination` takes too.
pub(super) async fn bind_exchange(channel: &Channel, source: &str, destination: &str) -> Result<()> {
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
                format!(
                    "binding it to exchange `{destination}`: {}",
                    crate::error::describe(&e)
                ),
            )
        })
}

/// Declares a durable fanout exchange named `name`, as MassTransit does
/// for its endpoints and message types.
pub(super) async fn fanout_exchange(channel: &Channel, name: &str) -> Result<()> {
    let options = ExchangeDeclareOptions {
        durable: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(name.into(), ExchangeKind::Fanout, options, FieldTable::default())
        .await
        .map_err(|e| Error::exchange(name.to_owned(), crate::error::describe(&e)))
}

/// Binds `queue` to the fanout `exchange`.
async fn bind_queue(channel: &Channel, queue: &str, exchange: &str) -> Result<()> {
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
                format!(
                    "binding it to exchange `{exchange}`: {}",
                    crate::error::describe(&e)
                ),
            )
        })
}

/// Declares `queue` durable, of `kind`, with no other argument: a queue the
/// service's own messages go to (the outbox's destinations, say).
/// Idempotent.
pub async fn declare_queue(channel: &Channel, queue: &str, kind: QueueKind) -> Result<()> {
    declare(channel, queue, base_arguments(kind)).await
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
