//! TLS to PostgreSQL and RabbitMQ, against the servers tests/tls_servers.sh
//! starts beside the machine's own: a PostgreSQL that accepts TLS only, one
//! whose certificate has expired, and a RabbitMQ node with a TLS listener
//! only, all with certificates of the script's own CA that name
//! `localhost` (and no IP address, so that `127.0.0.1` is a host-name
//! mismatch).

use std::path::PathBuf;
use std::process::Command;
use std::sync::OnceLock;
use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::tokio_postgres::Client;
use rabbit_inbox::tools::lapin::options::{QueueDeclareOptions, QueueDeleteOptions};
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::{
    EventHandler, HandlerError, Message, MessageContext, QueueSettings, Settings, UnitOfWork,
};

use crate::support::{Captured, Counted, Valid, increment, wait_until};

/// What tests/tls_servers.sh started, from its `env`.
struct Servers {
    certs: PathBuf,
    pg_port: u16,
    expired_pg_port: u16,
    amqp_port: u16,
}

/// Starts the servers once for the test binary (the script is idempotent:
/// servers already up are left as they are).
fn servers() -> &'static Servers {
    static SERVERS: OnceLock<Servers> = OnceLock::new();
    SERVERS.get_or_init(|| {
        let script = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/tls_servers.sh");
        let status = Command::new("bash").args([script, "start"]).status().unwrap();
        assert!(
            status.success(),
            "tests/tls_servers.sh could not start the TLS servers"
        );
        let out = Command::new("bash").args([script, "env"]).output().unwrap();
        let env = String::from_utf8(out.stdout).unwrap();
        let value = |key: &str| {
            env.lines()
                .find_map(|line| line.strip_prefix(&format!("{key}=")))
                .unwrap_or_else(|| panic!("tests/tls_servers.sh env says no {key}"))
                .to_owned()
        };
        Servers {
            certs: PathBuf::from(value("TLS_CERTS")),
            pg_port: value("TLS_PG_PORT").parse().unwrap(),
            expired_pg_port: value("TLS_EXPIRED_PG_PORT").parse().unwrap(),
            amqp_port: value("TLS_AMQP_PORT").parse().unwrap(),
        }
    })
}

impl Servers {
    fn cert(&self, name: &str) -> String {
        self.certs.join(name).display().to_string()
    }

    /// The TLS-only PostgreSQL's database `name` at `host`, as libpq
    /// spells it, with `params` (`sslmode=...&...`). The password is
    /// ignored by the server (trust) and must show nowhere.
    fn pg_url(&self, host: &str, port: u16, name: &str, params: &str) -> String {
        format!("postgres://postgres:s3cret-pg@{host}:{port}/{name}?{params}")
    }

    /// The TLS node as `host`, verified against the script's CA.
    fn amqps_url(&self, host: &str, params: &str) -> String {
        format!(
            "amqps://guest:guest@{host}:{}/%2f?cacertfile={}{params}",
            self.amqp_port,
            self.cert("ca.pem")
        )
    }

    /// `verify-full` against the script's CA.
    fn verified(&self, name: &str) -> String {
        self.pg_url(
            "localhost",
            self.pg_port,
            name,
            &format!("sslmode=verify-full&sslrootcert={}", self.cert("ca.pem")),
        )
    }
}

/// Connects as the runtime does, through the settings' TLS.
async fn connect(url: &str) -> Result<Client, String> {
    let mut settings = Settings::default();
    settings.database.url = url.into();
    let config = settings.pg_config().map_err(|e| e.to_string())?;
    let tls = rabbit_inbox::internal::pg_tls(&settings).map_err(|e| e.to_string())?;
    let (client, connection) = config.connect(tls).await.map_err(|e| chain(&e))?;
    tokio::spawn(connection);
    Ok(client)
}

/// An error with every cause under it, as a reader of a log needs it.
fn chain(error: &dyn std::error::Error) -> String {
    let mut text = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        text.push_str(&format!(": {cause}"));
        source = cause.source();
    }
    text
}

/// A database of this test's own on the TLS-only server, made afresh.
async fn database(servers: &Servers, name: &str) -> Client {
    let admin = connect(&servers.verified("postgres")).await.unwrap();
    for sql in [
        format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"),
        format!("CREATE DATABASE {name}"),
    ] {
        admin.batch_execute(&sql).await.unwrap();
    }
    let client = connect(&servers.verified(name)).await.unwrap();
    client
        .batch_execute("CREATE TABLE counts (key bigint PRIMARY KEY, n bigint NOT NULL)")
        .await
        .unwrap();
    client
}

async fn drop_database(servers: &Servers, name: &str) {
    let admin = connect(&servers.verified("postgres")).await.unwrap();
    admin
        .batch_execute(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .await
        .unwrap();
}

/// Counts the event, and forwards it through the outbox to `to`.
struct CountAndForward {
    to: String,
}

impl EventHandler<Counted> for CountAndForward {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, "counts", event.key).await?;
        uow.publish(&self.to, &Message::new(event.clone())).await?;
        Ok(())
    }
}

async fn start_error(settings: Settings) -> String {
    match Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
    {
        Ok(runtime) => {
            runtime.shutdown().await;
            panic!("the runtime started")
        }
        Err(e) => e.to_string(),
    }
}

#[actix_rt::test]
async fn verify_full_consumes_records_and_forwards_over_tls_on_both_connections() {
    let servers = servers();
    let name = "inbox_tls_end_to_end";
    let db = database(servers, name).await;
    let suffix = uuid::Uuid::now_v7();
    let (queue, forwarded) = (
        format!("test.tls.{suffix}"),
        format!("test.tls.{suffix}.forwarded"),
    );
    let mut settings = Settings::default();
    settings.database.url = servers.verified(name);
    settings.message_bus.amqp_urls = vec![servers.amqps_url("localhost", "")];
    settings.queues = vec![QueueSettings::new(&queue)];
    let connection = rabbit_inbox::tools::connect(&settings, "tls test").await.unwrap();
    let channel = connection.create_channel().await.unwrap();
    let options = QueueDeclareOptions {
        durable: true,
        ..QueueDeclareOptions::default()
    };
    channel
        .queue_declare(forwarded.as_str().into(), options, FieldTable::default())
        .await
        .unwrap();
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(CountAndForward {
            to: forwarded.clone(),
        })
        .start()
        .await
        .unwrap();
    // Each message twice, as a redelivery would bring it: processed once.
    let publisher = runtime.publisher();
    for key in 0..5 {
        let message = Message::new(Counted { key });
        publisher.publish(&queue, &message).await.unwrap();
        publisher.publish(&queue, &message).await.unwrap();
    }
    let waiting = |queue: String| {
        let channel = channel.clone();
        async move {
            let passive = QueueDeclareOptions {
                passive: true,
                ..QueueDeclareOptions::default()
            };
            let declared = channel
                .queue_declare(queue.as_str().into(), passive, FieldTable::default())
                .await
                .unwrap();
            declared.message_count()
        }
    };
    wait_until("both copies of every message settled", || async {
        waiting(queue.clone()).await == 0
            && db
                .query_one("SELECT count(*) FROM counts", &[])
                .await
                .unwrap()
                .get::<_, i64>(0)
                == 5
    })
    .await;
    wait_until("a follow-up per message forwarded", || async {
        waiting(forwarded.clone()).await >= 5
    })
    .await;
    runtime.shutdown().await;
    let counted: i64 = db
        .query_one("SELECT sum(n)::bigint FROM counts", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(counted, 5, "each message processed once, its duplicate skipped");
    assert_eq!(
        waiting(forwarded.clone()).await,
        5,
        "one follow-up per message, not per copy"
    );
    let inbox: i64 = db
        .query_one("SELECT count(*) FROM inbox_messages", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(inbox, 5);
    // What the runtime's sessions were: the pool's, the outbox's LISTEN
    // and the migrations' all encrypted (pg_stat_ssl has a row per
    // backend; the test's own connection is among them, verified too).
    let row = db
        .query_one(
            "SELECT count(*), count(*) FILTER (WHERE s.ssl) FROM pg_stat_activity a \
             JOIN pg_stat_ssl s USING (pid) WHERE a.datname = $1",
            &[&name],
        )
        .await
        .unwrap();
    let (sessions, encrypted): (i64, i64) = (row.get(0), row.get(1));
    assert!(
        sessions >= 1 && sessions == encrypted,
        "{encrypted} of {sessions} sessions encrypted"
    );

    delete_queues(&channel, &[queue, forwarded]).await;
    connection.close(200, "done".into()).await.unwrap();
    drop(db);
    drop_database(servers, name).await;
}

/// Deletes `queues` and the queues the runtime keeps beside each.
async fn delete_queues(channel: &rabbit_inbox::tools::lapin::Channel, queues: &[String]) {
    for queue in queues {
        let kept = [".error", ".skipped", ".retry.1", ".retry.2", ".retry.3"];
        for name in std::iter::once(queue.clone()).chain(kept.iter().map(|k| format!("{queue}{k}"))) {
            let _ = channel
                .queue_delete(name.as_str().into(), QueueDeleteOptions::default())
                .await;
        }
    }
}

/// A certificate the client must refuse fails the start at once, naming
/// the server and the reason, with no attempt after the first and no
/// secret in the error or the log.
async fn refused(settings: Settings, endpoint: &str, reason: &str) {
    let logs = Captured::default();
    let _capturing = logs.install();
    let error = start_error(settings).await;
    let text = logs.text();
    assert!(error.contains(endpoint) && error.contains(reason), "{error}");
    assert!(
        !text.contains("trying again"),
        "not retried as an outage:\n{text}"
    );
    for secret in ["s3cret", "guest:guest"] {
        assert!(
            !error.contains(secret) && !text.contains(secret),
            "{error}\n{text}"
        );
    }
}

fn with(database_url: String, amqp_url: String) -> Settings {
    let mut settings = Settings::default();
    settings.database.url = database_url;
    settings.database.connect_timeout = Duration::from_secs(20);
    settings.message_bus.amqp_urls = vec![amqp_url];
    settings.message_bus.connect_timeout = Duration::from_secs(20);
    settings.queues = vec![QueueSettings::new(format!("test.tls.{}", uuid::Uuid::now_v7()))];
    settings
}

#[actix_rt::test]
async fn postgresql_certificates_that_fail_verification_fail_the_start_with_the_reason() {
    let servers = servers();
    let amqps = servers.amqps_url("localhost", "");
    let ca = servers.cert("ca.pem");
    let other_ca = servers.cert("other-ca.pem");
    let port = servers.pg_port;
    // A CA that did not sign the server's certificate.
    let url = servers.pg_url(
        "localhost",
        port,
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={other_ca}"),
    );
    refused(
        with(url, amqps.clone()),
        &format!("localhost:{port}"),
        "not signed by a trusted CA",
    )
    .await;
    // The right CA, but the certificate names `localhost`, not 127.0.0.1.
    let url = servers.pg_url(
        "127.0.0.1",
        port,
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    refused(
        with(url, amqps.clone()),
        &format!("127.0.0.1:{port}"),
        "host name mismatch",
    )
    .await;
    // An expired certificate of the right CA.
    let expired = servers.expired_pg_port;
    let url = servers.pg_url(
        "localhost",
        expired,
        "postgres",
        &format!("sslmode=verify-full&sslrootcert={ca}"),
    );
    refused(with(url, amqps), &format!("localhost:{expired}"), "has expired").await;
}

#[actix_rt::test]
async fn verify_ca_checks_the_chain_but_not_the_name() {
    let servers = servers();
    let ca = servers.cert("ca.pem");
    let url = servers.pg_url(
        "127.0.0.1",
        servers.pg_port,
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={ca}"),
    );
    let client = connect(&url).await.unwrap();
    let ssl: bool = client
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0);
    assert!(ssl);
    let url = servers.pg_url(
        "127.0.0.1",
        servers.pg_port,
        "postgres",
        &format!("sslmode=verify-ca&sslrootcert={}", servers.cert("other-ca.pem")),
    );
    let error = connect(&url).await.map(drop).unwrap_err();
    assert!(error.contains("UnknownIssuer"), "{error}");
}

#[actix_rt::test]
async fn clear_text_to_a_tls_only_postgresql_is_refused_with_the_servers_words() {
    let servers = servers();
    let url = servers.pg_url("localhost", servers.pg_port, "postgres", "sslmode=disable");
    let error = start_error(with(url, servers.amqps_url("localhost", ""))).await;
    assert!(
        error.contains(&format!("localhost:{}", servers.pg_port)) && error.contains("no encryption"),
        "{error}"
    );
    assert!(
        error.contains("sslmode"),
        "the error says which setting to change: {error}"
    );
    assert!(!error.contains("s3cret"), "{error}");
}

#[actix_rt::test]
async fn a_client_certificate_logs_in_to_postgresql_and_to_rabbitmq() {
    let servers = servers();
    let (ca, cert, key) = (
        servers.cert("ca.pem"),
        servers.cert("client.pem"),
        servers.cert("client.key"),
    );
    // PostgreSQL: the role tls_client logs in by certificate only.
    let url = format!(
        "postgres://tls_client@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}&sslcert={cert}&sslkey={key}",
        servers.pg_port
    );
    let client = connect(&url).await.unwrap();
    let user: String = client
        .query_one("SELECT current_user::text", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(user, "tls_client");
    let without = format!(
        "postgres://tls_client@localhost:{}/postgres?sslmode=verify-full&sslrootcert={ca}",
        servers.pg_port
    );
    let error = connect(&without).await.map(drop).unwrap_err();
    assert!(error.contains("certificate"), "{error}");

    // RabbitMQ: EXTERNAL, the user named by the certificate's CN.
    let mut settings = Settings::default();
    settings.message_bus.amqp_urls = vec![format!(
        "amqps://localhost:{}/%2f?auth_mechanism=external&cacertfile={ca}",
        servers.amqp_port
    )];
    settings.message_bus.tls_cert_file = Some(cert);
    settings.message_bus.tls_key_file = Some(key);
    let connection = rabbit_inbox::tools::connect(&settings, "tls external")
        .await
        .unwrap();
    assert!(connection.status().connected());
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn broker_certificates_that_fail_verification_fail_the_start_with_the_reason() {
    let servers = servers();
    let db = servers.verified("postgres");
    let port = servers.amqp_port;
    // The node's certificate names `localhost`, not 127.0.0.1 ...
    refused(
        with(db.clone(), servers.amqps_url("127.0.0.1", "")),
        &format!("127.0.0.1:{port}"),
        "host name mismatch",
    )
    .await;
    // ... unless the name to verify is given.
    let mut settings = Settings::default();
    settings.message_bus.amqp_urls =
        vec![servers.amqps_url("127.0.0.1", "&server_name_indication=localhost")];
    let connection = rabbit_inbox::tools::connect(&settings, "tls sni").await.unwrap();
    connection.close(200, "done".into()).await.unwrap();
    // A CA that did not sign it, from the settings rather than the URL.
    let mut settings = with(db, format!("amqps://guest:s3cret@localhost:{port}/%2f"));
    settings.message_bus.tls_ca_file = Some(servers.cert("other-ca.pem"));
    refused(
        settings,
        &format!("localhost:{port}"),
        "not signed by a trusted CA",
    )
    .await;
}

#[test]
fn the_example_service_runs_on_tls_only_servers() {
    let servers = servers();
    let name = "inbox_tls_example";
    let system = actix_rt::System::new();
    system.block_on(async {
        database(servers, name).await;
    });
    let queue = format!("test.tls.example.{}", uuid::Uuid::now_v7());
    let mut child = Command::new(crate::support::checkin_service())
        .args(["--queue", &queue])
        .current_dir(crate::support::REPOSITORY)
        .env("INBOX__DATABASE__URL", servers.verified(name))
        .env(
            "INBOX__MESSAGE_BUS__AMQP_URLS",
            servers.amqps_url("localhost", ""),
        )
        .env("NO_COLOR", "1")
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let (consumes, log) = crate::support::consumes(&mut child);
    let _ = child.kill();
    let _ = child.wait();
    assert!(consumes, "{log}");
    assert!(!log.contains("s3cret"), "{log}");
    system.block_on(async {
        let mut settings = Settings::default();
        settings.message_bus.amqp_urls = vec![servers.amqps_url("localhost", "")];
        let connection = rabbit_inbox::tools::connect(&settings, "tls test").await.unwrap();
        let channel = connection.create_channel().await.unwrap();
        delete_queues(&channel, &[queue]).await;
        drop_database(servers, name).await;
    });
}

/// Whether `pool`'s connection is encrypted, as the server sees it.
async fn encrypted(pool: &rabbit_inbox::tools::deadpool_postgres::Pool) -> bool {
    pool.get()
        .await
        .unwrap()
        .query_one("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()", &[])
        .await
        .unwrap()
        .get(0)
}

/// Where `sslmode` is unset and the database is on this machine, the
/// connection is clear text (TLS there protects nothing and costs the
/// server CPU on every message), unless the server refuses clear text:
/// then TLS. A URL that says `sslmode` gets what it says.
#[actix_rt::test]
async fn a_loopback_database_without_sslmode_is_clear_text_unless_it_takes_tls_only() {
    let env = crate::support::TestEnv::new("tls_loopback").await;
    let mut settings = env.settings();
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    assert!(!encrypted(&pool).await, "clear text on loopback");

    let server_offers_tls: String = pool
        .get()
        .await
        .unwrap()
        .query_one("SHOW ssl", &[])
        .await
        .unwrap()
        .get(0);
    let separator = if settings.database.url.contains('?') {
        '&'
    } else {
        '?'
    };
    settings.database.url = format!("{}{separator}sslmode=prefer", settings.database.url);
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    assert_eq!(
        encrypted(&pool).await,
        server_offers_tls == "on",
        "sslmode=prefer said: TLS where the server offers it"
    );

    // The TLS-only server, on this machine too, no sslmode.
    let servers = servers();
    let mut settings = Settings::default();
    settings.database.url = format!("postgres://postgres@localhost:{}/postgres", servers.pg_port);
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    assert!(encrypted(&pool).await, "TLS where clear text is refused");
    // A second connection, opened while the first is held, goes straight
    // to TLS.
    let _held = pool.get().await.unwrap();
    assert!(encrypted(&pool).await, "and for the next connection");
}
