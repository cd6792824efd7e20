//! Operability: health (live, ready, with reasons) through a database
//! outage, a lost broker connection and a shutdown; the metrics a
//! Prometheus recorder sees.

use std::sync::OnceLock;
use std::time::Duration;

use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusHandle};
use rabbit_inbox::Runtime;
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::proxy::{Proxy, broker_through_proxy, database_through_proxy};
use crate::support::{
    Captured, Count, Counted, TestEnv, Valid, database_url_of, increment, publish_keys, wait_until,
};

#[actix_rt::test]
async fn ready_once_consuming_and_no_longer_while_draining_live_all_along() {
    let env = TestEnv::new("health_lifecycle").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let monitor = runtime.monitor();
    assert!(runtime.health().await.live.ok);
    wait_until("ready once consuming", || async { monitor.ready().await.ok }).await;
    let consuming = monitor.health().await;
    assert_eq!(consuming.ready.reasons, Vec::<String>::new());
    assert!(consuming.live.ok);

    runtime.shutdown().await;
    let stopped = monitor.ready().await;
    assert!(!stopped.ok);
    assert!(
        stopped.reasons.iter().any(|r| r.contains("draining")),
        "{stopped:?}"
    );
}

/// Starts a runtime over `settings`, waits until it is ready, cuts the
/// proxy, and checks that it turns unready, for reasons that `expected`
/// accepts, but stays live; then that it is ready again once the proxy is
/// restored.
async fn unready_while_cut_and_live_all_along(
    settings: rabbit_inbox::Settings,
    proxy: &Proxy,
    expected: impl Fn(&[String]) -> bool,
) {
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    wait_until("ready", || async { runtime.health().await.ready.ok }).await;

    proxy.cut();
    wait_until("unready while the service is away", || async {
        !runtime.health().await.ready.ok
    })
    .await;
    let away = runtime.health().await;
    assert!(away.live.ok, "live must not fail for an outage: {away:?}");
    assert!(expected(&away.ready.reasons), "{away:?}");

    proxy.restore();
    wait_until("ready again", || async { runtime.health().await.ready.ok }).await;
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_database_outage_makes_it_unready_but_never_unlive() {
    let env = TestEnv::new("health_database").await;
    let mut settings = env.settings();
    let proxy = database_through_proxy(&mut settings).await;
    unready_while_cut_and_live_all_along(settings, &proxy, |reasons| {
        reasons == ["the database is unavailable"]
    })
    .await;
}

#[actix_rt::test]
async fn a_database_outage_is_logged_by_the_outbox_dispatcher_when_it_starts_and_ends() {
    let env = TestEnv::new("outbox_outage_log").await;
    let mut settings = env.settings();
    let proxy = database_through_proxy(&mut settings).await;
    // A drain at every poll: thirty or so fail during the outage.
    settings.outbox.poll_interval = Duration::from_millis(100);
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    let logs = Captured::default();
    let _capturing = logs.install();
    proxy.cut();
    tokio::time::sleep(Duration::from_secs(3)).await;
    proxy.restore();
    wait_until("the dispatcher says it works again", || async {
        logs.text().contains("outbox dispatch works again")
    })
    .await;
    runtime.shutdown().await;
    let text = logs.text();
    let failed = text.matches("outbox dispatch failed;").count();
    assert_eq!(failed, 1, "one WARN for the whole outage:\n{text}");
}

#[actix_rt::test]
async fn a_lost_broker_connection_makes_it_unready_until_the_consumer_is_back() {
    let env = TestEnv::new("health_broker").await;
    let mut settings = env.settings();
    let proxy = broker_through_proxy(&mut settings).await;
    unready_while_cut_and_live_all_along(settings, &proxy, |reasons| {
        reasons
            .iter()
            .any(|r| r.contains(&env.queue) && r.contains("not connected"))
    })
    .await;
}

/// The test binary's one Prometheus recorder: installed before any runtime
/// of these tests is built (other tests' runtimes may record into it too,
/// each under its own queue).
fn prometheus() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        PrometheusBuilder::new()
            .set_buckets(&[0.001, 0.01, 0.1, 1.0])
            .unwrap()
            .install_recorder()
            .unwrap()
    })
}

/// Counts, and fails key 7 every time.
struct CountButSeven;

impl EventHandler<Counted> for CountButSeven {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == 7 {
            return Err("seven always fails".into());
        }
        increment(uow, "counts", event.key).await
    }
}

/// The value of the sample `name{labels}` in `text`, if any.
fn sample(text: &str, name_and_labels: &str) -> Option<f64> {
    text.lines()
        .find_map(|line| line.strip_prefix(name_and_labels)?.trim().parse().ok())
}

#[actix_rt::test]
async fn the_metrics_count_each_outcome_by_queue_and_name_every_series() {
    let prometheus = prometheus();
    let env = TestEnv::new("metrics_outcomes").await;
    let mut settings = env.settings();
    // A claim per message, each timed, as counted below.
    settings.queues[0].batch_size = 1;
    settings.failure.immediate_retries = 1;
    settings.failure.immediate_backoff = Duration::from_millis(10);
    settings.failure.delays = Vec::new();
    let runtime = Runtime::builder(settings.valid())
        .handler(CountButSeven)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..10).await;
    // Two copies of one message: the second is a duplicate.
    let again = Message::new(Counted { key: 20 });
    for _ in 0..2 {
        runtime.publisher().publish(&env.queue, &again).await.unwrap();
    }
    wait_until("every message is settled", || async {
        let s = runtime.stats();
        s.completed == 10 && s.duplicates == 1 && s.dead_lettered == 1
    })
    .await;
    let text = prometheus.render();
    runtime.shutdown().await;

    let queue = &env.queue;
    let outcome = |outcome: &str| {
        sample(
            &text,
            &format!("inbox_messages_total{{queue=\"{queue}\",outcome=\"{outcome}\"}}"),
        )
    };
    assert_eq!(outcome("completed"), Some(10.0), "{text}");
    assert_eq!(outcome("duplicate"), Some(1.0), "{text}");
    assert_eq!(outcome("retried"), Some(1.0), "{text}");
    assert_eq!(outcome("dead_lettered"), Some(1.0), "{text}");
    assert_eq!(outcome("rejected"), Some(0.0), "{text}");
    assert_eq!(
        sample(
            &text,
            &format!("inbox_process_duration_seconds_count{{queue=\"{queue}\"}}")
        ),
        Some(11.0),
        "one per delivery acked after processing (completed or duplicate): {text}"
    );
    assert_eq!(
        sample(&text, &format!("inbox_in_flight{{queue=\"{queue}\"}}")),
        Some(0.0),
        "{text}"
    );
    assert_eq!(
        sample(&text, &format!("inbox_consumer_connected{{queue=\"{queue}\"}}")),
        Some(1.0),
        "{text}"
    );
    let claims = sample(
        &text,
        &format!("inbox_claim_wait_seconds_count{{queue=\"{queue}\"}}"),
    );
    assert!(claims.is_some_and(|n| n >= 12.0), "{text}");
    for name in [
        "inbox_handler_duration_seconds_bucket{event_type=\"Counted\"",
        "inbox_database_available ",
        "inbox_database_connection_limit ",
        "inbox_outbox_pending ",
        "inbox_outbox_oldest_pending_seconds ",
        "inbox_outbox_dispatched_total ",
        "inbox_outbox_dead ",
        "inbox_rows ",
        "inbox_oldest_row_seconds ",
        "inbox_swept_rows_total ",
    ] {
        assert!(
            text.lines().any(|line| line.starts_with(name)),
            "no {name} in:\n{text}"
        );
    }
}

/// Makes `role` (a login without superuser rights, so that its connection
/// limit holds) with the grants a service needs on `env`'s database and
/// at most `limit` connections at once.
async fn limited_role(env: &TestEnv, role: &str, limit: u32) -> rabbit_inbox::tokio_postgres::Client {
    let mut admin = env.db().await;
    rabbit_inbox::internal::run_migrations(&mut admin).await.unwrap();
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN CREATE ROLE {role} LOGIN; END IF;
             END $$;
             ALTER ROLE {role} CONNECTION LIMIT {limit};
             GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_messages, inbox_deliveries, outbox_messages, inbox_failures TO {role};
             GRANT USAGE ON SEQUENCE outbox_messages_seq_seq TO {role};
             GRANT SELECT, INSERT, UPDATE ON counts TO {role};"
        ))
        .await
        .unwrap();
    admin
}

/// `env`'s settings, connecting as `role`.
fn settings_as(env: &TestEnv, role: &str) -> rabbit_inbox::Settings {
    let mut settings = env.settings();
    let as_postgres = database_url_of(&env.database);
    settings.database.url = as_postgres.replacen("://postgres@", &format!("://{role}@"), 1);
    assert_ne!(
        settings.database.url, as_postgres,
        "DATABASE_URL names user postgres"
    );
    settings.database.run_migrations = false;
    settings
}

/// A pool larger than the connections the server grants (here the role's
/// connection limit, as a managed server's `max_connections` would be once
/// several instances share it): a message whose connection is refused
/// waits for one of the pool's, spends none of its attempts and is
/// processed once; none is retried or set aside, and the log says which
/// setting to change.
#[actix_rt::test]
async fn a_pool_larger_than_the_server_grants_waits_and_spends_no_attempt() {
    let env = TestEnv::new("pool_over_limit").await;
    let role = "inbox_test_pool_over_limit";
    let admin = limited_role(&env, role, 3).await;
    let logs = Captured::default();
    let _capturing = logs.install();
    let mut settings = settings_as(&env, role);
    settings.database.pool_size = 20;
    settings.queues[0].prefetch = 16;
    settings.queues[0].batch_size = 1;
    let runtime = Runtime::builder(settings.valid())
        .handler(Count)
        .start()
        .await
        .unwrap();
    publish_keys(&runtime, &env.queue, 0..200).await;
    wait_until("all complete", || async { runtime.stats().completed == 200 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(
        (stats.retried, stats.abandoned, stats.dead_lettered),
        (0, 0, 0),
        "{stats:?}"
    );
    let text = logs.text();
    assert!(
        text.contains("for want of slots (53300)")
            && text.contains("`database.pool_size`, times the instances"),
        "the limit was met and said so: {text}"
    );
    for key in 0..200 {
        assert_eq!(env.count("counts", key).await, 1, "key {key}");
    }
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .await
        .unwrap();
}

/// Counts, after a short pause holding its connection: the work of a
/// handler that calls out, which keeps connections busy long enough for
/// messages to wait for them (and the machine not, for the tests beside).
struct CountSlowly;

impl EventHandler<Counted> for CountSlowly {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        actix_rt::time::sleep(Duration::from_millis(5)).await;
        increment(uow, "counts", event.key).await
    }
}

/// The server's sessions of `role` now.
async fn sessions_of(admin: &rabbit_inbox::tokio_postgres::Client, role: &str) -> i64 {
    admin
        .query_one(
            "SELECT count(*) FROM pg_stat_activity WHERE usename = $1",
            &[&role],
        )
        .await
        .unwrap()
        .get(0)
}

/// The connection limit comes down where the server grants fewer
/// connections, and goes back up once it grants more: a service started
/// while other sessions held all but two of its role's connections (one
/// for the outbox's listener, one for the pool) gets all of them once
/// those sessions end, without a restart, and is ready throughout (full is
/// not away).
#[actix_rt::test]
async fn the_connection_limit_comes_down_when_refused_and_grows_back_when_the_server_has_room() {
    const LIMIT: i64 = 6;
    let env = TestEnv::new("pool_grows_back").await;
    let role = "inbox_test_pool_grows_back";
    let admin = limited_role(&env, role, LIMIT as u32).await;
    let settings = {
        let mut settings = settings_as(&env, role);
        settings.database.pool_size = 10;
        settings.queues[0].prefetch = 16;
        settings.queues[0].batch_size = 1;
        settings
    };
    let logs = Captured::default();
    let _capturing = logs.install();
    // Other sessions of the role hold all its connections but two: the
    // outbox's listener holds one of its own (LISTEN), and whichever of it
    // and the pool connects first would otherwise leave the other none.
    let mut others = Vec::new();
    for _ in 0..LIMIT - 2 {
        let config: rabbit_inbox::tokio_postgres::Config = settings.database.url.parse().unwrap();
        let (client, connection) = config.connect(rabbit_inbox::tokio_postgres::NoTls).await.unwrap();
        actix_rt::spawn(connection);
        others.push(client);
    }
    let runtime = Runtime::builder(settings.valid())
        .handler(CountSlowly)
        .start()
        .await
        .unwrap();
    let monitor = runtime.monitor();
    publish_keys(&runtime, &env.queue, 0..50).await;
    wait_until("the first 50 complete", || async {
        runtime.stats().completed == 50
    })
    .await;
    assert_eq!(
        sessions_of(&admin, role).await,
        LIMIT,
        "the role's connections all taken"
    );

    drop(others);
    let unready = std::cell::RefCell::new(Vec::new());
    let publishing = publish_keys(&runtime, &env.queue, 50..2_050);
    let growing = async {
        wait_until("the service holds every connection the role has", || async {
            let ready = monitor.ready().await;
            if !ready.ok {
                unready.borrow_mut().push(ready.reasons);
            }
            sessions_of(&admin, role).await == LIMIT
        })
        .await;
    };
    tokio::join!(publishing, growing);
    wait_until("all complete", || async { runtime.stats().completed == 2_050 }).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!(
        unready.into_inner(),
        Vec::<Vec<String>>::new(),
        "ready throughout"
    );
    let text = logs.text();
    assert!(
        text.contains("for want of slots (53300)"),
        "the limit came down: {text}"
    );
    assert!(
        !text.contains("database unavailable"),
        "full was taken for away: {text}"
    );
    assert_eq!(
        (stats.retried, stats.abandoned, stats.dead_lettered),
        (0, 0, 0),
        "{stats:?}"
    );
    let (rows, total): (i64, i64) = {
        let row = env
            .db()
            .await
            .query_one("SELECT count(*), sum(n)::bigint FROM counts", &[])
            .await
            .unwrap();
        (row.get(0), row.get(1))
    };
    assert_eq!((rows, total), (2_050, 2_050), "every message applied once");
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .await
        .unwrap();
}

/// A connection refused for want of slots is waited for like an outage
/// at start, and the error says which setting to change.
#[actix_rt::test]
async fn a_connection_refused_for_want_of_slots_names_pool_size() {
    let env = TestEnv::new("pool_no_slot").await;
    let role = "inbox_test_pool_no_slot";
    let admin = limited_role(&env, role, 1).await;
    let mut settings = settings_as(&env, role);
    settings.database.connect_timeout = Duration::from_secs(1);
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    let only = pool.get().await.unwrap();
    let Err(refused) = rabbit_inbox::tools::wait_for_database(&pool, &settings).await else {
        panic!("a second connection beyond the role's limit");
    };
    let refused = refused.to_string();
    assert!(refused.contains("53300"), "{refused}");
    assert!(
        refused.contains("`database.pool_size`, times the instances"),
        "{refused}"
    );
    drop((only, pool));
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .await
        .unwrap();
}
