//! Publishing, over the broker or in process.

use std::sync::Arc;

use actix::Recipient;
use futures_util::future::BoxFuture;

use crate::actors::dedup::Deliver;
use crate::actors::stats::Stats;
use crate::actors::tally::Tally;
use crate::amqp::AmqpPublisher;
use crate::envelope::Envelope;
use crate::outbox::{Outgoing, Sink};
use crate::policy::Outcome;
use crate::{Error, ErrorKind, IntegrationEvent, Message, Result};

/// Publishes events the way the runtime's provider says: through RabbitMQ
/// with publisher confirms, or, in process, straight to the handlers.
/// Cheap to clone.
#[derive(Clone, Debug)]
pub struct Publisher {
    way: Way,
}

#[derive(Clone)]
enum Way {
    /// Through RabbitMQ, confirmed by the broker.
    Amqp(AmqpPublisher),
    /// Straight to the [`DedupActor`](crate::DedupActor): the handlers run
    /// before `publish` returns, through the same inbox and unit of work.
    InProcess {
        dedup: Recipient<Deliver>,
        /// The consumer id messages are processed as: the first configured
        /// queue's, else `in_process`.
        consumer: Arc<str>,
        stats: Arc<Stats>,
    },
}

impl std::fmt::Debug for Way {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Way::Amqp(publisher) => publisher.fmt(f),
            Way::InProcess { consumer, .. } => {
                f.debug_struct("InProcess").field("consumer", consumer).finish()
            }
        }
    }
}

impl Publisher {
    pub(crate) fn amqp(publisher: AmqpPublisher) -> Self {
        Self {
            way: Way::Amqp(publisher),
        }
    }

    pub(crate) fn in_process(dedup: Recipient<Deliver>, consumer: Arc<str>, stats: Arc<Stats>) -> Self {
        Self {
            way: Way::InProcess {
                dedup,
                consumer,
                stats,
            },
        }
    }

    /// Publishes `message` with `routing_key` (ignored in process). Returns
    /// once the broker confirmed it, or in process once the handlers
    /// committed (an error if they did not; an event nobody handles here
    /// is not an error).
    pub async fn publish<E: IntegrationEvent>(&self, routing_key: &str, message: &Message<E>) -> Result<()> {
        let (dedup, consumer, stats) = match &self.way {
            Way::Amqp(publisher) => return publisher.publish(routing_key, message).await,
            Way::InProcess {
                dedup,
                consumer,
                stats,
            } => (dedup, consumer, stats),
        };
        let envelope = Envelope::from_message(message, consumer)?;
        Self::deliver(dedup, consumer, stats, envelope).await
    }

    /// Hands `envelope`'s message to the handlers, in process, counts the
    /// outcome, and says why if they did not take it.
    async fn deliver(
        dedup: &Recipient<Deliver>,
        consumer: &Arc<str>,
        stats: &Stats,
        envelope: Envelope,
    ) -> Result<()> {
        let message_id = envelope.message_id;
        let deliver = Deliver {
            consumer: Arc::clone(consumer),
            envelope: Arc::new(envelope),
        };
        let outcome = dedup
            .send(deliver)
            .await
            .map_err(|e| Error::new(ErrorKind::Stopped, format!("the dedup actor is gone: {e}")))?;
        // The caller is the consumer here: what would be retried or moved
        // is an error for it to handle.
        let (counter, refused) = match outcome {
            Outcome::Completed => (Tally::Completed, None),
            Outcome::Duplicate => (Tally::Duplicates, None),
            Outcome::NoHandler { .. } => (Tally::Skipped, None),
            Outcome::Abandoned(a) => (Tally::Abandoned, Some(format!("{}: {}", a.stage, a.reason))),
            Outcome::Rejected { stage, reason } => (Tally::Rejected, Some(format!("{stage}: {reason}"))),
        };
        stats.add(counter);
        match refused {
            None => Ok(()),
            Some(reason) => Err(Error::abandoned(message_id, reason)),
        }
    }

    /// Closes the broker connection, if it publishes through one.
    pub(crate) async fn close(&self) -> Result<()> {
        match &self.way {
            Way::Amqp(publisher) => publisher.close().await,
            Way::InProcess { .. } => Ok(()),
        }
    }
}

/// What the outbox dispatches goes where this publisher sends: the broker,
/// with confirms, or the handlers in process.
impl Sink for Publisher {
    fn send<'a>(&'a self, outgoing: &'a Outgoing) -> BoxFuture<'a, Result<()>> {
        match &self.way {
            Way::Amqp(publisher) => publisher.send(outgoing),
            Way::InProcess {
                dedup,
                consumer,
                stats,
            } => Box::pin(Self::deliver(
                dedup,
                consumer,
                stats,
                Envelope::from_outgoing(outgoing, consumer),
            )),
        }
    }
}
