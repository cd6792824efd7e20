//! Moves messages from a queue's error queue back to the queue, once the
//! fault that sent them there is fixed.
//!
//! ```text
//! cargo run --example replay -- [--queue NAME] [--from error|skipped|outbox] [--message-id UUID]...
//!     [--wire masstransit]
//! ```
//!
//! Without `--message-id`, every message in `NAME.error` (or, with `--from
//! skipped`, `NAME.skipped`; with `--wire masstransit`, `NAME_error` and
//! `NAME_skipped`, MassTransit's fault headers removed too) goes back; with it, only those, and the others
//! stay where they were, in their order. `--from outbox` gives the outbox's
//! dead rows (those that failed `outbox.max_attempts` publishes) another
//! round of attempts, in the service's database. Each keeps its `message_id`, so one that was processed after
//! all is skipped by the inbox, as long as it comes back within
//! `retention.days`. Honours `AMQP_URL` and the settings in `config/`.
//!
//! An operator in the service's container uses `inbox-ops replay` (the
//! same tools, the service's own settings); this example stays for the
//! repository's scripts and its output line.

mod common;

use std::collections::HashSet;

use rabbit_inbox::tools::{self, SetAside};
use rabbit_inbox::uuid::Uuid;

#[tokio::main(flavor = "current_thread")]
async fn main() -> std::process::ExitCode {
    match run().await {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("replay: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

async fn run() -> common::Result<()> {
    let mut only = HashSet::new();
    let mut args = std::env::args();
    while let Some(arg) = args.next() {
        if arg == "--message-id" {
            let text = args.next().unwrap_or_default();
            let id = Uuid::try_parse(&text)
                .map_err(|_| common::BoxError::from(format!("--message-id `{text}` is not a UUID")))?;
            only.insert(id);
        }
    }
    let settings = common::settings()?;
    let from = match common::arg("--from").as_deref() {
        None | Some("error") => SetAside::Error,
        Some("skipped") => SetAside::Skipped,
        Some("outbox") => {
            let pool = tools::create_pool(&settings)?;
            let only = (!only.is_empty()).then_some(&only);
            let revived = tools::retry_dead(&pool, only).await?;
            println!("from=outbox revived={revived}");
            return Ok(());
        }
        Some(other) => {
            return Err(common::BoxError::from(format!(
                "--from `{other}`: expected `error`, `skipped` or `outbox`"
            )));
        }
    };
    let queue = &settings.queues[0].name;
    let connection = tools::connect(&settings, "inbox replay").await?;
    let wire = settings.message_bus.wire;
    let only = (!only.is_empty()).then_some(&only);
    let report = tools::replay_on(wire, &connection, queue, from, only).await?;
    connection.close(200, "done".into()).await?;
    println!(
        "from={} to={queue} replayed={} left={}",
        from.queue_on(wire, queue),
        report.replayed,
        report.left
    );
    Ok(())
}
