//! What the check-in examples share: the event, and settings from
//! `config/` plus the conventional environment and command line.

// Each example compiles this module on its own and uses part of it.
#![allow(dead_code)]

use rabbit_inbox::tokio_postgres::types::ToSql;
use rabbit_inbox::{
    EventHandler, HandlerError, IntegrationEvent, MessageContext, QueueSettings, Settings, UnitOfWork,
    ValidSettings,
};
use serde::{Deserialize, Serialize};

/// The examples' own failures, and the library's, as one boxed error: a
/// service has errors of its own beside [`rabbit_inbox::Error`].
pub(crate) type BoxError = Box<dyn std::error::Error + Send + Sync>;

/// `Result` over [`BoxError`] (a handler's is `Result<(), HandlerError>`).
pub(crate) type Result<T, E = BoxError> = std::result::Result<T, E>;

/// The queue the check-in service consumes unless `--queue` says otherwise.
pub(crate) const DEFAULT_QUEUE: &str = "checkin.attendee-checked-in";

/// The database the check-in service uses unless `DATABASE_URL` or the
/// settings' `database.url` name another than the server's maintenance
/// database `postgres` (the built-in default).
pub(crate) const DEFAULT_DATABASE: &str = "checkin";

/// An attendee checked in to a session.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct AttendeeCheckedIn {
    pub(crate) attendee_id: i64,
    pub(crate) session_id: i64,
}

impl IntegrationEvent for AttendeeCheckedIn {
    const TYPE: &'static str = "AttendeeCheckedIn";
}

/// Adds a check-in for the attendee.
pub(crate) const COUNT_CHECKIN: &str = "INSERT INTO attendee_checkins (attendee_id, checkins) VALUES ($1, 1)
     ON CONFLICT (attendee_id) DO UPDATE SET checkins = attendee_checkins.checkins + 1";

/// Adds an attendee to the session.
pub(crate) const COUNT_ATTENDANCE: &str =
    "INSERT INTO session_attendance (session_id, attendees) VALUES ($1, 1)
     ON CONFLICT (session_id) DO UPDATE SET attendees = session_attendance.attendees + 1";

/// [`COUNT_CHECKIN`] for a whole batch in one statement. Grouped, because
/// one statement may not update a row twice; ordered, so that concurrent
/// batches lock their rows in the same order.
pub(crate) const COUNT_CHECKINS: &str = "INSERT INTO attendee_checkins (attendee_id, checkins)
     SELECT attendee_id, count(*) FROM unnest($1::bigint[]) AS e (attendee_id)
     GROUP BY attendee_id ORDER BY attendee_id
     ON CONFLICT (attendee_id) DO UPDATE SET checkins = attendee_checkins.checkins + excluded.checkins";

/// [`COUNT_ATTENDANCE`] for a whole batch in one statement.
pub(crate) const COUNT_ATTENDANCES: &str = "INSERT INTO session_attendance (session_id, attendees)
     SELECT session_id, count(*) FROM unnest($1::bigint[]) AS e (session_id)
     GROUP BY session_id ORDER BY session_id
     ON CONFLICT (session_id) DO UPDATE SET attendees = session_attendance.attendees + excluded.attendees";

/// A check-in, in either wire's contract: this library's
/// (`AttendeeCheckedIn`) or MassTransit's ([`masstransit`]). The handlers
/// below take either.
pub(crate) trait CheckIn: IntegrationEvent {
    /// What is forwarded for it (`--forward-to`).
    type Recorded: IntegrationEvent;
    /// A check-in of `attendee_id` at `session_id` (the publisher's).
    fn new(attendee_id: i64, session_id: i64) -> Self;
    fn attendee_id(&self) -> i64;
    fn session_id(&self) -> i64;
    /// Its follow-up, for the message `source_message_id`.
    fn recorded(&self, source_message_id: rabbit_inbox::uuid::Uuid) -> Self::Recorded;
}

impl CheckIn for AttendeeCheckedIn {
    type Recorded = CheckinRecorded;
    fn new(attendee_id: i64, session_id: i64) -> Self {
        Self {
            attendee_id,
            session_id,
        }
    }
    fn attendee_id(&self) -> i64 {
        self.attendee_id
    }
    fn session_id(&self) -> i64 {
        self.session_id
    }
    fn recorded(&self, source_message_id: rabbit_inbox::uuid::Uuid) -> CheckinRecorded {
        CheckinRecorded {
            attendee_id: self.attendee_id,
            session_id: self.session_id,
            source_message_id,
        }
    }
}

/// The same contracts as a MassTransit estate names them
/// (`message_bus.wire = "masstransit"`): `Namespace:Type`, camelCase.
pub(crate) mod masstransit {
    use serde::{Deserialize, Serialize};

    /// `{"attendeeId": .., "sessionId": ..}`, also as a producer on the
    /// PascalCase naming policy writes it (the runtime reads names in any
    /// case, as MassTransit does), and as Newtonsoft writes it, leaving out
    /// default values (`#[serde(default)]`: a missing `sessionId` is 0).
    #[derive(Debug, Clone, Default, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase", default)]
    pub(crate) struct AttendeeCheckedIn {
        pub(crate) attendee_id: i64,
        pub(crate) session_id: i64,
    }

    impl rabbit_inbox::IntegrationEvent for AttendeeCheckedIn {
        const TYPE: &'static str = "Conference.Contracts:AttendeeCheckedIn";
    }

    /// `{"attendeeId": .., "sessionId": .., "sourceMessageId": ..}`.
    #[derive(Debug, Clone, Serialize, Deserialize)]
    #[serde(rename_all = "camelCase")]
    pub(crate) struct CheckinRecorded {
        pub(crate) attendee_id: i64,
        pub(crate) session_id: i64,
        pub(crate) source_message_id: rabbit_inbox::uuid::Uuid,
    }

    impl rabbit_inbox::IntegrationEvent for CheckinRecorded {
        const TYPE: &'static str = "Conference.Contracts:CheckinRecorded";
    }

    impl super::CheckIn for AttendeeCheckedIn {
        type Recorded = CheckinRecorded;
        fn new(attendee_id: i64, session_id: i64) -> Self {
            Self {
                attendee_id,
                session_id,
            }
        }
        fn attendee_id(&self) -> i64 {
            self.attendee_id
        }
        fn session_id(&self) -> i64 {
            self.session_id
        }
        fn recorded(&self, source_message_id: rabbit_inbox::uuid::Uuid) -> CheckinRecorded {
            CheckinRecorded {
                attendee_id: self.attendee_id,
                session_id: self.session_id,
                source_message_id,
            }
        }
    }
}

/// Counts check-ins per attendee; refuses negative attendee ids (a
/// deliberate business failure, to show the failure path).
pub(crate) struct CountCheckins;

impl<E: CheckIn> EventHandler<E> for CountCheckins {
    async fn handle(
        &self,
        event: &E,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        refuse_negative(event)?;
        execute(uow, COUNT_CHECKIN, &[&event.attendee_id()]).await
    }

    /// One statement for the batch. A negative id fails the batch: the
    /// runtime then runs its messages one at a time, and only that one fails.
    async fn handle_batch(
        &self,
        events: &[E],
        _contexts: &[MessageContext],
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        events.iter().try_for_each(refuse_negative)?;
        let ids: Vec<i64> = events.iter().map(CheckIn::attendee_id).collect();
        execute(uow, COUNT_CHECKINS, &[&ids]).await
    }
}

/// Runs `sql` in the unit of work, prepared once per connection.
async fn execute(uow: &UnitOfWork, sql: &str, params: &[&(dyn ToSql + Sync)]) -> Result<(), HandlerError> {
    let client = uow.client();
    let statement = client.prepare_cached(sql).await?;
    client.execute(&statement, params).await?;
    Ok(())
}

fn refuse_negative<E: CheckIn>(event: &E) -> Result<(), HandlerError> {
    if event.attendee_id() < 0 {
        return Err(format!("attendee_id {} is negative", event.attendee_id()).into());
    }
    Ok(())
}

/// What the check-in service forwards for each check-in it recorded
/// (`--forward-to`), through the outbox.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct CheckinRecorded {
    pub(crate) attendee_id: i64,
    pub(crate) session_id: i64,
    /// The `AttendeeCheckedIn`'s message_id.
    pub(crate) source_message_id: rabbit_inbox::uuid::Uuid,
}

impl IntegrationEvent for CheckinRecorded {
    const TYPE: &'static str = "CheckinRecorded";
}

/// Stages one `CheckinRecorded` per check-in, to `queue`, in the message's
/// transaction: it leaves only if the check-in's effects commit, with the
/// check-in's correlation and causation ids. (With
/// MassTransit's wire it goes to the type's exchange; `queue` is bound
/// there.)
pub(crate) struct ForwardCheckins {
    pub(crate) queue: String,
}

impl<E: CheckIn> EventHandler<E> for ForwardCheckins {
    async fn handle(
        &self,
        event: &E,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let source = context.message_id;
        uow.publish(&self.queue, &rabbit_inbox::Message::new(event.recorded(source)))
            .await?;
        Ok(())
    }
    // No `handle_batch`: one row staged per check-in either way, and the
    // default runs `handle` with each message and its own context, whose
    // ids `publish` stamps on its follow-up.
}

/// Counts attendees per session.
pub(crate) struct CountAttendance;

impl<E: CheckIn> EventHandler<E> for CountAttendance {
    async fn handle(
        &self,
        event: &E,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        execute(uow, COUNT_ATTENDANCE, &[&event.session_id()]).await
    }

    async fn handle_batch(
        &self,
        events: &[E],
        _contexts: &[MessageContext],
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let ids: Vec<i64> = events.iter().map(CheckIn::session_id).collect();
        execute(uow, COUNT_ATTENDANCES, &[&ids]).await
    }
}

/// The service's own tables, as versioned migrations: the runtime applies
/// them at start under the inbox's advisory lock
/// (`RuntimeBuilder::migrations`), so that two replicas starting together
/// on a fresh database take turns instead of racing.
pub(crate) const SCHEMA: &[rabbit_inbox::Migration] = &[rabbit_inbox::Migration::new(
    1,
    "checkin_tables",
    // IF NOT EXISTS for databases made before this migration existed,
    // which have the tables and no record of it; safe under the lock.
    "CREATE TABLE IF NOT EXISTS attendee_checkins (attendee_id bigint PRIMARY KEY, checkins bigint NOT NULL);
     CREATE TABLE IF NOT EXISTS session_attendance (session_id bigint PRIMARY KEY, attendees bigint NOT NULL);",
)];

/// Applies [`SCHEMA`] (and the inbox's tables) where no runtime is built.
pub(crate) async fn create_tables(pool: &rabbit_inbox::tools::deadpool_postgres::Pool) -> Result<()> {
    let mut connection = pool.get().await?;
    let lock_wait = rabbit_inbox::settings::DatabaseSettings::default().migration_lock_timeout;
    Ok(rabbit_inbox::tools::migrate(&mut connection, true, SCHEMA, lock_wait).await?)
}

/// A seeded generator (fastrand's, a dependency of the crate already): the
/// same seed, the same numbers, run after run.
pub(crate) struct Seeded(fastrand::Rng);

impl Seeded {
    pub(crate) fn new(seed: u64) -> Self {
        Self(fastrand::Rng::with_seed(seed))
    }

    /// A number in `0..n`.
    pub(crate) fn below(&mut self, n: u64) -> u64 {
        self.0.u64(..n.max(1))
    }

    /// `true` with probability `p`.
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.0.f64() < p
    }
}

/// Drops and creates database `name` on the server `settings` point at.
pub(crate) async fn recreate_database(settings: &Settings, name: &str) -> Result<()> {
    drop_database(settings, name).await?;
    create_database(settings, name).await
}

/// Creates database `name` on the server `settings` point at, unless it
/// exists.
pub(crate) async fn create_database(settings: &Settings, name: &str) -> Result<()> {
    let client = admin(settings).await?;
    let exists = client
        .query_opt("SELECT 1 FROM pg_database WHERE datname = $1", &[&name])
        .await?
        .is_some();
    if !exists {
        // Not in a transaction block: a statement of its own. Another
        // instance starting at the same time may create it first: then it
        // exists, as wanted (42P04 duplicate_database, or 23505 from the
        // catalog's unique index when both inserted at once).
        let created = client.batch_execute(&format!("CREATE DATABASE \"{name}\"")).await;
        match created {
            Err(e)
                if e.code().is_some_and(|code| {
                    *code == rabbit_inbox::tokio_postgres::error::SqlState::DUPLICATE_DATABASE
                        || *code == rabbit_inbox::tokio_postgres::error::SqlState::UNIQUE_VIOLATION
                }) => {}
            other => other?,
        }
    }
    Ok(())
}

/// Drops database `name` on the server `settings` point at, if it exists.
pub(crate) async fn drop_database(settings: &Settings, name: &str) -> Result<()> {
    let client = admin(settings).await?;
    client
        .batch_execute(&format!("DROP DATABASE IF EXISTS \"{name}\" WITH (FORCE)"))
        .await?;
    Ok(())
}

/// A connection to the maintenance database `postgres` on the server
/// `database.url` names.
async fn admin(settings: &Settings) -> Result<rabbit_inbox::tools::deadpool_postgres::Object> {
    let mut admin = settings.clone();
    admin.database.set_dbname("postgres")?;
    let pool = rabbit_inbox::tools::create_pool(&admin)?;
    Ok(rabbit_inbox::tools::wait_for_database(&pool, &admin).await?)
}

/// The value after `--name` on the command line.
pub(crate) fn arg(name: &str) -> Option<String> {
    if let Some(flags) = FLAGS.get() {
        return flags.get(name.trim_start_matches('-')).cloned();
    }
    let mut args = std::env::args().skip_while(|a| a != name);
    args.next()?;
    args.next()
}

/// The options an example's command line gave, once checked by
/// [`check_flags`]: name (without its dashes) to value (`""` for a switch).
static FLAGS: std::sync::OnceLock<std::collections::HashMap<String, String>> = std::sync::OnceLock::new();

/// Reads the command line against what the example takes: options with a
/// value (`valued`, `--name value` or `--name=value`) and switches, by
/// name without their dashes. `--help` prints `usage` and exits 0; an
/// unknown option, a stray argument or a missing value exits 2, naming
/// it, with `usage`. [`arg`] and [`parsed_arg`] then read what it found.
pub(crate) fn check_flags(usage: &str, valued: &[&str], switches: &[&str]) {
    use lexopt::prelude::*;
    let program = std::env::args().next().unwrap_or_default();
    let fail = |error: lexopt::Error| -> ! {
        eprintln!("{program}: {error}\n\n{usage}");
        std::process::exit(2)
    };
    let mut found = std::collections::HashMap::new();
    let mut parser = lexopt::Parser::from_env();
    loop {
        match parser.next() {
            Ok(None) => break,
            Ok(Some(Long("help") | Short('h'))) => {
                println!("{usage}");
                std::process::exit(0)
            }
            Ok(Some(Long(name))) if valued.contains(&name) => {
                let name = name.to_owned();
                match parser.value().map(|v| v.string()) {
                    Ok(Ok(value)) => found.insert(name, value),
                    Ok(Err(e)) | Err(e) => fail(e),
                };
            }
            Ok(Some(Long(name))) if switches.contains(&name) => {
                found.insert(name.to_owned(), String::new());
            }
            Ok(Some(other)) => fail(other.unexpected()),
            Err(e) => fail(e),
        }
    }
    let _ = FLAGS.set(found);
}

/// `--name` parsed, or `default`; exits with a clear message on a bad value.
pub(crate) fn parsed_arg<T: std::str::FromStr>(name: &str, default: T) -> T {
    match arg(name) {
        None => default,
        Some(text) => text.parse().unwrap_or_else(|_| {
            eprintln!("{name}: cannot read `{text}`");
            std::process::exit(2);
        }),
    }
}

/// `config/` (with `INBOX_ENV`) and `INBOX__…`, then the conventional
/// `DATABASE_URL` (replacing `database.url`) and `AMQP_URL` (replacing one
/// broker, not the listed nodes of a cluster, which one URL cannot
/// describe), else the database [`DEFAULT_DATABASE`] in place of the
/// maintenance database `postgres`; then `--wire` and `--queue`: the queue
/// to consume (default [`DEFAULT_QUEUE`] when the settings list none).
pub(crate) fn settings() -> Result<ValidSettings> {
    let mut settings = Settings::load()?.into_inner();
    match std::env::var("DATABASE_URL").ok().filter(|url| !url.is_empty()) {
        Some(url) => settings.database.url = url,
        None if own_database(&settings).as_deref() == Some("postgres") => {
            settings.database.set_dbname(DEFAULT_DATABASE)?;
        }
        None => {}
    }
    if let Some(url) = std::env::var("AMQP_URL").ok().filter(|url| !url.is_empty())
        && settings.message_bus.amqp_urls.len() < 2
    {
        settings.message_bus.amqp_urls = vec![url];
    }
    match arg("--wire").as_deref() {
        Some("masstransit") => settings.message_bus.wire = rabbit_inbox::Wire::Masstransit,
        Some("inbox") => settings.message_bus.wire = rabbit_inbox::Wire::Inbox,
        Some(other) => {
            eprintln!("--wire takes inbox or masstransit, not `{other}`");
            std::process::exit(2);
        }
        None => {}
    }
    if let Some(queue) = arg("--queue") {
        settings.queues = vec![QueueSettings::new(queue)];
    } else if settings.queues.is_empty() {
        settings.queues = vec![QueueSettings::new(DEFAULT_QUEUE)];
    }
    Ok(settings.validate()?)
}

/// The database the service creates at start when missing, and `--remove`
/// drops: the one `database.url` names (PostgreSQL's default, the user's
/// name, when it names none), unless it is the one `DATABASE_URL` names:
/// that database the service uses as it is.
pub(crate) fn own_database(settings: &Settings) -> Option<String> {
    let named = |config: &rabbit_inbox::tokio_postgres::Config| {
        config.get_dbname().or(config.get_user()).map(str::to_owned)
    };
    let own = named(&settings.pg_config().ok()?)?;
    // Read as the settings read a URL (libpq's TLS parameters apart).
    let given = std::env::var("DATABASE_URL").ok().and_then(|url| {
        let mut given = settings.clone();
        given.database.url = url;
        named(&given.pg_config().ok()?)
    });
    (given.as_deref() != Some(own.as_str())).then_some(own)
}

/// Installs the Prometheus recorder as the `metrics` facade's, with every
/// `*_seconds` metric rendered as a histogram, and keeps it tidy (the
/// exporter wants its upkeep run now and then). Install it before building
/// the runtime: the runtime registers its metrics as it builds.
pub(crate) fn install_prometheus() -> Result<metrics_exporter_prometheus::PrometheusHandle> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    const SECONDS: &[f64] = &[
        0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
    ];
    let handle = PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS)
        .and_then(PrometheusBuilder::install_recorder)
        .map_err(|e| BoxError::from(format!("cannot install the Prometheus recorder: {e}")))?;
    let upkeep = handle.clone();
    actix_rt::spawn(async move {
        let mut every = tokio::time::interval(std::time::Duration::from_secs(5));
        loop {
            every.tick().await;
            upkeep.run_upkeep();
        }
    });
    Ok(handle)
}
