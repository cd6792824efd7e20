#![doc = include_str!("../README.md")]
//!
//! ## The parts of this crate
//!
//! This crate holds the pieces; `inbox-actors` runs them as actix actors.
//!
//! - [`Settings`]: layered configuration, validated, with
//!   [`is_inbox_enabled`](Settings::is_inbox_enabled).
//! - [`IntegrationEvent`] and [`Message`]: an event type and one identified
//!   instance of it (a UUID v7 `message_id`).
//! - [`Envelope`]: a delivery decoded per the wire contract.
//! - [`UnitOfWork`]: one message's transaction; never pooled unfinished;
//!   [`Nested`] scopes for handlers.
//! - [`EventHandler`]: user code that writes through the unit of work;
//!   [`Permanent`] for a failure no retry can fix.
//! - [`InboxStore`]: [`PgInboxStore`] claims inside the unit of work;
//!   [`NoopInboxStore`] never deduplicates.
//! - [`create_pool`] and [`wait_for_database`]: the inbox's pool, and the
//!   start's bounded wait for the database.
//! - [`run_migrations`]: creates `inbox_messages` and `outbox_messages`,
//!   inbox on or off; [`migrate`] runs a service's own [`Migration`]s
//!   after them, under the same advisory lock.
//! - [`limits`]: what the broker takes (names, properties as encoded, body
//!   size), checked before anything is published.
//! - [`dispatch`]: one round of the outbox: publishes the committed rows
//!   [`UnitOfWork::publish`] staged, with confirms, then deletes them.
//! - [`sweep`]: deletes inbox rows past `retention.days`, in batches, one
//!   instance per database at a time.
//! - [`amqp`]: connecting (bounded, logged), declaring a queue's topology
//!   (with its delivery limit), [`AmqpPublisher`], replaying `Q.error` or
//!   `Q.skipped`.
//! - [`policy`]: the failure policy, one pure function [`decide`] from an
//!   attempt's [`Outcome`] to an [`Action`].
//! - [`fault`]: the failure history and fault reasons in a message's
//!   headers, read as untrusted input and written bounded.
//! - [`Error`]: the one error type; [`describe`] and [`is_unavailable`] read
//!   any error's source chain (for logs, and to tell an outage from a
//!   failure).

mod backoff;
mod confirms;
mod context;
mod db;
mod envelope;
mod error;
mod event;
pub mod fault;
mod handler;
pub mod limits;
pub mod masstransit;
mod migrations;
mod names;
pub mod outbox;
pub mod policy;
mod retention;
mod settings;
mod store;
pub mod trace;
mod unit_of_work;

pub mod amqp;

pub use amqp::AmqpPublisher;
pub use backoff::Backoff;
pub use context::{CAUSATION_ID, CORRELATION_ID, MessageContext};
pub use db::{create_dispatching_pool, create_pool, wait_for_database};
pub use envelope::{DecodeError, DeliveryLabel, Envelope};
pub use error::{Error, ErrorKind, HandlerError, Permanent, Result, describe, is_unavailable};
pub use event::{IntegrationEvent, Message};
pub use handler::{DynEventHandler, EventHandler};
pub use migrations::{Migration, migrate, run_migrations};
pub use outbox::{DispatchReport, Outgoing, Sink, dispatch, drain};
pub use policy::{Abandoned, Action, Outcome, Stage, Target, decide};
pub use retention::{SweepReport, sweep};
pub use settings::{
    DatabaseSettings, FailureSettings, MessageBusSettings, OutboxSettings, Provider, QueueKind,
    QueueSettings, RetentionSettings, RuntimeSettings, Settings, ValidSettings, Wire,
};
pub use store::{Claim, DynInboxStore, InboxKey, InboxStore, NoopInboxStore, PgInboxStore};
pub use trace::TraceContext;
pub use unit_of_work::{Nested, Outbox, UnitOfWork};

// The dependencies that appear in this crate's signatures, so users never
// fight a version mismatch.
pub use deadpool_postgres;
pub use lapin;
pub use tokio_postgres;
pub use uuid;
