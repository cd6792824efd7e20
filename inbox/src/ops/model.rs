//! What the operator plane reads and answers, as its JSON API says it
//! (docs/operations.md, "The operations API"): the names here are the
//! contract.

use std::time::SystemTime;

use serde::{Deserialize, Serialize, Serializer};
use uuid::Uuid;

/// Which failures: the list's query keys, every one optional, all of them
/// together.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Filter {
    /// The queue it failed on (`outbox` for dead outbox rows).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub queue: Option<String>,
    /// `error`, `skipped` or `dead_outbox`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub kind: Option<String>,
    /// `open`, `redriving`, `redriven` or `discarded`.
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub status: Option<String>,
    /// The message's type.
    #[serde(
        rename = "type",
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub message_type: Option<String>,
    /// The cause's fingerprint (see [`Group`]).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub fingerprint: Option<String>,
    /// Failed last at or after this time (RFC 3339).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub since: Option<String>,
    /// Failed last before this time (RFC 3339).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub until: Option<String>,
    /// Found in its reason, type, handler or message id (case ignored).
    #[serde(
        default,
        skip_serializing_if = "Option::is_none",
        deserialize_with = "blank_is_none"
    )]
    pub text: Option<String>,
}

/// A form's empty field is no filter.
fn blank_is_none<'de, D: serde::Deserializer<'de>>(deserializer: D) -> Result<Option<String>, D::Error> {
    let value = Option::<String>::deserialize(deserializer)?;
    Ok(value.filter(|text| !text.trim().is_empty()))
}

impl Filter {
    /// Whether it selects every failure.
    pub fn is_empty(&self) -> bool {
        self == &Filter::default()
    }
}

/// The failures an action is for: by id, or every one a filter matches
/// when the action starts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Selection {
    /// These failures.
    Ids(Vec<Uuid>),
    /// Every failure the filter matches.
    Filter(Filter),
}

/// One failure, as the list shows it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureSummary {
    /// The failure's id (not the message's).
    pub id: Uuid,
    /// The message's id; `null` for one without a valid id (malformed).
    pub message_id: Option<Uuid>,
    /// The queue it failed on (`outbox` for a dead outbox row).
    pub queue: String,
    /// `error`, `skipped` or `dead_outbox`.
    pub kind: String,
    /// `open`, `redriving`, `redriven` or `discarded`.
    pub status: String,
    /// The message's type, when it says one.
    #[serde(rename = "type")]
    pub message_type: Option<String>,
    /// Why it failed, as its failure headers say.
    pub reason: Option<String>,
    /// What groups the same cause across messages.
    pub fingerprint: String,
    /// The attempts it was given.
    pub attempts: i32,
    /// When it first failed.
    #[serde(serialize_with = "rfc3339")]
    pub first_failed_at: SystemTime,
    /// When it last failed.
    #[serde(serialize_with = "rfc3339")]
    pub last_failed_at: SystemTime,
}

/// One failure with everything kept of it.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct FailureDetail {
    /// What the list shows.
    #[serde(flatten)]
    pub summary: FailureSummary,
    /// The handler that failed (`broker` when the broker dead-lettered it,
    /// `outbox` for a dead outbox row).
    pub handler: Option<String>,
    /// The queue it was set aside in.
    pub set_aside_in: String,
    /// How many times it was set aside (it failed again after a redrive).
    pub times_failed: i32,
    /// Its AMQP properties (for a dead outbox row: where it was going).
    pub properties: serde_json::Value,
    /// Its AMQP headers.
    pub headers: serde_json::Value,
    /// Its body, as text (bytes that are not UTF-8 shown replaced).
    pub body: String,
    /// The job that last took it.
    pub job_id: Option<Uuid>,
    /// Why it was discarded.
    pub discard_reason: Option<String>,
}

/// The open failures of one cause.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Group {
    /// The cause's fingerprint: the filter that selects the group.
    pub fingerprint: String,
    /// Its message type.
    #[serde(rename = "type")]
    pub message_type: Option<String>,
    /// Its handler.
    pub handler: Option<String>,
    /// The reason of its latest failure.
    pub reason: Option<String>,
    /// How many failures it has, by the group's filter.
    pub count: i64,
    /// The queues they failed on.
    pub queues: Vec<String>,
    /// Its latest failure.
    #[serde(serialize_with = "rfc3339")]
    pub last_failed_at: SystemTime,
}

/// An action on a selection: a redrive, which runs at its rate on any
/// instance, or a discard or restore, done when created.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Job {
    /// Its id (nil for a dry run).
    pub id: Uuid,
    /// `redrive`, `discard` or `restore`.
    pub action: String,
    /// `running`, `paused`, `cancelled`, `done`, or `dry_run`.
    pub status: String,
    /// The failures it took.
    pub total: i32,
    /// Those it has redriven, discarded or restored.
    pub done: i32,
    /// Redriven ones that failed again since.
    pub failed_again: i64,
    /// Its rate, for a redrive (`null`: as fast as the outbox goes).
    pub rate_per_second: Option<i32>,
    /// Who started it.
    pub actor: String,
    /// Why.
    pub reason: Option<String>,
    /// Why it paused itself.
    pub paused_reason: Option<String>,
    /// When it was created.
    #[serde(serialize_with = "rfc3339")]
    pub created_at: SystemTime,
    /// When it last changed.
    #[serde(serialize_with = "rfc3339")]
    pub updated_at: SystemTime,
}

/// A line of the audit: who did what, when, to which messages, and why.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct AuditEntry {
    /// Its place in the audit (later entries have higher numbers).
    pub seq: i64,
    /// When.
    #[serde(serialize_with = "rfc3339")]
    pub at: SystemTime,
    /// The token's name.
    pub actor: String,
    /// Its role.
    pub role: String,
    /// `redrive`, `discard`, `restore`, `pause_job`, `resume_job`,
    /// `cancel_job`, `pause_queue` or `resume_queue`.
    pub action: String,
    /// Why, as the actor said.
    pub reason: Option<String>,
    /// What it was done to: `{"ids": [...]}`, `{"filter": {...}}`,
    /// `{"job": id}` or `{"queue": name}`.
    pub target: serde_json::Value,
    /// How many messages it took.
    pub affected: i32,
    /// Its job.
    pub job_id: Option<Uuid>,
}

/// A queue an operator paused.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PausedQueue {
    /// Its name.
    pub queue: String,
    /// Who paused it.
    pub paused_by: String,
    /// When.
    #[serde(serialize_with = "rfc3339")]
    pub paused_at: SystemTime,
    /// Why.
    pub reason: Option<String>,
}

/// A page of a list, and where the next one starts (`null` at the end).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Page<T> {
    /// This page's items.
    pub items: Vec<T>,
    /// The cursor of the next page: pass it as `after`.
    pub next: Option<String>,
}

/// A time as RFC 3339, to the microsecond (PostgreSQL's precision).
pub(crate) fn rfc3339<S: Serializer>(time: &SystemTime, serializer: S) -> Result<S::Ok, S::Error> {
    serializer.collect_str(&humantime::format_rfc3339_micros(*time))
}
