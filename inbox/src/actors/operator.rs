//! [`OperatorActor`]: the operator plane's work on each instance.
//!
//! With `failures.drain` on, every instance runs one. It advances the due
//! redrive jobs ([`crate::ops::Operations::advance_jobs`]: any instance
//! takes any job, one at a time per job), applies the queues operators
//! paused to this instance's consumers ([`Pause`]), and samples the
//! failures' gauges. It acts at once when this process's API was asked
//! something (a nudge), and every [`POLL`] for what other instances were
//! asked. A database away is waited out at a growing pause. Receives
//! [`StopOperating`] at shutdown.

use std::collections::HashMap;
use std::time::{Duration, Instant};

use actix::prelude::*;
use tokio::sync::watch;

use crate::actors::consumer::{ConsumerActor, Pause};
use crate::backoff::Backoff;
use crate::ops::Operations;

/// How often jobs and paused queues are looked at without a nudge.
const POLL: Duration = Duration::from_millis(200);
/// How often the gauges are sampled.
const SAMPLE_EVERY: Duration = Duration::from_secs(10);

/// Stop (shutdown): the slice in hand is committed or rolled back first.
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct StopOperating;

/// Runs redrive jobs and operators' pauses on this instance.
pub(crate) struct OperatorActor {
    operations: Operations,
    consumers: HashMap<String, Addr<ConsumerActor>>,
    stop: watch::Sender<bool>,
    ended: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl OperatorActor {
    pub(crate) fn new(operations: Operations, consumers: HashMap<String, Addr<ConsumerActor>>) -> Self {
        Self {
            operations,
            consumers,
            stop: watch::channel(false).0,
            ended: None,
        }
    }
}

impl Actor for OperatorActor {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Context<Self>) {
        let (done, ended) = tokio::sync::oneshot::channel();
        self.ended = Some(ended);
        let (operations, consumers) = (self.operations.clone(), self.consumers.clone());
        let stop = self.stop.subscribe();
        actix_rt::spawn(async move {
            operating(&operations, &consumers, stop).await;
            let _ = done.send(());
        });
    }
}

impl Supervised for OperatorActor {}

impl actix::Handler<StopOperating> for OperatorActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: StopOperating, _ctx: &mut Context<Self>) -> Self::Result {
        let _ = self.stop.send(true);
        let ended = self.ended.take();
        Box::pin(async move {
            if let Some(ended) = ended {
                let _ = ended.await;
            }
        })
    }
}

async fn operating(
    operations: &Operations,
    consumers: &HashMap<String, Addr<ConsumerActor>>,
    mut stop: watch::Receiver<bool>,
) {
    let mut backoff = Backoff::new(POLL, Duration::from_secs(30));
    let mut failing_since: Option<Instant> = None;
    let mut sampled_at: Option<Instant> = None;
    let nudge = std::sync::Arc::clone(operations.nudge());
    while !*stop.borrow() {
        let round = async {
            apply_pauses(operations, consumers).await?;
            operations.advance_jobs().await?;
            if sampled_at.is_none_or(|at| at.elapsed() >= SAMPLE_EVERY) {
                sample(operations).await?;
                sampled_at = Some(Instant::now());
            }
            Ok::<(), crate::ops::OpsError>(())
        };
        let wait = match round.await {
            Ok(()) => {
                if let Some(since) = failing_since.take() {
                    tracing::info!(after = ?since.elapsed(), "operator plane: the database answers again");
                }
                backoff = Backoff::new(POLL, Duration::from_secs(30));
                POLL
            }
            Err(e) => {
                let pause = backoff.next_pause();
                if failing_since.is_none() {
                    failing_since = Some(Instant::now());
                    tracing::warn!(error = %e, "operator plane: jobs and pauses wait; trying again in {pause:?}");
                } else {
                    tracing::debug!(error = %e, "operator plane: still failing; trying again in {pause:?}");
                }
                pause
            }
        };
        tokio::select! {
            _ = stop.wait_for(|stop| *stop) => return,
            () = nudge.notified() => {}
            () = tokio::time::sleep(wait) => {}
        }
    }
}

/// Tells each consumer of this instance whether its queue is paused.
async fn apply_pauses(
    operations: &Operations,
    consumers: &HashMap<String, Addr<ConsumerActor>>,
) -> crate::ops::OpsResult<()> {
    let paused = operations.paused_queues().await?;
    for (queue, consumer) in consumers {
        let pause = paused.iter().any(|p| &p.queue == queue);
        // The consumer ignores what it is already.
        consumer.do_send(Pause(pause));
    }
    Ok(())
}

async fn sample(operations: &Operations) -> crate::ops::OpsResult<()> {
    let (open, oldest, running) = operations.sample().await?;
    crate::actors::metrics::failures_sampled(&open, oldest, running);
    Ok(())
}
