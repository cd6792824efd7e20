//! [`HandlerActor`]: the supervised actor of one event type's handlers;
//! [`Route`]: runs them.
//!
//! The handlers registered for an event type `E`, in registration order,
//! are held in a `Slot` of its [`Route`]; the route runs them only while
//! the type's supervised actor runs. A unit of work runs the handlers
//! through the route, in its own task: the route takes
//! the event decoded before the transaction (or deserializes the body into
//! `E`) and runs every handler on the message's unit of work
//! ([`RunHandlers::run`]), one message (`handle`) or a batch's messages of
//! the type (`handle_batch`), replying [`Handled`]. A handler that panics
//! fails its message (never the other messages in flight); the slot builds
//! the handlers anew at once, and the actor restarts through its
//! [`Supervisor`], via [`Restart`].
//!
//! Why no message to the actor per unit of work: a mailbox, a task and a
//! reply per message were a good part of the runtime's own CPU per
//! message (docs/performance.md), and bought nothing the slot does not
//! give: the handlers still run only while their supervised actor does, a
//! panic still restarts it, and a unit of work past
//! `database.transaction_timeout` drops the handlers' futures where they
//! wait, with its connection, since they are its own.
//!
//! What a panic resets: every handler registered with a factory
//! (`RuntimeBuilder::handler_factory`) is built anew, so that whatever the
//! panic may have left half-changed in it (a client, a cache) starts fresh;
//! no message that starts after the panic runs on the old ones. A handler
//! registered as a value (`RuntimeBuilder::handler`) is shared, and goes
//! on as it was. Messages in flight on the old handlers finish on them.

use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use actix::prelude::*;
use futures_util::FutureExt;
use futures_util::future::BoxFuture;
use metrics::Histogram;

use crate::envelope::Envelope;
use crate::handler::DynEventHandler;
use crate::{IntegrationEvent, MessageContext, Permanent, UnitOfWork};

/// Runs the handlers of one event type, whichever it is: how the dedup
/// actor addresses them (see [`HandlerRoute`]).
pub(crate) type Route = Arc<dyn RunHandlers>;

/// The handlers of one event type, as a unit of work runs them.
pub(crate) trait RunHandlers: Send + Sync {
    /// Runs every handler on `envelopes` in `uow`: `handle` for one
    /// message, `handle_batch` for several (of this type, in delivery
    /// order). Dropped before it ends (past `database.transaction_timeout`),
    /// the handlers are cancelled where they wait, and `uow` is dropped with
    /// its connection.
    fn run(self: Arc<Self>, envelopes: Vec<Arc<Envelope>>, uow: UnitOfWork) -> BoxFuture<'static, Handled>;

    /// Whether the handler actor runs (for health); does not keep it alive.
    fn liveness(&self) -> Box<dyn Fn() -> bool + Send + Sync>;
}

type Handlers<E> = Arc<[Arc<dyn DynEventHandler<E>>]>;

/// The handlers of `E` as registered, and the set built from them last.
struct Slot<E> {
    sources: Vec<HandlerSource<E>>,
    current: RwLock<Handlers<E>>,
}

impl<E> Slot<E> {
    fn new(sources: Vec<HandlerSource<E>>) -> Self {
        let current = RwLock::new(build(&sources));
        Self { sources, current }
    }

    /// The handlers to run a message on.
    fn current(&self) -> Handlers<E> {
        // A panic while locked (in a factory) leaves the set whole.
        Arc::clone(&self.current.read().unwrap_or_else(PoisonError::into_inner))
    }

    /// Builds the handlers anew in place of `panicked`, unless a panic on
    /// another message has already.
    fn rebuild(&self, panicked: &Handlers<E>) {
        let mut current = self.current.write().unwrap_or_else(PoisonError::into_inner);
        if Arc::ptr_eq(&current, panicked) {
            *current = build(&self.sources);
        }
    }
}

/// [`RunHandlers`] for `E`: its handlers' slot, and their actor, for
/// [`Restart`].
pub(crate) struct HandlerRoute<E: IntegrationEvent> {
    slot: Arc<Slot<E>>,
    actor: Addr<HandlerActor<E>>,
    /// `inbox_handler_duration_seconds` of `E`.
    duration: Histogram,
    /// A handler's usage error has been logged (see [`is_usage_error`]).
    usage_error_said: AtomicBool,
}

impl<E: IntegrationEvent> HandlerRoute<E> {
    /// Starts the supervised actor of `sources` (run in this order), and
    /// returns its route.
    pub(crate) fn start(sources: Vec<HandlerSource<E>>) -> Route {
        let actor = Supervisor::start(|_| HandlerActor {
            event: std::marker::PhantomData,
        });
        Arc::new(Self {
            slot: Arc::new(Slot::new(sources)),
            actor,
            duration: crate::actors::metrics::handler_duration(E::TYPE),
            usage_error_said: AtomicBool::new(false),
        })
    }
}

impl<E: IntegrationEvent> RunHandlers for HandlerRoute<E> {
    fn run(self: Arc<Self>, envelopes: Vec<Arc<Envelope>>, uow: UnitOfWork) -> BoxFuture<'static, Handled> {
        if !self.actor.connected() {
            // Stopped for good (the system is stopping): the handlers have
            // no owner to restart them, and run no more.
            return Box::pin(std::future::ready(Handled::Failed {
                uow: Some(uow),
                failure: HandlerFailure::Stopped { event_type: E::TYPE },
            }));
        }
        let timer = HandlerTimer::start(&self.duration);
        Box::pin(run_handlers(self, envelopes, uow, timer))
    }

    fn liveness(&self) -> Box<dyn Fn() -> bool + Send + Sync> {
        let actor = self.actor.downgrade();
        Box::new(move || actor.upgrade().is_some_and(|actor| actor.connected()))
    }
}

/// The reply to [`RunHandlers::run`].
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
        /// The event type it handled.
        event_type: &'static str,
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
        /// The event type it handled.
        event_type: &'static str,
        /// Its reason, as text (bounded).
        reason: String,
    },
    /// A handler panicked.
    Panicked {
        /// The handler's name.
        handler: &'static str,
        /// The event type it handled.
        event_type: &'static str,
        /// The panic's message.
        message: String,
    },
    /// The handler actor of the type has stopped: nothing ran.
    Stopped {
        /// The event type.
        event_type: &'static str,
    },
}

/// Stop so that the supervisor restarts the actor (sent after a handler
/// panicked).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct Restart;

/// A handler as registered: a value, or a factory that builds one.
pub(crate) enum HandlerSource<E> {
    /// Shared, whatever panics.
    Value(Arc<dyn DynEventHandler<E>>),
    /// Called again after each panic.
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

fn build<E>(sources: &[HandlerSource<E>]) -> Handlers<E> {
    sources.iter().map(HandlerSource::build).collect()
}

/// The supervised actor of the handlers registered for `E`: its route
/// runs them while it runs (health watches it as `handler actor of E`),
/// and a panic in one restarts it.
pub(crate) struct HandlerActor<E: IntegrationEvent> {
    event: std::marker::PhantomData<fn() -> E>,
}

impl<E: IntegrationEvent> Actor for HandlerActor<E> {
    type Context = Context<Self>;
}

impl<E: IntegrationEvent> Supervised for HandlerActor<E> {
    fn restarting(&mut self, _ctx: &mut Context<Self>) {
        // The slot built them at the panic already, before any other
        // message could start on the old ones.
        tracing::warn!(
            r#type = E::TYPE,
            "handler actor restarted after a handler panicked; handlers from factories are built anew"
        );
    }
}

impl<E: IntegrationEvent> actix::Handler<Restart> for HandlerActor<E> {
    type Result = ();

    fn handle(&mut self, _: Restart, ctx: &mut Context<Self>) {
        ctx.stop();
    }
}

/// How a body's keys are matched to the event type's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum FieldNames {
    /// As serde matches them: this library's wire.
    Exact,
    /// In any case, as MassTransit reads a message (see
    /// `masstransit::any_case`).
    AnyCase,
}

impl FieldNames {
    /// How `envelope`'s body is read: in any case on MassTransit's wire.
    pub(crate) fn of(envelope: &Envelope) -> Self {
        match envelope.masstransit {
            Some(_) => Self::AnyCase,
            None => Self::Exact,
        }
    }
}

/// `body` decoded into `E`, or why it is not one (bounded: serde quotes the
/// offending text).
pub(crate) fn decode<E: IntegrationEvent>(body: &[u8], names: FieldNames) -> Result<E, String> {
    match names {
        FieldNames::Exact => serde_json::from_slice(body),
        FieldNames::AnyCase => crate::masstransit::from_slice_any_case(body),
    }
    .map_err(|e| cut_to_reason(format!("body is not a valid `{}`: {e}", E::TYPE)))
}

/// `envelope`'s body decoded into `E`, as the handlers' route decodes it.
#[cfg(feature = "testing")]
pub(crate) fn decode_event<E: IntegrationEvent>(envelope: &Envelope) -> Result<E, String> {
    decode(&envelope.body, FieldNames::of(envelope))
}

/// Decodes a body into an event type before a message's transaction
/// begins: a body that is not its event goes to the error queue without
/// costing a transaction and a rollback, and one that is has its event
/// held in the envelope ([`crate::envelope::DecodedEvent`]) for the
/// handlers' route, which parses it no second time.
pub(crate) type Decodes = fn(&[u8], FieldNames) -> Result<Box<dyn std::any::Any + Send>, String>;

/// [`Decodes`] for `E`.
pub(crate) fn decodes<E: IntegrationEvent>(
    body: &[u8],
    names: FieldNames,
) -> Result<Box<dyn std::any::Any + Send>, String> {
    decode::<E>(body, names).map(|event| Box::new(event) as Box<dyn std::any::Any + Send>)
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

    /// `envelope`'s body decoded into the type `name`, or why it does not
    /// decode; `None` when no handler is registered for it.
    pub(crate) fn decode(
        &self,
        name: &str,
        envelope: &Envelope,
    ) -> Option<Result<Box<dyn std::any::Any + Send>, String>> {
        self.find(name)
            .map(|decodes| decodes(&envelope.body, FieldNames::of(envelope)))
    }

    fn find(&self, name: &str) -> Option<Decodes> {
        let at = self.0.binary_search_by(|(n, _)| n.as_str().cmp(name)).ok()?;
        Some(self.0[at].1)
    }
}

/// Runs every handler on the messages: `handle` for one message,
/// `handle_batch` for several. A panic has the handlers built anew and
/// their actor restart.
async fn run_handlers<E: IntegrationEvent>(
    // Shared, not its parts cloned: an `Addr` clone allocates.
    route: Arc<HandlerRoute<E>>,
    envelopes: Vec<Arc<Envelope>>,
    mut uow: UnitOfWork,
    // Records when the handlers are done, whichever way they end.
    _timer: HandlerTimer,
) -> Handled {
    let handlers = route.slot.current();
    // Decoded before the transaction when consumed, and taken here; a
    // message published in process, or on a later attempt, decodes here.
    let mut events: Vec<E> = Vec::with_capacity(envelopes.len());
    for envelope in &envelopes {
        let event = envelope
            .decoded
            .take::<E>()
            .map_or_else(|| decode(&envelope.body, FieldNames::of(envelope)), Ok);
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
    let contexts: Arc<[MessageContext]> = envelopes.iter().map(MessageContext::of).collect();
    uow.set_contexts(contexts.clone());
    for handler in handlers.iter() {
        let name = handler.name();
        // Called inside the future that `catch_unwind` polls: a `handle`
        // written by hand can panic before it returns its future, and that
        // is the handler's panic as much as one inside it.
        let handled = async {
            match events.as_slice() {
                [event] => handler.handle(event, &contexts[0], &mut uow).await,
                events => handler.handle_batch(events, &contexts, &mut uow).await,
            }
        };
        match AssertUnwindSafe(handled).catch_unwind().await {
            Ok(Ok(())) => {}
            Ok(Err(error)) => {
                let text = cut_to_reason(crate::error::describe(error.as_ref()));
                if is_usage_error(error.as_ref()) && !route.usage_error_said.swap(true, Ordering::Relaxed) {
                    tracing::warn!(
                        handler = name,
                        r#type = E::TYPE,
                        error = %text,
                        "a handler asked the unit of work for what it refuses (said once): each time, its \
                         message fails, and a batch runs again one message at a time; fix the handler"
                    );
                }
                let failure = if Permanent::is_in(error.as_ref()) {
                    HandlerFailure::Permanent {
                        handler: name,
                        event_type: E::TYPE,
                        reason: text,
                    }
                } else {
                    HandlerFailure::Failed {
                        handler: name,
                        event_type: E::TYPE,
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
                route.slot.rebuild(&handlers);
                route.actor.do_send(Restart);
                let failure = HandlerFailure::Panicked {
                    handler: name,
                    event_type: E::TYPE,
                    message: cut_to_reason(panic_message(panic.as_ref())),
                };
                return Handled::Failed { uow: None, failure };
            }
        }
    }
    Handled::Done(uow)
}

/// Whether a handler's error is the runtime refusing what the handler asked
/// of it (`publish` in an overridden `handle_batch`, say): a bug to fix,
/// not a failure of the message's, which only a WARN makes visible when a
/// split batch then succeeds message by message.
fn is_usage_error(error: &(dyn std::error::Error + 'static)) -> bool {
    let mut current = Some(error);
    while let Some(e) = current {
        if e.downcast_ref::<crate::Error>()
            .is_some_and(|e| e.kind() == crate::ErrorKind::Usage)
        {
            return true;
        }
        current = e.source();
    }
    false
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

pub(crate) fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| (*s).to_owned())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}
