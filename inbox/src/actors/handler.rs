//! [`HandlerActor`]: runs the handlers of one event type.
//!
//! Owns the handlers registered for its event type `E`, in registration
//! order. Receives [`Handle`] from the [`DedupActor`](crate::DedupActor):
//! takes the event decoded before the transaction (or deserializes the
//! body into `E`) and runs every handler on the message's
//! unit of work, replying [`Handled`]; and [`HandleBatch`], the same for
//! several messages of a batch at once. A handler that panics fails its
//! message (never the actor's other work) and the actor restarts itself
//! through its [`Supervisor`], via [`Restart`].
//!
//! What a restart resets: every handler registered with a factory
//! (`RuntimeBuilder::handler_factory`) is built anew, so that whatever a
//! panic may have left half-changed in it (a client, a cache) starts fresh.
//! A handler registered as a value (`RuntimeBuilder::handler`) is shared,
//! and goes on as it was. Messages in flight on the old handlers finish
//! on them.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use actix::prelude::*;
use futures_util::FutureExt;
use metrics::Histogram;
use tracing::Instrument;

use crate::envelope::Envelope;
use crate::handler::DynEventHandler;
use crate::{IntegrationEvent, MessageContext, Permanent, UnitOfWork};

/// Run the handlers for one message inside its unit of work. Sent with
/// [`handle`].
#[derive(Message)]
#[rtype(result = "Handled")]
pub(crate) struct Handle {
    /// The message.
    envelope: Arc<Envelope>,
    /// Its open transaction, with the inbox row claimed.
    uow: UnitOfWork,
    /// Resolves when whoever waits for the reply gave up.
    abandoned: Abandonment,
}

/// Run the handlers for several messages of one type inside one unit of
/// work, through [`EventHandler::handle_batch`](crate::EventHandler::handle_batch).
/// Sent with [`handle_batch`].
#[derive(Message)]
#[rtype(result = "Handled")]
pub(crate) struct HandleBatch {
    /// The messages, in delivery order.
    envelopes: Vec<Arc<Envelope>>,
    /// Their open transaction, with their inbox rows claimed.
    uow: UnitOfWork,
    /// Resolves when whoever waits for the reply gave up.
    abandoned: Abandonment,
}

/// Resolves when the sender of a [`Handle`] or [`HandleBatch`] stops
/// waiting for the reply: its unit of work passed
/// `database.transaction_timeout` and was abandoned. The handlers are then
/// cancelled, and their unit of work dropped with its connection. Without
/// it a handler stuck on a dead peer would keep its pooled connection until
/// it returned, one more per attempt, until the pool was empty and every
/// message held as if the database were down.
type Abandonment = tokio::sync::oneshot::Receiver<()>;

/// Runs the handlers for one message on `route`; dropped before the reply
/// (a timeout), it cancels them.
pub(crate) async fn handle(
    route: &Recipient<Handle>,
    envelope: Arc<Envelope>,
    uow: UnitOfWork,
) -> Result<Handled, MailboxError> {
    // Dropped with this future, whether it completes or is cancelled.
    let (_waiting, abandoned) = tokio::sync::oneshot::channel();
    route
        .send(Handle {
            envelope,
            uow,
            abandoned,
        })
        .await
}

/// [`handle`] for a batch's messages of one type.
pub(crate) async fn handle_batch(
    route: &Recipient<HandleBatch>,
    envelopes: Vec<Arc<Envelope>>,
    uow: UnitOfWork,
) -> Result<Handled, MailboxError> {
    let (_waiting, abandoned) = tokio::sync::oneshot::channel();
    route
        .send(HandleBatch {
            envelopes,
            uow,
            abandoned,
        })
        .await
}

/// The reply to [`Handle`] and [`HandleBatch`].
pub(crate) enum Handled {
    /// Every handler succeeded: the unit of work, ready to commit.
    Done(UnitOfWork),
    /// A handler failed, or the body is not the event. `uow` is `None` when
    /// the connection's state is unknown (a panic mid-statement): it has been
    /// discarded.
    Failed {
        /// The unit of work to roll back, if it can still be trusted.
        uow: Option<UnitOfWork>,
        /// What went wrong.
        failure: HandlerFailure,
    },
}

/// Why the handlers did not complete a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum HandlerFailure {
    /// The body does not deserialize into the event: no attempt can succeed.
    Malformed(String),
    /// A handler returned an error: the message may succeed on a later attempt.
    Failed {
        /// The handler's name.
        handler: &'static str,
        /// Its error, as text (bounded). Whatever it wraps, it is the
        /// handler's failure: the dedup actor alone tells a lost database
        /// connection, from its own rollback.
        error: String,
    },
    /// A handler returned a [`Permanent`] failure: no
    /// attempt can succeed.
    Permanent {
        /// The handler's name.
        handler: &'static str,
        /// Its reason, as text (bounded).
        reason: String,
    },
    /// A handler panicked.
    Panicked {
        /// The handler's name.
        handler: &'static str,
        /// The panic's message.
        message: String,
    },
}

/// Stop so that the supervisor restarts the actor (sent to itself after a
/// handler panicked).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Restart;

/// A handler as registered: a value, or a factory that builds one.
pub(crate) enum HandlerSource<E> {
    /// Shared by every incarnation of the actor.
    Value(Arc<dyn DynEventHandler<E>>),
    /// Called again at each restart.
    Factory(Arc<dyn Fn() -> Arc<dyn DynEventHandler<E>> + Send + Sync>),
}

impl<E> HandlerSource<E> {
    fn build(&self) -> Arc<dyn DynEventHandler<E>> {
        match self {
            HandlerSource::Value(handler) => Arc::clone(handler),
            HandlerSource::Factory(factory) => factory(),
        }
    }
}

/// Runs the handlers registered for `E`.
pub(crate) struct HandlerActor<E: IntegrationEvent> {
    sources: Vec<HandlerSource<E>>,
    handlers: Arc<[Arc<dyn DynEventHandler<E>>]>,
    /// `inbox_handler_duration_seconds` of `E`.
    duration: Histogram,
}

impl<E: IntegrationEvent> HandlerActor<E> {
    /// An actor over the handlers of `sources`, which run in this order.
    pub(crate) fn new(sources: Vec<HandlerSource<E>>) -> Self {
        let handlers = sources.iter().map(HandlerSource::build).collect();
        Self {
            sources,
            handlers,
            duration: crate::actors::metrics::handler_duration(E::TYPE),
        }
    }
}

impl<E: IntegrationEvent> Actor for HandlerActor<E> {
    type Context = Context<Self>;
}

impl<E: IntegrationEvent> Supervised for HandlerActor<E> {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        self.handlers = self.sources.iter().map(HandlerSource::build).collect();
        tracing::warn!(
            r#type = E::TYPE,
            "handler actor restarted after a handler panicked; handlers from factories are built anew"
        );
    }
}

impl<E: IntegrationEvent> actix::Handler<Handle> for HandlerActor<E> {
    // Its own task per message: messages of one type run concurrently, and a
    // slow handler does not hold up the mailbox.
    type Result = ResponseFuture<Handled>;

    fn handle(&mut self, msg: Handle, ctx: &mut Context<Self>) -> Self::Result {
        let handlers = Arc::clone(&self.handlers);
        let myself = ctx.address();
        let span = msg.envelope.span.clone();
        let timer = HandlerTimer::start(&self.duration);
        // Boxed where it is made: the handlers' futures can be large, and
        // each wrapper would copy them again.
        let run = Box::pin(run_handlers(handlers, vec![msg.envelope], msg.uow, myself, timer));
        Box::pin(unless_abandoned(run, msg.abandoned).instrument(span))
    }
}

impl<E: IntegrationEvent> actix::Handler<HandleBatch> for HandlerActor<E> {
    type Result = ResponseFuture<Handled>;

    fn handle(&mut self, msg: HandleBatch, ctx: &mut Context<Self>) -> Self::Result {
        let handlers = Arc::clone(&self.handlers);
        let myself = ctx.address();
        let timer = HandlerTimer::start(&self.duration);
        let run = Box::pin(run_handlers(handlers, msg.envelopes, msg.uow, myself, timer));
        Box::pin(unless_abandoned(run, msg.abandoned))
    }
}

impl<E: IntegrationEvent> actix::Handler<Restart> for HandlerActor<E> {
    type Result = ();

    fn handle(&mut self, _: Restart, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

/// Runs `handlers` to their end, unless `abandoned` resolves first: then
/// they are dropped where they wait, and their unit of work with them (its
/// connection discarded, so the server rolls back).
async fn unless_abandoned(
    handlers: impl std::future::Future<Output = Handled>,
    abandoned: Abandonment,
) -> Handled {
    tokio::select! {
        handled = handlers => handled,
        _ = abandoned => {
            tracing::warn!(
                "the handlers did not finish within database.transaction_timeout: cancelled, their connection discarded"
            );
            // Nobody reads it: the sender is gone.
            Handled::Failed {
                uow: None,
                failure: HandlerFailure::Failed {
                    handler: "runtime",
                    error: "cancelled: past database.transaction_timeout".into(),
                },
            }
        }
    }
}

/// `body` decoded into `E`, or why it is not one (bounded: serde quotes the
/// offending text).
pub(crate) fn decode<E: IntegrationEvent>(body: &[u8]) -> Result<E, String> {
    serde_json::from_slice(body).map_err(|e| cut_to_reason(format!("body is not a valid `{}`: {e}", E::TYPE)))
}

/// Decodes a body into an event type before a message's transaction
/// begins: a body that is not its event goes to the error queue without
/// costing a transaction and a rollback, and one that is has its event
/// held in the envelope ([`crate::envelope::DecodedEvent`]) for the handler
/// actor, which parses it no second time.
pub(crate) type Decodes = fn(&[u8]) -> Result<Box<dyn std::any::Any + Send>, String>;

/// [`Decodes`] for `E`.
pub(crate) fn decodes<E: IntegrationEvent>(body: &[u8]) -> Result<Box<dyn std::any::Any + Send>, String> {
    decode::<E>(body).map(|event| Box::new(event) as Box<dyn std::any::Any + Send>)
}

/// The event types handlers are registered for, by name, each with its
/// [`Decodes`]: what a MassTransit message is handled as, which type
/// exchanges its wire binds, and what is decoded before a transaction.
#[derive(Clone)]
pub(crate) struct HandledTypes(Arc<[(String, Decodes)]>);

impl HandledTypes {
    pub(crate) fn new(mut types: Vec<(String, Decodes)>) -> Self {
        types.sort_by(|a, b| a.0.cmp(&b.0));
        Self(types.into())
    }

    /// Those of them named in `names`; all when `names` is empty.
    pub(crate) fn only(&self, names: &[String]) -> Self {
        if names.is_empty() {
            return self.clone();
        }
        let kept: Vec<_> = self
            .0
            .iter()
            .filter(|(name, _)| names.contains(name))
            .cloned()
            .collect();
        Self(kept.into())
    }

    /// Their names, sorted.
    pub(crate) fn names(&self) -> Vec<&str> {
        self.0.iter().map(|(name, _)| name.as_str()).collect()
    }

    pub(crate) fn contains(&self, name: &str) -> bool {
        self.find(name).is_some()
    }

    /// `body` decoded into the type `name`, or why it does not decode;
    /// `None` when no handler is registered for it.
    pub(crate) fn decode(
        &self,
        name: &str,
        body: &[u8],
    ) -> Option<Result<Box<dyn std::any::Any + Send>, String>> {
        self.find(name).map(|decodes| decodes(body))
    }

    fn find(&self, name: &str) -> Option<Decodes> {
        let at = self.0.binary_search_by(|(n, _)| n.as_str().cmp(name)).ok()?;
        Some(self.0[at].1)
    }
}

/// Runs every handler on the messages: `handle` for one message,
/// `handle_batch` for several.
async fn run_handlers<E: IntegrationEvent>(
    handlers: Arc<[Arc<dyn DynEventHandler<E>>]>,
    envelopes: Vec<Arc<Envelope>>,
    mut uow: UnitOfWork,
    myself: Addr<HandlerActor<E>>,
    // Records when the handlers are done, whichever way they end.
    _timer: HandlerTimer,
) -> Handled {
    // Decoded before the transaction when consumed, and taken here; a
    // message published in process, or on a later attempt, decodes here.
    let mut events: Vec<E> = Vec::with_capacity(envelopes.len());
    for envelope in &envelopes {
        let event = envelope
            .decoded
            .take::<E>()
            .map_or_else(|| decode(&envelope.body), Ok);
        match event {
            Ok(event) => events.push(event),
            Err(reason) => {
                return Handled::Failed {
                    uow: Some(uow),
                    failure: HandlerFailure::Malformed(reason),
                };
            }
        }
    }
    uow.set_contexts(envelopes.iter().map(MessageContext::of).collect());
    for handler in handlers.iter() {
        let name = handler.name();
        let handled = match events.as_slice() {
            [event] => handler.handle(event, &mut uow),
            events => handler.handle_batch(events, &mut uow),
        };
        match AssertUnwindSafe(handled).catch_unwind().await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                let text = cut_to_reason(crate::error::describe(error.as_ref()));
                let failure = if Permanent::is_in(error.as_ref()) {
                    HandlerFailure::Permanent {
                        handler: name,
                        reason: text,
                    }
                } else {
                    HandlerFailure::Failed {
                        handler: name,
                        error: text,
                    }
                };
                return Handled::Failed {
                    uow: Some(uow),
                    failure,
                };
            }
            Err(panic) => {
                // The panic may have struck mid-statement: discard the
                // connection rather than trust a ROLLBACK on it.
                drop(uow);
                myself.do_send(Restart);
                let failure = HandlerFailure::Panicked {
                    handler: name,
                    message: cut_to_reason(panic_message(panic.as_ref())),
                };
                return Handled::Failed { uow: None, failure };
            }
        }
    }
    Handled::Done(uow)
}

/// Records the handlers' duration when dropped, whichever way they end.
struct HandlerTimer {
    started: std::time::Instant,
    duration: Histogram,
}

impl HandlerTimer {
    fn start(duration: &Histogram) -> Self {
        Self {
            started: std::time::Instant::now(),
            duration: duration.clone(),
        }
    }
}

impl Drop for HandlerTimer {
    fn drop(&mut self) {
        self.duration.record(self.started.elapsed().as_secs_f64());
    }
}

/// An error's text cut to what a log line and a header can carry: it may
/// quote the whole message (serde quotes the offending string).
fn cut_to_reason(text: String) -> String {
    match crate::fault::truncate(&text, crate::fault::MAX_REASON_BYTES) {
        std::borrow::Cow::Borrowed(_) => text,
        cut => cut.into_owned(),
    }
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
