//! Validation: every value the runtime relies on, section by section, with
//! an error that names the key; [`ValidSettings`], the only kind the
//! runtime takes.

use std::collections::HashSet;
use std::time::Duration;

use super::{
    DatabaseSettings, FailureSettings, MessageBusSettings, OutboxSettings, Provider, QueueSettings,
    RetentionSettings, Settings,
};
use crate::error::{Error, Result};

impl Settings {
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
        self.failure.validate("failure")?;
        // Each queue's policy, and the longest redelivery path of them all.
        let mut longest = ("failure".to_owned(), self.failure.longest_redelivery_path());
        for (i, queue) in self.queues.iter().enumerate() {
            if queue.failure == Default::default() {
                continue;
            }
            let section = format!("queues[{i}].failure");
            let policy = queue.failure_policy(&self.failure);
            policy.validate(&section)?;
            if policy.longest_redelivery_path() > longest.1 {
                longest = (section, policy.longest_redelivery_path());
            }
        }
        self.retention.validate()?;
        self.outbox.validate()?;
        if !(0.0..=1.0).contains(&self.failures.pause_redrive_at) {
            return Err(Error::setting("failures.pause_redrive_at", "must be from 0 to 1"));
        }
        check_timer(self.runtime.shutdown_timeout, "runtime.shutdown_timeout")?;
        // Across sections: a late redelivery must still find its row.
        let (section, path) = longest;
        if self.retention.period() <= path {
            return Err(Error::setting(
                "retention.days",
                format!(
                    "{} days is not longer than the longest redelivery path ({}, from {section}.delays and \
                     {section}.immediate_retries): a late redelivery would find its inbox row deleted and run again",
                    self.retention.days,
                    humantime::format_duration(path)
                ),
            ));
        }
        Ok(ValidSettings(self))
    }
}

impl MessageBusSettings {
    fn validate(&self) -> Result<()> {
        if self.provider == Provider::Rabbitmq {
            if self.amqp_urls.is_empty() {
                return Err(no_broker());
            }
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
        check_timer(self.migration_lock_timeout, "database.migration_lock_timeout")?;
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
        // (Above prefetch it is harmless: no batch can hold more than the
        // deliveries in flight, so a `prefetch = 1` queue runs one message
        // per transaction whatever the default batch size.)
        if !(1..=64).contains(&self.batch_size) {
            return Err(Error::setting(&key("batch_size"), "must be from 1 to 64"));
        }
        if !(1..=MAX_DELIVERY_LIMIT).contains(&self.delivery_limit) {
            return Err(Error::setting(
                &key("delivery_limit"),
                format!("must be from 1 to {MAX_DELIVERY_LIMIT}"),
            ));
        }
        let in_flight = (self.prefetch / self.batch_limit()).max(1);
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
    /// Checks the policy read under `section` (`failure`, or a queue's
    /// `queues[i].failure`), naming its keys so.
    fn validate(&self, section: &str) -> Result<()> {
        if self.immediate_retries > 100 {
            return Err(Error::setting(
                &format!("{section}.immediate_retries"),
                "must be at most 100",
            ));
        }
        for (i, delay) in self.delays.iter().enumerate() {
            // x-message-ttl is a 32-bit count of milliseconds.
            if delay.is_zero() || delay.as_millis() > u128::from(u32::MAX) {
                return Err(Error::setting(
                    &format!("{section}.delays[{i}]"),
                    "must be more than 0 and at most 49 days",
                ));
            }
        }
        if self.max_body_size == 0 {
            return Err(Error::setting(
                &format!("{section}.max_body_size"),
                "must be at least 1",
            ));
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
        // At least 0.01: a pause of at most 99 times a statement, never a
        // product past what a `Duration` holds.
        if !(MIN_BUSY_SHARE..=1.0).contains(&self.busy_share) {
            return Err(Error::setting(
                "retention.busy_share",
                format!("must be from {MIN_BUSY_SHARE} to 1, not {}", self.busy_share),
            ));
        }
        Ok(())
    }
}

impl OutboxSettings {
    fn validate(&self) -> Result<()> {
        check_timer(self.poll_interval, "outbox.poll_interval")?;
        check_timer(self.claim_lease, "outbox.claim_lease")?;
        if self.claim_lease < Duration::from_secs(1) {
            // Renewed every third of it, a round trip each: any shorter and
            // a busy database lets it lapse, the rows sent twice.
            return Err(Error::setting("outbox.claim_lease", "must be at least 1s"));
        }
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

/// An empty `message_bus.amqp_urls`, refused by validation and by
/// connecting (which takes settings from code too).
pub(crate) fn no_broker() -> Error {
    Error::setting(
        "message_bus.amqp_urls",
        "is empty: name the broker, or the nodes of its cluster",
    )
}

/// The highest `queues[].delivery_limit`: the broker reads it as a signed
/// 32-bit number.
pub(crate) const MAX_DELIVERY_LIMIT: u32 = i32::MAX as u32;

/// The longest timeout PostgreSQL takes: `INT_MAX` milliseconds.
const MAX_PG_TIMEOUT: Duration = Duration::from_millis(i32::MAX as u64);

/// The least `retention.busy_share`: see `RetentionSettings::validate`.
const MIN_BUSY_SHARE: f64 = 0.01;

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
