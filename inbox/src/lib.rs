//! Exactly-once effects for RabbitMQ integration events on a service's own
//! PostgreSQL database.
//!
//! RabbitMQ delivers at least once: a lost ack, a consumer that crashes
//! mid-message, a redeploy or a retry an hour later hands the same event to
//! the same handlers again. This crate records each processed message's id
//! in an `inbox_messages` table **in the same transaction as the handlers'
//! own writes**, and skips every redelivery. It runs on actix: register a
//! handler per event type, start the [`Runtime`] in the service's actix
//! system, and end it with a signal.
//!
//! ```no_run
//! use rabbit_inbox::{EventHandler, HandlerError, IntegrationEvent, MessageContext, Migration, Runtime, Settings, UnitOfWork};
//!
//! #[derive(serde::Serialize, serde::Deserialize)]
//! struct OrderPlaced { order_id: i64 }
//!
//! impl IntegrationEvent for OrderPlaced {
//!     const TYPE: &'static str = "OrderPlaced"; // the AMQP `type` property
//! }
//!
//! struct RecordOrder;
//!
//! impl EventHandler<OrderPlaced> for RecordOrder {
//!     async fn handle(&self, event: &OrderPlaced, _context: &MessageContext, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
//!         // In the message's transaction, with its inbox row: once, or not at all.
//!         uow.client().execute("INSERT INTO orders (id) VALUES ($1)", &[&event.order_id]).await?;
//!         Ok(())
//!     }
//! }
//!
//! // The service's own tables, migrated with the inbox's, replicas taking turns.
//! const SCHEMA: &[Migration] = &[Migration::new(1, "orders", "CREATE TABLE orders (id bigint PRIMARY KEY)")];
//!
//! #[actix::main]
//! async fn main() -> rabbit_inbox::Result<()> {
//!     let settings = Settings::load()?; // config/*.toml and INBOX__SECTION__KEY, validated
//!     let signal = rabbit_inbox::shutdown_signal()?; // SIGINT or SIGTERM
//!     let runtime = Runtime::builder(settings).migrations(SCHEMA).handler(RecordOrder).start().await?;
//!     runtime.run_until(signal).await; // then drains within runtime.shutdown_timeout
//!     Ok(())
//! }
//! ```
//!
//! # The guarantee
//!
//! - **Exactly once for writes through the unit of work**: the inbox row and
//!   every handler's writes through [`UnitOfWork`] commit in one
//!   transaction, and a message is acked only after its `COMMIT`. What a
//!   handler publishes with [`UnitOfWork::publish`] leaves through the
//!   outbox, after that commit, never before.
//! - **At least once for everything else** a handler touches (another
//!   database, an HTTP call): make those idempotent.
//! - **Never lost, never looped**: a failing message walks immediate
//!   retries, delayed retry tiers and an error queue; one that can never
//!   succeed ([`Permanent`], or malformed) goes there at once; every move is
//!   confirmed by the broker before the original is acked.
//! - **Outages pause, they do not fail**: while the database is away the
//!   messages in flight are held without spending their attempts; the
//!   database and the broker are reconnected by themselves; every wait is
//!   bounded.
//!
//! # Read on
//!
//! [`RuntimeBuilder`] (handlers, migrations, a custom [`store`]),
//! [`Settings`] (every key in `config/default.toml`), [`Monitor`] (health and
//! stats for a service's endpoints), [`metrics`] (the series it records). In
//! the repository: `README.md` (a quickstart: the example service and the
//! tests, two commands), and under `docs/` the guarantees and what the fault
//! suite breaks to check them, the failure policy, the outbox, operations
//! (settings, health, metrics, tracing, clusters), joining a MassTransit
//! estate, and performance.
//!
//! # Where things are
//!
//! At the root of `src/`, the API a handler meets and the engine beneath the
//! actors, one file or folder per module: the handler trait, the message and
//! its context, the unit of work, the settings, the store, the migrations
//! and the error; then the broker (`amqp/`), the database's connections
//! and the one gate they go through (`db/`), the outbox (`outbox/`), the
//! failure policy, the fault headers, trace context, the wire formats and
//! retention. Under `actors/`, the actix actors that run them, and the
//! runtime that wires them (its module documentation draws how).

// README's code compiles with the tests.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

// The API a handler meets.
mod context;
mod error;
mod event;
mod handler;
mod migrations;
pub mod ops;
pub mod settings;
pub mod store;
mod unit_of_work;

// The engine the actors run.
mod amqp;
mod backoff;
mod confirms;
mod db;
mod deliveries;
mod envelope;
mod failures;
mod fault;
mod limits;
mod masstransit;
mod names;
mod outbox;
mod policy;
mod retention;
#[cfg(feature = "testing")]
pub mod testing;
mod tls;
mod trace;

// The actors, and the runtime that wires them.
mod actors;

#[doc(hidden)]
pub mod internal;

pub use actors::metrics;
pub use actors::{
    Health, Monitor, Probe, Publisher, RetentionActor, Runtime, RuntimeBuilder, StatsSnapshot, Sweep,
    shutdown_signal,
};
pub use context::{HeaderValue, Headers, MessageContext};
pub use error::{Error, ErrorKind, HandlerError, Permanent, Result};
pub use event::{IntegrationEvent, Message};
pub use handler::EventHandler;
pub use migrations::Migration;
pub use settings::{Provider, QueueKind, QueueSettings, Settings, ValidSettings, Wire};
pub use trace::TraceContext;
pub use unit_of_work::{Nested, UnitOfWork};

/// The PostgreSQL client a handler writes through ([`UnitOfWork::client`]).
pub use ::tokio_postgres;
/// Message ids ([`Message::id`]).
pub use ::uuid;

/// For producers and operators, outside a runtime: connecting to the
/// broker, declaring a queue (with its retry tiers and error queues, on
/// this library's wire or MassTransit's, or alone, or bound to an event
/// type's exchange), publishing with confirms,
/// replaying what was set aside, reviving dead outbox rows, and the
/// database pool and migrations, as the examples use them.
pub mod tools {
    pub use crate::amqp::{
        AmqpPublisher, ReplayReport, SetAside, bind_to_fanout, connect, declare_queue, declare_topology,
        declare_wire_topology, error_queue, replay, replay_on, retry_queue, skipped_queue,
    };
    pub use crate::db::{create_pool, wait_for_database};
    pub use crate::migrations::migrate;
    pub use crate::outbox::retry_dead;
    /// The pool the database tools return.
    pub use ::deadpool_postgres;
    /// The AMQP client the broker tools take and return.
    pub use ::lapin;
}
