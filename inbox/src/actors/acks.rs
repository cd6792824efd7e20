//! [`AckWindow`]: which deliveries of a consumer's channel are unsettled,
//! so that acks can go to the broker as one `multiple` ack.
//!
//! An ack with `multiple` settles every unsettled delivery up to its tag, on
//! the broker's side, including any the runtime has not processed yet: it
//! is sent only when the deliveries it covers are exactly the unsettled ones
//! up to its tag, all of them done. And the broker closes the channel on an
//! ack of a tag already settled, so every settlement takes the window's lock
//! while it hands lapin its frame: lapin sends frames in the order it is
//! handed them, so no ack can reach the broker after a `multiple` that
//! covered it.
//!
//! **Coalescing.** On a quorum queue every ack is a command the queue's
//! replicas log, and it costs the broker about as much as the delivery
//! itself: one `multiple` ack for eight deliveries halved RabbitMQ's CPU per
//! message in the benchmark's `raw` scenario. So a delivery that is done
//! while an earlier one is still in flight does not ack at once: it waits
//! (at most [`ACK_HOLD`]) for the earlier ones, and the one that completes
//! the run from the lowest unsettled tag acks them all with one frame. A
//! delivery still held after [`ACK_HOLD`] (one before it is slow, retrying
//! or held in an outage) acks alone. Only acks wait: its effects are already
//! committed, and a redelivery meanwhile would be skipped by the inbox.
//!
//! After lapin recovers the channel, delivery tags start again at 1; the
//! first tag that does not grow starts a new generation and forgets the old
//! one, whose deliveries can no longer be settled anyway (their ackers
//! answer `Ok(false)`, and so do those still waiting to be covered). A
//! reconnect gives the consumer a new window, whose tags start at 1 as
//! well: generations are numbered across every window of the process, so a
//! delivery of a dead channel, settled late, can never settle the live
//! channel's delivery that has the same tag.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::Duration;

use futures_util::FutureExt;
use lapin::Acker;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicNackOptions};
use tokio::sync::oneshot;

/// The longest a done delivery's ack waits for the deliveries before it to
/// be done too, so that one `multiple` ack settles them all. A few
/// milliseconds is what a message's transaction takes on a busy machine,
/// and a held ack keeps its prefetch slot that long.
pub(crate) const ACK_HOLD: Duration = Duration::from_millis(2);

/// The unsettled deliveries of one consumer channel.
#[derive(Debug, Default)]
pub(crate) struct AckWindow {
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    generation: u64,
    last_tag: u64,
    unsettled: BTreeSet<u64>,
    /// Done deliveries of this generation waiting for the ones before them,
    /// still unsettled: the next `multiple` ack that reaches them covers
    /// them.
    held: BTreeMap<u64, Held>,
}

/// A done delivery whose ack waits to be covered.
#[derive(Debug)]
struct Held {
    /// Its acker: a `multiple` ack goes out through the highest one covered.
    acker: Acker,
    /// Where the covering ack's result goes.
    covered: oneshot::Sender<lapin::Result<bool>>,
}

impl Default for State {
    fn default() -> Self {
        Self {
            generation: next_generation(),
            last_tag: 0,
            unsettled: BTreeSet::new(),
            held: BTreeMap::new(),
        }
    }
}

/// A held delivery's wait for the ack that covers it.
struct Covered {
    result: oneshot::Receiver<lapin::Result<bool>>,
    /// When it stops waiting and acks alone.
    deadline: tokio::time::Instant,
}

/// An ack handed to lapin, and the held deliveries it covered, which get
/// its result.
struct Sent<F> {
    answer: F,
    covered: Vec<oneshot::Sender<lapin::Result<bool>>>,
}

impl<F: Future<Output = lapin::Result<bool>>> Sent<F> {
    async fn answer(self) -> lapin::Result<bool> {
        let result = self.answer.await;
        for covered in self.covered {
            let _ = covered.send(result.clone());
        }
        result
    }
}

/// A generation no window of this process has had: the one counter of
/// every channel's runs of delivery tags.
fn next_generation() -> u64 {
    static GENERATIONS: AtomicU64 = AtomicU64::new(0);
    GENERATIONS.fetch_add(1, Ordering::Relaxed)
}

/// A delivery's place in the window: the generation it arrived in.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Ticket {
    generation: u64,
}

impl AckWindow {
    /// Records an arriving delivery as unsettled. Every delivery of the
    /// channel must pass here, handled or not.
    pub(crate) fn track(&self, delivery: &Delivery) -> Ticket {
        self.lock().track(delivery.delivery_tag)
    }

    /// Acks one delivery: now, with the done ones after it, if no delivery
    /// before it is unsettled; else once those are done, as part of their
    /// `multiple` ack, or alone after [`ACK_HOLD`].
    pub(crate) async fn ack(&self, delivery: &Delivery, ticket: Ticket) -> lapin::Result<bool> {
        let tag = delivery.delivery_tag;
        let now = {
            let mut state = self.lock();
            if state.behind_others(tag, ticket) {
                Err(state.hold(delivery))
            } else {
                state.settle(tag, ticket);
                // The done ones right after it, if any: one `multiple` ack
                // through the last of them covers this one too. (Of a
                // recovered channel, it goes alone, and lapin answers
                // `Ok(false)`.)
                let current = ticket.generation == state.generation;
                let run = if current { state.take_held_run() } else { None };
                let (acker, multiple, covered) = match run {
                    Some((last, covered)) => (last, true, covered),
                    None => (delivery.acker.clone(), false, Vec::new()),
                };
                Ok(Sent {
                    answer: send_ack(acker, multiple),
                    covered,
                })
            }
        };
        match now {
            Ok(sent) => sent.answer().await,
            Err(held) => self.wait_until_covered(delivery, ticket, held).await,
        }
    }

    /// A held delivery's ack: the covering ack's result, or its own after
    /// [`ACK_HOLD`].
    async fn wait_until_covered(
        &self,
        delivery: &Delivery,
        ticket: Ticket,
        mut covered: Covered,
    ) -> lapin::Result<bool> {
        if let Ok(result) = tokio::time::timeout_at(covered.deadline, &mut covered.result).await {
            return result.unwrap_or(Ok(false));
        }
        let alone = {
            let mut state = self.lock();
            let current = ticket.generation == state.generation;
            let held = if current {
                state.held.remove(&delivery.delivery_tag)
            } else {
                None
            };
            held.map(|_| {
                state.settle(delivery.delivery_tag, ticket);
                send_ack(delivery.acker.clone(), false)
            })
        };
        match alone {
            Some(answer) => answer.await,
            // Covered meanwhile: the covering ack's result is on its way.
            None => covered.result.await.unwrap_or(Ok(false)),
        }
    }

    /// Nacks one delivery.
    pub(crate) async fn nack(
        &self,
        delivery: &Delivery,
        ticket: Ticket,
        options: BasicNackOptions,
    ) -> lapin::Result<bool> {
        let (sent, released) = {
            let mut state = self.lock();
            state.settle(delivery.delivery_tag, ticket);
            let sent = send_now(delivery.acker.nack(options));
            (sent, state.release_held())
        };
        let result = sent.await;
        if let Some(released) = released {
            let _ = released.answer().await;
        }
        result
    }

    /// Acks every one of `deliveries` (a batch): those at the front of the
    /// window with one `multiple` ack, the others held as by
    /// [`ack`](Self::ack). One result per delivery, in order.
    pub(crate) async fn ack_all(&self, deliveries: &[(&Delivery, Ticket)]) -> Vec<lapin::Result<bool>> {
        enum Pending<F> {
            Sent(F),
            Held(Covered),
        }
        let (pending, released) = {
            let mut state = self.lock();
            let pending: Vec<_> = deliveries
                .iter()
                .map(|&(delivery, ticket)| {
                    if ticket.generation == state.generation
                        && state.unsettled.contains(&delivery.delivery_tag)
                    {
                        Pending::Held(state.hold(delivery))
                    } else {
                        // Of a recovered channel: lapin answers `Ok(false)`.
                        Pending::Sent(send_ack(delivery.acker.clone(), false))
                    }
                })
                .collect();
            (pending, state.release_held())
        };
        if let Some(released) = released {
            let _ = released.answer().await;
        }
        let mut results = Vec::with_capacity(deliveries.len());
        for (pending, &(delivery, ticket)) in pending.into_iter().zip(deliveries) {
            results.push(match pending {
                Pending::Sent(answer) => answer.await,
                Pending::Held(covered) => self.wait_until_covered(delivery, ticket, covered).await,
            });
        }
        results
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Nothing that can panic runs while it is held, and a panic
        // elsewhere leaves the state as consistent as it was.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl State {
    fn track(&mut self, tag: u64) -> Ticket {
        if tag <= self.last_tag {
            // The channel was recovered: a new run of tags. The held ones
            // learn that they were not acked (their senders are dropped).
            self.generation = next_generation();
            self.unsettled.clear();
            self.held.clear();
        }
        self.last_tag = tag;
        self.unsettled.insert(tag);
        Ticket {
            generation: self.generation,
        }
    }

    fn settle(&mut self, tag: u64, ticket: Ticket) {
        if ticket.generation == self.generation {
            self.unsettled.remove(&tag);
        }
    }

    /// Whether `tag`, of this generation, has an unsettled delivery before
    /// it: then its ack may wait to be covered by theirs.
    fn behind_others(&self, tag: u64, ticket: Ticket) -> bool {
        ticket.generation == self.generation && self.unsettled.first().is_some_and(|&lowest| lowest < tag)
    }

    /// Holds `delivery`, done, until an ack covers it.
    fn hold(&mut self, delivery: &Delivery) -> Covered {
        let (covered, result) = oneshot::channel();
        let held = Held {
            acker: delivery.acker.clone(),
            covered,
        };
        self.held.insert(delivery.delivery_tag, held);
        Covered {
            result,
            deadline: tokio::time::Instant::now() + ACK_HOLD,
        }
    }

    /// After a settlement, the run of held deliveries it left at the front,
    /// if any, settled: the acker of its last, for a `multiple` ack that
    /// covers them all, and where each one's result goes.
    fn take_held_run(&mut self) -> Option<(Acker, Vec<oneshot::Sender<lapin::Result<bool>>>)> {
        let mut covered = Vec::new();
        let mut last = None;
        while let Some(held) = self.unsettled.first().and_then(|next| self.held.remove(next)) {
            self.unsettled.pop_first();
            covered.push(held.covered);
            last = Some(held.acker);
        }
        Some((last?, covered))
    }

    /// [`take_held_run`](Self::take_held_run)'s ack, handed to lapin.
    fn release_held(&mut self) -> Option<Sent<impl Future<Output = lapin::Result<bool>> + use<>>> {
        self.take_held_run().map(|(last, covered)| Sent {
            answer: send_ack(last, true),
            covered,
        })
    }
}

/// Hands lapin an ack through `acker` now (see [`send_now`]).
fn send_ack(acker: Acker, multiple: bool) -> impl Future<Output = lapin::Result<bool>> {
    send_now(async move { acker.ack(BasicAckOptions { multiple }).await })
}

/// Polls `request` once, which hands lapin its frame now (lapin queues it
/// on the first poll, and sends frames in that order), and returns what is
/// left to wait for: the answer.
fn send_now<F: Future>(request: F) -> impl Future<Output = F::Output> {
    let mut request = Box::pin(request);
    let ready = (&mut request).now_or_never();
    async move {
        match ready {
            Some(output) => output,
            None => request.await,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn deliveries(window: &AckWindow, tags: std::ops::RangeInclusive<u64>) -> Vec<(Delivery, Ticket)> {
        tags.map(|tag| {
            // A mock's acker answers `Ok(true)` the first time it is used,
            // so `usable()` tells which ackers sent a frame.
            let delivery = Delivery::mock(tag, "".into(), "q".into(), false, Vec::new());
            let ticket = window.track(&delivery);
            (delivery, ticket)
        })
        .collect()
    }

    /// Which of `deliveries` sent a frame of their own.
    fn sent(deliveries: &[(Delivery, Ticket)]) -> Vec<u64> {
        deliveries
            .iter()
            .filter(|(d, _)| !d.acker.usable())
            .map(|(d, _)| d.delivery_tag)
            .collect()
    }

    #[tokio::test]
    async fn done_out_of_order_they_are_acked_with_one_multiple_ack() {
        let window = AckWindow::default();
        let d = deliveries(&window, 1..=4);
        let (three, two, one) = tokio::join!(
            window.ack(&d[2].0, d[2].1),
            window.ack(&d[1].0, d[1].1),
            window.ack(&d[0].0, d[0].1),
        );
        assert!(matches!((three, two, one), (Ok(true), Ok(true), Ok(true))));
        // One frame, through the highest: it covers 1 and 2, not 4.
        assert_eq!(sent(&d), vec![3]);
        assert_eq!(window.lock().unsettled, BTreeSet::from([4]));
        assert!(window.lock().held.is_empty());
    }

    #[tokio::test]
    async fn a_held_ack_goes_alone_when_the_one_before_it_takes_too_long() {
        let window = AckWindow::default();
        let d = deliveries(&window, 1..=2);
        let started = tokio::time::Instant::now();
        assert!(matches!(window.ack(&d[1].0, d[1].1).await, Ok(true)));
        assert!(started.elapsed() >= ACK_HOLD);
        assert_eq!(sent(&d), vec![2]);
        // 1, done later, acks alone: 2 is settled already.
        assert!(matches!(window.ack(&d[0].0, d[0].1).await, Ok(true)));
        assert_eq!(sent(&d), vec![1, 2]);
        assert!(window.lock().unsettled.is_empty());
    }

    #[tokio::test]
    async fn a_nack_releases_the_done_ones_after_it() {
        let window = AckWindow::default();
        let d = deliveries(&window, 1..=3);
        let requeue = BasicNackOptions::default();
        let (two, three, one) = tokio::join!(
            window.ack(&d[1].0, d[1].1),
            window.ack(&d[2].0, d[2].1),
            window.nack(&d[0].0, d[0].1, requeue),
        );
        assert!(matches!((two, three, one), (Ok(true), Ok(true), Ok(true))));
        // The nack of 1, then one ack through 3 for 2 and 3.
        assert_eq!(sent(&d), vec![1, 3]);
        assert!(window.lock().unsettled.is_empty());
    }

    #[tokio::test]
    async fn a_batch_behind_another_is_covered_by_the_others_ack() {
        let window = AckWindow::default();
        let d = deliveries(&window, 1..=8);
        let first: Vec<(&Delivery, Ticket)> = d[..4].iter().map(|(d, t)| (d, *t)).collect();
        let second: Vec<(&Delivery, Ticket)> = d[4..].iter().map(|(d, t)| (d, *t)).collect();
        let (later, earlier) = tokio::join!(window.ack_all(&second), window.ack_all(&first));
        assert!(later.iter().chain(&earlier).all(|r| matches!(r, Ok(true))));
        assert_eq!(sent(&d), vec![8]);
        assert!(window.lock().unsettled.is_empty());
    }

    #[tokio::test]
    async fn held_acks_of_a_recovered_channel_are_not_acked() {
        let window = AckWindow::default();
        let d = deliveries(&window, 1..=2);
        let held = window.ack(&d[1].0, d[1].1);
        let recover = async {
            // Recovery: tags start again at 1.
            tokio::task::yield_now().await;
            deliveries(&window, 1..=1)
        };
        let (held, fresh) = tokio::join!(held, recover);
        assert!(matches!(held, Ok(false)), "{held:?}");
        assert_eq!(sent(&d), Vec::<u64>::new());
        // The old 1, settled late, leaves the new 1 alone.
        assert!(matches!(window.ack(&d[0].0, d[0].1).await, Ok(true)));
        assert_eq!(window.lock().unsettled, BTreeSet::from([1]));
        assert!(matches!(window.ack(&fresh[0].0, fresh[0].1).await, Ok(true)));
        assert!(window.lock().unsettled.is_empty());
    }

    #[test]
    fn a_dead_channels_deliveries_never_settle_the_next_channels() {
        // A reconnect: a new window for the new channel, tags from 1 again,
        // while deliveries of the old one are still buffered or in flight.
        let mut old = State::default();
        let stale: Vec<(u64, Ticket)> = (1..=6).map(|tag| (tag, old.track(tag))).collect();
        let mut live = State::default();
        (1..=6).for_each(|tag| {
            live.track(tag);
        });
        for (tag, ticket) in &stale[4..] {
            live.settle(*tag, *ticket);
            assert!(
                !live.behind_others(*tag, *ticket),
                "a stale delivery waits on the live channel"
            );
        }
        assert_eq!(live.unsettled.len(), 6, "an old ticket erased a live tag");
    }
}
