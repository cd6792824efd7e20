//! [`DedupActor`]: the inbox itself.
//!
//! Uses the runtime's connections (through their one gate, see
//! `db::Connections`) and owns the inbox store. Receives [`Deliver`] (from
//! a [`ConsumerActor`](crate::actors::consumer::ConsumerActor) or the in-process
//! [`Publisher`](crate::Publisher)); for each message it opens a unit of
//! work, claims the message in the inbox, runs the handlers of the
//! message's type (through their [`Route`], in the message's task; their
//! [`HandlerActor`](crate::actors::handler::HandlerActor) supervises them), and commits
//! or rolls back. It replies with the message's [`Outcome`].
//!
//! Receives [`DeliverBatch`] (a consumer with `batch_size` above 1): claims
//! the batch's messages in one go, runs the handlers on the whole batch
//! (their `handle_batch`), commits once, and replies with an [`Outcome`] per
//! message. If the handlers fail on the batch, it rolls back, claims the
//! batch again and runs each message's handlers on their own, each after a
//! savepoint of its own: a failure rolls back that message only.
//!
//! Receives [`CountRedelivery`] (a consumer whose broker does not limit a
//! message's deliveries): counts one, committed at once, and replies with
//! the count.
//!
//! A unit of work that takes longer than `database.transaction_timeout` is
//! dropped (its connection closed) and its messages are reported as held
//! by an outage; a failed handler whose rollback finds the connection gone
//! is reported the same way. A handler's error alone never is.

use std::collections::HashMap;
use std::future::Future;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::{Duration, Instant};

use actix::prelude::*;
use futures_util::FutureExt;
use metrics::Histogram;
use tokio::sync::Semaphore;
use tracing::Instrument;

use crate::Error;
use crate::UnitOfWork;
use crate::actors::handler::{Handled, HandlerFailure, Route};
use crate::actors::stats::Stats;
use crate::actors::tally::Tally;
use crate::db::Connections;
use crate::envelope::Envelope;
use crate::policy::{Abandoned, Outcome, Stage};
use crate::store::{Claim, DynInboxStore, InboxKey};
use crate::unit_of_work::Outbox;

/// Process one message through the inbox.
#[derive(Debug, Message)]
#[rtype(result = "Outcome")]
pub struct Deliver {
    /// The consumer id: the first half of the dedup key.
    pub consumer: Arc<str>,
    /// The message; shared, since a failed attempt is retried with it.
    pub envelope: Arc<Envelope>,
}

/// Process several messages through the inbox in one transaction.
#[derive(Debug, Message)]
#[rtype(result = "Vec<Outcome>")]
pub struct DeliverBatch {
    /// The consumer id: the first half of the dedup key.
    pub consumer: Arc<str>,
    /// The messages; the reply has one outcome for each, in this order.
    pub envelopes: Vec<Arc<Envelope>>,
    /// How many of this consumer's batches may run their handlers at once
    /// (`queues[].concurrent_batches`).
    pub concurrent_batches: u16,
}

/// Count one more delivery of a message the broker marked redelivered, on
/// a queue whose broker does not limit deliveries; replies with the
/// deliveries so far, the first one included.
#[derive(Debug, Message)]
#[rtype(result = "Result<u32, Abandoned>")]
pub(crate) struct CountRedelivery {
    /// The consumer id: the first half of the key.
    pub(crate) consumer: Arc<str>,
    /// The message.
    pub(crate) message_id: uuid::Uuid,
}

/// Forget the deliveries counted for a message that has left the queue
/// (see `deliveries`).
#[derive(Debug, Message)]
#[rtype(result = "Result<(), Abandoned>")]
pub(crate) struct ForgetDeliveries {
    /// The consumer id: the first half of the key.
    pub(crate) consumer: Arc<str>,
    /// The message.
    pub(crate) message_id: uuid::Uuid,
}

/// The handlers' routes, by event type name.
pub(crate) type Routes = HashMap<String, Route>;

/// Owns the store; runs each message's unit of work on the runtime's connections.
pub struct DedupActor {
    /// The runtime's connections, behind its one gate (which outlives
    /// this actor's restarts).
    connections: Connections,
    /// Given to every unit of work, so that handlers can stage messages.
    outbox: Outbox,
    /// `database.transaction_timeout`: the longest a message's (or a
    /// batch's) unit of work may take.
    transaction_timeout: Duration,
    store: Arc<dyn DynInboxStore>,
    /// Every handled type's route: a consumer's, unless its queue names
    /// its types (`queues[].event_types`).
    routes: Arc<Routes>,
    /// Per consumer id whose queue names its types, those types' routes.
    routes_by_consumer: HashMap<Arc<str>, Arc<Routes>>,
    stats: Arc<Stats>,
    /// Per consumer, the batches that may run their handlers at once
    /// (`queues[].concurrent_batches`, 1 by default); the others may claim
    /// meanwhile, and start once one is committing. Two batches both taking
    /// row locks would deadlock on rows they share in opposite order; one
    /// that only commits takes no new lock, so the other merely waits.
    batch_lanes: HashMap<Arc<str>, Arc<Semaphore>>,
    /// Per consumer id, its queue's `inbox_claim_wait_seconds`.
    claim_waits: HashMap<Arc<str>, Histogram>,
}

impl DedupActor {
    /// An actor over `connections` and `store`, dispatching to `routes`; a
    /// message's unit of work that takes longer than `transaction_timeout`
    /// is abandoned (its connection closed) and the message held as in an
    /// outage.
    pub(crate) fn new(
        connections: Connections,
        store: Arc<dyn DynInboxStore>,
        routes: Routes,
        stats: Arc<Stats>,
        transaction_timeout: Duration,
        outbox: Outbox,
        queues: &[crate::QueueSettings],
    ) -> Self {
        let routes_by_consumer = queues
            .iter()
            .filter(|queue| !queue.event_types.is_empty())
            .map(|queue| {
                let own: Routes = routes
                    .iter()
                    .filter(|(name, _)| queue.event_types.contains(name))
                    .map(|(name, route)| (name.clone(), route.clone()))
                    .collect();
                (queue.consumer_id().into(), Arc::new(own))
            })
            .collect();
        Self {
            connections,
            outbox,
            transaction_timeout,
            store,
            routes: Arc::new(routes),
            routes_by_consumer,
            stats,
            batch_lanes: HashMap::new(),
            claim_waits: queues
                .iter()
                .map(|q| {
                    (
                        q.consumer_id().into(),
                        crate::actors::metrics::claim_wait(&q.name),
                    )
                })
                .collect(),
        }
    }
}

impl std::fmt::Debug for DedupActor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DedupActor")
            .field("event_types", &self.routes.keys().collect::<Vec<_>>())
            .field("transaction_timeout", &self.transaction_timeout)
            .finish_non_exhaustive()
    }
}

impl Actor for DedupActor {
    type Context = Context<Self>;
}

impl Supervised for DedupActor {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        tracing::warn!("dedup actor restarted");
    }
}

impl DedupActor {
    fn work(&mut self, consumer: &Arc<str>) -> Work {
        // A consumer of no configured queue (in process): by its id.
        let claim_wait = match self.claim_waits.get(consumer) {
            Some(histogram) => histogram.clone(),
            None => self
                .claim_waits
                .entry(Arc::clone(consumer))
                .or_insert_with(|| crate::actors::metrics::claim_wait(consumer))
                .clone(),
        };
        Work {
            claim_wait,
            connections: self.connections.clone(),
            outbox: self.outbox.clone(),
            store: Arc::clone(&self.store),
            routes: Arc::clone(self.routes_by_consumer.get(consumer).unwrap_or(&self.routes)),
            stats: Arc::clone(&self.stats),
        }
    }
}

impl actix::Handler<Deliver> for DedupActor {
    // Its own task per message, so up to prefetch messages are in flight
    // at once; the actor itself holds only shared, immutable state.
    type Result = ResponseFuture<Outcome>;

    fn handle(&mut self, msg: Deliver, _ctx: &mut Context<Self>) -> Self::Result {
        let work = self.work(&msg.consumer);
        let span = msg.envelope.span.clone();
        let timeout = self.transaction_timeout;
        // Boxed where it is made: the wrappers then move a pointer, not the
        // unit of work's whole state (some 2 KiB).
        let process = Box::pin(work.process(msg));
        Box::pin(
            async move {
                within_timeout(timeout, process)
                    .await
                    .unwrap_or_else(Outcome::Abandoned)
            }
            .instrument(span),
        )
    }
}

impl actix::Handler<CountRedelivery> for DedupActor {
    type Result = ResponseFuture<Result<u32, Abandoned>>;

    fn handle(&mut self, msg: CountRedelivery, _ctx: &mut Context<Self>) -> Self::Result {
        let connections = self.connections.clone();
        let timeout = self.transaction_timeout;
        Box::pin(async move {
            let counting = crate::deliveries::count_redelivery(&connections, &msg.consumer, msg.message_id);
            within_timeout(timeout, counting)
                .await?
                .map_err(|e| Abandoned::database(Stage::DeliveryLimit, &e))
        })
    }
}

impl actix::Handler<ForgetDeliveries> for DedupActor {
    type Result = ResponseFuture<Result<(), Abandoned>>;

    fn handle(&mut self, msg: ForgetDeliveries, _ctx: &mut Context<Self>) -> Self::Result {
        let connections = self.connections.clone();
        let timeout = self.transaction_timeout;
        Box::pin(async move {
            let forgetting = crate::deliveries::forget(&connections, &msg.consumer, msg.message_id);
            within_timeout(timeout, forgetting)
                .await?
                .map_err(|e| Abandoned::database(Stage::DeliveryLimit, &e))
        })
    }
}

impl actix::Handler<DeliverBatch> for DedupActor {
    type Result = ResponseFuture<Vec<Outcome>>;

    fn handle(&mut self, msg: DeliverBatch, _ctx: &mut Context<Self>) -> Self::Result {
        let work = self.work(&msg.consumer);
        let stats = Arc::clone(&self.stats);
        let size = msg.envelopes.len();
        let lane = Arc::clone(
            self.batch_lanes
                .entry(Arc::clone(&msg.consumer))
                .or_insert_with(|| Arc::new(Semaphore::new(usize::from(msg.concurrent_batches)))),
        );
        let timeout = self.transaction_timeout;
        // Boxed where it is made, as a message's unit of work is.
        let batch = Box::pin(work.process_batch(msg, lane));
        Box::pin(
            async move {
                let outcomes = match within_timeout(timeout, batch).await {
                    Ok(outcomes) => outcomes,
                    Err(abandoned) => vec![Outcome::Abandoned(abandoned); size],
                };
                stats.add(Tally::Batches);
                outcomes
            }
            .instrument(tracing::info_span!("batch", size)),
        )
    }
}

/// Runs `work` (one message's or one batch's), turning a panic into an
/// abandonment, and one past `timeout` too: dropped, the unit of work
/// closes its connection, and the message is held as in an outage, since a
/// network that drops packets looks just like this. (If the database
/// answers at once after all, the holds count as attempts: see `settle`.)
async fn within_timeout<T>(timeout: Duration, work: impl Future<Output = T>) -> Result<T, Abandoned> {
    match tokio::time::timeout(timeout, AssertUnwindSafe(work).catch_unwind()).await {
        Ok(Ok(done)) => Ok(done),
        Ok(Err(_)) => Err(Abandoned::new(Stage::Runtime, "panicked")),
        Err(_) => Err(Abandoned {
            stage: Stage::Transaction,
            reason: format!(
                "no outcome within {timeout:?} (database.transaction_timeout): abandoned, its connection closed"
            ),
            unavailable: true,
        }),
    }
}

/// What processing needs, taken from the actor.
pub(crate) struct Work {
    /// The claim's duration: the wait on a concurrent copy's row lock.
    pub(crate) claim_wait: Histogram,
    pub(crate) connections: Connections,
    pub(crate) outbox: Outbox,
    pub(crate) store: Arc<dyn DynInboxStore>,
    pub(crate) routes: Arc<Routes>,
    pub(crate) stats: Arc<Stats>,
}

impl Work {
    pub(crate) async fn begin(&self) -> Result<UnitOfWork, Abandoned> {
        let connection = self
            .connections
            .get()
            .await
            .map_err(|e| Abandoned::database(Stage::Database, &Error::client(e)))?;
        let uow = UnitOfWork::begin(connection)
            .await
            .map_err(|e| Abandoned::database(Stage::Begin, &e))?;
        Ok(uow.with_outbox(self.outbox.clone()))
    }

    async fn process(self, Deliver { consumer, envelope }: Deliver) -> Outcome {
        let Some(route) = self.routes.get(&envelope.event_type) else {
            return Outcome::NoHandler {
                event_type: envelope.event_type.clone(),
            };
        };
        let key = key(&consumer, &envelope);
        let mut uow = match self.begin().await {
            Ok(uow) => uow,
            Err(abandoned) => return Outcome::Abandoned(abandoned),
        };
        let claiming = Instant::now();
        let claim = self.store.try_begin(&mut uow, &key).await;
        self.claim_wait.record(claiming.elapsed().as_secs_f64());
        match claim {
            Ok(Claim::Proceed) => {}
            Ok(Claim::Duplicate) => {
                let _ = roll_back(uow).await;
                return Outcome::Duplicate;
            }
            Err(e) => return Outcome::Abandoned(give_up(uow, Stage::InboxClaim, &e).await),
        }
        match self.handle_every_type(route, envelope, uow).await {
            Handled::Done(mut uow) => {
                if let Err(e) = self.store.complete(&mut uow, &key).await {
                    return Outcome::Abandoned(give_up(uow, Stage::InboxRecord, &e).await);
                }
                // Ack only after this: a failed COMMIT leaves the message
                // for redelivery.
                match uow.commit().await {
                    Ok(()) => Outcome::Completed,
                    Err(e) => Outcome::Abandoned(Abandoned::database(Stage::Commit, &e)),
                }
            }
            Handled::Failed { uow, failure } => {
                // Alone in its transaction, the message is rolled back whole,
                // staged inbox record included.
                let mut outcome = Outcome::from(failure);
                if let Some(uow) = uow
                    && let Err(lost) = roll_back(uow).await
                    && let Outcome::Abandoned(abandoned) = &mut outcome
                {
                    // The runtime's own connection failed under the
                    // handler: the database, not the message, is what
                    // failed. (A handler's error alone never says so: its
                    // I/O error may be a refused HTTP call.)
                    abandoned.unavailable = lost.unavailable;
                }
                outcome
            }
        }
    }
}

impl Work {
    /// Runs the handlers of `envelope`'s type on `route`, then, for a
    /// MassTransit message that lists more of the types handlers are
    /// registered for (its class, base classes, interfaces), those of each
    /// of them in the order listed, every one reading the message as its
    /// own type, all in the one unit of work: as MassTransit runs every
    /// consumer whose type the message lists (MT/Middleware/MessageTypeFilter.cs).
    /// The first failure stops the others, and the message fails whole.
    async fn handle_every_type(&self, route: &Route, envelope: Arc<Envelope>, uow: UnitOfWork) -> Handled {
        let others: Vec<(&String, &Route)> = match &envelope.masstransit {
            Some(context) => {
                let mut others = Vec::new();
                for name in &context.message_types {
                    if *name != envelope.event_type
                        && !others.iter().any(|(other, _)| *other == name)
                        && let Some(route) = self.routes.get(name)
                    {
                        others.push((name, route));
                    }
                }
                others
            }
            None => Vec::new(),
        };
        let mut handled = Arc::clone(route).run(vec![Arc::clone(&envelope)], uow).await;
        for (name, route) in others {
            let Handled::Done(uow) = handled else {
                break;
            };
            // The message as this type: its handlers' context names it.
            let mut as_type = (*envelope).clone();
            as_type.event_type = name.clone();
            handled = Arc::clone(route).run(vec![Arc::new(as_type)], uow).await;
        }
        handled
    }
}

pub(crate) fn key(consumer: &str, envelope: &Envelope) -> InboxKey {
    InboxKey {
        consumer: consumer.to_owned(),
        message_id: envelope.message_id,
        event_type: envelope.event_type.clone(),
    }
}

impl From<HandlerFailure> for Outcome {
    fn from(failure: HandlerFailure) -> Self {
        match failure {
            HandlerFailure::Malformed(reason) => Outcome::Rejected {
                stage: Stage::Deserialize,
                reason,
            },
            HandlerFailure::Permanent {
                handler,
                event_type,
                reason,
            } => Outcome::Rejected {
                stage: Stage::Handler {
                    name: handler,
                    event_type,
                },
                reason,
            },
            HandlerFailure::Failed {
                handler,
                event_type,
                error,
            } => Outcome::Abandoned(Abandoned::new(
                Stage::Handler {
                    name: handler,
                    event_type,
                },
                error,
            )),
            HandlerFailure::Panicked {
                handler,
                event_type,
                message,
            } => Outcome::Abandoned(Abandoned::new(
                Stage::Handler {
                    name: handler,
                    event_type,
                },
                format!("panicked: {message}"),
            )),
            HandlerFailure::Stopped { event_type } => Outcome::Abandoned(Abandoned::new(
                Stage::HandlerCall,
                format!("the handler actor of `{event_type}` has stopped"),
            )),
        }
    }
}

/// Ends `uow` after its own statement failed with `error`: rolled back, or,
/// when the error says the database cannot take writes now (a read-only
/// server, one shutting down), discarded with its connection, which must
/// not serve the next message.
pub(crate) async fn give_up(uow: UnitOfWork, stage: Stage, error: &crate::Error) -> Abandoned {
    let abandoned = Abandoned::database(stage, error);
    if abandoned.unavailable {
        drop(uow);
    } else {
        let _ = roll_back(uow).await;
    }
    abandoned
}

/// Rolls back; a failure there already discarded the connection, which is
/// all a rollback could do more, so it is only logged, and returned
/// classified (a lost connection is an outage).
pub(crate) async fn roll_back(uow: UnitOfWork) -> Result<(), Abandoned> {
    uow.rollback().await.map_err(|e| {
        tracing::warn!(error = %e, "rollback failed; the connection was discarded");
        Abandoned::database(Stage::Rollback, &e)
    })
}
