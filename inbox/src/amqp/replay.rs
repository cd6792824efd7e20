//! Replay: moving the messages set aside in `Q.error` or `Q.skipped` (or
//! MassTransit's `Q_error`, `Q_skipped`) back to their queue.

use std::collections::HashSet;
use std::sync::Arc;

use lapin::options::{BasicAckOptions, BasicGetOptions, QueueDeclareOptions};
use lapin::types::FieldTable;
use lapin::{BasicProperties, Connection};
use uuid::Uuid;

use crate::error::{Error, Result};
use crate::fault;
use crate::settings::Wire;

use super::publisher::AmqpPublisher;

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
/// properties (but a producer's TTL and `user_id`, see
/// `fault::copy_properties`) and `message_id`, so one that was processed after all is
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
        removed.extend(crate::masstransit::headers::HOST);
    }
    let channel = connection.create_channel().await.map_err(Error::client)?;
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
            .await
            .map_err(Error::client)?
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
            let properties = without_headers(&delivery.properties, &removed);
            publisher.publish_raw(queue, properties, &delivery.data).await?;
            report.replayed += 1;
        } else {
            let properties = without_headers(&delivery.properties, &[]);
            publisher.publish_raw(&source, properties, &delivery.data).await?;
            report.left += 1;
        }
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(Error::client)?;
    }
    channel
        .close(200, "replay done".into())
        .await
        .map_err(Error::client)?;
    publisher.close().await?;
    Ok(report)
}

/// `properties` less the headers named in `removed` and those the broker
/// owns ([`fault::headers::BROKER_OWNED`]), and less the producer's TTL and
/// `user_id` ([`fault::copy_properties`]): the broker keeps both when it
/// dead-letters, and the replay publishes as itself.
fn without_headers(properties: &BasicProperties, removed: &[&str]) -> BasicProperties {
    let mut removed = removed.to_vec();
    removed.extend(fault::headers::BROKER_OWNED);
    let kept = match properties.headers() {
        Some(headers) => fault::without(headers, &removed),
        None => FieldTable::default(),
    };
    fault::copy_properties(properties, kept)
}
