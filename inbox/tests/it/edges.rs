//! Edges where one message, one row or one slow handler could stall, leak
//! or poison others, and two replicas starting together could race.

use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::internal::fault::headers;
use rabbit_inbox::tools::error_queue;
use rabbit_inbox::tools::lapin::BasicProperties;
use rabbit_inbox::tools::lapin::types::{AMQPValue, FieldTable};
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::outbox::with_forward_queue;
use crate::support::{
    Counted, TestEnv, Valid, checkin_service, consumes, header, increment, publish_keys, rabbitmqctl,
    start_service, wait_until,
};

/// Stages a row as another process could: any exchange, any headers.
async fn stage_row(env: &TestEnv, exchange: &str, routing_key: &str, headers: &str, key: i64) {
    let body = serde_json::to_vec(&Counted { key }).unwrap();
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
             VALUES (gen_random_uuid(), $1, $2, 'Counted', $3::text::jsonb, $4)",
            &[&exchange, &routing_key, &headers, &body],
        )
        .await
        .unwrap();
}

/// Rows parked as dead, with their last errors.
async fn parked(env: &TestEnv) -> Vec<String> {
    env.db()
        .await
        .query(
            "SELECT last_error FROM outbox_messages WHERE dead_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<_, Option<String>>(0).unwrap_or_default())
        .collect()
}

/// A runtime that only counts, on `settings`, with the inbox's tables made
/// before rows are staged by hand.
async fn counting(settings: rabbit_inbox::Settings) -> Runtime {
    Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap()
}

#[actix_rt::test]
async fn an_outbox_row_with_a_header_key_past_255_bytes_is_parked_alone_and_the_rest_flow() {
    let (env, forward) = with_forward_queue("edge_long_header_key").await;
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    // First in its round: before the fix, building its properties panicked
    // the round, every round, and nothing behind it left.
    let long_key = serde_json::json!({ "k".repeat(300): "v" }).to_string();
    stage_row(&env, "", &forward, &long_key, 0).await;
    for key in 1..=3 {
        stage_row(&env, "", &forward, "{}", key).await;
    }
    let runtime = counting(env.settings()).await;
    wait_until("the three others arrive and the row is parked", || async {
        env.ready(&forward).await == 3 && parked(&env).await.len() == 1
    })
    .await;
    runtime.shutdown().await;
    let reasons = parked(&env).await;
    assert!(reasons[0].contains("header key"), "{reasons:?}");
}

#[actix_rt::test]
async fn an_outbox_row_with_headers_that_are_not_strings_goes_with_its_strings_and_a_warn() {
    let (env, forward) = with_forward_queue("edge_header_values").await;
    let logs = crate::support::Captured::default();
    let _capturing = logs.install();
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    // Staging writes strings only; another process may write anything.
    let written = r#"{"correlation_id": "c-1", "retries": 3, "nested": {"k": "v"}}"#;
    stage_row(&env, "", &forward, written, 0).await;
    let runtime = counting(env.settings()).await;
    wait_until("the row arrives", || async { env.ready(&forward).await == 1 }).await;
    runtime.shutdown().await;
    let delivery = env.take(&forward).await.expect("the row's message");
    assert_eq!(header(&delivery, "correlation_id").as_deref(), Some("c-1"));
    assert_eq!(header(&delivery, "retries"), None);
    assert_eq!(header(&delivery, "nested"), None);
    assert!(parked(&env).await.is_empty());
    let text = logs.text();
    assert!(
        text.lines().any(|line| line.contains("WARN")
            && line.contains("not strings")
            && line.contains("retries")
            && line.contains("nested")),
        "{text}"
    );
}

#[actix_rt::test]
async fn an_outbox_row_whose_headers_encode_past_a_frame_is_parked_at_once_not_retried_as_an_outage() {
    let (env, forward) = with_forward_queue("edge_frame_size").await;
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    // 12,000 empty headers with 5-byte keys: 60,000 bytes of keys and
    // values, under the old 64 KiB guard; 132,004 bytes encoded, past
    // RabbitMQ's 131,072-byte frame, which closed the connection.
    let many: serde_json::Map<String, serde_json::Value> =
        (0..12_000).map(|i| (format!("{i:05}"), "".into())).collect();
    stage_row(
        &env,
        "",
        &forward,
        &serde_json::Value::Object(many).to_string(),
        0,
    )
    .await;
    for key in 1..=3 {
        stage_row(&env, "", &forward, "{}", key).await;
    }
    let mut settings = env.settings();
    // Parked at once, not after its attempts: no attempt can succeed.
    settings.outbox.max_attempts = 10;
    let runtime = counting(settings).await;
    wait_until("the three others arrive and the row is parked", || async {
        env.ready(&forward).await == 3 && parked(&env).await.len() == 1
    })
    .await;
    runtime.shutdown().await;
    let reasons = parked(&env).await;
    assert!(reasons[0].contains("encoded"), "{reasons:?}");
    assert_eq!(env.ready(&forward).await, 3, "each of the others once");
}

#[actix_rt::test]
async fn a_row_that_closes_the_channel_is_charged_alone_and_its_round_mates_leave() {
    let (env, forward) = with_forward_queue("edge_poisoned_round").await;
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    // First of ten in one round: a missing exchange closes the channel
    // (404), failing every confirm in flight with it.
    stage_row(&env, "inbox.test.no-such-exchange", &forward, "{}", 0).await;
    for key in 1..=9 {
        stage_row(&env, "", &forward, "{}", key).await;
    }
    let mut settings = env.settings();
    settings.outbox.max_attempts = 3;
    settings.outbox.retry_backoff = Duration::from_millis(50);
    let runtime = counting(settings).await;
    wait_until("the bad row is parked after its three attempts", || async {
        !parked(&env).await.is_empty()
    })
    .await;
    wait_until("the nine others arrive", || async {
        env.ready(&forward).await >= 9
    })
    .await;
    runtime.shutdown().await;
    let reasons = parked(&env).await;
    assert_eq!(
        reasons.len(),
        1,
        "only the row that closed the channel: {reasons:?}"
    );
    assert!(reasons[0].contains("no-such-exchange"), "{reasons:?}");
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox_messages").await,
        1,
        "the nine were sent and deleted"
    );
}

#[actix_rt::test]
async fn a_body_past_max_message_size_is_refused_at_staging_and_parked_at_dispatch() {
    let (env, forward) = with_forward_queue("edge_body_size").await;
    let mut settings = env.settings();
    settings.message_bus.max_message_size = 1_000;
    let runtime = counting(settings).await;
    let mut uow = runtime.unit_of_work().await.unwrap();
    #[derive(serde::Serialize, serde::Deserialize)]
    struct Large {
        text: String,
    }
    impl rabbit_inbox::IntegrationEvent for Large {
        const TYPE: &'static str = "Large";
    }
    let large = Message::new(Large {
        text: "x".repeat(2_000),
    });
    let refused = uow.publish(&forward, &large).await.unwrap_err().to_string();
    assert!(refused.contains("message_bus.max_message_size"), "{refused}");
    uow.rollback().await.unwrap();
    // Staged by another process that allows more: parked at dispatch.
    let body = serde_json::to_vec(&Large {
        text: "x".repeat(2_000),
    })
    .unwrap();
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body)
             VALUES (gen_random_uuid(), '', $1, 'Large', $2)",
            &[&forward, &body],
        )
        .await
        .unwrap();
    wait_until("the large row is parked", || async {
        parked(&env).await.len() == 1
    })
    .await;
    runtime.shutdown().await;
    let reasons = parked(&env).await;
    assert!(reasons[0].contains("max_message_size"), "{reasons:?}");
    assert_eq!(env.ready(&forward).await, 0);
}

#[actix_rt::test]
async fn returned_rows_are_matched_by_message_id_never_by_confirm_order() {
    let (mut env, forward) = with_forward_queue("edge_returns").await;
    let nowhere = env.another_queue("nowhere");
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    // Unroutable and routable rows in rounds of 1,000, interleaved: the
    // returns of the first and the quorum queue's confirms of the second
    // arrive mixed, several completed by one `multiple` ack.
    let rows: i64 = 3_000;
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body)
             SELECT gen_random_uuid(), '', CASE WHEN k % 3 = 0 THEN $1 ELSE $2 END, 'Counted',
                    convert_to(json_build_object('key', k)::text, 'UTF8')
             FROM generate_series(0, $3::bigint - 1) AS k ORDER BY k",
            &[&nowhere, &forward, &rows],
        )
        .await
        .unwrap();
    let mut settings = env.settings();
    settings.outbox.max_attempts = 1;
    settings.outbox.batch_size = 1_000;
    let runtime = counting(settings).await;
    wait_until("every row is sent or parked", || async {
        env.scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NULL")
            .await
            == 0
    })
    .await;
    runtime.shutdown().await;
    let parked_keys: HashSet<i64> = env
        .db()
        .await
        .query(
            "SELECT convert_from(body, 'UTF8')::jsonb->>'key' FROM outbox_messages WHERE dead_at IS NOT NULL",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| row.get::<_, String>(0).parse().unwrap())
        .collect();
    let unroutable: HashSet<i64> = (0..rows).filter(|k| k % 3 == 0).collect();
    let lost: Vec<_> = unroutable.difference(&parked_keys).collect();
    let misread: Vec<_> = parked_keys.difference(&unroutable).collect();
    assert!(
        lost.is_empty() && misread.is_empty(),
        "read as taken: {lost:?}; read as returned: {misread:?}"
    );
    assert_eq!(
        i64::from(env.ready(&forward).await),
        rows / 3 * 2,
        "every routable row arrived once"
    );
}

/// Counts like `Count`, but never returns for key 7: a handler stuck on a
/// peer that answers nothing.
struct StuckOn7 {
    calls_for_7: Arc<AtomicUsize>,
}

impl EventHandler<Counted> for StuckOn7 {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key == 7 {
            self.calls_for_7.fetch_add(1, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_secs(3600)).await;
        }
        increment(uow, "counts", event.key).await
    }
}

#[actix_rt::test]
async fn a_handler_stuck_past_the_transaction_timeout_gives_its_connection_back() {
    let env = TestEnv::new("edge_stuck_handler").await;
    let mut settings = env.settings();
    settings.database.pool_size = 3;
    settings.database.transaction_timeout = Duration::from_secs(1);
    let calls_for_7 = Arc::new(AtomicUsize::new(0));
    let runtime = Runtime::builder(settings.valid())
        .handler(StuckOn7 {
            calls_for_7: Arc::clone(&calls_for_7),
        })
        .start()
        .await
        .unwrap();
    let health = runtime.monitor();
    publish_keys(&runtime, &env.queue, [7]).await;
    // Let it time out more often than the pool has connections: each
    // attempt used to keep one until its handler returned, an hour on.
    wait_until("key 7 has been tried four times", || async {
        calls_for_7.load(Ordering::SeqCst) >= 4
    })
    .await;
    publish_keys(&runtime, &env.queue, (20..30).collect::<Vec<_>>()).await;
    let blamed = std::cell::RefCell::new(Vec::new());
    wait_until("the ten others complete", || async {
        let ready = health.ready().await;
        blamed
            .borrow_mut()
            .extend(ready.reasons.into_iter().filter(|r| r.contains("database")));
        env.scalar("SELECT count(*) FROM counts WHERE key BETWEEN 20 AND 29")
            .await
            == 10
    })
    .await;
    runtime.shutdown().await;
    let blamed = blamed.into_inner();
    assert!(blamed.is_empty(), "readiness blamed the database: {blamed:?}");
}

#[actix_rt::test]
async fn a_message_whose_headers_fill_a_frame_reaches_the_error_queue_without_them() {
    let env = TestEnv::new("edge_move_past_frame").await;
    let runtime = counting(env.settings()).await;
    // Its properties come to 130,961 bytes encoded, within the frame
    // (131,072), so the broker delivers it; with the fault headers, a copy
    // would not fit, and the broker closed the consumer's connection at
    // every move, with the other messages' acks.
    let mut untrusted = FieldTable::default();
    untrusted.insert("note".into(), AMQPValue::LongString("n".repeat(130_900).into()));
    let properties = BasicProperties::default()
        .with_message_id(uuid::Uuid::now_v7().to_string().into())
        .with_type("Counted".into())
        .with_headers(untrusted);
    env.publish_raw(properties, b"not json").await;
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("the others complete and the bad one is set aside", || async {
        let s = runtime.stats();
        s.completed == 5 && s.rejected == 1
    })
    .await;
    runtime.shutdown().await;
    let copy = env
        .take(&error_queue(&env.queue))
        .await
        .expect("in the error queue");
    assert_eq!(copy.data, b"not json", "the body is kept");
    assert_eq!(header(&copy, "note"), None, "the untrusted header is dropped");
    let dropped = header(&copy, headers::DROPPED_HEADERS).expect("what was dropped is said");
    assert!(dropped.starts_with("1 headers dropped"), "{dropped}");
    assert!(header(&copy, headers::REASON).is_some_and(|r| r.contains("not a valid")));
}

/// `queue`'s messages delivered and not yet acked, as the broker counts.
async fn unacked(queue: &str) -> u64 {
    rabbitmqctl(&["-q", "list_queues", "name", "messages_unacknowledged"])
        .await
        .lines()
        .find_map(|line| {
            let (q, n) = line.split_once('\t')?;
            (q == queue).then(|| n.trim().parse().ok()).flatten()
        })
        .unwrap_or(0)
}

#[actix_rt::test]
async fn after_broker_outages_longer_than_the_connect_timeout_one_consumer_remains() {
    let env = TestEnv::new("edge_zombie_consumer").await;
    let mut settings = env.settings();
    let proxy = crate::proxy::broker_through_proxy(&mut settings).await;
    settings.message_bus.connect_timeout = Duration::from_secs(3);
    let runtime = counting(settings).await;
    // Its three connections (the queue's, the publisher's, the outbox's)
    // go through the proxy.
    let connections = proxy.open_connections();
    let published = Arc::new(AtomicUsize::new(0));
    // Steady publishing, straight to the broker (not through the proxy).
    let publishing = {
        let (queue, published) = (env.queue.clone(), Arc::clone(&published));
        actix_rt::spawn(async move {
            let connection = crate::support::amqp().await;
            let channel = connection.create_channel().await.unwrap();
            loop {
                let message = Message::new(Counted { key: 0 });
                let properties = BasicProperties::default()
                    .with_message_id(message.id.to_string().into())
                    .with_type("Counted".into());
                let body = message.to_json().unwrap();
                let sent = channel
                    .basic_publish(
                        "".into(),
                        queue.as_str().into(),
                        Default::default(),
                        &body,
                        properties,
                    )
                    .await;
                if sent.is_ok() {
                    published.fetch_add(1, Ordering::SeqCst);
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
    };
    for outage in 1..=3 {
        proxy.cut();
        // Longer than connect_timeout: the consumer's watchdog opens a new
        // connection while the broker is still away.
        tokio::time::sleep(Duration::from_secs(12)).await;
        proxy.restore();
        wait_until("the consumer consumes again", || async {
            runtime.monitor().ready().await.ok
        })
        .await;
        // Whatever was delivered on a second, unsettled link would stay
        // unacked for good.
        tokio::time::sleep(Duration::from_secs(3)).await;
        assert!(
            proxy.open_connections() <= connections,
            "{} connections after outage {outage}, {connections} before the first",
            proxy.open_connections()
        );
        assert_eq!(
            env.consumers(&env.queue).await,
            Some(1),
            "consumers after outage {outage}"
        );
    }
    publishing.abort();
    let sent = published.load(Ordering::SeqCst);
    wait_until("every message is settled", || async {
        unacked(&env.queue).await == 0 && env.ready(&env.queue).await == 0
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;
    // Every publish counted arrived; the one the abort cut off may have
    // reached the broker uncounted.
    let completed = stats.completed as usize;
    assert!(
        (sent..=sent + 1).contains(&completed),
        "{sent} published, {completed} completed: {stats:?}"
    );
}

#[actix_rt::test]
async fn two_services_started_together_on_a_fresh_database_both_start() {
    for round in 0..20 {
        let database = format!("inbox_test_edge_cold_start_{round}");
        let queue = format!("test.edge_cold_start.{}", uuid::Uuid::now_v7());
        let mut services = [
            start_service(&database, &queue, &[]),
            start_service(&database, &queue, &[]),
        ];
        let started: Vec<(bool, String)> = std::thread::scope(|scope| {
            let readers: Vec<_> = services.iter_mut().map(|s| scope.spawn(|| consumes(s))).collect();
            readers.into_iter().map(|r| r.join().unwrap()).collect()
        });
        for service in &mut services {
            let _ = service.kill();
            let _ = service.wait();
        }
        let removed = std::process::Command::new(checkin_service())
            .args(["--remove", "--queue", &queue])
            .current_dir(crate::support::REPOSITORY)
            .env("INBOX__DATABASE__URL", crate::support::database_url_of(&database))
            .output()
            .unwrap();
        assert!(removed.status.success(), "--remove: {removed:?}");
        // Fresh again for the next run.
        let said = String::from_utf8_lossy(&removed.stdout);
        assert!(said.contains(&format!("dropped database {database}")), "{said}");
        for (started, log) in started {
            assert!(started, "round {round}: a service did not start:\n{log}");
        }
    }
}

/// How long the migration tests wait for each other's lock: the default.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(600);

#[actix_rt::test]
async fn service_migrations_run_by_four_instances_at_once_are_applied_once() {
    let env = TestEnv::new("edge_migrate_together").await;
    // No IF NOT EXISTS: without the lock, all but one would fail each round.
    let schema = [
        rabbit_inbox::Migration::new(1, "orders", "CREATE TABLE orders (id bigint PRIMARY KEY)"),
        rabbit_inbox::Migration::new(2, "orders_total", "ALTER TABLE orders ADD COLUMN total bigint"),
    ];
    for round in 0..20 {
        let mut clients = Vec::new();
        for _ in 0..4 {
            clients.push(env.db().await);
        }
        let results = futures_util::future::join_all(
            clients
                .iter_mut()
                .map(|client| rabbit_inbox::tools::migrate(client, false, &schema, LOCK_WAIT)),
        )
        .await;
        for result in results {
            assert!(result.is_ok(), "round {round}: {result:?}");
        }
        assert_eq!(
            env.scalar("SELECT count(*) FROM inbox_service_migrations").await,
            2
        );
        env.db()
            .await
            .batch_execute("DROP TABLE orders, inbox_service_migrations")
            .await
            .unwrap();
    }
    // A version applied under one name and listed under another is refused.
    let mut client = env.db().await;
    rabbit_inbox::tools::migrate(&mut client, false, &schema, LOCK_WAIT)
        .await
        .unwrap();
    let renamed = [rabbit_inbox::Migration::new(
        1,
        "customers",
        "CREATE TABLE customers ()",
    )];
    let refused = rabbit_inbox::tools::migrate(&mut client, false, &renamed, LOCK_WAIT)
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("never be reused"), "{refused}");
}
