//! The transactional outbox: publishing what a transaction staged, once it
//! committed.
//!
//! [`UnitOfWork::publish`](crate::UnitOfWork::publish) stages a row of
//! `outbox_messages` in the caller's transaction, written with its
//! `COMMIT`; [`dispatch`] claims due
//! rows (`FOR UPDATE SKIP LOCKED`, leased for `outbox.claim_lease`, so
//! several instances never hold the same row and no transaction stays open
//! across a publish), publishes them with publisher confirms (and
//! `mandatory`, on this library's wire: see [`Sink`]), and deletes the
//! confirmed ones. A crash between the confirm and the delete publishes the
//! row again, with the same `message_id`, which the receiving inbox skips:
//! at-least-once delivery with stable ids, exactly-once effects downstream.
//!
//! A row whose publish fails (unroutable, an exchange that does not exist,
//! a broker error) waits `outbox.retry_backoff`, doubled after each next
//! failure up to `outbox.max_retry_backoff`; after `outbox.max_attempts` it
//! is parked as dead with its last error, and never blocks the others.
//!
//! One concern a file: `staging.rs` (a message on its way out, and the
//! rows written with the `COMMIT`), `sink.rs` (where dispatched rows go), `dispatch.rs` (rounds,
//! and draining them), `backlog.rs` (what waits, sampled), `listen.rs`
//! (waking on other processes' commits), `admin.rs` (reviving dead rows).

mod admin;
mod backlog;
mod dispatch;
mod listen;
mod sink;
pub(crate) mod staging;

pub use admin::retry_dead;
pub(crate) use backlog::Backlog;
pub(crate) use backlog::backlog;
pub(crate) use dispatch::DispatchReport;
pub(crate) use dispatch::dispatch;
pub(crate) use dispatch::drain;
pub(crate) use listen::{ListenTo, listen};
pub use sink::Sink;
pub use staging::Outgoing;
