//! [`ConsumerActor`]: one RabbitMQ queue.
//!
//! Owns the queue's channel and its lapin consumer stream. Decodes each
//! delivery into an envelope and sends [`Deliver`] to the
//! [`DedupActor`](crate::DedupActor), up to the queue's prefetch at once;
//! settles the delivery from the [`Outcome`]: ack for completed and
//! duplicates, nack with requeue for abandoned messages, reject without
//! requeue for messages that can never succeed. Receives [`Drain`] at
//! shutdown: stops consuming and waits for the messages in flight.

use std::sync::Arc;

use actix::prelude::*;
use inbox::lapin::message::Delivery;
use inbox::lapin::options::{BasicAckOptions, BasicCancelOptions, BasicNackOptions, BasicRejectOptions};
use inbox::lapin::types::ShortString;
use inbox::lapin::{Channel, Consumer};
use inbox::{DeliveryLabel, Envelope};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::dedup::{Deliver, Outcome};
use crate::stats::{Counter, Stats};

/// Stop consuming and resolve once no message is in flight.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Drain;

/// Consumes one queue.
pub struct ConsumerActor {
    queue: String,
    consumer: Arc<str>,
    channel: Channel,
    tag: ShortString,
    stream: Option<Consumer>,
    dedup: Recipient<Deliver>,
    stats: Arc<Stats>,
    in_flight: usize,
    draining: bool,
    drained: Vec<oneshot::Sender<()>>,
    stream_ended: bool,
}

impl ConsumerActor {
    /// An actor over a started lapin `stream` of `queue` on `channel`;
    /// `consumer` is the consumer id of the dedup key.
    pub fn new(
        queue: String,
        consumer: Arc<str>,
        channel: Channel,
        stream: Consumer,
        dedup: Recipient<Deliver>,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            queue,
            consumer,
            channel,
            tag: stream.tag(),
            stream: Some(stream),
            dedup,
            stats,
            in_flight: 0,
            draining: false,
            drained: Vec::new(),
            stream_ended: false,
        }
    }

    fn message_done(&mut self, ctx: &mut Context<Self>) {
        self.in_flight -= 1;
        if self.in_flight == 0 {
            for waiter in self.drained.drain(..) {
                let _ = waiter.send(());
            }
            if self.stream_ended {
                ctx.stop();
            }
        }
    }
}

impl Actor for ConsumerActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        if let Some(stream) = self.stream.take() {
            ctx.add_stream(stream);
        }
        tracing::info!(queue = %self.queue, consumer = %self.consumer, "consuming");
    }
}

impl StreamHandler<inbox::lapin::Result<Delivery>> for ConsumerActor {
    fn handle(&mut self, item: inbox::lapin::Result<Delivery>, ctx: &mut Context<Self>) {
        let delivery = match item {
            Ok(delivery) => delivery,
            Err(e) => {
                tracing::warn!(queue = %self.queue, error = %e, "consumer stream error");
                return;
            }
        };
        if self.draining {
            // Left unacked: the broker requeues it when the channel closes.
            return;
        }
        self.in_flight += 1;
        let work = settle(
            delivery,
            self.queue.clone(),
            Arc::clone(&self.consumer),
            self.dedup.clone(),
            Arc::clone(&self.stats),
        );
        ctx.spawn(
            work.into_actor(self)
                .map(|(), actor, ctx| actor.message_done(ctx)),
        );
    }

    fn finished(&mut self, ctx: &mut Context<Self>) {
        if !self.draining {
            tracing::error!(queue = %self.queue, "the broker ended the consumer; this queue is no longer consumed");
        }
        // Stopping now would cancel the messages in flight before their
        // acks: stop once the last one is settled.
        self.stream_ended = true;
        if self.in_flight == 0 {
            ctx.stop();
        }
    }
}

impl actix::Handler<Drain> for ConsumerActor {
    type Result = ResponseActFuture<Self, ()>;

    fn handle(&mut self, _: Drain, _ctx: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        let (done, drained) = oneshot::channel();
        if self.in_flight == 0 {
            let _ = done.send(());
        } else {
            self.drained.push(done);
        }
        let channel = self.channel.clone();
        let tag = self.tag.clone();
        let queue = self.queue.clone();
        let in_flight = self.in_flight;
        Box::pin(
            async move {
                if let Err(e) = channel.basic_cancel(tag, BasicCancelOptions::default()).await {
                    tracing::warn!(%queue, error = %e, "cancelling the consumer failed");
                }
                tracing::info!(%queue, in_flight, "stopped consuming; waiting for messages in flight");
                let _ = drained.await;
            }
            .into_actor(self),
        )
    }
}

/// Runs one delivery through the inbox and settles it with the broker.
async fn settle(
    mut delivery: Delivery,
    queue: String,
    consumer: Arc<str>,
    dedup: Recipient<Deliver>,
    stats: Arc<Stats>,
) {
    let body = std::mem::take(&mut delivery.data);
    let envelope = match Envelope::decode(&delivery.properties, body, delivery.redelivered, &consumer) {
        Ok(envelope) => envelope,
        Err(e) => {
            tracing::warn!(
                %queue,
                delivery_tag = delivery.delivery_tag,
                delivery = %DeliveryLabel(&delivery.properties),
                reason = %e,
                "malformed delivery set aside (rejected without requeue)"
            );
            stats.add(Counter::Rejected);
            let result = delivery.acker.reject(BasicRejectOptions { requeue: false }).await;
            check_settled(result, "reject", &stats);
            return;
        }
    };
    let span = envelope.span.clone();
    async move {
        let outcome = dedup
            .send(Deliver { consumer, envelope })
            .await
            .unwrap_or_else(|e| Outcome::Abandoned(crate::dedup::Abandoned {
                stage: "dedup actor".into(),
                reason: e.to_string(),
            }));
        let acker = &delivery.acker;
        match outcome {
            Outcome::Completed | Outcome::Duplicate => {
                tracing::debug!(?outcome, "acking");
                check_settled(acker.ack(BasicAckOptions::default()).await, "ack", &stats);
            }
            Outcome::Abandoned(abandoned) => {
                tracing::warn!(stage = %abandoned.stage, reason = %abandoned.reason, "message abandoned; requeued for redelivery");
                let options = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                check_settled(acker.nack(options).await, "nack", &stats);
            }
            Outcome::Rejected(reason) => {
                tracing::warn!(%reason, "message set aside (rejected without requeue)");
                check_settled(acker.reject(BasicRejectOptions { requeue: false }).await, "reject", &stats);
            }
            Outcome::NoHandler => {
                tracing::warn!("no handler registered for this type; message set aside (rejected without requeue)");
                check_settled(acker.reject(BasicRejectOptions { requeue: false }).await, "reject", &stats);
            }
        }
    }
    .instrument(span)
    .await
}

/// lapin answers `Ok(false)` for an ack on a channel that has been recovered
/// since the delivery: the broker never got it and will redeliver.
fn check_settled(result: inbox::lapin::Result<bool>, what: &str, stats: &Stats) {
    match result {
        Ok(true) => {}
        Ok(false) => {
            stats.add(Counter::UnconfirmedAcks);
            tracing::warn!(
                "{what} not delivered: the channel was recovered since; the broker will redeliver and the inbox will skip what was committed"
            );
        }
        Err(e) => {
            stats.add(Counter::UnconfirmedAcks);
            tracing::warn!(error = %e, "{what} failed; the broker will redeliver and the inbox will skip what was committed");
        }
    }
}
