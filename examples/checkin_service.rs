//! A conference check-in service: consumes `AttendeeCheckedIn` events and
//! counts check-ins per attendee and attendance per session, exactly once.
//!
//! ```text
//! cargo run --example checkin_service [-- --queue NAME]
//! ```
//!
//! Two handlers write in the message's one transaction, so a redelivery
//! counted twice would show. An event with a negative `attendee_id` fails
//! the first handler on purpose: the failure path, with nothing committed.
//! Honours `DATABASE_URL` and `AMQP_URL`; stop it with Ctrl-C or SIGTERM.

mod common;

use std::time::Duration;

use common::AttendeeCheckedIn;
use inbox::{EventHandler, HandlerError, Settings, UnitOfWork};
use inbox_actors::Runtime;
use tracing_subscriber::EnvFilter;

/// Counts check-ins per attendee; refuses negative attendee ids.
struct CountCheckins;

impl EventHandler<AttendeeCheckedIn> for CountCheckins {
    async fn handle(&self, event: &AttendeeCheckedIn, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
        if event.attendee_id < 0 {
            return Err(format!("attendee_id {} is negative", event.attendee_id).into());
        }
        let client = uow.client();
        let statement = client
            .prepare_cached(
                "INSERT INTO attendee_checkins (attendee_id, checkins) VALUES ($1, 1)
                 ON CONFLICT (attendee_id) DO UPDATE SET checkins = attendee_checkins.checkins + 1",
            )
            .await?;
        client.execute(&statement, &[&event.attendee_id]).await?;
        Ok(())
    }
}

/// Counts attendees per session.
struct CountAttendance;

impl EventHandler<AttendeeCheckedIn> for CountAttendance {
    async fn handle(&self, event: &AttendeeCheckedIn, uow: &mut UnitOfWork) -> Result<(), HandlerError> {
        let client = uow.client();
        let statement = client
            .prepare_cached(
                "INSERT INTO session_attendance (session_id, attendees) VALUES ($1, 1)
                 ON CONFLICT (session_id) DO UPDATE SET attendees = session_attendance.attendees + 1",
            )
            .await?;
        client.execute(&statement, &[&event.session_id]).await?;
        Ok(())
    }
}

/// The service's own tables, created before anything is consumed.
async fn create_tables(settings: &Settings) -> inbox::Result<()> {
    let pool = inbox::create_pool(settings)?;
    pool.get()
        .await?
        .batch_execute(
            "CREATE TABLE IF NOT EXISTS attendee_checkins (attendee_id bigint PRIMARY KEY, checkins bigint NOT NULL);
             CREATE TABLE IF NOT EXISTS session_attendance (session_id bigint PRIMARY KEY, attendees bigint NOT NULL);",
        )
        .await?;
    pool.close();
    Ok(())
}

#[actix::main]
async fn main() -> std::process::ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(EnvFilter::try_from_default_env().unwrap_or_else(|_| EnvFilter::new("info")))
        .init();
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> inbox::Result<()> {
    let settings = common::settings()?;
    create_tables(&settings).await?;
    let runtime = Runtime::builder(settings)
        .handler(CountCheckins)
        .handler(CountAttendance)
        .start()
        .await?;

    // A progress line every few seconds.
    let stats = runtime.shared_stats();
    actix_rt::spawn(async move {
        let mut every = tokio::time::interval(Duration::from_secs(5));
        every.tick().await;
        loop {
            every.tick().await;
            let s = stats.snapshot();
            tracing::info!(
                processed = s.completed,
                duplicates_skipped = s.duplicates,
                failed = s.abandoned,
                set_aside = s.rejected + s.skipped,
                "progress"
            );
        }
    });
    runtime.run_until_signal().await
}
