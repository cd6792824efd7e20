//! A redrive under fire: the failures of 200 check-ins redriven at a rate
//! while two instances of the example service compete for the job and
//! its messages, each SIGKILLed and restarted midway. Every check-in is
//! applied once.

use std::time::Duration;

use rabbit_inbox::ops::{Filter, Operations, Operator, Role, Selection};
use rabbit_inbox::tools::lapin::BasicProperties;
use uuid::Uuid;

use crate::support::{Killed, TestEnv, free_port, publish_to, start_ops_service, wait_until};

const CHECKINS: i64 = 200;
/// From here on, attendees are refused while the constraint stands.
const REFUSED_FROM: i64 = 900_000;

struct Service {
    child: Killed,
}

impl Service {
    fn start(env: &TestEnv, tokens: &std::path::Path) -> Self {
        let address = format!("127.0.0.1:{}", free_port());
        Self {
            child: start_ops_service(&env.database, &env.queue, &address, tokens),
        }
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[actix_rt::test]
async fn a_redrive_under_two_competing_instances_and_their_kills_applies_each_effect_once() {
    let env = TestEnv::new("ops_redrive_kills").await;
    let tokens = std::env::temp_dir().join(format!("inbox-kills-tokens-{}", Uuid::new_v4()));
    std::fs::write(&tokens, "ops operator ops-token-0123456789abc\n").unwrap();
    let mut first = Service::start(&env, &tokens);
    wait_until("the service consumes", || async {
        env.consumers(&env.queue).await == Some(1)
    })
    .await;

    // A cause: the database refuses these attendees.
    env.db()
        .await
        .batch_execute(&format!(
            "ALTER TABLE attendee_checkins ADD CONSTRAINT refused CHECK (attendee_id < {REFUSED_FROM})"
        ))
        .await
        .unwrap();
    for i in 0..CHECKINS {
        let properties = BasicProperties::default()
            .with_message_id(Uuid::now_v7().to_string().into())
            .with_type("AttendeeCheckedIn".into())
            .with_content_type("application/json".into());
        let body = format!(r#"{{"attendee_id": {}, "session_id": {i}}}"#, REFUSED_FROM + i);
        publish_to("", &env.queue, properties, body.as_bytes()).await;
    }
    wait_until("every check-in failed into the table", || async {
        env.scalar("SELECT count(*) FROM inbox_failures WHERE status = 'open'")
            .await
            == CHECKINS
    })
    .await;

    // Fixed; a second instance; the redrive, at 40 a second (5 s).
    env.db()
        .await
        .batch_execute("ALTER TABLE attendee_checkins DROP CONSTRAINT refused")
        .await
        .unwrap();
    let mut second = Service::start(&env, &tokens);
    wait_until("both consume", || async {
        env.consumers(&env.queue).await == Some(2)
    })
    .await;
    let mut settings = env.settings();
    settings.queues = vec![rabbit_inbox::QueueSettings::new(&env.queue)];
    let ops = Operations::new(rabbit_inbox::tools::create_pool(&settings).unwrap(), &settings);
    let job = ops
        .redrive(
            &Operator::new("ops", Role::Operator),
            &Selection::Filter(Filter {
                queue: Some(env.queue.clone()),
                ..Filter::default()
            }),
            Some(40),
            Some("constraint dropped"),
            false,
        )
        .await
        .unwrap();
    assert_eq!(job.total, CHECKINS as i32);

    // Kill each midway, and bring it back.
    let done = || async {
        env.scalar(&format!(
            "SELECT done::bigint FROM inbox_ops_jobs WHERE id = '{}'",
            job.id
        ))
        .await
    };
    wait_until("a quarter is redriven", || async { done().await >= CHECKINS / 4 }).await;
    first.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    first = Service::start(&env, &tokens);
    wait_until("half is redriven", || async { done().await >= CHECKINS / 2 }).await;
    second.kill();
    tokio::time::sleep(Duration::from_millis(300)).await;
    second = Service::start(&env, &tokens);

    let long = || async {
        let deadline = std::time::Instant::now() + Duration::from_secs(90);
        while env.scalar("SELECT count(*) FROM attendee_checkins").await < CHECKINS {
            assert!(
                std::time::Instant::now() < deadline,
                "not every check-in was applied"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    };
    long().await;
    wait_until("the job is done", || async {
        ops.job(job.id)
            .await
            .is_ok_and(|job| job.status == "done" && job.done == CHECKINS as i32)
    })
    .await;
    // Time for a second copy, had there been one.
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(
        env.scalar("SELECT count(*) FROM attendee_checkins WHERE checkins = 1")
            .await,
        CHECKINS,
        "each check-in applied once"
    );
    assert_eq!(
        env.scalar("SELECT coalesce(sum(attendees), 0)::bigint FROM session_attendance")
            .await,
        CHECKINS,
        "and counted once by the second handler"
    );
    assert_eq!(
        env.scalar("SELECT count(*) FROM inbox_failures WHERE status = 'redriven'")
            .await,
        CHECKINS
    );
    assert_eq!(env.ready(&rabbit_inbox::tools::error_queue(&env.queue)).await, 0);
    drop((first, second));
    let _ = std::fs::remove_file(&tokens);
}
