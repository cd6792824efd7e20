//! The engine: what the runtime crate (`inbox-actors`) and this
//! repository's tests and tools use and a service does not. Not part of
//! the API, and under no semver promise: it changes with the runtime.
//!
//! Everything the crate's root offered before it kept only a service's
//! names is here too, so that one path reaches all of it.

#[path = "amqp/mod.rs"]
pub mod amqp;
#[path = "backoff.rs"]
pub(crate) mod backoff;
#[path = "confirms.rs"]
pub(crate) mod confirms;
#[path = "db.rs"]
pub(crate) mod db;
#[path = "deliveries.rs"]
pub mod deliveries;
#[path = "envelope.rs"]
pub(crate) mod envelope;
#[path = "fault.rs"]
pub mod fault;
#[path = "limits.rs"]
pub mod limits;
#[path = "masstransit.rs"]
pub mod masstransit;
#[path = "names.rs"]
pub(crate) mod names;
#[path = "outbox/mod.rs"]
pub mod outbox;
#[path = "policy.rs"]
pub mod policy;
#[path = "retention.rs"]
pub(crate) mod retention;
/// TLS for both connections.
#[path = "tls.rs"]
pub(crate) mod tls;
#[path = "trace.rs"]
pub mod trace;

pub use crate::context::{CAUSATION_ID, CORRELATION_ID};
pub use crate::error::{describe, is_unavailable};
pub use crate::handler::DynEventHandler;
pub use crate::migrations::{migrate, run_migrations};
pub use crate::settings::{
    DatabaseSettings, FailureSettings, MessageBusSettings, OutboxSettings, RetentionSettings, RuntimeSettings,
};
pub use crate::store::{Claim, DynInboxStore, InboxKey, InboxStore, NoopInboxStore, PgInboxStore};
pub use crate::unit_of_work::Outbox;
pub use crate::{
    Error, ErrorKind, EventHandler, HandlerError, IntegrationEvent, Message, MessageContext, Migration,
    Nested, Permanent, Provider, QueueKind, QueueSettings, Result, Settings, UnitOfWork, ValidSettings, Wire,
};
pub use amqp::AmqpPublisher;
pub use backoff::Backoff;
pub use db::{create_dispatching_pool, create_pool, wait_for_database};
pub use envelope::{DecodeError, Decoded, DeliveryLabel, Envelope};
pub use outbox::{DispatchReport, Outgoing, Sink, dispatch, drain};
pub use policy::{Abandoned, Action, Outcome, Stage, Target, decide};
pub use retention::{SweepReport, sweep};
pub use trace::TraceContext;

pub use ::deadpool_postgres;
pub use ::lapin;
pub use ::tokio_postgres;
pub use ::uuid;
