//! The unit of work: one message's transaction, owned, and never returned to
//! the pool unfinished.

use std::ops::{Deref, DerefMut};
use std::sync::Arc;

use deadpool_postgres::{ClientWrapper, Object};
use futures_util::FutureExt;
use tokio_postgres::error::SqlState;
use uuid::Uuid;

use crate::context::MessageContext;
use crate::db::{Connection, Slot};
use crate::error::{Error, Result};
use crate::event::{IntegrationEvent, Message};
use crate::outbox::staging::{OutboxRows, Outgoing};
use crate::settings::Wire;
use crate::trace::TraceContext;

/// One message's open transaction over a pooled connection. The inbox claim
/// and every handler's writes run in it and commit together, or not at all.
///
/// Handlers borrow it (`&mut UnitOfWork`) and run SQL through
/// [`client`](Self::client); [`commit`](Self::commit) and
/// [`rollback`](Self::rollback) take it by value, so only its owner, the
/// runtime, can finish it.
///
/// The savepoints that isolate the messages of a batch are the runtime's
/// alone too: a handler cannot release or roll back to them.
///
/// A handler that needs to undo part of its own work has
/// [`nested`](Self::nested) scopes.
///
/// Dropped unfinished (a handler panicked, a future was cancelled, `COMMIT`
/// failed), it discards its connection instead of returning it to the pool:
/// deadpool would hand a connection still inside `BEGIN` to the next user
/// whatever its recycling method, while a closed connection makes the server
/// abort the transaction.
#[derive(Debug)]
pub struct UnitOfWork {
    /// Boxed: a unit of work moves from the runtime to the handlers and
    /// back, and lives in every future along the way; a pointer keeps those
    /// futures small (each is allocated once per message).
    state: Box<State>,
}

/// What a [`UnitOfWork`] holds.
#[derive(Debug)]
struct State {
    /// `Some` until finished or dropped.
    connection: Option<Object>,
    /// Set once `COMMIT` or `ROLLBACK` succeeded: only then may the
    /// connection go back to the pool.
    finished: bool,
    /// Messages whose inbox record is written in this transaction; see
    /// [`InboxStore::complete`](crate::store::InboxStore::complete).
    recorded: Vec<Uuid>,
    /// How many savepoints were made; the open one is `s<count>`.
    savepoints: u32,
    /// `recorded` as it was at the open savepoint (batches keep one open
    /// at a time).
    recorded_at_savepoint: Vec<Uuid>,
    /// How many [`nested`](UnitOfWork::nested) scopes handlers opened, for their
    /// savepoints' names.
    nested_scopes: u32,
    /// Where [`publish`](UnitOfWork::publish) stages messages; `None` where no
    /// dispatcher runs.
    outbox: Option<Outbox>,
    /// The messages its handlers are handling now, in the order of their
    /// events.
    /// Shared with the handlers, which are given them as arguments.
    contexts: Arc<[MessageContext]>,
    /// Which of `contexts` a batch's default `handle_batch` is handling
    /// now through `handle`: the one [`publish`](UnitOfWork::publish)
    /// stamps.
    focus: Option<usize>,
    /// The messages staged with [`publish`](UnitOfWork::publish), in staging
    /// order: written to `outbox_messages` with the `COMMIT` (the outbox
    /// on), or handed over after it (off). A rolled-back savepoint or
    /// nested scope truncates them to what they were when it opened.
    outgoing: Vec<Outgoing>,
    /// How many there were at the open savepoint.
    outgoing_at_savepoint: usize,
    /// The connection's slot in the runtime's gate (see `db::Connections`),
    /// given back after the connection: last, as fields drop in order.
    _slot: Option<Slot>,
}

/// A statement's own result, before it is told apart as the runtime's error.
type PgResult<T> = std::result::Result<T, tokio_postgres::Error>;

/// Opens a unit of work's transaction (see [`UnitOfWork::begin`]).
const BEGIN: &str = "BEGIN";

/// Fails in an aborted transaction (25P02), as any statement there does.
/// Prepared once per connection: a bind and an execute, where a simple
/// query would make PostgreSQL parse and plan it for every message.
const PROBE: &str = "SELECT 1";

/// Commits; in an aborted transaction, rolls back without an error, which
/// is why [`PROBE`] runs just before it.
const COMMIT: &str = "COMMIT";

/// Rolls an aborted transaction back: what [`COMMIT`] would do there, said
/// plainly.
const ROLLBACK: &str = "ROLLBACK";

/// A statement [`UnitOfWork::prepare`]d for the commit, or the error that
/// says the transaction is aborted.
enum Prepared {
    Statement(tokio_postgres::Statement),
    Aborted(tokio_postgres::Error),
}

/// A unit of work's outbox: the exchange its staged messages go to, the
/// dispatcher to wake when a commit has staged some, and, with the outbox
/// off, where they go straight after the commit instead.
#[derive(Debug, Clone)]
pub(crate) struct Outbox {
    /// `message_bus.exchange`; shared, since every unit of work gets a copy.
    pub(crate) exchange: Arc<str>,
    /// `message_bus.max_message_size`: the largest body staged.
    pub(crate) max_message_size: usize,
    /// `message_bus.wire`: MassTransit's stages each message to its type's
    /// exchange, in its envelope.
    pub(crate) wire: Wire,
    /// Notified after a commit that staged messages.
    pub(crate) wake: Arc<tokio::sync::Notify>,
    /// `None`: staged as rows of `outbox_messages`. `Some`: held in memory
    /// and handed here once the transaction has committed
    /// (`message_bus.enable_outbox` off; a crash in between loses them).
    pub(crate) after_commit: Option<tokio::sync::mpsc::UnboundedSender<Outgoing>>,
}

impl UnitOfWork {
    /// Opens a transaction on `connection`. On a connection from
    /// [`create_pool`](crate::db::create_pool), lock waits inside it (the inbox
    /// claim's above all) give up after `database.lock_timeout`.
    ///
    /// `BEGIN` is sent without waiting for its answer, as
    /// [`savepoint`](Self::savepoint) is: the first statement (the inbox
    /// claim) follows it in the same pipeline, a round trip saved per
    /// message. Its answer is not needed: on a connection that answers, a
    /// `BEGIN` outside a transaction cannot fail (inside one it only warns,
    /// and no pooled connection is ever left inside one: see below), and on
    /// a connection that fails, the statements after it fail too.
    pub(crate) async fn begin(connection: Connection) -> Result<Self> {
        let (connection, slot) = connection.into_parts();
        // Armed before BEGIN is sent: if this future is dropped mid-flight,
        // Drop discards the connection rather than risk pooling an open
        // transaction.
        let uow = Self {
            state: Box::new(State {
                connection: Some(connection),
                finished: false,
                recorded: Vec::new(),
                savepoints: 0,
                recorded_at_savepoint: Vec::new(),
                nested_scopes: 0,
                outbox: None,
                contexts: Arc::new([]),
                focus: None,
                outgoing: Vec::new(),
                outgoing_at_savepoint: 0,
                _slot: slot,
            }),
        };
        if let Some(Err(e)) = uow.client().batch_execute(BEGIN).now_or_never() {
            return Err(Error::client(e));
        }
        Ok(uow)
    }

    /// The connection, inside the transaction, for the handlers' SQL.
    /// `prepare_cached` keeps prepared statements per connection.
    pub fn client(&self) -> &ClientWrapper {
        // Only `commit`, `rollback` and `Drop` take the connection out, and
        // they consume or end `self`, so it is always here.
        self.state
            .connection
            .as_ref()
            .expect("a live unit of work holds its connection")
    }

    /// Notes that the inbox record of `message_id` is written in this
    /// transaction (for [`InboxStore`](crate::store::InboxStore) implementations).
    pub(crate) fn note_recorded(&mut self, message_id: Uuid) {
        if !self.is_recorded(message_id) {
            self.state.recorded.push(message_id);
        }
    }

    /// Whether the inbox record of `message_id` is written in this transaction.
    pub(crate) fn is_recorded(&self, message_id: Uuid) -> bool {
        self.state.recorded.contains(&message_id)
    }

    /// Forgets that the inbox record of `message_id` is written; returns
    /// whether it was.
    pub(crate) fn forget_recorded(&mut self, message_id: Uuid) -> bool {
        let before = self.state.recorded.len();
        self.state.recorded.retain(|id| *id != message_id);
        self.state.recorded.len() != before
    }

    /// Marks a point in a batch (before the whole batch, or before one
    /// message): what follows can be undone by
    /// [`rollback_to_savepoint`](Self::rollback_to_savepoint) without
    /// touching what came before. One savepoint is kept open at a time (the
    /// previous one is released in the same request), so a batch never
    /// nests subtransactions.
    ///
    /// Like [`commit`](Self::commit) it takes the unit of work by value:
    /// only its owner, the runtime, can call it. A handler, which borrows
    /// the unit of work, cannot release or roll back to the batch's
    /// savepoints (that would let a failed batch commit effects twice); it
    /// has [`nested`](Self::nested) scopes of its own.
    ///
    /// Sent without waiting for the answer: tokio-postgres sends a request
    /// when its future is first polled and runs requests in that order, so
    /// the savepoint reaches the server ahead of the next statement, in the
    /// same pipeline, and a batch saves a round trip. It fails at once only
    /// if the connection is closed. Any other failure still shows: it aborts
    /// the transaction, so every later statement fails, and so do
    /// [`commit`](Self::commit) and `rollback_to_savepoint` (each savepoint
    /// has a name of its own, and this one was never made), so a rollback
    /// can never land on an older savepoint and undo work reported as done.
    pub(crate) fn savepoint(mut self) -> Result<Self> {
        let sql = match self.state.savepoints {
            0 => "SAVEPOINT s1".to_owned(),
            n => format!("RELEASE SAVEPOINT s{n}; SAVEPOINT s{}", n + 1),
        };
        if let Some(Err(e)) = self.client().batch_execute(&sql).now_or_never() {
            return Err(Error::client(e));
        }
        self.state.savepoints += 1;
        self.state.recorded_at_savepoint.clone_from(&self.state.recorded);
        self.state.outgoing_at_savepoint = self.state.outgoing.len();
        Ok(self)
    }

    /// Undoes everything since the last [`savepoint`](Self::savepoint),
    /// including a failed statement, and forgets the records staged since:
    /// their rows are gone. The transaction can go on. Fails if no savepoint
    /// was made, or if making the last one failed. By value, like
    /// `savepoint`: the runtime's alone.
    pub(crate) async fn rollback_to_savepoint(mut self) -> Result<Self> {
        let sql = format!("ROLLBACK TO SAVEPOINT s{}", self.state.savepoints);
        // Fails when no savepoint was made, before anything is restored.
        self.client().batch_execute(&sql).await.map_err(Error::client)?;
        self.state.recorded.clone_from(&self.state.recorded_at_savepoint);
        self.state.outgoing.truncate(self.state.outgoing_at_savepoint);
        Ok(self)
    }

    /// Gives this unit of work an outbox, so that [`publish`](Self::publish)
    /// can stage messages (the runtime does this for the units of work it
    /// opens).
    pub(crate) fn with_outbox(mut self, outbox: Outbox) -> Self {
        self.state.outbox = Some(outbox);
        self
    }

    /// Tells the unit of work which messages its handlers handle now (the
    /// runtime does, before the handlers run).
    pub(crate) fn set_contexts(&mut self, contexts: Arc<[MessageContext]>) {
        self.state.contexts = contexts;
        self.state.focus = None;
    }

    /// Makes the `index`th of the batch's messages the one being handled
    /// (`Some`), or the whole batch again (`None`): the default
    /// `handle_batch` does, around each call of `handle`.
    pub(crate) fn focus(&mut self, index: Option<usize>) {
        self.state.focus = index;
    }

    /// The message a follow-up staged now is caused by: the one being
    /// handled, if any. In a whole batch, which one is not known, and a
    /// follow-up without its cause's ids would break its flow's
    /// correlation without a word: refused, naming the way to say it.
    fn cause(&self) -> Result<Option<&MessageContext>> {
        let handling = match (self.state.focus, &*self.state.contexts) {
            (Some(i), contexts) => contexts.get(i),
            (None, [one]) => Some(one),
            (None, _) => None,
        };
        match handling {
            Some(cause) => Ok(Some(cause)),
            None if self.state.contexts.is_empty() => Ok(None),
            None => Err(Error::new(
                crate::ErrorKind::Usage,
                format!(
                    "`publish` in `handle_batch` of a batch of {} messages: which message the follow-up \
                     is caused by is unknown; stage it with `publish_caused_by(&contexts[i], ..)`",
                    self.state.contexts.len()
                ),
            )),
        }
    }

    /// Stages `message` for publishing with `routing_key`, as a row of
    /// `outbox_messages` in this transaction: it leaves only if the
    /// transaction commits, then at least once and always with the same
    /// `message_id` (the receiving inbox makes its effect exactly-once). In
    /// a batch, a message rolled back to its savepoint takes its rows with
    /// it. A body that cannot be serialized fails here, in the caller's
    /// transaction, never later.
    ///
    /// The rows are written by [`commit`](Self::commit), in the same
    /// request as the `COMMIT` (one statement for up to 1,000 of them, in
    /// staging order): staging costs no round trip, and the transaction holds its
    /// locks no longer for it. So this transaction's own queries do not
    /// see its staged rows, and a row that cannot be written (say,
    /// `outbox_messages` is missing) fails the commit, which then commits
    /// nothing.
    ///
    /// Fails on a unit of work without an outbox (the in-process provider):
    /// nothing would dispatch the row.
    ///
    /// Staged while a message is handled (in `handle`, whatever the batch
    /// size), the follow-up carries its
    /// `correlation_id` (or its id, for the first of a flow), its id as
    /// `causation_id` and its trace; on MassTransit's wire, what a
    /// MassTransit consumer's follow-up gets instead (its headers but
    /// MassTransit's own, its conversation, its correlation id as the
    /// initiator, the trace: docs/masstransit.md). In an overridden `handle_batch`, which
    /// handles several messages at once, it fails with a usage error: name
    /// the cause with [`publish_caused_by`](Self::publish_caused_by).
    pub async fn publish<E: IntegrationEvent>(
        &mut self,
        routing_key: &str,
        message: &Message<E>,
    ) -> Result<()> {
        let cause = self.cause()?;
        let outgoing = outgoing(
            self.state.outbox.as_ref(),
            cause,
            To::Subscribers(routing_key),
            message,
        )?;
        self.state.outgoing.push(outgoing);
        Ok(())
    }

    /// [`publish`](Self::publish), as a follow-up of `cause` (one of
    /// the `contexts` of [`handle_batch`](crate::EventHandler::handle_batch)).
    pub async fn publish_caused_by<E: IntegrationEvent>(
        &mut self,
        cause: &MessageContext,
        routing_key: &str,
        message: &Message<E>,
    ) -> Result<()> {
        let outgoing = outgoing(
            self.state.outbox.as_ref(),
            Some(cause),
            To::Subscribers(routing_key),
            message,
        )?;
        self.state.outgoing.push(outgoing);
        Ok(())
    }

    /// Stages `message` for one queue, `queue`, as MassTransit's `Send`
    /// does: through the default exchange straight to that queue, on both
    /// wires (on MassTransit's, in its envelope), whatever exchange
    /// [`publish`](Self::publish) would use. The queue must exist: a row
    /// the broker cannot route is retried, then parked as dead. Otherwise
    /// as `publish`: through the outbox, with the commit, carrying its
    /// cause's ids and trace.
    pub async fn send<E: IntegrationEvent>(&mut self, queue: &str, message: &Message<E>) -> Result<()> {
        let cause = self.cause()?;
        let outgoing = outgoing(self.state.outbox.as_ref(), cause, To::Queue(queue), message)?;
        self.state.outgoing.push(outgoing);
        Ok(())
    }

    /// [`send`](Self::send), as a follow-up of `cause` (one of the
    /// `contexts` of [`handle_batch`](crate::EventHandler::handle_batch)).
    pub async fn send_caused_by<E: IntegrationEvent>(
        &mut self,
        cause: &MessageContext,
        queue: &str,
        message: &Message<E>,
    ) -> Result<()> {
        let outgoing = outgoing(self.state.outbox.as_ref(), Some(cause), To::Queue(queue), message)?;
        self.state.outgoing.push(outgoing);
        Ok(())
    }

    /// Opens a nested scope for a handler: what runs through it can be
    /// undone on its own ([`Nested::rollback`]), including a failed
    /// statement, while the rest of the message's transaction goes on. It
    /// derefs to the unit of work, so pass it wherever `&mut UnitOfWork`
    /// goes. A scope dropped without [`release`](Nested::release) or
    /// `rollback` is rolled back.
    ///
    /// Its savepoint has a name of its own (`n1`, `n2`, …), nested inside
    /// the runtime's, which it can neither release nor roll back to.
    ///
    /// ```no_run
    /// # async fn handler(uow: &mut rabbit_inbox::UnitOfWork) -> Result<(), rabbit_inbox::HandlerError> {
    /// let scope = uow.nested().await?;
    /// match scope.client().execute("INSERT INTO audit VALUES (1)", &[]).await {
    ///     Ok(_) => scope.release().await?,
    ///     // Optional work: undo it, keep the rest of the message's writes.
    ///     Err(_) => scope.rollback().await?,
    /// }
    /// # Ok(()) }
    /// ```
    pub async fn nested(&mut self) -> Result<Nested<'_>> {
        self.state.nested_scopes += 1;
        let name = format!("n{}", self.state.nested_scopes);
        self.client()
            .batch_execute(&format!("SAVEPOINT {name}"))
            .await
            .map_err(Error::client)?;
        let outgoing_at_open = self.state.outgoing.len();
        Ok(Nested {
            uow: self,
            name,
            outgoing_at_open,
            open: true,
        })
    }

    /// Commits. Fails when any statement in the transaction failed, even
    /// one a handler caught and ignored: PostgreSQL answers `COMMIT` in an
    /// aborted transaction with a silent rollback, which would otherwise
    /// look like success, so a probe that fails there goes just before it.
    ///
    /// The messages staged with [`publish`](Self::publish) are written in
    /// the same request, ahead of the probe: if writing them fails, the
    /// probe fails and nothing commits.
    pub async fn commit(mut self) -> Result<()> {
        let writes_rows = matches!(&self.state.outbox, Some(outbox) if outbox.after_commit.is_none())
            && !self.state.outgoing.is_empty();
        // Boxed apart: the rows' statements make a future of kilobytes,
        // which every message, most staging nothing, would carry otherwise.
        let (probed, committed) = if writes_rows {
            Box::pin(self.write_rows_then_commit()).await?
        } else {
            self.probe_then_commit().await?
        };
        // Nothing committed unless the probe passed; a COMMIT that answered
        // rolled the transaction back, and the connection is clean again.
        let committed = match probed {
            Ok(_) => committed,
            Err(e) => {
                self.state.finished = committed.is_ok();
                Err(e)
            }
        };
        match committed {
            Ok(()) => {
                self.state.finished = true;
                if let Some(outbox) = &self.state.outbox {
                    match &outbox.after_commit {
                        // Handed over only now: never before the commit.
                        Some(after_commit) => {
                            for outgoing in self.state.outgoing.drain(..) {
                                let _ = after_commit.send(outgoing);
                            }
                        }
                        None if writes_rows => outbox.wake.notify_one(),
                        None => {}
                    }
                }
                Ok(())
            }
            Err(e) if e.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION) => Err(Error::new(
                crate::ErrorKind::Usage,
                "a statement in the transaction failed and a handler went on; nothing was committed",
            )),
            Err(e) => Err(Error::client(e)),
        }
    }

    /// The probe and `COMMIT`, in one pipeline: tokio-postgres sends a
    /// request when its future is first polled. The probe is prepared once
    /// per connection; after that, no round trip.
    async fn probe_then_commit(&self) -> Result<(PgResult<u64>, PgResult<()>)> {
        let probe = match self.prepare(PROBE).await? {
            Prepared::Statement(probe) => probe,
            Prepared::Aborted(e) => return Ok(self.end_aborted(e).await),
        };
        Ok(futures_util::future::join(
            self.client().execute(&probe, &[]),
            self.client().batch_execute(COMMIT),
        )
        .await)
    }

    /// The staged rows, then the probe and `COMMIT`, in one pipeline. A
    /// failed insert aborts the transaction, the probe then fails with
    /// 25P02, and the `COMMIT` rolls back. Fails without sending the
    /// `COMMIT` when an insert is refused before it was sent.
    async fn write_rows_then_commit(&self) -> Result<(PgResult<u64>, PgResult<()>)> {
        let chunks = OutboxRows::chunks(&self.state.outgoing);
        // The last chunk (nearly always the only one) goes with the COMMIT;
        // any before it, one round trip each. Each statement is prepared
        // once per connection; after that, no round trip.
        let probe = match self.prepare(PROBE).await? {
            Prepared::Statement(probe) => probe,
            Prepared::Aborted(e) => return Ok(self.end_aborted(e).await),
        };
        let mut last = None;
        for (i, chunk) in chunks.iter().enumerate() {
            let insert = match self.prepare(chunk.sql()).await? {
                Prepared::Statement(insert) => insert,
                Prepared::Aborted(e) => return Ok(self.end_aborted(e).await),
            };
            if i + 1 < chunks.len() {
                self.client()
                    .execute(&insert, &chunk.params())
                    .await
                    .map_err(Error::client)?;
            } else {
                last = Some((chunk, insert));
            }
        }
        let write = async {
            match &last {
                Some((chunk, insert)) => self.client().execute(insert, &chunk.params()).await.map(drop),
                None => Ok(()),
            }
        };
        let probing = self.client().execute(&probe, &[]);
        let committing = self.client().batch_execute(COMMIT);
        let mut write = std::pin::pin!(write);
        let (written, probed, committed) = match write.as_mut().now_or_never() {
            // Refused before it was sent (a value that does not fit the
            // column's type, after a schema change): the COMMIT must not
            // go without it.
            Some(Err(e)) => return Err(Error::client(e)),
            Some(Ok(())) => {
                let (probed, committed) = futures_util::future::join(probing, committing).await;
                (Ok(()), probed, committed)
            }
            None => futures_util::future::join3(write, probing, committing).await,
        };
        written.map_err(Error::client)?;
        Ok((probed, committed))
    }

    /// `sql` prepared once per connection, for [`commit`](Self::commit). A
    /// statement not prepared yet on this connection is prepared inside
    /// the transaction, which fails there (25P02) if a handler went on
    /// after a failed statement: that is the transaction's state, not the
    /// connection's, and the commit says so ([`Prepared::Aborted`]) instead
    /// of failing as a database error that discards the connection.
    async fn prepare(&self, sql: &str) -> Result<Prepared> {
        match self.client().prepare_cached(sql).await {
            Ok(statement) => Ok(Prepared::Statement(statement)),
            Err(e) if e.code() == Some(&SqlState::IN_FAILED_SQL_TRANSACTION) => Ok(Prepared::Aborted(e)),
            Err(e) => Err(Error::client(e)),
        }
    }

    /// What the probe and `COMMIT` come to in a transaction found aborted
    /// (`failed`) before they were sent: the probe's failure, and the
    /// transaction rolled back, keeping the connection.
    async fn end_aborted(&self, failed: tokio_postgres::Error) -> (PgResult<u64>, PgResult<()>) {
        (Err(failed), self.client().batch_execute(ROLLBACK).await)
    }

    /// Rolls back, keeping the connection for reuse when that succeeds.
    pub async fn rollback(mut self) -> Result<()> {
        self.client()
            .batch_execute(ROLLBACK)
            .await
            .map_err(Error::client)?;
        self.state.finished = true;
        Ok(())
    }

    /// Runs `statement`, then commits, in one pipeline, and returns its
    /// rows: for the outbox's short transactions, one round trip less. A
    /// failed statement aborts the transaction, the probe before `COMMIT`
    /// then fails, and nothing commits (the connection is discarded).
    /// Nothing staged with [`publish`](Self::publish) is written.
    pub(crate) async fn query_then_commit(
        mut self,
        statement: &tokio_postgres::Statement,
        params: &[&(dyn tokio_postgres::types::ToSql + Sync)],
    ) -> Result<Vec<tokio_postgres::Row>> {
        let (rows, committed) = futures_util::future::join(
            self.client().query(statement, params),
            self.client().batch_execute(COMMIT),
        )
        .await;
        let rows = rows.map_err(Error::client)?;
        committed.map_err(Error::client)?;
        self.state.finished = true;
        Ok(rows)
    }
}

/// Where a staged message goes.
#[derive(Debug, Clone, Copy)]
enum To<'a> {
    /// To whoever subscribes: `message_bus.exchange` with this routing
    /// key; on MassTransit's wire, the type's exchange.
    Subscribers(&'a str),
    /// To this one queue, through the default exchange.
    Queue(&'a str),
}

/// The row `message` stages through `outbox`, as a follow-up of `cause` if
/// it is one; refused here, in the caller's transaction, when the broker
/// would never take it.
fn outgoing<E: IntegrationEvent>(
    outbox: Option<&Outbox>,
    cause: Option<&MessageContext>,
    to: To<'_>,
    message: &Message<E>,
) -> Result<Outgoing> {
    let routing_key = match to {
        To::Subscribers(routing_key) | To::Queue(routing_key) => routing_key,
    };
    let Some(outbox) = outbox else {
        return Err(Error::new(
            crate::ErrorKind::Usage,
            format!(
                "cannot publish message {}: this unit of work has no outbox (the in_process provider, or a unit \
             of work not from the runtime)",
                message.id
            ),
        ));
    };
    let json = message.to_json()?;
    let own = message.own_headers()?;
    let trace = TraceContext::current(cause.and_then(|cause| cause.trace.as_ref()));
    // The message's own headers beside what the library carries over, in
    // place of a carried one of the same name.
    let set_own = |headers: &mut Vec<(String, String)>| {
        for (name, value) in own {
            headers.retain(|(key, _)| key != name);
            headers.push((name.clone(), value.clone()));
        }
    };
    let (exchange, headers, body) = match outbox.wire {
        Wire::Inbox => {
            let mut headers = follow_up_headers(cause, trace);
            set_own(&mut headers);
            let exchange = match to {
                To::Subscribers(_) => outbox.exchange.to_string(),
                To::Queue(_) => String::new(),
            };
            (exchange, headers, json)
        }
        // MassTransit publishes to the type's own fanout exchange, in
        // its envelope, with what its consumers carry on.
        Wire::Masstransit => {
            let mut headers = crate::masstransit::follow_up_headers(cause, trace.as_ref());
            set_own(&mut headers.amqp);
            for (name, value) in own {
                headers.envelope.insert(name.clone(), value.as_str().into());
            }
            let envelope = crate::masstransit::envelope_now(
                message.id,
                (E::TYPE, E::IMPLEMENTS),
                &json,
                cause,
                headers.envelope,
            )?;
            let exchange = match to {
                To::Subscribers(_) => E::TYPE.to_owned(),
                To::Queue(_) => String::new(),
            };
            (exchange, headers.amqp, envelope)
        }
    };
    let outgoing = Outgoing {
        message_id: message.id,
        exchange,
        routing_key: routing_key.to_owned(),
        message_type: E::TYPE.to_owned(),
        headers,
        body,
        properties: None,
    };
    if let Err(reason) = outgoing.check(outbox.max_message_size) {
        return Err(Error::unpublishable(
            message.id.to_string(),
            crate::fault::truncate(routing_key, 64).into_owned(),
            reason,
        ));
    }
    Ok(outgoing)
}

/// The headers of a message staged now on this library's wire, as a
/// follow-up of `cause` if any: its correlation and causation ids, and the
/// trace context (`trace`), which goes on with the row however late it is
/// dispatched.
fn follow_up_headers(cause: Option<&MessageContext>, trace: Option<TraceContext>) -> Vec<(String, String)> {
    let mut headers: Vec<(String, String)> = Vec::new();
    if let Some(cause) = cause {
        headers.extend(cause.follow_up_headers().map(|(k, v)| (k.to_owned(), v)));
    }
    if let Some(trace) = trace {
        headers.extend(trace.headers().map(|(k, v)| (k.to_owned(), v)));
    }
    headers
}

impl Drop for UnitOfWork {
    fn drop(&mut self) {
        if let Some(connection) = self.state.connection.take()
            && !self.state.finished
        {
            // Detach from the pool and close: the server aborts the
            // transaction when the connection goes.
            drop(Object::take(connection));
        }
    }
}

/// A handler's nested scope in a unit of work, from
/// [`UnitOfWork::nested`]: a savepoint of the handler's own.
#[derive(Debug)]
pub struct Nested<'a> {
    uow: &'a mut UnitOfWork,
    name: String,
    /// How many messages were staged when the scope opened.
    outgoing_at_open: usize,
    /// Neither released nor rolled back yet.
    open: bool,
}

impl Nested<'_> {
    /// Keeps what ran in the scope, as part of the message's transaction.
    pub async fn release(mut self) -> Result<()> {
        self.open = false;
        let sql = format!("RELEASE SAVEPOINT {}", self.name);
        self.uow
            .client()
            .batch_execute(&sql)
            .await
            .map_err(Error::client)?;
        Ok(())
    }

    /// Undoes what ran in the scope, a failed statement included; the
    /// message's transaction goes on.
    pub async fn rollback(mut self) -> Result<()> {
        self.open = false;
        self.uow.state.outgoing.truncate(self.outgoing_at_open);
        let sql = format!("ROLLBACK TO SAVEPOINT {0}; RELEASE SAVEPOINT {0}", self.name);
        self.uow
            .client()
            .batch_execute(&sql)
            .await
            .map_err(Error::client)?;
        Ok(())
    }
}

impl Deref for Nested<'_> {
    type Target = UnitOfWork;

    fn deref(&self) -> &UnitOfWork {
        self.uow
    }
}

impl DerefMut for Nested<'_> {
    fn deref_mut(&mut self) -> &mut UnitOfWork {
        self.uow
    }
}

impl Drop for Nested<'_> {
    fn drop(&mut self) {
        if self.open {
            self.uow.state.outgoing.truncate(self.outgoing_at_open);
            // Cannot await here: handed to the connection now, it runs
            // before the next statement (see `UnitOfWork::savepoint`). A
            // failure shows there, as an aborted transaction.
            let sql = format!("ROLLBACK TO SAVEPOINT {0}; RELEASE SAVEPOINT {0}", self.name);
            let _ = self.uow.client().batch_execute(&sql).now_or_never();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Settings;

    #[derive(serde::Serialize, serde::Deserialize)]
    struct Shipped {
        order: i64,
    }

    impl IntegrationEvent for Shipped {
        const TYPE: &'static str = "Shop:Shipped";
    }

    #[test]
    fn a_message_sent_goes_to_its_queue_and_one_published_to_subscribers_with_its_own_headers_on_both_wires()
    {
        for wire in [Wire::Inbox, Wire::Masstransit] {
            let outbox = Outbox {
                exchange: "events".into(),
                max_message_size: 1 << 20,
                wire,
                wake: Arc::default(),
                after_commit: None,
            };
            let message = Message::new(Shipped { order: 7 }).with_header("tenant", "acme");
            let staged = outgoing(Some(&outbox), None, To::Subscribers("q"), &message).unwrap();
            let expected = match wire {
                Wire::Inbox => "events",
                Wire::Masstransit => "Shop:Shipped",
            };
            assert_eq!(
                (staged.exchange.as_str(), staged.routing_key.as_str()),
                (expected, "q")
            );
            let sent = outgoing(Some(&outbox), None, To::Queue("billing"), &message).unwrap();
            assert_eq!(
                (sent.exchange.as_str(), sent.routing_key.as_str()),
                ("", "billing"),
                "{wire:?}"
            );
            if wire == Wire::Masstransit {
                let envelope: serde_json::Value = serde_json::from_slice(&sent.body).unwrap();
                assert!(
                    envelope["messageType"].is_array(),
                    "sent in its envelope too: {envelope}"
                );
            }
            assert!(
                staged.headers.contains(&("tenant".to_owned(), "acme".to_owned())),
                "{wire:?}: {:?}",
                staged.headers
            );
            if wire == Wire::Masstransit {
                let envelope: serde_json::Value = serde_json::from_slice(&staged.body).unwrap();
                assert_eq!(envelope["headers"]["tenant"], "acme");
            }
            let refused = Message::new(Shipped { order: 8 }).with_header("MT-Activity-Id", "x");
            assert!(
                outgoing(Some(&outbox), None, To::Queue("q"), &refused).is_err(),
                "{wire:?}"
            );
        }
    }

    /// On the machine's PostgreSQL (`database.url`'s default): a
    /// transaction with a savepoint, no tables.
    #[tokio::test]
    async fn rolling_back_to_a_savepoint_forgets_the_records_staged_since() {
        let pool = crate::db::create_pool(&Settings::default()).unwrap();
        let mut uow = UnitOfWork::begin(pool.get().await.unwrap().into()).await.unwrap();
        let (before, after) = (Uuid::now_v7(), Uuid::now_v7());
        uow.note_recorded(before);
        let mut uow = uow.savepoint().unwrap();
        uow.note_recorded(after);
        let uow = uow.rollback_to_savepoint().await.unwrap();
        // The row staged after the savepoint is gone with the rollback; a
        // store trusting the stale mark would skip writing it again.
        assert!(uow.is_recorded(before));
        assert!(!uow.is_recorded(after));
        uow.rollback().await.unwrap();
    }
}
