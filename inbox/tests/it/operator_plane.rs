//! The operator plane: every endpoint against every role, redrives applied
//! once (a race between two has one winner), a job's rate across a
//! restart, a queue paused and resumed, nothing taken off a queue to show
//! it.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use actix_web::http::StatusCode;
use actix_web::test::{self, TestRequest};
use rabbit_inbox::ops::access::Access;
use rabbit_inbox::ops::{Filter, Operations, Operator, Role, Selection};
use rabbit_inbox::{
    EventHandler, HandlerError, Message, MessageContext, Permanent, Runtime, Settings, UnitOfWork,
};
use uuid::Uuid;

use crate::support::{Counted, TestEnv, Valid, increment, wait_until};

/// Refuses keys from 100 on until the cause is fixed.
#[derive(Clone, Default)]
struct RefuseUntilFixed {
    fixed: Arc<AtomicBool>,
}

impl EventHandler<Counted> for RefuseUntilFixed {
    async fn handle(
        &self,
        event: &Counted,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        if event.key >= 100 && !self.fixed.load(Ordering::SeqCst) {
            return Err(Permanent::new(format!("key {} is refused", event.key)).into());
        }
        increment(uow, "counts", event.key).await
    }

    fn name(&self) -> &'static str {
        "RefuseUntilFixed"
    }
}

const READER: &str = "reader-token-0123456789";
const OPERATOR: &str = "operator-token-0123456789";
const ADMIN: &str = "admin-token-0123456789";

fn access() -> Access {
    let path = std::env::temp_dir().join(format!("inbox-ops-tokens-{}", Uuid::new_v4()));
    std::fs::write(
        &path,
        format!("rita reader {READER}\notto operator {OPERATOR}\nada admin {ADMIN}\n"),
    )
    .unwrap();
    let access = Access::from_files(std::slice::from_ref(&path)).unwrap();
    std::fs::remove_file(&path).unwrap();
    access
}

fn operations_settings(env: &TestEnv) -> Settings {
    let mut settings = env.settings();
    settings.failures.drain = true;
    settings
}

/// A runtime that refuses keys from 100 on (until `fixed`), with its
/// failures drained, and `keys` of them failed into the table.
async fn with_failures(
    env: &TestEnv,
    keys: std::ops::Range<i64>,
    handler: &RefuseUntilFixed,
) -> (Runtime, Vec<Uuid>) {
    let runtime = Runtime::builder(operations_settings(env).valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    let mut ids = Vec::new();
    for key in keys.clone() {
        let message = Message::new(Counted { key });
        ids.push(message.id);
        runtime.publisher().publish(&env.queue, &message).await.unwrap();
    }
    let expected = keys.count() as i64;
    wait_until("the failures are in the table", || async {
        env.scalar("SELECT count(*) FROM inbox_failures").await == expected
    })
    .await;
    (runtime, ids)
}

/// The failures' ids, in order.
async fn failure_ids(env: &TestEnv) -> Vec<Uuid> {
    env.db()
        .await
        .query("SELECT id FROM inbox_failures ORDER BY id", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect()
}

async fn status_counts(env: &TestEnv) -> Vec<(String, i64)> {
    env.db()
        .await
        .query(
            "SELECT status, count(*) FROM inbox_failures GROUP BY status ORDER BY status",
            &[],
        )
        .await
        .unwrap()
        .iter()
        .map(|row| (row.get(0), row.get(1)))
        .collect()
}

#[actix_rt::test]
async fn every_endpoint_answers_401_without_a_token_403_to_a_role_that_may_not_and_200_to_one_that_may() {
    let env = TestEnv::new("ops_roles").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, _) = with_failures(&env, 100..110, &handler).await;
    runtime.shutdown().await;
    // The operations outside a runtime (as a command line has them): no
    // instance runs the jobs, so each stays as its caller left it.
    let settings = operations_settings(&env);
    let ops = Operations::new(rabbit_inbox::tools::create_pool(&settings).unwrap(), &settings);
    let app = test::init_service(actix_web::App::new().service(rabbit_inbox::ops::http::scope(
        "/ops",
        ops.clone(),
        access(),
    )))
    .await;

    // A job for each caller to pause, resume and cancel.
    let otto = Operator::new("otto", Role::Operator);
    let job_of = |id: Uuid| {
        let ops = ops.clone();
        let otto = otto.clone();
        async move {
            ops.redrive(&otto, &Selection::Ids(vec![id]), Some(1), None, false)
                .await
                .unwrap()
                .id
        }
    };

    // (method, path, body, the least role that may)
    let queue = env.queue.clone();
    let endpoints =
        |job: Uuid, failure: Uuid| -> Vec<(&'static str, String, Option<serde_json::Value>, Role)> {
            vec![
                ("GET", "/ops/v1/failures?status=open".into(), None, Role::Reader),
                ("GET", format!("/ops/v1/failures/{failure}"), None, Role::Reader),
                ("GET", "/ops/v1/groups".into(), None, Role::Reader),
                ("GET", "/ops/v1/jobs".into(), None, Role::Reader),
                ("GET", format!("/ops/v1/jobs/{job}"), None, Role::Reader),
                ("GET", "/ops/v1/queues".into(), None, Role::Reader),
                ("GET", "/ops/v1/audit".into(), None, Role::Reader),
                (
                    "POST",
                    "/ops/v1/redrive".into(),
                    Some(serde_json::json!({"ids": [failure], "dry_run": true})),
                    Role::Operator,
                ),
                (
                    "POST",
                    "/ops/v1/discard".into(),
                    Some(serde_json::json!({"ids": [failure], "reason": "a test"})),
                    Role::Operator,
                ),
                (
                    "POST",
                    "/ops/v1/restore".into(),
                    Some(serde_json::json!({"ids": [failure]})),
                    Role::Operator,
                ),
                ("POST", format!("/ops/v1/jobs/{job}/pause"), None, Role::Operator),
                ("POST", format!("/ops/v1/jobs/{job}/resume"), None, Role::Operator),
                (
                    "POST",
                    format!("/ops/v1/queues/{queue}/pause"),
                    None,
                    Role::Operator,
                ),
                (
                    "POST",
                    format!("/ops/v1/queues/{queue}/resume"),
                    None,
                    Role::Operator,
                ),
                ("POST", format!("/ops/v1/jobs/{job}/cancel"), None, Role::Operator),
            ]
        };
    let failure_ids = failure_ids(&env).await;
    let callers: [(Option<&str>, Option<Role>); 5] = [
        (None, None),
        (Some("not-a-token-at-all-0000"), None),
        (Some(READER), Some(Role::Reader)),
        (Some(OPERATOR), Some(Role::Operator)),
        (Some(ADMIN), Some(Role::Admin)),
    ];
    for (i, (token, role)) in callers.iter().enumerate() {
        // Each caller its own failure and job, so that what one did does
        // not answer for the next.
        let failure = failure_ids[i];
        let job = job_of(failure_ids[5 + i]).await;
        for (method, path, body, least) in endpoints(job, failure) {
            let mut request = match method {
                "GET" => TestRequest::get(),
                _ => TestRequest::post(),
            }
            .uri(&path);
            if let Some(token) = token {
                request = request.insert_header(("Authorization", format!("Bearer {token}")));
            }
            if let Some(body) = &body {
                request = request.set_json(body);
            }
            let response = test::call_service(&app, request.to_request()).await;
            let expected = match role {
                None => StatusCode::UNAUTHORIZED,
                Some(role) if *role < least => StatusCode::FORBIDDEN,
                Some(_) => StatusCode::OK,
            };
            let status = response.status();
            let answer: serde_json::Value = test::read_body_json(response).await;
            assert_eq!(status, expected, "{method} {path} as {token:?}: {answer}");
            if expected != StatusCode::OK {
                assert!(answer["error"].is_string(), "an error says why: {answer}");
            }
        }
    }

    // The list's and the audit's contract.
    let request = TestRequest::get()
        .uri(&format!(
            "/ops/v1/failures?queue={}&status=open&limit=2",
            env.queue
        ))
        .insert_header(("Authorization", format!("Bearer {READER}")))
        .to_request();
    let page: serde_json::Value = test::call_and_read_body_json(&app, request).await;
    let item = &page["items"][0];
    for key in [
        "id",
        "message_id",
        "queue",
        "kind",
        "status",
        "type",
        "reason",
        "fingerprint",
        "attempts",
        "first_failed_at",
        "last_failed_at",
    ] {
        assert!(item.get(key).is_some(), "`{key}` in {item}");
    }
    assert_eq!(item["queue"], env.queue.as_str());
    assert_eq!(item["kind"], "error");
    assert_eq!(item["type"], "Counted");
    let next = page["next"].as_str().expect("more than one page");
    let request = TestRequest::get()
        .uri(&format!(
            "/ops/v1/failures?queue={}&status=open&limit=2&after={next}",
            env.queue
        ))
        .insert_header(("Authorization", format!("Bearer {READER}")))
        .to_request();
    let second: serde_json::Value = test::call_and_read_body_json(&app, request).await;
    assert_ne!(
        second["items"][0]["id"], page["items"][0]["id"],
        "the next page starts after"
    );

    let request = TestRequest::get()
        .uri("/ops/v1/audit")
        .insert_header(("Authorization", format!("Bearer {READER}")))
        .to_request();
    let audit: serde_json::Value = test::call_and_read_body_json(&app, request).await;
    let entries = audit["items"].as_array().unwrap();
    let discard = entries
        .iter()
        .find(|e| e["action"] == "discard" && e["actor"] == "otto")
        .expect("otto's discard is in the audit");
    assert_eq!(discard["reason"], "a test");
    assert!(discard["at"].is_string());
    assert!(
        !audit.to_string().contains("token-0123456789"),
        "no token in the audit"
    );
    // An operator may not cancel an admin's job; an admin may cancel anyone's.
    let ada_job = ops
        .redrive(
            &Operator::new("ada", Role::Admin),
            &Selection::Ids(vec![failure_ids[0]]),
            Some(1),
            None,
            false,
        )
        .await
        .unwrap();
    let refused = ops.cancel_job(&otto, ada_job.id).await;
    assert!(
        matches!(refused, Err(rabbit_inbox::ops::OpsError::Forbidden(_))),
        "{refused:?}"
    );
    let cancelled = ops
        .cancel_job(&Operator::new("ada", Role::Admin), ada_job.id)
        .await
        .unwrap();
    assert_eq!(cancelled.status, "cancelled");
    // A mistyped filter key widens nothing: refused.
    let request = TestRequest::post()
        .uri("/ops/v1/redrive")
        .insert_header(("Authorization", format!("Bearer {OPERATOR}")))
        .set_json(serde_json::json!({"filter": {"queu": "x"}}))
        .to_request();
    assert_eq!(
        test::call_service(&app, request).await.status(),
        StatusCode::BAD_REQUEST
    );
    // A discard without a reason: refused.
    let request = TestRequest::post()
        .uri("/ops/v1/discard")
        .insert_header(("Authorization", format!("Bearer {OPERATOR}")))
        .set_json(serde_json::json!({"ids": [failure_ids[0]]}))
        .to_request();
    assert_eq!(
        test::call_service(&app, request).await.status(),
        StatusCode::BAD_REQUEST
    );
}

#[actix_rt::test]
async fn a_redrive_applies_each_effect_once_and_of_two_racing_for_a_message_one_wins() {
    let env = TestEnv::new("ops_redrive").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, ids) = with_failures(&env, 100..140, &handler).await;
    let ops = runtime.operations();
    let otto = Operator::new("otto", Role::Operator);
    assert_eq!(
        env.count("counts", 100).await,
        0,
        "nothing applied while it fails"
    );

    // The cause is fixed. A redrive of everything and redrives of one
    // message each race: every message is taken by exactly one of them.
    handler.fixed.store(true, Ordering::SeqCst);
    let failures = failure_ids(&env).await;
    let everything = Selection::Filter(Filter {
        queue: Some(env.queue.clone()),
        ..Filter::default()
    });
    let bulk = ops.redrive(&otto, &everything, None, Some("fixed"), false);
    let one_each: Vec<Selection> = failures.iter().map(|id| Selection::Ids(vec![*id])).collect();
    let singles = futures_util::future::join_all(
        one_each
            .iter()
            .map(|selection| ops.redrive(&otto, selection, None, None, false)),
    );
    let (bulk, singles) = futures_util::join!(bulk, singles);
    let taken = bulk.unwrap().total + singles.into_iter().map(|job| job.unwrap().total).sum::<i32>();
    assert_eq!(taken, 40, "each message taken once");

    wait_until("every redriven message is applied", || async {
        env.scalar("SELECT count(*) FROM counts WHERE key >= 100").await == 40
    })
    .await;
    // Time for a second copy, had there been one.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for key in 100..140 {
        assert_eq!(env.count("counts", key).await, 1, "key {key} applied once");
    }
    assert_eq!(status_counts(&env).await, vec![("redriven".to_owned(), 40)]);
    assert_eq!(env.ready(&rabbit_inbox::tools::error_queue(&env.queue)).await, 0);
    // Redriven under its own id: the inbox knows each.
    for id in &ids {
        let known = env
            .db()
            .await
            .query_one("SELECT count(*) FROM inbox_messages WHERE message_id = $1", &[id])
            .await
            .unwrap()
            .get::<_, i64>(0);
        assert_eq!(known, 1, "message {id} processed under its own id");
    }
    // A redriven message is not redriven again.
    let again = ops.redrive(&otto, &everything, None, None, false).await.unwrap();
    assert_eq!((again.total, again.status.as_str()), (0, "done"));
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_jobs_rate_holds_and_it_resumes_after_a_restart() {
    let env = TestEnv::new("ops_rate").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, _) = with_failures(&env, 100..115, &handler).await;
    handler.fixed.store(true, Ordering::SeqCst);
    let otto = Operator::new("otto", Role::Operator);
    let everything = Selection::Filter(Filter::default());
    let job = runtime
        .operations()
        .redrive(&otto, &everything, Some(5), None, false)
        .await
        .unwrap();
    assert_eq!((job.total, job.status.as_str()), (15, "running"));
    wait_until("a few are redriven", || async {
        env.scalar("SELECT count(*) FROM inbox_failures WHERE status = 'redriven'")
            .await
            >= 3
    })
    .await;
    runtime.shutdown().await;
    let stopped_at = env.scalar("SELECT done::bigint FROM inbox_ops_jobs").await;
    assert!(stopped_at < 15, "the job was stopped midway ({stopped_at} done)");

    // Another instance (the same service restarted) goes on with it.
    let runtime = Runtime::builder(operations_settings(&env).valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    wait_until("the job is done", || async {
        env.scalar("SELECT count(*) FROM inbox_ops_jobs WHERE status = 'done' AND done = 15")
            .await
            == 1
    })
    .await;
    wait_until("every message applied", || async {
        env.scalar("SELECT count(*) FROM counts WHERE key >= 100").await == 15
    })
    .await;
    // No second holds more than the rate and one slice (1 at 5 a second),
    // whichever instance staged them.
    let stamps: Vec<SystemTime> = env
        .db()
        .await
        .query("SELECT redriven_at FROM inbox_failures ORDER BY redriven_at", &[])
        .await
        .unwrap()
        .iter()
        .map(|row| row.get(0))
        .collect();
    for (i, at) in stamps.iter().enumerate() {
        let within = stamps[i..]
            .iter()
            .take_while(|t| **t < *at + Duration::from_secs(1))
            .count();
        assert!(
            within <= 6,
            "{within} staged within a second at 5 a second: {stamps:?}"
        );
    }
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_paused_queue_is_not_consumed_readiness_says_paused_and_showing_takes_nothing_off_a_queue() {
    let env = TestEnv::new("ops_pause").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, _) = with_failures(&env, 100..103, &handler).await;
    let ops: Operations = runtime.operations();
    let otto = Operator::new("otto", Role::Operator);
    assert!(
        ops.pause_queue(&otto, &env.queue, true, Some("a test"))
            .await
            .unwrap()
    );
    let monitor = runtime.monitor();
    wait_until("readiness says paused", || async {
        let ready = monitor.ready().await;
        ready.ok && ready.paused == vec![env.queue.clone()]
    })
    .await;
    for key in 1..4 {
        runtime
            .publisher()
            .publish(&env.queue, &Message::new(Counted { key }))
            .await
            .unwrap();
    }
    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(env.ready(&env.queue).await, 3, "nothing consumed while paused");

    // Showing everything takes nothing off a queue.
    let rows_before = status_counts(&env).await;
    let page = ops.failures(&Filter::default(), None, 50).await.unwrap();
    for item in &page.items {
        ops.failure(item.id).await.unwrap();
    }
    ops.groups(&Filter::default()).await.unwrap();
    ops.audit(None, 50).await.unwrap();
    assert_eq!(env.ready(&env.queue).await, 3);
    assert_eq!(status_counts(&env).await, rows_before);

    assert!(ops.pause_queue(&otto, &env.queue, false, None).await.unwrap());
    wait_until("consumed once resumed", || async {
        env.scalar("SELECT count(*) FROM counts WHERE key < 100").await == 3
    })
    .await;
    assert!(monitor.ready().await.paused.is_empty());
    let audit = ops.audit(None, 10).await.unwrap();
    let actions: Vec<&str> = audit.items.iter().map(|e| e.action.as_str()).collect();
    assert_eq!(actions, ["resume_queue", "pause_queue"]);
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn discarded_failures_leave_the_open_list_until_restored_and_retention_keeps_what_nobody_resolved() {
    let env = TestEnv::new("ops_discard").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, _) = with_failures(&env, 100..104, &handler).await;
    let ops = runtime.operations();
    let otto = Operator::new("otto", Role::Operator);
    let all_four = Selection::Filter(Filter {
        text: Some("key 10".into()),
        ..Filter::default()
    });
    assert!(
        ops.discard(&otto, &all_four, None).await.is_err(),
        "a reason is required"
    );
    let job = ops
        .discard(&otto, &all_four, Some("known bad data"))
        .await
        .unwrap();
    assert_eq!((job.total, job.status.as_str()), (4, "done"));
    let restored = ops
        .restore(
            &otto,
            &Selection::Filter(Filter {
                text: Some("key 100".into()),
                ..Filter::default()
            }),
            None,
        )
        .await
        .unwrap();
    assert_eq!(restored.total, 1);
    assert_eq!(
        status_counts(&env).await,
        vec![("discarded".to_owned(), 3), ("open".to_owned(), 1)]
    );
    runtime.shutdown().await;

    // Everything aged past retention: resolved failures go, open ones stay.
    env.db()
        .await
        .batch_execute("UPDATE inbox_failures SET updated_at = now() - interval '400 days'")
        .await
        .unwrap();
    let settings = operations_settings(&env);
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    rabbit_inbox::internal::sweep_keeping_failures(&pool, &settings.retention)
        .await
        .unwrap();
    assert_eq!(status_counts(&env).await, vec![("open".to_owned(), 1)]);
    rabbit_inbox::internal::sweep(&pool, &settings.retention)
        .await
        .unwrap();
    assert_eq!(
        status_counts(&env).await,
        Vec::<(String, i64)>::new(),
        "without the plane, all of it ages out"
    );
    // The audit is append-only.
    let refused = env.db().await.batch_execute("DELETE FROM inbox_ops_audit").await;
    assert!(refused.is_err(), "the audit refuses a delete");
}

/// `inbox-ops`, run as an operator runs it in the service's container:
/// the service's settings from its environment.
fn inbox_ops(env: &TestEnv, args: &[&str]) -> serde_json::Value {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_inbox-ops"))
        .args(args)
        .current_dir(crate::support::REPOSITORY)
        .env("INBOX_ENV", "test")
        .env(
            "INBOX__DATABASE__URL",
            crate::support::database_url_of(&env.database),
        )
        .output()
        .expect("inbox-ops runs");
    assert!(
        output.status.success(),
        "inbox-ops {args:?}: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    serde_json::from_slice(&output.stdout).expect("inbox-ops answers JSON")
}

#[actix_rt::test]
async fn the_command_line_lists_and_redrives_with_the_services_settings_and_signs_the_audit() {
    let env = TestEnv::new("ops_cli").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, _) = with_failures(&env, 100..103, &handler).await;
    let listed = inbox_ops(&env, &["failures", "--queue", &env.queue, "--status", "open"]);
    assert_eq!(listed["items"].as_array().unwrap().len(), 3);
    handler.fixed.store(true, Ordering::SeqCst);
    let dry = inbox_ops(&env, &["redrive", "--queue", &env.queue, "--dry-run"]);
    assert_eq!(
        (dry["job"]["status"].as_str(), dry["job"]["total"].as_i64()),
        (Some("dry_run"), Some(3))
    );
    let job = inbox_ops(
        &env,
        &[
            "--as",
            "night-shift",
            "redrive",
            "--queue",
            &env.queue,
            "--reason",
            "fixed in 1.4.2",
        ],
    );
    assert_eq!(job["job"]["total"], 3);
    wait_until("the service applies what the command line redrove", || async {
        env.scalar("SELECT count(*) FROM counts WHERE key >= 100").await == 3
    })
    .await;
    let audit = inbox_ops(&env, &["audit"]);
    assert_eq!(audit["items"][0]["actor"], "night-shift");
    assert_eq!(audit["items"][0]["reason"], "fixed in 1.4.2");
    let refused = std::process::Command::new(env!("CARGO_BIN_EXE_inbox-ops"))
        .args(["redrive", "--queu", "x"])
        .output()
        .unwrap();
    assert!(!refused.status.success());
    assert!(String::from_utf8_lossy(&refused.stderr).contains("unknown option `--queu`"));
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_dead_outbox_row_is_a_failure_from_the_moment_it_is_parked_and_a_redrive_sends_it() {
    let mut env = TestEnv::new("ops_dead_outbox").await;
    let mut settings = operations_settings(&env);
    settings.outbox.max_attempts = 1;
    let runtime = Runtime::builder(settings.valid())
        .handler(RefuseUntilFixed::default())
        .start()
        .await
        .unwrap();
    let nowhere = env.another_queue("nowhere");
    let message = Message::new(Counted { key: 7 });
    let mut uow = runtime.unit_of_work().await.unwrap();
    uow.publish(&nowhere, &message).await.unwrap();
    uow.commit().await.unwrap();
    wait_until("the unroutable row is parked", || async {
        env.scalar("SELECT count(*) FROM outbox_messages WHERE dead_at IS NOT NULL")
            .await
            == 1
    })
    .await;
    // Parked and recorded in one transaction: never one without the other.
    let row = env
        .db()
        .await
        .query_one(
            "SELECT message_id, queue, kind, status, reason, message_type FROM inbox_failures",
            &[],
        )
        .await
        .unwrap();
    assert_eq!(row.get::<_, Uuid>(0), message.id);
    assert_eq!(
        (
            row.get::<_, &str>(1),
            row.get::<_, &str>(2),
            row.get::<_, &str>(3)
        ),
        ("outbox", "dead_outbox", "open")
    );
    assert!(
        row.get::<_, String>(4).contains("unroutable"),
        "{:?}",
        row.get::<_, String>(4)
    );
    assert_eq!(row.get::<_, &str>(5), "Counted");

    // The cause is fixed (the queue exists), and the row is redriven.
    let connection = crate::support::amqp().await;
    let channel = connection.create_channel().await.unwrap();
    let durable = rabbit_inbox::tools::lapin::options::QueueDeclareOptions {
        durable: true,
        ..Default::default()
    };
    channel
        .queue_declare(nowhere.as_str().into(), durable, Default::default())
        .await
        .unwrap();
    let otto = Operator::new("otto", Role::Operator);
    let dead = Selection::Filter(Filter {
        kind: Some("dead_outbox".into()),
        ..Filter::default()
    });
    let job = runtime
        .operations()
        .redrive(&otto, &dead, None, None, false)
        .await
        .unwrap();
    assert_eq!(job.total, 1);
    wait_until("the revived row arrives", || async {
        env.ready(&nowhere).await == 1
    })
    .await;
    wait_until("and leaves the outbox", || async {
        env.scalar("SELECT count(*) FROM outbox_messages").await == 0
    })
    .await;
    assert_eq!(status_counts(&env).await, vec![("redriven".to_owned(), 1)]);
    let arrived = env.take(&nowhere).await.unwrap();
    assert_eq!(
        arrived.properties.message_id().as_ref().map(|id| id.to_string()),
        Some(message.id.to_string()),
        "under its own id"
    );
    connection.close(200, "done".into()).await.unwrap();
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_redriven_copy_has_its_id_properties_and_headers_and_none_of_its_failure() {
    use rabbit_inbox::tools::lapin::types::{AMQPValue, FieldTable};
    let env = TestEnv::new("ops_redriven_copy").await;
    let handler = RefuseUntilFixed::default();
    let runtime = Runtime::builder(operations_settings(&env).valid())
        .handler(handler.clone())
        .start()
        .await
        .unwrap();
    let id = Uuid::now_v7();
    let mut headers = FieldTable::default();
    headers.insert("tenant".into(), AMQPValue::LongString("acme".into()));
    headers.insert("priority-class".into(), AMQPValue::LongLongInt(3));
    let properties = rabbit_inbox::tools::lapin::BasicProperties::default()
        .with_message_id(id.to_string().into())
        .with_type("Counted".into())
        .with_content_type("application/json".into())
        .with_correlation_id("order-17".into())
        .with_headers(headers);
    env.publish_raw(properties, br#"{"key": 100}"#).await;
    wait_until("it failed into the table", || async {
        env.scalar("SELECT count(*) FROM inbox_failures").await == 1
    })
    .await;

    // Paused, so that the copy waits in the queue to be looked at.
    let ops = runtime.operations();
    let otto = Operator::new("otto", Role::Operator);
    ops.pause_queue(&otto, &env.queue, true, None).await.unwrap();
    wait_until("paused", || async {
        runtime.monitor().ready().await.paused.len() == 1
    })
    .await;
    handler.fixed.store(true, Ordering::SeqCst);
    ops.redrive(&otto, &Selection::Filter(Filter::default()), None, None, false)
        .await
        .unwrap();
    wait_until("the copy waits in the queue", || async {
        env.ready(&env.queue).await == 1
    })
    .await;
    let copy = env.take(&env.queue).await.unwrap();
    let p = &copy.properties;
    assert_eq!(
        p.message_id().as_ref().map(|v| v.to_string()),
        Some(id.to_string())
    );
    assert_eq!(p.kind().as_ref().map(|v| v.to_string()), Some("Counted".into()));
    assert_eq!(
        p.correlation_id().as_ref().map(|v| v.to_string()),
        Some("order-17".into())
    );
    assert_eq!(
        p.content_type().as_ref().map(|v| v.to_string()),
        Some("application/json".into())
    );
    let headers = p.headers().as_ref().unwrap().inner();
    assert_eq!(headers.get("tenant"), Some(&AMQPValue::LongString("acme".into())));
    assert_eq!(headers.get("priority-class"), Some(&AMQPValue::LongLongInt(3)));
    let failure_headers: Vec<&str> = headers
        .keys()
        .map(|k| k.as_str())
        .filter(|k| k.starts_with("x-inbox-") || k.starts_with("x-death") || k.starts_with("x-first-death"))
        .collect();
    assert!(failure_headers.is_empty(), "{failure_headers:?}");
    assert_eq!(copy.data, br#"{"key": 100}"#);

    // The copy as it came (taken off to look at it, so put back), consumed
    // once resumed.
    crate::support::publish_to("", &env.queue, copy.properties.clone(), &copy.data).await;
    ops.pause_queue(&otto, &env.queue, false, None).await.unwrap();
    wait_until("applied once resumed", || async {
        env.count("counts", 100).await == 1
    })
    .await;
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_redrive_whose_messages_fail_again_pauses_itself_and_says_why() {
    let env = TestEnv::new("ops_self_pause").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, _) = with_failures(&env, 100..130, &handler).await;
    // Not fixed: every redriven message fails again.
    let ops = runtime.operations();
    let otto = Operator::new("otto", Role::Operator);
    let job = ops
        .redrive(
            &otto,
            &Selection::Filter(Filter::default()),
            Some(10),
            None,
            false,
        )
        .await
        .unwrap();
    wait_until("the job pauses itself", || async {
        ops.job(job.id).await.is_ok_and(|job| job.status == "paused")
    })
    .await;
    let paused = ops.job(job.id).await.unwrap();
    assert!(
        paused.done < 30,
        "it stopped before the end ({} of 30)",
        paused.done
    );
    assert!(paused.failed_again >= 10, "{paused:?}");
    let why = paused.paused_reason.unwrap();
    assert!(why.contains("failed again"), "{why}");
    // What it did not redrive stays with it, held from any other redrive.
    let held = env
        .scalar("SELECT count(*) FROM inbox_failures WHERE status = 'redriving'")
        .await;
    assert_eq!(held, i64::from(30 - paused.done));
    let other = ops
        .redrive(&otto, &Selection::Filter(Filter::default()), None, None, true)
        .await
        .unwrap();
    assert!(
        i64::from(other.total) <= 30 - held,
        "another redrive would take none of the {held} it holds ({} counted)",
        other.total
    );

    // Fixed; resumed: the rest go, and are applied.
    handler.fixed.store(true, Ordering::SeqCst);
    let resumed = ops.resume_job(&otto, job.id).await.unwrap();
    assert_eq!(
        (resumed.status.as_str(), resumed.paused_reason),
        ("running", None)
    );
    wait_until("the job is done", || async {
        ops.job(job.id).await.is_ok_and(|job| job.status == "done")
    })
    .await;
    // Each message it redrove is applied once or failed again, none lost,
    // none twice: the held ones after the fix, and one redriven before
    // the pause may still have been in flight then, and applied after.
    wait_until(
        "what it redrove is applied or failed again, once each",
        || async {
            let failed_again = ops.job(job.id).await.map_or(0, |job| job.failed_again);
            env.scalar("SELECT count(*) FROM counts WHERE key >= 100").await + failed_again == 30
        },
    )
    .await;
    let applied = env.scalar("SELECT count(*) FROM counts WHERE key >= 100").await;
    assert!(
        applied >= held,
        "every held message is applied after the fix ({applied} of {held})"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM counts WHERE key >= 100 AND n <> 1")
            .await,
        0,
        "none applied twice"
    );
    runtime.shutdown().await;
}

#[actix_rt::test]
async fn a_job_whose_slice_fails_waits_and_holds_up_no_other_job() {
    let env = TestEnv::new("ops_poison_job").await;
    let handler = RefuseUntilFixed::default();
    let (runtime, ids) = with_failures(&env, 100..102, &handler).await;
    handler.fixed.store(true, Ordering::SeqCst);
    // The database refuses to stage the first message again.
    env.db()
        .await
        .batch_execute(&format!(
            "CREATE FUNCTION refuse_one() RETURNS trigger LANGUAGE plpgsql AS $$
             BEGIN
                 IF NEW.message_id = '{}' THEN RAISE EXCEPTION 'refused for the test'; END IF;
                 RETURN NEW;
             END $$;
             CREATE TRIGGER refuse_one BEFORE INSERT ON outbox_messages
                 FOR EACH ROW EXECUTE FUNCTION refuse_one();",
            ids[0]
        ))
        .await
        .unwrap();
    let failure_of = |id: Uuid| {
        let env = &env;
        async move {
            env.db()
                .await
                .query_one("SELECT id FROM inbox_failures WHERE message_id = $1", &[&id])
                .await
                .unwrap()
                .get::<_, Uuid>(0)
        }
    };
    let (poisoned, healthy) = (failure_of(ids[0]).await, failure_of(ids[1]).await);
    let ops = runtime.operations();
    let otto = Operator::new("otto", Role::Operator);
    let first = ops
        .redrive(&otto, &Selection::Ids(vec![poisoned]), None, None, false)
        .await
        .unwrap();
    let second = ops
        .redrive(&otto, &Selection::Ids(vec![healthy]), None, None, false)
        .await
        .unwrap();
    wait_until("the other job is done and its message applied", || async {
        ops.job(second.id).await.is_ok_and(|job| job.status == "done") && env.count("counts", 101).await == 1
    })
    .await;
    let stuck = ops.job(first.id).await.unwrap();
    assert_eq!(
        (stuck.status.as_str(), stuck.done),
        ("running", 0),
        "rolled back, tried again later"
    );
    assert_eq!(
        ops.failure(poisoned).await.unwrap().summary.status,
        "redriving",
        "still held by its job, from any other redrive"
    );
    runtime.shutdown().await;
}
