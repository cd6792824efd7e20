//! The transactional outbox: publishing what a transaction staged, once it
//! committed.
//!
//! [`UnitOfWork::publish`](crate::UnitOfWork::publish) writes a row of
//! `outbox_messages` in the caller's transaction; [`dispatch`] claims due
//! rows (`FOR UPDATE SKIP LOCKED`, so several instances never hold the same
//! row), publishes them with publisher confirms and `mandatory`, and deletes
//! the confirmed ones in the transaction that claimed them. A crash between
//! the confirm and the delete publishes the row again, with the same
//! `message_id`, which the receiving inbox skips: at-least-once delivery
//! with stable ids, exactly-once effects downstream.
//!
//! A row whose publish fails (unroutable, an exchange that does not exist,
//! a broker error) waits `outbox.retry_backoff`, doubled after each next
//! failure up to `outbox.max_retry_backoff`; after `outbox.max_attempts` it
//! is parked as dead with its last error, and never blocks the others.

use std::time::Duration;

use deadpool_postgres::Pool;
use futures_util::future::join_all;
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use uuid::Uuid;

use crate::amqp::AmqpPublisher;
use crate::backoff::Backoff;
use crate::envelope::JSON;
use crate::error::Result;
use crate::settings::OutboxSettings;

/// AMQP `delivery_mode` for messages that survive a broker restart.
const PERSISTENT: u8 = 2;

/// What one [`dispatch`] round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// Published, confirmed and deleted.
    pub dispatched: usize,
    /// Failed to publish, to be tried again after a pause.
    pub failed: usize,
    /// Failed for the last allowed time: parked as dead.
    pub dead: usize,
}

/// One round: claims up to `outbox.batch_size` due rows in staging order,
/// publishes them (confirms awaited together, sent in order), deletes the
/// confirmed ones and reschedules or parks the others, in one transaction.
pub async fn dispatch(
    pool: &Pool,
    publisher: &AmqpPublisher,
    settings: &OutboxSettings,
) -> Result<DispatchReport> {
    let mut connection = pool.get().await?;
    let tx = connection.transaction().await?;
    let rows = tx
        .query(
            "SELECT seq, message_id, exchange, routing_key, message_type, headers::text AS headers, body, attempts
             FROM outbox_messages
             WHERE dead_at IS NULL AND next_attempt_at <= now()
             ORDER BY seq
             LIMIT $1
             FOR UPDATE SKIP LOCKED",
            &[&i64::from(settings.batch_size)],
        )
        .await?;
    let mut report = DispatchReport {
        claimed: rows.len(),
        ..DispatchReport::default()
    };
    if rows.is_empty() {
        tx.commit().await?;
        return Ok(report);
    }
    // Handed to lapin in staging order; the confirms are awaited together.
    let publishes = rows.iter().map(|row| {
        let message_id: Uuid = row.get("message_id");
        let exchange: &str = row.get("exchange");
        let routing_key: &str = row.get("routing_key");
        let message_type: &str = row.get("message_type");
        let body: &[u8] = row.get("body");
        let properties = BasicProperties::default()
            .with_message_id(message_id.to_string().into())
            .with_type(message_type.into())
            .with_content_type(JSON.into())
            .with_delivery_mode(PERSISTENT)
            .with_headers(headers(row.get("headers")));
        publisher.publish_to(exchange, routing_key, properties, body)
    });
    let results = join_all(publishes).await;

    let mut confirmed: Vec<i64> = Vec::new();
    for (row, result) in rows.iter().zip(results) {
        let seq: i64 = row.get("seq");
        let Err(error) = result else {
            confirmed.push(seq);
            continue;
        };
        let attempts = row.get::<_, i32>("attempts").saturating_add(1);
        let tries = u32::try_from(attempts).unwrap_or(u32::MAX);
        let dead = tries >= settings.max_attempts;
        let pause = Backoff::nth(settings.retry_backoff, tries - 1, settings.max_retry_backoff);
        let reason =
            crate::fault::truncate(&crate::describe(&error), crate::fault::MAX_REASON_BYTES).into_owned();
        let message_id: Uuid = row.get("message_id");
        if dead {
            report.dead += 1;
            tracing::error!(%message_id, attempts, %reason, "outbox message parked as dead after its last attempt");
        } else {
            report.failed += 1;
            tracing::warn!(%message_id, attempts, %reason, "outbox message not published; trying again in {pause:?}");
        }
        tx.execute(
            "UPDATE outbox_messages
             SET attempts = $2, last_error = $3,
                 next_attempt_at = now() + $4 * interval '1 millisecond',
                 dead_at = CASE WHEN $5 THEN now() END
             WHERE seq = $1",
            &[&seq, &attempts, &reason, &millis(pause), &dead],
        )
        .await?;
    }
    if !confirmed.is_empty() {
        tx.execute("DELETE FROM outbox_messages WHERE seq = ANY($1)", &[&confirmed])
            .await?;
    }
    tx.commit().await?;
    report.dispatched = confirmed.len();
    Ok(report)
}

/// The row's headers (a JSON object of strings, as staging writes them) as
/// AMQP headers.
fn headers(json: &str) -> FieldTable {
    let mut table = FieldTable::default();
    if let Ok(serde_json::Value::Object(map)) = serde_json::from_str(json) {
        for (key, value) in map {
            if let serde_json::Value::String(text) = value {
                table.insert(key.as_str().into(), AMQPValue::LongString(text.as_str().into()));
            }
        }
    }
    table
}

fn millis(pause: Duration) -> f64 {
    pause.as_secs_f64() * 1000.0
}
