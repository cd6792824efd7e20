//! The test kit (feature `testing`), on the example service's own
//! handlers: a handler run on a message the test makes, in a real
//! PostgreSQL transaction, no broker, and what the runtime would do.

use rabbit_inbox::testing::{TestKit, Verdict};
use rabbit_inbox::{EventHandler, HandlerError, Message, MessageContext, UnitOfWork};

use crate::common::{AttendeeCheckedIn, CountAttendance, CountCheckins, ForwardCheckins, SCHEMA};
use crate::support::TestEnv;

/// A handler that panics.
struct Panics;

impl EventHandler<AttendeeCheckedIn> for Panics {
    async fn handle(
        &self,
        _: &AttendeeCheckedIn,
        _context: &MessageContext,
        _: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        panic!("the ledger is gone")
    }
}

#[actix_rt::test]
async fn the_example_services_handlers_run_under_the_test_kit_as_the_runtime_would_run_them() {
    let env = TestEnv::new("test_kit").await;
    let settings = env.settings();
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    let lock_wait = settings.database.migration_lock_timeout;
    rabbit_inbox::tools::migrate(&mut pool.get().await.unwrap(), false, SCHEMA, lock_wait)
        .await
        .unwrap();
    let kit = TestKit::new(&settings).unwrap();
    let check_in = |attendee_id| {
        Message::new(AttendeeCheckedIn {
            attendee_id,
            session_id: 1,
        })
    };

    let ran = kit.deliver(check_in(7)).handled_by(&CountCheckins).await.unwrap();
    assert_eq!(ran.verdict, Verdict::Committed);
    assert_eq!(
        env.scalar("SELECT checkins FROM attendee_checkins WHERE attendee_id = 7")
            .await,
        1
    );

    // Refused: rolled back, and retried by the runtime.
    let ran = kit
        .deliver(check_in(-1))
        .handled_by(&CountCheckins)
        .await
        .unwrap();
    assert!(
        matches!(&ran.verdict, Verdict::Retried { reason } if reason.contains("negative")),
        "{ran:?}"
    );
    assert_eq!(env.scalar("SELECT count(*) FROM attendee_checkins").await, 1);

    // A follow-up, staged with the commit, caused by the message.
    let message = check_in(8).with_header("tenant", "acme");
    let source = message.id;
    let forward = ForwardCheckins {
        queue: "checkins.recorded".into(),
    };
    let ran = kit.deliver(message).handled_by(&forward).await.unwrap();
    assert_eq!(ran.verdict, Verdict::Committed);
    let [staged] = ran.staged.as_slice() else {
        panic!("one follow-up: {ran:?}");
    };
    assert_eq!(staged.routing_key, "checkins.recorded");
    assert_eq!(staged.json().unwrap()["source_message_id"], source.to_string());
    assert!(
        staged
            .headers
            .contains(&("causation_id".into(), source.to_string())),
        "{:?}",
        staged.headers
    );

    let ran = kit
        .deliver(check_in(9))
        .redelivered()
        .attempt(3)
        .handled_by(&Panics)
        .await
        .unwrap();
    assert!(
        matches!(&ran.verdict, Verdict::Retried { reason } if reason.contains("the ledger is gone")),
        "{ran:?}"
    );
}

#[actix_rt::test]
async fn a_types_handlers_run_together_under_the_test_kit_and_fail_together() {
    let env = TestEnv::new("test_kit_all").await;
    let settings = env.settings();
    let pool = rabbit_inbox::tools::create_pool(&settings).unwrap();
    let lock_wait = settings.database.migration_lock_timeout;
    rabbit_inbox::tools::migrate(&mut pool.get().await.unwrap(), false, SCHEMA, lock_wait)
        .await
        .unwrap();
    let check_in = |attendee_id| {
        Message::new(AttendeeCheckedIn {
            attendee_id,
            session_id: 3,
        })
    };
    // Registered as the example service registers them.
    let kit = TestKit::new(&settings)
        .unwrap()
        .handler::<AttendeeCheckedIn, _>(CountCheckins)
        .handler::<AttendeeCheckedIn, _>(CountAttendance)
        .handler::<AttendeeCheckedIn, _>(ForwardCheckins {
            queue: "checkins.recorded".into(),
        });

    let ran = kit.deliver(check_in(7)).handled().await.unwrap();
    assert_eq!(ran.verdict, Verdict::Committed);
    assert_eq!(ran.staged.len(), 1, "{ran:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM attendee_checkins").await, 1);
    assert_eq!(
        env.scalar("SELECT attendees FROM session_attendance WHERE session_id = 3")
            .await,
        1
    );

    // The last handler panics: the first two's writes roll back with it.
    let ran = kit
        .clone()
        .handler::<AttendeeCheckedIn, _>(Panics)
        .deliver(check_in(8))
        .handled()
        .await
        .unwrap();
    assert!(
        matches!(&ran.verdict, Verdict::Retried { reason } if reason.contains("the ledger is gone")),
        "{ran:?}"
    );
    assert!(ran.staged.is_empty(), "{ran:?}");
    assert_eq!(env.scalar("SELECT count(*) FROM attendee_checkins").await, 1);
    assert_eq!(
        env.scalar("SELECT attendees FROM session_attendance WHERE session_id = 3")
            .await,
        1
    );

    // A type the kit has no handler for is a test of nothing: refused.
    let error = TestKit::new(&settings)
        .unwrap()
        .deliver(check_in(9))
        .handled()
        .await
        .unwrap_err();
    assert!(
        error.to_string().contains("no handler for `AttendeeCheckedIn`"),
        "{error}"
    );
}

/// A handler with only `handle`, so the default `handle_batch`.
struct Inner;

impl EventHandler<AttendeeCheckedIn> for Inner {
    async fn handle(
        &self,
        _: &AttendeeCheckedIn,
        _context: &MessageContext,
        _: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        Ok(())
    }
}

/// Composes `Inner` through its default `handle_batch`, forgetting the
/// contexts: a mistake that would skip the event.
struct ForgetsContexts;

impl EventHandler<AttendeeCheckedIn> for ForgetsContexts {
    async fn handle(
        &self,
        event: &AttendeeCheckedIn,
        _context: &MessageContext,
        uow: &mut UnitOfWork,
    ) -> Result<(), HandlerError> {
        Inner.handle_batch(std::slice::from_ref(event), &[], uow).await
    }
}

#[actix_rt::test]
async fn a_batch_given_fewer_contexts_than_events_fails_rather_than_skip_an_event() {
    let env = TestEnv::new("test_kit_contexts").await;
    let kit = TestKit::new(&env.settings()).unwrap();
    let ran = kit
        .deliver(Message::new(AttendeeCheckedIn {
            attendee_id: 1,
            session_id: 1,
        }))
        .handled_by(&ForgetsContexts)
        .await
        .unwrap();
    assert!(
        matches!(&ran.verdict, Verdict::Retried { reason } if reason.contains("1 events and 0 contexts")),
        "{ran:?}"
    );
}
