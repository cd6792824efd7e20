//! README's embedding example, as it stands there (a test checks that
//! the two are the same, and runs this against the local services):
//! `cargo run --example embedding`.

use rabbit_inbox::{
    EventHandler, HandlerError, IntegrationEvent, MessageContext, Migration, QueueSettings, Runtime,
    Settings, UnitOfWork,
};

#[derive(serde::Serialize, serde::Deserialize)]
struct AttendeeCheckedIn {
    attendee_id: i64,
    session_id: i64,
}

impl IntegrationEvent for AttendeeCheckedIn {
    const TYPE: &'static str = "AttendeeCheckedIn"; // the AMQP `type` property
}

struct CountCheckins;

impl EventHandler<AttendeeCheckedIn> for CountCheckins {
    async fn handle(
        &self,
        event: &AttendeeCheckedIn,
        _message: &MessageContext, // its id, headers, attempt, correlation
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        // Runs inside the message's transaction, with the inbox row.
        uow.client()
            .execute(
                "INSERT INTO attendee_checkins VALUES ($1, 1)
                 ON CONFLICT (attendee_id) DO UPDATE SET checkins = attendee_checkins.checkins + 1",
                &[&event.attendee_id],
            )
            .await?;
        Ok(())
    }
}

// The service's own schema: applied once each, in order, under the same
// lock as the inbox's tables, so replicas starting together take turns.
const SCHEMA: &[Migration] = &[Migration::new(
    1,
    "attendee_checkins",
    "CREATE TABLE attendee_checkins (attendee_id bigint PRIMARY KEY, checkins bigint)",
)];

#[actix::main]
async fn main() -> rabbit_inbox::Result<()> {
    // config/default.toml, config/$INBOX_ENV.toml (or INBOX_CONFIG_DIR), then
    // INBOX__DATABASE__URL, INBOX__MESSAGE_BUS__AMQP_URLS..., validated; and the
    // queue it consumes (or `[[queues]] name = "..."` in a settings file).
    let settings =
        Settings::load()?.with(|s| s.queues.push(QueueSettings::new("embedded.attendee-checked-in")))?;
    let signal = rabbit_inbox::shutdown_signal()?; // SIGINT or SIGTERM
    // Connects, migrates (the inbox's tables, then SCHEMA), declares the queues, consumes.
    let runtime = Runtime::builder(settings)
        .migrations(SCHEMA)
        .handler(CountCheckins)
        .start()
        .await?;
    // Until the signal, then drains within runtime.shutdown_timeout.
    runtime.run_until(signal).await;
    Ok(())
}
