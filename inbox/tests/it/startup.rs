//! The first hour: a broker or database that is down at start, errors that
//! say why and where, settings found on purpose.

use std::time::{Duration, Instant};

use rabbit_inbox::Runtime;
use rabbit_inbox::tools::AmqpPublisher;
use rabbit_inbox::tools::lapin::ExchangeKind;
use rabbit_inbox::tools::lapin::options::ExchangeDeclareOptions;
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::{Message, Settings};

use crate::support::{Captured, Count, Counted, TestEnv, Valid, amqp, declare, wait_until};

/// A port on loopback where nothing listens.
fn closed_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

async fn start_error(settings: Settings) -> String {
    match Runtime::builder(settings.valid()).handler(Count).start().await {
        Ok(_) => panic!("the runtime started"),
        Err(e) => e.to_string(),
    }
}

#[actix_rt::test]
async fn a_broker_down_at_start_is_retried_then_an_error_naming_it() {
    let env = TestEnv::new("broker_down").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    let port = closed_port();
    settings.message_bus.amqp_urls = vec![format!("amqp://guest:s3cret@127.0.0.1:{port}/%2f")];
    settings.message_bus.connect_timeout = Duration::from_secs(2);
    let started = Instant::now();
    let error = start_error(settings).await;
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    let endpoint = format!("127.0.0.1:{port}");
    assert!(error.contains(&endpoint), "{error}");
    assert!(error.contains("message_bus.connect_timeout"), "{error}");
    let text = logs.text();
    let attempts = text
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("cannot connect to the broker") && l.contains(&endpoint))
        .count();
    assert!(attempts >= 2, "a WARN per failed attempt:\n{text}");
    assert!(
        !text.contains("s3cret") && !error.contains("s3cret"),
        "{error}\n{text}"
    );
}

#[actix_rt::test]
async fn with_several_brokers_a_node_that_is_down_is_passed_over_for_the_next() {
    let env = TestEnv::new("broker_list").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    let port = closed_port();
    let live = settings.message_bus.amqp_urls[0].clone();
    // Three times the dead node: whichever node the rotation starts at, the
    // runtime's connections (its consumer, publisher and outbox) meet it
    // before the live one.
    let dead = format!("amqp://guest:s3cret@127.0.0.1:{port}/%2f");
    settings.message_bus.amqp_urls = vec![dead.clone(), dead.clone(), dead, live];
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    runtime
        .publisher()
        .publish(&env.queue, &rabbit_inbox::Message::new(Counted { key: 1 }))
        .await
        .unwrap();
    wait_until("the message completes", || async {
        runtime.stats().completed == 1
    })
    .await;
    runtime.shutdown().await;
    let text = logs.text();
    let endpoint = format!("127.0.0.1:{port}");
    assert!(
        text.lines()
            .any(|l| l.contains("WARN") && l.contains(&endpoint) && l.contains("trying the next node")),
        "the dead node is logged by host and port:\n{text}"
    );
    assert!(!text.contains("s3cret"), "{text}");
    assert_eq!(env.count("counts", 1).await, 1);
}

#[test]
fn a_broker_list_with_a_bad_url_is_an_error_naming_its_place() {
    let mut settings = Settings::default();
    settings.message_bus.amqp_urls = vec!["amqp://127.0.0.1:5672/%2f".into(), "http://nope".into()];
    let error = settings.validate().unwrap_err().to_string();
    assert!(error.contains("message_bus.amqp_urls[1]"), "{error}");
}

#[actix_rt::test]
async fn a_database_down_at_start_is_retried_then_an_error_naming_it() {
    let env = TestEnv::new("database_down").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    let port = closed_port();
    settings.database.url = format!("postgres://postgres:s3cret@127.0.0.1:{port}/{}", env.database);
    settings.database.connect_timeout = Duration::from_secs(1);
    let error = start_error(settings).await;
    let endpoint = format!("127.0.0.1:{port}/{}", env.database);
    assert!(error.contains(&endpoint), "{error}");
    assert!(error.contains("database.connect_timeout"), "{error}");
    assert!(error.contains("refused"), "the cause is kept: {error}");
    let text = logs.text();
    assert!(
        text.contains("cannot connect to the database") && text.contains(&endpoint),
        "{text}"
    );
    assert!(
        !text.contains("s3cret") && !error.contains("s3cret"),
        "{error}\n{text}"
    );
}

#[actix_rt::test]
async fn a_database_that_does_not_exist_is_one_error_in_the_servers_words() {
    let env = TestEnv::new("database_missing").await;
    let mut settings = env.settings();
    settings
        .database
        .set_dbname("inbox_test_no_such_database")
        .unwrap();
    let started = Instant::now();
    let error = start_error(settings).await;
    assert!(
        error.contains(r#"database "inbox_test_no_such_database" does not exist"#),
        "{error}"
    );
    assert!(error.contains("127.0.0.1:5432"), "{error}");
    // Not an outage: no point waiting for it.
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "{:?}",
        started.elapsed()
    );
}

#[actix_rt::test]
async fn the_settings_files_read_are_logged_and_a_folder_without_any_warns() {
    let logs = Captured::default();
    let _capturing = logs.install();
    let dir = std::env::temp_dir().join(format!("inbox-startup-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    rabbit_inbox::internal::load_settings(&dir, None).unwrap();
    assert!(logs.text().contains("no settings file found"), "{}", logs.text());
    std::fs::write(dir.join("default.toml"), "[[queues]]\nname = \"orders\"\n").unwrap();
    let settings = rabbit_inbox::internal::load_settings(&dir, None).unwrap();
    assert_eq!(settings.queues[0].name, "orders");
    let text = logs.text();
    assert!(
        text.contains("settings loaded") && text.contains(&dir.join("default.toml").display().to_string()),
        "{text}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[actix_rt::test]
async fn a_settings_file_of_an_earlier_version_is_refused_naming_its_old_key() {
    let dir = std::env::temp_dir().join(format!("inbox-startup-{}", uuid::Uuid::now_v7()));
    std::fs::create_dir_all(&dir).unwrap();
    // As the default.toml of earlier versions had it: one broker.
    std::fs::write(
        dir.join("default.toml"),
        "[message_bus]\namqp_url = \"amqp://guest:guest@rabbit:5672/%2f\"\n",
    )
    .unwrap();
    let error = rabbit_inbox::internal::load_settings(&dir, None)
        .unwrap_err()
        .to_string();
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(
        error.contains("unknown field `amqp_url`") && error.contains("message_bus"),
        "{error}"
    );
}

#[actix_rt::test]
async fn a_broker_runtime_that_consumes_nothing_says_so() {
    let env = TestEnv::new("consumes_nothing").await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    settings.queues.clear();
    let runtime = Runtime::builder(settings.valid()).start().await.unwrap();
    runtime.shutdown().await;
    assert!(logs.text().contains("no queue to consume"), "{}", logs.text());
}

#[actix_rt::test]
async fn the_exchange_is_declared_at_start_and_one_of_another_type_is_an_error_naming_it() {
    let env = TestEnv::new("exchange_declared").await;
    let mut settings = env.settings();
    let exchange = format!("{}.events", env.queue);
    settings.message_bus.exchange = exchange.clone();
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    runtime.shutdown().await;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let passive = ExchangeDeclareOptions {
        passive: true,
        ..ExchangeDeclareOptions::default()
    };
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            passive,
            FieldTable::default(),
        )
        .await
        .expect("the start declared the exchange");
    channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await
        .unwrap();

    // Someone else declared it as a direct exchange.
    let channel = connection.create_channel().await.unwrap();
    channel
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Direct,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    let error = start_error(settings).await;
    assert!(error.contains(&format!("exchange `{exchange}`")), "{error}");
    assert!(error.contains("inequivalent arg 'type'"), "{error}");
    channel
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await
        .unwrap();
}

#[actix_rt::test]
async fn a_publish_the_broker_refuses_with_a_channel_error_does_not_stop_the_next_ones() {
    let env = TestEnv::new("publisher_recovers").await;
    declare(&env.settings()).await;
    let connection = amqp().await;
    let exchange = format!("{}.late", env.queue);
    let publisher = AmqpPublisher::new(&connection, exchange.clone()).await.unwrap();
    let message = Message::new(Counted { key: 1 });
    // The exchange does not exist yet: the broker closes the channel.
    let error = publisher.publish(&env.queue, &message).await.unwrap_err();
    assert!(error.to_string().contains("NOT_FOUND"), "{error}");
    let setup = connection.create_channel().await.unwrap();
    setup
        .exchange_declare(
            exchange.as_str().into(),
            ExchangeKind::Topic,
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    setup
        .queue_bind(
            env.queue.as_str().into(),
            exchange.as_str().into(),
            env.queue.as_str().into(),
            Default::default(),
            FieldTable::default(),
        )
        .await
        .unwrap();
    for _ in 0..2 {
        publisher.publish(&env.queue, &message).await.unwrap();
    }
    wait_until("both arrive", || async { env.ready(&env.queue).await == 2 }).await;
    setup
        .exchange_delete(exchange.as_str().into(), Default::default())
        .await
        .unwrap();
}

#[actix_rt::test]
async fn the_example_takes_amqp_url_for_one_broker_and_keeps_a_listed_cluster() {
    let env = TestEnv::new("conventional_amqp_url").await;
    let dead = format!("amqp://guest:guest@127.0.0.1:{}/%2f", closed_port());
    let live = crate::support::amqp_url();
    // (the settings' list, AMQP_URL): each start works only if the rule
    // holds, since the other URL leads nowhere.
    let cases = [
        (vec![dead.clone()], live.clone()),
        (vec![live.clone(), live.clone()], dead.clone()),
    ];
    for (listed, conventional) in cases {
        let mut service = std::process::Command::new(crate::support::checkin_service())
            .args(["--queue", &env.queue])
            .current_dir(crate::support::REPOSITORY)
            .env(
                "INBOX__DATABASE__URL",
                crate::support::database_url_of(&env.database),
            )
            .env("INBOX__MESSAGE_BUS__AMQP_URLS", listed.join(","))
            .env("INBOX__MESSAGE_BUS__CONNECT_TIMEOUT", "3s")
            .env("AMQP_URL", &conventional)
            .env("NO_COLOR", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        let (started, log) = crate::support::consumes(&mut service);
        let _ = service.kill();
        let _ = service.wait();
        assert!(
            started,
            "amqp_urls {listed:?}, AMQP_URL {conventional}: the service did not start\n{log}"
        );
    }
}

#[actix_rt::test]
async fn the_example_runs_on_the_database_url_names_and_never_drops_it() {
    // DATABASE_URL names the test's database: the service uses it as it
    // is, and `--remove` leaves it, since it is not the service's own.
    let env = TestEnv::new("conventional_database").await;
    let example = |args: &[&str]| {
        let mut command = std::process::Command::new(crate::support::checkin_service());
        command
            .args(["--queue", &env.queue])
            .args(args)
            .current_dir(crate::support::REPOSITORY)
            .env("DATABASE_URL", crate::support::database_url_of(&env.database))
            .env("NO_COLOR", "1")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::null());
        command
    };
    let mut service = example(&[]).spawn().unwrap();
    let (started, log) = crate::support::consumes(&mut service);
    let _ = service.kill();
    let _ = service.wait();
    assert!(started, "the service did not start\n{log}");
    let kept = example(&["--remove"]).output().unwrap();
    assert!(kept.status.success(), "--remove: {kept:?}");
    let still_there: i64 = env
        .db()
        .await
        .query_one(
            "SELECT count(*) FROM pg_database WHERE datname = $1",
            &[&env.database],
        )
        .await
        .unwrap()
        .get(0);
    assert_eq!(still_there, 1, "--remove dropped the database DATABASE_URL names");
    let kept_said = String::from_utf8_lossy(&kept.stdout);
    assert!(!kept_said.contains("dropped database"), "{kept_said}");
}
