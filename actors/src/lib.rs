//! `inbox-actors`: the actix actors that run [`inbox`].
//!
//! ```text
//! RabbitMQ ─Delivery─▶ ConsumerActor ─Deliver─▶ DedupActor ──Handle──▶ HandlerActor<E>
//!    ▲                 one per queue ◀─Outcome─ owns the pool ◀─Handled─ one per event type
//!    └── ack · Q.retry.<n> · Q.error · Q.skipped
//! ```
//!
//! - [`Runtime`]: built from [`inbox::Settings`] with
//!   [`Runtime::builder`], registers handlers per event type, starts the
//!   actors, drains them at shutdown.
//! - [`ConsumerActor`]: one RabbitMQ queue; settles each delivery from its
//!   [`Outcome`]: ack, immediate retries, a retry tier, `Q.error` or
//!   `Q.skipped`.
//! - [`DedupActor`]: owns the pool; claims the message in the inbox, runs
//!   the handlers in one unit of work, commits or rolls back.
//! - [`HandlerActor`]: the handlers of one event type; a panic fails the
//!   message and restarts the actor, nothing else.
//! - [`RetentionActor`]: deletes inbox rows past `retention.days`, while
//!   the inbox is on.
//! - [`Publisher`]: publishes over the broker, or in process.
//! - [`Stats`]: what happened to the messages, for logs and metrics.

mod acks;
mod availability;
mod consumer;
mod dedup;
mod handler;
mod publisher;
mod retention;
mod runtime;
mod settle;
mod stats;

pub use consumer::{ConsumerActor, Disconnect, Drain, Flush};
pub use dedup::{DedupActor, Deliver, DeliverBatch, Route, Routes};
pub use handler::{Handle, HandleBatch, Handled, HandlerActor, HandlerFailure, Restart};
pub use inbox::{Abandoned, Outcome};
pub use publisher::Publisher;
pub use retention::{RetentionActor, StopSweeping, Sweep};
pub use runtime::{Runtime, RuntimeBuilder};
pub use stats::{Stats, StatsSnapshot};

pub use inbox;
