//! `inbox`: the core of `inbox-actors`, which runs it as actix actors. A
//! service depends on `inbox-actors`: it re-exports what a service uses,
//! and its crate documentation is the place to start.
//!
//! At this crate's root: the handler trait and the unit of work, the
//! message and its context, the settings, the migrations and the error.
//! Under [`internal`], under no semver promise: the engine itself, for the
//! runtime crate and this repository's tests and tools (the broker, the
//! outbox, the failure policy, the fault headers, trace context, the wire
//! formats, retention).

mod context;
mod error;
mod event;
mod handler;
mod migrations;
pub mod settings;
pub mod store;
mod unit_of_work;

pub mod internal;
// Inside the crate, the engine's modules and items by their short names,
// as they were at the root (`crate::amqp`, `crate::describe`).
#[allow(unused_imports)]
use internal::*;

pub use context::MessageContext;
pub use error::{Error, ErrorKind, HandlerError, Permanent, Result};
pub use event::{IntegrationEvent, Message};
pub use handler::EventHandler;
pub use migrations::Migration;
pub use settings::{Provider, QueueKind, QueueSettings, Settings, ValidSettings, Wire};
pub use unit_of_work::{Nested, UnitOfWork};

// The dependencies a service meets in these signatures (the unit of work's
// client, message ids), so it never fights a version mismatch.
pub use ::tokio_postgres;
pub use ::uuid;
