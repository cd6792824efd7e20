//! Publishes `AttendeeCheckedIn` events for the check-in service, some of
//! them again under an id already used (the redeliveries the inbox skips).
//!
//! ```text
//! cargo run --example publish -- [--count 1000] [--dup-ratio 0.2] [--failing 0] [--queue NAME]
//!     [--wire inbox|masstransit]
//! ```
//!
//! `--failing N` adds N events with a negative attendee id, which the
//! service's first handler refuses. `--wire masstransit` publishes them as
//! a MassTransit 8 producer does, for `checkin_service --wire masstransit`:
//! `Conference.Contracts:AttendeeCheckedIn` in MassTransit's envelope, to
//! that type's exchange, which the service's queue is bound to. Prints what
//! the service's tables should add up to once everything is consumed.

mod common;

use std::collections::HashSet;

use common::{AttendeeCheckedIn, CheckIn, Seeded};
use rabbit_inbox::tools::{self, AmqpPublisher};
use rabbit_inbox::{IntegrationEvent, Message, Wire};

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("publish: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> common::Result<()> {
    common::check_flags(
        "usage: publish [--count 1000] [--dup-ratio 0.2] [--failing 0] [--queue NAME] [--wire inbox|masstransit]",
        &["count", "dup-ratio", "failing", "queue", "wire"],
        &[],
    );
    let count: usize = common::parsed_arg("--count", 1000);
    let dup_ratio: f64 = common::parsed_arg("--dup-ratio", 0.2);
    let failing: usize = common::parsed_arg("--failing", 0);
    if !(0.0..1.0).contains(&dup_ratio) {
        return Err(common::BoxError::from(format!(
            "--dup-ratio {dup_ratio} must be in [0, 1)"
        )));
    }
    let settings = common::settings()?;
    let queue = &settings.queues[0];
    let wire = settings.message_bus.wire;

    let connection = tools::connect(&settings, "inbox example publisher").await?;
    // The queue as the service declares it on this wire, so that nothing
    // published before the service first starts is lost.
    let types = match wire {
        Wire::Inbox => Vec::new(),
        Wire::Masstransit => vec![common::masstransit::AttendeeCheckedIn::TYPE],
    };
    tools::declare_wire_topology(&connection, queue, &settings.failure, wire, &types).await?;
    let publisher = AmqpPublisher::new(&connection, "").await?.with_wire(wire);
    let unique = match wire {
        Wire::Inbox => {
            publish::<AttendeeCheckedIn>(&publisher, &queue.name, count, dup_ratio, failing).await?
        }
        Wire::Masstransit => {
            publish::<common::masstransit::AttendeeCheckedIn>(
                &publisher,
                &queue.name,
                count,
                dup_ratio,
                failing,
            )
            .await?
        }
    };
    connection.close(200, "done".into()).await?;
    println!(
        "queue={} published={} unique={} failing={} expected_checkins={}",
        queue.name,
        count + failing,
        unique,
        failing,
        unique
    );
    Ok(())
}

/// Publishes `count` check-ins of contract `E` (a share of them again under
/// an id already sent) and `failing` refused ones; returns how many ids
/// are unique.
async fn publish<E: CheckIn + Clone>(
    publisher: &AmqpPublisher,
    queue: &str,
    count: usize,
    dup_ratio: f64,
    failing: usize,
) -> common::Result<usize> {
    let mut random = Seeded::new(0x9e37_79b9_7f4a_7c15);
    let mut sent: Vec<Message<E>> = Vec::with_capacity(count);
    let mut unique = HashSet::new();
    for i in 0..count + failing {
        let message = if i >= count {
            Message::new(E::new(-1 - random.below(100) as i64, 1 + random.below(10) as i64))
        } else if !sent.is_empty() && random.chance(dup_ratio) {
            sent[random.below(sent.len() as u64) as usize].clone()
        } else {
            Message::new(E::new(1 + random.below(1000) as i64, 1 + random.below(10) as i64))
        };
        publisher.publish(queue, &message).await?;
        if i < count {
            unique.insert(message.id);
            sent.push(message);
        }
    }
    Ok(unique.len())
}
