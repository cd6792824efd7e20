//! `inbox-actors`: the actix actors that run [`inbox`]. How a message
//! flows through them, drawn: docs/guarantees.md, "How a message flows".
//!
//! A service touches the [`Runtime`]: built from [`inbox::Settings`] with
//! [`Runtime::builder`], it registers a handler per event type,
//! [`start`](RuntimeBuilder::start)s (database, migrations, topology,
//! consuming), then [`run_until`](Runtime::run_until) a shutdown future,
//! and drains within one timeout. It hands out a [`Publisher`] and a
//! [`Monitor`] (health and stats).
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
//!   `LISTEN`) and by its poll; samples the backlog and sweeps dead rows.
//!   Takes `StopDispatching` at shutdown.
//! - [`RetentionActor`] (`retention.rs`): deletes inbox rows past
//!   `retention.days` while the inbox is on; [`Sweep`] sweeps now.
//!
//! Beside them: `batch.rs` (the dedup actor's batch path), `link.rs` (a
//! queue's connection, and reconnecting it), `acks.rs` (the window of
//! unsettled deliveries), `availability.rs` (the gate that waits out a
//! database outage), `health.rs` (liveness and readiness), `monitor.rs`
//! (the handle on health and stats), `metrics.rs` (what the runtime
//! records through the `metrics` facade), `publisher.rs`, `stats.rs`,
//! `runtime.rs`.

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
