//! Integration tests, against the real PostgreSQL and RabbitMQ on loopback.
//! One binary, so the crates link once.

mod proxy;
mod support;

// Redeliveries are skipped: duplicates, ten publishes, two runtimes, a crash between commit and ack.
mod dedup;
// Failing and panicking handlers roll everything back and run again on redelivery.
mod failures;
// The failures table: what the queues set aside, drained into one row per message.
mod failures_table;
// The operator plane: its API by role, redrives applied once, jobs' rates, queues paused.
mod operator_plane;
// The operator page in headless Chromium, against the example service.
mod browser;
// The test kit, on the example service's own handlers (shared with the
// examples, which use more of it than the tests do).
#[allow(dead_code, unreachable_pub, clippy::all)]
#[path = "../../examples/common/mod.rs"]
mod common;
mod test_kit;
// README's embedding example: the example word for word, and it works as shown.
mod readme;
// A redrive while two instances of the example service compete for it and are killed.
mod redrive_kills;
// Malformed deliveries go to the error queue, unknown types to the skipped queue, never looped.
mod bad_input;
// Immediate retries, retry tiers, the error queue and its headers, replay.
mod failure_policy;
// The unit of work never returns an open transaction to the pool.
mod unit_of_work;
// Retention: old rows go in batches, one instance per database at a time.
mod retention;
// Batches: one transaction, a savepoint per message, one commit.
mod batching;
// Database failover: a read-only primary, a new primary; held, never retried, processed once.
mod failover;
// Acks: coalesced into `multiple` acks, each delivery settled once, in any order.
mod acks;
// Faults: a database outage pauses consumption; an ended consumer reconnects.
mod faults;
// Graceful shutdown: drain what is in flight, within the timeout.
mod shutdown;
// Hostile input and handler errors: never a hot loop, a crash or a drop.
mod hardening;
// The first hour: services down at start, errors that name their cause, settings found on purpose.
mod startup;
// The outbox: published after the commit, never for a rollback, never blocked, never twice.
mod outbox;
// Hosting: migrations, the startup warning, in-process, the opt-out, hand-written stores.
mod hosting;
// Operability: health through outages and shutdown, metrics by queue and outcome.
mod operability;
// Traces: W3C trace context across publish, the outbox and consume.
mod traces;
// Hardening II: one row, message or handler never stalls, leaks or poisons the others.
mod edges;
// Set-aside copies keep nothing the broker would drop (a TTL) or refuse (a user_id).
mod set_aside;
// MassTransit on the wire: its envelope consumed once, its error and skipped queues and headers.
mod masstransit;
// TLS to both servers, verified (tests/tls_servers.sh).
mod tls;
// A batch's members: each its own context in `handle`; a panic charges its own message only.
mod batch_members;
