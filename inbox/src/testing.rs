//! A test kit for handlers (feature `testing`): runs a handler, or every
//! handler of a message's type, on a message the test makes, in a real
//! PostgreSQL transaction, without RabbitMQ or a runtime, and says what the
//! runtime would do: commit, retry or set aside, with the reason, and what
//! the handlers staged.
//!
//! ```no_run
//! use rabbit_inbox::testing::{TestKit, Verdict};
//! use rabbit_inbox::{EventHandler, HandlerError, IntegrationEvent, Message, MessageContext, Permanent, UnitOfWork};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct Refund { order: i64, cents: i64 }
//! impl IntegrationEvent for Refund { const TYPE: &'static str = "Refund"; }
//!
//! struct IssueRefund;
//! impl EventHandler<Refund> for IssueRefund {
//!     async fn handle(&self, refund: &Refund, _: &MessageContext, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
//!         if refund.cents <= 0 { return Err(Permanent::new("nothing to refund").into()) }
//!         uow.client().execute("INSERT INTO refunds VALUES ($1, $2)", &[&refund.order, &refund.cents]).await?;
//!         uow.publish("billing", &Message::new(Refund { order: refund.order, cents: refund.cents })).await?;
//!         Ok(())
//!     }
//! }
//!
//! # async fn test() -> rabbit_inbox::Result<()> {
//! let settings = rabbit_inbox::Settings::load()?;
//! let kit = TestKit::new(&settings)?;
//! let ran = kit.deliver(Message::new(Refund { order: 7, cents: 250 })).handled_by(&IssueRefund).await?;
//! assert_eq!(ran.verdict, Verdict::Committed);
//! assert_eq!(ran.staged[0].routing_key, "billing");
//! let ran = kit.deliver(Message::new(Refund { order: 8, cents: 0 })).handled_by(&IssueRefund).await?;
//! assert_eq!(ran.verdict, Verdict::SetAside { reason: "nothing to refund".into() });
//!
//! // Or every handler of the type, registered as the service registers them:
//! let kit = kit.handler::<Refund, _>(IssueRefund);
//! let ran = kit.deliver(Message::new(Refund { order: 9, cents: 100 })).handled().await?;
//! assert_eq!(ran.verdict, Verdict::Committed);
//! # Ok(()) }
//! ```

use std::any::Any;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use deadpool_postgres::Pool;
use futures_util::FutureExt;
use uuid::Uuid;

use crate::envelope::Envelope;
use crate::handler::DynEventHandler;
use crate::unit_of_work::Outbox;
use crate::{
    EventHandler, IntegrationEvent, Message, MessageContext, Permanent, Result, Settings, UnitOfWork, Wire,
};

/// Runs handlers as the runtime does, on the database of its settings:
/// one handler ([`Delivery::handled_by`]), or every handler registered with
/// the kit for the message's type ([`Delivery::handled`]), in registration
/// order in one transaction, as a queue's handlers run.
#[derive(Clone)]
pub struct TestKit {
    pool: Pool,
    wire: Wire,
    max_message_size: usize,
    /// Each an `Arc<dyn DynEventHandler<E>>` for its event type `E`, in
    /// registration order.
    handlers: Vec<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for TestKit {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestKit")
            .field("wire", &self.wire)
            .field("handlers", &self.handlers.len())
            .finish_non_exhaustive()
    }
}

/// A handler of `E`, as the kit keeps it.
type Registered<E> = Arc<dyn DynEventHandler<E>>;

/// What the runtime would do with the message.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Verdict {
    /// Every handler succeeded and the transaction committed: acked.
    Committed,
    /// A handler failed (or panicked, or the commit failed): rolled back,
    /// and tried again within the queue's failure policy.
    Retried {
        /// The failure, as its fault headers would say it.
        reason: String,
    },
    /// It can never succeed (a [`Permanent`] failure, or a body that does
    /// not decode): rolled back and set aside in the error queue at once.
    SetAside {
        /// Why, as its fault headers would say it.
        reason: String,
    },
}

/// A message the handler staged, committed with its writes.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Staged {
    /// Its id.
    pub message_id: Uuid,
    /// Its routing key (on MassTransit's wire, its type's exchange is
    /// where it goes).
    pub routing_key: String,
    /// Its type.
    pub message_type: String,
    /// Its headers, the carried ones and its own.
    pub headers: Vec<(String, String)>,
    /// Its body, as it goes on the wire (on MassTransit's, its envelope).
    pub body: Vec<u8>,
}

impl Staged {
    /// Its body as JSON.
    pub fn json(&self) -> serde_json::Result<serde_json::Value> {
        serde_json::from_slice(&self.body)
    }
}

/// What running a handler came to.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Ran {
    /// What the runtime would do.
    pub verdict: Verdict,
    /// What it staged, if it committed (nothing otherwise: a rollback
    /// takes it).
    pub staged: Vec<Staged>,
}

/// A message on its way to a handler, as the test makes it.
#[derive(Debug)]
pub struct Delivery<'k, E> {
    kit: &'k TestKit,
    message: Message<E>,
    redelivered: bool,
    attempt: u32,
}

impl TestKit {
    /// A kit on the database of `settings` (`database.url`), speaking its
    /// wire (`message_bus.wire`). The handlers' tables are the test's to
    /// make; the kit needs none of the inbox's.
    pub fn new(settings: &Settings) -> Result<Self> {
        Ok(Self {
            pool: crate::db::create_pool(settings)?,
            wire: settings.message_bus.wire,
            max_message_size: settings.message_bus.max_message_size,
            handlers: Vec::new(),
        })
    }

    /// Registers `handler` for `E`, as
    /// [`RuntimeBuilder::handler`](crate::RuntimeBuilder::handler) does:
    /// [`Delivery::handled`] runs every handler of the message's type, in
    /// this order.
    #[must_use]
    pub fn handler<E: IntegrationEvent, H: EventHandler<E>>(mut self, handler: H) -> Self {
        let registered: Registered<E> = Arc::new(handler);
        self.handlers.push(Arc::new(registered));
        self
    }

    /// `message`, delivered for the first time (see [`Delivery`] for a
    /// redelivery or a later attempt; its headers are the message's own).
    pub fn deliver<E: IntegrationEvent>(&self, message: Message<E>) -> Delivery<'_, E> {
        Delivery {
            kit: self,
            message,
            redelivered: false,
            attempt: 1,
        }
    }
}

impl<E: IntegrationEvent> Delivery<'_, E> {
    /// As the broker marks a message it delivered before.
    #[must_use]
    pub fn redelivered(mut self) -> Self {
        self.redelivered = true;
        self
    }

    /// As the `attempt`th attempt (from 1).
    #[must_use]
    pub fn attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt.max(1);
        self
    }

    /// Runs `handler` on it, in a transaction of its own, as the runtime
    /// runs it: the body decoded from its JSON as the runtime decodes it,
    /// the context a handler reads, commit or rollback.
    pub async fn handled_by<H: EventHandler<E>>(self, handler: &H) -> Result<Ran> {
        self.run(&[handler]).await
    }

    /// Runs every handler registered with the kit for `E` on it (see
    /// [`TestKit::handler`]), in one transaction and in registration
    /// order, as the runtime runs a type's handlers: the first to fail
    /// rolls back the others' writes too. Fails, naming the type, when the
    /// kit has none for it: a test of nothing.
    pub async fn handled(self) -> Result<Ran> {
        let registered: Vec<Registered<E>> = self
            .kit
            .handlers
            .iter()
            .filter_map(|h| h.downcast_ref::<Registered<E>>().cloned())
            .collect();
        if registered.is_empty() {
            return Err(crate::Error::new(
                crate::ErrorKind::Usage,
                format!(
                    "the test kit has no handler for `{}`: register them with `TestKit::handler`",
                    E::TYPE
                ),
            ));
        }
        let handlers: Vec<&dyn DynEventHandler<E>> = registered.iter().map(|h| &**h).collect();
        self.run(&handlers).await
    }

    async fn run(self, handlers: &[&dyn DynEventHandler<E>]) -> Result<Ran> {
        let mut envelope = Envelope::from_message(&self.message, "test")?;
        envelope.redelivered = self.redelivered;
        envelope.attempt = self.attempt;
        let envelope = Arc::new(envelope);
        let event: E = match crate::actors::decode_event(&envelope) {
            Ok(event) => event,
            Err(reason) => {
                return Ok(Ran {
                    verdict: Verdict::SetAside { reason },
                    staged: Vec::new(),
                });
            }
        };
        let (sender, mut handed_over) = tokio::sync::mpsc::unbounded_channel();
        let outbox = Outbox {
            exchange: "".into(),
            max_message_size: self.kit.max_message_size,
            wire: self.kit.wire,
            wake: Arc::default(),
            after_commit: Some(sender),
        };
        let connection = self.kit.pool.get().await.map_err(crate::Error::client)?;
        let mut uow = UnitOfWork::begin(connection.into()).await?.with_outbox(outbox);
        let context: Arc<[MessageContext]> = Arc::new([MessageContext::of(&envelope)]);
        uow.set_contexts(context.clone());
        let handled = AssertUnwindSafe(async {
            for handler in handlers {
                handler.handle(&event, &context[0], &mut uow).await?;
            }
            Ok::<_, crate::HandlerError>(())
        })
        .catch_unwind()
        .await;
        let verdict = match handled {
            Ok(Ok(())) => match uow.commit().await {
                Ok(()) => Verdict::Committed,
                Err(e) => Verdict::Retried {
                    reason: crate::error::describe(&e),
                },
            },
            Ok(Err(error)) => {
                let reason = crate::error::describe(error.as_ref());
                let _ = uow.rollback().await;
                match Permanent::is_in(error.as_ref()) {
                    true => Verdict::SetAside { reason },
                    false => Verdict::Retried { reason },
                }
            }
            Err(panic) => Verdict::Retried {
                reason: format!("panicked: {}", crate::actors::panic_text(panic.as_ref())),
            },
        };
        let mut staged = Vec::new();
        while let Ok(outgoing) = handed_over.try_recv() {
            staged.push(Staged {
                message_id: outgoing.message_id,
                routing_key: outgoing.routing_key,
                message_type: outgoing.message_type,
                headers: outgoing.headers,
                body: outgoing.body,
            });
        }
        Ok(Ran { verdict, staged })
    }
}
