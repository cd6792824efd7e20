//! The queues and exchanges kept for a consumed queue, as this library
//! declares them and as MassTransit does (`message_bus.wire`).

use lapin::options::{ExchangeBindOptions, ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, ExchangeKind};

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
            bind_queue(channel, &set_aside, &set_aside).await?;
        }
    }
    if wire == Wire::Masstransit {
        for message_type in message_types {
            crate::limits::check_name("message type", message_type).map_err(|reason| {
                Error::exchange(crate::fault::truncate(message_type, 64).into_owned(), reason)
            })?;
        }
        fanout_exchange(channel, &queue.name).await?;
        bind_queue(channel, &queue.name, &queue.name).await?;
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
                format!("binding it to exchange `{destination}`: {}", crate::describe(&e)),
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
        .map_err(|e| Error::exchange(name.to_owned(), crate::describe(&e)))
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
                format!("binding it to exchange `{exchange}`: {}", crate::describe(&e)),
            )
        })
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
