//! What the check-in examples share: the event, and settings from
//! `config/` plus the conventional environment and command line.

// Each example compiles this module on its own and uses part of it.
#![allow(dead_code)]

use inbox::{IntegrationEvent, QueueSettings, Settings};
use serde::{Deserialize, Serialize};

/// The queue the check-in service consumes unless `--queue` says otherwise.
pub const DEFAULT_QUEUE: &str = "checkin.attendee-checked-in";

/// An attendee checked in to a session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttendeeCheckedIn {
    pub attendee_id: i64,
    pub session_id: i64,
}

impl IntegrationEvent for AttendeeCheckedIn {
    const TYPE: &'static str = "AttendeeCheckedIn";
}

/// The value after `--name` on the command line.
pub fn arg(name: &str) -> Option<String> {
    let mut args = std::env::args().skip_while(|a| a != name);
    args.next()?;
    args.next()
}

/// `--name` parsed, or `default`; exits with a clear message on a bad value.
pub fn parsed_arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    match arg(name) {
        None => default,
        Some(text) => text.parse().unwrap_or_else(|_| {
            eprintln!("{name}: cannot read `{text}`");
            std::process::exit(2);
        }),
    }
}

/// `config/` (with `INBOX_ENV`) and `INBOX__…`, then `DATABASE_URL` and
/// `AMQP_URL`, then `--queue`: the queue to consume (default
/// [`DEFAULT_QUEUE`] when the settings list none).
pub fn settings() -> inbox::Result<Settings> {
    let mut settings = Settings::load()?;
    settings.apply_conventional_urls();
    if let Some(queue) = arg("--queue") {
        settings.queues = vec![QueueSettings::new(queue)];
    } else if settings.queues.is_empty() {
        settings.queues = vec![QueueSettings::new(DEFAULT_QUEUE)];
    }
    settings.validate()?;
    Ok(settings)
}
