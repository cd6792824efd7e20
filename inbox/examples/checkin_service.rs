//! A conference check-in service: consumes `AttendeeCheckedIn` events and
//! counts check-ins per attendee and attendance per session, exactly once.
//!
//! ```text
//! cargo run --example checkin_service [-- --queue NAME] [--batch-size N] [--prefetch N] [--abort-on-attendee ID]
//!     [--forward-to QUEUE] [--http ADDR [--ops-tokens FILE]] [--wire inbox|masstransit]
//! cargo run --example checkin_service -- --remove [--queue NAME]
//! ```
//!
//! It uses the database `checkin` (created if missing) unless
//! `DATABASE_URL` or the settings' `database.url` name another than the
//! maintenance database `postgres`. `--remove` drops that database (not
//! one `DATABASE_URL` names) and deletes the queue and the queues kept
//! beside it, then exits: what the quickstart created, gone.
//!
//! The deliveries that are ready together commit together, in batches of
//! up to 16 (group commit, `queues[].batch_size`), which the handlers write
//! with one set-based statement each; `--batch-size N` sets the size, and
//! `--batch-size 1` processes each message in its own transaction.
//! `--prefetch N` sets how many deliveries may be in flight (default 32,
//! `queues[].prefetch`).
//!
//! `--forward-to QUEUE` declares QUEUE (durable, quorum) and, for every
//! check-in it records, stages one `CheckinRecorded` follow-up for QUEUE
//! through the outbox, in the same transaction as its counts: a fresh
//! `message_id`, the body `{"attendee_id", "session_id",
//! "source_message_id"}`. A refused check-in forwards nothing.
//!
//! `--wire masstransit` speaks MassTransit 8 (docs/masstransit.md): it
//! consumes `Conference.Contracts:AttendeeCheckedIn`
//! (`{"attendeeId", "sessionId"}` in MassTransit's envelope), which a
//! producer publishes to the exchange of that name with an empty routing
//! key; errors go to `Q_error`, unknown types to `Q_skipped`; with
//! `--forward-to F`, F is bound to the fanout exchange
//! `Conference.Contracts:CheckinRecorded`, and each check-in stages one
//! `CheckinRecorded` envelope (`{"attendeeId", "sessionId",
//! "sourceMessageId"}`) with what a MassTransit consumer's follow-up
//! gets: the handled envelope's headers but MassTransit's own (`MT-`), its
//! `initiatorId` the handled `correlationId` (else `requestId`), its
//! `conversationId` carried over, no `correlationId`, and the trace as
//! `MT-Activity-Id` and `traceparent`).
//!
//! `--http ADDR` (`127.0.0.1:9464`, say) serves, with actix-web on the
//! runtime's own actix system:
//! - `GET /health/live`: 200 while the runtime's actors run, else 503;
//! - `GET /health/ready`: 200 when every queue is consumed over a live
//!   connection, the database answers and the service is not stopping,
//!   else 503;
//! - `GET /metrics`: the runtime's metrics, in Prometheus' text format.
//!
//! With `--ops-tokens FILE` (one `NAME ROLE TOKEN` a line), it drains its
//! error and skipped queues into the failures table (`failures.drain`)
//! and serves the operator plane beside them: the page at `/ops/` and the
//! JSON API at `/ops/v1/` (docs/operations.md, "On call"). Without it,
//! nothing under `/ops` is served and nothing is drained.
//!
//! The health bodies are JSON: `{"ok": true, "reasons": []}`, the reasons
//! saying what is wrong (and `"paused"`, the queues an operator paused). One SIGINT or SIGTERM stops the server and the
//! runtime together, their drains overlapping (docs/operations.md).
//!
//! `--abort-on-attendee ID` is a crash-loop demonstration: the process
//! aborts (`std::process::abort`) whenever it handles a check-in of
//! attendee ID, before anything commits. The broker hands that message out
//! again after every restart, until its queue's `delivery_limit` moves it
//! to the error queue. Never use it for anything else.
//!
//! Two handlers write in the message's one transaction, so a redelivery
//! counted twice would show. An event with a negative `attendee_id` fails
//! the first handler on purpose: the failure path, with nothing committed.
//! Honours `DATABASE_URL` and `AMQP_URL`; stop it with Ctrl-C or SIGTERM.

// The event, the two handlers and the tables live in common/mod.rs, shared
// with the publisher and the throughput benchmark.
mod common;

use std::time::Duration;

use actix_web::{App, HttpResponse, HttpServer, web};
use common::{AttendeeCheckedIn, CheckIn, CountAttendance, CountCheckins, ForwardCheckins};
use metrics_exporter_prometheus::PrometheusHandle;
use rabbit_inbox::{
    EventHandler, HandlerError, IntegrationEvent, MessageContext, Monitor, Probe, Runtime, RuntimeBuilder,
    UnitOfWork, Wire,
};
use tracing_subscriber::EnvFilter;

#[actix::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        // Colours for a terminal only: a log file or collector gets plain
        // `key=value` lines, and each message's span fields are formatted
        // without escape codes.
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stdout()))
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// What `--help` prints.
const USAGE: &str =
    "usage: checkin_service [--queue NAME] [--batch-size N] [--prefetch N] [--abort-on-attendee ID]
                       [--forward-to QUEUE] [--http ADDR [--ops-tokens FILE]] [--wire inbox|masstransit]
       checkin_service --remove [--queue NAME] [--wire inbox|masstransit]
(inbox/examples/checkin_service.rs says what each does)";

async fn run() -> common::Result<()> {
    common::check_flags(
        USAGE,
        &[
            "queue",
            "batch-size",
            "prefetch",
            "abort-on-attendee",
            "forward-to",
            "http",
            "ops-tokens",
            "wire",
        ],
        &["remove"],
    );
    let mut settings = common::settings()?;
    if common::arg("--remove").is_some() {
        return remove(&settings).await;
    }
    let wire = settings.message_bus.wire;
    // Before the runtime is built: it registers its metrics as it builds.
    let http = match common::arg("--http") {
        Some(address) => Some((address, common::install_prometheus()?)),
        None => None,
    };
    // The operator plane: its tokens read (and refused) before anything
    // starts, and the failures drained into the table it shows.
    let access = match common::arg("--ops-tokens") {
        None => None,
        Some(_) if http.is_none() => {
            return Err("--ops-tokens serves the operator plane: it needs --http".into());
        }
        Some(file) => {
            settings = settings.with(|settings| {
                settings.failures.drain = true;
                settings.failures.token_files = vec![file.into()];
            })?;
            Some(rabbit_inbox::ops::access::Access::from_settings(&settings)?)
        }
    };
    if let Some(name) = common::own_database(&settings) {
        common::create_database(&settings, &name).await?;
    }
    // Together, so that a batch larger than the default window is checked
    // against the window given beside it.
    let prefetch = common::arg("--prefetch").map(|_| common::parsed_arg("--prefetch", 16u16));
    let batch_size = common::arg("--batch-size").map(|_| common::parsed_arg("--batch-size", 1u16));
    if prefetch.is_some() || batch_size.is_some() {
        settings = settings.with(|settings| {
            for queue in &mut settings.queues {
                queue.prefetch = prefetch.unwrap_or(queue.prefetch);
                queue.batch_size = batch_size.unwrap_or(queue.batch_size);
            }
        })?;
    }
    let forward_to = common::arg("--forward-to");
    // The queue for follow-ups before the first message is consumed.
    if let Some(queue) = &forward_to {
        let recorded = match wire {
            Wire::Inbox => None,
            Wire::Masstransit => Some(common::masstransit::CheckinRecorded::TYPE),
        };
        declare_forward_queue(&settings, queue, recorded).await?;
    }
    // Listening before consuming starts: a SIGTERM from then on drains.
    let signal = rabbit_inbox::shutdown_signal()?;
    let builder = Runtime::builder(settings).migrations(common::SCHEMA);
    let runtime = match wire {
        Wire::Inbox => with_handlers::<AttendeeCheckedIn>(builder, forward_to.as_deref()),
        Wire::Masstransit => {
            with_handlers::<common::masstransit::AttendeeCheckedIn>(builder, forward_to.as_deref())
        }
    }
    .start()
    .await?;

    // A progress line every few seconds.
    let stats = runtime.monitor();
    actix_rt::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        every.tick().await;
        loop {
            every.tick().await;
            let s = stats.stats();
            tracing::info!(
                processed = s.completed,
                duplicates_skipped = s.duplicates,
                failed = s.abandoned,
                set_aside = s.rejected + s.skipped,
                batches = s.batches,
                "progress"
            );
        }
    });
    match http {
        Some((address, metrics)) => serve(runtime, signal, &address, metrics, access).await,
        None => {
            runtime.run_until(signal).await;
            Ok(())
        }
    }
}

/// What the HTTP endpoints read.
#[derive(Clone)]
struct Endpoints {
    health: Monitor,
    metrics: PrometheusHandle,
}

/// Runs the runtime and the HTTP server on `address` until one signal
/// stops both: the docs/operations.md pattern, one signal handler for the
/// whole service and both drains at once.
async fn serve(
    runtime: Runtime,
    signal: impl Future<Output = ()> + 'static,
    address: &str,
    metrics: PrometheusHandle,
    access: Option<rabbit_inbox::ops::access::Access>,
) -> common::Result<()> {
    let endpoints = Endpoints {
        health: runtime.monitor(),
        metrics,
    };
    let operations = runtime.operations();
    let access_served = access.is_some();
    let server = HttpServer::new(move || {
        let app = App::new()
            .app_data(web::Data::new(endpoints.clone()))
            .route("/health/live", web::get().to(live))
            .route("/health/ready", web::get().to(ready))
            .route("/metrics", web::get().to(render_metrics));
        match &access {
            Some(access) => app.service(rabbit_inbox::ops::http::scope(
                "/ops",
                operations.clone(),
                access.clone(),
            )),
            None => app,
        }
    })
    .workers(1)
    .disable_signals() // one signal handler for the whole service
    .shutdown_timeout(20) // within runtime.shutdown_timeout, below the grace period
    .bind(address)
    .map_err(|e| common::BoxError::from(format!("--http {address}: cannot listen: {e}")))?
    .run();
    // The first line as it always was: scripts wait for it.
    tracing::info!(%address, "serving /health/live, /health/ready and /metrics");
    if access_served {
        tracing::info!(%address, "serving the operator plane: the page at /ops/, the API at /ops/v1/");
    }
    let http = server.handle();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    actix_rt::spawn(async move {
        signal.await;
        let _ = stop.send(());
        http.stop(true).await; // graceful: finishes the requests in flight
    });
    // Both drain at once: the whole stop takes the longer of the two.
    let (served, ()) = tokio::join!(
        server,
        runtime.run_until(async {
            let _ = stopped.await;
        })
    );
    served.map_err(|e| common::BoxError::from(format!("the HTTP server failed: {e}")))
}

async fn live(endpoints: web::Data<Endpoints>) -> HttpResponse {
    probe(endpoints.health.live())
}

async fn ready(endpoints: web::Data<Endpoints>) -> HttpResponse {
    probe(endpoints.health.ready().await)
}

/// 200 or 503, with the probe as JSON.
fn probe(probe: Probe) -> HttpResponse {
    let mut response = match probe.ok {
        true => HttpResponse::Ok(),
        false => HttpResponse::ServiceUnavailable(),
    };
    response.json(probe)
}

async fn render_metrics(endpoints: web::Data<Endpoints>) -> HttpResponse {
    HttpResponse::Ok()
        .content_type("text/plain; version=0.0.4")
        .body(endpoints.metrics.render())
}

/// The service's handlers for check-ins of contract `E` (this library's,
/// or MassTransit's with `--wire masstransit`), in registration order.
fn with_handlers<E: CheckIn>(mut builder: RuntimeBuilder, forward_to: Option<&str>) -> RuntimeBuilder {
    if common::arg("--abort-on-attendee").is_some() {
        let attendee_id = common::parsed_arg("--abort-on-attendee", 0i64);
        tracing::warn!(
            attendee_id,
            "--abort-on-attendee: this process aborts on that attendee's check-ins"
        );
        builder = builder.handler::<E, _>(AbortOn { attendee_id });
    }
    builder = builder
        .handler::<E, _>(CountCheckins)
        .handler::<E, _>(CountAttendance);
    if let Some(queue) = forward_to {
        builder = builder.handler::<E, _>(ForwardCheckins {
            queue: queue.to_owned(),
        });
    }
    builder
}

/// Kills the process on one attendee's check-ins: a poison message that
/// crashes its consumer on every delivery (`--abort-on-attendee`).
struct AbortOn {
    attendee_id: i64,
}

impl<E: CheckIn> EventHandler<E> for AbortOn {
    async fn handle(
        &self,
        event: &E,
        _context: &MessageContext,
        _uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.attendee_id() == self.attendee_id {
            eprintln!(
                "checkin_service: aborting on attendee {} (--abort-on-attendee)",
                self.attendee_id
            );
            std::process::abort();
        }
        Ok(())
    }
}

/// Drops the service's database and deletes its queues (`--remove`).
async fn remove(settings: &rabbit_inbox::Settings) -> common::Result<()> {
    let connection = rabbit_inbox::tools::connect(settings, "checkin_service --remove").await?;
    let channel = connection.create_channel().await?;
    let wire = settings.message_bus.wire;
    for queue in &settings.queues {
        let q = queue.name.as_str();
        let tiers = queue.failure_policy(&settings.failure).delays.len();
        let kept = (1..=tiers).map(|tier| wire.retry_queue(q, tier));
        for name in kept.chain([wire.error_queue(q), wire.skipped_queue(q), q.to_owned()]) {
            let deleted = channel
                .queue_delete(name.as_str().into(), Default::default())
                .await?;
            println!("deleted queue {name} ({deleted} messages)");
            if wire == Wire::Masstransit && !name.contains("_retry_") {
                // MassTransit's endpoints have an exchange of their name.
                channel
                    .exchange_delete(name.as_str().into(), Default::default())
                    .await?;
            }
        }
    }
    connection.close(200, "removed".into()).await?;
    if let Some(name) = common::own_database(settings) {
        common::drop_database(settings, &name).await?;
        println!("dropped database {name}");
    }
    Ok(())
}

/// Declares the queue follow-ups go to, durable, idempotently: quorum;
/// with MassTransit's wire classic and bound to the fanout exchange of
/// their type `recorded`, as a MassTransit consumer's endpoint of it
/// declares it (so that one can start on it).
async fn declare_forward_queue(
    settings: &rabbit_inbox::Settings,
    queue: &str,
    recorded: Option<&str>,
) -> common::Result<()> {
    let connection = rabbit_inbox::tools::connect(settings, "checkin_service --forward-to").await?;
    let channel = connection.create_channel().await?;
    let wire = match recorded {
        Some(_) => rabbit_inbox::Wire::Masstransit,
        None => rabbit_inbox::Wire::Inbox,
    };
    rabbit_inbox::tools::declare_queue(&channel, queue, rabbit_inbox::QueueKind::default_on(wire)).await?;
    if let Some(exchange) = recorded {
        rabbit_inbox::tools::bind_to_fanout(&channel, queue, exchange).await?;
    }
    connection.close(200, "declared".into()).await?;
    Ok(())
}
