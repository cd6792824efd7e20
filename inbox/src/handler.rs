//! Event handlers: user code that runs inside a message's unit of work.

use std::future::Future;

use futures_util::future::BoxFuture;

use crate::context::MessageContext;
use crate::error::HandlerError;
use crate::event::IntegrationEvent;
use crate::unit_of_work::UnitOfWork;

/// Handles one event type. Every handler registered for a type runs, in
/// registration order, inside the same [`UnitOfWork`]: they commit together
/// with the inbox row or not at all.
///
/// Returning an error (or panicking) abandons the message: the whole unit of
/// work rolls back and the message goes back to the broker. Writes made
/// through `uow` happen exactly once; anything else (another database, an
/// HTTP call) can happen again on a redelivery, so make it idempotent.
///
/// ```
/// # #[derive(serde::Serialize, serde::Deserialize)]
/// # struct AttendeeCheckedIn { attendee_id: i64, session_id: i64 }
/// # impl rabbit_inbox::IntegrationEvent for AttendeeCheckedIn { const TYPE: &'static str = "AttendeeCheckedIn"; }
/// use rabbit_inbox::{EventHandler, HandlerError, MessageContext, UnitOfWork};
///
/// struct CountCheckins;
///
/// impl EventHandler<AttendeeCheckedIn> for CountCheckins {
///     async fn handle(
///         &self,
///         event: &AttendeeCheckedIn,
///         message: &MessageContext,
///         uow: &mut UnitOfWork,
///     ) -> Result<(), HandlerError> {
///         tracing::debug!(message_id = %message.message_id, attempt = message.attempt, "counting");
///         uow.client()
///             .execute(
///                 "INSERT INTO attendee_checkins VALUES ($1, 1)
///                  ON CONFLICT (attendee_id) DO UPDATE SET checkins = attendee_checkins.checkins + 1",
///                 &[&event.attendee_id],
///             )
///             .await?;
///         Ok(())
///     }
/// }
/// ```
pub trait EventHandler<E: IntegrationEvent>: Send + Sync + 'static {
    /// Applies `event`, which came in the message `context` describes (its
    /// id, attempt, correlation), through `uow`.
    fn handle(
        &self,
        event: &E,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send;

    /// Applies several events through one `uow`, in delivery order: the
    /// messages of one batch (`queues[].batch_size` above 1), `contexts[i]`
    /// the message of `events[i]`. The default calls
    /// [`handle`](Self::handle) for each event with its own message, and
    /// the follow-ups that call stages with [`UnitOfWork::publish`] carry
    /// that message's ids, whatever the batch size.
    ///
    /// Override it to write a whole batch in a few set-based statements
    /// instead of a few statements per event: that is what makes batches
    /// fast. It must have the same effect as `handle` for each event in
    /// turn, because a failure makes the runtime roll the batch back and run
    /// its messages again one at a time through `handle`, each after a
    /// savepoint of its own: the failing message is isolated and takes its
    /// failure path alone, the others commit. When several handlers are
    /// registered, each handles the whole batch before the next starts.
    ///
    /// An override handles every message at once, so a follow-up is
    /// staged there with [`publish_caused_by`](UnitOfWork::publish_caused_by)
    /// naming its cause, `&contexts[i]` (`publish` refuses to guess it).
    fn handle_batch(
        &self,
        events: &[E],
        contexts: &[MessageContext],
        uow: &mut UnitOfWork,
    ) -> impl Future<Output = Result<(), HandlerError>> + Send {
        async move {
            // A caller of its own (an override's `handle` delegating here)
            // that passed fewer contexts would have events skipped and
            // their messages acked without their effect.
            if events.len() != contexts.len() {
                return Err(crate::Error::new(
                    crate::ErrorKind::Usage,
                    format!(
                        "`handle_batch` given {} events and {} contexts: one context per event",
                        events.len(),
                        contexts.len()
                    ),
                )
                .into());
            }
            for (i, (event, context)) in events.iter().zip(contexts).enumerate() {
                uow.focus(Some(i));
                let handled = self.handle(event, context, uow).await;
                uow.focus(None);
                handled?;
            }
            Ok(())
        }
    }

    /// The name logs and fault reports use. Default: the Rust type name.
    fn name(&self) -> &'static str {
        std::any::type_name::<Self>()
    }
}

/// [`EventHandler`] in a form that can be stored as `dyn`; implemented for
/// every handler.
pub(crate) trait DynEventHandler<E>: Send + Sync + 'static {
    /// See [`EventHandler::handle`].
    fn handle<'a>(
        &'a self,
        event: &'a E,
        context: &'a MessageContext,
        uow: &'a mut UnitOfWork,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
    /// See [`EventHandler::handle_batch`].
    fn handle_batch<'a>(
        &'a self,
        events: &'a [E],
        contexts: &'a [MessageContext],
        uow: &'a mut UnitOfWork,
    ) -> BoxFuture<'a, Result<(), HandlerError>>;
    /// See [`EventHandler::name`].
    fn name(&self) -> &'static str;
}

impl<E: IntegrationEvent, H: EventHandler<E>> DynEventHandler<E> for H {
    fn handle<'a>(
        &'a self,
        event: &'a E,
        context: &'a MessageContext,
        uow: &'a mut UnitOfWork,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(EventHandler::handle(self, event, context, uow))
    }

    fn handle_batch<'a>(
        &'a self,
        events: &'a [E],
        contexts: &'a [MessageContext],
        uow: &'a mut UnitOfWork,
    ) -> BoxFuture<'a, Result<(), HandlerError>> {
        Box::pin(EventHandler::handle_batch(self, events, contexts, uow))
    }

    fn name(&self) -> &'static str {
        EventHandler::name(self)
    }
}
