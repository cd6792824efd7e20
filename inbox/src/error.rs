//! The crate's one error type.

/// What a handler returns when it fails: whatever error the handler has, boxed.
///
/// Every handler error is transient: the message walks the failure policy
/// (immediate retries, retry tiers, then `Q.error`), since a later attempt
/// may succeed. Return a [`Permanent`] for a failure no attempt can fix, and
/// the message goes straight to `Q.error` with its reason. Whatever it
/// wraps, a handler's error never reads as a database outage: only the
/// runtime's own connection can hold a message (see [`Error::is_unavailable`]).
pub type HandlerError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// A handler's failure that no retry can fix: a business rejection ("order
/// 42 does not exist"), an event this service refuses. The message skips
/// the immediate retries and the retry tiers and goes straight to `Q.error`,
/// with this reason in `x-inbox-reason`.
///
/// ```
/// # use rabbit_inbox::{HandlerError, Permanent};
/// fn check(amount: i64) -> Result<(), HandlerError> {
///     if amount < 0 {
///         return Err(Permanent::new(format!("amount {amount} is negative")).into());
///     }
///     Ok(())
/// }
/// assert!(check(-1).unwrap_err().is::<Permanent>());
/// ```
///
/// Found anywhere in the error's source chain, so a handler's own error type
/// may wrap it.
#[derive(Debug, thiserror::Error)]
#[error("{reason}")]
pub struct Permanent {
    reason: String,
}

impl Permanent {
    /// A permanent failure, for `reason`.
    pub fn new(reason: impl Into<String>) -> Self {
        Self {
            reason: reason.into(),
        }
    }

    /// Whether `error`, or one of its sources, is a [`Permanent`].
    pub fn is_in(error: &(dyn std::error::Error + 'static)) -> bool {
        let mut current = Some(error);
        while let Some(e) = current {
            if e.is::<Permanent>() {
                return true;
            }
            current = e.source();
        }
        false
    }
}

/// `Result` with this crate's [`Error`]. No second parameter, so that
/// `rabbit_inbox::Result::Ok(())` infers.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in `rabbit-inbox`, outside a handler's own code:
/// a [kind](Error::kind), a message that names what failed (the setting,
/// the message, the queue, where it tried to connect), and the cause as
/// its [`source`](std::error::Error::source). Opaque, as tokio-postgres's
/// is: the clients it wraps are not part of its API, so they can be
/// upgraded without breaking a service.
pub struct Error(Box<Repr>);

/// What kind of failure an [`Error`] is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorKind {
    /// A setting has a value the runtime cannot use (the message names it
    /// as `section.key`), or the settings could not be read.
    Settings,
    /// The service asked for something the runtime cannot do: two event
    /// types with one name, no handler at all, migrations out of order, a
    /// publish on a unit of work without an outbox, a commit after a
    /// failed statement.
    Usage,
    /// The start could not reach the database or the broker within its
    /// connect timeout.
    Unreachable,
    /// A PostgreSQL statement failed, or no connection could be had.
    Database,
    /// A RabbitMQ operation failed.
    Broker,
    /// A queue or an exchange could not be declared as the settings
    /// describe it (it exists with other arguments or another type).
    Topology,
    /// The broker refused a publish: a nack, or no queue to route it to.
    Refused,
    /// The broker did not confirm a publish in time; whether it took the
    /// message is unknown.
    ConfirmTimeout,
    /// The broker blocked publishing (a memory or disk alarm).
    Blocked,
    /// A message the broker would never take, refused before it was sent.
    Unpublishable,
    /// An event could not be serialized to JSON.
    Serialize,
    /// Published in process, the message was not completed by the handlers.
    Abandoned,
    /// The runtime has stopped, or the system refused it something (a
    /// signal handler).
    Stopped,
}

/// What an [`Error`] holds.
#[derive(Debug, thiserror::Error)]
pub(crate) enum Repr {
    /// A setting has a value the runtime cannot use; `key` names it as written
    /// in `config/default.toml` (`section.key`).
    #[error("invalid setting `{key}`: {reason}")]
    Setting {
        /// The setting, as `section.key`.
        key: String,
        /// What is wrong with its value.
        reason: String,
    },

    /// The settings files or environment could not be read or layered.
    #[error("cannot load settings: {0}")]
    Config(#[source] config::ConfigError),

    /// A PostgreSQL statement failed.
    #[error("database error: {}", describe(.0))]
    Database(#[source] tokio_postgres::Error),

    /// No connection could be taken from the pool. The text carries the
    /// cause (`database "x" does not exist`, a refused connection) and the
    /// server it was for.
    #[error("cannot connect to the database: {}", describe_checkout(.0))]
    Pool(#[source] deadpool_postgres::PoolError),

    /// An inbox store of the service's own failed.
    #[error("inbox store error: {}", describe(.0.as_ref()))]
    Store(#[source] Box<dyn std::error::Error + Send + Sync + 'static>),

    /// A RabbitMQ operation failed.
    #[error("broker error: {}", describe(.0))]
    Broker(#[source] lapin::Error),

    /// The broker did not confirm a publish (nack, or the message was unroutable).
    #[error("broker did not accept message {message_id} for `{routing_key}`: {reason}")]
    Refused {
        /// The message's id, as it was on the message (or `none`).
        message_id: String,
        /// Where it was sent.
        routing_key: String,
        /// What the broker said.
        reason: String,
    },

    /// A message the broker would never take (a name past 255 bytes,
    /// properties past a frame, a body past `message_bus.max_message_size`):
    /// refused before it was sent, since sending it would fail others too.
    #[error("message {message_id} for `{routing_key}` cannot be published: {reason}")]
    Unpublishable {
        /// The message's id.
        message_id: String,
        /// Where it was to go (cut to 64 bytes).
        routing_key: String,
        /// The limit it breaks.
        reason: String,
    },

    /// The broker blocked the connection (a memory or disk alarm): nothing
    /// is published until it lifts, so that no copy waits in the client to
    /// go out with the others once it does.
    #[error(
        "message {message_id} for `{routing_key}` not sent: the broker blocked the connection (a resource alarm)"
    )]
    Blocked {
        /// The message's id.
        message_id: String,
        /// Where it was to go.
        routing_key: String,
    },

    /// The broker did not confirm a publish in time: a resource alarm, a
    /// node that went, or a network that answers nothing. Whether the
    /// broker took the message is unknown.
    #[error(
        "no confirm for message {message_id} to `{routing_key}` within {} (a resource alarm, a lost node, or a network that answers nothing)",
        humantime::format_duration(*.waited)
    )]
    ConfirmTimeout {
        /// The message's id, as it was on the message (or `none`).
        message_id: String,
        /// Where it was sent.
        routing_key: String,
        /// How long it waited (`message_bus.confirm_timeout`).
        waited: std::time::Duration,
    },

    /// An event could not be serialized to JSON.
    #[error("cannot serialize event `{event_type}`: {source}")]
    Serialize {
        /// The event's type name.
        event_type: &'static str,
        /// The serializer's error.
        source: serde_json::Error,
    },

    /// A queue could not be declared as the settings describe it, typically
    /// because it exists with other arguments.
    #[error("cannot declare queue `{queue}`: {reason}")]
    Topology {
        /// The queue.
        queue: String,
        /// What the broker said (for a mismatch, which argument differs).
        reason: String,
    },

    /// The exchange publishing sends to could not be declared, typically
    /// because it exists with another type.
    #[error("cannot declare exchange `{exchange}`: {reason}")]
    Exchange {
        /// The exchange (`message_bus.exchange`).
        exchange: String,
        /// What the broker said.
        reason: String,
    },

    /// The start could not reach the broker or the database: every attempt
    /// failed until the connect timeout. Names where it tried (never the
    /// password) and the last attempt's cause.
    #[error("cannot reach the {service} at {endpoint} within {} ({key}): {cause}", humantime::format_duration(*.waited))]
    Unreachable {
        /// `broker` or `database`.
        service: &'static str,
        /// `host:port/vhost` or `host:port/dbname`.
        endpoint: String,
        /// How long the start kept trying.
        waited: std::time::Duration,
        /// The setting that bounds the wait.
        key: &'static str,
        /// Why the last attempt failed.
        cause: String,
    },

    /// Any other failure: its kind, and what happened.
    #[error("{text}")]
    Other {
        /// Its kind.
        kind: ErrorKind,
        /// What happened.
        text: String,
    },

    /// A message was handed to the handlers and they did not complete it.
    /// Returned by in-process publishing, where the caller is the consumer.
    #[error("message {message_id} was abandoned: {reason}")]
    Abandoned {
        /// The message's id.
        message_id: uuid::Uuid,
        /// Why it was abandoned.
        reason: String,
    },
}

/// An error with its sources, on one line: tokio-postgres says only
/// `db error` and keeps PostgreSQL's message (`deadlock detected`, with its
/// SQLSTATE) in the source, which is what logs and fault headers need.
pub fn describe(error: &(dyn std::error::Error + 'static)) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let more = match cause.downcast_ref::<tokio_postgres::error::DbError>() {
            Some(db) => format!("{} ({})", db.message(), db.code().code()),
            None => cause.to_string(),
        };
        if !text.contains(&more) {
            text = format!("{text}: {more}");
        }
        source = cause.source();
    }
    text
}

/// [`describe`] of a failed checkout from the pool, with what to change
/// when the server has no connection slot left for a new connection
/// (53300): the pools of every instance together outgrew it, and only
/// settings can mend that.
fn describe_checkout(error: &deadpool_postgres::PoolError) -> String {
    let text = describe(error);
    match error {
        deadpool_postgres::PoolError::Backend(e) if no_slot_left(e) => {
            format!("{text}; {NO_SLOT_LEFT_HINT}")
        }
        _ => text,
    }
}

/// What to change when the server has no connection slot left (53300).
pub(crate) const NO_SLOT_LEFT_HINT: &str = "keep `database.pool_size`, times the instances, below the server's `max_connections` (or the role's connection limit)";

/// Whether the server refused a connection for want of slots (53300:
/// `max_connections`, or the role's limit).
pub(crate) fn no_slot_left(error: &tokio_postgres::Error) -> bool {
    error.code() == Some(&tokio_postgres::error::SqlState::TOO_MANY_CONNECTIONS)
}

/// Whether `error` (or one of its sources) says the database cannot take
/// the runtime's writes now, rather than that it refused a statement: a
/// closed or broken connection, a failed connect, a server shutting down or
/// starting up (SQLSTATE class 08, 57P01-57P03), a server that is read-only
/// (25006: a standby, or a primary being failed over) and one that has no
/// connection left (53300). Such a failure says nothing about the message,
/// so the runtime waits for a writable database instead of spending the
/// message's attempts.
///
/// A full disk (53100) and a server out of memory (53200) are not counted:
/// one message can cause either (a sort or a temporary file too large, a
/// huge value), so holding it would retry it forever, and no probe can see
/// either end. They fail the attempt like any error, and the retry tiers
/// give the server time to recover without losing the message.
///
/// Apply it only to errors of the runtime's own pool and connection: an
/// I/O error counts, which is right for those and wrong for a handler's
/// (a refused HTTP call is not the inbox's database going away). The
/// runtime judges a failed handler by whether the unit of work's own
/// connection is still open instead.
pub(crate) fn is_unavailable(error: &(dyn std::error::Error + 'static)) -> bool {
    /// Outside class 08: shutting down (57P01 admin, 57P02 crash), starting
    /// up (57P03), read-only (25006), no connection slot left (53300).
    const UNAVAILABLE: [&str; 5] = ["57P01", "57P02", "57P03", "25006", "53300"];
    use deadpool_postgres::PoolError;
    // A certificate refused (or a handshake the server refused) fails
    // alike every time: the settings' to fix, not an outage.
    if tls_failure(error).is_some() {
        return false;
    }
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(pg) = e.downcast_ref::<tokio_postgres::Error>() {
            if pg.is_closed() {
                return true;
            }
            if let Some(state) = pg.code() {
                let code = state.code();
                return code.starts_with("08") || UNAVAILABLE.contains(&code);
            }
        }
        if let Some(pool) = e.downcast_ref::<PoolError>() {
            match pool {
                // A refused or broken connection is an outage; a server that
                // answered "no such database" or "wrong password" is not.
                PoolError::Backend(backend) => return is_unavailable(backend),
                // Wait: every connection stayed busy past the transaction
                // timeout, as they do when the network drops their packets.
                PoolError::Timeout(_) => return true,
                PoolError::PostCreateHook(_) => return true,
                _ => {}
            }
        }
        if e.is::<std::io::Error>() {
            return true;
        }
        current = e.source();
    }
    false
}

/// The TLS failure in `error`'s chain, if any: a certificate the client
/// refused, a handshake the server refused. Such a failure is the
/// configuration's, not an outage: trying again changes nothing.
pub(crate) fn tls_failure<'a>(error: &'a (dyn std::error::Error + 'static)) -> Option<&'a rustls::Error> {
    let mut current = Some(error);
    while let Some(e) = current {
        if let Some(tls) = e.downcast_ref::<rustls::Error>() {
            return Some(tls);
        }
        // io::Error's `source` skips the error it wraps: look inside.
        if let Some(tls) = e
            .downcast_ref::<std::io::Error>()
            .and_then(|io| io.get_ref())
            .and_then(|inner| inner.downcast_ref::<rustls::Error>())
        {
            return Some(tls);
        }
        current = e.source();
    }
    None
}

impl Error {
    /// A client's error (PostgreSQL, the pool, RabbitMQ, the settings
    /// loader) as ours: `.map_err(Error::client)?`.
    pub(crate) fn client(error: impl Into<Repr>) -> Self {
        Error(Box::new(error.into()))
    }

    /// What an inbox store failed with, as ours: our own errors as they
    /// are, PostgreSQL's (what `?` boxes in any store, `PgInboxStore`
    /// included) as the database errors they are, anything else a store
    /// failure with it as the source. All of them are `Database` errors,
    /// read as an outage when the connection went away.
    pub(crate) fn store(error: Box<dyn std::error::Error + Send + Sync + 'static>) -> Self {
        let error = match error.downcast::<Error>() {
            Ok(ours) => return *ours,
            Err(other) => other,
        };
        match error.downcast::<tokio_postgres::Error>() {
            Ok(database) => Repr::Database(*database).into(),
            Err(other) => Repr::Store(other).into(),
        }
    }

    /// A failure of `kind`, saying `text`.
    pub(crate) fn new(kind: ErrorKind, text: impl Into<String>) -> Self {
        Repr::Other {
            kind,
            text: text.into(),
        }
        .into()
    }

    /// What kind of failure it is.
    pub fn kind(&self) -> ErrorKind {
        match &*self.0 {
            Repr::Setting { .. } | Repr::Config(_) => ErrorKind::Settings,
            Repr::Database(_) | Repr::Pool(_) | Repr::Store(_) => ErrorKind::Database,
            Repr::Broker(_) => ErrorKind::Broker,
            Repr::Refused { .. } => ErrorKind::Refused,
            Repr::Unpublishable { .. } => ErrorKind::Unpublishable,
            Repr::Blocked { .. } => ErrorKind::Blocked,
            Repr::ConfirmTimeout { .. } => ErrorKind::ConfirmTimeout,
            Repr::Serialize { .. } => ErrorKind::Serialize,
            Repr::Topology { .. } | Repr::Exchange { .. } => ErrorKind::Topology,
            Repr::Unreachable { .. } => ErrorKind::Unreachable,
            Repr::Abandoned { .. } => ErrorKind::Abandoned,
            Repr::Other { kind, .. } => *kind,
        }
    }

    /// Whether the database or the broker could not be reached, or went
    /// away (a refused or dropped connection, a server shutting down or
    /// starting, a pool with no connection to give): an outage, not a
    /// fault of the message.
    pub fn is_unavailable(&self) -> bool {
        is_unavailable(self)
    }

    /// Whether a publish failed because the broker could not be reached or
    /// did not answer, rather than because it refused the message: a
    /// connection that failed, closed or is being recovered (an I/O error, a
    /// missed heartbeat, a connection-level AMQP error such as a node
    /// shutting down), no connection to be had, or no confirm in time. Such a failure says
    /// nothing about the message; a refusal (unroutable, a nack, a channel
    /// error such as a missing exchange) does.
    pub fn is_broker_unavailable(&self) -> bool {
        use lapin::ErrorKind;
        match &*self.0 {
            Repr::Unreachable { service, .. } => *service == "broker",
            Repr::ConfirmTimeout { .. } | Repr::Blocked { .. } => true,
            Repr::Broker(error) => match error.kind() {
                ErrorKind::IOError(_)
                | ErrorKind::RuntimeShutdownError(_)
                | ErrorKind::InvalidConnectionState(_)
                | ErrorKind::MissingHeartbeatError
                // lapin is recovering the connection under the channel.
                | ErrorKind::InvalidChannelState(lapin::ChannelState::Reconnecting, _) => true,
                // A connection-level error, unless one message caused it:
                // that is the message's failure, not an outage.
                ErrorKind::ProtocolError(amqp) => {
                    matches!(amqp.kind(), lapin::protocol::AMQPErrorKind::Hard(_)) && !caused_by_a_message(amqp)
                }
                _ => false,
            },
            _ => false,
        }
    }

    /// Whether the broker closed the publishing channel over a publish (an
    /// exchange that does not exist, a body past its `max_message_size`),
    /// or the connection over a malformed frame. Every publish in flight on
    /// that channel fails with the same error, so it does not say which of
    /// them caused it: only one sent alone does.
    pub fn is_channel_closed_by_broker(&self) -> bool {
        use lapin::ErrorKind;
        let Repr::Broker(error) = &*self.0 else {
            return false;
        };
        match error.kind() {
            ErrorKind::ProtocolError(amqp) => match amqp.kind() {
                lapin::protocol::AMQPErrorKind::Soft(_) => true,
                lapin::protocol::AMQPErrorKind::Hard(_) => caused_by_a_message(amqp),
            },
            ErrorKind::InvalidChannelState(lapin::ChannelState::Closed | lapin::ChannelState::Error, _) => {
                true
            }
            _ => false,
        }
    }

    pub(crate) fn setting(key: &str, reason: impl Into<String>) -> Self {
        Repr::Setting {
            key: key.to_owned(),
            reason: reason.into(),
        }
        .into()
    }

    /// A message `message_id` the handlers did not complete, for `reason`.
    pub(crate) fn abandoned(message_id: uuid::Uuid, reason: String) -> Self {
        Repr::Abandoned { message_id, reason }.into()
    }

    pub(crate) fn refused(message_id: String, routing_key: String, reason: String) -> Self {
        Repr::Refused {
            message_id,
            routing_key,
            reason,
        }
        .into()
    }

    pub(crate) fn unpublishable(message_id: String, routing_key: String, reason: String) -> Self {
        Repr::Unpublishable {
            message_id,
            routing_key,
            reason,
        }
        .into()
    }

    pub(crate) fn blocked(message_id: String, routing_key: String) -> Self {
        Repr::Blocked {
            message_id,
            routing_key,
        }
        .into()
    }

    pub(crate) fn confirm_timeout(
        message_id: String,
        routing_key: String,
        waited: std::time::Duration,
    ) -> Self {
        Repr::ConfirmTimeout {
            message_id,
            routing_key,
            waited,
        }
        .into()
    }

    pub(crate) fn serialize(event_type: &'static str, source: serde_json::Error) -> Self {
        Repr::Serialize { event_type, source }.into()
    }

    pub(crate) fn topology(queue: String, reason: String) -> Self {
        Repr::Topology { queue, reason }.into()
    }

    pub(crate) fn exchange(exchange: String, reason: String) -> Self {
        Repr::Exchange { exchange, reason }.into()
    }

    pub(crate) fn unreachable(
        service: &'static str,
        endpoint: String,
        waited: std::time::Duration,
        key: &'static str,
        cause: String,
    ) -> Self {
        Repr::Unreachable {
            service,
            endpoint,
            waited,
            key,
            cause,
        }
        .into()
    }
}

impl From<Repr> for Error {
    fn from(repr: Repr) -> Self {
        Self(Box::new(repr))
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::fmt::Debug for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl std::error::Error for Error {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        self.0.source()
    }
}

// The clients' errors become ours through `Error::client`, not through
// `From`: a `From` impl would be public, and the clients are not part of
// the API (a service never builds an `Error` from one of theirs).
macro_rules! client_errors {
    ($($client:ty => $variant:ident),* $(,)?) => {$(
        impl From<$client> for Repr {
            fn from(error: $client) -> Self {
                Repr::$variant(error)
            }
        }
    )*};
}

client_errors! {
    config::ConfigError => Config,
    tokio_postgres::Error => Database,
    deadpool_postgres::PoolError => Pool,
    lapin::Error => Broker,
}

/// Whether a connection-level AMQP error answers what one message carried
/// (a frame the broker could not read), rather than the broker's state.
fn caused_by_a_message(error: &lapin::protocol::AMQPError) -> bool {
    use lapin::protocol::{AMQPErrorKind, AMQPHardError};
    matches!(
        error.kind(),
        AMQPErrorKind::Hard(
            AMQPHardError::FRAMEERROR
                | AMQPHardError::SYNTAXERROR
                | AMQPHardError::COMMANDINVALID
                | AMQPHardError::UNEXPECTEDFRAME
        )
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, thiserror::Error)]
    #[error("handler failed")]
    struct Outer(#[source] std::io::Error);

    #[test]
    fn unavailability_is_read_from_the_source_chain() {
        let refused = Outer(std::io::Error::from(std::io::ErrorKind::ConnectionRefused));
        assert!(is_unavailable(&refused));
        assert!(!is_unavailable(&std::fmt::Error));
        assert!(
            Error::client(deadpool_postgres::PoolError::Timeout(
                deadpool_postgres::TimeoutType::Create
            ))
            .is_unavailable()
        );
        assert!(!Error::client(deadpool_postgres::PoolError::Closed).is_unavailable());
    }

    #[test]
    fn a_stores_errors_are_database_errors_and_ours_stay_as_they_are() {
        let ours = Error::store(Box::new(Error::new(ErrorKind::Usage, "misused")));
        assert_eq!(ours.kind(), ErrorKind::Usage);
        assert_eq!(ours.to_string(), "misused");
        // An HTTP call's refusal inside a store of a service's own: a
        // database failure of the store, with its cause, and (an I/O error)
        // read as an outage, as the store's connection going away would be.
        let io = Error::store(Box::new(std::io::Error::from(
            std::io::ErrorKind::ConnectionRefused,
        )));
        assert_eq!(io.kind(), ErrorKind::Database);
        assert!(io.to_string().starts_with("inbox store error: "), "{io}");
        assert!(io.is_unavailable());
        let plain = Error::store("no such tenant".into());
        assert_eq!(plain.kind(), ErrorKind::Database);
        assert!(!plain.is_unavailable(), "{plain}");
    }

    #[test]
    fn an_error_says_its_kind_and_keeps_its_cause_as_its_source() {
        let closed = Error::client(deadpool_postgres::PoolError::Closed);
        assert_eq!(closed.kind(), ErrorKind::Database);
        assert!(std::error::Error::source(&closed).is_some());
        let setting = Error::setting("database.url", "not a URL");
        assert_eq!(setting.kind(), ErrorKind::Settings);
        assert_eq!(setting.to_string(), "invalid setting `database.url`: not a URL");
        let usage = Error::new(ErrorKind::Usage, "no handler is registered");
        assert_eq!(
            (usage.kind(), usage.to_string().as_str()),
            (ErrorKind::Usage, "no handler is registered")
        );
        assert!(std::error::Error::source(&usage).is_none());
        assert_eq!(
            Error::unpublishable("id".into(), "q".into(), "too big".into()).kind(),
            ErrorKind::Unpublishable
        );
    }

    #[test]
    fn result_infers_from_ok_alone() {
        // With a defaulted error parameter this was E0282.
        let done = crate::Result::Ok(());
        assert!(done.is_ok());
    }

    #[test]
    fn describe_walks_the_sources_once_each() {
        let error = Outer(std::io::Error::other("disk on fire"));
        assert_eq!(describe(&error), "handler failed: disk on fire");
        let plain = std::io::Error::other("just this");
        assert_eq!(describe(&plain), "just this");
    }
}
