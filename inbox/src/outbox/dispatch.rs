//! Dispatching: rounds that claim due rows, publish them and settle them,
//! and draining, rounds pipelined while they come back full.
//!
//! No transaction stays open across a publish: a round claims its rows by
//! leasing them (their `next_attempt_at` moved past the publish, and a
//! token of the round's written in `lease`, in a short transaction of its
//! own), and settles in another short transaction. A transaction held open
//! across a publish would be ended by the server's
//! `idle_in_transaction_session_timeout` during an alarm, its confirmed
//! rows' delete lost and the rows sent again, and it would hold back vacuum
//! meanwhile.
//!
//! Every lease a dispatcher holds is renewed while it holds it
//! ([`Leases`]): the round publishing, and, while a drain pipelines them,
//! the round claimed after it and the one settling before it, however long
//! the broker takes (an alarm can hold a confirm for minutes). A renewal
//! matches the round's token, not the lease's end it last wrote, so one
//! whose answer was lost after its `UPDATE` committed leaves nothing out of
//! date.

use std::future::Future;
use std::sync::Mutex;
use std::time::Duration;

use futures_util::FutureExt;
use futures_util::future::join_all;
use uuid::Uuid;

use crate::Error;
use crate::backoff::Backoff;
use crate::db::Connections;
use crate::error::Result;
use crate::settings::OutboxSettings;
use crate::unit_of_work::UnitOfWork;

use super::sink::Sink;
use super::staging::{Outgoing, headers};

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
/// after `seq` `after` (0 for all), leased for `outbox.claim_lease`;
/// publishes them (confirms awaited together, sent in order), renewing the
/// lease while that lasts; then deletes the confirmed ones and reschedules
/// or parks the others.
///
/// Why `after`: a queue table's deleted rows stay in its index until
/// vacuumed, and a scan from the start walks past every one of them; a
/// backlog drained from the start would cost more each round. Rounds that
/// follow a full one start after it; a round that is not full is followed
/// by one from the start, which finds rows passed over (retries come due,
/// rows another instance held).
pub(crate) async fn dispatch(
    connections: &Connections,
    sink: &dyn Sink,
    settings: &OutboxSettings,
    after: i64,
) -> Result<DispatchReport> {
    let leases = Leases::default();
    leases
        .kept_during(
            connections,
            settings,
            Round::run(connections, sink, settings, after, &leases),
        )
        .await
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
pub(crate) async fn drain(
    connections: &Connections,
    sink: &dyn Sink,
    settings: &OutboxSettings,
    go_on: impl FnMut(&DispatchReport) -> bool,
) -> Result<()> {
    let leases = Leases::default();
    leases
        .kept_during(
            connections,
            settings,
            drain_holding(connections, sink, settings, go_on, &leases),
        )
        .await
}

/// [`drain`], its rounds' leases held in `leases`.
async fn drain_holding(
    connections: &Connections,
    sink: &dyn Sink,
    settings: &OutboxSettings,
    mut go_on: impl FnMut(&DispatchReport) -> bool,
    leases: &Leases,
) -> Result<()> {
    if connections.pool_size() < 2 {
        let mut after = 0;
        loop {
            let report = Round::run(connections, sink, settings, after, leases).await?;
            if !go_on(&report) || !report.is_full(settings) {
                return Ok(());
            }
            after = report.last_seq.unwrap_or(after);
        }
    }
    let mut current = Round::claim(connections, settings, 0, leases).await?;
    let mut previous: Option<(Round, Vec<Result<()>>)> = None;
    loop {
        let claim_next = current.is_full(settings);
        let after = current.last_seq().unwrap_or(0);
        let previous_round = previous.take();
        let (results, (settled, next)) = futures_util::future::join(current.send_all(sink), async {
            let settled = match previous_round {
                Some((round, results)) => Some(round.settle(connections, results, settings, leases).await),
                None => None,
            };
            // Not once settling failed: the database is likely away.
            let next = match (&settled, claim_next) {
                (Some(Err(_)), _) | (_, false) => None,
                _ => Some(Round::claim(connections, settings, after, leases).await),
            };
            (settled, next)
        })
        .await;
        let stop = match settled {
            Some(Ok(report)) => !go_on(&report),
            // The database is likely away. The round just published, and
            // the one claimed, stay leased: published again (same
            // message_ids) once their lease ends.
            Some(Err(e)) => return Err(e),
            None => false,
        };
        match next {
            Some(Ok(next)) if !stop => previous = Some((std::mem::replace(&mut current, next), results)),
            // The table is drained, the claim failed, or it is time to
            // stop: settle what was published, then return.
            next => {
                let report = current.settle(connections, results, settings, leases).await?;
                go_on(&report);
                return match next {
                    Some(Ok(unpublished)) => unpublished.release(connections, leases).await,
                    Some(Err(e)) => Err(e),
                    None => Ok(()),
                };
            }
        }
    }
}

/// The leases one dispatcher holds: a token per round claimed and not yet
/// settled or released, with its rows.
#[derive(Default)]
struct Leases(Mutex<Vec<(Uuid, Vec<i64>)>>);

impl Leases {
    fn held(&self) -> std::sync::MutexGuard<'_, Vec<(Uuid, Vec<i64>)>> {
        self.0.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn hold(&self, round: &Round) {
        if !round.rows.is_empty() {
            self.held().push((round.lease, round.seqs()));
        }
    }

    fn let_go(&self, lease: Uuid) {
        self.held().retain(|(held, _)| *held != lease);
    }

    /// Runs `work`, renewing every lease held meanwhile every third of
    /// `outbox.claim_lease`. A renewal that fails (the database away) is
    /// tried again at the next; should the lease run out meanwhile, another
    /// dispatcher may send the rows too, with the same message_ids.
    async fn kept_during<T>(
        &self,
        connections: &Connections,
        settings: &OutboxSettings,
        work: impl Future<Output = T>,
    ) -> T {
        let work = std::pin::pin!(work);
        let renewing = std::pin::pin!(async {
            loop {
                tokio::time::sleep(settings.claim_lease / 3).await;
                if let Err(e) = self.renew(connections, settings).await {
                    tracing::debug!(error = %e, "cannot renew the outbox rounds' leases; trying again");
                }
            }
        });
        match futures_util::future::select(work, renewing).await {
            futures_util::future::Either::Left((done, _)) => done,
            futures_util::future::Either::Right((never, _)) => never,
        }
    }

    /// Moves the lease's end `claim_lease` ahead on every row still held
    /// (a row whose lease ran out and that another dispatcher claimed has
    /// another token), in one statement.
    async fn renew(&self, connections: &Connections, settings: &OutboxSettings) -> Result<()> {
        let (tokens, seqs): (Vec<Uuid>, Vec<i64>) = {
            let held = self.held();
            let tokens = held.iter().map(|(lease, _)| *lease).collect();
            (
                tokens,
                held.iter().flat_map(|(_, seqs)| seqs.iter().copied()).collect(),
            )
        };
        if tokens.is_empty() {
            return Ok(());
        }
        connections
            .get()
            .await
            .map_err(Error::client)?
            .execute(
                "UPDATE outbox_messages SET next_attempt_at = now() + $3 * interval '1 millisecond'
                 WHERE seq = ANY($1) AND lease = ANY($2)",
                &[&seqs, &tokens, &millis(settings.claim_lease)],
            )
            .await
            .map_err(Error::client)?;
        Ok(())
    }
}

/// The rows one round claimed: leased to it, their `next_attempt_at` moved
/// to the lease's end, which no other dispatcher's claim passes.
struct Round {
    /// `(seq, attempts)` per row, in the order of `outgoing`.
    rows: Vec<(i64, i32)>,
    outgoing: Vec<Outgoing>,
    /// The round's token, written into every row it claimed: what says a
    /// row is still this round's. A row whose lease ran out and that
    /// another round claimed has another.
    lease: Uuid,
}

/// The settings of a round's short transactions. Losing a commit in a
/// crash costs a resend with the same message_id, which the receiving
/// inbox skips: no need to wait for its flush to disk. And the claim
/// always reads the pending rows' index in seq order, stopping after
/// batch_size: before autovacuum has analyzed a table that filled in a
/// burst, the planner takes `dead_at IS NULL` for rare and picks every
/// matching row through a bitmap, then sorts them, a round costing 25 ms
/// on 50,000 rows, not 2.
const ROUND_SETTINGS: &str = "SET LOCAL synchronous_commit = off; SET LOCAL enable_seqscan = off;
                              SET LOCAL enable_bitmapscan = off; SET LOCAL enable_sort = off";

/// A short transaction for a round's statements, [`ROUND_SETTINGS`] sent in
/// the pipeline with BEGIN and the first statement, unanswered: were they
/// to fail, the transaction aborts and that statement with it.
async fn round_transaction(connections: &Connections) -> Result<UnitOfWork> {
    let uow = UnitOfWork::begin(connections.get().await.map_err(Error::client)?).await?;
    if let Some(Err(e)) = uow.client().batch_execute(ROUND_SETTINGS).now_or_never() {
        return Err(Error::client(e));
    }
    Ok(uow)
}

impl Round {
    /// A whole round, unpipelined: claim, publish, settle.
    async fn run(
        connections: &Connections,
        sink: &dyn Sink,
        settings: &OutboxSettings,
        after: i64,
        leases: &Leases,
    ) -> Result<DispatchReport> {
        let round = Round::claim(connections, settings, after, leases).await?;
        let results = round.send_all(sink).await;
        round.settle(connections, results, settings, leases).await
    }

    /// Claims the round's rows, and holds their lease in `leases`.
    async fn claim(
        connections: &Connections,
        settings: &OutboxSettings,
        after: i64,
        leases: &Leases,
    ) -> Result<Self> {
        let uow = round_transaction(connections).await?;
        let claim = uow
            .client()
            .prepare_cached(
                "UPDATE outbox_messages o
                 SET next_attempt_at = now() + $3 * interval '1 millisecond', lease = $4
                 FROM (SELECT seq FROM outbox_messages
                       WHERE dead_at IS NULL AND next_attempt_at <= now() AND seq > $2
                       ORDER BY seq
                       LIMIT $1
                       FOR UPDATE SKIP LOCKED) due
                 WHERE o.seq = due.seq
                 RETURNING o.seq, o.message_id, o.exchange, o.routing_key, o.message_type,
                           o.headers::text AS headers, o.body, o.attempts, o.properties",
            )
            .await
            .map_err(Error::client)?;
        let lease = Uuid::new_v4();
        let mut claimed = uow
            .query_then_commit(
                &claim,
                &[
                    &i64::from(settings.batch_size),
                    &after,
                    &millis(settings.claim_lease),
                    &lease,
                ],
            )
            .await?;
        // RETURNING keeps no order.
        claimed.sort_by_cached_key(|row| row.try_get::<_, i64>("seq").unwrap_or(i64::MAX));
        // `try_get`: a column whose type changed under the runtime fails
        // the round with an error that names it, rather than a panic.
        let mut rows = Vec::with_capacity(claimed.len());
        let mut outgoing = Vec::with_capacity(claimed.len());
        for row in &claimed {
            rows.push((
                row.try_get("seq").map_err(Error::client)?,
                row.try_get("attempts").map_err(Error::client)?,
            ));
            let message_id = row.try_get("message_id").map_err(Error::client)?;
            outgoing.push(Outgoing {
                message_id,
                exchange: row.try_get("exchange").map_err(Error::client)?,
                routing_key: row.try_get("routing_key").map_err(Error::client)?,
                message_type: row.try_get("message_type").map_err(Error::client)?,
                headers: headers(row.try_get("headers").map_err(Error::client)?, message_id),
                body: row.try_get("body").map_err(Error::client)?,
                properties: row.try_get("properties").map_err(Error::client)?,
            });
        }
        let round = Self {
            rows,
            outgoing,
            lease,
        };
        leases.hold(&round);
        Ok(round)
    }

    fn seqs(&self) -> Vec<i64> {
        self.rows.iter().map(|&(seq, _)| seq).collect()
    }

    /// Gives the rows back unpublished: due at once again.
    async fn release(self, connections: &Connections, leases: &Leases) -> Result<()> {
        let released = async {
            connections
                .get()
                .await
                .map_err(Error::client)?
                .execute(
                    "UPDATE outbox_messages SET next_attempt_at = now(), lease = NULL
                     WHERE seq = ANY($1) AND lease = $2",
                    &[&self.seqs(), &self.lease],
                )
                .await
                .map_err(Error::client)
        }
        .await;
        leases.let_go(self.lease);
        released.map(drop)
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
    async fn send_all(&self, sink: &dyn Sink) -> Vec<Result<()>> {
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

    /// Deletes the confirmed rows, reschedules or parks the others (those
    /// still this round's), and gives back the unsent ones, in one short
    /// transaction.
    async fn settle(
        self,
        connections: &Connections,
        results: Vec<Result<()>>,
        settings: &OutboxSettings,
        leases: &Leases,
    ) -> Result<DispatchReport> {
        // The rows it reschedules lose the token with the lease, so that a
        // renewal in flight meanwhile cannot push their next attempt out.
        let lease = self.lease;
        let settled = self.settle_rows(connections, results, settings).await;
        // Settled, or not (the database away): either way no longer held,
        // and rows left unsettled come due when their lease runs out.
        leases.let_go(lease);
        settled
    }

    /// [`settle`](Self::settle), the rows' part.
    async fn settle_rows(
        self,
        connections: &Connections,
        results: Vec<Result<()>>,
        settings: &OutboxSettings,
    ) -> Result<DispatchReport> {
        let mut report = DispatchReport {
            claimed: self.rows.len(),
            last_seq: self.last_seq(),
            ..DispatchReport::default()
        };
        let uow = round_transaction(connections).await?;
        let mut confirmed: Vec<i64> = Vec::new();
        let mut unsent: Vec<i64> = Vec::new();
        let mut unreachable = None;
        for ((&(seq, attempts), outgoing), result) in self.rows.iter().zip(&self.outgoing).zip(results) {
            let Err(error) = result else {
                confirmed.push(seq);
                continue;
            };
            if error.is_broker_unavailable() {
                // Not the row's doing: a lost node, a broker restarting, an
                // alarm. It is given back as it was, due, and goes out with a
                // later round (again, if the broker took it after all: the
                // same message_id, which the receiving inbox skips). An
                // outage parks no row, however long it lasts.
                report.unsent += 1;
                unsent.push(seq);
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
                crate::fault::truncate(&crate::error::describe(&error), crate::fault::MAX_REASON_BYTES)
                    .into_owned();
            let message_id = outgoing.message_id;
            if dead {
                report.dead += 1;
                tracing::error!(%message_id, attempts, %reason, "outbox message parked as dead after its last attempt");
            } else {
                report.failed += 1;
                tracing::warn!(%message_id, attempts, %reason, "outbox message not published; trying again in {pause:?}");
            }
            uow.client()
                .execute(
                    "UPDATE outbox_messages
                     SET attempts = $2, last_error = $3,
                         next_attempt_at = now() + $4 * interval '1 millisecond',
                         dead_at = CASE WHEN $5 THEN now() END, lease = NULL
                     WHERE seq = $1 AND lease = $6",
                    &[&seq, &attempts, &reason, &millis(pause), &dead, &self.lease],
                )
                .await
                .map_err(Error::client)?;
            if dead {
                // In the failures table too, in the same transaction: the
                // operator sees it beside the messages the queues set aside,
                // and redrives it from there.
                let fingerprint =
                    crate::failures::fingerprint(Some(&outgoing.message_type), Some("outbox"), Some(&reason));
                uow.client()
                    .execute(
                        crate::failures::RECORD_DEAD_OUTBOX_ROW,
                        &[&seq, &Uuid::now_v7(), &fingerprint],
                    )
                    .await
                    .map_err(Error::client)?;
            }
        }
        if !unsent.is_empty() {
            uow.client()
                .execute(
                    "UPDATE outbox_messages SET next_attempt_at = now(), lease = NULL
                     WHERE seq = ANY($1) AND lease = $2",
                    &[&unsent, &self.lease],
                )
                .await
                .map_err(Error::client)?;
        }
        // Confirmed: gone, whoever holds the lease now.
        if confirmed.is_empty() {
            uow.commit().await?;
        } else {
            let delete = uow
                .client()
                .prepare_cached("DELETE FROM outbox_messages WHERE seq = ANY($1)")
                .await
                .map_err(Error::client)?;
            uow.query_then_commit(&delete, &[&confirmed]).await?;
        }
        report.dispatched = confirmed.len();
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
