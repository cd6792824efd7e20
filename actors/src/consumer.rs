//! [`ConsumerActor`]: one RabbitMQ queue, and the failure policy for its
//! messages.
//!
//! Owns the queue's channel and its lapin consumer stream. Decodes each
//! delivery into an envelope and sends [`Deliver`] to the
//! [`DedupActor`](crate::DedupActor), up to the queue's prefetch at once,
//! then settles the delivery from the [`Outcome`]:
//!
//! - completed or duplicate: ack;
//! - abandoned because the database is unreachable: held until it answers
//!   again (the runtime's database gate probes it), spending
//!   none of the message's attempts;
//! - abandoned: retried in process (`failure.immediate_retries`), then
//!   moved to the next retry tier `Q.retry.<n>`, or to `Q.error` after the
//!   last one;
//! - malformed (bad properties, a body too large or not the event): moved
//!   to `Q.error` at once; no handler for the type: moved to `Q.skipped`.
//!
//! With `batch_size` above 1, deliveries that arrive together are buffered
//! until the actor has handled every one that is ready ([`Flush`]), then
//! sent as one [`DeliverBatch`]; each delivery is settled from its own
//! outcome, after the batch's commit. A batch fills up to `batch_size`, and
//! at most `prefetch / batch_size` batches run at once.
//!
//! A move publishes the copy, with its [fault headers](inbox::fault), and
//! waits for the broker's confirm before acking the original: a crash in
//! between leaves a duplicate for the inbox to skip, never a loss.
//! Receives [`Drain`] at shutdown: stops consuming, waits for the
//! messages in flight and closes its connection; and [`Disconnect`] when
//! the shutdown timeout is up: closes it at once.
//!
//! The queue has a connection of its own. lapin's recovery replays it after
//! a network fault or a broker restart; if the consumer ends all the same
//! (recovery gave up, the queue was deleted), the actor reconnects with a
//! growing pause, declares the topology again and consumes anew.

use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures_util::future::join_all;
use inbox::amqp;
use inbox::amqp::{error_queue, retry_queue, skipped_queue};
use inbox::fault::{FailureHistory, Fault};
use inbox::lapin::message::Delivery;
use inbox::lapin::options::{
    BasicAckOptions, BasicCancelOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions,
};
use inbox::lapin::types::{FieldTable, ShortString};
use inbox::lapin::{Channel, Connection, Consumer};
use inbox::{AmqpPublisher, DeliveryLabel, Destination, Envelope, FailureSettings, QueueSettings, Settings};
use tokio::sync::oneshot;
use tracing::Instrument;

use crate::availability::DatabaseGate;
use crate::dedup::{Abandoned, DedupActor, Deliver, DeliverBatch, Outcome};
use crate::stats::{Counter, Stats};

/// How long to wait before handing a message back to the broker when it
/// could not be moved to a retry tier or the error queue (the broker is
/// struggling; an instant requeue would spin).
const MOVE_FAILED_PAUSE: Duration = Duration::from_secs(1);

/// Stop consuming and resolve once no message is in flight.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Drain;

/// Close the connection now, whatever is still in flight (shutdown past its
/// timeout): unacked messages go back to the queue.
#[derive(Message)]
#[rtype(result = "()")]
pub struct Disconnect;

/// Send the buffered deliveries as batches (sent to itself once the
/// deliveries that were ready together have all been buffered).
#[derive(Message)]
#[rtype(result = "()")]
pub struct Flush;

/// Consumes one queue.
pub struct ConsumerActor {
    settler: Arc<Settler>,
    /// What reconnecting needs: the broker's address and the topology.
    settings: Settings,
    queue: QueueSettings,
    /// The queue's own connection, so that it can reconnect on its own.
    connection: Arc<Connection>,
    channel: Channel,
    tag: ShortString,
    stream: Option<Consumer>,
    in_flight: usize,
    draining: bool,
    drained: Vec<oneshot::Sender<()>>,
    stream_ended: bool,
    batching: Batching,
}

/// The batch buffer of a consumer with `batch_size` above 1.
struct Batching {
    size: usize,
    max_in_flight: usize,
    in_flight: usize,
    buffer: Vec<Pending>,
    flush_scheduled: bool,
}

/// A queue's link to the broker: a connection of its own, the consuming
/// channel and its stream, and a confirming channel for moving messages to
/// the retry tiers, `Q.error` and `Q.skipped`.
pub(crate) struct Link {
    connection: Arc<Connection>,
    channel: Channel,
    stream: Consumer,
    forwarder: AmqpPublisher,
}

impl Link {
    /// Connects, declares the queue's topology, sets its prefetch and starts
    /// consuming.
    pub(crate) async fn open(settings: &Settings, queue: &QueueSettings) -> inbox::Result<Self> {
        let connection = amqp::connect(settings, &format!("inbox {}", queue.name)).await?;
        let channel = connection.create_channel().await?;
        amqp::declare_topology(&channel, queue, &settings.failure).await?;
        channel
            .basic_qos(queue.prefetch, BasicQosOptions { global: false })
            .await?;
        let stream = channel
            .basic_consume(
                queue.name.as_str().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await?;
        let forwarder = AmqpPublisher::new(&connection, "").await?;
        Ok(Self {
            connection: Arc::new(connection),
            channel,
            stream,
            forwarder,
        })
    }
}

/// The first pause before reconnecting; doubled up to [`MAX_RECONNECT_PAUSE`].
const FIRST_RECONNECT_PAUSE: Duration = Duration::from_millis(100);
const MAX_RECONNECT_PAUSE: Duration = Duration::from_secs(30);

impl ConsumerActor {
    /// An actor consuming `queue` over `link`.
    pub(crate) fn new(
        settings: &Settings,
        queue: &QueueSettings,
        link: Link,
        dedup: Addr<DedupActor>,
        stats: Arc<Stats>,
        database: Arc<DatabaseGate>,
    ) -> Self {
        let settler = Settler {
            queue: queue.name.clone(),
            consumer: queue.consumer_id().into(),
            dedup,
            forwarder: link.forwarder,
            failure: settings.failure.clone(),
            stats,
            database,
        };
        let size = usize::from(queue.batch_size);
        Self {
            settler: Arc::new(settler),
            settings: settings.clone(),
            queue: queue.clone(),
            connection: link.connection,
            channel: link.channel,
            tag: link.stream.tag(),
            stream: Some(link.stream),
            in_flight: 0,
            draining: false,
            drained: Vec::new(),
            stream_ended: false,
            batching: Batching {
                size,
                max_in_flight: (usize::from(queue.prefetch) / size).max(1),
                in_flight: 0,
                buffer: Vec::new(),
                flush_scheduled: false,
            },
        }
    }

    /// Sends buffered deliveries as batches while fewer than the maximum
    /// are running.
    fn dispatch_batches(&mut self, ctx: &mut Context<Self>) {
        while !self.batching.buffer.is_empty() && self.batching.in_flight < self.batching.max_in_flight {
            let take = self.batching.buffer.len().min(self.batching.size);
            let batch: Vec<Pending> = self.batching.buffer.drain(..take).collect();
            self.batching.in_flight += 1;
            let work = Arc::clone(&self.settler).settle_batch(batch);
            ctx.spawn(work.into_actor(self).map(move |(), actor, ctx| {
                actor.batching.in_flight -= 1;
                for _ in 0..take {
                    actor.message_done(ctx);
                }
                actor.dispatch_batches(ctx);
            }));
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
        let settler = &self.settler;
        tracing::info!(queue = %settler.queue, consumer = %settler.consumer, "consuming");
    }
}

impl StreamHandler<inbox::lapin::Result<Delivery>> for ConsumerActor {
    fn handle(&mut self, item: inbox::lapin::Result<Delivery>, ctx: &mut Context<Self>) {
        let delivery = match item {
            Ok(delivery) => delivery,
            Err(e) => {
                tracing::warn!(queue = %self.settler.queue, error = %e, "consumer stream error");
                return;
            }
        };
        if self.draining {
            // Left unacked: the broker requeues it when the channel closes.
            return;
        }
        self.in_flight += 1;
        let arrived = Instant::now();
        if self.batching.size == 1 {
            let work = Arc::clone(&self.settler).settle(delivery, arrived);
            ctx.spawn(
                work.into_actor(self)
                    .map(|(), actor, ctx| actor.message_done(ctx)),
            );
            return;
        }
        match self.settler.prepare(delivery, arrived) {
            Ok(pending) => {
                self.batching.buffer.push(pending);
                if !self.batching.flush_scheduled {
                    // Runs once the deliveries that are ready now are buffered.
                    self.batching.flush_scheduled = true;
                    ctx.notify(Flush);
                }
            }
            Err(malformed) => {
                let work = Arc::clone(&self.settler).set_aside(malformed);
                ctx.spawn(
                    work.into_actor(self)
                        .map(|(), actor, ctx| actor.message_done(ctx)),
                );
            }
        }
    }

    fn finished(&mut self, ctx: &mut Context<Self>) {
        if !self.draining {
            // lapin's own recovery gave up, or the broker cancelled the
            // consumer (the queue was deleted): start over.
            tracing::warn!(queue = %self.queue.name, "the broker ended the consumer; reconnecting");
            self.reconnect(ctx);
            return;
        }
        // Stopping now would cancel the messages in flight before their
        // acks: stop once the last one is settled.
        self.stream_ended = true;
        if self.in_flight == 0 {
            ctx.stop();
        }
    }
}

impl ConsumerActor {
    /// Opens a new link with a growing pause between tries, then consumes
    /// from it. Messages still in flight on the old link settle there as
    /// they can; an ack that no longer reaches the broker means a
    /// redelivery, which the inbox skips.
    fn reconnect(&mut self, ctx: &mut Context<Self>) {
        let (settings, queue, old) = (self.settings.clone(), self.queue.clone(), self.connection.clone());
        let opening = async move {
            let _ = old.close(320, "reconnecting".into()).await;
            let mut pause = FIRST_RECONNECT_PAUSE;
            loop {
                match Link::open(&settings, &queue).await {
                    Ok(link) => return link,
                    Err(e) => {
                        tracing::warn!(queue = %queue.name, error = %e, "reconnecting failed; trying again in {pause:?}");
                        tokio::time::sleep(pause).await;
                        pause = (pause * 2).min(MAX_RECONNECT_PAUSE);
                    }
                }
            }
        };
        ctx.spawn(opening.into_actor(self).map(|link, actor, ctx| {
            if actor.draining {
                // Shut down meanwhile: nothing more to consume.
                actix_rt::spawn(async move {
                    let _ = link.connection.close(200, "shutdown".into()).await;
                });
                return;
            }
            actor.connection = link.connection;
            actor.channel = link.channel;
            actor.tag = link.stream.tag();
            let settler = Settler {
                forwarder: link.forwarder,
                ..(*actor.settler).clone()
            };
            actor.settler = Arc::new(settler);
            ctx.add_stream(link.stream);
            tracing::info!(queue = %actor.queue.name, "consuming again");
        }));
    }
}

impl actix::Handler<Flush> for ConsumerActor {
    type Result = ();

    fn handle(&mut self, _: Flush, ctx: &mut Context<Self>) {
        self.batching.flush_scheduled = false;
        self.dispatch_batches(ctx);
    }
}

impl actix::Handler<Disconnect> for ConsumerActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Disconnect, _ctx: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        let connection = Arc::clone(&self.connection);
        Box::pin(async move {
            // Already closed after a drain that finished in time: fine.
            let _ = connection.close(200, "shutdown".into()).await;
        })
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
        let (connection, channel, tag) = (self.connection.clone(), self.channel.clone(), self.tag.clone());
        let queue = self.queue.name.clone();
        let in_flight = self.in_flight;
        Box::pin(
            async move {
                if let Err(e) = channel.basic_cancel(tag, BasicCancelOptions::default()).await {
                    tracing::warn!(%queue, error = %e, "cancelling the consumer failed");
                }
                tracing::info!(%queue, in_flight, "stopped consuming; waiting for messages in flight");
                let _ = drained.await;
                // Whatever is left unacked (deliveries not started) goes back
                // to the queue with the connection.
                if let Err(e) = connection.close(200, "shutdown".into()).await {
                    tracing::debug!(%queue, error = %e, "closing the connection failed");
                }
            }
            .into_actor(self),
        )
    }
}

/// What settling a delivery needs; shared by the queue's messages in flight.
#[derive(Clone)]
struct Settler {
    queue: String,
    consumer: Arc<str>,
    dedup: Addr<DedupActor>,
    forwarder: AmqpPublisher,
    failure: FailureSettings,
    stats: Arc<Stats>,
    database: Arc<DatabaseGate>,
}

/// A decoded delivery waiting for its outcome.
struct Pending {
    delivery: Delivery,
    envelope: Arc<Envelope>,
    history: FailureHistory,
    arrived: Instant,
}

/// A delivery that can never be processed, and why.
struct Malformed {
    delivery: Delivery,
    reason: String,
    stage: &'static str,
    history: FailureHistory,
}

impl Settler {
    /// Checks a delivery's size and decodes it.
    fn prepare(&self, mut delivery: Delivery, arrived: Instant) -> Result<Pending, Box<Malformed>> {
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
                envelope: Arc::new(envelope),
                history,
                arrived,
            }),
            Err(e) => Err(Box::new(Malformed {
                delivery,
                reason: e.to_string(),
                stage: "decode",
                history,
            })),
        }
    }

    /// Runs one delivery through the inbox and the failure policy, and
    /// settles it with the broker.
    async fn settle(self: Arc<Self>, delivery: Delivery, arrived: Instant) {
        match self.prepare(delivery, arrived) {
            Ok(pending) => self.process(pending, None).await,
            Err(malformed) => self.set_aside(malformed).await,
        }
    }

    /// Runs a batch through the inbox in one transaction, then settles each
    /// delivery from its own outcome (a failed one retries alone).
    async fn settle_batch(self: Arc<Self>, batch: Vec<Pending>) {
        if batch.len() == 1 {
            // Alone, it is cheaper without the batch's savepoint.
            for pending in batch {
                self.process(pending, None).await;
            }
            return;
        }
        let deliver = DeliverBatch {
            consumer: Arc::clone(&self.consumer),
            envelopes: batch.iter().map(|p| Arc::clone(&p.envelope)).collect(),
        };
        let outcomes = self.dedup.send(deliver).await.unwrap_or_else(|e| {
            let abandoned = Abandoned::new("dedup actor", e);
            vec![Outcome::Abandoned(abandoned); batch.len()]
        });
        let settled = batch
            .into_iter()
            .zip(outcomes)
            .map(|(pending, outcome)| self.process(pending, Some(outcome)));
        join_all(settled).await;
    }

    /// A malformed delivery: straight to `Q.error`, no handler ran.
    async fn set_aside(self: Arc<Self>, malformed: Box<Malformed>) {
        let Malformed {
            delivery,
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
        self.move_to(&error_queue(&self.queue), &delivery, &delivery.data, &fault)
            .await;
    }

    /// Settles one message: from `first`, the outcome of an attempt already
    /// made (in a batch), or from attempts of its own; failures go through
    /// the immediate retries, then a retry tier or `Q.error`.
    async fn process(&self, pending: Pending, mut first: Option<Outcome>) {
        let Pending {
            delivery,
            envelope,
            mut history,
            arrived,
        } = pending;
        let span = envelope.span.clone();
        async move {
            let mut retry = 0;
            let abandoned: Abandoned = loop {
                tracing::Span::current().record("attempt", history.attempts + 1);
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
                        ack(&delivery, &self.stats).await;
                        self.stats.record_latency(arrived.elapsed());
                        return;
                    }
                    Outcome::Rejected(reason) => {
                        tracing::warn!(%reason, "the body is not the event; moving it to the error queue");
                        // Counted as rejected by the dedup actor.
                        let fault = self.fault(&reason, "deserialize", history);
                        self.move_to(&error_queue(&self.queue), &delivery, &envelope.body, &fault)
                            .await;
                        return;
                    }
                    Outcome::NoHandler => {
                        let reason = format!("no handler registered for type `{}`", envelope.event_type);
                        tracing::warn!("{reason}; moving it to the skipped queue");
                        let fault = self.fault(&reason, "dispatch", history);
                        self.move_to(&skipped_queue(&self.queue), &delivery, &envelope.body, &fault)
                            .await;
                        return;
                    }
                    Outcome::Abandoned(abandoned) if abandoned.unavailable => {
                        // Not the message's fault: hold it (unacked, so the
                        // prefetch stops further deliveries) until the
                        // database answers, and spend none of its attempts.
                        tracing::debug!(reason = %abandoned.reason, "database unavailable; holding the message");
                        self.database.wait_until_available(&abandoned.reason).await;
                        continue;
                    }
                    Outcome::Abandoned(abandoned) => {
                        history.attempts += 1;
                        history.first_failure.get_or_insert_with(inbox::fault::now);
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
                    history.redeliveries += 1;
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
            if self.move_to(&to, &delivery, &envelope.body, &fault).await {
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
    async fn move_to(&self, to: &str, delivery: &Delivery, body: &[u8], fault: &Fault<'_>) -> bool {
        let mut headers = delivery.properties.headers().clone().unwrap_or_default();
        fault.stamp(&mut headers);
        let properties = delivery.properties.clone().with_headers(headers);
        match self.forwarder.publish_raw(to, properties, body).await {
            Ok(()) => {
                ack(delivery, &self.stats).await;
                true
            }
            Err(e) => {
                tracing::error!(error = %e, "could not move the message to {to}; handing it back to the broker");
                tokio::time::sleep(MOVE_FAILED_PAUSE).await;
                let options = BasicNackOptions {
                    requeue: true,
                    ..BasicNackOptions::default()
                };
                check_settled(delivery.acker.nack(options).await, "nack", &self.stats);
                false
            }
        }
    }
}

async fn ack(delivery: &Delivery, stats: &Stats) {
    check_settled(delivery.acker.ack(BasicAckOptions::default()).await, "ack", stats);
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
