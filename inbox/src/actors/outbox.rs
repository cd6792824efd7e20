//! [`OutboxActor`]: publishes what committed transactions staged.
//!
//! Owns where the rows go: over a broker, a connection of its own; in
//! process, the handlers (a [`Publisher`] either way). Drains the outbox
//! ([`crate::outbox::drain`]: rounds of [`crate::outbox::dispatch`], pipelined): at once when a commit that staged messages
//! wakes it (through the [`Outbox`]'s `Notify`, so the latency is that of
//! one publish), when PostgreSQL notifies that another process committed
//! rows (`LISTEN inbox_outbox`), and every
//! `outbox.poll_interval` for rows of other processes and retries coming
//! due. Receives `StopDispatching` at shutdown: the round in progress
//! finishes, no other starts. A round that fails (the database or the
//! broker away) is tried again at the next wake or poll; a run of failures
//! is a WARN when it starts and one when dispatching works again.

use std::panic::AssertUnwindSafe;
use std::sync::Arc;

use actix::prelude::*;
use futures_util::FutureExt;
use tokio::sync::watch;

use crate::actors::publisher::Publisher;
use crate::actors::stats::Stats;
use crate::db::Connections;
use crate::settings::OutboxSettings;
use crate::unit_of_work::Outbox;

/// Stop dispatching once the round in progress is done (shutdown).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct StopDispatching;

/// Dispatches the outbox of one database.
pub(crate) struct OutboxActor {
    connections: Connections,
    /// Where rows go: the broker over a connection of the outbox's own, or
    /// the handlers in process.
    sink: Publisher,
    settings: OutboxSettings,
    outbox: Outbox,
    stats: Arc<Stats>,
    /// The database, for the LISTEN connection.
    listen_to: Option<crate::outbox::ListenTo>,
    /// Set to `true` to stop; the dispatch loop watches it.
    stop: watch::Sender<bool>,
    /// Resolves when the dispatch loop has ended.
    ended: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl OutboxActor {
    pub(crate) fn new(
        connections: Connections,
        sink: Publisher,
        settings: OutboxSettings,
        outbox: Outbox,
        stats: Arc<Stats>,
        listen_to: Option<crate::outbox::ListenTo>,
    ) -> Self {
        Self {
            connections,
            sink,
            settings,
            outbox,
            stats,
            listen_to,
            stop: watch::channel(false).0,
            ended: None,
        }
    }
}

impl Actor for OutboxActor {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Context<Self>) {
        if let Some(config) = self.listen_to.clone() {
            actix_rt::spawn(self.listening(config));
        }
        actix_rt::spawn(self.sampling());
        let (done, ended) = tokio::sync::oneshot::channel();
        self.ended = Some(ended);
        actix_rt::spawn(self.dispatching(done));
    }
}

impl OutboxActor {
    /// Resolves once the actor is told to stop.
    fn stopped(&self) -> impl Future<Output = ()> + 'static {
        let mut stop = self.stop.subscribe();
        async move {
            let _ = stop.wait_for(|stop| *stop).await;
        }
    }

    /// Wakes the dispatcher when another process commits rows (LISTEN/NOTIFY).
    fn listening(&self, config: crate::outbox::ListenTo) -> impl Future<Output = ()> + 'static {
        let wake = Arc::clone(&self.outbox.wake);
        crate::outbox::listen(config, move || wake.notify_one(), self.stopped())
    }

    /// Samples the backlog, for the stats and metrics, every poll interval
    /// rather than after every round.
    fn sampling(&self) -> impl Future<Output = ()> + 'static {
        let (connections, stats, every) = (
            self.connections.clone(),
            Arc::clone(&self.stats),
            self.settings.poll_interval,
        );
        let mut stop = self.stop.subscribe();
        async move {
            while !*stop.borrow() {
                match crate::outbox::backlog(&connections).await {
                    Ok(backlog) => stats.record_backlog(&backlog),
                    Err(e) => tracing::debug!(error = %e, "cannot count the outbox's backlog"),
                }
                tokio::select! {
                    _ = tokio::time::sleep(every) => {}
                    _ = stop.changed() => {}
                }
            }
        }
    }

    /// Drains the outbox at every wake and poll until told to stop, then
    /// says so through `done`.
    fn dispatching(&self, done: tokio::sync::oneshot::Sender<()>) -> impl Future<Output = ()> + 'static {
        let (connections, sink, settings) =
            (self.connections.clone(), self.sink.clone(), self.settings.clone());
        let stats = Arc::clone(&self.stats);
        let wake = Arc::clone(&self.outbox.wake);
        let mut stop = self.stop.subscribe();
        async move {
            // Failing since when, and how many drains: an outage is logged
            // when it starts and when it ends, not at every poll.
            let mut failing: Option<(std::time::Instant, u64)> = None;
            while !*stop.borrow() {
                // Rounds go on while they come back full. A panic fails the
                // drain, never the loop: the claimed rows come due again
                // once their lease ends.
                // A round that found the broker away ends the drain: the
                // next waits for a wake or the poll.
                let mut unsent = 0;
                let drained = crate::outbox::drain(&connections, &sink, &settings, |report| {
                    stats.record_dispatch(report);
                    unsent += report.unsent;
                    !*stop.borrow() && report.unsent == 0
                });
                let drained = AssertUnwindSafe(drained).catch_unwind().await.map(|drained| {
                    drained.and_then(|()| match unsent {
                        0 => Ok(()),
                        rows => Err(crate::Error::new(
                            crate::ErrorKind::Broker,
                            format!("the broker is unavailable: {rows} outbox messages wait for it, no attempt spent"),
                        )),
                    })
                });
                match drained {
                    Ok(Ok(())) => {
                        if let Some((since, drains)) = failing.take() {
                            tracing::warn!(after = ?since.elapsed(), failed_drains = drains, "outbox dispatch works again");
                        }
                    }
                    Ok(Err(e)) => match &mut failing {
                        None => {
                            tracing::warn!(error = %e, "outbox dispatch failed; trying again at every wake and poll, logged again once it works");
                            failing = Some((std::time::Instant::now(), 1));
                        }
                        Some((_, drains)) => {
                            *drains += 1;
                            tracing::debug!(error = %e, "outbox dispatch failed again");
                        }
                    },
                    Err(_) => tracing::error!("outbox dispatch panicked; trying again"),
                }
                tokio::select! {
                    _ = wake.notified() => {}
                    _ = tokio::time::sleep(settings.poll_interval) => {}
                    _ = stop.changed() => {}
                }
            }
            let _ = done.send(());
        }
    }
}

impl Supervised for OutboxActor {}

impl actix::Handler<StopDispatching> for OutboxActor {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: StopDispatching, _ctx: &mut Context<Self>) -> Self::Result {
        let _ = self.stop.send(true);
        let ended = self.ended.take();
        let sink = self.sink.clone();
        Box::pin(async move {
            if let Some(ended) = ended {
                let _ = ended.await;
            }
            if let Err(e) = sink.close().await {
                tracing::debug!(error = %e, "closing the outbox connection failed");
            }
        })
    }
}
