//! Settling one delivery: the failure policy.
//!
//! A [`Settler`] runs a decoded delivery through the inbox (via the
//! [`DedupActor`]) and settles it with the broker from the outcome: ack;
//! hold while the database is unreachable; immediate retries, then the next
//! retry tier or `Q.error`; `Q.error` at once for malformed input;
//! `Q.skipped` for a type without handlers. Every move publishes the copy
//! with its fault headers and waits for the broker's confirm before acking
//! the original. The [`ConsumerActor`](crate::ConsumerActor) owns one per
//! queue and spawns its work, one delivery (or batch) at a time.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use futures_util::future::join_all;
use inbox::amqp::{error_queue, retry_queue, skipped_queue};
use inbox::fault::{FailureHistory, Fault};
use inbox::lapin::message::Delivery;
use inbox::lapin::options::BasicNackOptions;
use inbox::{AmqpPublisher, DeliveryLabel, Destination, Envelope, FailureSettings};
use tracing::Instrument;

use crate::acks::{AckWindow, Ticket};
use crate::availability::DatabaseGate;
use crate::dedup::{Abandoned, DedupActor, Deliver, DeliverBatch, Outcome};
use crate::stats::{Counter, Stats};

/// How long to wait before handing a message back to the broker when it
/// could not be moved to a retry tier or the error queue (the broker is
/// struggling; an instant requeue would spin).
const MOVE_FAILED_PAUSE: Duration = Duration::from_secs(1);

/// How many times in a row a message may be held for a lost connection
/// while the database answers at once, before the failure counts as an
/// attempt: a message whose handler kills its own connection would
/// otherwise loop hot, holding and retrying forever.
const MAX_HOLDS_IN_VAIN: u32 = 3;

/// What settling a delivery needs; shared by the queue's messages in flight.
#[derive(Clone)]
pub(crate) struct Settler {
    pub(crate) queue: String,
    pub(crate) consumer: Arc<str>,
    pub(crate) dedup: Addr<DedupActor>,
    pub(crate) forwarder: AmqpPublisher,
    pub(crate) failure: FailureSettings,
    pub(crate) stats: Arc<Stats>,
    pub(crate) database: Arc<DatabaseGate>,
    /// `queues[].concurrent_batches`.
    pub(crate) concurrent_batches: u16,
    /// The consuming channel's unsettled deliveries; one per link.
    pub(crate) window: Arc<AckWindow>,
}

/// A decoded delivery waiting for its outcome.
pub(crate) struct Pending {
    delivery: Delivery,
    ticket: Ticket,
    envelope: Arc<Envelope>,
    history: FailureHistory,
    arrived: Instant,
}

/// A delivery that can never be processed, and why.
pub(crate) struct Malformed {
    delivery: Delivery,
    ticket: Ticket,
    reason: String,
    stage: &'static str,
    history: FailureHistory,
}

impl Settler {
    /// Checks a delivery's size and decodes it.
    pub(crate) fn prepare(
        &self,
        mut delivery: Delivery,
        ticket: Ticket,
        arrived: Instant,
    ) -> Result<Pending, Box<Malformed>> {
        let history = FailureHistory::read(
            delivery
                .properties
                .headers()
                .as_ref()
                .unwrap_or(&Default::default()),
        );
        let size = delivery.data.len();
        if size > self.failure.max_body_size {
            let reason = format!(
                "body is {size} bytes; failure.max_body_size is {}",
                self.failure.max_body_size
            );
            return Err(Box::new(Malformed {
                delivery,
                ticket,
                reason,
                stage: "consumer",
                history,
            }));
        }
        match Envelope::decode(
            &delivery.properties,
            &mut delivery.data,
            delivery.redelivered,
            &self.consumer,
        ) {
            Ok(envelope) => Ok(Pending {
                delivery,
                ticket,
                envelope: Arc::new(envelope),
                history,
                arrived,
            }),
            Err(e) => Err(Box::new(Malformed {
                delivery,
                ticket,
                reason: e.to_string(),
                stage: "decode",
                history,
            })),
        }
    }

    /// Runs one delivery through the inbox and the failure policy, and
    /// settles it with the broker.
    pub(crate) async fn settle(self: Arc<Self>, delivery: Delivery, ticket: Ticket, arrived: Instant) {
        match self.prepare(delivery, ticket, arrived) {
            Ok(pending) => self.process(pending, None).await,
            Err(malformed) => self.set_aside(malformed).await,
        }
    }

    /// Runs a batch through the inbox in one transaction, then settles each
    /// delivery from its own outcome (a failed one retries alone).
    pub(crate) async fn settle_batch(self: Arc<Self>, mut batch: Vec<Pending>) {
        if batch.len() == 1
            && let Some(alone) = batch.pop()
        {
            // Alone, it is cheaper without the batch's savepoint.
            return self.process(alone, None).await;
        }
        let deliver = DeliverBatch {
            consumer: Arc::clone(&self.consumer),
            envelopes: batch.iter().map(|p| Arc::clone(&p.envelope)).collect(),
            concurrent_batches: self.concurrent_batches,
        };
        let outcomes = self.dedup.send(deliver).await.unwrap_or_else(|e| {
            let abandoned = Abandoned::new("dedup actor", e);
            vec![Outcome::Abandoned(abandoned); batch.len()]
        });
        // The ones to ack go together, often as one `multiple` ack; the
        // others take their own paths.
        let (done, others): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .zip(outcomes)
            .partition(|(_, outcome)| matches!(outcome, Outcome::Completed | Outcome::Duplicate));
        let acks: Vec<(&Delivery, Ticket)> = done.iter().map(|(p, _)| (&p.delivery, p.ticket)).collect();
        let results = self.window.ack_all(&acks).await;
        for ((pending, outcome), result) in done.iter().zip(results) {
            let _span = pending.envelope.span.enter();
            tracing::debug!(?outcome, "acked");
            check_settled(result, "ack", &self.stats);
            self.stats.record_latency(pending.arrived.elapsed());
        }
        let settled = others
            .into_iter()
            .map(|(pending, outcome)| self.process(pending, Some(outcome)));
        join_all(settled).await;
    }

    /// A malformed delivery: straight to `Q.error`, no handler ran.
    pub(crate) async fn set_aside(self: Arc<Self>, malformed: Box<Malformed>) {
        let Malformed {
            delivery,
            ticket,
            reason,
            stage,
            history,
        } = *malformed;
        tracing::warn!(
            queue = %self.queue,
            delivery_tag = delivery.delivery_tag,
            delivery = %DeliveryLabel(&delivery.properties),
            %reason,
            "malformed delivery; moving it to the error queue"
        );
        self.stats.add(Counter::Rejected);
        let fault = self.fault(&reason, stage, history);
        self.move_to(
            &error_queue(&self.queue),
            &delivery,
            ticket,
            &delivery.data,
            &fault,
        )
        .await;
    }

    /// Settles one message: from `first`, the outcome of an attempt already
    /// made (in a batch), or from attempts of its own; failures go through
    /// the immediate retries, then a retry tier or `Q.error`.
    async fn process(&self, pending: Pending, mut first: Option<Outcome>) {
        let Pending {
            delivery,
            ticket,
            envelope,
            mut history,
            arrived,
        } = pending;
        let span = envelope.span.clone();
        async move {
            let mut retry = 0;
            let mut holds_in_vain = 0;
            let abandoned: Abandoned = loop {
                tracing::Span::current().record("attempt", history.next_attempt());
                let outcome = match first.take() {
                    Some(outcome) => outcome,
                    None => {
                        let deliver = Deliver {
                            consumer: Arc::clone(&self.consumer),
                            envelope: Arc::clone(&envelope),
                        };
                        self.dedup
                            .send(deliver)
                            .await
                            .unwrap_or_else(|e| Outcome::Abandoned(Abandoned::new("dedup actor", e)))
                    }
                };
                match outcome {
                    Outcome::Completed | Outcome::Duplicate => {
                        tracing::debug!(?outcome, "acking");
                        self.ack(&delivery, ticket).await;
                        self.stats.record_latency(arrived.elapsed());
                        return;
                    }
                    Outcome::Rejected { stage, reason } => {
                        tracing::warn!(%stage, %reason, "the message can never succeed; moving it to the error queue");
                        // Counted as rejected by the dedup actor.
                        let fault = self.fault(&reason, &stage, history);
                        self.move_to(&error_queue(&self.queue), &delivery, ticket, &envelope.body, &fault)
                            .await;
                        return;
                    }
                    Outcome::NoHandler => {
                        let reason = format!("no handler registered for type `{}`", envelope.event_type);
                        tracing::warn!("{reason}; moving it to the skipped queue");
                        let fault = self.fault(&reason, "dispatch", history);
                        self.move_to(&skipped_queue(&self.queue), &delivery, ticket, &envelope.body, &fault)
                            .await;
                        return;
                    }
                    Outcome::Abandoned(abandoned) if abandoned.unavailable && holds_in_vain < MAX_HOLDS_IN_VAIN => {
                        // Not the message's fault: hold it (unacked, so the
                        // prefetch stops further deliveries) until the
                        // database answers, and spend none of its attempts.
                        tracing::debug!(reason = %abandoned.reason, "database unavailable; holding the message");
                        if self.database.wait_until_available(&abandoned.reason).await {
                            holds_in_vain = 0;
                        } else {
                            holds_in_vain += 1;
                        }
                        continue;
                    }
                    Outcome::Abandoned(abandoned) => {
                        history.record_failure();
                        if retry < self.failure.immediate_retries {
                            let pause = self.failure.backoff(retry);
                            tracing::warn!(
                                stage = %abandoned.stage,
                                reason = %abandoned.reason,
                                attempts = history.attempts,
                                "attempt failed; retrying in {pause:?}"
                            );
                            tokio::time::sleep(pause).await;
                            retry += 1;
                            continue;
                        }
                        break abandoned;
                    }
                }
            };
            let (to, counter) = match self.failure.destination(history.redeliveries) {
                Destination::RetryTier(tier) => {
                    history.record_redelivery();
                    (retry_queue(&self.queue, tier), Counter::Delayed)
                }
                Destination::Error => (error_queue(&self.queue), Counter::DeadLettered),
            };
            tracing::warn!(
                stage = %abandoned.stage,
                reason = %abandoned.reason,
                attempts = history.attempts,
                "attempts failed; moving it to {to}"
            );
            let fault = self.fault(&abandoned.reason, &abandoned.stage, history);
            if self.move_to(&to, &delivery, ticket, &envelope.body, &fault).await {
                self.stats.add(counter);
            }
        }
        .instrument(span)
        .await
    }

    fn fault<'a>(&'a self, reason: &'a str, handler: &'a str, history: FailureHistory) -> Fault<'a> {
        Fault {
            reason,
            handler,
            history,
            source_queue: &self.queue,
        }
    }

    /// Publishes a copy of the delivery with the fault in its headers to
    /// `to`, then acks the original, in that order. If the copy is not
    /// confirmed, the original goes back to the broker instead. Returns
    /// whether the message moved.
    async fn move_to(
        &self,
        to: &str,
        delivery: &Delivery,
        ticket: Ticket,
        body: &[u8],
        fault: &Fault<'_>,
    ) -> bool {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        fault.stamp(&mut headers);
        let properties = delivery.properties.clone().with_headers(headers);
        match self.forwarder.publish_raw(to, properties, body).await {
            Ok(()) => {
                self.ack(delivery, ticket).await;
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "could not move the message to {to}; handing it back to the broker");
                tokio::time::sleep(MOVE_FAILED_PAUSE).await;
                let options = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                let result = self.window.nack(delivery, ticket, options).await;
                check_settled(result, "nack", &self.stats);
                false
            }
        }
    }

    async fn ack(&self, delivery: &Delivery, ticket: Ticket) {
        check_settled(self.window.ack(delivery, ticket).await, "ack", &self.stats);
    }
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
