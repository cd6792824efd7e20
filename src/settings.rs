//! Settings: layered raw values, then validation with errors that name the key.
//!
//! Layers, later ones winning: the built-in defaults below (the same values
//! `config/default.toml` documents), `config/default.toml`,
//! `config/{INBOX_ENV}.toml`, then environment variables
//! `INBOX__SECTION__KEY` (for example `INBOX__DATABASE__POOL_SIZE=32`).

use std::collections::{HashMap, HashSet};
use std::path::Path;
use std::time::Duration;

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::policy::Target;

/// Every setting of the runtime. Build it with [`Settings::load`] (files and
/// environment) or in code from [`Settings::default`]; the runtime validates
/// it again on start.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(default, deny_unknown_fields)]
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
    /// MassTransit 8's ([`crate::masstransit`]): the JSON envelope (or raw
    /// JSON), types as `urn:message:Namespace:Type`, a fanout exchange per
    /// queue and per message type, `Q_error` and `Q_skipped` with
    /// MassTransit's `MT-*` fault headers; `Q_retry_<n>` for the delay
    /// tiers (MassTransit's own delays need a broker plugin).
    Masstransit,
}

/// `[message_bus]`. Its `Debug` hides the passwords in `amqp_url` and
/// `amqp_urls`.
#[derive(Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MessageBusSettings {
    /// `provider`: `rabbitmq` or `in_process`. Default `rabbitmq`.
    pub provider: Provider,
    /// `wire`: `inbox` (this library's contract) or `masstransit`
    /// (MassTransit 8's envelope, topology and fault conventions). Default
    /// `inbox`.
    pub wire: Wire,
    /// `amqp_url`: the broker. Default `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub amqp_url: String,
    /// `amqp_urls`: the nodes of a RabbitMQ cluster, one URL each. When set,
    /// it replaces `amqp_url`: every connection (consumers, the publisher,
    /// the outbox dispatcher) goes to the next node in turn, and a failed
    /// attempt moves on to the next. Default empty: `amqp_url` alone. See
    /// [`Settings::amqp_urls`].
    pub amqp_urls: Vec<String>,
    /// `exchange`: where [publishing](crate::AmqpPublisher) sends events.
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
    /// (to be tried again later), and a publish from code fails. Default `30s`.
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
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            amqp_urls: Vec::new(),
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
            .field("amqp_url", &redact(&self.amqp_url))
            .field(
                "amqp_urls",
                &self.amqp_urls.iter().map(|url| redact(url)).collect::<Vec<_>>(),
            )
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
pub struct DatabaseSettings {
    /// `url`: PostgreSQL connection URL. Default `postgres://postgres@127.0.0.1:5432/postgres`.
    pub url: String,
    /// `name`: a database name that replaces the one in `url`. Default unset.
    pub name: Option<String>,
    /// `pool_size`: connections in the inbox pool. Each message in flight
    /// holds one, so keep it at least the sum of the queues' `prefetch`.
    /// Default 20.
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
}

impl std::fmt::Debug for DatabaseSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DatabaseSettings")
            .field("url", &redact(&self.url))
            .field("name", &self.name)
            .field("pool_size", &self.pool_size)
            .field("run_migrations", &self.run_migrations)
            .field("lock_timeout", &self.lock_timeout)
            .field("connect_timeout", &self.connect_timeout)
            .field("transaction_timeout", &self.transaction_timeout)
            .finish()
    }
}

/// `url` with its password, if any, replaced by `***`: in the
/// `scheme://user:password@host` form, and in PostgreSQL's `key=value`
/// form (`password=...`). For logs, errors and `Debug`.
pub(crate) fn redact(url: &str) -> String {
    if let Some((scheme, rest)) = url.split_once("://") {
        let end = rest.find(['/', '?', '#']).unwrap_or(rest.len());
        let (authority, tail) = rest.split_at(end);
        if let Some((userinfo, host)) = authority.rsplit_once('@')
            && let Some((user, _password)) = userinfo.split_once(':')
        {
            return format!("{scheme}://{user}:***@{host}{}", redact_options(tail));
        }
        return format!("{scheme}://{authority}{}", redact_options(tail));
    }
    redact_options(url)
}

/// `password=...` (a `key=value` connection string, or a URL's query)
/// with the value replaced by `***`.
fn redact_options(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(at) = rest.find("password=") {
        let value = at + "password=".len();
        out.push_str(&rest[..value]);
        out.push_str("***");
        let end = rest[value..].find([' ', '&']).map_or(rest.len(), |e| value + e);
        rest = &rest[end..];
    }
    out.push_str(rest);
    out
}

impl Default for DatabaseSettings {
    fn default() -> Self {
        Self {
            url: "postgres://postgres@127.0.0.1:5432/postgres".into(),
            name: None,
            pool_size: 20,
            run_migrations: true,
            lock_timeout: Duration::from_secs(5),
            connect_timeout: Duration::from_secs(5),
            transaction_timeout: Duration::from_secs(60),
        }
    }
}

/// What kind of RabbitMQ queue to declare.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum QueueKind {
    /// Replicated, durable; the default.
    #[default]
    Quorum,
    /// A durable classic queue.
    Classic,
}

/// One `[[queues]]` entry.
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueSettings {
    /// `name`: the queue to consume. Required.
    pub name: String,
    /// `consumer`: the consumer id in the dedup key `(consumer, message_id)`.
    /// Default: the queue name.
    #[serde(default)]
    pub consumer: Option<String>,
    /// `prefetch`: how many deliveries may be in flight at once. Default 16.
    #[serde(default = "default_prefetch")]
    pub prefetch: u16,
    /// `kind`: `quorum` or `classic`. Default `quorum`.
    #[serde(default)]
    pub kind: QueueKind,
    /// `batch_size`: at most this many deliveries that are ready together
    /// run in one transaction, with one commit: the handlers run on the
    /// whole batch ([`EventHandler::handle_batch`](crate::EventHandler::handle_batch)), and if that
    /// fails, on each message after a savepoint of its own. 1 (the default)
    /// processes each message in its own transaction. Opt-in; at most 64
    /// and at most `prefetch`.
    #[serde(default = "default_batch_size")]
    pub batch_size: u16,
    /// `concurrent_batches`: how many of the queue's batches may run their
    /// handlers at once (the others claim or commit meanwhile). Default 1.
    /// Raise it only if every handler takes its row locks in one order
    /// (set-based statements sorted by key): two batches locking shared rows
    /// in opposite orders deadlock, and PostgreSQL breaks a deadlock only
    /// after its `deadlock_timeout` (1 s by default). At most
    /// `prefetch / batch_size`, the batches that can be in flight.
    #[serde(default = "default_concurrent_batches")]
    pub concurrent_batches: u16,
    /// `delivery_limit`: how many times the broker may deliver a message of
    /// a quorum queue before it sets it aside in `Q.error` (dead-lettered,
    /// with the broker's `x-death` header saying `delivery_limit`). Only a
    /// crash loop gets there: a message whose handler kills the process, or
    /// one handed back again and again. RabbitMQ 4 gives every quorum queue
    /// a limit of 20 and drops the message past it unless the queue
    /// dead-letters: `Q` is declared with this limit and dead-lettering to
    /// `Q.error`, so nothing is dropped. Classic queues count no deliveries:
    /// there a crash loop goes on. Default 20.
    #[serde(default = "default_delivery_limit")]
    pub delivery_limit: u32,
}

fn default_delivery_limit() -> u32 {
    20
}

fn default_batch_size() -> u16 {
    1
}

fn default_concurrent_batches() -> u16 {
    1
}

fn default_prefetch() -> u16 {
    16
}

impl QueueSettings {
    /// A queue with default settings.
    pub fn new(name: impl Into<String>) -> Self {
        Self {
            name: name.into(),
            consumer: None,
            prefetch: default_prefetch(),
            kind: QueueKind::default(),
            batch_size: default_batch_size(),
            concurrent_batches: default_concurrent_batches(),
            delivery_limit: default_delivery_limit(),
        }
    }

    /// The consumer id used in the dedup key: `consumer`, or the queue name.
    pub fn consumer_id(&self) -> &str {
        self.consumer.as_deref().unwrap_or(&self.name)
    }
}

/// `[failure]`: immediate retries, then delayed redelivery through the retry
/// tiers `Q.retry.1`, `Q.retry.2`, …, then the error queue `Q.error`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
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
    pub fn backoff(&self, retry: u32) -> Duration {
        crate::Backoff::nth(self.immediate_backoff, retry.min(16), Duration::MAX)
    }

    /// Where a message goes once its immediate retries are spent, given
    /// how many delayed redeliveries it has had: the next retry tier, or
    /// `Q.error` when every tier has been tried.
    pub fn destination(&self, redeliveries: u32) -> Target {
        let next = usize::try_from(redeliveries).map_or(usize::MAX, |r| r.saturating_add(1));
        if next <= self.delays.len() {
            Target::RetryTier(next)
        } else {
            Target::Exhausted
        }
    }

    /// The longest a message can take from its first failure to its last
    /// attempt: every backoff and every tier's delay.
    pub fn longest_redelivery_path(&self) -> Duration {
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
}

impl Default for RetentionSettings {
    fn default() -> Self {
        Self {
            days: 7,
            interval: Duration::from_secs(600),
            batch_size: 5000,
        }
    }
}

impl RetentionSettings {
    /// `days` as a duration.
    pub fn period(&self) -> Duration {
        Duration::from_secs(u64::from(self.days) * 24 * 60 * 60)
    }
}

/// `[outbox]`: how the dispatcher publishes the rows of `outbox_messages`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
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
    /// after each next failure up to `max_retry_backoff`. Default `1s`.
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
}

impl Default for OutboxSettings {
    fn default() -> Self {
        Self {
            poll_interval: Duration::from_secs(1),
            batch_size: 100,
            retry_backoff: Duration::from_secs(1),
            max_retry_backoff: Duration::from_secs(300),
            max_attempts: 10,
        }
    }
}

impl OutboxSettings {
    fn validate(&self) -> Result<()> {
        check_timer(self.poll_interval, "outbox.poll_interval")?;
        if !(1..=10_000).contains(&self.batch_size) {
            return Err(Error::setting("outbox.batch_size", "must be from 1 to 10000"));
        }
        check_timer(self.retry_backoff, "outbox.retry_backoff")?;
        check_timer(self.max_retry_backoff, "outbox.max_retry_backoff")?;
        if !(1..=1000).contains(&self.max_attempts) {
            return Err(Error::setting("outbox.max_attempts", "must be from 1 to 1000"));
        }
        Ok(())
    }
}

/// `[runtime]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
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
    /// Loads `default.toml`, `{INBOX_ENV}.toml` and the
    /// `INBOX__SECTION__KEY` environment over the built-in defaults, and
    /// validates the result. The files are in `INBOX_CONFIG_DIR`, or in
    /// `config/` under the working directory. Which files were read is
    /// logged at INFO (and a folder without any at WARN): a service started
    /// elsewhere must not run on the defaults unnoticed.
    pub fn load() -> Result<ValidSettings> {
        Self::load_from(&config_dir(std::env::var_os("INBOX_CONFIG_DIR")))
    }

    /// Like [`Settings::load`], with the settings files in `dir`.
    pub fn load_from(dir: &Path) -> Result<ValidSettings> {
        let inbox_env = std::env::var("INBOX_ENV").ok().filter(|e| !e.is_empty());
        Self::load_layered(dir, inbox_env.as_deref(), None)
    }

    /// Like [`Settings::load_from`], for the environment named `inbox_env`
    /// whatever `INBOX_ENV` says (tests load `config/test.toml` this way).
    pub fn load_environment(dir: &Path, inbox_env: &str) -> Result<ValidSettings> {
        Self::load_layered(dir, Some(inbox_env), None)
    }

    /// The layering itself; `vars` replaces the process environment (tests).
    fn load_layered(
        dir: &Path,
        inbox_env: Option<&str>,
        vars: Option<HashMap<String, String>>,
    ) -> Result<ValidSettings> {
        use config::{Config, Environment, File};
        let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
        // default.toml is optional (the built-in defaults are the same values);
        // a named environment whose file is missing is a mistake worth stopping for.
        let mut builder = Config::builder().add_source(File::with_name(&path("default")).required(false));
        let mut files: Vec<String> = Some(dir.join("default.toml"))
            .filter(|file| file.is_file())
            .map(|file| file.display().to_string())
            .into_iter()
            .collect();
        if let Some(env) = inbox_env {
            builder = builder.add_source(File::with_name(&path(env)).required(true));
            files.push(dir.join(format!("{env}.toml")).display().to_string());
        }
        if files.is_empty() {
            let dir = std::path::absolute(dir).unwrap_or_else(|_| dir.to_owned());
            tracing::warn!(
                dir = %dir.display(),
                "no settings file found (set INBOX_CONFIG_DIR to the folder that holds default.toml): \
                 running on the built-in defaults and INBOX__ variables"
            );
        } else {
            tracing::info!(files = %files.join(", "), "settings loaded");
        }
        let settings: Settings = builder
            .add_source(
                Environment::with_prefix("INBOX")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true)
                    .list_separator(",")
                    .with_list_parse_key("failure.delays")
                    .with_list_parse_key("message_bus.amqp_urls")
                    .source(vars),
            )
            .build()?
            .try_deserialize()?;
        settings.validate()
    }

    /// Applies the conventional `DATABASE_URL` and `AMQP_URL` environment
    /// variables, where set, over `database.url` and `message_bus.amqp_url`.
    pub fn apply_conventional_urls(&mut self) {
        if let Ok(url) = std::env::var("DATABASE_URL") {
            self.database.url = url;
        }
        if let Ok(url) = std::env::var("AMQP_URL") {
            self.message_bus.amqp_url = url;
        }
    }

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

    /// The brokers to connect to, in order: `message_bus.amqp_urls` when
    /// set, else `message_bus.amqp_url` alone.
    pub fn amqp_urls(&self) -> Vec<&str> {
        match self.message_bus.amqp_urls.as_slice() {
            [] => vec![self.message_bus.amqp_url.as_str()],
            urls => urls.iter().map(String::as_str).collect(),
        }
    }

    /// Where the brokers are, for logs and errors: each one's
    /// `host:port/vhost`, comma-separated; never a password.
    pub fn broker_endpoint(&self) -> String {
        let endpoints: Vec<String> = self.amqp_urls().into_iter().map(broker_endpoint).collect();
        endpoints.join(",")
    }

    /// Where the database is, for logs and errors: `host:port/dbname` (every
    /// host, for a list), never the password.
    pub fn database_endpoint(&self) -> String {
        let Ok(config) = self.pg_config() else {
            return redact(&self.database.url);
        };
        let ports = config.get_ports();
        let hosts: Vec<String> = config
            .get_hosts()
            .iter()
            .enumerate()
            .map(|(i, host)| {
                let port = ports.get(i).or(ports.first()).copied().unwrap_or(5432);
                match host {
                    tokio_postgres::config::Host::Tcp(name) => format!("{name}:{port}"),
                    #[cfg(unix)]
                    tokio_postgres::config::Host::Unix(path) => format!("{}:{port}", path.display()),
                }
            })
            .collect();
        format!("{}/{}", hosts.join(","), config.get_dbname().unwrap_or(""))
    }

    /// The PostgreSQL connection settings: `database.url` with
    /// `database.name`, `database.connect_timeout` and, for every session,
    /// `database.lock_timeout` applied.
    pub fn pg_config(&self) -> Result<tokio_postgres::Config> {
        let db = &self.database;
        let mut config: tokio_postgres::Config = db
            .url
            .parse()
            .map_err(|e| Error::setting("database.url", format!("not a PostgreSQL URL: {e}")))?;
        if let Some(name) = &db.name {
            config.dbname(name);
        }
        config.connect_timeout(db.connect_timeout);
        // A peer that vanished without closing: keepalives find an idle
        // connection dead within about 30 s, and unacknowledged writes fail
        // after 30 s, instead of the system's two hours or more.
        config
            .keepalives(true)
            .keepalives_idle(Duration::from_secs(15))
            .tcp_user_timeout(Duration::from_secs(30));
        #[cfg(unix)]
        config
            .keepalives_interval(Duration::from_secs(5))
            .keepalives_retries(3);
        // Session settings rather than SET LOCAL in every transaction: no
        // statement more per message.
        let lock = db.lock_timeout.as_millis().max(1);
        let transaction = db.transaction_timeout.as_millis().max(1);
        let session = format!(
            "-c lock_timeout={lock} -c statement_timeout={transaction} \
             -c idle_in_transaction_session_timeout={transaction}"
        );
        let options = match config.get_options() {
            Some(given) if !given.is_empty() => format!("{given} {session}"),
            _ => session,
        };
        config.options(&options);
        Ok(config)
    }

    /// Checks every value the runtime relies on, section by section, and
    /// returns the settings as [`ValidSettings`], the only kind the runtime
    /// takes. The error names the key.
    pub fn validate(self) -> Result<ValidSettings> {
        self.message_bus.validate()?;
        self.database.validate()?;
        self.pg_config()?;
        let mut names = HashSet::new();
        for (i, queue) in self.queues.iter().enumerate() {
            queue.validate(i)?;
            if !names.insert(queue.name.as_str()) {
                return Err(Error::setting(
                    &format!("queues[{i}].name"),
                    format!("`{}` is listed twice", queue.name),
                ));
            }
        }
        self.failure.validate()?;
        self.retention.validate()?;
        self.outbox.validate()?;
        check_timer(self.runtime.shutdown_timeout, "runtime.shutdown_timeout")?;
        // Across sections: a late redelivery must still find its row.
        let path = self.failure.longest_redelivery_path();
        if self.retention.period() <= path {
            return Err(Error::setting(
                "retention.days",
                format!(
                    "{} days is not longer than the longest redelivery path ({}, from failure.delays and \
                     failure.immediate_retries): a late redelivery would find its inbox row deleted and run again",
                    self.retention.days,
                    humantime::format_duration(path)
                ),
            ));
        }
        Ok(ValidSettings(self))
    }
}

/// Where the broker `url` names is, for logs and errors: `host:port`, then
/// `/vhost` unless it is the default `/`; never the password.
pub(crate) fn broker_endpoint(url: &str) -> String {
    match url.parse::<lapin::uri::AMQPUri>() {
        Ok(uri) if uri.vhost == "/" => format!("{}:{}", uri.authority.host, uri.authority.port),
        Ok(uri) => format!("{}:{}/{}", uri.authority.host, uri.authority.port, uri.vhost),
        Err(_) => redact(url),
    }
}

impl MessageBusSettings {
    fn validate(&self) -> Result<()> {
        if self.provider == Provider::Rabbitmq {
            self.amqp_url
                .parse::<lapin::uri::AMQPUri>()
                .map_err(|e| Error::setting("message_bus.amqp_url", format!("not an AMQP URL: {e}")))?;
            for (i, url) in self.amqp_urls.iter().enumerate() {
                url.parse::<lapin::uri::AMQPUri>().map_err(|e| {
                    Error::setting(
                        &format!("message_bus.amqp_urls[{i}]"),
                        format!("not an AMQP URL: {e}"),
                    )
                })?;
            }
        }
        if self.exchange.len() > 255 {
            return Err(Error::setting(
                "message_bus.exchange",
                "is longer than the 255 bytes AMQP allows",
            ));
        }
        // RabbitMQ's own ceiling for max_message_size is 512 MiB.
        if !(1..=512 * 1024 * 1024).contains(&self.max_message_size) {
            return Err(Error::setting(
                "message_bus.max_message_size",
                "must be from 1 to 536870912 bytes (RabbitMQ's largest)",
            ));
        }
        check_timer(self.connect_timeout, "message_bus.connect_timeout")?;
        check_timer(self.confirm_timeout, "message_bus.confirm_timeout")
    }
}

impl DatabaseSettings {
    fn validate(&self) -> Result<()> {
        if self.name.as_deref() == Some("") {
            return Err(Error::setting(
                "database.name",
                "is empty; leave it unset to use the url's database",
            ));
        }
        if self.pool_size == 0 {
            return Err(Error::setting("database.pool_size", "must be at least 1"));
        }
        if self.lock_timeout.is_zero() {
            // PostgreSQL reads lock_timeout = 0 as "wait forever".
            return Err(Error::setting(
                "database.lock_timeout",
                "must be more than 0 (0 would wait forever)",
            ));
        }
        if self.lock_timeout > MAX_PG_TIMEOUT {
            // The server would refuse every connection, which would look
            // like an outage that never ends.
            return Err(Error::setting(
                "database.lock_timeout",
                "must be at most 2147483647ms (24 days), the most PostgreSQL accepts",
            ));
        }
        check_timer(self.connect_timeout, "database.connect_timeout")?;
        if self.transaction_timeout.is_zero() || self.transaction_timeout > MAX_PG_TIMEOUT {
            return Err(Error::setting(
                "database.transaction_timeout",
                "must be more than 0 and at most 2147483647ms (24 days), the most PostgreSQL accepts",
            ));
        }
        Ok(())
    }
}

impl QueueSettings {
    /// Checks entry `i` of `[[queues]]`.
    fn validate(&self, i: usize) -> Result<()> {
        let key = |field: &str| format!("queues[{i}].{field}");
        if self.name.is_empty() {
            return Err(Error::setting(&key("name"), "is empty"));
        }
        if self.name.len() + crate::names::LONGEST_SUFFIX > 255 {
            return Err(Error::setting(
                &key("name"),
                format!(
                    "is {} bytes long; AMQP names hold 255 and the runtime adds up to {} for `.retry.<n>`, `.error` and `.skipped`",
                    self.name.len(),
                    crate::names::LONGEST_SUFFIX
                ),
            ));
        }
        if self.consumer.as_deref() == Some("") {
            return Err(Error::setting(
                &key("consumer"),
                "is empty; leave it unset to use the queue name",
            ));
        }
        if self.prefetch == 0 {
            // basic.qos 0 means "unlimited", which would defeat the pool sizing.
            return Err(Error::setting(&key("prefetch"), "must be at least 1"));
        }
        // Past 64 subtransactions PostgreSQL's snapshots overflow their
        // cache and slow every session down.
        if !(1..=64).contains(&self.batch_size) || self.batch_size > self.prefetch {
            return Err(Error::setting(
                &key("batch_size"),
                format!("must be from 1 to 64 and at most prefetch ({})", self.prefetch),
            ));
        }
        if !(1..=MAX_DELIVERY_LIMIT).contains(&self.delivery_limit) {
            return Err(Error::setting(
                &key("delivery_limit"),
                format!("must be from 1 to {MAX_DELIVERY_LIMIT}"),
            ));
        }
        let in_flight = (self.prefetch / self.batch_size).max(1);
        if !(1..=in_flight).contains(&self.concurrent_batches) {
            return Err(Error::setting(
                &key("concurrent_batches"),
                format!(
                    "must be from 1 to prefetch / batch_size ({in_flight}): no more batches are ever in flight"
                ),
            ));
        }
        Ok(())
    }
}

impl FailureSettings {
    fn validate(&self) -> Result<()> {
        if self.immediate_retries > 100 {
            return Err(Error::setting("failure.immediate_retries", "must be at most 100"));
        }
        for (i, delay) in self.delays.iter().enumerate() {
            // x-message-ttl is a 32-bit count of milliseconds.
            if delay.is_zero() || delay.as_millis() > u128::from(u32::MAX) {
                return Err(Error::setting(
                    &format!("failure.delays[{i}]"),
                    "must be more than 0 and at most 49 days",
                ));
            }
        }
        if self.max_body_size == 0 {
            return Err(Error::setting("failure.max_body_size", "must be at least 1"));
        }
        Ok(())
    }
}

impl RetentionSettings {
    fn validate(&self) -> Result<()> {
        if !(1..=MAX_RETENTION_DAYS).contains(&self.days) {
            return Err(Error::setting(
                "retention.days",
                format!("must be from 1 to {MAX_RETENTION_DAYS}"),
            ));
        }
        check_timer(self.interval, "retention.interval")?;
        if self.batch_size == 0 {
            return Err(Error::setting("retention.batch_size", "must be at least 1"));
        }
        Ok(())
    }
}

/// [`Settings`] that passed [`Settings::validate`]: the only kind the
/// runtime takes, so an invalid value stops a service at its start with an
/// error naming the key, never later. Read it like `Settings` (it derefs to
/// them); change it with [`with`](Self::with), which validates again.
#[derive(Clone)]
pub struct ValidSettings(Settings);

impl std::fmt::Debug for ValidSettings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.0.fmt(f)
    }
}

impl ValidSettings {
    /// Applies `change` and validates the result: overrides from code (a
    /// command-line flag, a test's queue name).
    pub fn with(self, change: impl FnOnce(&mut Settings)) -> Result<Self> {
        let mut settings = self.0;
        change(&mut settings);
        settings.validate()
    }

    /// The settings, to change and validate again.
    pub fn into_inner(self) -> Settings {
        self.0
    }
}

impl std::ops::Deref for ValidSettings {
    type Target = Settings;

    fn deref(&self) -> &Settings {
        &self.0
    }
}

/// The settings folder: `INBOX_CONFIG_DIR` when set, else `config`.
fn config_dir(variable: Option<std::ffi::OsString>) -> std::path::PathBuf {
    variable
        .filter(|dir| !dir.is_empty())
        .map_or_else(|| "config".into(), Into::into)
}

/// The highest `queues[].delivery_limit`: the broker reads it as a signed
/// 32-bit number.
pub(crate) const MAX_DELIVERY_LIMIT: u32 = i32::MAX as u32;

/// The longest timeout PostgreSQL takes: `INT_MAX` milliseconds.
const MAX_PG_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// The longest retention: a century. Past it, the sweep's cutoff would
/// leave PostgreSQL's range of timestamps.
const MAX_RETENTION_DAYS: u32 = 36_500;

/// The longest wait or interval the runtime takes for a timer setting.
const MAX_TIMER: Duration = Duration::from_secs(365 * 24 * 60 * 60);

/// Checks a timer setting: more than 0 (it would spin or never wait) and at
/// most a year (a typo, and past what timers are meant for).
fn check_timer(value: Duration, key: &str) -> Result<()> {
    if value.is_zero() || value > MAX_TIMER {
        return Err(Error::setting(key, "must be more than 0 and at most a year"));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn with_bus(provider: Provider, enable_inbox: Option<bool>) -> Settings {
        let mut settings = Settings::default();
        settings.message_bus.provider = provider;
        settings.message_bus.enable_inbox = enable_inbox;
        settings
    }

    #[test]
    fn inbox_resolution_table() {
        use Provider::*;
        let table = [
            (Rabbitmq, None, true),
            (Rabbitmq, Some(true), true),
            (Rabbitmq, Some(false), false),
            (InProcess, None, false),
            (InProcess, Some(true), true),
            (InProcess, Some(false), false),
        ];
        for (provider, explicit, expected) in table {
            assert_eq!(
                with_bus(provider, explicit).is_inbox_enabled(),
                expected,
                "provider {provider:?}, enable_inbox {explicit:?}"
            );
            let mut outbox = Settings::default();
            outbox.message_bus.provider = provider;
            outbox.message_bus.enable_outbox = explicit;
            assert_eq!(
                outbox.is_outbox_enabled(),
                expected,
                "provider {provider:?}, enable_outbox {explicit:?}"
            );
        }
    }

    fn temp_dir(files: &[(&str, &str)]) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("inbox-settings-{}", uuid::Uuid::now_v7()));
        std::fs::create_dir_all(&dir).unwrap();
        for (name, text) in files {
            std::fs::write(dir.join(name), text).unwrap();
        }
        dir
    }

    fn vars(pairs: &[(&str, &str)]) -> Option<HashMap<String, String>> {
        Some(
            pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
        )
    }

    #[test]
    fn the_shipped_default_file_matches_the_built_in_defaults() {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
        let loaded = Settings::load_layered(&dir, None, vars(&[])).unwrap();
        let built_in = Settings::default();
        assert_eq!(format!("{loaded:?}"), format!("{built_in:?}"));
    }

    #[test]
    fn layers_apply_in_order_default_file_env_file_environment() {
        let dir = temp_dir(&[
            (
                "default.toml",
                "[database]\npool_size = 7\nname = \"from_default\"\n[message_bus]\nprovider = \"in_process\"\n",
            ),
            (
                "staging.toml",
                "[database]\npool_size = 9\n[[queues]]\nname = \"orders\"\nprefetch = 4\n",
            ),
        ]);
        let settings = Settings::load_layered(
            &dir,
            Some("staging"),
            vars(&[
                ("INBOX__DATABASE__POOL_SIZE", "11"),
                ("INBOX__MESSAGE_BUS__ENABLE_INBOX", "true"),
            ]),
        )
        .unwrap();
        assert_eq!(
            settings.database.pool_size, 11,
            "environment wins over both files"
        );
        assert_eq!(
            settings.database.name.as_deref(),
            Some("from_default"),
            "default file applies"
        );
        assert_eq!(settings.queues[0].prefetch, 4, "environment file applies");
        assert_eq!(
            settings.queues[0].consumer_id(),
            "orders",
            "consumer defaults to the queue name"
        );
        assert_eq!(settings.message_bus.provider, Provider::InProcess);
        assert!(settings.is_inbox_enabled(), "explicit true wins over in_process");
    }

    #[test]
    fn a_missing_environment_file_is_an_error_naming_it() {
        let dir = temp_dir(&[]);
        let err = Settings::load_layered(&dir, Some("prod"), vars(&[])).unwrap_err();
        assert!(err.to_string().contains("prod"), "{err}");
    }

    #[test]
    fn invalid_values_name_their_key() {
        let cases = [
            ("INBOX__MESSAGE_BUS__PROVIDER", "kafka", "provider"),
            ("INBOX__MESSAGE_BUS__ENABLE_INBOX", "maybe", "enable_inbox"),
            ("INBOX__DATABASE__POOL_SIZE", "0", "database.pool_size"),
            ("INBOX__DATABASE__LOCK_TIMEOUT", "soon", "lock_timeout"),
            ("INBOX__DATABASE__LOCK_TIMEOUT", "0s", "database.lock_timeout"),
            ("INBOX__DATABASE__LOCK_TIMEOUT", "25days", "database.lock_timeout"),
            (
                "INBOX__DATABASE__CONNECT_TIMEOUT",
                "2years",
                "database.connect_timeout",
            ),
            ("INBOX__RETENTION__DAYS", "4294967295", "retention.days"),
            ("INBOX__RETENTION__INTERVAL", "0s", "retention.interval"),
            (
                "INBOX__FAILURE__IMMEDIATE_RETRIES",
                "4294967295",
                "failure.immediate_retries",
            ),
            ("INBOX__DATABASE__URL", "mysql://nope", "database.url"),
            (
                "INBOX__MESSAGE_BUS__AMQP_URL",
                "http://nope",
                "message_bus.amqp_url",
            ),
            (
                "INBOX__RUNTIME__SHUTDOWN_TIMEOUT",
                "0s",
                "runtime.shutdown_timeout",
            ),
        ];
        let dir = temp_dir(&[]);
        for (var, value, key) in cases {
            let err = Settings::load_layered(&dir, None, vars(&[(var, value)])).unwrap_err();
            assert!(
                err.to_string().contains(key),
                "{var}={value}: `{err}` does not name `{key}`"
            );
        }
    }

    #[test]
    fn invalid_queues_name_their_entry() {
        let long = "q".repeat(256);
        let cases = [
            ("[[queues]]\nname = \"\"\n".to_string(), "queues[0].name"),
            (format!("[[queues]]\nname = \"{long}\"\n"), "queues[0].name"),
            (
                "[[queues]]\nname = \"a\"\n[[queues]]\nname = \"a\"\n".to_string(),
                "queues[1].name",
            ),
            (
                "[[queues]]\nname = \"a\"\nprefetch = 0\n".to_string(),
                "queues[0].prefetch",
            ),
            (
                "[[queues]]\nname = \"a\"\nconsumer = \"\"\n".to_string(),
                "queues[0].consumer",
            ),
            (
                "[[queues]]\nname = \"a\"\nkind = \"stream\"\n".to_string(),
                "kind",
            ),
            ("[databse]\nurl = \"x\"\n".to_string(), "databse"),
            (
                "[[queues]]\nname = \"a\"\nbatch_size = 0\n".to_string(),
                "queues[0].batch_size",
            ),
            (
                "[[queues]]\nname = \"a\"\nprefetch = 8\nbatch_size = 9\n".to_string(),
                "queues[0].batch_size",
            ),
            (
                "[[queues]]\nname = \"a\"\nprefetch = 100\nbatch_size = 65\n".to_string(),
                "queues[0].batch_size",
            ),
            (
                "[[queues]]\nname = \"a\"\nbatch_size = 8\nconcurrent_batches = 3\n".to_string(),
                "queues[0].concurrent_batches",
            ),
            (
                "[[queues]]\nname = \"a\"\nconcurrent_batches = 0\n".to_string(),
                "queues[0].concurrent_batches",
            ),
            (
                "[[queues]]\nname = \"a\"\ndelivery_limit = 0\n".to_string(),
                "queues[0].delivery_limit",
            ),
        ];
        for (text, key) in cases {
            let dir = temp_dir(&[("default.toml", &text)]);
            let err = Settings::load_layered(&dir, None, vars(&[])).unwrap_err();
            assert!(
                err.to_string().contains(key),
                "{text}: `{err}` does not name `{key}`"
            );
        }
    }

    #[test]
    fn retention_shorter_than_the_redelivery_path_names_both() {
        let dir = temp_dir(&[(
            "default.toml",
            "[retention]\ndays = 2\n[failure]\ndelays = [\"1h\", \"2days\"]\n",
        )]);
        let err = Settings::load_layered(&dir, None, vars(&[]))
            .unwrap_err()
            .to_string();
        for words in ["retention.days", "2 days", "failure.delays", "2days 1h"] {
            assert!(err.contains(words), "`{err}` does not say `{words}`");
        }
        let ok = Settings::load_layered(&dir, None, vars(&[("INBOX__RETENTION__DAYS", "3")])).unwrap();
        assert_eq!(ok.failure.delays, [3600, 2 * 86400].map(Duration::from_secs));
    }

    #[test]
    fn the_failure_path_walks_the_tiers_then_the_error_queue() {
        let failure = FailureSettings::default();
        assert_eq!(failure.destination(0), Target::RetryTier(1));
        assert_eq!(failure.destination(2), Target::RetryTier(3));
        assert_eq!(failure.destination(3), Target::Exhausted);
        assert_eq!(
            (0..3).map(|r| failure.backoff(r)).collect::<Vec<_>>(),
            [100, 200, 400].map(Duration::from_millis)
        );
        // 30s + 5m + 1h, plus 700 ms of backoff on each of four deliveries.
        assert_eq!(
            failure.longest_redelivery_path(),
            Duration::from_millis(3_930_000 + 2_800)
        );
    }

    #[test]
    fn the_settings_folder_is_inbox_config_dir_or_config() {
        assert_eq!(config_dir(None), Path::new("config"));
        assert_eq!(config_dir(Some("".into())), Path::new("config"));
        assert_eq!(config_dir(Some("/etc/checkin".into())), Path::new("/etc/checkin"));
    }

    #[test]
    fn no_password_shows_in_debug_or_endpoints() {
        let mut settings = Settings::default();
        settings.message_bus.amqp_url = "amqp://app:s3cret-bus@broker.internal:5673/prod".into();
        settings.database.url = "postgres://app:s3cret-db@db.internal:5433/orders?sslmode=disable".into();
        let shown = format!(
            "{settings:?} {} {}",
            settings.broker_endpoint(),
            settings.database_endpoint()
        );
        assert!(!shown.contains("s3cret"), "{shown}");
        assert!(
            shown.contains("amqp://app:***@broker.internal:5673/prod"),
            "{shown}"
        );
        assert_eq!(settings.broker_endpoint(), "broker.internal:5673/prod");
        assert_eq!(settings.database_endpoint(), "db.internal:5433/orders");
        // A cluster: every node, none with its password.
        settings.message_bus.amqp_urls = vec![
            "amqp://app:s3cret-1@rabbit-1:5672/prod".into(),
            "amqp://app:s3cret-2@rabbit-2:5672/prod".into(),
        ];
        settings.database.url =
            "postgres://app:s3cret-db@db1:5432,db2:5433/orders?target_session_attrs=read-write".into();
        let shown = format!("{settings:?} {}", settings.broker_endpoint());
        assert!(!shown.contains("s3cret"), "{shown}");
        assert_eq!(
            settings.broker_endpoint(),
            "rabbit-1:5672/prod,rabbit-2:5672/prod"
        );
        assert_eq!(settings.database_endpoint(), "db1:5432,db2:5433/orders");
        assert_eq!(
            redact("host=db user=app password=s3cret dbname=orders"),
            "host=db user=app password=*** dbname=orders"
        );
        assert_eq!(
            redact("postgres://db/orders?password=s3cret&x=1"),
            "postgres://db/orders?password=***&x=1"
        );
        assert_eq!(redact("amqp://127.0.0.1"), "amqp://127.0.0.1");
    }

    #[test]
    fn database_name_replaces_the_urls_database() {
        let mut settings = Settings::default();
        settings.database.name = Some("orders".into());
        assert_eq!(settings.pg_config().unwrap().get_dbname(), Some("orders"));
    }

    #[test]
    fn lock_timeout_joins_the_urls_own_session_options() {
        let mut settings = Settings::default();
        settings.database.url = "postgres://u@h/db?options=-c%20search_path%3Dapp".into();
        settings.database.lock_timeout = Duration::from_millis(1500);
        let config = settings.pg_config().unwrap();
        assert_eq!(
            config.get_options(),
            Some(
                "-c search_path=app -c lock_timeout=1500 -c statement_timeout=60000 \
                 -c idle_in_transaction_session_timeout=60000"
            )
        );
    }
}
