//! Integration tests, against the real PostgreSQL and RabbitMQ on loopback.
//! One binary, so the crates link once.

mod support;

// Redeliveries are skipped: duplicates, ten publishes, two runtimes, a crash between commit and ack.
mod dedup;
// Failing and panicking handlers roll everything back and run again on redelivery.
mod failures;
// Malformed deliveries and types without handlers are set aside, never looped.
mod bad_input;
// The unit of work never returns an open transaction to the pool.
mod unit_of_work;
// Graceful shutdown: drain what is in flight, within the timeout.
mod shutdown;
// Hosting: migrations, the startup warning, in-process, the opt-out, hand-written stores.
mod hosting;
