//! Settings: layered raw values, then validation with errors that name the key.
//!
//! Layers, later ones winning: the built-in defaults below (the same values
//! `config/default.toml` documents), `config/default.toml`,
//! `config/{INBOX_ENV}.toml`, then environment variables
//! `INBOX__SECTION__KEY` (for example `INBOX__DATABASE__POOL_SIZE=32`).
//!
//! One concern a file: the schema and its defaults here; `load.rs` (files
//! and environment), `validate.rs` ([`ValidSettings`]: errors that name
//! the key), `connection.rs` (where the database and the brokers are, and
//! passwords kept out of logs).

use std::time::Duration;

use serde::Deserialize;

mod connection;
mod load;
#[cfg(test)]
mod tests;
mod tls;
mod validate;

pub(crate) use connection::{broker_endpoint, percent_encode, redact};
pub(crate) use tls::{BrokerTls, without_amqp_tls_params};
pub use validate::ValidSettings;
pub(crate) use validate::{MAX_DELIVERY_LIMIT, no_broker};

/// Every setting of the runtime. Build it with [`Settings::load`] (files and
/// environment) or in code from [`Settings::default`]; the runtime validates
/// it again on start.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct Settings {
    /// `[message_bus]`: which bus, where it is, and whether the inbox is on.
    pub message_bus: MessageBusSettings,
    /// `[database]`: the service's own PostgreSQL database, home of the inbox.
    pub database: DatabaseSettings,
    /// `[[queues]]`: the queues this service consumes, one consumer actor each.
    pub queues: Vec<QueueSettings>,
    /// `[failure]`: what happens to a message its handlers cannot process.
    pub failure: FailureSettings,
    /// `[retention]`: how long inbox rows are kept.
    pub retention: RetentionSettings,
    /// `[runtime]`: lifecycle of the actors.
    pub runtime: RuntimeSettings,
    /// `[outbox]`: dispatching the messages staged with
    /// [`UnitOfWork::publish`](crate::UnitOfWork::publish).
    pub outbox: OutboxSettings,
    /// `[failures]`: keeping failed messages in the database, for an
    /// operator.
    pub failures: FailuresSettings,
}

/// `[failures]`: where failed messages are kept, and the operator plane
/// that works on them (`rabbit_inbox::ops`).
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct FailuresSettings {
    /// `drain`: consume every consumed queue's error and skipped queues
    /// (`Q.error`, `Q.skipped`; `Q_error`, `Q_skipped`) into the table
    /// `inbox_failures`, each copy written and committed before it is
    /// acked, on every instance as competing consumers. On where an
    /// operator works from the database (the operator plane); off, failures
    /// stay in the broker for the tools that read those queues (a monitor
    /// bound to the error exchange still gets every copy either way: the
    /// drainer consumes the queue, not the exchange). Default `false`.
    ///
    /// On, the runtime also runs the operator plane's work on every
    /// instance: redrive jobs, queues an operator paused; and retention
    /// keeps every failure nobody resolved (redrove or discarded).
    pub drain: bool,
    /// `pause_redrive_at`: a redrive job pauses itself when more than this
    /// share of the messages it redrove failed again (and at least 10
    /// did): the cause is likely not fixed. From 0 to 1; default 0.5.
    pub pause_redrive_at: f64,
    /// `token_files`: the files of the operator plane's access tokens, one
    /// `NAME ROLE TOKEN` a line (`ROLE`: `reader`, `operator` or `admin`;
    /// `#` starts a comment). The tokens themselves are never settings.
    /// Read when the HTTP scope is built (`rabbit_inbox::ops::http`).
    pub token_files: Vec<std::path::PathBuf>,
}

impl Default for FailuresSettings {
    fn default() -> Self {
        Self {
            drain: false,
            pause_redrive_at: 0.5,
            token_files: Vec::new(),
        }
    }
}

/// How events travel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Provider {
    /// Through RabbitMQ: at-least-once delivery, so the inbox defaults to on.
    #[default]
    Rabbitmq,
    /// Straight to the handler actors in this process, no broker: nothing is
    /// ever redelivered, so the inbox defaults to off.
    InProcess,
}

/// What a message looks like on the wire, and how the queues kept beside a
/// consumed queue are named.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Wire {
    /// This library's own contract: the AMQP `message_id` and `type`
    /// properties, the event as the JSON body; `Q.retry.<n>`, `Q.error`,
    /// `Q.skipped`.
    #[default]
    Inbox,
    /// MassTransit 8's (`docs/masstransit.md`): the JSON envelope (or raw
    /// JSON), types as `urn:message:Namespace:Type`, a fanout exchange per
    /// queue and per message type, `Q_error` and `Q_skipped` with
    /// MassTransit's `MT-*` fault headers; `Q_retry_<n>` for the delay
    /// tiers (MassTransit's own delays need a broker plugin).
    Masstransit,
}

/// `[message_bus]`. Its `Debug` hides the passwords in `amqp_urls`.
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct MessageBusSettings {
    /// `provider`: `rabbitmq` or `in_process`. Default `rabbitmq`.
    pub provider: Provider,
    /// `wire`: `inbox` (this library's contract) or `masstransit`
    /// (MassTransit 8's envelope, topology and fault conventions). Default
    /// `inbox`.
    pub wire: Wire,
    /// `amqp_urls`: the broker, as one URL, or the nodes of a RabbitMQ
    /// cluster, one URL each. Every connection (consumers, the publisher,
    /// the outbox dispatcher) goes to the next node in turn, and a failed
    /// attempt moves on to the next. A settings file may give one URL as a
    /// string; the environment a comma-separated list. Default
    /// `["amqp://guest:guest@127.0.0.1:5672/%2f"]`, which an empty list in
    /// a settings file also means.
    ///
    /// `amqp_url`, the one-broker spelling of earlier versions, is still
    /// read (with a WARN naming this key) where `amqp_urls` is not set.
    ///
    /// `amqps://` connects over TLS and verifies the broker: its
    /// certificate chain up to the system's CAs (or `cacertfile`), and its
    /// name. A URL may carry the TLS query parameters of RabbitMQ's URI
    /// spec: `cacertfile`, `certfile`, `keyfile` (a client certificate,
    /// unencrypted PEM) and `server_name_indication`; they win over the
    /// `tls_*` settings below. `auth_mechanism=external` logs in with the
    /// client certificate (RabbitMQ's `rabbitmq_auth_mechanism_ssl`).
    #[serde(deserialize_with = "one_or_many")]
    pub amqp_urls: Vec<String>,
    /// `password`: the brokers' password, replacing the one in
    /// `amqp_urls` (for example from `INBOX__MESSAGE_BUS__PASSWORD`).
    /// Never logged. Default unset.
    pub password: Option<String>,
    /// `password_file`: a file holding the brokers' password (a mounted
    /// secret; a trailing newline is dropped), replacing the one in
    /// `amqp_urls`. Not with `password`. Default unset.
    pub password_file: Option<String>,
    /// `tls_ca_file`: for `amqps://`, the PEM file of the CA to trust
    /// instead of the system's (`cacertfile` in a URL wins). Default unset.
    pub tls_ca_file: Option<String>,
    /// `tls_cert_file`: for `amqps://`, a PEM client certificate to present
    /// (`certfile` in a URL wins). Default unset.
    pub tls_cert_file: Option<String>,
    /// `tls_key_file`: its unencrypted PEM key (`keyfile` in a URL wins).
    /// Default unset.
    pub tls_key_file: Option<String>,
    /// `tls_server_name`: for `amqps://`, the name to verify the broker's
    /// certificate against (and to send as SNI) instead of the URL's host,
    /// as when the broker is reached through an IP address or a tunnel
    /// (`server_name_indication` in a URL wins). Default unset.
    pub tls_server_name: Option<String>,
    /// `exchange`: where publishing sends events.
    /// Default `""`, the default exchange, where the routing key is the queue name.
    pub exchange: String,
    /// `enable_inbox`: deduplicate redeliveries through `inbox_messages`.
    /// Default unset: on for `rabbitmq`, off for `in_process`. An explicit
    /// value wins both ways; see [`Settings::is_inbox_enabled`].
    pub enable_inbox: Option<bool>,
    /// `enable_outbox`: stage what units of work publish in
    /// `outbox_messages`, so that it leaves only once their transaction has
    /// committed, then at least once. Default unset: on for `rabbitmq`, off
    /// for `in_process`. Off, a staged message is published right after the
    /// commit (a crash in between loses it); in process, it reaches the
    /// handlers after the commit. See [`Settings::is_outbox_enabled`].
    pub enable_outbox: Option<bool>,
    /// `connect_timeout`: how long the start keeps trying to reach the
    /// broker (each failed attempt is a WARN naming it) before it fails;
    /// also the longest one connection attempt may take later, when a
    /// consumer reconnects. Default `30s`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// `confirm_timeout`: the longest a publish waits for the broker's
    /// confirm. A broker under a memory or disk alarm takes no publishes,
    /// and a network that drops packets answers nothing: past this, a move
    /// to a retry tier or `Q.error` hands its message back to the broker
    /// (to be tried again later), and a publish from code fails. A publish
    /// the broker blocked after it was written has this long after the
    /// alarm lifts. Default `30s`.
    #[serde(with = "humantime_serde")]
    pub confirm_timeout: Duration,
    /// `max_message_size`: the largest body, in bytes, that a unit of work
    /// may stage and the outbox sends: the broker closes the channel on a
    /// larger one. Set it to the broker's own `max_message_size`. Default
    /// 16 MiB (RabbitMQ 4's default).
    pub max_message_size: usize,
}

impl Default for MessageBusSettings {
    fn default() -> Self {
        Self {
            provider: Provider::Rabbitmq,
            wire: Wire::Inbox,
            amqp_urls: vec![DEFAULT_AMQP_URL.into()],
            password: None,
            password_file: None,
            tls_ca_file: None,
            tls_cert_file: None,
            tls_key_file: None,
            tls_server_name: None,
            exchange: String::new(),
            enable_inbox: None,
            enable_outbox: None,
            connect_timeout: Duration::from_secs(30),
            confirm_timeout: Duration::from_secs(30),
            max_message_size: crate::limits::DEFAULT_MAX_MESSAGE_SIZE,
        }
    }
}

impl std::fmt::Debug for MessageBusSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MessageBusSettings")
            .field("provider", &self.provider)
            .field("wire", &self.wire)
            .field(
                "amqp_urls",
                &self.amqp_urls.iter().map(|url| redact(url)).collect::<Vec<_>>(),
            )
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("tls_ca_file", &self.tls_ca_file)
            .field("tls_cert_file", &self.tls_cert_file)
            .field("tls_key_file", &self.tls_key_file)
            .field("tls_server_name", &self.tls_server_name)
            .field("exchange", &self.exchange)
            .field("enable_inbox", &self.enable_inbox)
            .field("enable_outbox", &self.enable_outbox)
            .field("connect_timeout", &self.connect_timeout)
            .field("confirm_timeout", &self.confirm_timeout)
            .field("max_message_size", &self.max_message_size)
            .finish()
    }
}

/// `[database]`. Its `Debug` hides the password in `url`.
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct DatabaseSettings {
    /// `url`: where the database is, and which: a PostgreSQL URL
    /// (`postgres://user:password@host:port/dbname`) or `key=value`
    /// connection string. [`DatabaseSettings::set_dbname`] names another
    /// database on the same server. Default
    /// `postgres://postgres@127.0.0.1:5432/postgres`.
    ///
    /// `name`, a database name that replaced the one in `url` in earlier
    /// versions, is still read (with a WARN naming this key): it is written
    /// into `url` as the settings load.
    ///
    /// TLS is set with libpq's parameters, in the query of a URL or as
    /// `key=value`: `sslmode` (`disable`, `prefer`, `require`, `verify-ca`
    /// or `verify-full`; default `prefer`, as libpq's), `sslrootcert` (the
    /// PEM file of a private CA; `system` or none: the system's CAs),
    /// `sslcert` and `sslkey` (a client certificate, unencrypted PEM).
    pub url: String,
    /// `password`: the database password, replacing the one in `url` (for
    /// example from `INBOX__DATABASE__PASSWORD`). Never logged. Default
    /// unset.
    pub password: Option<String>,
    /// `password_file`: a file holding the database password (a mounted
    /// secret; a trailing newline is dropped), replacing the one in `url`.
    /// Not with `password`. Default unset.
    pub password_file: Option<String>,
    /// `pool_size`: connections in the inbox pool. A batch in flight holds
    /// one (two per queue at the default `prefetch` and `batch_size`), and
    /// so does each message processed alone (`batch_size = 1`, a message
    /// that left its batch): keep it at least the sum of the queues'
    /// `prefetch` where messages go alone, or wait for connections there.
    /// Connections are opened as needed. Default 20.
    pub pool_size: usize,
    /// `run_migrations`: create or update the inbox's tables at startup.
    /// Default `true`.
    pub run_migrations: bool,
    /// `lock_timeout`: the longest a message's transaction waits for a row
    /// lock, above all for a concurrent delivery of the same message to
    /// finish. Past it the message goes back to the broker (and is skipped
    /// there if the other delivery committed). Default `5s`.
    #[serde(with = "humantime_serde")]
    pub lock_timeout: Duration,
    /// `connect_timeout`: the longest one new connection may take; also how
    /// long the start keeps trying to reach the database (each failed
    /// attempt is a WARN naming it) before it fails. Default `5s`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
    /// `transaction_timeout`: the longest one message's (or one batch's)
    /// transaction may take, handlers included. Past it the runtime
    /// abandons the transaction, closes its connection and holds the
    /// message as during an outage (a network that drops packets without
    /// closing answers nothing, forever). The server ends a statement, and a
    /// session idle inside a transaction, past the same time, so that a
    /// client cut off mid-transaction does not keep its row locks. Also
    /// the longest wait for a free pooled connection. Default `60s`.
    #[serde(with = "humantime_serde")]
    pub transaction_timeout: Duration,
    /// `migration_lock_timeout`: the longest a start waits for another
    /// instance's migrations (the inbox's and the service's, under one
    /// lock), saying every 10 s who holds the lock; past it the start
    /// fails naming the holder. The migrations themselves are not bounded
    /// (an index build may take long), nor cut by `lock_timeout` or
    /// `transaction_timeout`. Default `10m`.
    #[serde(with = "humantime_serde")]
    pub migration_lock_timeout: Duration,
}

impl std::fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &redact(&self.url))
            .field("password", &self.password.as_ref().map(|_| "***"))
            .field("password_file", &self.password_file)
            .field("pool_size", &self.pool_size)
            .field("run_migrations", &self.run_migrations)
            .field("lock_timeout", &self.lock_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("transaction_timeout", &self.transaction_timeout)
            .field("migration_lock_timeout", &self.migration_lock_timeout)
            .finish()
    }
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            password: None,
            password_file: None,
            pool_size: 20,
            run_migrations: true,
            lock_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            transaction_timeout: Duration::from_secs(60),
            migration_lock_timeout: Duration::from_secs(600),
        }
    }
}

/// What kind of RabbitMQ queue to declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueKind {
    /// Replicated, durable: the default on this library's wire.
    Quorum,
    /// A durable classic queue: the default on MassTransit's, as a
    /// MassTransit receive endpoint declares its queue.
    Classic,
}

impl QueueKind {
    /// The kind a queue is declared as when its settings name none: on
    /// this library's wire a quorum queue (replicated, its deliveries
    /// limited by the broker); on MassTransit's a classic queue without
    /// arguments, as a MassTransit 8.5 receive endpoint declares it
    /// (RabbitMqQueueConfigurator.cs), so that a MassTransit endpoint can
    /// start on it beside the service or after it.
    pub fn default_on(wire: Wire) -> Self {
        match wire {
            Wire::Inbox => Self::Quorum,
            Wire::Masstransit => Self::Classic,
        }
    }
}

/// One `[[queues]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
#[non_exhaustive]
pub struct QueueSettings {
    /// `name`: the queue to consume. Required.
    pub name: String,
    /// `consumer`: the consumer id in the dedup key `(consumer, message_id)`.
    /// Default: the queue name.
    #[serde(default)]
    pub consumer: Option<String>,
    /// `prefetch`: how many deliveries may be in flight at once: with the
    /// default `batch_size`, two batches, one filling while the other
    /// commits. Default 32.
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// `kind`: `quorum` or `classic`. Default: `quorum` on this library's
    /// wire, `classic` on MassTransit's ([`QueueKind::default_on`]); read
    /// it through [`kind_on`](Self::kind_on).
    #[serde(default)]
    pub kind: Option<QueueKind>,
    /// `batch_size`: group commit. At most this many deliveries that are
    /// ready together run in one transaction, with one commit: the handlers
    /// run on the whole batch
    /// ([`EventHandler::handle_batch`](crate::EventHandler::handle_batch)),
    /// and if that fails, on each message after a savepoint of its own, so
    /// that a failing message is rolled back and retried alone. A batch
    /// never waits for more deliveries: it takes those that are ready now
    /// (a message arriving alone is processed alone, at once), and more
    /// gather only while another batch of the queue is running. Default 16;
    /// 1 processes each message in its own transaction, and up to
    /// `prefetch` of them at once: better for handlers that wait on
    /// something slow (a batch runs its messages' handlers one after the
    /// other). At most 64; a batch never holds more than `prefetch`
    /// deliveries.
    #[serde(default = "default_batch_size")]
    pub batch_size: u16,
    /// `concurrent_batches`: how many of the queue's batches may run their
    /// handlers at once (the others claim or commit meanwhile). Default 1.
    /// Raise it only if every handler takes its row locks in one order
    /// (set-based statements sorted by key): two batches locking shared rows
    /// in opposite orders deadlock, and PostgreSQL breaks a deadlock only
    /// after its `deadlock_timeout` (1 s by default). At most
    /// `prefetch / batch_size` (at least 1), the batches that can be in
    /// flight.
    #[serde(default = "default_concurrent_batches")]
    pub concurrent_batches: u16,
    /// `delivery_limit`: how many times the broker may deliver a message of
    /// a quorum queue before it sets it aside in `Q.error` (dead-lettered,
    /// with the broker's `x-death` header saying `delivery_limit`). Only a
    /// crash loop gets there: a message whose handler kills the process, or
    /// one handed back again and again. RabbitMQ 4 gives every quorum queue
    /// a limit of 20 and drops the message past it unless the queue
    /// dead-letters: `Q` is declared with this limit and dead-lettering to
    /// `Q.error`, so nothing is dropped. On a classic queue, or one another
    /// client declared (used as it is on MassTransit's wire), the broker
    /// counts nothing: the runtime counts the deliveries it marks
    /// redelivered and sets the message aside on this delivery itself.
    /// Default 20.
    #[serde(default = "default_delivery_limit")]
    pub delivery_limit: u32,
    /// `raw_json`: on MassTransit's wire, read a body whose content type is
    /// `application/json` as raw JSON (the message alone, its id and type
    /// in headers), as an endpoint with MassTransit's
    /// `UseRawJsonDeserializer()` does. Off, MassTransit reads every
    /// content type but its raw one's as its envelope, and so does the
    /// runtime. Default `false`.
    #[serde(default)]
    pub raw_json: bool,
    /// `event_types`: the event types this queue's consumer handles, by
    /// name (`IntegrationEvent::TYPE`); each must have a handler. On
    /// MassTransit's wire only their exchanges are bound to the queue, so a
    /// type handled on two queues is processed on both, on purpose, under
    /// each queue's consumer id. A message of another type is skipped.
    /// Empty (the default): every type a handler is registered for.
    #[serde(default)]
    pub event_types: Vec<String>,
    /// `failure`: this queue's failure policy, key by key over the
    /// service's `[failure]` (`[queues.failure]` under its `[[queues]]`):
    /// a queue of payments may retry for an hour where one of
    /// notifications gives up at once. Read it through
    /// [`failure_policy`](Self::failure_policy). Default: the service's.
    #[serde(default)]
    pub failure: QueueFailureSettings,
}

/// `queues[].failure`: what a queue changes of the service's failure
/// policy; a key left out is the service's.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct QueueFailureSettings {
    /// `immediate_retries`, as `failure.immediate_retries`.
    pub immediate_retries: Option<u32>,
    /// `immediate_backoff`, as `failure.immediate_backoff`.
    #[serde(with = "humantime_serde::option")]
    pub immediate_backoff: Option<Duration>,
    /// `delays`, as `failure.delays`: this queue's retry tiers (`[]`: none,
    /// straight to `Q.error` after the immediate retries).
    #[serde(deserialize_with = "optional_durations")]
    pub delays: Option<Vec<Duration>>,
    /// `max_body_size`, as `failure.max_body_size`.
    pub max_body_size: Option<usize>,
}

fn optional_durations<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Option<Vec<Duration>>, D::Error> {
    durations(deserializer).map(Some)
}

fn default_delivery_limit() -> u32 {
    20
}

fn default_batch_size() -> u16 {
    16
}

fn default_concurrent_batches() -> u16 {
    1
}

fn default_prefetch() -> u16 {
    32
}

impl QueueSettings {
    /// The most deliveries one of this queue's batches holds: `batch_size`,
    /// but no more than `prefetch`, the deliveries the broker lets be in
    /// flight. 1: each message in its own transaction.
    pub fn batch_limit(&self) -> u16 {
        self.batch_size.min(self.prefetch).max(1)
    }

    /// The kind of queue declared on `wire`: `kind`, or the wire's default.
    pub fn kind_on(&self, wire: Wire) -> QueueKind {
        self.kind.unwrap_or(QueueKind::default_on(wire))
    }

    /// A queue with default settings.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            consumer: None,
            prefetch: default_prefetch(),
            kind: None,
            batch_size: default_batch_size(),
            concurrent_batches: default_concurrent_batches(),
            delivery_limit: default_delivery_limit(),
            raw_json: false,
            event_types: Vec::new(),
            failure: QueueFailureSettings::default(),
        }
    }

    /// The consumer id used in the dedup key: `consumer`, or the queue name.
    pub fn consumer_id(&self) -> &str {
        self.consumer.as_deref().unwrap_or(&self.name)
    }

    /// This queue's failure policy: its own keys (`queues[].failure`) over
    /// the service's `service` (`[failure]`).
    pub fn failure_policy(&self, service: &FailureSettings) -> FailureSettings {
        let own = &self.failure;
        FailureSettings {
            immediate_retries: own.immediate_retries.unwrap_or(service.immediate_retries),
            immediate_backoff: own.immediate_backoff.unwrap_or(service.immediate_backoff),
            delays: own.delays.clone().unwrap_or_else(|| service.delays.clone()),
            max_body_size: own.max_body_size.unwrap_or(service.max_body_size),
        }
    }
}

/// `[failure]`: immediate retries, then delayed redelivery through the retry
/// tiers `Q.retry.1`, `Q.retry.2`, …, then the error queue `Q.error`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct FailureSettings {
    /// `immediate_retries`: further attempts in process, each in a fresh
    /// transaction, before the message is sent to a retry tier. Default 3.
    pub immediate_retries: u32,
    /// `immediate_backoff`: pause before the first immediate retry, doubled
    /// for each one after. Default `100ms`.
    #[serde(with = "humantime_serde")]
    pub immediate_backoff: Duration,
    /// `delays`: one retry tier per delay, in order; a message that failed
    /// its immediate retries waits in the next tier, then comes back. After
    /// the last tier it goes to `Q.error`. Default `["30s", "5m", "1h"]`.
    #[serde(deserialize_with = "durations")]
    pub delays: Vec<Duration>,
    /// `max_body_size`: bytes; a larger body goes straight to `Q.error`.
    /// Default 1048576 (1 MiB).
    pub max_body_size: usize,
}

impl Default for FailureSettings {
    fn default() -> Self {
        Self {
            immediate_retries: 3,
            immediate_backoff: Duration::from_millis(100),
            delays: [30, 300, 3600].map(Duration::from_secs).to_vec(),
            max_body_size: 1 << 20,
        }
    }
}

impl FailureSettings {
    /// The pause before immediate retry number `retry` (from 0).
    pub(crate) fn backoff(&self, retry: u32) -> Duration {
        crate::backoff::Backoff::nth(self.immediate_backoff, retry.min(16), Duration::MAX)
    }

    /// The longest a message can take from its first failure to its last
    /// attempt: every backoff and every tier's delay.
    pub(crate) fn longest_redelivery_path(&self) -> Duration {
        let backoffs: Duration = (0..self.immediate_retries).map(|r| self.backoff(r)).sum();
        let per_delivery = backoffs.saturating_mul(self.delays.len() as u32 + 1);
        self.delays.iter().sum::<Duration>() + per_delivery
    }
}

fn durations<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<Duration>, D::Error> {
    let wrapped: Vec<humantime_serde::Serde<Duration>> = Deserialize::deserialize(deserializer)?;
    Ok(wrapped.into_iter().map(|d| d.into_inner()).collect())
}

/// `[retention]`: the cleanup that keeps `inbox_messages` from growing
/// forever. It runs only while the inbox is on.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RetentionSettings {
    /// `days`: how long an inbox row is kept. A redelivery (or a replay from
    /// `Q.error`) later than this is processed again, so it must exceed the
    /// longest redelivery path. Default 7.
    pub days: u32,
    /// `interval`: time between sweeps. Default `10m`.
    #[serde(with = "humantime_serde")]
    pub interval: Duration,
    /// `batch_size`: rows deleted per statement (each its own short
    /// transaction); a sweep deletes batches until nothing is due.
    /// Default 5000.
    pub batch_size: u32,
    /// `busy_share`: the share of a sweep's time spent deleting, from 0.01
    /// to 1: after a statement that took `t`, the sweep pauses
    /// `t × (1 − busy_share) / busy_share` before the next, so that a large
    /// backlog (retention turned on, or back after an outage) is deleted
    /// beside consumption instead of taking the database from it. 1 deletes
    /// back to back. Default 0.05.
    pub busy_share: f64,
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            days: 7,
            interval: Duration::from_secs(600),
            batch_size: 5000,
            busy_share: 0.05,
        }
    }
}

impl RetentionSettings {
    /// `days` as a duration.
    pub(crate) fn period(&self) -> Duration {
        Duration::from_secs(u64::from(self.days) * 24 * 60 * 60)
    }

    /// The pause after a statement that took `busy`: see `busy_share`.
    pub(crate) fn pause_after(&self, busy: Duration) -> Duration {
        busy.mul_f64((1.0 - self.busy_share) / self.busy_share)
    }
}

/// `[outbox]`: how the dispatcher publishes the rows of `outbox_messages`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct OutboxSettings {
    /// `poll_interval`: how often the dispatcher looks for due rows when no
    /// commit woke it (rows of other processes, retries coming due).
    /// Default `1s`.
    #[serde(with = "humantime_serde")]
    pub poll_interval: Duration,
    /// `batch_size`: rows claimed, published and deleted per round.
    /// Default 100.
    pub batch_size: u32,
    /// `retry_backoff`: the pause after a row's failed publish, doubled
    /// after each next failure up to `max_retry_backoff`, each pause drawn
    /// between half and all of that (rows failed together come due
    /// apart). Default `1s`.
    #[serde(with = "humantime_serde")]
    pub retry_backoff: Duration,
    /// `max_retry_backoff`: the longest pause between a row's tries.
    /// Default `5m`.
    #[serde(with = "humantime_serde")]
    pub max_retry_backoff: Duration,
    /// `max_attempts`: failed publishes after which a row is parked as dead
    /// (`dead_at` set, its last error kept) and no longer blocks or costs
    /// anything. Default 10.
    pub max_attempts: u32,
    /// `claim_lease`: how long a round's claim keeps other dispatchers off
    /// its rows, renewed every third of it while the round's publish lasts
    /// (an alarm can hold a confirm for minutes): no transaction stays
    /// open across a publish. After a crash, the rows the round held go out
    /// again once it ends. At least `1s`. Default `30s`.
    #[serde(with = "humantime_serde")]
    pub claim_lease: Duration,
}

impl Default for OutboxSettings {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            batch_size: 100,
            retry_backoff: Duration::from_secs(1),
            max_retry_backoff: Duration::from_secs(300),
            max_attempts: 10,
            claim_lease: Duration::from_secs(30),
        }
    }
}

/// `[runtime]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
#[non_exhaustive]
pub struct RuntimeSettings {
    /// `shutdown_timeout`: on SIGINT/SIGTERM, how long to let in-flight
    /// messages finish before closing anyway (the unfinished ones are
    /// redelivered). Default `30s`.
    #[serde(with = "humantime_serde")]
    pub shutdown_timeout: Duration,
}

impl Default for RuntimeSettings {
    fn default() -> Self {
        Self {
            shutdown_timeout: Duration::from_secs(30),
        }
    }
}

impl Settings {
    /// Whether the inbox deduplicates: an explicit `message_bus.enable_inbox`
    /// wins both ways; unset resolves on for `rabbitmq` (at-least-once
    /// delivery) and off for `in_process` (nothing is redelivered).
    pub fn is_inbox_enabled(&self) -> bool {
        self.message_bus
            .enable_inbox
            .unwrap_or(self.message_bus.provider != Provider::InProcess)
    }

    /// Whether staged messages go through `outbox_messages`: an explicit
    /// `message_bus.enable_outbox` wins both ways; unset resolves on for
    /// `rabbitmq` and off for `in_process`, as the inbox does.
    pub fn is_outbox_enabled(&self) -> bool {
        self.message_bus
            .enable_outbox
            .unwrap_or(self.message_bus.provider != Provider::InProcess)
    }
}

/// The broker [`MessageBusSettings::amqp_urls`] names by default: RabbitMQ
/// on this machine, as installed.
const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// A list of strings, or one string as a list of one: `amqp_urls =
/// "amqp://.."` in a settings file names one broker.
fn one_or_many<'de, D: serde::Deserializer<'de>>(
    deserializer: D,
) -> std::result::Result<Vec<String>, D::Error> {
    #[derive(Deserialize)]
    #[serde(untagged)]
    enum OneOrMany {
        One(String),
        Many(Vec<String>),
    }
    Ok(match OneOrMany::deserialize(deserializer)? {
        OneOrMany::One(url) => vec![url],
        OneOrMany::Many(urls) => urls,
    })
}
