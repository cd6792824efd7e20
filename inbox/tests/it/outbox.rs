//! The outbox: staged in the transaction, published after the commit, never
//! before and never for a rollback; an unsendable row parks without
//! blocking; two dispatchers never both send a row.

use std::collections::HashSet;
use std::time::Duration;

use rabbit_inbox::Runtime;
use rabbit_inbox::tools::lapin::options::BasicGetOptions;
use rabbit_inbox::tools::lapin::types::FieldTable;
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::support::{Counted, TestEnv, Valid, amqp, header, increment, publish_keys, wait_until};

/// Counts like `Count`, and stages one follow-up per event to `forward`
/// (key + 1000), in the same transaction; fails key 7 after staging.
struct CountAndForward {
    forward: String,
}

impl EventHandler<Counted> for CountAndForward {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        increment(uow, "counts", event.key).await?;
        uow.publish(
            &self.forward,
            &Message::new(Counted {
                key: event.key + 1000,
            }),
        )
        .await?;
        if event.key == 7 {
            return Err("fails after staging its follow-up".into());
        }
        Ok(())
    }
}

/// Declares `queue`, durable and quorum, as a receiving service would.
pub(crate) async fn declare_queue(queue: &str) {
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    rabbit_inbox::tools::declare_queue(&channel, queue, rabbit_inbox::QueueKind::Quorum)
        .await
        .unwrap();
    connection.close(200, "done".into()).await.unwrap();
}

/// A test environment with a queue for follow-ups (`forward`), declared
/// as a receiving service would, beside its own.
pub(crate) async fn with_forward_queue(name: &str) -> (TestEnv, String) {
    let mut env = TestEnv::new(name).await;
    let forward = env.another_queue("forward");
    declare_queue(&forward).await;
    (env, forward)
}

/// A runtime whose handler counts and forwards each event to `forward`.
async fn forwarding(settings: rabbit_inbox::Settings, forward: &str) -> Runtime {
    Runtime::builder(settings.valid())
        .handler(CountAndForward {
            forward: forward.to_owned(),
        })
        .start()
        .await
        .unwrap()
}

/// A runtime on `env`'s settings whose handler only counts.
async fn counting(env: &TestEnv) -> Runtime {
    Runtime::builder(env.settings().valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap()
}

/// Takes every message of `queue`: their `message_id`s and bodies' keys.
async fn drain(queue: &str) -> (Vec<String>, Vec<i64>) {
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let (mut ids, mut keys) = (Vec::new(), Vec::new());
    while let Some(message) = channel
        .basic_get(queue.into(), BasicGetOptions { no_ack: true })
        .await
        .unwrap()
    {
        let delivery = message.delivery;
        ids.push(
            delivery
                .properties
                .message_id()
                .as_ref()
                .unwrap()
                .as_str()
                .to_owned(),
        );
        let event: Counted = serde_json::from_slice(&delivery.data).unwrap();
        keys.push(event.key);
    }
    connection.close(200, "done".into()).await.unwrap();
    (ids, keys)
}

/// Stages a row as another process would: a plain session, no runtime.
async fn stage_from_another_session(env: &TestEnv, queue: &str, key: i64) {
    let body = serde_json::to_vec(&Counted { key }).unwrap();
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body)
             VALUES (gen_random_uuid(), '', $1, 'Counted', $2)",
            &[&queue, &body],
        )
        .await
        .unwrap();
}

/// Waits until every row has left `outbox_messages`.
async fn outbox_empties(env: &TestEnv) {
    wait_until("the outbox is empty", || async {
        env.scalar("SELECT count(*) FROM outbox_messages").await == 0
    })
    .await;
}

/// Whether a message is ready in `queue` within ten seconds.
async fn arrives_within_10s(env: &TestEnv, queue: &str) -> bool {
    tokio::time::timeout(Duration::from_secs(10), async {
        while env.ready(queue).await == 0 {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    })
    .await
    .is_ok()
}

/// Waits until as many messages as `keys` are ready in `forward`, stops
/// the runtime, and checks that exactly `keys` arrived, in that order.
async fn only_these_arrive(env: &TestEnv, runtime: Runtime, forward: &str, keys: &[i64]) {
    let expected = u32::try_from(keys.len()).unwrap();
    wait_until("the committed ones arrive", || async {
        env.ready(forward).await == expected
    })
    .await;
    runtime.shutdown().await;
    let (_, arrived) = drain(forward).await;
    assert_eq!(arrived, keys);
}

#[actix_rt::test]
async fn a_follow_up_staged_in_a_handler_leaves_after_its_commit_and_never_for_a_rollback() {
    let (env, forward) = with_forward_queue("outbox_forward").await;
    let mut settings = env.settings();
    settings.failure.delays = Vec::new();
    let runtime = forwarding(settings, &forward).await;
    publish_keys(&runtime, &env.queue, 0..10).await;
    wait_until("nine follow-ups arrive and key 7 is set aside", || async {
        runtime.stats().dead_lettered == 1 && env.ready(&forward).await == 9
    })
    .await;
    outbox_empties(&env).await;
    runtime.shutdown().await;
    let (ids, mut keys) = drain(&forward).await;
    keys.sort();
    let expected: Vec<i64> = (0..10).filter(|k| *k != 7).map(|k| k + 1000).collect();
    assert_eq!(
        keys, expected,
        "one follow-up per committed message, none for the failed one"
    );
    assert_eq!(
        ids.iter().collect::<HashSet<_>>().len(),
        9,
        "each with its own id"
    );
}

#[actix_rt::test]
async fn an_unroutable_row_is_parked_dead_after_its_attempts_and_the_others_flow() {
    let (mut env, forward) = with_forward_queue("outbox_dead").await;
    let mut settings = env.settings();
    settings.outbox.max_attempts = 2;
    settings.outbox.retry_backoff = Duration::from_millis(50);
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    let mut uow = runtime.unit_of_work().await.unwrap();
    let nowhere = env.another_queue("nowhere");
    uow.publish(&nowhere, &Message::new(Counted { key: 0 }))
        .await
        .unwrap();
    for key in 1..4 {
        uow.publish(&forward, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    uow.commit().await.unwrap();
    wait_until("the three routable ones arrive", || async {
        env.ready(&forward).await == 3
    })
    .await;
    wait_until("the unroutable one is parked", || async {
        env.scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    // The backlog is sampled every poll interval.
    wait_until("the backlog is sampled empty", || async {
        runtime.stats().outbox_pending == 0
    })
    .await;
    let stats = runtime.stats();
    assert_eq!(
        (stats.outbox_dispatched, stats.outbox_failed, stats.outbox_dead),
        (3, 2, 1),
        "{stats:?}"
    );
    let row = env
        .db()
        .await
        .query_one("SELECT attempts, last_error FROM outbox_messages", &[])
        .await
        .unwrap();
    let (attempts, error): (i32, String) = (row.get(0), row.get(1));
    assert_eq!(attempts, 2);
    assert!(error.contains("unroutable"), "{error}");

    // The cause is fixed: the queue exists now. The dead row gets another
    // round of attempts and leaves.
    declare_queue(&nowhere).await;
    let revived = rabbit_inbox::tools::retry_dead(runtime.pool(), None)
        .await
        .unwrap();
    assert_eq!(revived, 1);
    wait_until("the revived row arrives", || async {
        env.ready(&nowhere).await == 1
    })
    .await;
    outbox_empties(&env).await;
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_broker_outage_spends_no_attempt_of_the_rows_waiting_to_go() {
    let (env, forward) = with_forward_queue("outbox_outage").await;
    let mut settings = env.settings();
    let proxy = crate::proxy::broker_through_proxy(&mut settings).await;
    // Two failed publishes would park a row: rounds during the outage must
    // not count.
    settings.outbox.max_attempts = 2;
    settings.outbox.retry_backoff = Duration::from_millis(50);
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    proxy.cut();
    let mut uow = runtime.unit_of_work().await.unwrap();
    for key in 0..3 {
        uow.publish(&forward, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    uow.commit().await.unwrap();
    // Rounds fail meanwhile, one per connect timeout (2 s) and poll.
    tokio::time::sleep(Duration::from_secs(6)).await;
    let (attempts, dead) = (
        env.scalar("SELECT coalesce(max(attempts), 0)::bigint FROM outbox_messages")
            .await,
        env.scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL")
            .await,
    );
    let errors = env
        .db()
        .await
        .query("SELECT last_error FROM outbox_messages", &[])
        .await
        .unwrap()
        .iter()
        .map(|r| r.get::<_, Option<String>>(0))
        .collect::<Vec<_>>();
    assert_eq!(
        (attempts, dead),
        (0, 0),
        "attempts spent on an outage: {errors:?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox_messages").await, 3);
    proxy.restore();
    wait_until("the three arrive once the broker is back", || async {
        env.ready(&forward).await == 3
    })
    .await;
    outbox_empties(&env).await;
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn nothing_staged_leaves_before_the_commit_or_after_a_rollback() {
    let (env, forward) = with_forward_queue("outbox_commit").await;
    let runtime = counting(&env).await;
    let mut rolled_back = runtime.unit_of_work().await.unwrap();
    rolled_back
        .publish(&forward, &Message::new(Counted { key: 1 }))
        .await
        .unwrap();
    rolled_back.rollback().await.unwrap();
    let mut pending = runtime.unit_of_work().await.unwrap();
    pending
        .publish(&forward, &Message::new(Counted { key: 2 }))
        .await
        .unwrap();
    // Uncommitted for longer than a poll: nothing leaves.
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(env.ready(&forward).await, 0);
    pending.commit().await.unwrap();
    only_these_arrive(&env, runtime, &forward, &[2]).await;
}

/// Staged messages wait in the unit of work until its commit: a handler's
/// nested scope rolled back (or dropped unfinished) takes what it staged
/// with it; one released keeps it.
#[actix_rt::test]
async fn a_nested_scope_rolled_back_or_dropped_takes_its_staged_messages_with_it() {
    let (env, forward) = with_forward_queue("outbox_nested").await;
    let runtime = counting(&env).await;
    let stage = |key| Message::new(Counted { key });
    let mut uow = runtime.unit_of_work().await.unwrap();
    uow.publish(&forward, &stage(1)).await.unwrap();
    let mut rolled_back = uow.nested().await.unwrap();
    rolled_back.publish(&forward, &stage(2)).await.unwrap();
    rolled_back.rollback().await.unwrap();
    let mut dropped = uow.nested().await.unwrap();
    dropped.publish(&forward, &stage(3)).await.unwrap();
    drop(dropped);
    let mut released = uow.nested().await.unwrap();
    released.publish(&forward, &stage(4)).await.unwrap();
    let mut inner = released.nested().await.unwrap();
    inner.publish(&forward, &stage(5)).await.unwrap();
    inner.rollback().await.unwrap();
    released.release().await.unwrap();
    uow.publish(&forward, &stage(6)).await.unwrap();
    uow.commit().await.unwrap();
    only_these_arrive(&env, runtime, &forward, &[1, 4, 6]).await;
}

/// Starts a runtime, changes `outbox_messages` with `ddl`, then commits a
/// write with a follow-up to each of `routing_keys`: the commit must fail
/// and commit nothing. Returns the runtime and the commit's error.
async fn a_commit_refused_after(
    env: &TestEnv,
    ddl: &str,
    routing_keys: &[&str],
) -> (Runtime, rabbit_inbox::Error) {
    let runtime = counting(env).await;
    env.db().await.batch_execute(ddl).await.unwrap();
    let mut uow = runtime.unit_of_work().await.unwrap();
    increment(&mut uow, "counts", 1).await.unwrap();
    for (key, routing_key) in (1..).zip(routing_keys) {
        uow.publish(routing_key, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    // Not written yet: its own transaction does not see them.
    let seen: i64 = uow
        .client()
        .query_one("SELECT count(*) FROM outbox_messages", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(seen, 0);
    let refused = uow.commit().await.unwrap_err();
    assert_eq!(env.scalar("SELECT count(*) FROM counts").await, 0);
    assert_eq!(env.scalar("SELECT count(*) FROM outbox_messages").await, 0);
    (runtime, refused)
}

/// Staged rows are written with the COMMIT, in its request: a row the
/// database refuses fails the commit, and the transaction's other writes
/// do not commit either.
#[actix_rt::test]
async fn a_staged_row_the_database_refuses_fails_the_commit_and_nothing_commits() {
    let (env, forward) = with_forward_queue("outbox_refused_row").await;
    let (runtime, refused) = a_commit_refused_after(
        &env,
        "ALTER TABLE outbox_messages ADD CONSTRAINT refuse_one CHECK (routing_key <> 'refused')",
        &[&forward, "refused"],
    )
    .await;
    assert!(refused.to_string().contains("refuse_one"), "{refused}");
    // The runtime's connections still work: the next commit goes through.
    let mut uow = runtime.unit_of_work().await.unwrap();
    increment(&mut uow, "counts", 1).await.unwrap();
    uow.publish(&forward, &Message::new(Counted { key: 3 }))
        .await
        .unwrap();
    uow.commit().await.unwrap();
    only_these_arrive(&env, runtime, &forward, &[3]).await;
    assert_eq!(env.scalar("SELECT count(*) FROM counts").await, 1);
}

/// A staged row can also be refused before it leaves the process: a value
/// that no longer fits its column (the table changed under the runtime).
/// Then the COMMIT must not go alone.
#[actix_rt::test]
async fn a_staged_row_refused_before_it_is_sent_lets_nothing_commit() {
    let (env, forward) = with_forward_queue("outbox_unsendable_row").await;
    let (runtime, refused) = a_commit_refused_after(
        &env,
        "ALTER TABLE outbox_messages ALTER COLUMN message_id TYPE text",
        &[&forward],
    )
    .await;
    assert!(
        rabbit_inbox::internal::describe(&refused).contains("uuid"),
        "{refused}"
    );
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn two_runtimes_dispatching_from_one_database_send_each_row_once() {
    let (env, forward) = with_forward_queue("outbox_two_dispatchers").await;
    let mut settings = env.settings();
    settings.outbox.batch_size = 10;
    let first = Runtime::builder(settings.clone().valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    let second = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    for chunk in 0..20 {
        let runtime = if chunk % 2 == 0 { &first } else { &second };
        let mut uow = runtime.unit_of_work().await.unwrap();
        for key in chunk * 10..chunk * 10 + 10 {
            uow.publish(&forward, &Message::new(Counted { key }))
                .await
                .unwrap();
        }
        uow.commit().await.unwrap();
    }
    outbox_empties(&env).await;
    first.shutdown().await;
    second.shutdown().await;
    let (ids, _) = drain(&forward).await;
    assert_eq!(ids.len(), 200, "no row sent by both");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), 200);
}

#[actix_rt::test]
async fn in_a_batch_a_message_rolled_back_to_its_savepoint_takes_its_follow_up_with_it() {
    let (env, forward) = with_forward_queue("outbox_batch").await;
    let mut settings = crate::batching::batching(&env);
    settings.failure.delays = Vec::new();
    crate::batching::prefill_keys(&settings, 0..16).await;
    let runtime = forwarding(settings, &forward).await;
    wait_until("fifteen follow-ups arrive and key 7 is set aside", || async {
        runtime.stats().dead_lettered == 1 && env.ready(&forward).await == 15
    })
    .await;
    let stats = runtime.stats();
    runtime.shutdown().await;
    assert!(stats.batches_split >= 1, "{stats:?}");
    let (_, mut keys) = drain(&forward).await;
    keys.sort();
    let expected: Vec<i64> = (0..16).filter(|k| *k != 7).map(|k| k + 1000).collect();
    assert_eq!(keys, expected);
}

#[actix_rt::test]
async fn a_follow_up_carries_the_correlation_id_and_its_cause() {
    let (env, forward) = with_forward_queue("outbox_headers").await;
    let runtime = forwarding(env.settings(), &forward).await;
    let (first, second) = (uuid::Uuid::now_v7(), uuid::Uuid::now_v7());
    let mut flow = FieldTable::default();
    flow.insert(
        rabbit_inbox::internal::CORRELATION_ID.into(),
        rabbit_inbox::tools::lapin::types::AMQPValue::LongString("flow-1".into()),
    );
    let with = |id: uuid::Uuid, headers: FieldTable| {
        rabbit_inbox::tools::lapin::BasicProperties::default()
            .with_message_id(id.to_string().into())
            .with_type("Counted".into())
            .with_headers(headers)
    };
    env.publish_raw(with(first, flow), br#"{"key": 1}"#).await;
    env.publish_raw(with(second, FieldTable::default()), br#"{"key": 2}"#)
        .await;
    wait_until("both follow-ups arrive", || async {
        env.ready(&forward).await == 2
    })
    .await;
    runtime.shutdown().await;
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    for _ in 0..2 {
        let copy = channel
            .basic_get(forward.as_str().into(), BasicGetOptions { no_ack: true })
            .await
            .unwrap()
            .unwrap()
            .delivery;
        let event: Counted = serde_json::from_slice(&copy.data).unwrap();
        let (cause, correlation) = if event.key == 1001 {
            (first, "flow-1".to_owned())
        } else {
            // The first of a flow: its own id starts the correlation.
            (second, second.to_string())
        };
        let header = |key| crate::support::header(&copy, key);
        assert_eq!(
            header(rabbit_inbox::internal::CAUSATION_ID),
            Some(cause.to_string())
        );
        assert_eq!(header(rabbit_inbox::internal::CORRELATION_ID), Some(correlation));
    }
    connection.close(200, "done".into()).await.unwrap();
}

#[actix_rt::test]
async fn in_process_a_staged_message_reaches_the_handlers_after_the_commit_never_before() {
    for enable_outbox in [None, Some(true)] {
        let env = TestEnv::new("outbox_in_process").await;
        let mut settings = env.settings();
        settings.message_bus.provider = rabbit_inbox::Provider::InProcess;
        settings.message_bus.enable_outbox = enable_outbox;
        let runtime = Runtime::builder(settings.valid())
            .handler(crate::support::Count)
            .start()
            .await
            .unwrap();
        let mut uow = runtime.unit_of_work().await.unwrap();
        uow.publish("ignored in process", &Message::new(Counted { key: 5 }))
            .await
            .unwrap();
        tokio::time::sleep(Duration::from_millis(1200)).await;
        assert_eq!(
            env.count("counts", 5).await,
            0,
            "{enable_outbox:?}: not before the commit"
        );
        uow.commit().await.unwrap();
        wait_until("the handler counts it", || async {
            env.count("counts", 5).await == 1
        })
        .await;
        let rows = env.scalar("SELECT count(*) FROM outbox_messages").await;
        runtime.shutdown().await;
        assert_eq!(rows, 0, "{enable_outbox:?}: no row left");
    }
}

#[actix_rt::test]
async fn with_the_outbox_off_a_broker_host_warns_and_publishes_right_after_the_commit() {
    let (env, forward) = with_forward_queue("outbox_off").await;
    let logs = crate::support::Captured::default();
    let _capturing = logs.install();
    let mut settings = env.settings();
    settings.message_bus.enable_outbox = Some(false);
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    let mut uow = runtime.unit_of_work().await.unwrap();
    uow.publish(&forward, &Message::new(Counted { key: 1 }))
        .await
        .unwrap();
    assert_eq!(
        env.scalar("SELECT count(*) FROM outbox_messages").await,
        0,
        "held in memory, not staged"
    );
    tokio::time::sleep(Duration::from_millis(300)).await;
    assert_eq!(env.ready(&forward).await, 0, "not before the commit");
    uow.commit().await.unwrap();
    wait_until("it arrives", || async { env.ready(&forward).await == 1 }).await;
    runtime.shutdown().await;
    let warnings = logs
        .text()
        .lines()
        .filter(|l| l.contains("WARN") && l.contains("enable_outbox"))
        .count();
    assert_eq!(warnings, 1, "{}", logs.text());
}

#[actix_rt::test]
async fn retention_sweeps_dead_rows_past_retention_days_and_nothing_else() {
    let env = TestEnv::new("outbox_retention").await;
    let settings = env.settings();
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    rabbit_inbox::internal::run_migrations(&mut pool.get().await.unwrap())
        .await
        .unwrap();
    env.db()
        .await
        .batch_execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body, dead_at)
             VALUES (gen_random_uuid(), '', 'q', 'T', '\\x7b7d', now() - interval '8 days'),
                    (gen_random_uuid(), '', 'q', 'T', '\\x7b7d', now() - interval '1 day'),
                    (gen_random_uuid(), '', 'q', 'T', '\\x7b7d', NULL)",
        )
        .await
        .unwrap();
    let report = rabbit_inbox::internal::sweep(&pool, &settings.retention)
        .await
        .unwrap();
    assert_eq!(report.rows, 1, "{report:?}");
    let left = env
        .scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NULL OR dead_at > now() - interval '2 days'")
        .await;
    assert_eq!(left, 2, "the recent dead row and the pending one stay");
    pool.close();
}

#[actix_rt::test]
async fn rows_another_process_commits_wake_the_dispatcher_through_notify() {
    let (env, forward) = with_forward_queue("outbox_notify").await;
    let mut settings = env.settings();
    // The poll alone would take a minute.
    settings.outbox.poll_interval = Duration::from_secs(60);
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    // Give the LISTEN connection a moment, then stage from elsewhere.
    tokio::time::sleep(Duration::from_millis(500)).await;
    stage_from_another_session(&env, &forward, 1).await;
    let arrived = arrives_within_10s(&env, &forward).await;
    runtime.shutdown().await;
    assert!(arrived, "not woken by the notification");
}

#[actix_rt::test]
async fn a_routing_key_past_255_bytes_is_refused_at_staging_and_parked_at_dispatch() {
    let (env, forward) = with_forward_queue("outbox_long_key").await;
    let mut settings = env.settings();
    settings.outbox.max_attempts = 1;
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    let too_long = "q".repeat(256);
    let mut uow = runtime.unit_of_work().await.unwrap();
    let refused = uow.publish(&too_long, &Message::new(Counted { key: 0 })).await;
    assert!(refused.is_err(), "refused in the caller's transaction");
    // Staged by another process, it fails at dispatch like any row that
    // cannot be sent, instead of panicking the client round after round.
    uow.client()
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body)
             VALUES (gen_random_uuid(), '', $1, 'Counted', '\\x7b7d')",
            &[&too_long],
        )
        .await
        .unwrap();
    uow.publish(&forward, &Message::new(Counted { key: 1 }))
        .await
        .unwrap();
    uow.commit().await.unwrap();
    wait_until("the good one arrives and the long one is parked", || async {
        env.ready(&forward).await == 1
            && env
                .scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL")
                .await
                == 1
    })
    .await;
    runtime.shutdown().await;
}

/// Stages `rows` follow-ups in one transaction before a runtime with
/// outbox batches of 10 and a pool of `pool_size` starts, then checks that
/// they arrive once each and in staging order, across rounds.
async fn a_backlog_arrives_once_in_staging_order(name: &str, pool_size: usize, rows: i64) {
    let mut env = TestEnv::new(name).await;
    let forward = env.another_queue("forward");
    declare_queue(&forward).await;
    let mut settings = env.settings();
    settings.outbox.batch_size = 10;
    settings.database.pool_size = pool_size;
    // Staged by one runtime's unit of work, dispatched by the next one.
    let staging = Runtime::builder(settings.clone().valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    let mut uow = staging.unit_of_work().await.unwrap();
    for key in 0..rows {
        uow.publish(&forward, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    staging.shutdown().await;
    // Shut down before the commit: only the next runtime dispatches.
    uow.commit().await.unwrap();
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    outbox_empties(&env).await;
    wait_until("the stats count every row", || async {
        runtime.stats().outbox_dispatched == rows as u64
    })
    .await;
    runtime.shutdown().await;
    let (ids, keys) = drain(&forward).await;
    assert_eq!(keys, (0..rows).collect::<Vec<_>>(), "once each, in staging order");
    assert_eq!(ids.iter().collect::<HashSet<_>>().len(), rows as usize);
}

/// More rows than one INSERT writes: the commit writes them in chunks,
/// the last with the COMMIT.
#[actix_rt::test]
async fn a_transaction_staging_thousands_of_rows_commits_them_all_in_staging_order() {
    a_backlog_arrives_once_in_staging_order("outbox_thousands", 4, 2_345).await;
}

#[actix_rt::test]
async fn a_backlog_drained_in_pipelined_rounds_arrives_once_each_in_staging_order() {
    a_backlog_arrives_once_in_staging_order("outbox_pipelined", 4, 205).await;
}

#[actix_rt::test]
async fn with_a_pool_of_one_connection_a_backlog_drains_round_after_round_in_order() {
    a_backlog_arrives_once_in_staging_order("outbox_pool_of_one", 1, 205).await;
}

#[actix_rt::test]
async fn a_runtimes_own_commits_wake_its_dispatcher_in_process_without_notifying_others() {
    let (env, forward) = with_forward_queue("outbox_local_wake").await;
    let mut settings = env.settings();
    // The poll alone would take a minute.
    settings.outbox.poll_interval = Duration::from_secs(60);
    let runtime = Runtime::builder(settings.clone().valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    // Another process listening, as other instances' dispatchers do.
    let (client, mut connection) = settings
        .pg_config()
        .unwrap()
        .connect(rabbit_inbox::tokio_postgres::NoTls)
        .await
        .unwrap();
    let (notified, mut notifications) = tokio::sync::mpsc::unbounded_channel();
    tokio::spawn(async move {
        let mut messages = futures_util::stream::poll_fn(move |cx| connection.poll_message(cx));
        while let Some(Ok(message)) = futures_util::StreamExt::next(&mut messages).await {
            if let rabbit_inbox::tokio_postgres::AsyncMessage::Notification(_) = message {
                let _ = notified.send(());
            }
        }
    });
    client.batch_execute("LISTEN inbox_outbox").await.unwrap();

    let mut uow = runtime.unit_of_work().await.unwrap();
    uow.publish(&forward, &Message::new(Counted { key: 1 }))
        .await
        .unwrap();
    uow.commit().await.unwrap();
    let arrived = arrives_within_10s(&env, &forward).await;
    assert!(arrived, "the commit did not wake the runtime's dispatcher");
    assert!(
        notifications.try_recv().is_err(),
        "the runtime's commit notified other processes"
    );

    // A commit from elsewhere still notifies.
    stage_from_another_session(&env, &forward, 2).await;
    let heard = tokio::time::timeout(Duration::from_secs(10), notifications.recv()).await;
    runtime.shutdown().await;
    assert!(
        matches!(heard, Ok(Some(()))),
        "a commit from another session did not notify"
    );
}

#[actix_rt::test]
async fn a_row_with_a_negative_attempt_count_is_tried_and_parked_like_any_other() {
    let mut env = TestEnv::new("outbox_negative_attempts").await;
    let nowhere = env.another_queue("nowhere");
    let mut settings = env.settings();
    settings.outbox.max_attempts = 1;
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    // Written by another process, or by hand: the count is not ours.
    let body = serde_json::to_vec(&Counted { key: 1 }).unwrap();
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body, attempts)
             VALUES (gen_random_uuid(), '', $1, 'Counted', $2, -1)",
            &[&nowhere, &body],
        )
        .await
        .unwrap();
    wait_until("the unroutable row is parked after its one attempt", || async {
        env.scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL AND attempts = 1")
            .await
            == 1
    })
    .await;
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_row_whose_headers_pass_a_frame_is_parked_and_the_rest_of_its_round_flows() {
    let (env, forward) = with_forward_queue("outbox_big_headers").await;
    let mut settings = env.settings();
    settings.outbox.max_attempts = 1;
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    // Claimed first, in the same round as the others.
    let body = serde_json::to_vec(&Counted { key: 0 }).unwrap();
    let huge = serde_json::json!({ "note": "x".repeat(200 * 1024) }).to_string();
    env.db()
        .await
        .execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, headers, body)
             VALUES (gen_random_uuid(), '', $1, 'Counted', $2::text::jsonb, $3)",
            &[&forward, &huge, &body],
        )
        .await
        .unwrap();
    for key in 1..=3 {
        stage_from_another_session(&env, &forward, key).await;
    }
    let runtime = Runtime::builder(settings.valid())
        .handler(crate::support::Count)
        .start()
        .await
        .unwrap();
    wait_until("the three others arrive", || async {
        env.ready(&forward).await == 3
    })
    .await;
    wait_until("the oversized row is parked", || async {
        env.scalar(
            "SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL AND last_error LIKE '%encoded%'",
        )
        .await
            == 1
    })
    .await;
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn the_backlog_sample_counts_pending_and_dead_rows_apart() {
    let env = TestEnv::new("outbox_backlog_sample").await;
    let pool = rabbit_inbox::tools::create_pool(&env.settings()).unwrap();
    rabbit_inbox::internal::run_migrations(&mut pool.get().await.unwrap())
        .await
        .unwrap();
    env.db()
        .await
        .batch_execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body, created_at, dead_at)
             SELECT gen_random_uuid(), '', 'q', 'Counted', '\\x7b7d',
                    now() - interval '5 minutes' + g * interval '1 second',
                    CASE WHEN g > 3 THEN now() END
             FROM generate_series(1, 5) AS g",
        )
        .await
        .unwrap();
    let backlog = rabbit_inbox::internal::outbox::backlog(&pool).await.unwrap();
    assert_eq!((backlog.pending, backlog.dead), (3, 2));
    let oldest = backlog.oldest_pending.expect("rows are pending");
    assert!(
        oldest > std::time::Duration::from_secs(290) && oldest < std::time::Duration::from_secs(300),
        "{oldest:?}"
    );
    // A row staged by hand with a timestamp at infinity: sampled, where
    // the sample failed on every poll (PostgreSQL 15 cannot subtract it)
    // or panicked (17 can, and the infinite age overflowed a Duration).
    env.db()
        .await
        .batch_execute(
            "INSERT INTO outbox_messages (message_id, exchange, routing_key, message_type, body, created_at, seq)
             VALUES (gen_random_uuid(), '', 'q', 'Counted', '\\x7b7d', '-infinity', -1)",
        )
        .await
        .unwrap();
    let backlog = rabbit_inbox::internal::outbox::backlog(&pool).await.unwrap();
    assert_eq!(backlog.pending, 4);
    assert_eq!(backlog.oldest_pending, Some(std::time::Duration::MAX));
    pool.close();
}

/// Takes each row once `open` is set (as a broker holding its confirms
/// through an alarm would), and records the ids it took.
#[derive(Clone, Default)]
struct HeldSink {
    open: std::sync::Arc<std::sync::atomic::AtomicBool>,
    sent: std::sync::Arc<std::sync::Mutex<Vec<uuid::Uuid>>>,
}

impl rabbit_inbox::internal::Sink for HeldSink {
    fn send<'a>(
        &'a self,
        outgoing: &'a rabbit_inbox::internal::Outgoing,
    ) -> futures_util::future::BoxFuture<'a, rabbit_inbox::Result<()>> {
        Box::pin(async move {
            while !self.open.load(std::sync::atomic::Ordering::SeqCst) {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            self.sent.lock().unwrap().push(outgoing.message_id);
            Ok(())
        })
    }
}

#[actix_rt::test]
async fn a_round_keeps_no_transaction_open_while_its_publish_waits_and_no_one_else_sends_its_rows() {
    let env = TestEnv::new("outbox_lease").await;
    let mut settings = env.settings();
    // The server ends a session idle in a transaction after a second.
    settings.database.transaction_timeout = Duration::from_secs(1);
    // Two seconds: a renewal late by a second on a loaded machine (the
    // suite runs its tests in parallel) must not let the lease lapse.
    settings.outbox.claim_lease = Duration::from_secs(2);
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    for key in 0..3 {
        stage_from_another_session(&env, "nowhere", key).await;
    }
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    let held = HeldSink::default();
    let dispatching = rabbit_inbox::internal::dispatch(&pool, &held, &settings.outbox, 0);
    // Two leases long: the round renews its own.
    let report = watched_while_held(&env, &settings, &held, dispatching, Duration::from_secs(4), 3).await;
    assert_eq!((report.claimed, report.dispatched), (3, 3));
}

/// A schema migrated elsewhere (docs/operations.md, "Outside start-up"): a
/// service user with only the grants listed there consumes, records, stages
/// and forwards through the outbox, and sweeps.
#[actix_rt::test]
async fn a_user_with_only_the_documented_grants_consumes_and_forwards() {
    let (env, forward) = with_forward_queue("documented_grants").await;
    let mut admin = env.db().await;
    rabbit_inbox::internal::run_migrations(&mut admin).await.unwrap();
    let role = "inbox_test_documented_grants";
    admin
        .batch_execute(&format!(
            "DO $$ BEGIN
                 IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN CREATE ROLE {role} LOGIN; END IF;
             END $$;
             GRANT SELECT, INSERT, UPDATE, DELETE ON inbox_messages, inbox_deliveries, outbox_messages, inbox_failures TO {role};
             GRANT USAGE ON SEQUENCE outbox_messages_seq_seq TO {role};
             GRANT SELECT, INSERT, UPDATE ON counts TO {role};"
        ))
        .await
        .unwrap();
    let mut settings = env.settings();
    let as_postgres = crate::support::database_url_of(&env.database);
    settings.database.url = as_postgres.replacen("://postgres@", &format!("://{role}@"), 1);
    assert_ne!(
        settings.database.url, as_postgres,
        "DATABASE_URL names user postgres"
    );
    settings.database.run_migrations = false;

    let runtime = forwarding(settings, &forward).await;
    publish_keys(&runtime, &env.queue, 0..5).await;
    wait_until("all five complete", || async { runtime.stats().completed == 5 }).await;
    wait_until("a retention sweep ran", || async { runtime.stats().sweeps >= 1 }).await;
    outbox_empties(&env).await;
    let stats = runtime.stats();
    runtime.shutdown().await;

    assert_eq!((stats.retried, stats.abandoned), (0, 0), "{stats:?}");
    let (_, mut keys) = drain(&forward).await;
    keys.sort_unstable();
    assert_eq!(keys, (1000..1005).collect::<Vec<i64>>());
    assert_eq!(env.scalar("SELECT count(*) FROM inbox_messages").await, 5);
    admin
        .batch_execute(&format!("DROP OWNED BY {role}; DROP ROLE {role};"))
        .await
        .unwrap();
}

/// Runs `dispatching` while `held` holds its publishes, for
/// `for_how_long`; meanwhile, every 100 ms, another dispatcher (on a pool
/// of its own) tries to claim rows, and no transaction may sit idle across
/// the publish. Then lets `held` publish, and checks that the other claimed
/// nothing, each of the `rows` went out once, and the table is empty.
/// Returns what `dispatching` returned.
async fn watched_while_held<T>(
    env: &TestEnv,
    settings: &rabbit_inbox::Settings,
    held: &HeldSink,
    dispatching: impl std::future::Future<Output = rabbit_inbox::Result<T>>,
    for_how_long: Duration,
    rows: usize,
) -> T {
    let others = rabbit_inbox::tools::create_pool(settings).unwrap();
    let watching = async {
        let until = std::time::Instant::now() + for_how_long;
        let mut other_claims = 0;
        while std::time::Instant::now() < until {
            // (A claim's own transaction is idle between its statement and
            // its COMMIT, for the round trip: not what is looked for.)
            let idle = env
                .scalar(&format!(
                    "SELECT count(*) FROM pg_stat_activity
                     WHERE datname = '{}' AND state LIKE 'idle in transaction%'
                       AND state_change < now() - interval '300 milliseconds'",
                    env.database
                ))
                .await;
            assert_eq!(idle, 0, "a transaction is held open across the publish");
            let other = HeldSink {
                open: std::sync::Arc::new(true.into()),
                ..HeldSink::default()
            };
            let report = rabbit_inbox::internal::dispatch(&others, &other, &settings.outbox, 0)
                .await
                .unwrap();
            other_claims += report.claimed;
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        held.open.store(true, std::sync::atomic::Ordering::SeqCst);
        other_claims
    };
    let (dispatched, other_claims) = futures_util::future::join(dispatching, watching).await;
    let dispatched = dispatched.expect("the rounds settle after their long publish");
    assert_eq!(other_claims, 0, "another dispatcher claimed leased rows");
    let sent = held.sent.lock().unwrap().clone();
    assert_eq!(sent.len(), rows, "each row once: {sent:?}");
    assert_eq!(
        sent.iter().collect::<HashSet<_>>().len(),
        rows,
        "each row once: {sent:?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM outbox_messages").await, 0);
    dispatched
}

/// A lease of four seconds: renewed every 1.3 s, it holds on a machine
/// loaded by the suite's other tests (a renewal can be a second late);
/// unrenewed, it lapses well within the test's ten seconds.
async fn leased_outbox(name: &str, batch_size: u32, rows: i64) -> (TestEnv, rabbit_inbox::Settings) {
    let env = TestEnv::new(name).await;
    let mut settings = env.settings();
    settings.outbox.claim_lease = Duration::from_secs(4);
    settings.outbox.batch_size = batch_size;
    rabbit_inbox::internal::run_migrations(&mut env.db().await)
        .await
        .unwrap();
    for key in 0..rows {
        stage_from_another_session(&env, "nowhere", key).await;
    }
    (env, settings)
}

#[actix_rt::test]
async fn a_drain_keeps_the_lease_of_the_round_it_claimed_while_another_publishes() {
    // Two rounds: the second is claimed while the first waits for the
    // broker, two and a half leases long.
    let (env, settings) = leased_outbox("outbox_lease_pipelined", 2, 4).await;
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    let held = HeldSink::default();
    let draining = rabbit_inbox::internal::drain_outbox(&pool, &held, &settings.outbox);
    watched_while_held(&env, &settings, &held, draining, Duration::from_secs(10), 4).await;
}

#[actix_rt::test]
async fn a_renewal_whose_answer_was_lost_leaves_the_lease_renewable() {
    let (env, settings) = leased_outbox("outbox_lease_lost_answer", 100, 3).await;
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    let held = HeldSink::default();
    let dispatching = async {
        rabbit_inbox::internal::dispatch(&pool, &held, &settings.outbox, 0)
            .await
            .map(drop)
    };
    let renewed_unseen = async {
        // Once the round holds its rows, a renewal of theirs commits and
        // its answer never reaches the round: the rows' lease has moved
        // on, the round still knows the one it wrote.
        wait_until("the round claims its rows", || async {
            env.scalar("SELECT count(*) FROM outbox_messages WHERE next_attempt_at > now()")
                .await
                == 3
        })
        .await;
        env.db()
            .await
            .execute(
                "UPDATE outbox_messages SET next_attempt_at = now() + interval '4 seconds'",
                &[],
            )
            .await
            .unwrap();
        Ok(())
    };
    let dispatching = async {
        let (dispatched, renewed) = futures_util::future::join(dispatching, renewed_unseen).await;
        renewed.and(dispatched)
    };
    watched_while_held(&env, &settings, &held, dispatching, Duration::from_secs(10), 3).await;
}

/// Forwards each event with a header of its own: the consumed message's
/// `tenant`, or the one a refused name asks for.
struct ForwardWithTenant {
    forward: String,
}

impl EventHandler<Counted> for ForwardWithTenant {
    async fn handle(
        &self,
        event: &Counted,
        context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        let tenant = context
            .headers()
            .get("tenant")
            .and_then(|v| v.as_text().map(str::to_owned))
            .unwrap_or_default();
        let follow_up = Message::new(Counted {
            key: event.key + 1000,
        })
        .with_header("tenant", tenant);
        // The flow's headers are the library's: refused, and nothing staged.
        let refused = Message::new(Counted { key: -1 }).with_header("correlation_id", "mine");
        let error = uow.publish(&self.forward, &refused).await.unwrap_err();
        assert!(error.to_string().contains("header `correlation_id`"), "{error}");
        uow.publish(&self.forward, &follow_up).await?;
        Ok(())
    }
}

#[actix_rt::test]
async fn a_handler_sets_a_header_of_its_own_on_a_follow_up_beside_the_carried_ones() {
    let (env, forward) = with_forward_queue("outbox_own_headers").await;
    let runtime = Runtime::builder(env.settings().valid())
        .handler(ForwardWithTenant {
            forward: forward.clone(),
        })
        .start()
        .await
        .unwrap();
    let id = uuid::Uuid::now_v7();
    let mut headers = FieldTable::default();
    headers.insert(
        "tenant".into(),
        rabbit_inbox::tools::lapin::types::AMQPValue::LongString("acme".into()),
    );
    let properties = rabbit_inbox::tools::lapin::BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_type("Counted".into())
        .with_headers(headers);
    env.publish_raw(properties, br#"{"key": 1}"#).await;
    wait_until("the follow-up arrives", || async {
        env.ready(&forward).await == 1
    })
    .await;
    runtime.shutdown().await;
    let copy = env.take(&forward).await.unwrap();
    let event: Counted = serde_json::from_slice(&copy.data).unwrap();
    assert_eq!(event.key, 1001, "only the follow-up, not the refused one");
    assert_eq!(header(&copy, "tenant").as_deref(), Some("acme"));
    assert_eq!(
        header(&copy, rabbit_inbox::internal::CAUSATION_ID).as_deref(),
        Some(id.to_string().as_str()),
        "the carried headers stay"
    );
}

/// Sends each event's follow-up to one queue, whatever the exchange.
struct SendOn {
    queue: String,
}

impl EventHandler<Counted> for SendOn {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        uow.send(
            &self.queue,
            &Message::new(Counted {
                key: event.key + 1000,
            }),
        )
        .await?;
        Ok(())
    }
}

#[actix_rt::test]
async fn a_message_sent_goes_straight_to_its_queue_whatever_exchange_publishing_uses() {
    let (env, forward) = with_forward_queue("outbox_send").await;
    let mut settings = env.settings();
    // Publishing goes to a topic exchange nothing is bound to.
    settings.message_bus.exchange = format!("{}.events", env.queue);
    let runtime = Runtime::builder(settings.valid())
        .handler(SendOn {
            queue: forward.clone(),
        })
        .start()
        .await
        .unwrap();
    for key in 1..4 {
        let properties = rabbit_inbox::tools::lapin::BasicProperties::default()
            .with_message_id(uuid::Uuid::now_v7().to_string().into())
            .with_type("Counted".into());
        env.publish_raw(properties, format!(r#"{{"key": {key}}}"#).as_bytes())
            .await;
    }
    wait_until("the three sent arrive", || async {
        env.ready(&forward).await == 3
    })
    .await;
    runtime.shutdown().await;
    let (_, mut keys) = drain(&forward).await;
    keys.sort_unstable();
    assert_eq!(keys, [1001, 1002, 1003]);
    let connection = amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let _ = channel
        .exchange_delete(
            format!("{}.events", env.queue).as_str().into(),
            Default::default(),
        )
        .await;
}
