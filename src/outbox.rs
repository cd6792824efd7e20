//! The transactional outbox: publishing what a transaction staged, once it
//! committed.
//!
//! [`UnitOfWork::publish`](crate::UnitOfWork::publish) stages a row of
//! `outbox_messages` in the caller's transaction, written with its
//! `COMMIT`; [`dispatch`] claims due
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
use futures_util::FutureExt;
use futures_util::future::{BoxFuture, join_all};
use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldTable};
use tokio_postgres::types::ToSql;
use uuid::Uuid;

use crate::amqp::AmqpPublisher;
use crate::backoff::Backoff;
use crate::error::Result;
use crate::settings::{OutboxSettings, Wire};
use crate::unit_of_work::UnitOfWork;

/// A message on its way out: staged by a unit of work until its commit,
/// then a row of `outbox_messages` (or, with the outbox off, handed to the
/// publisher).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Outgoing {
    /// Its id: the receiving inbox's dedup key.
    pub message_id: Uuid,
    /// Where: the exchange…
    pub exchange: String,
    /// …and the routing key.
    pub routing_key: String,
    /// The AMQP `type`.
    pub message_type: String,
    /// Headers (`correlation_id`, `causation_id`, `traceparent`,
    /// `tracestate`), as text.
    pub headers: Vec<(String, String)>,
    /// The event as JSON.
    pub body: Vec<u8>,
}

impl Outgoing {
    /// Its headers as AMQP headers.
    pub fn amqp_headers(&self) -> FieldTable {
        let mut table = FieldTable::default();
        for (key, value) in &self.headers {
            table.insert(key.as_str().into(), AMQPValue::LongString(value.as_str().into()));
        }
        table
    }

    /// Its AMQP properties: id, type, JSON, persistent, headers. Only for
    /// a message that passed [`check`](Self::check): a name past 255 bytes
    /// panics in the client.
    pub fn properties(&self) -> BasicProperties {
        crate::amqp::message_properties(self.message_id, &self.message_type).with_headers(self.amqp_headers())
    }

    /// Its AMQP properties as MassTransit sets them
    /// (RMQ/RabbitMqTransport/RabbitMqSendTransportContext.cs at v8.5.8):
    /// its id as `message_id`, the envelope's content type, persistent, its
    /// headers; no `type`.
    pub fn masstransit_properties(&self) -> BasicProperties {
        crate::masstransit::properties(self.message_id).with_headers(self.amqp_headers())
    }

    /// Why the broker would not take it, if it would not: a name (exchange,
    /// routing key, type, a header's key) past 255 bytes, properties past
    /// [`MAX_PROPERTIES_BYTES`](crate::limits::MAX_PROPERTIES_BYTES)
    /// encoded, or a body past `max_body` bytes. Checked at staging, and
    /// again at dispatch, since a row may come from any process.
    pub fn check(&self, max_body: usize) -> std::result::Result<(), String> {
        self.check_names_and_body(max_body)?;
        crate::limits::check_properties(&self.properties(), 0)
    }

    /// [`check`](Self::check) less the properties' encoded size, which the
    /// publisher measures as it sends, against its connection's frame: at
    /// dispatch, once per row.
    fn check_names_and_body(&self, max_body: usize) -> std::result::Result<(), String> {
        use crate::limits::{check_body, check_name};
        check_name("exchange", &self.exchange)?;
        check_name("routing key", &self.routing_key)?;
        check_name("type", &self.message_type)?;
        for (key, _) in &self.headers {
            check_name("header key", key)?;
        }
        check_body(self.body.len(), max_body)
    }
}

/// Messages a unit of work staged, as `outbox_messages`' columns, for an
/// `INSERT` that writes them: [`UnitOfWork::commit`] sends the last (and
/// nearly always only) one with its `COMMIT`.
pub(crate) struct OutboxRows<'a> {
    message_ids: Vec<Uuid>,
    exchanges: Vec<&'a str>,
    routing_keys: Vec<&'a str>,
    message_types: Vec<&'a str>,
    headers: Vec<String>,
    bodies: Vec<&'a [u8]>,
}

/// One row (a message's one follow-up, the common case).
const INSERT_ONE: &str =
    "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
     VALUES ($1, $2, $3, $4, $5::text::jsonb, $6)";

/// Several rows, numbered in staging order: `seq` follows it.
const INSERT_MANY: &str =
    "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
     SELECT m, e, r, t, h::jsonb, b
     FROM unnest($1::uuid[], $2::text[], $3::text[], $4::text[], $5::text[], $6::bytea[])
          WITH ORDINALITY AS s (m, e, r, t, h, b, n)
     ORDER BY n";

/// The most rows one `INSERT` writes…
const ROWS_PER_INSERT: usize = 1000;
/// …and about the most bytes of headers and bodies: PostgreSQL refuses a
/// protocol message past 1 GB, and a transaction may stage many large
/// messages.
const BYTES_PER_INSERT: usize = 64 * 1024 * 1024;

impl<'a> OutboxRows<'a> {
    /// `messages` in staging order, in chunks of at most
    /// [`ROWS_PER_INSERT`] rows and about [`BYTES_PER_INSERT`] bytes (a
    /// larger message goes alone); none for none.
    pub(crate) fn chunks(messages: &'a [Outgoing]) -> Vec<Self> {
        let mut chunks = Vec::new();
        let (mut start, mut bytes) = (0, 0);
        for (i, message) in messages.iter().enumerate() {
            let size = message.body.len()
                + message
                    .headers
                    .iter()
                    .map(|(k, v)| k.len() + v.len())
                    .sum::<usize>();
            if i > start && (i - start == ROWS_PER_INSERT || bytes + size > BYTES_PER_INSERT) {
                chunks.push(Self::new(&messages[start..i]));
                (start, bytes) = (i, 0);
            }
            bytes += size;
        }
        if start < messages.len() {
            chunks.push(Self::new(&messages[start..]));
        }
        chunks
    }

    fn new(messages: &'a [Outgoing]) -> Self {
        Self {
            message_ids: messages.iter().map(|m| m.message_id).collect(),
            exchanges: messages.iter().map(|m| m.exchange.as_str()).collect(),
            routing_keys: messages.iter().map(|m| m.routing_key.as_str()).collect(),
            message_types: messages.iter().map(|m| m.message_type.as_str()).collect(),
            headers: messages.iter().map(|m| headers_json(&m.headers)).collect(),
            bodies: messages.iter().map(|m| m.body.as_slice()).collect(),
        }
    }

    pub(crate) fn sql(&self) -> &'static str {
        if self.message_ids.len() == 1 {
            INSERT_ONE
        } else {
            INSERT_MANY
        }
    }

    /// The parameters of [`sql`](Self::sql).
    pub(crate) fn params(&self) -> Vec<&(dyn ToSql + Sync)> {
        if let ([id], [exchange], [routing_key], [message_type], [headers], [body]) = (
            self.message_ids.as_slice(),
            self.exchanges.as_slice(),
            self.routing_keys.as_slice(),
            self.message_types.as_slice(),
            self.headers.as_slice(),
            self.bodies.as_slice(),
        ) {
            return vec![id, exchange, routing_key, message_type, headers, body];
        }
        vec![
            &self.message_ids,
            &self.exchanges,
            &self.routing_keys,
            &self.message_types,
            &self.headers,
            &self.bodies,
        ]
    }
}

/// Where dispatched messages go: the broker ([`AmqpPublisher`], with
/// confirms), or, in process, the handlers.
pub trait Sink: Send + Sync + 'static {
    /// Sends `outgoing`; succeeds once it is taken (confirmed, or handled).
    fn send<'a>(&'a self, outgoing: &'a Outgoing) -> BoxFuture<'a, Result<()>>;
}

impl Sink for AmqpPublisher {
    fn send<'a>(&'a self, outgoing: &'a Outgoing) -> BoxFuture<'a, Result<()>> {
        // A row can come from any process, and one the broker cannot take
        // must fail alone: a name past 255 bytes would panic in the client,
        // round after round; headers past a frame would take the whole
        // connection down, and a body past the broker's limit the channel,
        // with every other publish in flight on them.
        // (Properties past a frame fail as `Unpublishable` in the publish.)
        if let Err(reason) = outgoing.check_names_and_body(self.max_message_size()) {
            return Box::pin(std::future::ready(Err(crate::Error::unpublishable(
                outgoing.message_id.to_string(),
                crate::fault::truncate(&outgoing.routing_key, 64).into_owned(),
                reason,
            ))));
        }
        match self.wire() {
            Wire::Inbox => Box::pin(self.publish_to(
                &outgoing.exchange,
                &outgoing.routing_key,
                outgoing.properties(),
                &outgoing.body,
            )),
            // A row to the default exchange (staged by hand, or by another
            // process) is sent to the queue its routing key names, which
            // must exist: as the inbox wire sends it, in MassTransit's
            // properties.
            Wire::Masstransit if outgoing.exchange.is_empty() => Box::pin(self.publish_to(
                "",
                &outgoing.routing_key,
                outgoing.masstransit_properties(),
                &outgoing.body,
            )),
            // To the type's exchange, for whoever subscribes.
            Wire::Masstransit => Box::pin(self.publish_to_subscribers(
                &outgoing.exchange,
                &[],
                outgoing.masstransit_properties(),
                &outgoing.body,
            )),
        }
    }
}

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
            outgoing.push(Outgoing {
                message_id: row.try_get("message_id")?,
                exchange: row.try_get("exchange")?,
                routing_key: row.try_get("routing_key")?,
                message_type: row.try_get("message_type")?,
                headers: headers(row.try_get("headers")?),
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
            let pause = Backoff::nth(settings.retry_backoff, tries - 1, settings.max_retry_backoff);
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

/// What waits to be dispatched: rows that are not dead, those other
/// transactions hold included; and the dead ones.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct Backlog {
    /// How many wait.
    pub pending: u64,
    /// How long the oldest of them has waited since it was staged.
    pub oldest_pending: Option<Duration>,
    /// Rows parked as dead (until retried or swept).
    pub dead: u64,
}

/// The most rows [`backlog`] counts of each kind: a sample taken every poll
/// interval must not scan a backlog of millions (a broker away for hours).
pub const BACKLOG_COUNT_LIMIT: i64 = 100_000;

/// Samples the [`Backlog`] through the pending and dead rows' indexes,
/// counting each kind up to [`BACKLOG_COUNT_LIMIT`] (a larger backlog
/// shows as that many); the oldest pending row is the first by `seq`.
pub async fn backlog(pool: &Pool) -> Result<Backlog> {
    let row = pool
        .get()
        .await?
        .query_one(
            "SELECT (SELECT count(*) FROM (SELECT 1 FROM outbox_messages WHERE dead_at IS NULL LIMIT $1) AS p),
                    (SELECT (EXTRACT(EPOCH FROM now()) - EXTRACT(EPOCH FROM created_at))::float8
                     FROM outbox_messages WHERE dead_at IS NULL ORDER BY seq LIMIT 1),
                    (SELECT count(*) FROM (SELECT 1 FROM outbox_messages WHERE dead_at IS NOT NULL LIMIT $1) AS d)",
            &[&BACKLOG_COUNT_LIMIT],
        )
        .await?;
    // `try_get`, as everywhere a row is read: a column of an unexpected
    // type is an error, never a panic in the dispatcher's sampler.
    let count =
        |column: usize| -> Result<u64> { Ok(u64::try_from(row.try_get::<_, i64>(column)?).unwrap_or(0)) };
    let oldest: Option<f64> = row.try_get(1)?;
    Ok(Backlog {
        pending: count(0)?,
        // A row staged by hand may carry any `created_at`, even infinity.
        oldest_pending: oldest
            .map(|seconds| Duration::try_from_secs_f64(seconds.max(0.0)).unwrap_or(Duration::MAX)),
        dead: count(2)?,
    })
}

/// Headers as the JSON object `outbox_messages.headers` holds.
fn headers_json(headers: &[(String, String)]) -> String {
    let object: serde_json::Map<String, serde_json::Value> = headers
        .iter()
        .map(|(k, v)| (k.clone(), v.as_str().into()))
        .collect();
    serde_json::Value::Object(object).to_string()
}

/// The row's headers: a JSON object of strings, as staging writes them.
fn headers(json: &str) -> Vec<(String, String)> {
    match serde_json::from_str(json) {
        Ok(serde_json::Value::Object(map)) => map
            .into_iter()
            .filter_map(|(key, value)| match value {
                serde_json::Value::String(text) => Some((key, text)),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    }
}

fn millis(pause: Duration) -> f64 {
    pause.as_secs_f64() * 1000.0
}

/// The channel a commit that staged outbox rows notifies (migration 3).
pub const CHANNEL: &str = "inbox_outbox";

/// Listens on [`CHANNEL`] over a connection of its own (not the pool's:
/// it waits for notifications all along) and calls `wake` for each, until
/// `stop` resolves. A lost connection is opened again with a growing pause;
/// the dispatcher's poll covers the gap.
pub async fn listen(
    config: tokio_postgres::Config,
    wake: impl Fn() + Send + 'static,
    stop: impl std::future::Future<Output = ()> + Send,
) {
    use futures_util::StreamExt;
    let listening = async {
        let mut backoff = Backoff::new(Duration::from_millis(200), Duration::from_secs(5));
        loop {
            match config.connect(tokio_postgres::NoTls).await {
                Ok((client, mut connection)) => {
                    let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
                    // The LISTEN's answer comes through the connection,
                    // which only the stream below drives.
                    let listen = client.batch_execute("LISTEN inbox_outbox");
                    let mut listen = std::pin::pin!(listen);
                    let mut listening = false;
                    loop {
                        tokio::select! {
                            result = &mut listen, if !listening => match result {
                                Ok(()) => {
                                    listening = true;
                                    // Rows committed meanwhile: look now.
                                    wake();
                                }
                                Err(_) => break,
                            },
                            message = messages.next() => match message {
                                Some(Ok(tokio_postgres::AsyncMessage::Notification(_))) => wake(),
                                Some(Ok(_)) => {}
                                Some(Err(_)) | None => break,
                            },
                        }
                    }
                    tracing::debug!("the outbox's LISTEN connection ended; opening another");
                }
                Err(e) => tracing::debug!(error = %e, "cannot open the outbox's LISTEN connection"),
            }
            tokio::time::sleep(backoff.next_pause()).await;
        }
    };
    tokio::select! {
        () = listening => {}
        () = stop => {}
    }
}

/// Gives dead rows another chance (all of them, or those whose
/// `message_id` is in `only`): their attempts start over and they are due
/// now. Returns how many. A running dispatcher is woken.
pub async fn retry_dead(pool: &Pool, only: Option<&std::collections::HashSet<Uuid>>) -> Result<u64> {
    let ids: Option<Vec<Uuid>> = only.map(|ids| ids.iter().copied().collect());
    let connection = pool.get().await?;
    let revived = connection
        .execute(
            "UPDATE outbox_messages
             SET dead_at = NULL, attempts = 0, next_attempt_at = now(), last_error = NULL
             WHERE dead_at IS NOT NULL AND ($1::uuid[] IS NULL OR message_id = ANY($1))",
            &[&ids],
        )
        .await?;
    connection
        .execute("SELECT pg_notify($1, '')", &[&CHANNEL])
        .await?;
    Ok(revived)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn message(body_bytes: usize) -> Outgoing {
        Outgoing {
            message_id: Uuid::now_v7(),
            exchange: String::new(),
            routing_key: "q".into(),
            message_type: "T".into(),
            headers: vec![("correlation_id".into(), "c".into())],
            body: vec![b'x'; body_bytes],
        }
    }

    fn sizes(messages: &[Outgoing]) -> Vec<usize> {
        OutboxRows::chunks(messages)
            .iter()
            .map(|c| c.message_ids.len())
            .collect()
    }

    #[test]
    fn headers_go_into_the_row_as_json_and_come_back_as_they_were() {
        let staged = message(1).headers;
        assert_eq!(headers(&headers_json(&staged)), staged);
        assert!(headers("not json").is_empty());
    }

    #[test]
    fn staged_rows_go_in_chunks_of_a_thousand_in_staging_order() {
        assert!(OutboxRows::chunks(&[]).is_empty());
        let messages: Vec<Outgoing> = (0..2_345).map(|_| message(10)).collect();
        assert_eq!(sizes(&messages), [1_000, 1_000, 345]);
        let ids: Vec<Uuid> = OutboxRows::chunks(&messages)
            .iter()
            .flat_map(|c| c.message_ids.clone())
            .collect();
        assert_eq!(ids, messages.iter().map(|m| m.message_id).collect::<Vec<_>>());
    }

    #[test]
    fn large_messages_split_a_chunk_and_one_larger_than_a_chunk_goes_alone() {
        let mb = 1024 * 1024;
        let messages = [
            message(40 * mb),
            message(20 * mb),
            message(10 * mb),
            message(100 * mb),
            message(1),
        ];
        // 40 + 20 fit; 10 does not join them; 100 goes alone; 1 follows it.
        assert_eq!(sizes(&messages), [2, 1, 1, 1]);
        assert_eq!(OutboxRows::chunks(&messages[..1])[0].sql(), INSERT_ONE);
        assert_eq!(OutboxRows::chunks(&messages[1..3])[0].sql(), INSERT_MANY);
    }
}
