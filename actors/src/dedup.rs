//! [`DedupActor`]: the inbox itself.
//!
//! Owns the connection pool and the inbox store. Receives [`Deliver`] (from
//! a [`ConsumerActor`](crate::ConsumerActor) or the in-process
//! [`Publisher`](crate::Publisher)); for each message it opens a unit of
//! work, claims the message in the inbox, sends [`Handle`] to the
//! [`HandlerActor`](crate::HandlerActor) of the message's type, and commits
//! or rolls back. It replies with the message's [`Outcome`].

use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures_util::FutureExt;
use inbox::deadpool_postgres::Pool;
use inbox::{Claim, DynInboxStore, Envelope, InboxKey, UnitOfWork};
use tracing::Instrument;

use crate::handler::{Handle, Handled, HandlerFailure};
use crate::stats::{Counter, Stats};

/// Process one message through the inbox.
#[derive(Message)]
#[rtype(result = "Outcome")]
pub struct Deliver {
    /// The consumer id: the first half of the dedup key.
    pub consumer: Arc<str>,
    /// The message; shared, since a failed attempt is retried with it.
    pub envelope: Arc<Envelope>,
}

/// What became of a [`Deliver`]ed message; the consumer settles the delivery
/// with the broker accordingly.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The handlers ran and their writes committed with the inbox row: ack.
    Completed,
    /// Processed before: the handlers were skipped. Ack.
    Duplicate,
    /// Not processed, nothing committed; it can succeed later (a handler
    /// failed or panicked, the database was unavailable): retry it.
    Abandoned(Abandoned),
    /// Can never be processed as it is (its body is not the event): to the
    /// error queue, without retries.
    Rejected(String),
    /// No handler is registered for its type: to the skipped queue.
    NoHandler,
}

/// Why a message was abandoned.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Abandoned {
    /// Where it failed: a handler's name, or a runtime stage such as
    /// `inbox claim` or `commit`.
    pub stage: String,
    /// The error, as text.
    pub reason: String,
}

impl Abandoned {
    fn new(stage: impl Into<String>, reason: impl ToString) -> Self {
        Self {
            stage: stage.into(),
            reason: reason.to_string(),
        }
    }
}

/// The handler actors, by event type name.
pub type Routes = HashMap<String, Recipient<Handle>>;

/// Owns the pool and the store; runs each message's unit of work.
pub struct DedupActor {
    pool: Pool,
    store: Arc<dyn DynInboxStore>,
    routes: Arc<Routes>,
    lock_timeout: Duration,
    stats: Arc<Stats>,
}

impl DedupActor {
    /// An actor over `pool` and `store`, dispatching to `routes`.
    pub fn new(
        pool: Pool,
        store: Arc<dyn DynInboxStore>,
        routes: Routes,
        lock_timeout: Duration,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            pool,
            store,
            routes: Arc::new(routes),
            lock_timeout,
            stats,
        }
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

impl actix::Handler<Deliver> for DedupActor {
    // Its own task per message, so up to prefetch messages are in flight
    // at once; the actor itself holds only shared, immutable state.
    type Result = ResponseFuture<Outcome>;

    fn handle(&mut self, msg: Deliver, _ctx: &mut Context<Self>) -> Self::Result {
        let work = Work {
            pool: self.pool.clone(),
            store: Arc::clone(&self.store),
            route: self.routes.get(&msg.envelope.event_type).cloned(),
            lock_timeout: self.lock_timeout,
        };
        let stats = Arc::clone(&self.stats);
        let span = msg.envelope.span.clone();
        Box::pin(
            async move {
                let outcome = AssertUnwindSafe(work.process(msg))
                    .catch_unwind()
                    .await
                    .unwrap_or_else(|_| Outcome::Abandoned(Abandoned::new("runtime", "panicked")));
                record(&stats, &outcome);
                outcome
            }
            .instrument(span),
        )
    }
}

/// What one message's processing needs, taken from the actor.
struct Work {
    pool: Pool,
    store: Arc<dyn DynInboxStore>,
    route: Option<Recipient<Handle>>,
    lock_timeout: Duration,
}

impl Work {
    async fn process(self, Deliver { consumer, envelope }: Deliver) -> Outcome {
        let Some(route) = self.route else {
            return Outcome::NoHandler;
        };
        let key = InboxKey {
            consumer: consumer.to_string(),
            message_id: envelope.message_id,
            event_type: envelope.event_type.clone(),
        };
        let connection = match self.pool.get().await {
            Ok(connection) => connection,
            Err(e) => return Outcome::Abandoned(Abandoned::new("database", e)),
        };
        let mut uow = match UnitOfWork::begin(connection, self.lock_timeout).await {
            Ok(uow) => uow,
            Err(e) => return Outcome::Abandoned(Abandoned::new("begin", e)),
        };
        match self.store.try_begin(&mut uow, &key).await {
            Ok(Claim::Proceed) => {}
            Ok(Claim::Duplicate) => {
                roll_back(uow).await;
                return Outcome::Duplicate;
            }
            Err(e) => {
                roll_back(uow).await;
                return Outcome::Abandoned(Abandoned::new("inbox claim", e));
            }
        }
        let failure = match route.send(Handle { envelope, uow }).await {
            Ok(Handled::Done(mut uow)) => {
                if let Err(e) = self.store.complete(&mut uow, &key).await {
                    roll_back(uow).await;
                    return Outcome::Abandoned(Abandoned::new("inbox record", e));
                }
                // Ack only after this: a failed COMMIT leaves the message
                // for redelivery.
                return match uow.commit().await {
                    Ok(()) => Outcome::Completed,
                    Err(e) => Outcome::Abandoned(Abandoned::new("commit", e)),
                };
            }
            Ok(Handled::Failed { uow, failure }) => {
                if let Some(mut uow) = uow {
                    if let Err(e) = self.store.abandon(&mut uow, &key).await {
                        tracing::warn!(error = %e, "inbox store failed to abandon the message");
                    }
                    roll_back(uow).await;
                }
                failure
            }
            // The unit of work went down with the message: its connection
            // was discarded.
            Err(e) => return Outcome::Abandoned(Abandoned::new("handler actor", e)),
        };
        match failure {
            HandlerFailure::Malformed(reason) => Outcome::Rejected(reason),
            HandlerFailure::Failed { handler, error } => Outcome::Abandoned(Abandoned::new(handler, error)),
            HandlerFailure::Panicked { handler, message } => {
                Outcome::Abandoned(Abandoned::new(handler, format!("panicked: {message}")))
            }
        }
    }
}

/// Rolls back; a failure there already discarded the connection, which is
/// all a rollback could do more, so it is only logged.
async fn roll_back(uow: UnitOfWork) {
    if let Err(e) = uow.rollback().await {
        tracing::warn!(error = %e, "rollback failed; the connection was discarded");
    }
}

fn record(stats: &Stats, outcome: &Outcome) {
    let counter = match outcome {
        Outcome::Completed => Counter::Completed,
        Outcome::Duplicate => Counter::Duplicates,
        Outcome::Abandoned(_) => Counter::Abandoned,
        Outcome::Rejected(_) => Counter::Rejected,
        Outcome::NoHandler => Counter::Skipped,
    };
    stats.add(counter);
}
