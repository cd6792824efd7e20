//! The actix actors that run the engine, and the runtime that wires them.
//!
//! How a message flows through the actors is drawn in `docs/guarantees.md`
//! ("How a message flows").
//!
//! The actors, one file each, with the messages they take:
//! - `ConsumerActor` (`consumer.rs`): one RabbitMQ queue. Sends `Deliver`
//!   (or `DeliverBatch`) to the dedup actor, and carries out what the
//!   failure policy (`decide` in `policy.rs`) makes of each `Outcome`
//!   (`settle.rs`): ack, hold, retry, or move to a retry tier, `Q.error`
//!   or `Q.skipped`. Takes
//!   `Drain` and `Disconnect` at shutdown, `Flush` from itself.
//! - `DedupActor` (`dedup.rs`): owns the inbox store; claims the message in the
//!   inbox, runs the event type's handlers in its unit of work through
//!   their `Route`, commits or rolls back on what they return (`Handled`),
//!   replies the `Outcome`.
//! - `HandlerActor<E>` (`handler.rs`): the supervised actor of one event
//!   type's handlers, which its `Route` holds and runs while the actor
//!   runs; a panic fails the message,
//!   builds anew the handlers registered with
//!   [`handler_factory`](RuntimeBuilder::handler_factory), and restarts the
//!   actor (`Restart`).
//! - `OutboxActor` (`outbox.rs`): dispatches the rows units of work staged
//!   in `outbox_messages`, woken by commits (in process and through
//!   `LISTEN`) and by its poll; samples the backlog. Takes
//!   `StopDispatching` at shutdown.
//! - [`RetentionActor`] (`retention.rs`): deletes inbox rows and dead outbox rows past
//!   `retention.days` while the inbox is on; [`Sweep`] sweeps now.
//! - `FailureDrainer` (`drainer.rs`): with `failures.drain`, moves what the
//!   queues set aside into `inbox_failures`. Takes `StopDraining` at
//!   shutdown.
//!
//! Beside them: `batch.rs` (the dedup actor's batch path), `link.rs` (a
//! queue's connection, and reconnecting it), `acks.rs` (the window of
//! unsettled deliveries), `availability.rs` (the gate that waits out a
//! database outage), `health.rs` (liveness and readiness), `monitor.rs`
//! (the handle on health and stats), `metrics.rs` (what the runtime
//! records through the `metrics` facade), `tally.rs` (what both count),
//! `publisher.rs`, `stats.rs`, `runtime.rs`.

mod acks;
mod availability;
mod batch;
mod consumer;
mod dedup;
mod drainer;
mod handler;
mod health;
mod link;
pub mod metrics;
mod monitor;
mod operator;
mod outbox;
mod publisher;
mod retention;
mod runtime;
mod settle;
mod stats;
mod tally;

// What the crate's root offers a service.
pub use health::{Health, Probe};
pub use monitor::Monitor;
pub use publisher::Publisher;
/// Sweeping inbox rows now, rather than at the next `retention.interval`:
/// send [`Sweep`] to [`Runtime::retention`].
pub use retention::{RetentionActor, Sweep};
pub use runtime::{Runtime, RuntimeBuilder, shutdown_signal};
pub use stats::StatsSnapshot;

// What this repository's tests and benches reach (`crate::internal`).
pub use dedup::{DedupActor, Deliver, DeliverBatch};
pub(crate) use handler::HandledTypes;
#[cfg(feature = "testing")]
pub(crate) use handler::{decode_event, panic_message as panic_text};
pub use stats::{Stats, latency_bound};
