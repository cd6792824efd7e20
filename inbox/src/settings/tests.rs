//! The settings' unit tests: layering, validation, redaction.

use std::collections::HashMap;
use std::path::Path;

use super::load::config_dir;
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

/// Group commit is the default, and a small prefetch needs no batch size
/// of its own: a batch never holds more than the deliveries in flight.
#[test]
fn batches_are_the_default_and_never_hold_more_than_prefetch() {
    for (prefetch, batch_size, limit, in_flight) in [
        (32, None, 16, 2),
        (16, None, 16, 1),
        (1, None, 1, 1),
        (4, None, 4, 1),
        (8, Some(9), 8, 1),
        (16, Some(1), 1, 16),
    ] {
        let mut text = format!("[[queues]]\nname = \"a\"\nprefetch = {prefetch}\n");
        if let Some(size) = batch_size {
            text.push_str(&format!("batch_size = {size}\n"));
        }
        let dir = temp_dir(&[("default.toml", &text)]);
        let settings = Settings::load_layered(&dir, None, vars(&[])).unwrap();
        let queue = &settings.queues[0];
        assert_eq!(
            queue.batch_limit(),
            limit,
            "prefetch {prefetch}, batch_size {batch_size:?}"
        );
        assert_eq!(queue.prefetch / queue.batch_limit(), in_flight);
        std::fs::remove_dir_all(dir).unwrap();
    }
}

#[test]
fn the_shipped_default_file_matches_the_built_in_defaults() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../config");
    let loaded = Settings::load_layered(&dir, None, vars(&[])).unwrap();
    let built_in = Settings::default();
    assert_eq!(format!("{loaded:?}"), format!("{built_in:?}"));
}

#[test]
fn layers_apply_in_order_default_file_env_file_environment() {
    let dir = temp_dir(&[
        (
            "default.toml",
            "[database]\npool_size = 7\nurl = \"postgres://h/from_default\"\n[message_bus]\nprovider = \"in_process\"\n",
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
        settings.database.dbname().as_deref(),
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
        ("INBOX__RETENTION__BUSY_SHARE", "0", "retention.busy_share"),
        ("INBOX__RETENTION__BUSY_SHARE", "1e-300", "retention.busy_share"),
        ("INBOX__RETENTION__BUSY_SHARE", "1.5", "retention.busy_share"),
        (
            "INBOX__FAILURE__IMMEDIATE_RETRIES",
            "4294967295",
            "failure.immediate_retries",
        ),
        ("INBOX__DATABASE__URL", "mysql://nope", "database.url"),
        (
            "INBOX__MESSAGE_BUS__AMQP_URLS",
            "amqp://a,http://nope",
            "message_bus.amqp_urls[1]",
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
            "[[queues]]\nname = \"a\"\nprefetch = 100\nbatch_size = 65\n".to_string(),
            "queues[0].batch_size",
        ),
        (
            "[[queues]]\nname = \"a\"\nprefetch = 16\nbatch_size = 8\nconcurrent_batches = 3\n".to_string(),
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
fn the_immediate_retries_back_off_and_the_longest_path_adds_every_wait() {
    let failure = FailureSettings::default();
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
    settings.message_bus.amqp_urls = vec!["amqp://app:s3cret-bus@broker.internal:5673/prod".into()];
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
fn set_dbname_names_another_database_on_the_same_server() {
    let cases = [
        (
            "postgres://u:pw@h:5433/orders?sslmode=disable",
            "postgres://u:pw@h:5433/billing?sslmode=disable",
        ),
        ("postgres://h", "postgres://h/billing"),
        (
            "postgresql://h/?application_name=a",
            "postgresql://h/billing?application_name=a",
        ),
        (
            "postgres:///orders?host=/run/pg",
            "postgres:///billing?host=/run/pg",
        ),
        (
            "host=h user=u dbname=orders",
            "host=h user=u dbname=orders dbname='billing'",
        ),
    ];
    for (url, renamed) in cases {
        let mut database = DatabaseSettings {
            url: url.into(),
            ..Default::default()
        };
        database.set_dbname("billing").unwrap();
        assert_eq!(database.url, renamed);
        assert_eq!(database.dbname().as_deref(), Some("billing"), "{url}");
    }
    // Any name survives the trip, in either form.
    for url in ["postgres://h/x", "host=h"] {
        let mut database = DatabaseSettings {
            url: url.into(),
            ..Default::default()
        };
        database.set_dbname("a b/c?'\\é").unwrap();
        assert_eq!(database.dbname().as_deref(), Some("a b/c?'\\é"), "{url}");
    }
    let mut database = DatabaseSettings {
        url: "mysql://nope".into(),
        ..Default::default()
    };
    let error = database.set_dbname("x").unwrap_err().to_string();
    assert!(error.contains("database.url"), "{error}");
}

#[test]
fn the_spellings_of_earlier_versions_are_refused_by_name() {
    // `message_bus.amqp_url` (now `amqp_urls`) and `database.name` (now the
    // url's path): an unknown key stops the start, named, rather than
    // leave a service on the defaults.
    let dir = temp_dir(&[]);
    for (var, key) in [
        ("INBOX__MESSAGE_BUS__AMQP_URL", "amqp_url"),
        ("INBOX__DATABASE__NAME", "name"),
    ] {
        let err = Settings::load_layered(&dir, None, vars(&[(var, "x")])).unwrap_err();
        assert!(
            err.to_string().contains(&format!("unknown field `{key}`")),
            "{var}: `{err}`"
        );
    }
    let dir = temp_dir(&[("default.toml", "[database]\nname = \"billing\"\n")]);
    let err = Settings::load_layered(&dir, None, vars(&[])).unwrap_err();
    assert!(err.to_string().contains("unknown field `name`"), "{err}");
}

#[test]
fn a_settings_file_may_name_one_broker_as_a_string() {
    let dir = temp_dir(&[("default.toml", "[message_bus]\namqp_urls = \"amqp://d:5672\"\n")]);
    let settings = Settings::load_layered(&dir, None, vars(&[])).unwrap();
    assert_eq!(settings.message_bus.amqp_urls, ["amqp://d:5672"]);
}

#[test]
fn an_empty_broker_list_is_an_error_naming_it() {
    let mut settings = Settings::default();
    settings.message_bus.amqp_urls.clear();
    let error = settings.validate().unwrap_err().to_string();
    assert!(error.contains("message_bus.amqp_urls"), "{error}");
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

#[test]
fn libpq_tls_parameters_are_read_from_a_url_and_from_key_value() {
    use super::tls::{PgTls, SslMode};
    let (rest, tls) = PgTls::split(
        "postgres://app@db.example.com:5432/orders?sslmode=verify-full&application_name=a\
         &sslrootcert=/etc/ca%20dir/ca.pem&sslcert=/c.pem&sslkey=/c.key",
    )
    .unwrap();
    assert_eq!(
        rest,
        "postgres://app@db.example.com:5432/orders?application_name=a"
    );
    assert_eq!(tls.mode, SslMode::VerifyFull);
    assert_eq!(tls.root_cert.as_deref(), Some("/etc/ca dir/ca.pem"));
    assert_eq!(
        (tls.cert.as_deref(), tls.key.as_deref()),
        (Some("/c.pem"), Some("/c.key"))
    );

    let unbalanced = PgTls::split("host=db password='open sslmode=verify-ca");
    assert!(unbalanced.is_err(), "unbalanced quotes are refused");
    let (rest, tls) = PgTls::split(
        "host=db user=app password='a b\\'c' sslmode = verify-ca sslrootcert='/my ca.pem' dbname=orders",
    )
    .unwrap();
    assert_eq!(rest, "host='db' user='app' password='a b\\'c' dbname='orders'");
    assert_eq!(tls.mode, SslMode::VerifyCa);
    assert_eq!(tls.root_cert.as_deref(), Some("/my ca.pem"));
    let config: tokio_postgres::Config = rest.parse().unwrap();
    assert_eq!(config.get_password(), Some(&b"a b'c"[..]));

    // No sslmode: libpq's default, prefer.
    let (rest, tls) = PgTls::split("postgres://h/db").unwrap();
    assert_eq!((rest.as_str(), tls.mode), ("postgres://h/db", SslMode::Prefer));
    let error = PgTls::split("postgres://h/db?sslmode=allow")
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("database.url") && error.contains("allow"),
        "{error}"
    );
}

#[test]
fn sslmode_decides_what_is_required_and_what_is_verified() {
    use crate::tls::{Roots, Verify};
    use tokio_postgres::config::SslMode as Wire;
    let settings = |url: &str| {
        let mut settings = Settings::default();
        settings.database.url = url.into();
        settings
    };
    let wire = |url: &str| settings(url).pg_config().unwrap().get_ssl_mode();
    assert_eq!(wire("postgres://h/db?sslmode=disable"), Wire::Disable);
    assert_eq!(wire("postgres://h/db"), Wire::Prefer);
    assert_eq!(wire("postgres://h/db?sslmode=require"), Wire::Require);
    assert_eq!(wire("postgres://h/db?sslmode=verify-ca"), Wire::Require);
    assert_eq!(
        wire("postgres://h/db?sslmode=verify-full&sslrootcert=/ca.pem"),
        Wire::Require
    );

    let verify = |url: &str| super::tls::PgTls::split(url).unwrap().1.verify();
    let file = |path: &str| Roots::File {
        path: path.into(),
        setting: "database.url (sslrootcert)".into(),
    };
    assert_eq!(verify("postgres://h/db?sslmode=prefer"), Verify::Nothing);
    assert_eq!(verify("postgres://h/db?sslmode=require"), Verify::Nothing);
    // libpq: require with a root certificate verifies the chain.
    assert_eq!(
        verify("postgres://h/db?sslmode=require&sslrootcert=/ca.pem"),
        Verify::ChainOnly(file("/ca.pem"))
    );
    assert_eq!(
        verify("postgres://h/db?sslmode=verify-ca"),
        Verify::ChainOnly(Roots::System)
    );
    assert_eq!(
        verify("postgres://h/db?sslmode=verify-full&sslrootcert=system"),
        Verify::Full(Roots::System)
    );
    assert_eq!(
        verify("postgres://h/db?sslmode=verify-full&sslrootcert=/ca.pem"),
        Verify::Full(file("/ca.pem"))
    );
    // Renaming the database keeps the TLS parameters.
    let mut db = settings("postgres://h/db?sslmode=verify-full&sslrootcert=/ca.pem").database;
    db.set_dbname("other").unwrap();
    assert_eq!(
        db.url,
        "postgres://h/other?sslmode=verify-full&sslrootcert=/ca.pem"
    );
    assert_eq!(db.dbname().as_deref(), Some("other"));
}

#[test]
fn a_missing_ca_file_fails_naming_the_parameter_and_the_path() {
    let mut settings = Settings::default();
    settings.database.url = "postgres://h/db?sslmode=verify-full&sslrootcert=/nowhere/ca.pem".into();
    let error = settings.pg_tls().map(drop).unwrap_err().to_string();
    assert!(
        error.contains("sslrootcert") && error.contains("/nowhere/ca.pem"),
        "{error}"
    );
    settings.database.url = "postgres://h/db?sslcert=/c.pem".into();
    let error = settings.pg_tls().map(drop).unwrap_err().to_string();
    assert!(error.contains("sslkey"), "{error}");
}

#[test]
fn the_tls_parameters_of_rabbitmqs_uri_spec_win_over_the_settings() {
    use super::{BrokerTls, without_amqp_tls_params};
    use crate::tls::{Roots, Verify};
    let mut bus = MessageBusSettings {
        tls_ca_file: Some("/settings/ca.pem".into()),
        tls_server_name: Some("rabbit.internal".into()),
        ..MessageBusSettings::default()
    };
    let url = "amqps://u:p@10.0.0.5:5671/%2f?heartbeat=10&cacertfile=%2Furl%2Fca.pem&certfile=/c.pem&keyfile=/c.key";
    let tls = BrokerTls::of(url, 0, &bus).unwrap();
    assert_eq!(
        tls.verify(),
        Verify::Full(Roots::File {
            path: "/url/ca.pem".into(),
            setting: "message_bus.amqp_urls[0] (cacertfile)".into()
        })
    );
    assert_eq!(tls.server_name.as_deref(), Some("rabbit.internal"));
    assert!(tls.identity().unwrap().is_some());
    assert_eq!(
        without_amqp_tls_params(url),
        "amqps://u:p@10.0.0.5:5671/%2f?heartbeat=10"
    );
    let tls = BrokerTls::of("amqps://h?server_name_indication=rabbit-1.internal", 1, &bus).unwrap();
    assert_eq!(tls.server_name.as_deref(), Some("rabbit-1.internal"));
    let error = BrokerTls::of("amqps://h?verify=verify_none", 0, &bus)
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("verify_none") && error.contains("amqp_urls[0]"),
        "{error}"
    );
    bus.tls_ca_file = None;
    bus.tls_cert_file = Some("/c.pem".into());
    let error = BrokerTls::of("amqps://h", 0, &bus)
        .unwrap()
        .identity()
        .unwrap_err()
        .to_string();
    assert!(
        error.contains("tls_cert_file") && error.contains("tls_key_file"),
        "{error}"
    );
}

#[test]
fn passwords_apart_from_the_urls_come_from_a_value_or_a_file_never_both() {
    let dir = std::env::temp_dir().join(format!("inbox-secret-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("password");
    std::fs::write(&file, "from-file s3cret\n").unwrap();
    let mut settings = Settings::default();
    settings.database.url = "postgres://app:in-url@db/orders".into();
    settings.database.password_file = Some(file.display().to_string());
    let config = settings.pg_config().unwrap();
    assert_eq!(config.get_password(), Some(&b"from-file s3cret"[..]));
    settings.database.password = Some("from-env".into());
    let error = settings.pg_config().unwrap_err().to_string();
    assert!(
        error.contains("database.password") && error.contains("database.password_file"),
        "{error}"
    );
    assert!(
        !error.contains("s3cret") && !error.contains("from-env"),
        "{error}"
    );
    settings.database.password_file = None;
    assert_eq!(
        settings.pg_config().unwrap().get_password(),
        Some(&b"from-env"[..])
    );

    settings.message_bus.password = Some("bus-s3cret".into());
    settings.message_bus.password_file = Some("/run/secrets/amqp".into());
    let shown = format!("{settings:?}");
    assert!(
        !shown.contains("s3cret") && !shown.contains("from-env"),
        "{shown}"
    );
    assert!(shown.contains("/run/secrets/amqp"), "{shown}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn quoted_and_spaced_passwords_are_redacted_too() {
    assert_eq!(
        redact("host=db password = 'a s3cret \\' here' dbname=orders"),
        "host=db password = *** dbname=orders"
    );
    assert_eq!(redact("host=db sslpassword=s3cret"), "host=db sslpassword=***");
}

#[test]
fn remote_connections_that_verify_nothing_are_named_at_start() {
    let mut settings = Settings::default();
    assert!(
        settings.insecure_connections().is_empty(),
        "loopback is not warned about"
    );
    settings.database.url = "postgres://app:s3cret@db.example.com/orders".into();
    settings.message_bus.amqp_urls = vec![
        "amqp://u:s3cret@rabbit.example.com".into(),
        "amqps://u:s3cret@rabbit.example.com".into(),
    ];
    let said = settings.insecure_connections();
    assert_eq!(said.len(), 2, "{said:?}");
    assert!(
        said[0].contains("sslmode=prefer") && said[0].contains("verify-full"),
        "{said:?}"
    );
    assert!(
        said[1].contains("amqp://") && said[1].contains("amqps://"),
        "{said:?}"
    );
    assert!(!format!("{said:?}").contains("s3cret"));
    settings.database.url = "postgres://db.example.com/orders?sslmode=verify-full".into();
    settings.message_bus.amqp_urls.truncate(0);
    assert!(settings.insecure_connections().is_empty());
}

/// The keys `config/default.toml` names, set or shown commented out, with
/// the value of those it sets: `section.key` (`queues[].key` for the
/// commented `[[queues]]` entry).
fn keys_of_the_default_file(text: &str) -> Vec<(String, Option<String>)> {
    let mut section = String::new();
    let mut keys = Vec::new();
    for line in text.lines() {
        let (commented, line) = match line.strip_prefix("# ") {
            Some(rest) => (true, rest),
            None => (false, line),
        };
        if let Some(name) = line.strip_prefix("[[").and_then(|l| l.strip_suffix("]]")) {
            section = format!("{name}[]");
        } else if let Some(name) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            section = name.to_owned();
        } else if let Some((key, value)) = line.split_once(" = ")
            && !key.is_empty()
            && key.chars().all(|c| c.is_ascii_lowercase() || c == '_')
        {
            keys.push((format!("{section}.{key}"), (!commented).then(|| value.to_owned())));
        }
    }
    keys
}

/// The rows of docs/operations.md's settings table: key and default.
fn rows_of_the_settings_table(text: &str) -> Vec<(String, String)> {
    text.lines()
        .filter_map(|line| {
            let mut cells = line.strip_prefix("| `")?.split(" | ");
            let key = cells.next()?.strip_suffix('`')?;
            let default = cells.next()?;
            key.contains('.').then(|| (key.to_owned(), default.to_owned()))
        })
        .collect()
}

/// The settings table users read and the file the runtime ships cannot
/// drift apart: the same keys, and the same defaults where the file sets
/// them.
#[test]
fn the_operations_settings_table_and_the_default_file_agree() {
    let file = keys_of_the_default_file(include_str!("../../../config/default.toml"));
    let table = rows_of_the_settings_table(include_str!("../../../docs/operations.md"));
    assert!(
        file.len() > 40 && table.len() > 40,
        "{} keys, {} rows",
        file.len(),
        table.len()
    );
    // Quotes aside: the table shows `rabbitmq` for the file's "rabbitmq".
    let plain = |value: &str| value.replace(['"', '`'], "");
    for (key, value) in &file {
        let row = table.iter().find(|(name, _)| name == key);
        let Some((_, default)) = row else {
            panic!("docs/operations.md's settings table has no row for `{key}`");
        };
        if let Some(value) = value {
            assert_eq!(plain(default), plain(value), "the default of `{key}`");
        }
    }
    for (key, _) in &table {
        assert!(
            file.iter().any(|(name, _)| name == key),
            "config/default.toml does not show `{key}`, which docs/operations.md lists"
        );
    }
}

#[test]
fn a_queue_changes_the_failure_policy_key_by_key_and_a_bad_key_is_named_under_it() {
    let dir = temp_dir(&[(
        "default.toml",
        "[failure]\nimmediate_retries = 5\n\n[[queues]]\nname = \"payments\"\n\n\
         [[queues]]\nname = \"notifications\"\n[queues.failure]\ndelays = []\nimmediate_retries = 0\n",
    )]);
    let settings = Settings::load_layered(&dir, None, vars(&[])).unwrap();
    let payments = settings.queues[0].failure_policy(&settings.failure);
    let notifications = settings.queues[1].failure_policy(&settings.failure);
    assert_eq!((payments.immediate_retries, payments.delays.len()), (5, 3));
    assert_eq!(
        (notifications.immediate_retries, notifications.delays.len()),
        (0, 0)
    );
    assert_eq!(notifications.max_body_size, settings.failure.max_body_size);

    let dir = temp_dir(&[(
        "default.toml",
        "[[queues]]\nname = \"a\"\n[queues.failure]\ndelays = [\"1s\", \"0s\"]\n",
    )]);
    let err = Settings::load_layered(&dir, None, vars(&[])).unwrap_err();
    assert!(err.to_string().contains("queues[0].failure.delays[1]"), "{err}");

    // The longest path of any queue bounds retention.
    let dir = temp_dir(&[(
        "default.toml",
        "[retention]\ndays = 1\n[[queues]]\nname = \"a\"\n[queues.failure]\ndelays = [\"25h\"]\n",
    )]);
    let err = Settings::load_layered(&dir, None, vars(&[])).unwrap_err();
    assert!(err.to_string().contains("queues[0].failure.delays"), "{err}");
}

#[test]
fn only_a_database_on_this_machine_with_no_tls_asked_for_tries_clear_text_first() {
    let clear_first = |url: &str| {
        let mut settings = Settings::default();
        settings.database.url = url.into();
        settings.pg_clear_text_first()
    };
    for url in [
        "postgres://app@127.0.0.1/orders",
        "postgres://app@localhost:5433/orders",
        "postgres://app@[::1]/orders",
        "host=127.0.0.1 user=app dbname=orders",
    ] {
        assert!(clear_first(url), "{url}");
    }
    for url in [
        "postgres://app@127.0.0.1/orders?sslmode=prefer",
        "postgres://app@127.0.0.1/orders?sslrootcert=/ca.pem",
        "postgres://app@localhost/orders?sslcert=/c.pem&sslkey=/c.key",
        "postgres://app@db.example.com/orders",
        "postgres://app@127.0.0.1:5432,db2:5432/orders",
        "host=db.example.com user=app",
    ] {
        assert!(!clear_first(url), "{url}");
    }
}
