//! [`FailureDrainer`]: moves what the consumed queues set aside into the
//! database, for an operator.
//!
//! With `failures.drain` on, consumes every consumed queue's error and
//! skipped queues (`Q.error`, `Q.skipped`; `Q_error`, `Q_skipped`) over a
//! connection of its own, and writes each copy into `inbox_failures`
//! ([`crate::failures`]), committed before the copy is acked: a crash in
//! between writes it again, into the same row, changing nothing. Every
//! instance runs one; they compete for the copies like any consumers. A
//! copy whose row cannot be written (the database away) is held, and tried
//! again after a pause; a lost broker connection is opened again after a
//! growing pause. Receives [`StopDraining`] at shutdown: the copy in hand
//! is written and acked, no other is taken. Sends nothing.

use std::sync::Arc;
use std::time::Duration;

use actix::prelude::*;
use futures_util::StreamExt;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::FieldTable;
use tokio::sync::watch;

use crate::Settings;
use crate::backoff::Backoff;
use crate::db::Connections;
use crate::error::{Error, Result};
use crate::failures::{Failure, Kind};

/// Copies in flight at once on the drainer's channel.
const PREFETCH: u16 = 32;
/// The first pause before reconnecting, or before writing a row again;
/// doubled up to [`MAX_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(200);
const MAX_PAUSE: Duration = Duration::from_secs(30);

/// Stop draining once the copy in hand is written and acked (shutdown).
#[derive(Message)]
#[rtype(result = "()")]
pub(crate) struct StopDraining;

/// Drains the error and skipped queues of every consumed queue.
pub(crate) struct FailureDrainer {
    settings: Arc<Settings>,
    connections: Connections,
    /// Set to `true` to stop; the drain loop watches it.
    stop: watch::Sender<bool>,
    /// Resolves when the drain loop has ended.
    ended: Option<tokio::sync::oneshot::Receiver<()>>,
}

impl FailureDrainer {
    pub(crate) fn new(settings: Arc<Settings>, connections: Connections) -> Self {
        Self {
            settings,
            connections,
            stop: watch::channel(false).0,
            ended: None,
        }
    }
}

impl Actor for FailureDrainer {
    type Context = Context<Self>;

    fn started(&mut self, _ctx: &mut Context<Self>) {
        let (done, ended) = tokio::sync::oneshot::channel();
        self.ended = Some(ended);
        let (settings, connections) = (Arc::clone(&self.settings), self.connections.clone());
        let stop = self.stop.subscribe();
        actix_rt::spawn(async move {
            draining(&settings, &connections, stop).await;
            let _ = done.send(());
        });
    }
}

impl Supervised for FailureDrainer {}

impl actix::Handler<StopDraining> for FailureDrainer {
    type Result = ResponseFuture<()>;

    fn handle(&mut self, _: StopDraining, _ctx: &mut Context<Self>) -> Self::Result {
        let _ = self.stop.send(true);
        let ended = self.ended.take();
        Box::pin(async move {
            if let Some(ended) = ended {
                let _ = ended.await;
            }
        })
    }
}

/// One set-aside queue: the queue it belongs to, which kind, its name.
#[derive(Clone)]
struct Source {
    queue: Arc<str>,
    kind: Kind,
    set_aside_in: Arc<str>,
}

/// Drains until told to stop, reconnecting after a growing pause.
async fn draining(settings: &Settings, connections: &Connections, mut stop: watch::Receiver<bool>) {
    let wire = settings.message_bus.wire;
    let sources: Vec<Source> = settings
        .queues
        .iter()
        .flat_map(|queue| {
            let name: Arc<str> = queue.name.as_str().into();
            [
                (Kind::Error, wire.error_queue(&queue.name)),
                (Kind::Skipped, wire.skipped_queue(&queue.name)),
            ]
            .map(|(kind, set_aside_in)| Source {
                queue: Arc::clone(&name),
                kind,
                set_aside_in: set_aside_in.into(),
            })
        })
        .collect();
    let mut backoff = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
    loop {
        match drain(settings, connections, &sources, &mut stop, &mut backoff).await {
            Ok(()) => return,
            Err(e) => {
                let pause = backoff.next_pause();
                tracing::warn!(error = %e, "draining the error and skipped queues failed; trying again in {pause:?}");
                tokio::select! {
                    _ = stop.wait_for(|stop| *stop) => return,
                    () = tokio::time::sleep(pause) => {}
                }
            }
        }
    }
}

/// Consumes `sources` on one connection until stopped (`Ok`) or the link
/// fails (`Err`).
async fn drain(
    settings: &Settings,
    connections: &Connections,
    sources: &[Source],
    stop: &mut watch::Receiver<bool>,
    backoff: &mut Backoff,
) -> Result<()> {
    let connection = crate::amqp::connect(settings, "inbox failures").await?;
    let channel = connection.create_channel().await.map_err(Error::client)?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions { global: false })
        .await
        .map_err(Error::client)?;
    let mut streams = Vec::with_capacity(sources.len());
    for source in sources {
        let consumer = channel
            .basic_consume(
                source.set_aside_in.as_ref().into(),
                "".into(),
                BasicConsumeOptions::default(),
                FieldTable::default(),
            )
            .await
            .map_err(|e| Error::topology(source.set_aside_in.to_string(), crate::error::describe(&e)))?;
        let source = source.clone();
        streams.push(consumer.map(move |delivery| (source.clone(), delivery)));
    }
    tracing::info!(
        queues = sources.len(),
        "draining the error and skipped queues into inbox_failures"
    );
    let mut copies = futures_util::stream::select_all(streams);
    let wire = settings.message_bus.wire;
    loop {
        let next = tokio::select! {
            biased;
            _ = stop.wait_for(|stop| *stop) => {
                let _ = connection.close(200, "stopping".into()).await;
                return Ok(());
            }
            next = copies.next() => next,
        };
        let Some((source, delivery)) = next else {
            return Err(Error::new(
                crate::ErrorKind::Unreachable,
                "the broker closed the drainer's consumers",
            ));
        };
        let delivery = delivery.map_err(Error::client)?;
        let mut failure = Failure::of(
            &source.queue,
            source.kind,
            &source.set_aside_in,
            wire,
            &delivery.properties,
            &delivery.data,
        );
        // Written before the ack, however long the database takes: the
        // copy stays unacked (in the queue) meanwhile. A row the database
        // refuses for what it holds (not for being away) is written bare,
        // once: one copy must not hold up the others.
        let mut pause = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
        let mut stripped = false;
        let failed_again = loop {
            let e = match crate::failures::record(connections, &failure).await {
                Ok(failed_again) => break failed_again,
                Err(e) => e,
            };
            if !stripped && !e.is_unavailable() {
                stripped = true;
                failure = failure.bare(&e);
                continue;
            }
            let wait = pause.next_pause();
            tracing::warn!(
                error = %e,
                queue = %source.set_aside_in,
                message = %failure.message_key,
                "cannot write the failure's row; trying again in {wait:?}"
            );
            tokio::select! {
                _ = stop.wait_for(|stop| *stop) => {
                    let _ = connection.close(200, "stopping".into()).await;
                    return Ok(());
                }
                () = tokio::time::sleep(wait) => {}
            }
        };
        delivery
            .acker
            .ack(BasicAckOptions::default())
            .await
            .map_err(Error::client)?;
        crate::actors::metrics::failure_ingested(&source.queue, source.kind);
        if failed_again {
            crate::actors::metrics::failure_failed_again(&source.queue);
        }
        *backoff = Backoff::new(FIRST_PAUSE, MAX_PAUSE);
    }
}
