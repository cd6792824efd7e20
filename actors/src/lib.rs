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
//! use inbox_actors::{EventHandler, HandlerError, IntegrationEvent, Migration, Runtime, Settings, UnitOfWork};
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
//!     async fn handle(&self, event: &OrderPlaced, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
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
//! async fn main() -> inbox_actors::Result<()> {
//!     let settings = Settings::load()?; // config/*.toml and INBOX__SECTION__KEY, validated
//!     let signal = inbox_actors::shutdown_signal()?; // SIGINT or SIGTERM
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
//! # How it runs
//!
//! How a message flows through the actors is drawn in `docs/guarantees.md`
//! ("How a message flows").
//!
//! The actors, one file each, with the messages they take:
//! - `ConsumerActor` (`consumer.rs`): one RabbitMQ queue. Sends `Deliver`
//!   (or `DeliverBatch`) to the dedup actor, and carries out what the
//!   failure policy (`inbox::internal::decide`) makes of each `Outcome` (`settle.rs`): ack, hold,
//!   retry, or move to a retry tier, `Q.error` or `Q.skipped`. Takes
//!   `Drain` and `Disconnect` at shutdown, `Flush` from itself.
//! - `DedupActor` (`dedup.rs`): owns the pool; claims the message in the
//!   inbox, sends `Handle` (or `HandleBatch`) to the event type's handler
//!   actor, commits or rolls back on its `Handled` reply, replies the
//!   `Outcome`.
//! - `HandlerActor<E>` (`handler.rs`): the handlers of one event type; a
//!   panic fails the message, and the actor restarts (`Restart`), building
//!   anew the handlers registered with
//!   [`handler_factory`](RuntimeBuilder::handler_factory).
//! - `OutboxActor` (`outbox.rs`): dispatches the rows units of work staged
//!   in `outbox_messages`, woken by commits (in process and through
//!   `LISTEN`) and by its poll; samples the backlog. Takes
//!   `StopDispatching` at shutdown.
//! - [`RetentionActor`] (`retention.rs`): deletes inbox rows and dead outbox rows past
//!   `retention.days` while the inbox is on; [`Sweep`] sweeps now.
//!
//! Beside them: `batch.rs` (the dedup actor's batch path), `link.rs` (a
//! queue's connection, and reconnecting it), `acks.rs` (the window of
//! unsettled deliveries), `availability.rs` (the gate that waits out a
//! database outage), `health.rs` (liveness and readiness), `monitor.rs`
//! (the handle on health and stats), `metrics.rs` (what the runtime
//! records through the `metrics` facade), `publisher.rs`, `stats.rs`,
//! `runtime.rs`.

// README's code compiles with the tests, as it did when it was a crate doc.
#[cfg(doctest)]
#[doc = include_str!("../../README.md")]
struct ReadmeDoctests;

mod acks;
mod availability;
mod batch;
mod consumer;
mod dedup;
mod handler;
mod health;
mod link;
pub mod metrics;
mod monitor;
mod outbox;
mod publisher;
mod retention;
mod runtime;
mod settle;
mod stats;

// What a service uses, at one root: the runtime and what it hands out,
// then the core's handler, message, unit of work, settings and error.
pub use health::{Health, Probe};
pub use monitor::Monitor;
pub use publisher::Publisher;
pub use runtime::{Runtime, RuntimeBuilder, shutdown_signal};
pub use stats::StatsSnapshot;

/// The PostgreSQL client a handler writes through ([`UnitOfWork::client`]).
pub use inbox::tokio_postgres;
/// Message ids ([`Message::id`]).
pub use inbox::uuid;
pub use inbox::{
    Error, ErrorKind, EventHandler, HandlerError, IntegrationEvent, Message, MessageContext, Migration,
    Nested, Permanent, Provider, QueueKind, QueueSettings, Result, Settings, UnitOfWork, ValidSettings, Wire,
};

/// Every section of [`Settings`], for settings built in code.
pub mod settings {
    pub use inbox::settings::{
        DatabaseSettings, FailureSettings, MessageBusSettings, OutboxSettings, Provider, QueueKind,
        QueueSettings, RetentionSettings, RuntimeSettings, Settings, ValidSettings, Wire,
    };
}

/// Where processed message ids are recorded: PostgreSQL (the default), none,
/// or a store of your own ([`RuntimeBuilder::inbox_store`]).
pub mod store {
    pub use inbox::store::{Claim, InboxKey, InboxStore, NoopInboxStore, PgInboxStore};
}

/// For producers and operators, outside a runtime: connecting to the
/// broker, declaring a queue (with its retry tiers and error queues, or
/// alone, or bound to an event type's exchange), publishing with confirms,
/// replaying what was set aside, reviving dead outbox rows, and the
/// database pool and migrations, as the examples use them.
pub mod tools {
    pub use inbox::internal::amqp::{
        ReplayReport, SetAside, bind_to_fanout, connect, declare_queue, declare_topology, error_queue,
        replay, replay_on, retry_queue, skipped_queue,
    };
    /// The pool the database tools return.
    pub use inbox::internal::deadpool_postgres;
    /// The AMQP client the broker tools take and return.
    pub use inbox::internal::lapin;
    pub use inbox::internal::outbox::retry_dead;
    pub use inbox::internal::{AmqpPublisher, create_pool, migrate, wait_for_database};
}

/// Sweeping inbox rows now, rather than at the next `retention.interval`:
/// send [`Sweep`] to [`Runtime::retention`].
pub use retention::{RetentionActor, Sweep};

/// The engine's parts this repository's tests and tools reach into
/// (feeding the dedup actor directly, the live counters, the core crate):
/// not part of the API, and under no semver promise.
#[doc(hidden)]
pub mod internal {
    pub use crate::dedup::{DedupActor, Deliver, DeliverBatch};
    pub use crate::stats::{Stats, latency_bound};
    pub use inbox;
    pub use inbox::internal::{Abandoned, Outcome};
}
