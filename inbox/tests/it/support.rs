//! Shared by the integration tests: an isolated database and queue per test,
//! a counting event and its handlers, polling with a deadline.

use std::future::Future;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use rabbit_inbox::tokio_postgres::{Client, NoTls};
use rabbit_inbox::tools::lapin::message::Delivery;
use rabbit_inbox::tools::lapin::options::{
    BasicGetOptions, BasicPublishOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::tools::lapin::{BasicProperties, Connection, ConnectionProperties};
use rabbit_inbox::{
    EventHandler, HandlerError, IntegrationEvent, MessageContext, QueueSettings, Settings, UnitOfWork,
    ValidSettings,
};
use serde::{Deserialize, Serialize};

/// The test event: each one adds 1 to `counts` (and `second_counts`) at `key`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Counted {
    pub(crate) key: i64,
}

impl IntegrationEvent for Counted {
    const TYPE: &'static str = "Counted";
}

/// Adds 1 to `counts.n` at the event's key.
pub(crate) struct Count;

impl EventHandler<Counted> for Count {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, "counts", event.key).await
    }
}

/// Adds 1 to `second_counts.n` at the event's key: a second handler.
pub(crate) struct CountAgain;

impl EventHandler<Counted> for CountAgain {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, "second_counts", event.key).await
    }
}

pub(crate) async fn increment(uow: &mut UnitOfWork, table: &str, key: i64) -> Result<(), HandlerError> {
    let sql = format!(
        "INSERT INTO {table} (key, n) VALUES ($1, 1) ON CONFLICT (key) DO UPDATE SET n = {table}.n + 1"
    );
    uow.client().execute(&sql, &[&key]).await?;
    Ok(())
}

fn database_url() -> String {
    std::env::var("DATABASE_URL").unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/postgres".into())
}

/// The URL of database `name` on the tests' server: what a service's
/// `database.url` says to use it.
pub(crate) fn database_url_of(name: &str) -> String {
    let mut database = rabbit_inbox::settings::DatabaseSettings::default();
    database.url = database_url();
    database.set_dbname(name).expect("DATABASE_URL");
    database.url
}

pub(crate) fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

async fn connect(url: &str, dbname: Option<&str>) -> Client {
    let mut config: rabbit_inbox::tokio_postgres::Config = url.parse().expect("DATABASE_URL");
    if let Some(name) = dbname {
        config.dbname(name);
    }
    let (client, connection) = config.connect(NoTls).await.expect("connect to PostgreSQL");
    tokio::spawn(connection);
    client
}

/// One test's own database (`inbox_test_<name>`, made afresh) and queue
/// (`test.<name>.<uuid>`), both removed when it drops, pass or fail.
pub(crate) struct TestEnv {
    pub(crate) database: String,
    pub(crate) queue: String,
    /// More queues of this test's, removed with the rest.
    extra_queues: Vec<String>,
}

impl TestEnv {
    pub(crate) async fn new(name: &str) -> Self {
        let database = format!("inbox_test_{name}");
        let admin = connect(&database_url(), None).await;
        // Two calls: one string would run as one transaction, which
        // DROP/CREATE DATABASE refuse.
        for sql in [
            format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"),
            format!("CREATE DATABASE {database}"),
        ] {
            admin.batch_execute(&sql).await.expect("create the test database");
        }
        let env = Self {
            database,
            queue: format!("test.{name}.{}", uuid::Uuid::now_v7()),
            extra_queues: Vec::new(),
        };
        env.db()
            .await
            .batch_execute(
                "CREATE TABLE counts (key bigint PRIMARY KEY, n bigint NOT NULL);
                 CREATE TABLE second_counts (key bigint PRIMARY KEY, n bigint NOT NULL);",
            )
            .await
            .expect("create the test tables");
        env
    }

    /// `config/test.toml` pointed at this test's database and queue.
    pub(crate) fn settings(&self) -> Settings {
        let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
        let mut settings = rabbit_inbox::internal::load_settings(&dir, Some("test"))
            .expect("config/test.toml")
            .into_inner();
        settings.database.url = database_url_of(&self.database);
        settings.message_bus.amqp_urls = vec![amqp_url()];
        settings.queues = vec![QueueSettings::new(&self.queue)];
        settings
    }

    /// Another queue name of this test's (`<queue>.<suffix>`).
    pub(crate) fn another_queue(&mut self, suffix: &str) -> String {
        let name = format!("{}.{suffix}", self.queue);
        self.extra_queues.push(name.clone());
        name
    }

    /// A connection to this test's database, outside the runtime.
    pub(crate) async fn db(&self) -> Client {
        connect(&database_url(), Some(&self.database)).await
    }

    pub(crate) async fn count(&self, table: &str, key: i64) -> i64 {
        let row = self
            .db()
            .await
            .query_opt(&format!("SELECT n FROM {table} WHERE key = $1"), &[&key])
            .await
            .unwrap();
        row.map_or(0, |r| r.get(0))
    }

    pub(crate) async fn scalar(&self, sql: &str) -> i64 {
        self.db().await.query_one(sql, &[]).await.unwrap().get(0)
    }

    /// Publishes raw properties and body to this test's queue, confirmed.
    pub(crate) async fn publish_raw(&self, properties: BasicProperties, body: &[u8]) {
        publish_to("", &self.queue, properties, body).await;
    }

    /// Takes one message from `queue` (acked), if there is one.
    pub(crate) async fn take(&self, queue: &str) -> Option<Delivery> {
        let connection = amqp().await;
        let channel = connection.create_channel().await.unwrap();
        let got = channel
            .basic_get(queue.into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .map(|m| m.delivery);
        connection.close(200, "done".into()).await.unwrap();
        got
    }

    /// Messages ready in `queue` (not counting unacked ones).
    pub(crate) async fn ready(&self, queue: &str) -> u32 {
        probe(queue).await.expect("the queue exists").message_count()
    }

    /// Consumers of `queue`; `None` while it does not exist.
    pub(crate) async fn consumers(&self, queue: &str) -> Option<u32> {
        probe(queue).await.map(|q| q.consumer_count())
    }
}

/// `queue` as the broker sees it (a passive declare), if it exists.
async fn probe(queue: &str) -> Option<rabbit_inbox::tools::lapin::Queue> {
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let options = QueueDeclareOptions {
        passive: true,
        ..QueueDeclareOptions::default()
    };
    let q = channel
        .queue_declare(queue.into(), options, FieldTable::default())
        .await
        .ok();
    connection.close(200, "done".into()).await.unwrap();
    q
}

/// The most retry tiers a test configures (the lock-timeout test's 20).
const MAX_TIERS: usize = 20;

impl Drop for TestEnv {
    fn drop(&mut self) {
        let database = self.database.clone();
        // Every queue the runtime may have declared for this test's queues:
        // tests use up to MAX_TIERS retry tiers. Deleting a queue that does
        // not exist is fine.
        let mut queues = Vec::new();
        // Under either wire's names; with MassTransit's, each has an
        // exchange of its name too.
        let mut exchanges = Vec::new();
        for queue in std::iter::once(&self.queue).chain(&self.extra_queues) {
            for wire in [rabbit_inbox::Wire::Inbox, rabbit_inbox::Wire::Masstransit] {
                queues.extend((1..=MAX_TIERS).map(|tier| wire.retry_queue(queue, tier)));
                queues.extend([wire.error_queue(queue), wire.skipped_queue(queue)]);
            }
            queues.push(queue.clone());
            let wire = rabbit_inbox::Wire::Masstransit;
            exchanges.extend([queue.clone(), wire.error_queue(queue), wire.skipped_queue(queue)]);
        }
        // Drop cannot await, and may run while a test panics: clean up on a
        // thread of its own with a runtime of its own.
        let cleanup = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .unwrap();
            rt.block_on(async move {
                if let Ok(connection) =
                    Connection::connect(&amqp_url(), ConnectionProperties::default()).await
                {
                    if let Ok(channel) = connection.create_channel().await {
                        for queue in queues {
                            let _ = channel
                                .queue_delete(queue.as_str().into(), QueueDeleteOptions::default())
                                .await;
                        }
                        for exchange in exchanges {
                            let _ = channel
                                .exchange_delete(exchange.as_str().into(), Default::default())
                                .await;
                        }
                    }
                    let _ = connection.close(200, "cleanup".into()).await;
                }
                let admin = connect(&database_url(), None).await;
                let _ = admin
                    .batch_execute(&format!("DROP DATABASE IF EXISTS {database} WITH (FORCE)"))
                    .await;
            });
        });
        let _ = cleanup.join();
    }
}

/// Publishes raw properties and body to `exchange` with `routing_key`,
/// confirmed.
pub(crate) async fn publish_to(exchange: &str, routing_key: &str, properties: BasicProperties, body: &[u8]) {
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    channel.confirm_select(Default::default()).await.unwrap();
    let confirm = channel
        .basic_publish(
            exchange.into(),
            routing_key.into(),
            BasicPublishOptions::default(),
            body,
            properties,
        )
        .await
        .unwrap()
        .await
        .unwrap();
    assert!(confirm.is_ack());
    connection.close(200, "done".into()).await.unwrap();
}

pub(crate) async fn amqp() -> Arc<Connection> {
    let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
        .await
        .expect("connect to RabbitMQ");
    Arc::new(connection)
}

/// A header of `delivery` as text (strings) or its debug form (others).
pub(crate) fn header(delivery: &Delivery, key: &str) -> Option<String> {
    use rabbit_inbox::tools::lapin::types::AMQPValue;
    let value = delivery.properties.headers().as_ref()?.inner().get(key)?.clone();
    Some(match value {
        AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
        AMQPValue::LongLongInt(n) => n.to_string(),
        other => format!("{other:?}"),
    })
}

/// Settings validated, as the runtime takes them.
pub(crate) trait Valid {
    fn valid(self) -> ValidSettings;
}

impl Valid for Settings {
    fn valid(self) -> ValidSettings {
        self.validate().expect("the test's settings are valid")
    }
}

/// Publishes one new message per key, in order, through the runtime.
pub(crate) async fn publish_keys(
    runtime: &rabbit_inbox::Runtime,
    queue: &str,
    keys: impl IntoIterator<Item = i64>,
) {
    for key in keys {
        runtime
            .publisher()
            .publish(queue, &rabbit_inbox::Message::new(Counted { key }))
            .await
            .unwrap();
    }
}

/// Declares the topology of the first queue `settings` list, as a runtime
/// would at its start.
pub(crate) async fn declare(settings: &Settings) {
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    rabbit_inbox::tools::declare_topology(&channel, &settings.queues[0], &settings.failure)
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// What `rabbitmqctl args` printed, run off the test's thread: it takes
/// half a second, and the runtime under test runs on that thread too (a
/// runtime stopped that long is not what a test means to show).
pub(crate) async fn rabbitmqctl(args: &[&str]) -> String {
    let args: Vec<String> = args.iter().map(|arg| (*arg).to_owned()).collect();
    tokio::task::spawn_blocking(move || rabbitmqctl_now(&args))
        .await
        .expect("rabbitmqctl ran")
        .unwrap_or_else(|failed| panic!("{failed}"))
}

/// [`rabbitmqctl`] on this thread, for a `Drop`.
pub(crate) fn rabbitmqctl_now(args: &[String]) -> Result<String, String> {
    let output = std::process::Command::new("rabbitmqctl")
        .args(args)
        .output()
        .map_err(|e| format!("rabbitmqctl does not run: {e}"))?;
    if !output.status.success() {
        return Err(format!("rabbitmqctl {args:?}: {output:?}"));
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Polls `condition` until it holds, failing the test after 30 s with `what`.
pub(crate) async fn wait_until<F, Fut>(what: &str, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + Duration::from_secs(30);
    while !condition().await {
        assert!(Instant::now() < deadline, "timed out waiting until {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Collects what the tracing subscriber writes on this test's thread, for
/// tests of the logs.
#[derive(Clone, Default)]
pub(crate) struct Captured(Arc<Mutex<Vec<u8>>>);

std::thread_local! {
    /// Where this thread's log lines go while a test captures them.
    static CAPTURING: std::cell::RefCell<Option<Captured>> = const { std::cell::RefCell::new(None) };
}

/// The test binary's one subscriber writes each line to the capture of the
/// thread that logged it, if any.
///
/// One global subscriber rather than one `set_default` per test: tracing
/// caches whether a log site is enabled the first time any thread reaches
/// it, and with per-thread subscribers it asks only the thread that got
/// there first. A site first reached by a test that captures nothing was
/// then off for every test, and a captured line went missing now and then.
struct ThreadCapture;

impl std::io::Write for ThreadCapture {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        CAPTURING.with(|capturing| {
            if let Some(captured) = capturing.borrow().as_ref() {
                captured.0.lock().unwrap().extend_from_slice(buf);
            }
        });
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// Stops a capture when dropped.
pub(crate) struct Capturing;

impl Drop for Capturing {
    fn drop(&mut self) {
        CAPTURING.with(|capturing| capturing.borrow_mut().take());
    }
}

impl Captured {
    /// Captures this thread's INFO and above until the guard drops (the
    /// test's actix system runs on this thread).
    pub(crate) fn install(&self) -> Capturing {
        static SUBSCRIBER: std::sync::Once = std::sync::Once::new();
        SUBSCRIBER.call_once(|| {
            let subscriber = tracing_subscriber::fmt()
                .with_writer(|| ThreadCapture)
                .with_ansi(false)
                .with_max_level(tracing::Level::INFO)
                .finish();
            tracing::subscriber::set_global_default(subscriber).expect("the test binary's one subscriber");
        });
        CAPTURING.with(|capturing| *capturing.borrow_mut() = Some(self.clone()));
        Capturing
    }

    pub(crate) fn text(&self) -> String {
        String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned()
    }
}

/// The repository's root, where `config/` is: the example service runs there,
/// as README's quickstart runs it.
pub(crate) const REPOSITORY: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");

/// The example service's binary, which `cargo test` builds with the tests.
pub(crate) fn checkin_service() -> std::path::PathBuf {
    example("checkin_service")
}

/// Example `name`'s binary, which `cargo test` builds with the tests.
pub(crate) fn example(name: &str) -> std::path::PathBuf {
    let deps = std::env::current_exe().unwrap();
    let path = deps
        .parent()
        .and_then(|d| d.parent())
        .unwrap()
        .join("examples")
        .join(name);
    assert!(
        path.exists(),
        "{} is not built: cargo build --examples",
        path.display()
    );
    path
}

/// A child process killed when dropped, pass or fail: a test that panics
/// while its service runs would otherwise leave it consuming, and taking
/// the messages of the tests after it that share a type's exchange.
pub(crate) struct Killed(pub(crate) std::process::Child);

impl std::ops::Deref for Killed {
    type Target = std::process::Child;
    fn deref(&self) -> &std::process::Child {
        &self.0
    }
}

impl std::ops::DerefMut for Killed {
    fn deref_mut(&mut self) -> &mut std::process::Child {
        &mut self.0
    }
}

impl Drop for Killed {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts the example service on database `database` and queue `queue`;
/// it is killed when the handle is dropped.
pub(crate) fn start_service(database: &str, queue: &str, extra: &[&str]) -> Killed {
    let child = std::process::Command::new(checkin_service())
        .args(["--queue", queue])
        .args(extra)
        .current_dir(crate::support::REPOSITORY)
        .env("INBOX__DATABASE__URL", database_url_of(database))
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the example service starts");
    Killed(child)
}

/// Starts the example service with the operator plane (`--http ADDRESS
/// --ops-tokens TOKENS`) on database `database` and queue `queue`, with
/// the tests' settings (a refused message walks its retries in about a
/// second).
pub(crate) fn start_ops_service(database: &str, queue: &str, address: &str, tokens: &Path) -> Killed {
    let child = std::process::Command::new(checkin_service())
        .args(["--queue", queue, "--http", address, "--ops-tokens"])
        .arg(tokens)
        .current_dir(crate::support::REPOSITORY)
        .env("INBOX_ENV", "test")
        .env("INBOX__DATABASE__URL", database_url_of(database))
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .expect("the example service starts");
    Killed(child)
}

/// A free port on loopback.
pub(crate) fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// Reads `child`'s log until it says it consumes (true) or it exits (false).
pub(crate) fn consumes(child: &mut std::process::Child) -> (bool, String) {
    use std::io::BufRead;
    let mut log = String::new();
    let lines = std::io::BufReader::new(child.stdout.take().unwrap()).lines();
    for line in lines.map_while(Result::ok) {
        log.push_str(&line);
        log.push('\n');
        if line.contains("consuming") {
            return (true, log);
        }
    }
    (false, log)
}

/// Takes the message waiting in `queue` and hands it back to the broker, as
/// a consumer that crashed on it would: its next delivery is marked
/// redelivered.
pub(crate) async fn crash_once_on(queue: &str) {
    use rabbit_inbox::tools::lapin::options::BasicNackOptions;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let got = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: false })
        .await
        .unwrap()
        .expect("a message waits");
    let requeue = BasicNackOptions {
        requeue: true,
        ..Default::default()
    };
    got.delivery.acker.nack(requeue).await.unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// Makes the inbox's tables in the test's database and records, as the
/// runtime counts them, `deliveries` deliveries of `message_id` on the
/// queue of `settings` (its consumer id).
pub(crate) async fn delivered_before(settings: &Settings, message_id: uuid::Uuid, deliveries: i32) {
    let pool = rabbit_inbox::tools::create_pool(settings).unwrap();
    let mut client = pool.get().await.unwrap();
    let lock_wait = settings.database.migration_lock_timeout;
    rabbit_inbox::tools::migrate(&mut client, true, &[], lock_wait)
        .await
        .unwrap();
    client
        .execute(
            "INSERT INTO inbox_deliveries (consumer, message_id, deliveries) VALUES ($1, $2, $3)",
            &[&settings.queues[0].consumer_id(), &message_id, &deliveries],
        )
        .await
        .unwrap();
}
