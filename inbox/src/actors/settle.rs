//! Settling one delivery: carrying out the failure policy.
//!
//! A [`Settler`] runs a decoded delivery through the inbox (via the
//! [`DedupActor`]), asks [`crate::policy::decide`] what the outcome means, and
//! carries the [`Action`] out with the broker: ack; hold while the
//! database is unreachable; retry in process; move to a retry tier,
//! `Q.error` or `Q.skipped`. Every move publishes the copy with its fault
//! headers, without the producer's TTL and `user_id`
//! ([`copy_properties`]), and waits for the broker's confirm before acking
//! the original.
//! What it did is counted once, when done. The
//! [`ConsumerActor`](crate::actors::consumer::ConsumerActor) owns one per queue and runs
//! its work as a future per delivery (or per batch).

use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::Addr;
use futures_util::future::Either;
use lapin::message::Delivery;
use lapin::options::BasicNackOptions;
use tracing::Instrument;

use crate::Wire;
use crate::actors::acks::{AckWindow, Ticket};
use crate::actors::availability::DatabaseGate;
use crate::actors::dedup::{CountRedelivery, DedupActor, Deliver, DeliverBatch, ForgetDeliveries};
use crate::actors::handler::HandledTypes;
use crate::actors::metrics::QueueMetrics;
use crate::actors::stats::Stats;
use crate::actors::tally::Tally;
use crate::amqp::AmqpPublisher;
use crate::envelope::{DeliveryLabel, Envelope};
use crate::fault::{FailureHistory, Fault, copy_properties};
use crate::policy::{Abandoned, Action, Failure, Outcome, Stage, Target};
use crate::settings::FailureSettings;

/// How long to wait before handing a message back to the broker when it
/// could not be moved to a retry tier or the error queue (the broker is
/// struggling; an instant requeue would spin).
const MOVE_FAILED_PAUSE: Duration = Duration::from_secs(1);

/// What settling a delivery needs; shared by the queue's messages in flight.
#[derive(Clone)]
pub(crate) struct Settler {
    pub(crate) queue: String,
    pub(crate) consumer: Arc<str>,
    pub(crate) dedup: Addr<DedupActor>,
    pub(crate) forwarder: AmqpPublisher,
    pub(crate) failure: FailureSettings,
    pub(crate) stats: Arc<Stats>,
    /// This queue's metrics.
    pub(crate) metrics: Arc<QueueMetrics>,
    pub(crate) database: Arc<DatabaseGate>,
    /// `queues[].concurrent_batches`.
    pub(crate) concurrent_batches: u16,
    /// The consuming channel's unsettled deliveries; one per link.
    pub(crate) window: Arc<AckWindow>,
    /// How the queue's messages look on the wire.
    pub(crate) dialect: Dialect,
    /// Whether the runtime counts a message's redeliveries itself, the
    /// broker not limiting them (a classic queue, or one adopted as it is),
    /// and sets one aside on its `queues[].delivery_limit`th delivery.
    pub(crate) counts_redeliveries: bool,
    /// `queues[].delivery_limit`.
    pub(crate) delivery_limit: u32,
}

/// How a queue's messages look on the wire (`message_bus.wire`): how a
/// delivery decodes, what the queues kept beside it are named, and which
/// fault headers a move adds.
#[derive(Clone)]
pub(crate) struct Dialect {
    wire: Wire,
    /// The types handlers are registered for: a MassTransit message is
    /// handled as the first of its types among them, and a body is
    /// decoded into its type before its transaction.
    pub(crate) handled: HandledTypes,
    /// The queue's address as MassTransit writes it, for
    /// `MT-Fault-InputAddress`.
    input_address: String,
    /// `queues[].raw_json`.
    raw_json: bool,
}

impl Dialect {
    pub(crate) fn of(
        settings: &crate::Settings,
        queue: &crate::QueueSettings,
        handled: HandledTypes,
    ) -> Self {
        let broker = settings
            .message_bus
            .amqp_urls
            .first()
            .and_then(|url| url.parse::<lapin::uri::AMQPUri>().ok());
        let input_address = match broker {
            Some(uri) => {
                crate::masstransit::address(&uri.authority.host, uri.authority.port, &uri.vhost, &queue.name)
            }
            None => crate::masstransit::address("localhost", 5672, "/", &queue.name),
        };
        Self {
            wire: settings.message_bus.wire,
            handled,
            input_address,
            raw_json: queue.raw_json,
        }
    }

    /// Whether a delivery with `properties` is read as raw JSON: on a
    /// queue with `queues[].raw_json`, under its content type.
    fn reads_raw(&self, properties: &lapin::BasicProperties) -> bool {
        crate::masstransit::is_raw_json(properties, self.raw_json)
    }

    /// Decodes `delivery` as this wire's envelope.
    fn decode(
        &self,
        delivery: &mut Delivery,
        consumer: &str,
    ) -> Result<Envelope, crate::envelope::DecodeError> {
        match self.wire {
            Wire::Inbox => Envelope::decode(
                &delivery.properties,
                &mut delivery.data,
                delivery.redelivered,
                consumer,
            ),
            Wire::Masstransit => Envelope::decode_masstransit(
                &delivery.properties,
                &delivery.data,
                self.raw_json,
                delivery.redelivered,
                consumer,
                &self.handled,
            ),
        }
    }
}

/// A move: where to, why, the body to copy, and the message as decoded
/// (`None` when it could not be).
struct Moved<'a> {
    to: Target,
    failure: Failure,
    body: &'a [u8],
    envelope: Option<&'a Envelope>,
}

/// A decoded delivery waiting for its outcome.
pub(crate) struct Pending {
    /// Boxed (432 bytes): every settling future holds it, and is then
    /// small enough for the allocator's cache of small blocks.
    delivery: Box<Delivery>,
    ticket: Ticket,
    envelope: Arc<Envelope>,
    history: FailureHistory,
    arrived: Instant,
    /// Its outcome when known before any transaction: a body that does not
    /// decode into its type.
    known: Option<Outcome>,
}

impl Pending {
    /// Whether it is to be settled on its own rather than join a batch:
    /// its outcome is known already (it needs no transaction), or it has
    /// failed before (back from a retry tier, or redelivered after its
    /// handlers failed), so that a message that keeps failing costs no
    /// batch its handlers' time twice, once together and once alone.
    pub(crate) fn goes_alone(&self) -> bool {
        self.known.is_some() || self.history.attempts > 0
    }
}

/// A member of a batch that did not complete there, with its outcome.
pub(crate) struct Leaver {
    pending: Pending,
    outcome: Outcome,
}

/// A delivery that can never be processed, and why.
pub(crate) struct Malformed {
    delivery: Delivery,
    ticket: Ticket,
    rejected: Outcome,
    history: FailureHistory,
}

impl Settler {
    /// Counts in the stats and, for the outcomes it knows, in the queue's
    /// metrics: one place for both.
    fn count(&self, tally: Tally) {
        self.stats.add(tally);
        self.metrics.outcome(tally);
    }

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
                rejected: Outcome::Rejected {
                    stage: Stage::BodySize,
                    reason,
                },
                history,
            }));
        }
        match self.dialect.decode(&mut delivery, &self.consumer) {
            Ok(mut envelope) => {
                envelope.consumed_from(&self.queue, delivery.routing_key.as_str());
                if envelope.masstransit.is_some() {
                    envelope.input_address = Some(self.dialect.input_address.clone());
                }
                envelope.set_attempt(history.next_attempt());
                // A type without handlers is skipped in its transaction
                // (which records the skip); one with handlers must decode,
                // and its handlers take the event decoded here.
                let known = match self.dialect.handled.decode(&envelope.event_type, &envelope) {
                    Some(Err(reason)) => Some(Outcome::Rejected {
                        stage: Stage::Deserialize,
                        reason,
                    }),
                    Some(Ok(event)) => {
                        envelope.decoded.set(event);
                        None
                    }
                    None => None,
                };
                Ok(Pending {
                    delivery: Box::new(delivery),
                    ticket,
                    envelope: Arc::new(envelope),
                    history,
                    arrived,
                    known,
                })
            }
            Err(e) => Err(Box::new(Malformed {
                delivery,
                ticket,
                rejected: Outcome::Rejected {
                    stage: Stage::Decode,
                    reason: e.to_string(),
                },
                history,
            })),
        }
    }

    /// Runs one delivery through the inbox and the failure policy, and
    /// settles it with the broker.
    ///
    /// This and the other entry points are functions that return the
    /// future rather than `async fn`s: each `async fn` layer would keep its
    /// own copy of the pending delivery beside the next layer's, and a
    /// settling future made of three layers was 4.6 KB, allocated and freed
    /// for every message; flat, it is the size of [`process`](Self::process)'s
    /// (800 bytes, the delivery boxed in [`Pending`]: under glibc's 1,032-byte
    /// cache of small blocks).
    pub(crate) fn settle(
        self: Arc<Self>,
        delivery: Delivery,
        ticket: Ticket,
        arrived: Instant,
    ) -> impl Future<Output = ()> + 'static {
        match self.prepare(delivery, ticket, arrived) {
            Ok(pending) => Either::Left(self.settle_prepared(pending)),
            Err(malformed) => Either::Right(Box::pin(self.set_aside(malformed))),
        }
    }

    /// [`settle`](Self::settle) for a delivery already prepared.
    pub(crate) fn settle_prepared(
        self: Arc<Self>,
        mut pending: Pending,
    ) -> impl Future<Output = ()> + 'static {
        match pending.known.take() {
            Some(known) => Either::Left(self.process(pending, Some(known))),
            None if self.must_count(&pending) => Either::Right(Box::pin(async move {
                let known = self.past_delivery_limit(&pending.envelope).await;
                self.process(pending, known).await
            })),
            None => Either::Left(self.process(pending, None)),
        }
    }

    /// Whether `pending` settles on its own rather than in a batch: see
    /// [`Pending::goes_alone`]; a redelivery this queue counts itself,
    /// counted before its handlers run; and a MassTransit message listing
    /// more than one type handlers are registered for, whose handlers of
    /// every type run one after the other (a batch runs one type's).
    pub(crate) fn settles_alone(&self, pending: &Pending) -> bool {
        pending.goes_alone()
            || self.must_count(pending)
            || pending.envelope.masstransit.as_ref().is_some_and(|context| {
                let mut handled = context
                    .message_types
                    .iter()
                    .filter(|name| self.dialect.handled.contains(name));
                handled.nth(1).is_some()
            })
    }

    /// Whether `pending` is a redelivery this queue counts itself.
    fn must_count(&self, pending: &Pending) -> bool {
        self.counts_redeliveries && pending.delivery.redelivered
    }

    /// Counts one more delivery of `envelope` and, once it reaches
    /// `queues[].delivery_limit`, the outcome that sets it aside without
    /// running its handlers. A count that fails lets the delivery go on
    /// (the database away: its transaction finds the outage too), with a
    /// WARN: if it keeps failing (`inbox_deliveries` missing, its migration
    /// not run), nothing bounds a crash loop on this queue.
    async fn past_delivery_limit(&self, envelope: &Envelope) -> Option<Outcome> {
        let count = CountRedelivery {
            consumer: Arc::clone(&self.consumer),
            message_id: envelope.message_id,
        };
        let deliveries = match self.dedup.send(count).await {
            Ok(Ok(deliveries)) => deliveries,
            Ok(Err(abandoned)) => {
                tracing::warn!(reason = %abandoned.reason, "cannot count the redelivery; handling it uncounted");
                return None;
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot count the redelivery; handling it uncounted");
                return None;
            }
        };
        (deliveries >= self.delivery_limit).then(|| Outcome::Rejected {
            stage: Stage::DeliveryLimit,
            reason: format!(
                "delivered {deliveries} times without an outcome (queues[].delivery_limit is {}): its \
                 consumer likely crashes on it; set aside without running its handlers",
                self.delivery_limit
            ),
        })
    }

    /// Runs a batch through the inbox in one transaction and acks the
    /// deliveries it completed (or found duplicate). Returns the others,
    /// each with its outcome: they leave the batch, to be settled each on
    /// its own ([`settle_leaver`](Self::settle_leaver)), so that one
    /// member's retries and waits hold up no other message.
    pub(crate) async fn settle_batch(self: Arc<Self>, batch: Vec<Pending>) -> Vec<Leaver> {
        let outcomes = if let [alone] = batch.as_slice() {
            // A batch of one: cheaper as a message on its own, without the
            // batch's savepoint. Its attempt is the batch's: if it fails,
            // it leaves, as any member does, and frees the batch's place.
            let deliver = Deliver {
                consumer: Arc::clone(&self.consumer),
                envelope: Arc::clone(&alone.envelope),
            };
            let outcome = self
                .dedup
                .send(deliver)
                .await
                .unwrap_or_else(|e| Outcome::Abandoned(Abandoned::new(Stage::Handover, e)));
            vec![outcome]
        } else {
            let deliver = DeliverBatch {
                consumer: Arc::clone(&self.consumer),
                envelopes: batch.iter().map(|p| Arc::clone(&p.envelope)).collect(),
                concurrent_batches: self.concurrent_batches,
            };
            self.dedup.send(deliver).await.unwrap_or_else(|e| {
                let abandoned = Abandoned::new(Stage::Handover, e);
                vec![Outcome::Abandoned(abandoned); batch.len()]
            })
        };
        // The ones to ack go together, often as one `multiple` ack; the
        // others take their own paths.
        let (done, others): (Vec<_>, Vec<_>) = batch
            .into_iter()
            .zip(outcomes)
            .partition(|(_, outcome)| matches!(outcome, Outcome::Completed | Outcome::Duplicate));
        let acks: Vec<(&Delivery, Ticket)> = done.iter().map(|(p, _)| (&*p.delivery, p.ticket)).collect();
        let results = self.window.ack_all(&acks).await;
        for ((pending, outcome), result) in done.iter().zip(results) {
            let _span = pending.envelope.span.enter();
            tracing::debug!(?outcome, "acked");
            self.acked(result, *outcome == Outcome::Duplicate, pending.arrived);
        }
        others
            .into_iter()
            .map(|(pending, outcome)| Leaver { pending, outcome })
            .collect()
    }

    /// Settles a member that left its batch, from the outcome it had there:
    /// its retries run alone.
    pub(crate) fn settle_leaver(self: Arc<Self>, leaver: Leaver) -> impl Future<Output = ()> + 'static {
        self.process(leaver.pending, Some(leaver.outcome))
    }

    /// A malformed delivery: straight to `Q.error`, no handler ran.
    pub(crate) async fn set_aside(self: Arc<Self>, malformed: Box<Malformed>) {
        let Malformed {
            delivery,
            ticket,
            rejected,
            history,
        } = *malformed;
        tracing::warn!(
            queue = %self.queue,
            delivery_tag = delivery.delivery_tag,
            delivery = %DeliveryLabel(&delivery.properties),
            ?rejected,
            "malformed delivery; moving it to the error queue"
        );
        match crate::policy::decide(rejected, &history, &self.failure) {
            Action::Move { to, failure } => {
                // Not decoded: no type to name.
                let moved = Moved {
                    to,
                    failure,
                    body: &delivery.data,
                    envelope: None,
                };
                self.move_to(moved, &delivery, ticket).await;
            }
            // The policy moves every rejected outcome (its table says so).
            // Were it ever otherwise, the broker dead-letters the delivery
            // to Q.error rather than leave it unsettled.
            other => {
                tracing::error!(
                    ?other,
                    "no move for a malformed delivery; rejecting it to the error queue"
                );
                let options = BasicNackOptions {
                    requeue: false,
                    ..BasicNackOptions::default()
                };
                check_settled(
                    self.window.nack(&delivery, ticket, options).await,
                    "nack",
                    &self.stats,
                );
            }
        }
    }

    /// Settles one message: from `first`, the outcome of an attempt already
    /// made (in a batch), or from attempts of its own, each outcome decided
    /// by [`crate::policy::decide`] and carried out here.
    fn process(
        self: Arc<Self>,
        pending: Pending,
        mut first: Option<Outcome>,
    ) -> impl Future<Output = ()> + 'static {
        let Pending {
            delivery,
            ticket,
            mut envelope,
            mut history,
            arrived,
            known: _,
        } = pending;
        let span = envelope.span.clone();
        async move {
            loop {
                let outcome = match first.take() {
                    Some(outcome) => outcome,
                    None => {
                        // Handlers see which attempt this is.
                        if envelope.attempt != history.next_attempt() {
                            let mut next = (*envelope).clone();
                            next.set_attempt(history.next_attempt());
                            envelope = Arc::new(next);
                        }
                        let deliver = Deliver {
                            consumer: Arc::clone(&self.consumer),
                            envelope: Arc::clone(&envelope),
                        };
                        self.dedup
                            .send(deliver)
                            .await
                            .unwrap_or_else(|e| Outcome::Abandoned(Abandoned::new(Stage::Handover, e)))
                    }
                };
                match crate::policy::decide(outcome, &history, &self.failure) {
                    Action::Ack { duplicate } => {
                        tracing::debug!(duplicate, "acking");
                        let result = self.window.ack(&delivery, ticket).await;
                        self.acked(result, duplicate, arrived);
                        return;
                    }
                    Action::Hold { reason } => {
                        // Not the message's fault: hold it (unacked, so the
                        // prefetch stops further deliveries) until the
                        // database answers, and spend none of its attempts.
                        tracing::debug!(%reason, "database unavailable; holding the message");
                        self.count(Tally::Held);
                        let outage_seen = Box::pin(self.database.wait_until_available(&reason)).await;
                        history.record_hold(outage_seen);
                    }
                    Action::Retry { after, failure } => {
                        self.count(Tally::Abandoned);
                        self.count(Tally::Retried);
                        tracing::warn!(
                            stage = %failure.stage,
                            reason = %failure.reason,
                            attempts = failure.history.attempts,
                            "attempt failed; retrying in {after:?}"
                        );
                        history = failure.history;
                        tokio::time::sleep(after).await;
                    }
                    Action::Move { to, failure } => {
                        if matches!(to, Target::RetryTier(_) | Target::Exhausted) {
                            self.count(Tally::Abandoned);
                        }
                        // MassTransit's tools expect the message as it was
                        // sent, envelope and all; the inbox wire's body was
                        // moved into the envelope as it came.
                        let body = match envelope.masstransit {
                            Some(_) => &delivery.data,
                            None => &envelope.body,
                        };
                        let moved = Moved {
                            to,
                            failure,
                            body,
                            envelope: Some(&envelope),
                        };
                        // Boxed, as every path off the common one: inline,
                        // its state would grow every message's future.
                        Box::pin(self.move_to(moved, &delivery, ticket)).await;
                        return;
                    }
                }
            }
        }
        .instrument(span)
    }

    /// Counts an ack, and the latency of the delivery it settled.
    fn acked(&self, result: lapin::Result<bool>, duplicate: bool, arrived: Instant) {
        check_settled(result, "ack", &self.stats);
        self.count(if duplicate {
            Tally::Duplicates
        } else {
            Tally::Completed
        });
        let latency = arrived.elapsed();
        self.stats.record_latency(latency);
        self.metrics.processed_in(latency);
    }

    /// Publishes a copy of the delivery, with the failure in its headers,
    /// to the queue `to` names, then acks the original, in that order, and
    /// counts the move. If the copy is not confirmed, the original goes
    /// back to the broker instead.
    async fn move_to(&self, moved: Moved<'_>, delivery: &Delivery, ticket: Ticket) {
        let Moved {
            to,
            failure,
            body,
            envelope,
        } = moved;
        let message_type = envelope.map_or("", |e| e.event_type.as_str());
        let wire = self.dialect.wire;
        let (queue, counter) = match to {
            Target::RetryTier(tier) => (wire.retry_queue(&self.queue, tier), Tally::Delayed),
            Target::Exhausted => (wire.error_queue(&self.queue), Tally::DeadLettered),
            Target::Rejected => (wire.error_queue(&self.queue), Tally::Rejected),
            Target::Skipped => (wire.skipped_queue(&self.queue), Tally::Skipped),
        };
        tracing::warn!(
            stage = %failure.stage,
            reason = %failure.reason,
            attempts = failure.history.attempts,
            "moving the message to {queue}"
        );
        let stage = failure.stage.to_string();
        let fault = Fault {
            reason: &failure.reason,
            handler: &stage,
            history: failure.history.clone(),
            source_queue: &self.queue,
        };
        // The fault headers, both wires' for MassTransit's.
        let stamp = |headers: &mut lapin::types::FieldTable| {
            fault.stamp(headers);
            if let Target::Exhausted | Target::Rejected | Target::Skipped = to {
                headers.insert(
                    crate::fault::headers::SET_ASIDE.into(),
                    lapin::types::AMQPValue::LongString(queue.as_str().into()),
                );
            }
            if wire == Wire::Masstransit {
                self.stamp_masstransit(headers, to, &failure, message_type);
            }
        };
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        stamp(&mut headers);
        let mut properties = copy_properties(&delivery.properties, headers);
        if let Err(too_large) = self.forwarder.check_fits(&properties).await {
            // The headers it came with are untrusted, and with the fault
            // headers they pass a frame: the broker would close the
            // connection at every try, with the other messages' acks. The
            // copy keeps its body, its other properties and the fault
            // headers, and says what was dropped.
            let dropped = delivery
                .properties
                .headers()
                .as_ref()
                .map_or(0, |h| h.inner().len());
            tracing::warn!(%too_large, dropped, "the message's headers do not fit one frame with the fault headers; moving it without them");
            let mut headers = lapin::types::FieldTable::default();
            stamp(&mut headers);
            let note = format!("{dropped} headers dropped: {too_large}");
            headers.insert(
                crate::fault::headers::DROPPED_HEADERS.into(),
                lapin::types::AMQPValue::LongString(
                    crate::fault::truncate(&note, crate::fault::MAX_REASON_BYTES)
                        .as_ref()
                        .into(),
                ),
            );
            properties = copy_properties(&delivery.properties, headers);
        }
        // MassTransit reads a message's redelivery count from its
        // envelope's headers (ABS/Middleware/RetryContextExtensions.cs), a
        // raw message's from the AMQP headers stamped above.
        let body = match to {
            Target::RetryTier(_)
                if wire == Wire::Masstransit && !self.dialect.reads_raw(&delivery.properties) =>
            {
                crate::masstransit::with_redelivery_count(body, failure.history.redeliveries)
            }
            _ => std::borrow::Cow::Borrowed(body),
        };
        // MassTransit's error transport publishes to the exchange of its
        // error (or skipped) queue's name, with the original routing key
        // (RMQ/RabbitMqTransport/RabbitMqMoveTransport.cs): what is bound
        // there (a central error monitor) gets the copy too. The retry
        // tiers are the runtime's own, reached by their name.
        let published = match to {
            Target::Exhausted | Target::Rejected | Target::Skipped if wire == Wire::Masstransit => {
                self.forwarder
                    .publish_to(&queue, delivery.routing_key.as_str(), properties, &body)
                    .await
            }
            _ => self.forwarder.publish_raw(&queue, properties, &body).await,
        };
        match published {
            Ok(()) => {
                self.ack(delivery, ticket).await;
                self.count(counter);
                if let Some(envelope) = envelope
                    && self.counts_redeliveries
                    && delivery.redelivered
                {
                    self.forget_deliveries(envelope).await;
                }
                // A notification, after the message is settled: a slow or
                // failed fault holds up no ack.
                if let Some(envelope) = envelope
                    && matches!(to, Target::Exhausted | Target::Rejected)
                {
                    self.publish_fault(envelope, &failure, to).await;
                }
            }
            Err(e) => {
                tracing::error!(error = %e, "could not move the message to {queue}; handing it back to the broker");
                self.count(Tally::MovesHandedBack);
                tokio::time::sleep(MOVE_FAILED_PAUSE).await;
                let options = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                let result = self.window.nack(delivery, ticket, options).await;
                check_settled(result, "nack", &self.stats);
            }
        }
    }

    /// Forgets the deliveries counted for a message that has just left the
    /// queue: a copy that comes back (from a retry tier, or replayed)
    /// starts with its deliveries unspent, as on a quorum queue. Called only
    /// where a count can exist: on a queue whose deliveries the runtime
    /// counts, for a delivery the broker marked redelivered (a message
    /// handed back once is marked so at every later delivery, and a first
    /// delivery counts nothing), so that the moves of messages never handed
    /// back cost no statement. After the ack, so that a failure here costs
    /// the message nothing but an early count, said in a WARN.
    async fn forget_deliveries(&self, envelope: &Envelope) {
        let forget = ForgetDeliveries {
            consumer: Arc::clone(&self.consumer),
            message_id: envelope.message_id,
        };
        let reason = match self.dedup.send(forget).await {
            Ok(Ok(())) => return,
            Ok(Err(abandoned)) => abandoned.reason,
            Err(e) => e.to_string(),
        };
        tracing::warn!(
            message_id = %envelope.message_id,
            %reason,
            "cannot forget the deliveries counted for a message that left the queue; a copy that comes back \
             starts with them spent"
        );
    }

    /// Publishes MassTransit's `Fault<T>` for a message now in `Q_error`, as
    /// MassTransit does, to the exchange `MassTransit:Fault--T--`, for
    /// whoever subscribes (a fault nobody subscribes to is dropped by the
    /// broker). A notification: the message is safe in `Q_error` already,
    /// so a fault that cannot be published is a WARN, not a reason to keep
    /// the message. A delivery that did not decode gets none (MassTransit
    /// would publish a `ReceiveFault`).
    async fn publish_fault(&self, envelope: &Envelope, failure: &Failure, to: Target) {
        use crate::masstransit::{FaultEvent, SendAddress, encode_fault};
        let Some(context) = &envelope.masstransit else {
            return;
        };
        // `Fault<T>` of the type whose handler failed (a message of several
        // types runs the handlers of each), else of the type it was
        // handled as.
        let message_type = match failure.stage {
            Stage::Handler { event_type, .. } => event_type,
            _ => envelope.event_type.as_str(),
        };
        let destination = context
            .fault_address
            .as_deref()
            .or(context.response_address.as_deref());
        let message_id = uuid::Uuid::now_v7();
        let timestamp = crate::masstransit::timestamp_now();
        let fault = FaultEvent {
            message_id,
            fault_id: uuid::Uuid::now_v7(),
            faulted_message_id: envelope.message_id,
            message_type,
            message: &envelope.body,
            exception_type: exception_type(to),
            reason: &failure.reason,
            timestamp: &timestamp,
            context,
            input_address: &self.dialect.input_address,
            retries: failure.history.attempts.saturating_sub(1),
            redeliveries: failure.history.redeliveries,
            destination_address: destination,
        };
        let published = match encode_fault(&fault) {
            Ok(body) => {
                let properties = crate::masstransit::properties(message_id);
                match destination {
                    // Sent where the message asked (a requester), not
                    // published: MassTransit's `GetFaultEndpoint`.
                    Some(address) => match SendAddress::parse(address) {
                        Some(address) => self.forwarder.send_to_address(&address, properties, &body).await,
                        None => Err(crate::Error::new(
                            crate::ErrorKind::Usage,
                            format!(
                                "the fault address `{}` is no RabbitMQ address",
                                crate::fault::truncate(address, 128)
                            ),
                        )),
                    },
                    None => self.publish_fault_to_subscribers(&fault, properties, &body).await,
                }
            }
            Err(e) => Err(crate::Error::new(
                crate::ErrorKind::Serialize,
                format!("cannot encode the fault: {e}"),
            )),
        };
        if let Err(e) = published {
            tracing::warn!(error = %e, "could not send the message's Fault<{message_type}>; it is in the error queue all the same");
        }
    }

    /// Publishes `fault` to `Fault<T>`'s exchange, bound first to those of
    /// `Fault<X>` for every other type of the faulted message and to
    /// `Fault`'s, each `Fault<X>`'s bound to `Fault`'s too: the exchanges
    /// MassTransit's publish topology declares and binds for a `Fault<T>`.
    async fn publish_fault_to_subscribers(
        &self,
        fault: &crate::masstransit::FaultEvent<'_>,
        properties: lapin::BasicProperties,
        body: &[u8],
    ) -> crate::Result<()> {
        use crate::masstransit::FAULT_EXCHANGE;
        let exchanges = fault.exchanges();
        let Some((own, others)) = exchanges.split_first() else {
            return Ok(());
        };
        for other in others {
            self.forwarder
                .declare_type_exchange(other, &[FAULT_EXCHANGE])
                .await?;
        }
        let implements: Vec<&str> = others
            .iter()
            .map(String::as_str)
            .chain(std::iter::once(FAULT_EXCHANGE))
            .collect();
        self.forwarder
            .publish_to_subscribers(own, &implements, properties, body)
            .await
    }

    /// MassTransit's headers for a move to `to`: `MT-Reason` and the
    /// `MT-Fault-*` of its error queue, `MT-Reason: dead-letter` for its
    /// skipped queue, the `MT-Host-*` of both, `MT-Redelivery-Count` for a
    /// retry tier.
    fn stamp_masstransit(
        &self,
        headers: &mut lapin::types::FieldTable,
        to: Target,
        failure: &Failure,
        message_type: &str,
    ) {
        use crate::masstransit::{Fault, stamp_dead_letter, stamp_fault, stamp_host, stamp_redelivery};
        match to {
            Target::RetryTier(_) => {
                // A copy MassTransit set aside once and that came back: its
                // fault headers describe its past, and on its way back from
                // the tier would make it look set aside again.
                *headers = crate::fault::without(headers, &crate::masstransit::headers::SET_ASIDE);
                *headers = crate::fault::without(headers, &crate::masstransit::headers::HOST);
                stamp_redelivery(headers, failure.history.redeliveries);
            }
            Target::Skipped => {
                stamp_dead_letter(headers);
                stamp_host(headers);
            }
            Target::Exhausted | Target::Rejected => {
                stamp_host(headers);
                let stage = failure.stage.to_string();
                stamp_fault(
                    headers,
                    &Fault {
                        message: &failure.reason,
                        exception_type: exception_type(to),
                        consumer_type: &stage,
                        message_type,
                        input_address: &self.dialect.input_address,
                        retries: failure.history.attempts.saturating_sub(1),
                        timestamp: &crate::masstransit::timestamp_now(),
                    },
                );
            }
        }
    }

    async fn ack(&self, delivery: &Delivery, ticket: Ticket) {
        check_settled(self.window.ack(delivery, ticket).await, "ack", &self.stats);
    }
}

/// What MassTransit's headers and `Fault<T>` say in place of an exception
/// type, for a message moved to `Q_error` as `to`.
fn exception_type(to: Target) -> &'static str {
    match to {
        Target::Rejected => "Inbox.MessageRejectedException",
        _ => "Inbox.AttemptsExhaustedException",
    }
}

/// lapin answers `Ok(false)` for an ack on a channel that has been recovered
/// since the delivery: the broker never got it and will redeliver.
fn check_settled(result: lapin::Result<bool>, what: &str, stats: &Stats) {
    match result {
        Ok(true) => {}
        Ok(false) => {
            stats.add(Tally::UnconfirmedAcks);
            tracing::warn!(
                "{what} not delivered: the channel was recovered since; the broker will redeliver and the inbox will skip what was committed"
            );
        }
        Err(e) => {
            stats.add(Tally::UnconfirmedAcks);
            tracing::warn!(error = %e, "{what} failed; the broker will redeliver and the inbox will skip what was committed");
        }
    }
}
