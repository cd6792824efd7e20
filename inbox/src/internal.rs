//! What this repository's tests, benches and examples reach below the API
//! (feeding the dedup actor directly, the live counters, the broker's and
//! the outbox's parts, the wire formats): hidden from the documentation,
//! not part of the API, and under no semver promise.

pub use crate::actors::{DedupActor, Deliver, DeliverBatch, Stats, latency_bound};
pub use crate::context::{CAUSATION_ID, CORRELATION_ID};
pub use crate::envelope::Envelope;
pub use crate::error::describe;
pub use crate::migrations::run_migrations;
pub use crate::outbox::{Outgoing, Sink};
pub use crate::policy::{Abandoned, Outcome};

/// A retention sweep on `pool`, as the runtime's sweeper runs one.
pub async fn sweep(
    pool: &deadpool_postgres::Pool,
    retention: &crate::settings::RetentionSettings,
) -> crate::Result<crate::retention::SweepReport> {
    crate::retention::sweep(&pool.clone().into(), retention, false).await
}

/// [`sweep`], failures nobody resolved kept (as with `failures.drain`).
pub async fn sweep_keeping_failures(
    pool: &deadpool_postgres::Pool,
    retention: &crate::settings::RetentionSettings,
) -> crate::Result<crate::retention::SweepReport> {
    crate::retention::sweep(&pool.clone().into(), retention, true).await
}

/// Drains the outbox as the runtime's dispatcher does (rounds pipelined,
/// every lease held renewed) until a round comes back short.
pub async fn drain_outbox(
    pool: &deadpool_postgres::Pool,
    sink: &dyn Sink,
    settings: &crate::settings::OutboxSettings,
) -> crate::Result<()> {
    crate::outbox::drain(&pool.clone().into(), sink, settings, |_| true).await
}

/// One outbox round on `pool`: claim, publish, settle.
pub async fn dispatch(
    pool: &deadpool_postgres::Pool,
    sink: &dyn Sink,
    settings: &crate::settings::OutboxSettings,
    after: i64,
) -> crate::Result<crate::outbox::DispatchReport> {
    crate::outbox::dispatch(&pool.clone().into(), sink, settings, after).await
}

/// [`Settings::load`](crate::Settings::load) from the files in `dir`, for
/// the environment `inbox_env` (the tests' `config/test.toml`), whatever
/// `INBOX_CONFIG_DIR` and `INBOX_ENV` say.
pub fn load_settings(dir: &std::path::Path, inbox_env: Option<&str>) -> crate::Result<crate::ValidSettings> {
    crate::Settings::load_layered(dir, inbox_env, None)
}

/// The TLS connector the runtime's PostgreSQL connections use, for
/// `settings.database.url`.
pub fn pg_tls(settings: &crate::Settings) -> crate::Result<tokio_postgres_rustls::MakeRustlsConnect> {
    settings.pg_tls()
}

/// The dedup actor of `runtime`, to feed it deliveries directly.
pub fn dedup_of(runtime: &crate::Runtime) -> &actix::Addr<DedupActor> {
    runtime.dedup()
}

/// A unit of work on `connection`, as the runtime opens one (the tests of
/// its guard against pooling an open transaction).
pub async fn begin(connection: ::deadpool_postgres::Object) -> crate::Result<crate::UnitOfWork> {
    crate::UnitOfWork::begin(connection.into()).await
}

/// The fault headers a set-aside copy carries.
pub mod fault {
    pub use crate::fault::{FailureHistory, Fault, MAX_REASON_BYTES, headers};
}

/// MassTransit's envelope and names.
pub mod masstransit {
    pub use crate::masstransit::{
        ENVELOPE_CONTENT_TYPE, FAULT_EXCHANGE, RAW_JSON_CONTENT_TYPE, decode, fault_exchange, headers,
        message_urn, properties,
    };
}

/// The outbox's parts a test watches.
pub mod outbox {
    /// What waits in the outbox of `pool`'s database.
    pub async fn backlog(pool: &deadpool_postgres::Pool) -> crate::Result<crate::outbox::Backlog> {
        crate::outbox::backlog(&pool.clone().into()).await
    }
}

/// W3C trace context in AMQP headers, as the runtime reads and writes it.
pub mod trace {
    use lapin::types::FieldTable;

    use crate::TraceContext;

    /// `traceparent` (and `tracestate`), if valid.
    pub fn parse(traceparent: &str, tracestate: Option<&str>) -> Option<TraceContext> {
        TraceContext::parse(traceparent, tracestate)
    }

    /// The trace context `headers` carry, if valid.
    pub fn read(headers: &FieldTable) -> Option<TraceContext> {
        TraceContext::from_headers(headers)
    }

    /// Writes `trace` into `headers`.
    pub fn write(trace: &TraceContext, headers: &mut FieldTable) {
        trace.insert_into(headers);
    }
}
