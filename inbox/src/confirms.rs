//! Publisher confirms, each read together with its own `basic.return`.
//!
//! A message published `mandatory` that no queue takes comes back as a
//! `basic.return`, sent before its confirm. lapin hands a return to the
//! first confirm it completes after it, and one `multiple` ack completes
//! its confirms in no set order: the return of one message can ride on the
//! confirm of another, so that the unroutable message reads as taken (and
//! an outbox row is deleted, a move acks its original) while a routed one
//! reads as returned. So returns are matched to their message by
//! `message_id` instead.
//!
//! One task per channel publishes and collects its confirms as they
//! complete. The confirm that carries a message's return completes no
//! later than that message's own (the return arrives first, and the next
//! confirm completed takes it), so the task takes every confirm completed
//! so far, files their returns by `message_id`, and only then answers
//! them. That holds only if the carrier is in hand when the message's own
//! confirm is: lapin hands back a publish's confirm future only once its
//! frames are written, and a publisher that had not come back from
//! `basic_publish` yet when the broker answered would leave the carrier,
//! complete, outside the task, and the returned message read as taken
//! (seen: one in 1,000 under load). So the task makes the publishes
//! itself: each is its own from before it is sent.

use std::collections::HashMap;

use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use futures_util::stream::{FuturesUnordered, StreamExt};
use lapin::options::BasicPublishOptions;
use lapin::{BasicProperties, Channel, Confirmation};
use tokio::sync::{mpsc, oneshot};

/// What the broker said of one publish.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Confirmed {
    /// Taken.
    Acked,
    /// Refused (a nack).
    Nacked,
    /// Routed to no queue: the broker's reply text.
    Returned(String),
}

/// The confirms of one channel in confirm mode.
#[derive(Debug, Clone)]
pub(crate) struct Confirms {
    awaited: mpsc::UnboundedSender<Awaited>,
}

struct Awaited {
    /// The message's `message_id`, if it has one.
    message_id: Option<String>,
    /// The publish, then its confirm.
    confirm: BoxFuture<'static, lapin::Result<Confirmation>>,
    answer: oneshot::Sender<lapin::Result<Confirmed>>,
}

impl Confirms {
    /// Starts the task that collects a channel's confirms; it ends once
    /// this value and its clones are dropped and no confirm is left.
    pub(crate) fn start() -> Self {
        let (awaited, incoming) = mpsc::unbounded_channel();
        tokio::spawn(collect(incoming));
        Self { awaited }
    }

    /// Publishes `body` on `channel` (this value's channel, in confirm
    /// mode) from the collecting task, and says what the broker said of it.
    /// Dropped before the answer, the publish may still go out.
    pub(crate) async fn publish(
        &self,
        channel: &Channel,
        (exchange, routing_key): (&str, &str),
        options: BasicPublishOptions,
        body: &[u8],
        properties: BasicProperties,
    ) -> lapin::Result<Confirmed> {
        let message_id = properties.message_id().as_ref().map(|id| id.as_str().to_owned());
        let (channel, exchange, routing_key) = (channel.clone(), exchange.into(), routing_key.into());
        // Owned: the task outlives this call's borrow.
        let body = body.to_vec();
        let confirm = async move {
            channel
                .basic_publish(exchange, routing_key, options, &body, properties)
                .await?
                .await
        }
        .boxed();
        let (answer, answered) = oneshot::channel();
        let awaited = Awaited {
            message_id,
            confirm,
            answer,
        };
        if self.awaited.send(awaited).is_err() {
            return Err(lapin::ErrorKind::FutureCompleted.into());
        }
        answered
            .await
            .unwrap_or_else(|_| Err(lapin::ErrorKind::FutureCompleted.into()))
    }
}

/// A confirm that completed: its message, where to answer, and what came.
type Completed = (
    Option<String>,
    oneshot::Sender<lapin::Result<Confirmed>>,
    lapin::Result<Confirmation>,
);

async fn collect(mut incoming: mpsc::UnboundedReceiver<Awaited>) {
    let mut pending = FuturesUnordered::new();
    let mut open = true;
    // Returns filed by `message_id`, until their own confirm is answered.
    let mut returned: HashMap<String, String> = HashMap::new();
    loop {
        let first: Completed = tokio::select! {
            awaited = incoming.recv(), if open => {
                match awaited {
                    Some(Awaited { message_id, confirm, answer }) => {
                        pending.push(confirm.map(move |result| (message_id, answer, result)));
                    }
                    None => open = false,
                }
                continue;
            }
            Some(completed) = pending.next(), if !pending.is_empty() => completed,
            else => return,
        };
        // Every confirm completed by now: the one carrying a return of
        // this batch's messages is among them or came before.
        let mut completed = vec![first];
        while let Some(Some(next)) = pending.next().now_or_never() {
            completed.push(next);
        }
        let mut read = Vec::with_capacity(completed.len());
        for (message_id, answer, result) in completed {
            let result = result.map(|confirmation| {
                let acked = confirmation.is_ack();
                let carried = confirmation.take_message().map(|message| {
                    let id = message
                        .properties
                        .message_id()
                        .as_ref()
                        .map(|id| id.as_str().to_owned());
                    (id, message.reply_text.as_str().to_owned())
                });
                match carried {
                    // Another message's return: filed for it.
                    Some((Some(id), reply)) if message_id.as_ref() != Some(&id) => {
                        returned.insert(id, reply);
                        (acked, None)
                    }
                    // Its own, or one without an id to match by.
                    Some((_, reply)) => (acked, Some(reply)),
                    None => (acked, None),
                }
            });
            read.push((message_id, answer, result));
        }
        for (message_id, answer, result) in read {
            let filed = message_id.as_ref().and_then(|id| returned.remove(id));
            let answered = result.map(|(acked, own)| match own.or(filed) {
                Some(reply) => Confirmed::Returned(reply),
                None if acked => Confirmed::Acked,
                None => Confirmed::Nacked,
            });
            // A publisher that stopped waiting (its confirm timeout) reads
            // nothing.
            let _ = answer.send(answered);
        }
    }
}
