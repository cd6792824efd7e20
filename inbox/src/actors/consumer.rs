//! [`ConsumerActor`]: one RabbitMQ queue.
//!
//! Owns the queue's connection, channel and lapin consumer stream. Decodes
//! each delivery into an envelope and sends [`Deliver`](crate::Deliver) to
//! the [`DedupActor`], up to the queue's prefetch at
//! once, then settles the delivery from the [`Outcome`](crate::Outcome)
//! (the failure policy lives in `settle.rs`):
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
//! sent as one [`DeliverBatch`](crate::DeliverBatch); each delivery is settled from its own
//! outcome, after the batch's commit: the completed ones are acked and free
//! the batch's slot, and a member that failed leaves the batch and takes
//! its failure path (retries, a retry tier) on its own. A delivery that
//! failed before (back from a retry tier) never joins a batch. A batch
//! fills up to `batch_size`; a
//! partial one is sent only when no other batch of the queue is in flight
//! (meanwhile, more deliveries arrive to fill it), and at most
//! `prefetch / batch_size` batches are in flight at once.
//!
//! A move publishes the copy, with its [fault headers](crate::fault), and
//! waits for the broker's confirm before acking the original: a crash in
//! between leaves a duplicate for the inbox to skip, never a loss.
//! Receives [`Drain`] at shutdown: stops consuming, waits for the
//! messages in flight and closes its connection; [`Disconnect`] when
//! the shutdown timeout is up: closes it at once; and [`Pause`] from the
//! operator actor: stops consuming (the messages in flight finish) until
//! told to resume, which consumes over a new link.
//!
//! The queue has a connection of its own ([`Link`]), and this actor is the
//! one owner of its reconnection (lapin's own recovery is off: with both,
//! a connection lapin recovered behind a new one would consume deliveries
//! nobody settles). When the connection fails or closes (a network fault,
//! a broker restart), the consumer ends (the queue was deleted, the broker
//! cancelled it), the broker closes its channel (a delivery unacked past
//! RabbitMQ's `consumer_timeout`), or a handshake hangs past
//! `message_bus.connect_timeout` (a watchdog), the actor reconnects with a
//! growing pause, declares the topology again and consumes anew. Deliveries
//! of the lost channel that wait in the batch buffer are dropped (the broker
//! redelivers them), and every delivery settles on its own channel's window
//! only.

use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures_util::FutureExt;
use futures_util::future::{LocalBoxFuture, ready};
use futures_util::stream::{self, FuturesUnordered, Stream, StreamExt};
use lapin::message::Delivery;
use lapin::options::BasicCancelOptions;
use lapin::types::ShortString;
use lapin::{Channel, Connection, Consumer};
use tokio::sync::oneshot;

use crate::actors::availability::DatabaseGate;
use crate::actors::dedup::DedupActor;
use crate::actors::link::Link;
use crate::actors::metrics::QueueMetrics;
use crate::actors::settle::{Dialect, Leaver, Pending, Settler};
use crate::actors::stats::Stats;
use crate::{QueueSettings, Settings};

/// Stop consuming and resolve once no message is in flight.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Drain;

/// Close the connection now, whatever is still in flight (shutdown past its
/// timeout): unacked messages go back to the queue.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Disconnect;

/// Send the buffered deliveries as batches (sent to itself once the
/// deliveries that were ready together have all been buffered).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Flush;

/// What a consumer says of itself to the runtime's health.
pub(crate) struct ConsumerFlags {
    /// Connected and consuming.
    pub(crate) connected: Arc<AtomicBool>,
    /// Paused by an operator.
    pub(crate) paused: Arc<AtomicBool>,
}

/// Stop consuming (`Pause(true)`) until told to resume (`Pause(false)`):
/// an operator paused the queue.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Pause(pub(crate) bool);

/// Consumes one queue.
pub(crate) struct ConsumerActor {
    settler: Arc<Settler>,
    /// What reconnecting needs: the broker's address and the topology.
    settings: Settings,
    queue: QueueSettings,
    /// The queue's own connection, so that it can reconnect on its own.
    connection: Arc<Connection>,
    channel: Channel,
    tag: ShortString,
    stream: Option<Consumer>,
    /// Which link the connection, channel and stream belong to: counts the
    /// reconnects, so that the end of an abandoned link's stream is ignored.
    link: u64,
    /// A new link is being opened.
    reconnecting: bool,
    /// Since when the connection has been down (a handshake under way), as
    /// last seen by the watchdog.
    down_since: Option<Instant>,
    in_flight: usize,
    /// Whether this consumer is connected and consuming, for the runtime's
    /// health.
    connected: Arc<AtomicBool>,
    metrics: Arc<QueueMetrics>,
    draining: bool,
    /// Paused by an operator: not consuming, not reconnecting.
    paused: bool,
    /// Says so to the runtime's health.
    paused_flag: Arc<AtomicBool>,
    drained: Vec<oneshot::Sender<()>>,
    stream_ended: bool,
    batching: Batching,
    /// The deliveries being settled: a future for each, or for each batch.
    /// One item of the actor's context, [`SettleAll`], polls them. Were
    /// each an item of its own, actix would poll every one of them at
    /// every wake of the actor (a reply, an ack, a delivery), up to
    /// prefetch polls for each; in a set, only the woken ones are polled.
    settling: FuturesUnordered<LocalBoxFuture<'static, Settled>>,
    /// Wakes [`SettleAll`] after a push: the set polls a new future only
    /// when it is polled itself.
    settling_waker: Option<Waker>,
}

/// What a settling future reports when it ends.
enum Settled {
    /// A delivery settled on its own.
    One,
    /// A batch of `size` ran; `leavers`, the members that did not complete
    /// in it, settle on their own now.
    Batch { size: usize, leavers: Vec<Leaver> },
}

/// The batch buffer of a consumer with `batch_size` above 1.
struct Batching {
    size: usize,
    max_in_flight: usize,
    in_flight: usize,
    buffer: Vec<Pending>,
    flush_scheduled: bool,
}

/// How long after a consumer stream error to look whether lapin is
/// recovering the channel, or the broker closed it for good.
const CHANNEL_CHECK_PAUSE: Duration = Duration::from_secs(1);
/// How often the watchdog looks at the connection.
const WATCHDOG_EVERY: Duration = Duration::from_secs(1);

/// An item of a link's consumer stream, tagged with the link.
struct Consumed {
    link: u64,
    /// `None` marks the end of the stream: the consumer was cancelled, by
    /// the runtime at shutdown or by the broker.
    delivery: Option<lapin::Result<Delivery>>,
}

/// `stream` with each item tagged with `link`, and an end marker.
fn tagged(stream: Consumer, link: u64) -> impl Stream<Item = Consumed> {
    stream
        .map(move |delivery| Consumed {
            link,
            delivery: Some(delivery),
        })
        .chain(stream::once(ready(Consumed { link, delivery: None })))
}

impl ConsumerActor {
    /// An actor consuming `queue` over `link`.
    pub(crate) fn new(
        settings: &Settings,
        queue: &QueueSettings,
        link: Link,
        dedup: Addr<DedupActor>,
        stats: Arc<Stats>,
        database: Arc<DatabaseGate>,
        flags: ConsumerFlags,
    ) -> Self {
        let ConsumerFlags { connected, paused } = flags;
        let metrics = Arc::new(QueueMetrics::new(&queue.name));
        let settler = Settler {
            queue: queue.name.clone(),
            consumer: queue.consumer_id().into(),
            dedup,
            forwarder: link.forwarder,
            failure: queue.failure_policy(&settings.failure),
            stats,
            metrics: Arc::clone(&metrics),
            database,
            concurrent_batches: queue.concurrent_batches,
            window: Arc::default(),
            dialect: Dialect::of(settings, queue, link.handled.clone()),
            counts_redeliveries: !link.broker_limits_deliveries,
            delivery_limit: link.delivery_limit,
        };
        let size = usize::from(queue.batch_limit());
        Self {
            settler: Arc::new(settler),
            settings: settings.clone(),
            queue: queue.clone(),
            connection: link.connection,
            channel: link.channel,
            tag: link.stream.tag(),
            stream: Some(link.stream),
            link: 0,
            reconnecting: false,
            down_since: None,
            in_flight: 0,
            connected,
            metrics,
            draining: false,
            paused: false,
            paused_flag: paused,
            drained: Vec::new(),
            stream_ended: false,
            settling: FuturesUnordered::new(),
            settling_waker: None,
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
    /// are running: full ones, or a partial one when none is running.
    fn dispatch_batches(&mut self) {
        while !self.batching.buffer.is_empty() && self.batching.in_flight < self.batching.max_in_flight {
            let take = self.batching.buffer.len().min(self.batching.size);
            if take < self.batching.size && self.batching.in_flight > 0 {
                // Fuller batches, fewer commits: while a batch runs, the
                // prefetch window lets more deliveries arrive to fill this
                // one. Once none runs, it goes as it is.
                break;
            }
            let batch: Vec<Pending> = self.batching.buffer.drain(..take).collect();
            self.batching.in_flight += 1;
            let work = Arc::clone(&self.settler).settle_batch(batch);
            self.start_settling(work.map(move |leavers| Settled::Batch { size: take, leavers }));
        }
    }

    /// Starts `work`, one message's settling: the message is done when it
    /// ends.
    fn start_message(&mut self, work: impl Future<Output = ()> + 'static) {
        self.start_settling(work.map(|()| Settled::One));
    }

    /// Adds `work` to the futures [`SettleAll`] polls, boxed: one
    /// allocation per message, of the settling's whole state (about
    /// 800 bytes: see `Settler::settle`).
    fn start_settling(&mut self, work: impl Future<Output = Settled> + 'static) {
        self.settling.push(Box::pin(work));
        // Always: when the push comes from an item that actix polls after
        // `SettleAll` in this pass (a reconnected link's stream), nothing
        // else would poll the new future before the watchdog's next tick.
        if let Some(waker) = &self.settling_waker {
            waker.wake_by_ref();
        }
    }

    /// Accounts for a settling future that ended.
    fn settled(&mut self, settled: Settled, ctx: &mut Context<Self>) {
        match settled {
            Settled::One => self.message_done(ctx),
            Settled::Batch { size, leavers } => {
                // The batch's slot is free once its completed members are
                // acked; those that failed settle on their own, each
                // holding only its own delivery.
                self.batching.in_flight -= 1;
                for _ in leavers.len()..size {
                    self.message_done(ctx);
                }
                for leaver in leavers {
                    let work = Arc::clone(&self.settler).settle_leaver(leaver);
                    self.start_message(work);
                }
                self.dispatch_batches();
            }
        }
    }

    fn message_done(&mut self, ctx: &mut Context<Self>) {
        self.in_flight -= 1;
        self.metrics.in_flight.decrement(1.0);
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
            ctx.add_stream(tagged(stream, self.link));
        }
        ctx.spawn(SettleAll);
        let settler = &self.settler;
        tracing::info!(queue = %settler.queue, consumer = %settler.consumer, "consuming");
        self.set_connected(true);
        ctx.run_interval(WATCHDOG_EVERY, |actor, ctx| actor.watch_connection(ctx));
    }
}

/// The one item of a consumer's context that polls its settling futures
/// (see [`ConsumerActor::settling`]); it lasts as long as the actor.
struct SettleAll;

impl ActorFuture<ConsumerActor> for SettleAll {
    type Output = ();

    fn poll(
        self: Pin<&mut Self>,
        actor: &mut ConsumerActor,
        ctx: &mut Context<ConsumerActor>,
        task: &mut std::task::Context<'_>,
    ) -> Poll<()> {
        if !actor
            .settling_waker
            .as_ref()
            .is_some_and(|waker| waker.will_wake(task.waker()))
        {
            actor.settling_waker = Some(task.waker().clone());
        }
        // `None` once the set is empty; a push wakes this again.
        while let Poll::Ready(Some(settled)) = actor.settling.poll_next_unpin(task) {
            actor.settled(settled, ctx);
        }
        Poll::Pending
    }
}

impl StreamHandler<Consumed> for ConsumerActor {
    fn handle(&mut self, item: Consumed, ctx: &mut Context<Self>) {
        let delivery = match item.delivery {
            Some(Ok(delivery)) => delivery,
            Some(Err(e)) => {
                tracing::warn!(queue = %self.settler.queue, error = %e, "consumer stream error");
                if item.link == self.link {
                    ctx.run_later(CHANNEL_CHECK_PAUSE, move |actor, ctx| {
                        actor.check_channel(item.link, ctx)
                    });
                }
                return;
            }
            None => {
                if item.link == self.link {
                    self.on_stream_end(ctx);
                }
                return;
            }
        };
        if item.link != self.link {
            // Late from an abandoned link, whose connection is closing: the
            // broker requeues it. (Its tags mean nothing on the new channel.)
            return;
        }
        // Every delivery, handled or not: a `multiple` ack must not pass it.
        let ticket = self.settler.window.track(&delivery);
        if self.draining {
            // Left unacked: the broker requeues it when the channel closes.
            return;
        }
        self.in_flight += 1;
        self.metrics.in_flight.increment(1.0);
        let arrived = Instant::now();
        if self.batching.size == 1 {
            let work = Arc::clone(&self.settler).settle(delivery, ticket, arrived);
            self.start_message(work);
            return;
        }
        match self.settler.prepare(delivery, ticket, arrived) {
            Ok(pending) if self.settler.settles_alone(&pending) => {
                let work = Arc::clone(&self.settler).settle_prepared(pending);
                self.start_message(work);
            }
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
                self.start_message(work);
            }
        }
    }

    fn finished(&mut self, _ctx: &mut Context<Self>) {
        // Every stream ends with a `Consumed` without a delivery, handled
        // above; the default would stop the actor.
    }
}

impl ConsumerActor {
    /// Says whether this consumer is connected and consuming: to the
    /// runtime's health and to the `inbox_consumer_connected` gauge.
    fn set_connected(&self, connected: bool) {
        self.connected.store(connected, Ordering::Relaxed);
        self.metrics.connected.set(if connected { 1.0 } else { 0.0 });
    }

    /// The current link's consumer stream ended.
    fn on_stream_end(&mut self, ctx: &mut Context<Self>) {
        if self.paused && !self.draining {
            tracing::debug!(queue = %self.queue.name, "the paused consumer's stream ended");
            return;
        }
        if !self.draining {
            // The connection was lost, or the broker cancelled the
            // consumer (the queue was deleted, a node went): start over.
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

    /// A while after a stream error on `link`: a channel the broker closed
    /// by itself (a delivery unacked past its `consumer_timeout`, an unknown
    /// delivery tag) leaves a consumer gone for good whose stream may never
    /// end, so start over.
    fn check_channel(&mut self, link: u64, ctx: &mut Context<Self>) {
        let status = self.channel.status();
        if link == self.link
            && !self.draining
            && !self.paused
            && !status.connected()
            && !status.reconnecting()
        {
            tracing::warn!(queue = %self.queue.name, "the broker closed the consumer's channel; reconnecting");
            self.reconnect(ctx);
        }
    }

    /// The watchdog: a connection that closed or failed without its stream
    /// saying so is replaced at once; and a handshake with a broker whose
    /// packets vanish waits forever, with neither an error nor an end on the
    /// consumer stream, so a connection down for longer than
    /// `message_bus.connect_timeout` is given up too.
    fn watch_connection(&mut self, ctx: &mut Context<Self>) {
        self.set_connected(
            !self.draining
                && !self.paused
                && !self.reconnecting
                && self.connection.status().connected()
                && self.channel.status().connected(),
        );
        if self.draining || self.paused || self.reconnecting || self.connection.status().connected() {
            self.down_since = None;
            return;
        }
        let status = self.connection.status();
        if status.closed() || status.errored() {
            tracing::warn!(queue = %self.queue.name, broker = %self.settings.broker_endpoint(), "the broker connection is lost; reconnecting");
            self.down_since = None;
            self.reconnect(ctx);
            return;
        }
        let since = *self.down_since.get_or_insert_with(Instant::now);
        let patience = self.settings.message_bus.connect_timeout;
        if since.elapsed() > patience {
            tracing::warn!(
                queue = %self.queue.name,
                broker = %self.settings.broker_endpoint(),
                "the broker connection has been down for over {patience:?} without recovering; reconnecting"
            );
            self.down_since = None;
            self.reconnect(ctx);
        }
    }

    /// Opens a new link with a growing pause between tries, then consumes
    /// from it. Messages still in flight on the old link settle there as
    /// they can; an ack that no longer reaches the broker means a
    /// redelivery, which the inbox skips.
    fn reconnect(&mut self, ctx: &mut Context<Self>) {
        // From here on, what the old link's stream says is of no concern.
        self.link += 1;
        self.reconnecting = true;
        self.set_connected(false);
        // Buffered deliveries of the old link can no longer be acked: its
        // connection closes below and the broker redelivers them on the new
        // one (the inbox skips whatever of them committed meanwhile).
        // Batches already running settle on the old link's window, each
        // with its own settler.
        let stale = std::mem::take(&mut self.batching.buffer);
        if !stale.is_empty() {
            tracing::info!(queue = %self.queue.name, deliveries = stale.len(), "dropping buffered deliveries of the lost channel; the broker redelivers them");
        }
        for _ in stale {
            self.message_done(ctx);
        }
        let (settings, queue, old) = (self.settings.clone(), self.queue.clone(), self.connection.clone());
        let types = self.settler.dialect.handled.clone();
        let opening = async move { Link::reopen(&settings, &queue, types, &old).await };
        ctx.spawn(opening.into_actor(self).map(|link, actor, ctx| {
            actor.reconnecting = false;
            if actor.draining || actor.paused {
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
                window: Arc::default(),
                counts_redeliveries: !link.broker_limits_deliveries,
                delivery_limit: link.delivery_limit,
                ..(*actor.settler).clone()
            };
            actor.settler = Arc::new(settler);
            ctx.add_stream(tagged(link.stream, actor.link));
            actor.set_connected(true);
            tracing::info!(queue = %actor.queue.name, "consuming again");
        }));
    }
}

impl actix::Handler<Flush> for ConsumerActor {
    type Result = ();

    fn handle(&mut self, _: Flush, _ctx: &mut Context<Self>) {
        self.batching.flush_scheduled = false;
        self.dispatch_batches();
    }
}

impl actix::Handler<Pause> for ConsumerActor {
    type Result = ();

    fn handle(&mut self, Pause(pause): Pause, ctx: &mut Context<Self>) {
        if pause == self.paused || self.draining {
            return;
        }
        self.paused = pause;
        self.paused_flag.store(pause, Ordering::Relaxed);
        let queue = self.queue.name.clone();
        if !pause {
            tracing::info!(%queue, "an operator resumed the queue: consuming again");
            // A link being opened consumes once open; else a new one.
            if !self.reconnecting {
                self.reconnect(ctx);
            }
            return;
        }
        tracing::warn!(%queue, in_flight = self.in_flight, "an operator paused the queue: consuming stops, the messages in flight finish");
        self.set_connected(false);
        let (channel, tag) = (self.channel.clone(), self.tag.clone());
        ctx.spawn(
            async move {
                if let Err(e) = channel.basic_cancel(tag, BasicCancelOptions::default()).await {
                    // The channel is gone: so is the consumer.
                    tracing::debug!(%queue, error = %e, "cancelling the paused consumer failed");
                }
            }
            .into_actor(self),
        );
    }
}

impl actix::Handler<Disconnect> for ConsumerActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: Disconnect, _ctx: &mut Context<Self>) -> Self::Result {
        self.draining = true;
        self.set_connected(false);
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
        self.set_connected(false);
        let (done, drained) = oneshot::channel();
        if self.in_flight == 0 {
            let _ = done.send(());
        } else {
            self.drained.push(done);
        }
        let (connection, channel, tag) = (self.connection.clone(), self.channel.clone(), self.tag.clone());
        let queue = self.queue.name.clone();
        let in_flight = self.in_flight;
        // Paused: cancelled already.
        let paused = self.paused;
        Box::pin(
            async move {
                if let Err(e) = channel.basic_cancel(tag, BasicCancelOptions::default()).await
                    && !paused
                {
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
