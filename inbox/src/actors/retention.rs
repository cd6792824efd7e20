//! [`RetentionActor`]: keeps `inbox_messages` from growing forever.
//!
//! Uses the runtime's connections and owns the `[retention]` settings. Every
//! `retention.interval` it runs an [`crate::retention::sweep`] (one at a time in this
//! instance; across instances the sweep's advisory lock lets one per
//! database go, the others skip the round). Receives [`Sweep`] to sweep now,
//! replying with the [`SweepReport`], and [`StopSweeping`]
//! at shutdown. Sends nothing; records each sweep in [`Stats`]. The runtime
//! starts it only while the inbox is on.

use std::sync::Arc;

use actix::prelude::*;

use crate::actors::stats::Stats;
use crate::db::Connections;
use crate::retention::SweepReport;
use crate::settings::RetentionSettings;

/// Sweep now, whatever the interval says.
#[derive(Debug, Message)]
#[rtype(result = "crate::Result<SweepReport>")]
pub struct Sweep;

/// Stop sweeping (shutdown).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct StopSweeping;

/// Deletes inbox rows past `retention.days`, every `retention.interval`.
#[derive(Debug)]
pub struct RetentionActor {
    connections: Connections,
    settings: RetentionSettings,
    /// `failures.drain`: failures nobody resolved stay.
    keep_unresolved: bool,
    stats: Arc<Stats>,
    sweeping: bool,
}

impl RetentionActor {
    /// An actor sweeping the database of `connections`.
    pub(crate) fn new(
        connections: Connections,
        settings: RetentionSettings,
        keep_unresolved: bool,
        stats: Arc<Stats>,
    ) -> Self {
        Self {
            connections,
            settings,
            keep_unresolved,
            stats,
            sweeping: false,
        }
    }

    /// One sweep, logged and counted.
    fn sweep(&mut self) -> impl ActorFuture<Self, Output = crate::Result<SweepReport>> + 'static {
        self.sweeping = true;
        let (connections, settings, keep) = (
            self.connections.clone(),
            self.settings.clone(),
            self.keep_unresolved,
        );
        async move { crate::retention::sweep(&connections, &settings, keep).await }
            .into_actor(self)
            .map(|result, actor, _| {
                actor.sweeping = false;
                match &result {
                    Ok(report) if report.swept => {
                        actor.stats.record_sweep(report);
                        tracing::info!(
                            rows = report.rows,
                            batches = report.batches,
                            duration = ?report.duration,
                            longest_batch = ?report.longest_batch,
                            "retention sweep"
                        );
                    }
                    Ok(report) => {
                        actor.stats.record_sweep(report);
                        tracing::debug!("another instance is sweeping this database; skipped this round");
                    }
                    Err(e) => {
                        tracing::warn!(error = %e, "retention sweep failed; the next round tries again")
                    }
                }
                result
            })
    }
}

impl Actor for RetentionActor {
    type Context = Context<Self>;

    fn started(&mut self, ctx: &mut Context<Self>) {
        // Once at start, so that a service redeployed more often than the
        // interval still sweeps, and the row gauges are known at once;
        // then every interval.
        ctx.spawn(self.sweep().map(|_, _, _| ()));
        ctx.run_interval(self.settings.interval, |actor, ctx| {
            if !actor.sweeping {
                ctx.spawn(actor.sweep().map(|_, _, _| ()));
            }
        });
    }
}

impl actix::Handler<Sweep> for RetentionActor {
    type Result = ResponseActFuture<Self, crate::Result<SweepReport>>;

    fn handle(&mut self, _: Sweep, _ctx: &mut Context<Self>) -> Self::Result {
        Box::pin(self.sweep())
    }
}

impl actix::Handler<StopSweeping> for RetentionActor {
    type Result = ();

    fn handle(&mut self, _: StopSweeping, ctx: &mut Context<Self>) {
        // A sweep cut short here drops its lock guard, which closes the
        // connection and with it the advisory lock.
        ctx.stop();
    }
}
