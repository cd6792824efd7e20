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
    /// `[runtime]`: lifecycle of the actors.
    pub runtime: RuntimeSettings,
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

/// `[message_bus]`.
#[derive(Debug, Clone, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MessageBusSettings {
    /// `provider`: `rabbitmq` or `in_process`. Default `rabbitmq`.
    pub provider: Provider,
    /// `amqp_url`: the broker. Default `amqp://guest:guest@127.0.0.1:5672/%2f`.
    pub amqp_url: String,
    /// `exchange`: where [publishing](crate::AmqpPublisher) sends events.
    /// Default `""`, the default exchange, where the routing key is the queue name.
    pub exchange: String,
    /// `enable_inbox`: deduplicate redeliveries through `inbox_messages`.
    /// Default unset: on for `rabbitmq`, off for `in_process`. An explicit
    /// value wins both ways; see [`Settings::is_inbox_enabled`].
    pub enable_inbox: Option<bool>,
}

impl Default for MessageBusSettings {
    fn default() -> Self {
        Self {
            provider: Provider::Rabbitmq,
            amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
            exchange: String::new(),
            enable_inbox: None,
        }
    }
}

/// `[database]`.
#[derive(Debug, Clone, Deserialize)]
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
    /// `connect_timeout`: the longest to wait for a new connection. Default `5s`.
    #[serde(with = "humantime_serde")]
    pub connect_timeout: Duration,
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
        }
    }

    /// The consumer id used in the dedup key: `consumer`, or the queue name.
    pub fn consumer_id(&self) -> &str {
        self.consumer.as_deref().unwrap_or(&self.name)
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
    /// Loads `config/default.toml`, `config/{INBOX_ENV}.toml` and the
    /// `INBOX__SECTION__KEY` environment over the built-in defaults, relative
    /// to the working directory, and validates the result.
    pub fn load() -> Result<Self> {
        Self::load_from(Path::new("config"))
    }

    /// Like [`Settings::load`], with the settings files in `dir`.
    pub fn load_from(dir: &Path) -> Result<Self> {
        let inbox_env = std::env::var("INBOX_ENV").ok().filter(|e| !e.is_empty());
        Self::load_layered(dir, inbox_env.as_deref(), None)
    }

    /// Like [`Settings::load_from`], for the environment named `inbox_env`
    /// whatever `INBOX_ENV` says (tests load `config/test.toml` this way).
    pub fn load_environment(dir: &Path, inbox_env: &str) -> Result<Self> {
        Self::load_layered(dir, Some(inbox_env), None)
    }

    /// The layering itself; `vars` replaces the process environment (tests).
    fn load_layered(
        dir: &Path,
        inbox_env: Option<&str>,
        vars: Option<HashMap<String, String>>,
    ) -> Result<Self> {
        use config::{Config, Environment, File};
        let path = |name: &str| dir.join(name).to_string_lossy().into_owned();
        // default.toml is optional (the built-in defaults are the same values);
        // a named environment whose file is missing is a mistake worth stopping for.
        let mut builder = Config::builder().add_source(File::with_name(&path("default")).required(false));
        if let Some(env) = inbox_env {
            builder = builder.add_source(File::with_name(&path(env)).required(true));
        }
        let settings: Settings = builder
            .add_source(
                Environment::with_prefix("INBOX")
                    .prefix_separator("__")
                    .separator("__")
                    .try_parsing(true)
                    .source(vars),
            )
            .build()?
            .try_deserialize()?;
        settings.validate()?;
        Ok(settings)
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

    /// The PostgreSQL connection settings: `database.url` with
    /// `database.name` and `database.connect_timeout` applied.
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
        Ok(config)
    }

    /// Checks every value the runtime relies on; the error names the key.
    pub fn validate(&self) -> Result<()> {
        let bus = &self.message_bus;
        if bus.provider == Provider::Rabbitmq {
            bus.amqp_url
                .parse::<lapin::uri::AMQPUri>()
                .map_err(|e| Error::setting("message_bus.amqp_url", format!("not an AMQP URL: {e}")))?;
        }
        short_string("message_bus.exchange", &bus.exchange)?;

        let db = &self.database;
        self.pg_config()?;
        if db.name.as_deref() == Some("") {
            return Err(Error::setting(
                "database.name",
                "is empty; leave it unset to use the url's database",
            ));
        }
        if db.pool_size == 0 {
            return Err(Error::setting("database.pool_size", "must be at least 1"));
        }
        if db.lock_timeout.is_zero() {
            // PostgreSQL reads lock_timeout = 0 as "wait forever".
            return Err(Error::setting(
                "database.lock_timeout",
                "must be more than 0 (0 would wait forever)",
            ));
        }
        if db.connect_timeout.is_zero() {
            return Err(Error::setting("database.connect_timeout", "must be more than 0"));
        }

        let mut names = HashSet::new();
        for (i, queue) in self.queues.iter().enumerate() {
            let key = |field: &str| format!("queues[{i}].{field}");
            if queue.name.is_empty() {
                return Err(Error::setting(&key("name"), "is empty"));
            }
            short_string(&key("name"), &queue.name)?;
            if !names.insert(queue.name.as_str()) {
                return Err(Error::setting(
                    &key("name"),
                    format!("`{}` is listed twice", queue.name),
                ));
            }
            if queue.consumer.as_deref() == Some("") {
                return Err(Error::setting(
                    &key("consumer"),
                    "is empty; leave it unset to use the queue name",
                ));
            }
            if queue.prefetch == 0 {
                // basic.qos 0 means "unlimited", which would defeat the pool sizing.
                return Err(Error::setting(&key("prefetch"), "must be at least 1"));
            }
        }
        if self.runtime.shutdown_timeout.is_zero() {
            return Err(Error::setting("runtime.shutdown_timeout", "must be more than 0"));
        }
        Ok(())
    }
}

/// AMQP short strings (queue and exchange names) hold at most 255 bytes;
/// lapin panics past that, so refuse them here with the key's name.
fn short_string(key: &str, value: &str) -> Result<()> {
    if value.len() > 255 {
        return Err(Error::setting(
            key,
            format!("is {} bytes long; AMQP allows 255", value.len()),
        ));
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
    fn database_name_replaces_the_urls_database() {
        let mut settings = Settings::default();
        settings.database.name = Some("orders".into());
        assert_eq!(settings.pg_config().unwrap().get_dbname(), Some("orders"));
    }
}
