//! Dispatching: rounds that claim due rows, publish them and settle them
//! in one transaction, and draining, rounds pipelined while they come back
//! full.

use std::time::Duration;

use deadpool_postgres::Pool;
use futures_util::FutureExt;
use futures_util::future::join_all;

use crate::backoff::Backoff;
use crate::error::Result;
use crate::settings::OutboxSettings;
use crate::unit_of_work::UnitOfWork;

use super::{Outgoing, Sink, headers};

/// What one [`dispatch`] round did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DispatchReport {
    /// Rows claimed.
    pub claimed: usize,
    /// The highest `seq` claimed: where a next round may start when this
    /// one was full.
    pub last_seq: Option<i64>,
    /// Published, confirmed and deleted.
    pub dispatched: usize,
    /// Failed to publish, to be tried again after a pause.
    pub failed: usize,
    /// Failed for the last allowed time: parked as dead.
    pub dead: usize,
    /// Not sent because the broker could not be reached or did not answer
    /// (see [`Error::is_broker_unavailable`](crate::Error::is_broker_unavailable)):
    /// left as they were, no attempt spent, for a later round.
    pub unsent: usize,
}

impl DispatchReport {
    /// Whether the round claimed all it could: more may be due.
    pub fn is_full(&self, settings: &OutboxSettings) -> bool {
        self.claimed >= settings.batch_size as usize
    }
}

/// One round: claims up to `outbox.batch_size` due rows in staging order
/// after `seq` `after` (0 for all), publishes them (confirms awaited
/// together, sent in order), deletes the confirmed ones and reschedules or
/// parks the others, in one transaction.
///
/// Why `after`: a queue table's deleted rows stay in its index until
/// vacuumed, and a scan from the start walks past every one of them; a
/// backlog drained from the start would cost more each round. Rounds that
/// follow a full one start after it; a round that is not full is followed
/// by one from the start, which finds rows passed over (retries come due,
/// rows another instance held).
pub async fn dispatch(
    pool: &Pool,
    sink: &dyn Sink,
    settings: &OutboxSettings,
    after: i64,
) -> Result<DispatchReport> {
    let round = Round::claim(pool, settings, after).await?;
    let results = round.publish(sink).await;
    round.settle(results, settings).await
}

/// Dispatches rounds ([`dispatch`]) from the start of the table until one
/// comes back short of `outbox.batch_size`, or `go_on` (called with each
/// round's report) says stop.
///
/// Pipelined: while one round's publishes wait for their confirms, the
/// round before it commits its deletes and the round after it is claimed,
/// so a backlog drains at nearly the broker's confirmed rate rather than
/// that rate plus the database's. Rounds are still published one after the
/// other (a round's first publish waits for the previous round's last
/// confirm), which keeps the rows of one transaction in staging order. A
/// pool of a single connection runs the rounds one after the other.
pub async fn drain(
    pool: &Pool,
    sink: &dyn Sink,
    settings: &OutboxSettings,
    mut go_on: impl FnMut(&DispatchReport) -> bool,
) -> Result<()> {
    if pool.status().max_size < 2 {
        let mut after = 0;
        loop {
            let report = dispatch(pool, sink, settings, after).await?;
            if !go_on(&report) || !report.is_full(settings) {
                return Ok(());
            }
            after = report.last_seq.unwrap_or(after);
        }
    }
    let mut current = Round::claim(pool, settings, 0).await?;
    let mut previous: Option<(Round, Vec<Result<()>>)> = None;
    loop {
        let claim_next = current.is_full(settings);
        let after = current.last_seq().unwrap_or(0);
        let previous_round = previous.take();
        let (results, (settled, next)) = futures_util::future::join(current.publish(sink), async {
            let settled = match previous_round {
                Some((round, results)) => Some(round.settle(results, settings).await),
                None => None,
            };
            // Not once settling failed: the database is likely away.
            let next = match (&settled, claim_next) {
                (Some(Err(_)), _) | (_, false) => None,
                _ => Some(Round::claim(pool, settings, after).await),
            };
            (settled, next)
        })
        .await;
        let stop = match settled {
            Some(Ok(report)) => !go_on(&report),
            // The round just published rolls back with its connection, to
            // be published again (same message_ids).
            Some(Err(e)) => return Err(e),
            None => false,
        };
        match next {
            Some(Ok(next)) if !stop => previous = Some((std::mem::replace(&mut current, next), results)),
            // The table is drained, the claim failed, or it is time to
            // stop: settle what was published, then return.
            next => {
                let report = current.settle(results, settings).await?;
                go_on(&report);
                return match next {
                    Some(Ok(unpublished)) => unpublished.uow.rollback().await,
                    Some(Err(e)) => Err(e),
                    None => Ok(()),
                };
            }
        }
    }
}

/// The rows one round claimed, locked by the transaction that will delete
/// them once confirmed.
struct Round {
    uow: UnitOfWork,
    /// `(seq, attempts)` per row, in the order of `outgoing`.
    rows: Vec<(i64, i32)>,
    outgoing: Vec<Outgoing>,
}

impl Round {
    async fn claim(pool: &Pool, settings: &OutboxSettings, after: i64) -> Result<Self> {
        let uow = UnitOfWork::begin(pool.get().await?).await?;
        // Losing this transaction's commit in a crash costs a resend with
        // the same message_id, which the receiving inbox skips: no need to
        // wait for its flush to disk. And the claim always reads the
        // pending rows' index in seq order, stopping after batch_size:
        // before autovacuum has analyzed a table that filled in a burst,
        // the planner takes `dead_at IS NULL` for rare and picks every
        // matching row through a bitmap, then sorts them, a round costing
        // 25 ms on 50,000 rows, not 2. Sent in the pipeline with BEGIN
        // and the claim, unanswered: were it to fail, the transaction
        // aborts and the claim fails with it.
        let settings_sql = "SET LOCAL synchronous_commit = off; SET LOCAL enable_seqscan = off;
                            SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off";
        if let Some(Err(e)) = uow.client().batch_execute(settings_sql).now_or_never() {
            return Err(e.into());
        }
        let claim = uow
            .client()
            .prepare_cached(
                "SELECT seq, message_id, exchange, routing_key, message_type, headers::text AS headers, body, attempts
                 FROM outbox_messages
                 WHERE dead_at IS NULL AND next_attempt_at <= now() AND seq > $2
                 ORDER BY seq
                 LIMIT $1
                 FOR UPDATE SKIP LOCKED",
            )
            .await?;
        let claimed = uow
            .client()
            .query(&claim, &[&i64::from(settings.batch_size), &after])
            .await?;
        // `try_get`: a column whose type changed under the runtime fails
        // the round with an error that names it, rather than a panic.
        let mut rows = Vec::with_capacity(claimed.len());
        let mut outgoing = Vec::with_capacity(claimed.len());
        for row in &claimed {
            rows.push((row.try_get("seq")?, row.try_get("attempts")?));
            let message_id = row.try_get("message_id")?;
            outgoing.push(Outgoing {
                message_id,
                exchange: row.try_get("exchange")?,
                routing_key: row.try_get("routing_key")?,
                message_type: row.try_get("message_type")?,
                headers: headers(row.try_get("headers")?, message_id),
                body: row.try_get("body")?,
            });
        }
        Ok(Self { uow, rows, outgoing })
    }

    fn is_full(&self, settings: &OutboxSettings) -> bool {
        self.rows.len() >= settings.batch_size as usize
    }

    fn last_seq(&self) -> Option<i64> {
        self.rows.last().map(|&(seq, _)| seq)
    }

    /// Hands every row to `sink` in staging order; the confirms are awaited
    /// together.
    ///
    /// A row the broker refuses by closing the channel (an exchange that
    /// does not exist, a body past its `max_message_size`) fails every
    /// other publish in flight on that channel with the same error. So when
    /// several rows failed so, each goes again alone, one after the other:
    /// only the one that fails alone is charged an attempt, and the others
    /// leave now (again, for those whose confirm the close cut off: the
    /// same `message_id`, which the receiving inbox skips).
    async fn publish(&self, sink: &dyn Sink) -> Vec<Result<()>> {
        let mut results = join_all(self.outgoing.iter().map(|message| sink.send(message))).await;
        let closed = |result: &Result<()>| matches!(result, Err(e) if e.is_channel_closed_by_broker() && !e.is_broker_unavailable());
        if results.iter().filter(|result| closed(result)).count() > 1 {
            tracing::debug!(
                "the broker closed the outbox channel over one publish; sending its rows one at a time"
            );
            for (message, result) in self.outgoing.iter().zip(&mut results) {
                if closed(result) {
                    *result = sink.send(message).await;
                }
            }
        }
        results
    }

    /// Deletes the confirmed rows, reschedules or parks the others, and
    /// commits.
    async fn settle(self, results: Vec<Result<()>>, settings: &OutboxSettings) -> Result<DispatchReport> {
        let mut report = DispatchReport {
            claimed: self.rows.len(),
            last_seq: self.last_seq(),
            ..DispatchReport::default()
        };
        let mut confirmed: Vec<i64> = Vec::new();
        let mut unreachable = None;
        for ((&(seq, attempts), outgoing), result) in self.rows.iter().zip(&self.outgoing).zip(results) {
            let Err(error) = result else {
                confirmed.push(seq);
                continue;
            };
            if error.is_broker_unavailable() {
                // Not the row's doing: a lost node, a broker restarting, an
                // alarm. It stays as it was, due, and goes out with a later
                // round (again, if the broker took it after all: the same
                // message_id, which the receiving inbox skips). An outage
                // parks no row, however long it lasts.
                report.unsent += 1;
                unreachable.get_or_insert(error);
                continue;
            }
            // The row may come from any process: a count below zero counts
            // as none.
            let attempts = attempts.max(0).saturating_add(1);
            let tries = u32::try_from(attempts).unwrap_or(u32::MAX);
            // One the broker will never take is parked at once.
            let dead = tries >= settings.max_attempts || error.kind() == crate::ErrorKind::Unpublishable;
            // Drawn at random below its value: the rows an outage failed
            // together, on every replica, come due apart.
            let pause = Backoff::jitter(Backoff::nth(
                settings.retry_backoff,
                tries - 1,
                settings.max_retry_backoff,
            ));
            let reason =
                crate::fault::truncate(&crate::describe(&error), crate::fault::MAX_REASON_BYTES).into_owned();
            let message_id = outgoing.message_id;
            if dead {
                report.dead += 1;
                tracing::error!(%message_id, attempts, %reason, "outbox message parked as dead after its last attempt");
            } else {
                report.failed += 1;
                tracing::warn!(%message_id, attempts, %reason, "outbox message not published; trying again in {pause:?}");
            }
            self.uow
                .client()
                .execute(
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
            let delete = self
                .uow
                .client()
                .prepare_cached("DELETE FROM outbox_messages WHERE seq = ANY($1)")
                .await?;
            self.uow.client().execute(&delete, &[&confirmed]).await?;
        }
        report.dispatched = confirmed.len();
        self.uow.commit().await?;
        if let Some(error) = unreachable {
            // The dispatcher logs the outage once, at WARN; each round's
            // cause is here.
            tracing::debug!(rows = report.unsent, error = %error, "the broker is unavailable: outbox messages wait for it");
        }
        Ok(report)
    }
}

fn millis(pause: Duration) -> f64 {
    pause.as_secs_f64() * 1000.0
}
