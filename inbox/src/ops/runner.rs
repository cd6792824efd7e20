//! Redrive jobs, advanced a slice at a time by whichever instance takes
//! the job's row first (`FOR UPDATE SKIP LOCKED`): the slice's failures
//! are staged as outbox rows under their own message ids and marked
//! `redriven`, and the job's progress and pace move on, in one
//! transaction. A crash anywhere leaves the job where its last commit left
//! it; whoever takes it next goes on from there.
//!
//! The pace is kept in the job's row (`next_at`: the earliest time its next
//! message may be staged), so a rate holds whichever instance runs the
//! job, and across restarts: a slice of `n` moves it `n / rate` seconds on,
//! from now if the job fell behind (a stopped job does not catch up in a
//! burst).
//!
//! A redriven message that fails again comes back to its failure row (the
//! drainer opens it again). When at least [`FAILED_AGAIN_MIN`] of a job's
//! messages did, and they are more than its `failures.pause_redrive_at`
//! share of those redriven, the job pauses itself and says why: the cause
//! is likely not fixed. Once an operator resumes it, only what it redrives
//! from then on counts.

use std::time::{Duration, SystemTime};

use tokio_postgres::types::ToSql;
use uuid::Uuid;

use super::OpsResult;

/// The most failures staged in one transaction.
pub(crate) const MAX_SLICE: i64 = 500;
/// Slices a second, for a job with a rate.
const SLICES_PER_SECOND: i64 = 5;
/// How many of a job's messages must fail again before it pauses itself.
pub(crate) const FAILED_AGAIN_MIN: i64 = 10;

/// How many failures a job at `rate` stages at once.
pub(crate) fn slice(rate: Option<i32>) -> i64 {
    match rate {
        None => MAX_SLICE,
        Some(rate) => (i64::from(rate) / SLICES_PER_SECOND).clamp(1, MAX_SLICE),
    }
}

/// When the job may stage again, having staged `staged` at `now`: its
/// pace moved on by `staged / rate` seconds, from `now` if it fell behind.
pub(crate) fn next_at(next_at: SystemTime, now: SystemTime, rate: Option<i32>, staged: i64) -> SystemTime {
    let Some(rate) = rate.filter(|rate| *rate > 0) else {
        return now;
    };
    let from = next_at.max(now);
    from + Duration::from_secs_f64(staged.max(0) as f64 / f64::from(rate))
}

/// What one [`advance`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct Advanced {
    /// The job it advanced, if one was due.
    pub(crate) job: Option<Uuid>,
    /// Failures staged.
    pub(crate) staged: u64,
}

/// How long a job whose slice failed waits before it is tried again.
const AFTER_A_FAILED_SLICE: Duration = Duration::from_secs(30);

/// Advances one due job by a slice, if one is due and free. A slice that
/// fails with the database still there (a row it cannot stage) rolls
/// back, and its job waits [`AFTER_A_FAILED_SLICE`] before it is tried
/// again, said at WARN: the other jobs, due before it again, go on.
pub(crate) async fn advance(client: &mut tokio_postgres::Client, pause_at: f64) -> OpsResult<Advanced> {
    let mut taken = None;
    let failed = match advance_taken(client, pause_at, &mut taken).await {
        Ok(advanced) => return Ok(advanced),
        Err(failed) => failed,
    };
    let Some(job) = taken.filter(|_| !client.is_closed()) else {
        return Err(failed);
    };
    tracing::warn!(%job, error = %failed, "a redrive's slice failed and was rolled back; the job is tried again in {AFTER_A_FAILED_SLICE:?}");
    client
        .execute(
            "UPDATE inbox_ops_jobs SET next_at = now() + $2 * interval '1 second' WHERE id = $1",
            &[&job, &AFTER_A_FAILED_SLICE.as_secs_f64()],
        )
        .await?;
    Ok(Advanced {
        job: Some(job),
        staged: 0,
    })
}

/// [`advance`], noting in `taken` the job it took.
async fn advance_taken(
    client: &mut tokio_postgres::Client,
    pause_at: f64,
    taken: &mut Option<Uuid>,
) -> OpsResult<Advanced> {
    let tx = client.transaction().await?;
    let Some(job) = tx
        .query_opt(
            "SELECT id, rate_per_second, next_at, done, coalesce(resumed_at, created_at) AS since FROM inbox_ops_jobs
             WHERE status = 'running' AND next_at <= now()
             ORDER BY next_at LIMIT 1 FOR UPDATE SKIP LOCKED",
            &[],
        )
        .await?
    else {
        return Ok(Advanced::default());
    };
    let id: Uuid = job.try_get("id")?;
    *taken = Some(id);
    let rate: Option<i32> = job.try_get("rate_per_second")?;
    let paced_to: SystemTime = job.try_get("next_at")?;
    let done: i32 = job.try_get("done")?;
    let since: SystemTime = job.try_get("since")?;
    let rows = tx
        .query(
            "SELECT id, queue, kind, message_id, coalesce(message_type, '') AS message_type,
                    properties, headers, body
             FROM inbox_failures WHERE job_id = $1 AND status = 'redriving'
             ORDER BY last_failed_at, id LIMIT $2 FOR UPDATE",
            &[&id, &slice(rate)],
        )
        .await?;
    let mut staged = Vec::with_capacity(rows.len());
    let mut queues = Vec::with_capacity(rows.len());
    for row in &rows {
        let failure: Uuid = row.try_get("id")?;
        let message_id: Uuid = row.try_get("message_id")?;
        let queue: String = row.try_get("queue")?;
        let kind: String = row.try_get("kind")?;
        let message_type: String = row.try_get("message_type")?;
        let properties: serde_json::Value = row.try_get("properties")?;
        let headers: serde_json::Value = row.try_get("headers")?;
        let body: Vec<u8> = row.try_get("body")?;
        match kind.as_str() {
            "dead_outbox" => {
                stage_dead_outbox_row(&tx, message_id, &message_type, &properties, &headers, &body).await?
            }
            _ => {
                let restored = crate::amqp::restored_json(&properties, without_failure_headers(headers));
                let params: [&(dyn ToSql + Sync); 5] = [&message_id, &queue, &message_type, &body, &restored];
                tx.execute(
                    "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body, properties)
                     VALUES ($1, '', $2, $3, '{}', $4, $5)
                     ON CONFLICT (message_id) DO NOTHING",
                    &params,
                )
                .await?;
            }
        }
        staged.push(failure);
        queues.push(queue);
    }
    if !staged.is_empty() {
        tx.execute(
            "UPDATE inbox_failures SET status = 'redriven', redriven_at = now(), updated_at = now()
             WHERE id = ANY($1)",
            &[&staged],
        )
        .await?;
    }
    let now: SystemTime = tx.query_one("SELECT now()", &[]).await?.try_get(0)?;
    let count = staged.len() as i64;
    let finished = count < slice(rate);
    let done = i64::from(done) + count;
    // Weighed over what it redrove since it started, or since an operator
    // last resumed it over the failures that paused it.
    let weighed = tx
        .query_one(
            "SELECT count(*) FILTER (WHERE status = 'open' AND last_failed_at > redriven_at), count(*)
             FROM inbox_failures WHERE job_id = $1 AND redriven_at >= $2",
            &[&id, &since],
        )
        .await?;
    let (failed_again, redriven): (i64, i64) = (weighed.try_get(0)?, weighed.try_get(1)?);
    let pause =
        !finished && failed_again >= FAILED_AGAIN_MIN && failed_again as f64 > pause_at * redriven as f64;
    let (status, paused_reason) = match (finished, pause) {
        (true, _) => ("done", None),
        (false, true) => (
            "paused",
            Some(format!(
                "paused itself: {failed_again} of the {redriven} messages it redrove failed again (more than {:.0}%); \
                 fix the cause, then resume it",
                pause_at * 100.0
            )),
        ),
        (false, false) => ("running", None),
    };
    tx.execute(
        "UPDATE inbox_ops_jobs SET done = $2, next_at = $3, status = $4, paused_reason = $5, updated_at = now()
         WHERE id = $1",
        &[
            &id,
            &i32::try_from(done).unwrap_or(i32::MAX),
            &next_at(paced_to, now, rate, count),
            &status,
            &paused_reason,
        ],
    )
    .await?;
    tx.commit().await?;
    for queue in &queues {
        crate::actors::metrics::failure_redriven(queue);
    }
    if let Some(why) = &paused_reason {
        tracing::warn!(job = %id, "redrive {why}");
    } else if finished {
        tracing::info!(job = %id, redriven = done, "redrive done");
    }
    Ok(Advanced {
        job: Some(id),
        staged: count as u64,
    })
}

/// A dead outbox row, revived: due at once, its attempts afresh. Gone
/// meanwhile (retention, or a revive by other means that was dispatched):
/// staged again from its failure row.
async fn stage_dead_outbox_row(
    tx: &tokio_postgres::Transaction<'_>,
    message_id: Uuid,
    message_type: &str,
    properties: &serde_json::Value,
    headers: &serde_json::Value,
    body: &[u8],
) -> OpsResult<()> {
    let revived = tx
        .execute(
            "UPDATE outbox_messages SET dead_at = NULL, attempts = 0, last_error = NULL, next_attempt_at = now(),
                    lease = NULL
             WHERE message_id = $1 AND dead_at IS NOT NULL",
            &[&message_id],
        )
        .await?;
    if revived == 0 {
        let text = |key: &str| {
            properties
                .get(key)
                .and_then(serde_json::Value::as_str)
                .unwrap_or_default()
                .to_owned()
        };
        tx.execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
             VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (message_id) DO NOTHING",
            &[
                &message_id,
                &text("exchange"),
                &text("routing_key"),
                &message_type,
                headers,
                &body,
            ],
        )
        .await?;
    }
    Ok(())
}

/// A failure's headers without those that say it failed (this library's,
/// MassTransit's, the broker's dead-lettering): redriven, it starts
/// afresh, its attempts unspent, as [`crate::tools::replay`] does.
fn without_failure_headers(headers: serde_json::Value) -> serde_json::Map<String, serde_json::Value> {
    let serde_json::Value::Object(mut headers) = headers else {
        return serde_json::Map::new();
    };
    let dropped = crate::fault::headers::ALL
        .iter()
        .chain(&crate::fault::headers::BROKER_OWNED)
        .chain(&crate::masstransit::headers::SET_ASIDE)
        .chain(&crate::masstransit::headers::HOST);
    for key in dropped {
        headers.remove(*key);
    }
    headers
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A rate holds over any stretch of time, whatever the instance's
    /// polling: the pace is simulated on a clock of its own, polled every
    /// 37 ms (off the slices' beat) for a minute.
    #[test]
    fn a_rate_holds_over_any_stretch_of_time() {
        for rate in [1, 3, 10, 250, 5000] {
            let start = SystemTime::UNIX_EPOCH + Duration::from_secs(1_000_000);
            let (mut clock, mut paced_to) = (start, start);
            let mut stamps = Vec::new();
            while clock < start + Duration::from_secs(60) {
                if paced_to <= clock {
                    let n = slice(Some(rate));
                    stamps.extend(std::iter::repeat_n(clock, n as usize));
                    paced_to = next_at(paced_to, clock, Some(rate), n);
                }
                clock += Duration::from_millis(37);
            }
            let per_second = stamps.len() as f64 / 60.0;
            assert!(
                per_second <= f64::from(rate) * 1.01 && per_second >= f64::from(rate) * 0.9,
                "rate {rate}: {per_second} a second"
            );
            // No second holds more than a rate and one slice.
            for (i, at) in stamps.iter().enumerate() {
                let within = stamps[i..]
                    .iter()
                    .take_while(|t| **t < *at + Duration::from_secs(1))
                    .count();
                assert!(
                    within as i64 <= i64::from(rate) + slice(Some(rate)),
                    "rate {rate}: {within} in a second"
                );
            }
        }
    }

    #[test]
    fn a_job_that_fell_behind_does_not_catch_up_in_a_burst() {
        let long_ago = SystemTime::UNIX_EPOCH;
        let now = long_ago + Duration::from_secs(3600);
        assert_eq!(
            next_at(long_ago, now, Some(10), 2),
            now + Duration::from_millis(200)
        );
        assert_eq!(next_at(long_ago, now, None, 500), now);
    }

    #[test]
    fn a_redriven_copy_keeps_its_own_headers_and_none_of_its_failure() {
        let headers = serde_json::json!({
            "x-inbox-reason": "boom", "x-inbox-attempts": 3, "x-death": [], "MT-Fault-Message": "m",
            "MT-Host-MachineName": "h", "tenant": "acme", "traceparent": "00-1-2-01"
        });
        let kept = without_failure_headers(headers);
        assert_eq!(
            kept.keys().map(String::as_str).collect::<Vec<_>>(),
            ["tenant", "traceparent"]
        );
    }
}
