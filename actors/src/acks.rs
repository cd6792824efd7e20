//! [`AckWindow`]: which deliveries of a consumer's channel are unsettled,
//! so that a batch can be acked with one `multiple` ack.
//!
//! An ack with `multiple` settles every unsettled delivery up to its tag, on
//! the broker's side, including any the runtime has not processed yet: it
//! is sent only when the batch's deliveries are exactly the unsettled ones
//! up to the highest. And the broker closes the channel on an ack of a tag
//! already settled, so every settlement takes the window's lock while it
//! hands lapin its frame: lapin sends frames in the order it is handed
//! them, so no ack can reach the broker after a `multiple` that covered it.
//!
//! After lapin recovers the channel, delivery tags start again at 1; the
//! first tag that does not grow starts a new generation and forgets the old
//! one, whose deliveries can no longer be settled anyway (their ackers
//! answer `Ok(false)`). A reconnect gives the consumer a new window, whose
//! tags start at 1 as well: generations are numbered across every window
//! of the process, so a delivery of a dead channel, settled late, can never
//! settle the live channel's delivery that has the same tag.

use std::collections::BTreeSet;
use std::future::Future;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};

use futures_util::FutureExt;
use inbox::lapin;
use inbox::lapin::message::Delivery;
use inbox::lapin::options::{BasicAckOptions, BasicNackOptions};

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
}

impl Default for State {
    fn default() -> Self {
        Self {
            generation: next_generation(),
            last_tag: 0,
            unsettled: BTreeSet::new(),
        }
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

    /// Acks one delivery.
    pub(crate) async fn ack(&self, delivery: &Delivery, ticket: Ticket) -> lapin::Result<bool> {
        let sent = {
            let mut state = self.lock();
            state.settle(delivery.delivery_tag, ticket);
            send_now(delivery.acker.ack(BasicAckOptions::default()))
        };
        sent.await
    }

    /// Nacks one delivery.
    pub(crate) async fn nack(
        &self,
        delivery: &Delivery,
        ticket: Ticket,
        options: BasicNackOptions,
    ) -> lapin::Result<bool> {
        let sent = {
            let mut state = self.lock();
            state.settle(delivery.delivery_tag, ticket);
            send_now(delivery.acker.nack(options))
        };
        sent.await
    }

    /// Acks every one of `deliveries`: with one ack with `multiple` when
    /// they are exactly the unsettled deliveries up to the highest of them,
    /// else one by one. One result per delivery, in order.
    pub(crate) async fn ack_all(&self, deliveries: &[(&Delivery, Ticket)]) -> Vec<lapin::Result<bool>> {
        let Some(&(last, _)) = deliveries.iter().max_by_key(|(d, _)| d.delivery_tag) else {
            return Vec::new();
        };
        let tags: Vec<(u64, Ticket)> = deliveries.iter().map(|(d, t)| (d.delivery_tag, *t)).collect();
        let (multiple, sent) = {
            let mut state = self.lock();
            let multiple = deliveries.len() > 1 && state.covers_exactly(&tags);
            for &(tag, ticket) in &tags {
                state.settle(tag, ticket);
            }
            let sent: Vec<_> = if multiple {
                vec![send_now(last.acker.ack(BasicAckOptions { multiple: true }))]
            } else {
                deliveries
                    .iter()
                    .map(|(delivery, _)| send_now(delivery.acker.ack(BasicAckOptions::default())))
                    .collect()
            };
            (multiple, sent)
        };
        let mut results = Vec::with_capacity(deliveries.len());
        for sent in sent {
            results.push(sent.await);
        }
        if multiple && let Some(one) = results.first().cloned() {
            // The one ack answers for all of them.
            results = vec![one; deliveries.len()];
        }
        results
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // The state stays consistent whatever panicked while holding it:
        // every change is a single set operation.
        self.state.lock().unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl State {
    fn track(&mut self, tag: u64) -> Ticket {
        if tag <= self.last_tag {
            // The channel was recovered: a new run of tags.
            self.generation = next_generation();
            self.unsettled.clear();
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

    /// Whether the unsettled deliveries up to the highest of `tags` are
    /// exactly `tags` (distinct), all of this generation.
    fn covers_exactly(&self, tags: &[(u64, Ticket)]) -> bool {
        let Some(last) = tags.iter().map(|(tag, _)| *tag).max() else {
            return false;
        };
        let all_current = tags
            .iter()
            .all(|(tag, t)| t.generation == self.generation && self.unsettled.contains(tag));
        all_current && self.unsettled.range(..=last).count() == tags.len()
    }
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

    #[test]
    fn a_batch_is_covered_only_when_nothing_below_it_is_unsettled() {
        let mut state = State::default();
        let tickets: Vec<(u64, Ticket)> = (1..=8).map(|tag| (tag, state.track(tag))).collect();
        // 5..=8 done first: 1..=4 are still unsettled below them.
        assert!(!state.covers_exactly(&tickets[4..]));
        // 1..=4 are exactly the unsettled ones up to 4.
        assert!(state.covers_exactly(&tickets[..4]));
        for (tag, ticket) in &tickets[..4] {
            state.settle(*tag, *ticket);
        }
        assert!(state.covers_exactly(&tickets[4..]));
        // Not a subset with a gap: 5 and 7 while 6 is unsettled.
        assert!(!state.covers_exactly(&[tickets[4], tickets[6]]));
    }

    #[test]
    fn a_recovered_channel_starts_a_new_generation() {
        let mut state = State::default();
        let old: Vec<(u64, Ticket)> = (1..=3).map(|tag| (tag, state.track(tag))).collect();
        // Recovery: tags start again at 1.
        let new: Vec<(u64, Ticket)> = (1..=2).map(|tag| (tag, state.track(tag))).collect();
        // The old ones can never be covered, and settling one of them must
        // not settle the new delivery with the same tag.
        assert!(!state.covers_exactly(&old));
        state.settle(old[0].0, old[0].1);
        assert!(state.unsettled.contains(&1));
        assert!(state.covers_exactly(&new));
    }

    #[test]
    fn a_dead_channels_deliveries_never_settle_the_next_channels() {
        // A reconnect: a new window for the new channel, tags from 1 again,
        // while deliveries of the old one are still buffered or in flight.
        let mut old = State::default();
        let stale: Vec<(u64, Ticket)> = (1..=6).map(|tag| (tag, old.track(tag))).collect();
        let mut live = State::default();
        let fresh: Vec<(u64, Ticket)> = (1..=6).map(|tag| (tag, live.track(tag))).collect();
        for (tag, ticket) in &stale[4..] {
            live.settle(*tag, *ticket);
        }
        assert_eq!(live.unsettled.len(), 6, "an old ticket erased a live tag");
        assert!(!live.covers_exactly(&stale[4..]));
        // Tags 5 and 6 of the live channel are unsettled: a `multiple` ack
        // of 7 and 8 would pass them.
        let later: Vec<(u64, Ticket)> = (7..=8).map(|tag| (tag, live.track(tag))).collect();
        for (tag, ticket) in &fresh[..4] {
            live.settle(*tag, *ticket);
        }
        assert!(!live.covers_exactly(&later));
    }
}
