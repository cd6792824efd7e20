//! Publishing, over the broker or in process.

use std::sync::Arc;

use actix::Recipient;
use inbox::{AmqpPublisher, Envelope, Error, IntegrationEvent, Message, Result};

use crate::dedup::{Deliver, Outcome};

/// Publishes events the way the runtime's provider says.
#[derive(Clone)]
pub enum Publisher {
    /// Through RabbitMQ, confirmed by the broker.
    Amqp(AmqpPublisher),
    /// Straight to the [`DedupActor`](crate::DedupActor): the handlers run
    /// before `publish` returns, through the same inbox and unit of work.
    InProcess {
        /// Where messages go.
        dedup: Recipient<Deliver>,
        /// The consumer id they are processed as: the first configured
        /// queue's, else `in_process`.
        consumer: Arc<str>,
    },
}

impl Publisher {
    /// Publishes `message` with `routing_key` (ignored in process). Returns
    /// once the broker confirmed it, or in process once the handlers
    /// committed (an error if they did not).
    pub async fn publish<E: IntegrationEvent>(&self, routing_key: &str, message: &Message<E>) -> Result<()> {
        match self {
            Publisher::Amqp(publisher) => publisher.publish(routing_key, message).await,
            Publisher::InProcess { dedup, consumer } => {
                let envelope = Envelope::from_message(message, consumer)?;
                let deliver = Deliver {
                    consumer: Arc::clone(consumer),
                    envelope: Arc::new(envelope),
                };
                let outcome = dedup
                    .send(deliver)
                    .await
                    .map_err(|e| Error::Runtime(format!("the dedup actor is gone: {e}")))?;
                let abandoned = |reason: String| Error::Abandoned {
                    message_id: message.id,
                    reason,
                };
                match outcome {
                    Outcome::Completed | Outcome::Duplicate => Ok(()),
                    // An event nobody here listens to is not an error.
                    Outcome::NoHandler => Ok(()),
                    Outcome::Abandoned(a) => Err(abandoned(format!("{}: {}", a.stage, a.reason))),
                    Outcome::Rejected { stage, reason } => Err(abandoned(format!("{stage}: {reason}"))),
                }
            }
        }
    }
}
